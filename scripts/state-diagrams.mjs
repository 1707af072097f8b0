#!/usr/bin/env node
// Writes docs/protocol.md's state diagrams from the tables the sides run
// (test/sidecar/state-diagrams.ts renders them; its test fails when the docs differ).
//
//   node scripts/state-diagrams.mjs
import { spawnSync } from "node:child_process";
import { resolve } from "node:path";

const ROOT = resolve(new URL("..", import.meta.url).pathname);
const r = spawnSync(
  resolve(ROOT, "node_modules/.bin/vitest"),
  ["run", "test/sidecar/state-diagrams.test.ts"],
  { cwd: ROOT, stdio: "inherit", env: { ...process.env, KVXFER_WRITE_DIAGRAMS: "1" } },
);
process.exit(r.status ?? 1);
