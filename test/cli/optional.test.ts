/**
 * The product without its harness: the built CLI in a tree of its own, with the product's
 * node_modules, kvxfer-sim installed but not built and kvxfer-bench not installed at all. Its
 * own commands run; the optional ones fail in one line that names the package and what to do
 * (src/cli/optional.ts).
 */
import { cpSync, mkdirSync, mkdtempSync, readdirSync, rmSync, symlinkSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { cliScript } from "../../sim/sidecar-process.js";
import { runNode, type NodeRun } from "../run-node.js";

const ROOT = fileURLToPath(new URL("../..", import.meta.url));
const HARNESS = ["kvxfer-sim", "kvxfer-bench"];

let dir = "";

function run(args: string[]): Promise<NodeRun> {
  return runNode([join(dir, "dist", "src", "cli", "main.js"), ...args]);
}

beforeAll(() => {
  cliScript(); // the build is there (or this says to run it)
  dir = mkdtempSync(join(tmpdir(), "kvxfer-product-"));
  mkdirSync(join(dir, "dist"));
  cpSync(join(ROOT, "dist", "src"), join(dir, "dist", "src"), { recursive: true });
  cpSync(join(ROOT, "package.json"), join(dir, "package.json"));
  for (const d of ["build", "native"]) symlinkSync(join(ROOT, d), join(dir, d));
  mkdirSync(join(dir, "node_modules"));
  for (const name of readdirSync(join(ROOT, "node_modules")))
    if (!HARNESS.includes(name))
      symlinkSync(join(ROOT, "node_modules", name), join(dir, "node_modules", name));
  // kvxfer-sim as `npm ci` installs it, before any build: its entry, no dist/sim/.
  mkdirSync(join(dir, "sim"));
  for (const f of ["package.json", "index.js"]) cpSync(join(ROOT, "sim", f), join(dir, "sim", f));
  symlinkSync(join("..", "sim"), join(dir, "node_modules", "kvxfer-sim"));
});

afterAll(() => {
  if (dir !== "") rmSync(dir, { recursive: true, force: true });
});

describe("the product without a built kvxfer-sim or an installed kvxfer-bench", () => {
  it("runs its own commands", async () => {
    const r = await run(["sidecar", "--help"]);
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toContain("usage: kvxfer sidecar");
  });

  for (const args of [["demo"], ["sim-engine", "--engine-id", "e", "--role", "prefill"]]) {
    it(`refuses 'kvxfer ${args.join(" ")}' in one line: kvxfer-sim is not built`, async () => {
      const r = await run(args);
      expect(r.status).toBe(1);
      expect(r.stdout).toBe("");
      const lines = r.stderr.trimEnd().split("\n");
      expect(lines).toHaveLength(1);
      expect(lines[0]).toMatch(
        new RegExp(
          `^kvxfer: ${args[0]} is in the package kvxfer-sim \\(the simulated engine and the demo\\), ` +
            `which did not load \\(run 'npm run build' in a checkout\\): Cannot find module '.*/dist/sim/commands\\.js'`,
        ),
      );
    });
  }

  for (const args of [["bench", "e2e", "--quick"], ["native-demo"]]) {
    it(`refuses 'kvxfer ${args.join(" ")}' in one line: kvxfer-bench is not installed`, async () => {
      const r = await run(args);
      expect(r.status).toBe(1);
      expect(r.stdout).toBe("");
      expect(r.stderr.trimEnd().split("\n")).toEqual([
        `kvxfer: ${args[0]} is in the package kvxfer-bench (the benchmarks and the native demo), ` +
          "which is not installed: in a checkout, 'npm ci' installs it from bench/ and 'npm run build' builds it",
      ]);
    });
  }

  it("--help lists the optional commands with the package each needs", async () => {
    const r = await run(["--help"]);
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toMatch(
      /kvxfer demo\n\s+not available: needs the package kvxfer-sim \(the simulated engine and the demo\); kvxfer demo says why/,
    );
    expect(r.stdout).toMatch(
      /kvxfer bench\n\s+not available: needs the package kvxfer-bench \(the benchmarks and the native demo\); kvxfer bench says why/,
    );
  });
});
