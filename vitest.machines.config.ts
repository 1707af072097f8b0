// The vitest config `npm run mutation` runs (stryker.config.mjs): the tests of the state tables
// (issue 34) and of the sides that run them, in process. A table is built when its module loads,
// so Stryker runs every test for each of its mutants: only these, not the whole in-process set
// of vitest.mutation.config.ts (which scripts/mutation/planted.mjs still runs).
import { defineConfig } from "vitest/config";

export default defineConfig({
  test: {
    include: [
      "test/sidecar/machines.test.ts",
      "test/sidecar/lifecycle.test.ts",
      "test/sidecar/decode-side.test.ts",
      "test/sidecar/prefill-side.test.ts",
      "test/sidecar/orderings.test.ts",
      "test/sidecar/drain.test.ts",
    ],
    setupFiles: ["scripts/mutation/vitest-setup.mjs"],
    testTimeout: 60_000,
    hookTimeout: 60_000,
  },
});
