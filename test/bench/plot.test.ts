// `kvxfer bench plot` on a temporary results directory (KVXFER_BENCH_RESULTS): each results file
// it cannot use is named with why, on stderr, and it exits 1 when it drew nothing; a good
// native.json or e2e.json is drawn, as SVG and PNG, and the missing ones are still named. No
// benchmark runs here.
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterEach, beforeEach, describe, expect, it } from "vitest";

import { cliScript } from "../../sim/sidecar-process.js";
import { runNode, type NodeRun } from "../run-node.js";

/** `kvxfer bench plot` as a child process with its results in `dir`; killed past 20 s. */
function plot(dir: string): Promise<NodeRun> {
  return runNode([cliScript(), "bench", "plot"], { ...process.env, KVXFER_BENCH_RESULTS: dir });
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
      `kvxfer bench plot: ${join(dir, "e2e.json")}: not there: run \`kvxfer bench e2e\` first`,
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
    const png = join(dir, "native-bandwidth.png");
    expect(lines(r.stdout)).toEqual([svg, png]);
    expect(existsSync(svg)).toBe(true);
    expectPng(png, svg);
    expect(lines(r.stderr)).toEqual([
      expect.stringContaining(`${join(dir, "e2e.json")}: not there`),
      expect.stringContaining(`${join(dir, "modes.json")}: not there`),
      expect.stringContaining(`${join(dir, "peers.json")}: not there`),
    ]);
  }, 30_000);

  it("draws the e2e plot (sidecar vs native p50 by size, push and pull) as SVG and PNG", async () => {
    const st = (p50: number): Record<string, number> => ({
      p50,
      p99: p50,
      mean: p50,
      min: p50,
      max: p50,
      n: 3,
    });
    const row = (mode: string, tokens: number, sidecar: number, native: number): unknown => ({
      mode,
      tokens,
      failed: 0,
      failures: [],
      bytes: tokens * 16384,
      descriptors: 64,
      sidecarMs: st(sidecar),
      sidecarOwnMs: st(sidecar),
      dataMs: st(native),
      nativeMs: st(native),
      ratio: sidecar / native,
      ratioP99: sidecar / native,
      sidecarGBps: 1,
      nativeGBps: 2,
    });
    writeFileSync(
      join(dir, "e2e.json"),
      JSON.stringify({
        bench: "e2e",
        machine: "2026-11-23, 2 cores (test), 1 GiB",
        ucx: "1.13.1",
        shape: "llama3-8b shape with 4 layers (test); 3 measured requests",
        rows: [
          row("push", 128, 7, 0.7),
          row("push", 2048, 15, 8),
          row("pull", 128, 18, 0.5),
          row("pull", 2048, 26, 7.5),
        ],
      }),
    );
    const r = await plot(dir);
    expect(r.status).toBe(0);
    const svg = join(dir, "e2e-latency.svg");
    const png = join(dir, "e2e-latency.png");
    expect(lines(r.stdout)).toEqual([svg, png]);
    const text = readFileSync(svg, "utf8");
    for (const name of [
      "push: sidecars",
      "push: native alone (ref)",
      "pull: sidecars",
      "pull: native alone (ref)",
    ])
      expect(text).toContain(name);
    expectPng(png, svg);
  }, 30_000);
});

/** `png` is a PNG twice the size of the SVG `svg` (its width and height attributes). */
function expectPng(png: string, svg: string): void {
  const b = readFileSync(png);
  expect(b.subarray(0, 8)).toEqual(Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]));
  const m = /<svg [^>]*width="(\d+)" height="(\d+)"/.exec(readFileSync(svg, "utf8"));
  expect(m).not.toBeNull();
  // IHDR: width and height, big-endian, at bytes 16 and 20.
  expect([b.readUInt32BE(16), b.readUInt32BE(20)]).toEqual([2 * Number(m![1]), 2 * Number(m![2])]);
}
