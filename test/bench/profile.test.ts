// bench/profile.ts on a profile written here (so every figure is known), and bench/zmq-wake.ts
// run small against real ZeroMQ sockets.
import { existsSync, readdirSync } from "node:fs";
import { describe, expect, it } from "vitest";

import { report, summarize, type CpuProfile } from "../../bench/profile.js";
import { measure } from "../../bench/zmq-wake.js";

const own = (name: string, file: string, line: number) => ({
  functionName: name,
  url: `file:///x/dist/src/${file}`,
  lineNumber: line - 1,
});

// root → onNotifications → send (a line calling into ZeroMQ) ; root → (idle) ; root → (gc) ;
// root → loader (start-up) → a kvxfer module's top level.
const profile: CpuProfile = {
  nodes: [
    {
      id: 1,
      callFrame: { functionName: "(root)", url: "", lineNumber: -1 },
      children: [2, 4, 5, 6],
    },
    { id: 2, callFrame: own("onNotifications", "sidecar/sidecar.js", 445), children: [3] },
    {
      id: 3,
      callFrame: own("trySend", "engine/link.js", 418),
      positionTicks: [
        { line: 430, ticks: 3 },
        { line: 424, ticks: 1 },
      ],
    },
    { id: 4, callFrame: { functionName: "(idle)", url: "", lineNumber: -1 } },
    { id: 5, callFrame: { functionName: "(garbage collector)", url: "", lineNumber: -1 } },
    {
      id: 6,
      callFrame: {
        functionName: "wrapSafe",
        url: "node:internal/modules/cjs/loader",
        lineNumber: 1,
      },
      children: [7],
    },
    { id: 7, callFrame: own("", "sidecar/decode.js", 1) },
  ],
  // µs per sample: 2 self in onNotifications, 4 in trySend, 10 idle, 1 GC, 3 start-up.
  samples: [2, 2, 3, 3, 3, 3, 4, 5, 6, 7, 7],
  timeDeltas: [1000, 1000, 1000, 1000, 1000, 1000, 10000, 1000, 1000, 1000, 1000],
};

describe("bench/profile", () => {
  it("splits busy time into start-up, GC and kvxfer's functions; lines get their ticks' share", () => {
    const s = summarize([profile, profile]);
    expect(s.busyUs).toBe(2 * 10_000); // idle left out
    expect(s.gcUs).toBe(2 * 1000);
    expect(s.startupUs).toBe(2 * 3000);
    expect(s.inclusive.get("onNotifications src/sidecar/sidecar.js:445")).toBe(2 * 6000);
    expect(s.inclusive.get("trySend src/engine/link.js:418")).toBe(2 * 4000);
    expect(s.inclusive.get("(anonymous) src/sidecar/decode.js:1")).toBe(2 * 2000);
    expect(s.lines.get("src/engine/link.js:430")).toBe(2 * 3000);
    expect(s.lines.get("src/engine/link.js:424")).toBe(2 * 1000);
    expect(report(s, { per: 4, top: 2 })).toEqual([
      "busy (sampled, idle left out): 20 ms   5000.0 µs/each",
      " 30.0%       6 ms   1500.0 µs/each  start-up (module loading, compilation)",
      " 10.0%       2 ms    500.0 µs/each  garbage collection",
      "kvxfer functions, inclusive:",
      " 60.0%      12 ms   3000.0 µs/each  onNotifications src/sidecar/sidecar.js:445",
      " 40.0%       8 ms   2000.0 µs/each  trySend src/engine/link.js:418",
      "hottest lines, self:",
      " 30.0%       6 ms   1500.0 µs/each  src/engine/link.js:430",
    ]);
  });
});

describe("bench/zmq-wake", () => {
  it("times sends back to back and after idleness, and leaves no socket file", async () => {
    const rows = await measure(50);
    expect(rows.map((r) => r.label)).toEqual([
      "back to back",
      "after 1 ms idle",
      "back to back, again",
    ]);
    for (const r of rows) expect(r.p50).toBeGreaterThan(0);
    expect(
      readdirSync("/tmp").filter((f) => f.startsWith(`kvxfer-zmq-wake-${process.pid}`)),
    ).toEqual([]);
    expect(existsSync(`/tmp/kvxfer-zmq-wake-${process.pid}.sock`)).toBe(false);
  }, 30_000);
});
