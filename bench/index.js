// kvxfer-bench, the benchmarks, their plots and harnesses, and the native demo: the entry that
// `kvxfer bench` and `kvxfer native-demo` load (src/cli/optional.ts). Its TypeScript is compiled
// with the product's into the checkout's dist/ (dist/bench/ beside dist/src/, by `npm run
// build`), so the benchmarks and the CLI that loads them share one copy of the product's modules.
export { commands } from "../dist/bench/commands.js";
