// Failure cases of issue 4, each across real processes: two sidecars (dist/), two simulated
// engines, UCX over shared memory, ZeroMQ engine links and side channels, gRPC events. Each case
// ends in exactly one terminal state per side within a bound computed from the flags below, with
// every block back in both engines, and the sidecars serving a byte-verified transfer afterwards.
// `npm run build` first: the processes run the compiled code.
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";

import { describe, expect, it } from "vitest";

import type { SidecarEvent } from "../../../src/sidecar/view.js";
import type { SimEngineEvent } from "../../../sim/engine-client.js";
import {
  KvNode,
  type Pair,
  freePort,
  goodTransfer,
  sleep,
  startPair,
  uniqueId,
} from "./fixtures.js";
import { until } from "../../until.js";

// Timers of every sidecar here (ms). The sweep runs every 100 ms (the sidecar's default).
const HEARTBEAT = 100;
const PEER_TIMEOUT = 1000;
const REG_LEASE = 1000;
const GRACE = 300;
/** How long a side waits at most for reads or writes it gave up on to settle in UCX. */
const SETTLE_BOUND = 1500;
const SWEEP = 100;
/** Scheduling slack on a loaded two-core machine, on top of every bound. */
const SLACK = 1500;

function flags(o: Record<string, number>): string[] {
  return Object.entries(o).flatMap(([k, v]) => [`--${k}`, String(v)]);
}

function fastArgs(over: Record<string, number> = {}): string[] {
  return flags({
    "heartbeat-ms": HEARTBEAT,
    "peer-timeout-ms": PEER_TIMEOUT,
    "reg-lease-ms": REG_LEASE,
    "abort-grace-ms": GRACE,
    "settle-bound-ms": SETTLE_BOUND,
    "transfer-timeout-ms": 20_000,
    "lease-ms": 5000,
    ...over,
  });
}

/** When the test saw each engine event (engines' events carry no clock). */
const seenAt = new WeakMap<SimEngineEvent, number>();
function stamp(node: KvNode): void {
  node.engine.on("event", (e) => seenAt.set(e, Date.now()));
}
function at(e: SimEngineEvent): number {
  const t = seenAt.get(e);
  if (t === undefined) throw new Error(`event ${JSON.stringify(e)} was not stamped`);
  return t;
}

function engineEvents(node: KvNode, transferId: string): SimEngineEvent[] {
  return node.engine.events.filter((e) => e.transferId === transferId);
}

/** Exactly one terminal event per side for `transferId`, checked after the dust settles. */
async function oneTerminal(node: KvNode, transferId: string): Promise<SidecarEvent> {
  await until(
    () => node.terminal(transferId).length > 0,
    10_000,
    `a terminal event of ${transferId} on ${node.role}`,
  );
  await sleep(3 * SWEEP);
  const ts = node.terminal(transferId);
  expect(ts, `${node.role} terminal events of ${transferId}`).toHaveLength(1);
  return ts[0]!;
}

/** Waits until P lists `transferId` in `state` (e.g. WAITING: D's registration arrived). */
async function pState(p: KvNode, transferId: string, state: string): Promise<void> {
  await p.waitTransfer(transferId, "prefill", (t) => t.state === state, state);
}

function hashFiles(node: KvNode): string {
  const h = createHash("sha256");
  for (const path of node.engine.ready!.files.flat()) h.update(readFileSync(path));
  return h.digest("hex");
}

async function withPair(
  o: Parameters<typeof startPair>[0],
  body: (pair: Pair) => Promise<void>,
): Promise<void> {
  const pair = await startPair(o);
  stamp(pair.p);
  stamp(pair.d);
  try {
    await body(pair);
  } finally {
    await pair.close();
  }
}

