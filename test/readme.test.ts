// The README's code runs as written: the walkthrough (two sidecars, two simulated engines,
// `watch` and `status`, in bash) and the native API example (as `example.mjs` in the clone).
// Each block is taken from README.md by its fence label, so the README cannot drift from what
// works. `npm run build` first.
import { spawn } from "node:child_process";
import { existsSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { describe, expect, it } from "vitest";

const ROOT = join(import.meta.dirname, "..");
const README = readFileSync(join(ROOT, "README.md"), "utf8");

/** The code block whose fence reads "```<label>". */
function block(label: string): string {
  const m = new RegExp("^```" + label + "\\n([\\s\\S]*?)^```", "m").exec(README);
  if (m === null) throw new Error(`README.md has no block \`\`\`${label}`);
  return m[1]!;
}

/** Runs a command in its own process group; kills the whole group after `timeoutMs`. */
function run(
  cmd: string,
  args: string[],
  timeoutMs: number,
): Promise<{ code: number | null; out: string }> {
  return new Promise((resolve) => {
    const child = spawn(cmd, args, {
      cwd: ROOT,
      detached: true,
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    child.stdout.on("data", (d: Buffer) => (out += d.toString()));
    child.stderr.on("data", (d: Buffer) => (out += d.toString()));
    const timer = setTimeout(() => {
      try {
        process.kill(-child.pid!, "SIGKILL");
      } catch {
        // gone
      }
    }, timeoutMs);
    child.on("exit", (code) => {
      clearTimeout(timer);
      // Whatever the block left running in its group goes too.
      try {
        process.kill(-child.pid!, "SIGKILL");
      } catch {
        // nothing left
      }
      resolve({ code, out });
    });
  });
}

describe("README", () => {
  it("the walkthrough moves one transfer, verified, and status and watch show it", async () => {
    const script = join(ROOT, `.readme-walkthrough-${process.pid}.sh`);
    // No job control (set -m): every process of the block stays in its process group, which
    // run() kills whatever happens.
    writeFileSync(script, block("sh walkthrough"));
    try {
      const { code, out } = await run("bash", [script], 60_000);
      expect(out).toMatch(/"event":"verified","transferId":"t1","ok":true/);
      expect(out).toMatch(/KV_READY\s+t1\s+decode\s+peer=walk-p\s+push\s+800 KiB/);
      expect(out).toMatch(/prefill:RELEASED\s+1/);
      expect(code, out).toBe(0);
    } finally {
      rmSync(script, { force: true });
      for (const f of [
        "/tmp/walk-p.log",
        "/tmp/walk-d.log",
        "/tmp/walk-p.json",
        "/tmp/walk-pe.json",
        "/tmp/walk-d.json",
      ])
        rmSync(f, { force: true });
      for (const id of ["walk-p", "walk-d"]) {
        const sock = `/tmp/kvxfer-${id}.sock`;
        for (const f of [sock, `${sock}.lock`]) if (existsSync(f)) rmSync(f, { force: true });
      }
    }
  }, 90_000);

  it("the native API example runs as example.mjs and prints what it says", async () => {
    const file = join(ROOT, `.readme-example-${process.pid}.mjs`);
    writeFileSync(file, block("js example.mjs"));
    try {
      const { code, out } = await run(process.execPath, [file], 30_000);
      expect(out.trim()).toBe("prefill-rank0: done; bytes 0 and 4096 of the file: 7, 7");
      expect(code).toBe(0);
      expect(existsSync("/dev/shm/kvxfer-example-rank0")).toBe(false);
    } finally {
      rmSync(file, { force: true });
      rmSync("/dev/shm/kvxfer-example-rank0", { force: true });
    }
  }, 60_000);
});
