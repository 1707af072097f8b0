// Loaded with `node --import` (NODE_OPTIONS, so Stryker's child processes get it too) by
// `npm run mutation`. StrykerJS 9 calls TypeScript's JavaScript compiler API (its TypeScript
// checker, and the tsconfig rewriting in its sandbox), which TypeScript 7, the project's compiler,
// no longer ships. This sends `typescript` imported from Stryker's own packages to TypeScript 6
// (scripts/mutation/node_modules, installed through the "kvxfer-mutation-typescript" dev
// dependency); every other import of `typescript`, and `tsc`, stay on TypeScript 7.
import { register } from "node:module";

register("./typescript-resolve.mjs", import.meta.url);
