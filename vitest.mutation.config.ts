// The vitest config StrykerJS runs (`npm run mutation`, stryker.config.mjs): only the fast
// in-process tests that drive the mutated modules. None spawns a process or loads the native
// addon; test/engine/link.test.ts uses ZeroMQ over ipc in its own temp dir and tcp port 0, so two
// Stryker workers never clash. `npx vitest run` and `npm test` keep vitest.config.ts.
import { defineConfig } from "vitest/config";

export default defineConfig({
  test: {
    include: [
      "test/sidecar/lifecycle.test.ts",
      "test/sidecar/machines.test.ts",
      "test/sidecar/prefill-side.test.ts",
      "test/sidecar/decode-side.test.ts",
      "test/sidecar/orderings.test.ts",
      "test/sidecar/peer-table.test.ts",
      "test/sidecar/peer-dial.test.ts",
      "test/sidecar/claims.test.ts",
      "test/sidecar/refusals.test.ts",
      "test/plan/*.test.ts",
      "test/engine/link.test.ts",
    ],
    // Stryker runs the tests in a worker thread: see the file.
    setupFiles: ["scripts/mutation/vitest-setup.mjs"],
    testTimeout: 60_000,
    hookTimeout: 60_000,
  },
});
