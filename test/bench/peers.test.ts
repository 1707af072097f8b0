// `kvxfer bench peers` on tiny sizes with the peers absent: kvxfer's own parts run and give
// figures, a missing peer is a row saying so (not a crash, not a silent gap), and the report
// and plot render. NIXL and Mooncake are never needed here.
import { describe, expect, it } from "vitest";

import {
  formatPeers,
  kvDescriptors,
  kvShapeLayout,
  parsePeersArgs,
  peersChart,
  runPeersBench,
  statusLines,
} from "../../bench/peers.js";

describe("bench peers", () => {
  it("builds the e2e KV shapes as one descriptor list over one buffer per side", () => {
    const layout = kvShapeLayout(8192);
    const total = layout.regionBytes.reduce((a, b) => a + b, 0);
    for (const [tokens, descs] of [
      [128, 64],
      [2048, 1024],
    ] as const) {
      const d = kvDescriptors(layout, tokens, tokens);
      expect(d.length / 3).toBe(descs);
      let bytes = 0;
      for (let i = 0; i < d.length; i += 3) {
        expect(d[i]! + d[i + 2]!).toBeLessThanOrEqual(total);
        expect(d[i + 1]! + d[i + 2]!).toBeLessThanOrEqual(total);
        bytes += d[i + 2]!;
      }
      // 4 layers x K,V x 8 heads x 128 x 2 bytes per token.
      expect(bytes).toBe(tokens * 4 * 2 * 8 * 128 * 2);
    }
  });

  it("parses its flags and refuses unknown ones", () => {
    expect(parsePeersArgs(["--systems", "kvxfer", "--transports", "shm"]).systems).toEqual([
      "kvxfer",
    ]);
    expect(() => parsePeersArgs(["--systems", "ucx"])).toThrow(/unknown system/);
    expect(() => parsePeersArgs(["--bogus"])).toThrow(/unknown argument/);
  });

  it("runs kvxfer's parts and reports a missing peer as not installed", async () => {
    const r = await runPeersBench({
      json: true,
      systems: ["kvxfer", "nixl", "mooncake"],
      transports: ["shm"],
      sizes: [4096, 1 << 20],
      kvTokens: [128],
      kvRounds: 2,
      descCounts: [1000],
      descReps: 1,
      pingReps: 50,
      targetBytes: 1 << 20,
      sidecars: false,
      python: "/nonexistent/python3",
    });
    const status = (label: string) => r.systems.find((s) => s.label === label);
    expect(status("kvxfer")?.status).toBe("ok");
    expect(status("nixl")?.status).toBe("not installed");
    expect(status("nixl")?.error).toMatch(/--install/);
    expect(status("mooncake")?.status).toBe("not offered");
    for (const row of r.bw) expect(row.values.kvxfer).toMatchObject({ gbps: expect.any(Number) });
    expect(r.kv[0]!.values.kvxfer).toMatchObject({ ms: { n: 2 } });
    expect(r.desc[0]!.values.kvxfer).toMatchObject({ completeMs: expect.any(Number) });
    expect(r.ping[0]!.values.kvxfer).toMatchObject({ rate: expect.any(Number) });
    expect(r.bw[0]!.values.nixl).toBeUndefined();
    const text = formatPeers(r);
    expect(text).toContain("WRITE bandwidth");
    expect(statusLines(r).join("\n")).toContain("not installed");
    expect(peersChart(r, "shm")).toContain("<svg");
  }, 120_000);
});
