// @ts-check
/** @type {import('@stryker-mutator/api/core').PartialStrykerOptions} */
export default {
  testRunner: "vitest",
  vitest: { configFile: "vitest.machines.config.ts" },
  // No type checker: a mutant that breaks a table's types is run (and caught by the tests) rather
  // than compiled apart, which on two cores costs more than the run.
  checkers: [],
  // No mutants inside logger calls (scripts/mutation/log-ignorer.mjs): log texts and fields.
  appendPlugins: ["./scripts/mutation/log-ignorer.mjs"],
  ignorers: ["log-calls"],
  tsconfigFile: "tsconfig.json",
  // The state tables and their one writer (issue 34); `-m FILE` runs others (the sides'
  // interpreters, planner.ts, ...).
  mutate: [
    "src/sidecar/decode-machine.ts",
    "src/sidecar/prefill-machine.ts",
    "src/sidecar/sidecar-lifecycle.ts",
    "src/sidecar/lifecycle.ts",
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
