// kill -9 of a sidecar while transfers are in flight, then a restart of that sidecar alone (same
// engine id and engine socket, new epoch), for P's and D's sidecar, during a push and during a
// pull (issue 16, case 8). The engine stays up: it must notice the restart (the link drops and
// comes back, a new epoch in Registered, or ERR_NOT_REGISTERED), register again and end what the
// dead sidecar had. Asserted on both engines: the restarted side re-registered, every transfer
// reached exactly one outcome (verified byte-exact, or failed and freed), no block is held past a
// bound, and a new transfer after the restart verifies. Real processes; `npm run build` first.
import { afterEach, describe, expect, it } from "vitest";

import type { SimEngineEvent } from "../../../sim/engine-client.js";
import { KvNode, type Pair, freePort, goodTransfer, sleep, startPair } from "./fixtures.js";
import { until } from "../../until.js";

/** Short leases and timeouts, so every bound below is seconds. */
const SIDECAR_ARGS = [
  "--heartbeat-ms",
  "200",
  "--peer-timeout-ms",
  "1500",
  "--lease-ms",
  "4000",
  "--reg-lease-ms",
  "4000",
  "--abort-grace-ms",
  "500",
  "--transfer-timeout-ms",
  "8000",
];
/** The engines fail everything in flight after this long without their sidecar. */
const SIDECAR_LOST_MS = 5000;
/** Every transfer has its one outcome on each engine, and every block is back, within this. */
const OUTCOME_BOUND_MS = 20_000;
const TRANSFERS = 6;
const TOKENS = 40;

/** The engine events that end a transfer on that engine: D verified it, or it was freed. */
function outcomes(node: KvNode, transferId: string): SimEngineEvent[] {
  return node.engine.events.filter(
    (e) =>
      e.transferId === transferId &&
      (e.event === "released" || (node.role === "decode" && e.event === "verified")),
  );
}

