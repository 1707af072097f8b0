// `kvxfer bench plot` on a temporary results directory (KVXFER_BENCH_RESULTS): each results file
// it cannot use is named with why, on stderr, and it exits 1 when it drew nothing; a good
// native.json is drawn and the missing ones are still named. No benchmark runs here.
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterEach, beforeEach, describe, expect, it } from "vitest";

import { cliScript } from "../../src/sim/sidecar-process.js";

interface Run {
  status: number | null;
  stdout: string;
  stderr: string;
}

/** `kvxfer bench plot` as a child process with its results in `dir`; killed past 20 s. */
function plot(dir: string): Promise<Run> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [cliScript(), "bench", "plot"], {
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, KVXFER_BENCH_RESULTS: dir },
    });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (b: Buffer) => (stdout += b.toString()));
    child.stderr.on("data", (b: Buffer) => (stderr += b.toString()));
    const timer = setTimeout(() => child.kill("SIGKILL"), 20_000);
    child.on("error", reject);
    child.on("close", (status) => {
      clearTimeout(timer);
      resolve({ status, stdout, stderr });
    });
  });
}

const lines = (s: string): string[] => s.split("\n").filter((l) => l.trim() !== "");

const nativeRow = (size: number, gbps: number): Record<string, unknown> => ({
  memory: "ucx",
  size,
  iters: 10,
  kvxferWriteGBps: gbps,
  perftestPutGBps: gbps,
  writeRatio: 1,
  kvxferWriteMsgRate: 1,
  perftestPutMsgRate: 1,
  writeRateRatio: 1,
  kvxferReadGBps: gbps / 2,
  perftestGetGBps: gbps / 2,
  readRatio: 1,
  kvxferReadMsgRate: 1,
  perftestGetMsgRate: 1,
  readRateRatio: 1,
});

let dir: string;
beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), "kvxfer-plot-"));
});
afterEach(() => rmSync(dir, { recursive: true, force: true }));

describe("kvxfer bench plot", () => {
  it("names a garbled file, one of another shape and a missing one; exit 1 when nothing is drawn", async () => {
    writeFileSync(join(dir, "native.json"), '{"bench": "native", "rows": [');
    writeFileSync(join(dir, "modes.json"), "{}");
    const r = await plot(dir);
    expect(r.status).toBe(1);
    expect(r.stdout).toBe("");
    expect(lines(r.stderr)).toEqual([
      expect.stringMatching(
        new RegExp(`^kvxfer bench plot: ${join(dir, "native.json")}: cannot read it: .+`),
      ),
      `kvxfer bench plot: ${join(dir, "modes.json")}: not a \`kvxfer bench modes\` result (no 'cells' list); run it again`,
      `kvxfer bench plot: ${join(dir, "peers.json")}: not there: run \`kvxfer bench peers\` first`,
      "kvxfer bench plot: no plot drawn",
    ]);
    expect(r.stderr).not.toMatch(/\n\s+at /);
  }, 30_000);

  it("draws from a good native.json (exit 0) and still names the files it did not have", async () => {
    writeFileSync(
      join(dir, "native.json"),
      JSON.stringify({
        bench: "native",
        transports: "shm,self",
        rows: [nativeRow(4096, 1), nativeRow(65536, 5), nativeRow(1 << 20, 10)],
      }),
    );
    const r = await plot(dir);
    expect(r.status).toBe(0);
    const svg = join(dir, "native-bandwidth.svg");
    expect(lines(r.stdout)).toEqual([svg]);
    expect(existsSync(svg)).toBe(true);
    expect(lines(r.stderr)).toEqual([
      expect.stringContaining(`${join(dir, "modes.json")}: not there`),
      expect.stringContaining(`${join(dir, "peers.json")}: not there`),
    ]);
  }, 30_000);
});
