// The demo's summary says what happened: transfers sent (not requested) after Ctrl-C, what
// prefix caching saved, settings the demo changed, binary units. Pure formatting: no processes.
import { describe, expect, it } from "vitest";

import { formatDemoSummary, parseDemoArgs } from "../../sim/demo-command.js";
import type { DemoSummary } from "../../sim/demo-types.js";

const base: DemoSummary = {
  verified: true,
  transfers: 24,
  requested: 24,
  interrupted: false,
  cut: 0,
  failed: 0,
  mismatches: 0,
  bytes: 100 * 2 ** 20,
  prefixTokens: 0,
  prefixBytes: 0,
  checkedBytes: 100 * 2 ** 20,
  mode: "auto",
  byMode: { push: 24 },
  dispatch: "concurrent",
  kvMemory: "segment",
  elapsedMs: 2000,
  gbps: 0.05,
  readyLatencyMs: { p50: 10, p99: 20, max: 30 },
  leakedBlocks: 0,
  failures: [],
  sidecars: [],
};

describe("demo summary", () => {
  it("uses binary units", () => {
    const text = formatDemoSummary(base);
    expect(text).toContain(
      "wall clock: 100.0 MiB moved in 2.00 s (0.05 GiB/s, simulated compute and checking included)",
    );
    expect(text).toContain("verified: every byte of every transfer checked on D (100.0 MiB)");
    expect(text).not.toMatch(/\bMB\b|\bGB\//);
    expect(text).not.toContain("prefix caching");
  });

  it("leads with what kvxfer did, and says apart what the simulation cost", () => {
    const text = formatDemoSummary({
      ...base,
      dataPhase: { transfers: 24, bytes: 100 * 2 ** 20, p50Ms: 1.234, gbps: 3.5 },
      simulation: { computeMsP50: 20, checkMsP50: 41.25 },
    });
    const lines = text.split("\n").filter((l) => l !== "");
    const at = (prefix: string): number => lines.findIndex((l) => l.startsWith(prefix));
    expect(lines[at("kvxfer: ")]).toBe(
      "kvxfer: KV ready after prefill p50 10 ms, p99 20 ms (P's engine done -> the router heard KV_READY)",
    );
    expect(lines[at("kvxfer data phase: ")]).toBe(
      "kvxfer data phase: p50 1.23 ms per transfer, 3.50 GB/s (100.0 MiB over 24 transfers: first write or read handed to UCX -> last flushed)",
    );
    expect(lines[at("the simulation")]).toBe(
      "the simulation around it (not kvxfer): prefill compute p50 20 ms per request, D's check of every byte p50 41.3 ms per transfer",
    );
    // kvxfer's own figures come before the simulation's and the wall clock's.
    expect(at("kvxfer: ")).toBeLessThan(at("the simulation"));
    expect(at("kvxfer data phase: ")).toBeLessThan(at("wall clock: "));
    // Without traces (sidecars out of the router's reach) there is no data-phase line.
    expect(formatDemoSummary(base)).not.toContain("data phase");
  });

  it("after Ctrl-C counts what was sent, and the cut ones apart from failures", () => {
    const text = formatDemoSummary({
      ...base,
      verified: false,
      interrupted: true,
      transfers: 17,
      requested: 500,
      cut: 2,
      byMode: { push: 15 },
    });
    expect(text).toContain(
      "interrupted: stopped after 17 of 500 transfers; 2 in flight were cut (not counted as failed)",
    );
    expect(text).toContain("transfers: 17 sent of 500 requested");
    expect(text).toContain("failed: 0");
    expect(text).toMatch(/NOT verified: interrupted/);
  });

  it("says what prefix caching saved when less moved than was verified", () => {
    const text = formatDemoSummary({
      ...base,
      bytes: 80 * 2 ** 20,
      prefixTokens: 2400,
      prefixBytes: 20 * 2 ** 20,
    });
    expect(text).toContain(
      "prefix caching: 2400 tokens were already on D and did not move (20.0 MiB saved)",
    );
  });

  it("says when it changed a setting (--mode pull: sequential dispatch)", () => {
    const pull = parseDemoArgs(["--mode", "pull"]);
    expect(pull.options.dispatch).toBe("sequential");
    expect(pull.notes).toHaveLength(1);
    expect(pull.notes[0]).toMatch(/--mode pull: dispatch set to sequential/);
    expect(parseDemoArgs(["--mode", "pull", "--dispatch", "sequential"]).notes).toEqual([]);
    expect(parseDemoArgs(["--mode", "push"]).notes).toEqual([]);
  });

  it("puts the KV in segments the sidecars allocate unless --kv-memory file", () => {
    expect(parseDemoArgs([]).options.kvMemory).toBe("segment");
    expect(parseDemoArgs(["--kv-memory", "file"]).options.kvMemory).toBe("file");
    expect(() => parseDemoArgs(["--kv-memory", "disk"])).toThrow(
      "--kv-memory must be one of segment, file, got 'disk'",
    );
  });

  it("over TCP puts the KV in files, says so, and refuses segments asked for", () => {
    const tcp = parseDemoArgs(["--transport", "tcp"]);
    expect(tcp.options.kvMemory).toBe("file");
    expect(tcp.notes).toEqual([
      expect.stringMatching(/^note: --transport tcp: the engines' KV in files/),
    ]);
    expect(parseDemoArgs(["--transport", "tcp", "--kv-memory", "file"]).notes).toEqual([]);
    expect(() => parseDemoArgs(["--transport", "tcp", "--kv-memory", "segment"])).toThrow(
      "--kv-memory segment needs --transport shm",
    );
  });
});
