// Sidecars across a link that misbehaves (issue 52): P and D sidecars in two network namespaces
// (UCX over TCP, error mode peer, mutual TLS), simulated engines, the fault harness of
// test/net/faults.ts on the link between them. Every transfer that reports ready is byte-verified
// by D's engine; every block is back with both engines at the end of each case. Needs root, tc,
// iptables; `npm run build` first.
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";

import { FaultNet, faultSupport } from "../../net/faults.js";
import { until } from "../../until.js";
import { sleep, type KvNode, type Pair } from "./fixtures.js";
import { BYTES_PER_TOKEN, attempt, startNetPair, type Outcome } from "./net-fixtures.js";

const support = faultSupport();

function summary(outs: Outcome[]): string {
  const by = new Map<string, number>();
  for (const o of outs) {
    const k = o.outcome === "failed" ? `failed ${o.reason}` : o.outcome;
    by.set(k, (by.get(k) ?? 0) + 1);
  }
  const ms = outs.map((o) => o.ms).sort((a, b) => a - b);
  return `${JSON.stringify(Object.fromEntries(by))}, first ${ms[0]} ms, last ${ms[ms.length - 1]} ms`;
}

describe.skipIf(support.missing !== undefined)(
  `sidecars across a faulty link${support.missing !== undefined ? ` (skipped: ${support.missing})` : ""}`,
  () => {
    let net: FaultNet;
    let pair: Pair | undefined;
    beforeAll(() => {
      net = new FaultNet("s", 54);
    });
    afterEach(async () => {
      net.heal();
      net.uncap();
      for (const s of ["p", "d"] as const) net.link(s, true);
      await pair?.close();
      pair = undefined;
    });
    afterAll(() => net?.destroy());

    // The issue's case scaled down 2.5x in time: 16 x 2 MiB at 50 Mbit/s take ~6 s together,
    // three times the 2 s peer timeout; one alone takes 0.35 s.
    it.skipIf(process.env.KX52_ONLY === "partition").each(["push", "pull"] as const)(
      "a 50 Mbit/s cap with 16 x 2 MiB in flight (%s): a peer delivering bytes is alive, every transfer verified",
      async (how) => {
        pair = await startNetPair(net, {
          sidecarArgs: ["--peer-timeout-ms", "2000", "--heartbeat-ms", "500"],
        });
        const tokens = (2 << 20) / BYTES_PER_TOKEN;
        net.cap(50);
        const t0 = Date.now();
        const outs = await Promise.all(
          Array.from({ length: 16 }, (_, i) =>
            attempt(pair!, `cap-${how}-${i}`, { tokens, pull: how === "pull", timeoutMs: 40_000 }),
          ),
        );
        const wall = Date.now() - t0;
        const downs = [...pair.p.events, ...pair.d.events].filter((e) => e.kind === "PEER_DOWN");
        console.log(
          `[net cap ${how}] 16 x 2 MiB at 50 Mbit/s: ${summary(outs)}, wall ${wall} ms, ` +
            `${((16 * 2 * 8 * 1.048576) / (wall / 1000)).toFixed(1)} Mbit/s; PEER_DOWN ${JSON.stringify(downs.map((e) => e.reason))}`,
        );
        expect(outs.filter((o) => o.outcome !== "verified")).toEqual([]);
        expect(downs).toEqual([]);
        net.uncap();
        await pair.p.allBlocksFree(10_000);
        await pair.d.allBlocksFree(10_000);
      },
      90_000,
    );

    // Issue 52's partition, 8 s instead of 15 (both sides' peer timeout is 2 s): pull and push
    // in flight on a capped link when the link goes; both sides declare the other down; D fails
    // every transfer not done. Once the link is back, no block of either side is held 5 s later
    // (P's lease is 30 s), and the next transfer works with nothing restarted.
    it.each(["both ways", "P -> D only"] as const)(
      "a partition of 8 s (%s) with 8 transfers in flight: every block back on both sides within 5 s of the heal, the next transfer works",
      async (how) => {
        pair = await startNetPair(net, {
          sidecarArgs: ["--peer-timeout-ms", "2000", "--heartbeat-ms", "500"],
        });
        const tokens = (2 << 20) / BYTES_PER_TOKEN;
        net.cap(20);
        const flights = Array.from({ length: 8 }, (_, i) =>
          attempt(pair!, `part-${how.replace(/\W/g, "")}-${i}`, {
            tokens,
            pull: i % 2 === 0,
            timeoutMs: 30_000,
          }),
        );
        await sleep(1_000);
        if (how === "both ways") net.partition();
        else net.drop("p");
        const cutAt = Date.now();
        await sleep(8_000);
        net.heal();
        const healedAt = Date.now();
        const outs = await Promise.all(flights);
        let pFree = -1;
        let dFree = -1;
        await until(
          async () => {
            const [ps, ds] = await Promise.all([pair!.p.engine.stats(), pair!.d.engine.stats()]);
            if (pFree < 0 && ps.freeBlocks === ps.totalBlocks) pFree = Date.now() - healedAt;
            if (dFree < 0 && ds.freeBlocks === ds.totalBlocks) dFree = Date.now() - healedAt;
            return pFree >= 0 && dFree >= 0;
          },
          40_000,
          "every block free on both sides",
          100,
        );
        const downs = (n: KvNode): string[] =>
          n.events.filter((e) => e.kind === "PEER_DOWN").map((e) => e.reason);
        console.log(
          `[net partition ${how}] cut for ${healedAt - cutAt} ms with 8 x 2 MiB in flight at 20 Mbit/s: ${summary(outs)}; ` +
            `blocks all back ${pFree} ms (P) and ${dFree} ms (D) after the heal; ` +
            `PEER_DOWN on P ${JSON.stringify(downs(pair.p))}, on D ${JSON.stringify(downs(pair.d))}`,
        );
        for (const o of outs) {
          expect(["verified", "failed"], JSON.stringify(o)).toContain(o.outcome);
          if (o.outcome === "failed") expect(o.reason, JSON.stringify(o)).toBe("PEER_FAILED");
        }
        expect(outs.some((o) => o.outcome === "failed")).toBe(true);
        expect(pFree).toBeLessThanOrEqual(5_000);
        expect(dFree).toBeLessThanOrEqual(5_000);
        net.uncap();
        for (const pull of [true, false]) {
          const next = await attempt(pair, `after-${how.replace(/\W/g, "")}-${pull}`, {
            tokens: 64,
            pull,
            timeoutMs: 15_000,
          });
          expect(next.outcome, JSON.stringify(next)).toBe("verified");
        }
        await pair.p.allBlocksFree(5_000);
        await pair.d.allBlocksFree(5_000);
      },
      90_000,
    );
  },
);
