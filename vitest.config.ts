import { defineConfig } from "vitest/config";

export default defineConfig({
  test: {
    // The native addon owns threads and UCX state: each test file gets its own process.
    pool: "forks",
    include: ["test/**/*.test.ts"],
    testTimeout: 60_000,
    hookTimeout: 60_000,
    // Two cores: running files in parallel only makes timing-sensitive tests flaky.
    fileParallelism: false,
  },
});
