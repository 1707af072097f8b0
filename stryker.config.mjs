// @ts-check
/** @type {import('@stryker-mutator/api/core').PartialStrykerOptions} */
export default {
  testRunner: "vitest",
  vitest: { configFile: "vitest.mutation.config.ts" },
  checkers: ["typescript"],
  // No mutants inside logger calls (scripts/mutation/log-ignorer.mjs): log texts and fields.
  appendPlugins: ["./scripts/mutation/log-ignorer.mjs"],
  ignorers: ["log-calls"],
  tsconfigFile: "tsconfig.json",
  mutate: [
    "src/sidecar/lifecycle.ts",
    "src/sidecar/prefill.ts",
    "src/sidecar/decode.ts",
    "src/sidecar/peers.ts",
    "src/sidecar/side-table.ts",
    "src/sidecar/claims.ts",
    "src/plan/planner.ts",
    "src/plan/ranks.ts",
    "src/engine/validate.ts",
  ],
  coverageAnalysis: "perTest",
  concurrency: 2,
  reporters: ["progress", "clear-text", "html", "json"],
  htmlReporter: { fileName: "reports/mutation/index.html" },
  jsonReporter: { fileName: "reports/mutation/mutation.json" },
  tempDirName: ".stryker-tmp",
  // Off by default (helper files such as test/sidecar/fakes.ts are not tracked by it, so a
  // change there could leave stale results); `npm run mutation -- --incremental` reuses the
  // results of the last run for unchanged code and tests.
  incrementalFile: "reports/mutation/stryker-incremental.json",
  // The sandbox needs src/, test/, the configs and package.json; not the native build, the
  // Python connector or its virtualenv (a symlink in some work trees, which Stryker cannot copy).
  ignorePatterns: ["/.venv", "/build", "/dist", "/native", "/connectors", "/docs", "/reports"],
};