describe("sidecar kill -9 and restart, engine stays up (multi-process)", () => {
  let pair: Pair | undefined;
  afterEach(async () => {
    await pair?.close();
    pair = undefined;
  }, 30_000);

  const cases = [
    { victim: "p", mode: "push" },
    { victim: "p", mode: "pull" },
    { victim: "d", mode: "push" },
    { victim: "d", mode: "pull" },
  ] as const;

  for (const { victim, mode } of cases) {
    it(`kill -9 of ${victim === "p" ? "P" : "D"}'s sidecar during a ${mode}, restart: the engines recover, one outcome per transfer, no block held, new transfers verify`, async () => {
      pair = await startPair({
        mode,
        sidecarArgs: SIDECAR_ARGS,
        // P's side channel survives the restart on the same address, as in a pod.
        pListen: `127.0.0.1:${await freePort()}`,
        engine: { sidecarLostMs: SIDECAR_LOST_MS },
      });
      const { p, d } = pair;
      const node = victim === "p" ? p : d;
      const other = victim === "p" ? d : p;
      await goodTransfer(p, d, "warm", { pull: mode === "pull" });
      const oldEpoch = node.ready.epoch;

      // Transfers with staggered compute times: some done before the kill, some in flight
      // across it, some finished while the sidecar is down.
      const ids = Array.from({ length: TRANSFERS }, (_, i) => `${victim}-${mode}-${i}`);
      const source = p.sideChannel;
      /** Transfers D's engine was asked for (a pull asks only once P's prefill answered). */
      const onDToo = new Set<string>();
      const ops = ids.map(async (id, i) => {
        const computeMs = 100 + i * 150;
        onDToo.add(id);
        if (mode === "push") {
          await Promise.all([
            p.engine.prefill(id, TOKENS, computeMs, 15_000),
            d.engine.expect({ transferId: id, tokens: TOKENS, source }, 15_000),
          ]);
        } else {
          onDToo.delete(id);
          const { blockIds } = await p.engine.prefill(id, TOKENS, computeMs, 15_000);
          onDToo.add(id);
          await d.engine.expect(
            { transferId: id, tokens: TOKENS, source, sourceBlockIds: blockIds },
            15_000,
          );
        }
      });
      // Prefilled before the kill, asked for by D only after the restart: P's old sidecar held
      // their blocks when it died (P's engine must take them back), or, when D's sidecar died,
      // P's still holds them for D.
      const late = [0, 1].map((j) => `${victim}-${mode}-late-${j}`);
      const lateBlocks = new Map<string, number[]>();
      for (const id of late) lateBlocks.set(id, (await p.engine.prefill(id, TOKENS, 0)).blockIds);
      for (const id of late)
        await p.waitTransfer(id, "prefill", (t) => t.state === "HELD", "HELD (P holds the blocks)");
      const { killedAt, upAt } = await node.restartSidecar(300);
      expect(node.ready.epoch).not.toBe(oldEpoch);

      // The engine registered again with the new sidecar and saw the new epoch.
      const reg = await node.engine.waitEvent(
        (e) => e.event === "registered" && e.ok === true && e.restarted === true,
        10_000,
      );
      expect(reg.epoch).toBe(node.ready.epoch);
      const regAt = Date.now();
      const lateOps = late.map(async (id) => {
        onDToo.add(id);
        await d.engine.expect(
          {
            transferId: id,
            tokens: TOKENS,
            source: p.sideChannel,
            ...(mode === "pull" ? { sourceBlockIds: lateBlocks.get(id)! } : {}),
          },
          15_000,
        );
      });
      ids.push(...late);
      const stats = await node.engine.stats();
      expect(stats.epoch).toBe(node.ready.epoch);
      expect(stats.restarts).toBeGreaterThanOrEqual(1);
      // The restarted sidecar refuses a transfer id it never saw, by name (not silence, not a
      // crash).
      // Only refusals after this call count: messages the engine sent before it registered again
      // were refused ERR_NOT_REGISTERED, possibly for this very id.
      const earlier = new Set(node.engine.events);
      await node.engine.call("abort", { transferId: ids[0]! });
      const stale = await node.engine.waitEvent(
        (e) => !earlier.has(e) && e.event === "refused" && e.transferId === ids[0],
        10_000,
      );
      expect(stale.code).toBe("ERR_UNKNOWN_TRANSFER");
      // Every engine call settled (a refusal is an outcome too, not a hang).
      const settled = await Promise.allSettled([...ops, ...lateOps]);

      // Exactly one outcome per transfer on each engine, within the bound.
      await until(
        () =>
          ids.every(
            (id) => outcomes(p, id).length >= 1 && (!onDToo.has(id) || outcomes(d, id).length >= 1),
          ),
        OUTCOME_BOUND_MS,
        () =>
          `an outcome of every transfer on both engines; P ${JSON.stringify(ids.map((id) => outcomes(p, id).length))}, D ${JSON.stringify(ids.map((id) => outcomes(d, id).length))}; ` +
          `P's sidecar: ${JSON.stringify(p.events.filter((e) => ids.includes(e.transferId)).map((e) => [e.transferId, e.kind, e.reason]))}; ` +
          `D's: ${JSON.stringify(d.events.filter((e) => ids.includes(e.transferId)).map((e) => [e.transferId, e.kind, e.reason]))}`,
        50,
      );
      const doneAt = Date.now();
      await sleep(500); // a second outcome would show up now
      const summary: string[] = [];
      for (const id of ids) {
        const onP = outcomes(p, id);
        const onD = outcomes(d, id);
        expect(onP, `P's outcomes of ${id}`).toHaveLength(1);
        expect(onD, `D's outcomes of ${id}`).toHaveLength(onDToo.has(id) ? 1 : 0);
        const dEnd = onD[0] ?? { event: "never asked" };
        if (dEnd.event === "never asked") {
          // A pull whose prefill call failed: D was never asked.
        } else if (dEnd.event === "verified")
          expect(dEnd.ok, `${id} verified byte-exact`).toBe(true);
        else
          expect(
            d.engine.events.some((e) => e.event === "failed" && e.transferId === id),
            `${id} failed on D before its blocks came back (D recomputes)`,
          ).toBe(true);
        summary.push(
          `${id}: D ${dEnd.event === "verified" ? "verified" : `failed/${String(dEnd.reason)}`}, P ${String(onP[0]!.reason)}`,
        );
        // At most one terminal event per transfer on each sidecar process that saw it.
        for (const evs of [
          ...other.earlierEvents,
          other.events,
          ...node.earlierEvents,
          node.events,
        ]) {
          const t = evs.filter(
            (e) =>
              e.transferId === id &&
              ["KV_READY", "FAILED", "EXPIRED", "ABORTED", "RELEASED"].includes(e.kind),
          );
          expect(t.length, `terminal events of ${id} on one sidecar`).toBeLessThanOrEqual(1);
        }
      }
      for (const n of [p, d]) {
        const s = await n.allBlocksFree(OUTCOME_BOUND_MS);
        expect(s.transfers).toBe(0);
        expect(s.held).toEqual({});
        expect(s.badReleases).toBe(0);
        expect(s.mismatches).toBe(0);
        expect(n.engine.events.filter((e) => e.event === "unexpected")).toEqual([]);
      }
      const freeAt = Date.now();

      // A new transfer after the restart, both ways, byte-exact.
      await goodTransfer(p, d, `${victim}-${mode}-after`, {
        pull: mode === "pull",
        timeoutMs: 20_000,
      });
      await goodTransfer(p, d, `${victim}-${mode}-after-2`, {
        pull: mode === "pull",
        timeoutMs: 20_000,
      });
      for (const n of [p, d]) await n.allBlocksFree(10_000);
      console.log(
        `[restart ${victim}/${mode}] killed, up again +${upAt - killedAt} ms, engine re-registered +${regAt - killedAt} ms, every outcome +${doneAt - killedAt} ms, every block free +${freeAt - killedAt} ms; ` +
          `${settled.filter((s) => s.status === "rejected").length} engine calls refused; ${summary.join("; ")}`,
      );
    }, 120_000);
  }
});
