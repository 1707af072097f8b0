// kvxfer-sim, the simulated engine and the demo: the entry that `kvxfer sim-engine` and
// `kvxfer demo` load (src/cli/optional.ts). Its TypeScript is compiled with the product's into
// the checkout's dist/ (dist/sim/ beside dist/src/, by `npm run build`), so the simulator and
// the CLI that loads it share one copy of the product's modules.
export { commands } from "../dist/sim/commands.js";
