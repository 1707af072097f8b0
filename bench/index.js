// The package's entry. Its TypeScript is compiled with the product's into the checkout's dist/
// (dist/bench/ beside dist/src/, by `npm run build`), so the benchmarks and the CLI that loads it
// share one copy of the product's modules.
export { commands } from "../dist/bench/commands.js";