describe("sidecar failure cases (multi-process)", () => {
  it("D never sends ExpectKv: P's lease expires, P releases EXPIRED, a late ExpectKv fails LEASE_EXPIRED", async () => {
    const LEASE = 500;
    await withPair(
      { mode: "push", sidecarArgs: fastArgs(), pArgs: flags({ "lease-ms": LEASE }) },
      async ({ p, d }) => {
        await goodTransfer(p, d, "t1-before");
        const id = "t1-no-expect";
        const t0 = Date.now();
        await p.engine.prefill(id, 40, 0);
        const rel = await p.engineEvent(id, "released", LEASE + SWEEP + SLACK);
        const heldMs = at(rel) - t0;
        expect(rel.reason).toBe("EXPIRED");
        // Bound: lease + one sweep period.
        expect(heldMs).toBeGreaterThanOrEqual(LEASE);
        expect(heldMs).toBeLessThan(LEASE + SWEEP + SLACK);
        const pEv = await p.client.awaitTransfer(id, 5000, { side: "prefill" });
        expect(pEv.kind).toBe("EXPIRED");
        expect(pEv.side).toBe("prefill");
        await p.allBlocksFree();

        // The router, late, sends D after it: push registration refused with ERR_LEASE_EXPIRED.
        const t1 = Date.now();
        await d.engine.expect({ transferId: id, tokens: 40, source: p.sideChannel });
        const failed = await d.engineEvent(id, "failed", 5000);
        const dRel = await d.engineEvent(id, "released", 5000);
        expect(failed.reason).toBe("LEASE_EXPIRED");
        expect(dRel.reason).toBe("FAILED");
        const dEvents = engineEvents(d, id).map((e) => e.event);
        expect(dEvents).not.toContain("verified");
        expect(dEvents.indexOf("failed")).toBeLessThan(dEvents.indexOf("released"));
        const dEv = await d.client.awaitTransfer(id, 5000, { side: "decode" });
        expect(dEv.kind).toBe("FAILED");
        expect(dEv.reason).toBe("ERR_LEASE_EXPIRED");
        expect((await oneTerminal(p, id)).kind).toBe("EXPIRED");
        expect((await oneTerminal(d, id)).kind).toBe("FAILED");
        await d.allBlocksFree();
        console.log(
          `[t1] P held ${heldMs} ms (lease ${LEASE}, bound ${LEASE + SWEEP + SLACK}); late ExpectKv failed on D after ${at(failed) - t1} ms, released after ${at(dRel) - t1} ms`,
        );
        await goodTransfer(p, d, "t1-after");
      },
    );
  }, 60_000);

  it("P never finishes: D's watchdog fires, KvFailed(TIMEOUT), blocks back only after P's AbortAck", async () => {
    const WATCHDOG = 800;
    await withPair(
      { mode: "push", sidecarArgs: fastArgs(), dArgs: flags({ "transfer-timeout-ms": WATCHDOG }) },
      async ({ p, d }) => {
        await goodTransfer(p, d, "t2-before");
        const id = "t2-no-prefill";
        const t0 = Date.now();
        await d.engine.expect({ transferId: id, tokens: 40, source: p.sideChannel });
        const failed = await d.engineEvent(id, "failed", WATCHDOG + SWEEP + SLACK);
        const rel = await d.engineEvent(id, "released", REG_LEASE + GRACE + SLACK);
        expect(failed.reason).toBe("TIMEOUT");
        expect(rel.reason).toBe("EXPIRED");
        const dEvents = engineEvents(d, id).map((e) => e.event);
        expect(dEvents).toEqual(["failed", "released"]);
        const dEv = await oneTerminal(d, id);
        expect(dEv.kind).toBe("EXPIRED");
        expect(dEv.reason).toBe("ERR_TIMEOUT");
        // The blocks came back on P's AbortAck: the reg-lease fallback would take REG_LEASE + GRACE.
        expect(at(rel) - at(failed)).toBeLessThan(REG_LEASE);
        const failMs = at(failed) - t0;
        expect(failMs).toBeGreaterThanOrEqual(WATCHDOG);
        expect(failMs).toBeLessThan(WATCHDOG + SWEEP + SLACK);
        await p.allBlocksFree();
        await d.allBlocksFree();
        console.log(
          `[t2] D watchdog ${WATCHDOG} ms: KvFailed after ${failMs} ms, ReleaseBlocks ${at(rel) - at(failed)} ms later (on AbortAck; fallback bound ${REG_LEASE + GRACE} ms)`,
        );
        // A prefill that finishes after all: P kept D's withdrawn registration aside (before
        // PrefillDone a registrant's Abort only withdraws it, issue 31); the token ("") names it,
        // so the transfer ends ABORTED there and its blocks come back at once.
        await p.engine.prefill(id, 40, 0).catch(() => undefined);
        await p.allBlocksFree(5000);
        const pEv = await oneTerminal(p, id);
        expect(pEv.kind).toBe("ABORTED");
        expect(p.terminal(id)).toHaveLength(1);
        await goodTransfer(p, d, "t2-after");
      },
    );
  }, 60_000);

  it("D aborts while P is still computing: D releases only after P's AbortAck, and P never writes", async () => {
    await withPair({ mode: "push", sidecarArgs: fastArgs() }, async ({ p, d }) => {
      await goodTransfer(p, d, "t3-before");
      const id = "t3-abort";
      const COMPUTE = 1500;
      const prefill = p.engine.prefill(id, 40, COMPUTE);
      await d.engine.expect({ transferId: id, tokens: 40, source: p.sideChannel });
      await pState(p, id, "WAITING"); // D's PushReg is on P, prefill still computing
      const t0 = Date.now();
      await d.engine.call("abort", { transferId: id });
      const failed = await d.engineEvent(id, "failed", 5000);
      const rel = await d.engineEvent(id, "released", REG_LEASE + GRACE + SLACK);
      expect(failed.reason).toBe("ABORTED");
      expect(rel.reason).toBe("ABORTED");
      expect(engineEvents(d, id).map((e) => e.event)).toEqual(["failed", "released"]);
      const snapshot = hashFiles(d);
      const pEv = await oneTerminal(p, id);
      const dEv = await oneTerminal(d, id);
      expect(pEv.kind).toBe("ABORTED");
      expect(dEv.kind).toBe("ABORTED");
      // D's blocks came back on P's AbortAck: the reg-lease fallback would take REG_LEASE + GRACE.
      expect(at(rel) - t0).toBeLessThan(REG_LEASE);
      // P's compute ends now; its PrefillDone must not start writes into D's released blocks,
      // and its blocks must come back to P's engine.
      const { blockIds } = await prefill;
      const pRel = await p.engineEvent(id, "released", 5000);
      expect(pRel.reason).toBe("ABORTED");
      expect(pRel.blocks).toBe(blockIds.length);
      // P's blocks are back: every write P posted has completed (or never started). The files
      // hashed when D released its blocks must be as they were then.
      expect(hashFiles(d), "D's KV files changed after D released the blocks").toBe(snapshot);
      expect(p.terminal(id)).toHaveLength(1);
      await p.allBlocksFree();
      await d.allBlocksFree();
      console.log(
        `[t3] abort -> KvFailed ${at(failed) - t0} ms, -> ReleaseBlocks ${at(rel) - t0} ms (P ABORTED at +${pEv.timeMs - t0} ms, D ABORTED at +${dEv.timeMs - t0} ms)`,
      );
      await goodTransfer(p, d, "t3-after");
    });
  }, 60_000);

  it("D aborts racing P's writes: whatever the timing, one terminal state per side and no write after release", async () => {
    // 16 MiB per transfer, so some aborts land while the writes are in flight.
    const engine = { layers: 4, kvHeads: 8, headDim: 128, block: 16, blocks: 80 };
    await withPair({ mode: "push", sidecarArgs: fastArgs(), engine }, async ({ p, d }) => {
      await goodTransfer(p, d, "t3r-before", { tokens: 1024 });
      const outcomes: string[] = [];
      for (let i = 0; i < 6; i++) {
        const id = `t3r-${i}`;
        const expectDone = d.engine.expect({ transferId: id, tokens: 1024, source: p.sideChannel });
        await expectDone;
        await pState(p, id, "WAITING");
        // PrefillDone goes out, and the abort right behind it (after i ms).
        await p.engine.prefill(id, 1024, 0);
        if (i > 0) await sleep(i);
        await d.engine.call("abort", { transferId: id });
        const dEv = await oneTerminal(d, id);
        // D's files as they were when D ended: no write may change them after D released.
        const atDEnd = hashFiles(d);
        const pEv = await oneTerminal(p, id);
        outcomes.push(`${pEv.kind}/${dEv.kind}`);
        const evs = engineEvents(d, id).map((e) => e.event);
        if (dEv.kind === "KV_READY") {
          expect(evs).toEqual(["verified"]);
          expect(pEv.kind).toBe("RELEASED");
        } else {
          expect(dEv.kind).toBe("ABORTED");
          expect(evs).toEqual(["failed", "released"]);
          // P ends RELEASED (writes were done or in flight: acknowledged after they settled) or
          // ABORTED (the abort came first); either way its writes had settled before D's blocks
          // came back.
          expect(["RELEASED", "ABORTED"]).toContain(pEv.kind);
          const { transfers } = await p.client.listTransfers();
          const pT = transfers.find((t) => t.transferId === id && t.side === "prefill")!;
          expect(pT.timings.dataDoneMs).toBeLessThanOrEqual(dEv.timeMs);
          // P has ended, so its writes are over: none landed after D released.
          expect(hashFiles(d), "D's KV files changed after release").toBe(atDEnd);
        }
        await p.allBlocksFree();
        await d.allBlocksFree();
      }
      console.log(`[t3r] P/D outcomes of 6 racing aborts: ${outcomes.join(", ")}`);
      await goodTransfer(p, d, "t3r-after", { tokens: 1024 });
    });
  }, 120_000);

  it("P killed mid-transfer, never back: D fails it within peer-timeout, releases after reg-lease + grace + settle bound", async () => {
    const pair = await startPair({ mode: "push", sidecarArgs: fastArgs() });
    const { p, d } = pair;
    stamp(d);
    let p2: KvNode | undefined;
    try {
      await goodTransfer(p, d, "t4-before");
      const id = "t4-p-killed";
      const prefill = p.engine.prefill(id, 40, 10_000).catch(() => undefined);
      await d.engine.expect({ transferId: id, tokens: 40, source: p.sideChannel });
      await pState(p, id, "WAITING");
      const tKill = Date.now();
      await p.kill();
      await prefill;
      const BOUND_FAIL = PEER_TIMEOUT + HEARTBEAT + SWEEP;
      // P never answers again: D cannot tell a dead P from one across a partition whose
      // abandoned writes may still land, so it waits out the settle bound too.
      const BOUND_RELEASE = BOUND_FAIL + REG_LEASE + GRACE + SETTLE_BOUND + HEARTBEAT + SWEEP;
      const failed = await d.engineEvent(id, "failed", BOUND_FAIL + SLACK);
      const rel = await d.engineEvent(id, "released", BOUND_RELEASE + SLACK);
      expect(failed.reason).toBe("PEER_FAILED");
      expect(rel.reason).toBe("FAILED");
      expect(engineEvents(d, id).map((e) => e.event)).toEqual(["failed", "released"]);
      const dEv = await oneTerminal(d, id);
      expect(dEv.kind).toBe("FAILED");
      expect(dEv.reason).toBe("ERR_PEER_DOWN");
      const down = d.events.find((e) => e.kind === "PEER_DOWN" && e.peer === p.engineId);
      expect(down).toBeDefined();
      const failMs = at(failed) - tKill;
      const relMs = at(rel) - tKill;
      expect(failMs).toBeLessThan(BOUND_FAIL + SLACK);
      expect(relMs).toBeLessThan(BOUND_RELEASE + SLACK);
      // The blocks waited for P's registration lease to run out (P might still have been
      // writing) and for the settle bound (a write P abandoned might still land).
      expect(at(rel) - at(failed)).toBeGreaterThanOrEqual(REG_LEASE + SETTLE_BOUND);
      await d.allBlocksFree();
      console.log(
        `[t4] P killed: D detected (PEER_DOWN) at +${down!.timeMs - tKill} ms, KvFailed at +${failMs} ms (bound ${BOUND_FAIL}), ReleaseBlocks at +${relMs} ms (bound ${BOUND_RELEASE})`,
      );
      // D still serves: a new P, a verified transfer.
      p2 = await KvNode.start({ role: "prefill", mode: "push", sidecarArgs: fastArgs() });
      await goodTransfer(p2, d, "t4-after");
    } finally {
      await p2?.close();
      await pair.close();
    }
  }, 60_000);

  it("D killed mid-transfer: P ends its registration within its bound and returns the blocks", async () => {
    const pair = await startPair({ mode: "push", sidecarArgs: fastArgs() });
    const { p, d } = pair;
    stamp(p);
    let d2: KvNode | undefined;
    try {
      await goodTransfer(p, d, "t5-before");
      const id = "t5-d-killed";
      const COMPUTE = 3000;
      const prefill = p.engine.prefill(id, 40, COMPUTE);
      await d.engine.expect({ transferId: id, tokens: 40, source: p.sideChannel });
      await pState(p, id, "WAITING");
      const tKill = Date.now();
      await d.kill();
      // P: the registration runs out (no renewal) or D is silent past the peer timeout. Before
      // PrefillDone that withdraws the registration (issue 31: a registrant never ends a
      // transfer whose token P does not know yet); PrefillDone then ends it as withdrawn.
      const BOUND = Math.min(REG_LEASE, PEER_TIMEOUT) + HEARTBEAT + SWEEP;
      await p.waitTransfer(
        id,
        "prefill",
        (t) => t.trace.some((h) => h.hop.startsWith("peer.pushReg withdrawn")),
        "the dead D's registration withdrawn",
        BOUND + SLACK,
      );
      const endMs = Date.now() - tKill;
      expect(endMs).toBeLessThan(BOUND + SLACK);
      // The prefill finishes later; its blocks come straight back.
      const { blockIds } = await prefill;
      const pEv = await p.waitEvent((e) => e.transferId === id && e.side === "prefill", 5000);
      expect(["EXPIRED", "FAILED"]).toContain(pEv.kind);
      const rel = await p.engineEvent(id, "released", 5000);
      expect(["EXPIRED", "FAILED"]).toContain(rel.reason);
      expect(rel.blocks).toBe(blockIds.length);
      expect((await oneTerminal(p, id)).kind).toBe(pEv.kind);
      await p.allBlocksFree();
      console.log(
        `[t5] D killed: P withdrew its registration at +${endMs} ms (bound ${BOUND}), ended ${pEv.kind} (${pEv.reason}) at the late PrefillDone; its blocks released ${String(rel.reason)}`,
      );
      d2 = await KvNode.start({ role: "decode", mode: "push", sidecarArgs: fastArgs() });
      await goodTransfer(p, d2, "t5-after");
    } finally {
      await d2?.close();
      await pair.close();
    }
  }, 60_000);

  it("P restarted on the same side-channel address: the old epoch's transfer fails on D, new ones verify", async () => {
    const port = await freePort();
    const listen = `127.0.0.1:${port}`;
    const engineId = uniqueId("p-restart");
    const d = await KvNode.start({ role: "decode", mode: "push", sidecarArgs: fastArgs() });
    stamp(d);
    let p: KvNode | undefined;
    let p2: KvNode | undefined;
    try {
      p = await KvNode.start({
        role: "prefill",
        engineId,
        listen,
        mode: "push",
        sidecarArgs: fastArgs(),
      });
      expect(p.sideChannel).toBe(listen);
      await goodTransfer(p, d, "t6-before");
      const id = "t6-old-epoch";
      const prefill = p.engine.prefill(id, 40, 10_000).catch(() => undefined);
      await d.engine.expect({ transferId: id, tokens: 40, source: listen });
      await pState(p, id, "WAITING");
      const tKill = Date.now();
      await p.kill();
      await prefill;
      p2 = await KvNode.start({
        role: "prefill",
        engineId,
        listen,
        mode: "push",
        sidecarArgs: fastArgs(),
      });
      const tUp = Date.now();
      expect(p2.sideChannel).toBe(listen);
      expect(p2.ready.epoch).not.toBe(p.ready.epoch);
      // A new transfer to the same address reaches the new epoch and verifies.
      await goodTransfer(p2, d, "t6-new");
      const failed = await d.engineEvent(id, "failed", 10_000);
      const rel = await d.engineEvent(id, "released", REG_LEASE + GRACE + SLACK + 2000);
      expect(failed.reason).toBe("PEER_FAILED");
      expect(rel.reason).toBe("FAILED");
      expect(engineEvents(d, id).map((e) => e.event)).toEqual(["failed", "released"]);
      const dEv = await oneTerminal(d, id);
      expect(dEv.kind).toBe("FAILED");
      const down = d.events.find((e) => e.kind === "PEER_DOWN" && e.peer === engineId);
      expect(down, "D saw the old epoch go").toBeDefined();
      const ups = d.events.filter((e) => e.kind === "PEER_UP" && e.peer === engineId);
      expect(ups.map((e) => e.reason)).toEqual([
        `epoch ${p.ready.epoch}`,
        `epoch ${p2.ready.epoch}`,
      ]);
      await d.allBlocksFree();
      await p2.allBlocksFree();
      console.log(
        `[t6] P killed, restarted on ${listen} ${tUp - tKill} ms later; D: PEER_DOWN '${down!.reason}' at +${down!.timeMs - tKill} ms, old transfer KvFailed at +${at(failed) - tKill} ms, released at +${at(rel) - tKill} ms`,
      );
      await goodTransfer(p2, d, "t6-new-2");
    } finally {
      await p2?.close();
      await p?.close();
      await d.close();
    }
  }, 60_000);

  it("a late read after lease expiry is never reported ready (pull; P reused the blocks)", async () => {
    const LEASE = 400;
    await withPair(
      {
        mode: "pull",
        sidecarArgs: fastArgs(),
        pArgs: flags({ "lease-ms": LEASE }),
        // P has exactly the 3 blocks one 40-token request needs: a reuse takes the same ones.
        pEngine: { blocks: 3 },
      },
      async ({ p, d }) => {
        await goodTransfer(p, d, "t7-before", { pull: true });
        const id = "t7-late";
        const { blockIds } = await p.engine.prefill(id, 40, 0);
        const rel = await p.engineEvent(id, "released", LEASE + SWEEP + SLACK);
        expect(rel.reason).toBe("EXPIRED");
        // P's engine reuses the blocks for another request right away.
        const reuse = await p.engine.prefill("t7-reuse", 40, 0);
        expect([...reuse.blockIds].sort()).toEqual([...blockIds].sort());
        // The router hands D the stale block ids.
        const t0 = Date.now();
        await d.engine.expect({
          transferId: id,
          tokens: 40,
          source: p.sideChannel,
          sourceBlockIds: blockIds,
        });
        const failed = await d.engineEvent(id, "failed", 5000);
        const dRel = await d.engineEvent(id, "released", 5000);
        expect(failed.reason).toBe("LEASE_EXPIRED");
        expect(dRel.reason).toBe("FAILED");
        expect(engineEvents(d, id).map((e) => e.event)).toEqual(["failed", "released"]);
        const dEv = await oneTerminal(d, id);
        expect(dEv.kind).toBe("FAILED");
        expect(dEv.reason).toBe("ERR_LEASE_EXPIRED");
        expect(d.events.some((e) => e.transferId === id && e.kind === "KV_READY")).toBe(false);
        expect((await oneTerminal(p, id)).kind).toBe("EXPIRED");
        // The reused blocks' own lease runs out too.
        const reuseRel = await p.engineEvent("t7-reuse", "released", LEASE + SWEEP + SLACK);
        expect(reuseRel.reason).toBe("EXPIRED");
        await p.allBlocksFree();
        await d.allBlocksFree();
        console.log(
          `[t7] late pull of expired blocks: D failed LEASE_EXPIRED ${at(failed) - t0} ms after ExpectKv, released ${at(dRel) - t0} ms; never ready`,
        );
        await goodTransfer(p, d, "t7-after", { pull: true });
      },
    );
  }, 60_000);

  it("D aborts a pull: P lets go of its blocks at once instead of holding them to the lease", async () => {
    await withPair(
      { mode: "pull", sidecarArgs: fastArgs(), pArgs: flags({ "lease-ms": 30_000 }) },
      async ({ p, d }) => {
        const id = "t8-pull-abort";
        const { blockIds } = await p.engine.prefill(id, 40, 0);
        const t0 = Date.now();
        await d.engine.expect({
          transferId: id,
          tokens: 40,
          source: p.sideChannel,
          sourceBlockIds: blockIds,
        });
        await d.engine.call("abort", { transferId: id });
        // Either the abort won (ABORTED on both sides) or the read finished first (ready,
        // released as transferred); both end at once, far inside P's 30 s lease.
        const pRel = await p.engineEvent(id, "released", 5000);
        const pEv = await oneTerminal(p, id);
        const dEv = await oneTerminal(d, id);
        expect(at(pRel) - t0).toBeLessThan(3000);
        if (dEv.kind === "KV_READY") {
          expect(pEv.kind).toBe("RELEASED");
          expect(pRel.reason).toBe("TRANSFERRED");
        } else {
          expect(dEv.kind).toBe("ABORTED");
          expect(pEv.kind).toBe("ABORTED");
          expect(pRel.reason).toBe("ABORTED");
          expect((await d.engineEvent(id, "released", 5000)).reason).toBe("ABORTED");
        }
        await p.allBlocksFree();
        await d.allBlocksFree();
        console.log(
          `[t8] pull abort: D ${dEv.kind}, P ${pEv.kind} after ${at(pRel) - t0} ms (lease 30 000)`,
        );
        await goodTransfer(p, d, "t8-after", { pull: true });
      },
    );
  }, 60_000);
});
