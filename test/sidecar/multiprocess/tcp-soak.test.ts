// The TCP path under a soak (issue 30): UCX 1.13 segfaulted in its TCP progress on fresh sidecar
// pairs and crashed D in 2 of 3 60-second soaks. Two network namespaces joined by veth (made and
// removed here), P TP 2 -> D TP 2 sidecars and simulated engines, 32 requests in flight for 60 s,
// pull and push in turn (auto mode, alternating dispatch), once with `--transports tcp,self` and
// once with UCX's own choice of transports. Every transfer is byte-verified by D's engine, none
// fails, and every block is back with its engine at the end: a sidecar that crashed would fail
// its transfers. `npm run build` first; needs root (ip netns).
import { execFileSync } from "node:child_process";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { canCreateNetns, createNetnsPair, type NetnsPair } from "../../../bench/native/netns.js";
import { runDemo } from "../../../sim/demo.js";

const SOAK_MS = 60_000;

/** D's count of ready transfers by mode, read from its metrics inside its namespace. */
function readyByMode(prefix: string[], address: string): Record<string, number> {
  const script = `fetch("http://${address}/metrics").then((r) => r.text()).then((t) => process.stdout.write(t))`;
  const text = execFileSync(prefix[0]!, [...prefix.slice(1), process.execPath, "-e", script], {
    encoding: "utf8",
    timeout: 10_000,
  });
  const out: Record<string, number> = {};
  for (const m of text.matchAll(/^kvxfer_transfers_ready_total\{mode="(\w+)"\} (\d+)/gm))
    out[m[1]!] = Number(m[2]);
  return out;
}

describe.skipIf(!canCreateNetns())("TCP soak across two network namespaces", () => {
  let ns: NetnsPair;
  beforeAll(() => {
    ns = createNetnsPair("s");
  });
  afterAll(() => ns.destroy());

  it.each(["tcp", "default"] as const)(
    "60 s, TP 2 -> 2, 32 in flight, pull and push alternating, transports %s: every transfer verified, no block held",
    async (transport) => {
      let byMode: Record<string, number> = {};
      const s = await runDemo({
        prefill: 1,
        decode: 1,
        pTp: 2,
        dTp: 2,
        pBlock: 16,
        dBlock: 16,
        layout: "hnd",
        model: "llama3-8b",
        layers: 2,
        mode: "auto",
        dispatch: "alternating",
        requests: 1_000_000,
        durationMs: SOAK_MS,
        concurrency: 32,
        promptTokens: [40, 200, 600],
        prefixTokens: 0,
        computeMs: 2,
        transport,
        hosts: {
          prefill: { prefix: ns.prefix(0), listenHost: ns.addresses[0], netDevice: ns.devices[0] },
          decode: { prefix: ns.prefix(1), listenHost: ns.addresses[1], netDevice: ns.devices[1] },
        },
        requestTimeoutMs: 30_000,
        sidecarArgs: ["--metrics", "127.0.0.1:0"],
        // The router cannot reach the sidecars' gRPC or metrics in their namespaces: D's
        // metrics are read from inside its namespace, before the sidecars stop.
        beforeStop: (sidecars) => {
          const d = sidecars.find((x) => x.role === "decode");
          if (d?.metrics !== undefined) byMode = readyByMode(ns.prefix(1), d.metrics);
        },
      });
      console.log(
        `[tcp soak, ${transport}] ${s.transfers} transfers in ${s.elapsedMs} ms (${JSON.stringify(byMode)}), ` +
          `${(s.bytes / 2 ** 20).toFixed(0)} MiB, KV ready p50 ${s.readyLatencyMs.p50.toFixed(1)} ms p99 ${s.readyLatencyMs.p99.toFixed(1)} ms; ` +
          `failed ${s.failed}, mismatched ${s.mismatches}, blocks held ${s.leakedBlocks}`,
      );
      expect(s.failures).toEqual([]);
      expect(s.mismatches).toBe(0);
      expect(s.leakedBlocks).toBe(0);
      expect(s.verified).toBe(true);
      expect(s.elapsedMs).toBeGreaterThanOrEqual(SOAK_MS);
      // Both directions of the data path ran, many times each.
      expect(byMode.pull).toBeGreaterThan(100);
      expect(byMode.push).toBeGreaterThan(100);
      expect(byMode.pull! + byMode.push!).toBe(s.transfers);
    },
    240_000,
  );
});
