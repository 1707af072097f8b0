// D's side in process (decode.ts) with fake agents, a fake peer resolver and a manual clock: the
// watchdog, the abort drain, P's Failed and AbortAck, P going down, pull confirmation, in
// milliseconds. Each case checks when D's blocks go back (never while a write may land) and the
// one terminal event.
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { FailureReason, ReleaseReason } from "../../src/gen/kvxfer/v1/engine_pb.js";
import { XferDoneSchema } from "../../src/gen/kvxfer/v1/peer_pb.js";
import type { KvLayout } from "../../src/plan/index.js";
import { DecodeSide } from "../../src/sidecar/decode.js";
import { UNKNOWN_GIVE_UP_MS } from "../../src/sidecar/decode-transfer.js";
import { PeerState } from "../../src/peer/peer-state.js";
import {
  FakeWorld,
  OP_STEPS,
  PUSH_DRAIN_MS,
  SETTINGS,
  expectKv,
  peerMetadata,
  settle,
  smallTp,
} from "./fakes.js";
import { singleGroup } from "../../src/plan/index.js";

function setup(opts: { reachable?: boolean; maxTransfers?: number; layout?: KvLayout } = {}) {
  const w = new FakeWorld(
    opts.maxTransfers !== undefined ? { maxTransfers: opts.maxTransfers } : {},
    opts.layout,
  );
  const p = w.peer("p0");
  let answer: ((peer: PeerState) => void) | undefined;
  const resolver = (): Promise<PeerState> =>
    opts.reachable === false
      ? new Promise<PeerState>((res) => (answer = res)) // the handshake hangs until told
      : Promise.resolve(p);
  const d = new DecodeSide(w.ctx, resolver);
  const state = (id: string) => d.list().find((t) => t.transferId === id)?.state;
  return { w, d, p, state, answer: () => answer!(p) };
}

/** D with two prefill peers, p1 and p2, each reached at the side channel named like it. */
function twoPeers() {
  const w = new FakeWorld({ maxTransfers: 10 });
  const p1 = w.peer("p1");
  const p2 = w.peer("p2");
  const d = new DecodeSide(w.ctx, (src) => Promise.resolve(src === "p1" ? p1 : p2));
  /** ExpectKv for `id` from the peer at `src`. */
  const expectFrom = (id: string, src: string, pull: boolean, blocks: number[]) => {
    const m = expectKv(id, pull, "", blocks);
    m.source = src;
    d.expectKv(m, pull);
  };
  return { w, d, p1, p2, expectFrom };
}

const xferDone = (transferId: string) =>
  create(XferDoneSchema, {
    transferId,
    srcRank: 0,
    dstRank: 0,
    bytes: 8192n,
    sincePrefillDoneMs: 3,
  });

describe("DecodeSide", () => {
  it("push: PushReg to P, the last XferDone makes the KV ready; one event", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1"), false);
    await settle();
    expect(state("t1")).toBe("MOVING");
    expect(w.peerSaid("t1")).toEqual(["pushReg"]);
    d.xferDone(p, 1, 0, xferDone("t1")); // from the wrong agent: refused by name
    expect(state("t1")).toBe("MOVING");
    expect(w.errors.at(-1)).toContain("names ranks 0->0 but came 1->0");
    d.xferDone(w.peer("intruder"), 0, 0, xferDone("t1")); // not the transfer's peer
    expect(state("t1")).toBe("MOVING");
    expect(w.errors.at(-1)).toContain("from 'intruder', not the engine it was registered with");
    d.xferDone(p, 0, 0, xferDone("t1"));
    expect(state("t1")).toBe("KV_READY");
    expect(w.engineSaid("t1")).toEqual(["kvReady"]);
    expect(w.eventsOf("t1")).toEqual(["KV_READY"]);
    d.xferDone(p, 0, 0, xferDone("t1")); // a duplicate changes nothing
    expect(w.eventsOf("t1")).toEqual(["KV_READY"]);
  });

  it("the watchdog while the handshake hangs: EXPIRED at once (nothing reached P)", async () => {
    const { w, d, state, answer } = setup({ reachable: false });
    d.expectKv(expectKv("t1"), false);
    w.clock.advance(SETTINGS.transferTimeoutMs - 1);
    d.expire(w.clock.now());
    expect(state("t1")).toBe("WAITING");
    w.clock.advance(1);
    d.expire(w.clock.now());
    expect(state("t1")).toBe("EXPIRED");
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.EXPIRED}`]);
    answer(); // the handshake ends after all: nothing more happens
    await settle();
    expect(w.peerSaid("t1")).toEqual([]);
    expect(w.eventsOf("t1")).toEqual(["EXPIRED"]);
  });

  it("the watchdog gives a transfer its link's time on top: the blocks in flight from that peer at the rate measured from it", async () => {
    const { w, d, p, state } = setup({ maxTransfers: 4 });
    const to = (ms: number) => w.clock.advance(ms - w.clock.now());
    const failedWith = (id: string): string | undefined => {
      for (const m of w.engine)
        if (m.case === "kvFailed" && m.value.transferId === id) return m.value.message;
      return undefined;
    };
    const expect1 = (id: string, blocks: number[], source = "127.0.0.1:1") => {
      const m = expectKv(id, false, "", blocks);
      m.numTokens = blocks.length * 16;
      m.source = source;
      d.expectKv(m, false);
    };
    // One block ready 100 ms after ExpectKv: the link carries 1 block per 100 ms.
    expect1("t0", [0]);
    await settle();
    w.clock.advance(100);
    d.xferDone(p, 0, 0, xferDone("t0"));
    expect(state("t0")).toBe("KV_READY");
    // Two more from the same peer, 1 and 4 blocks, and one from a peer never measured.
    const at = w.clock.now();
    expect1("t1", [1]);
    expect1("t2", [2, 3, 4, 5]);
    expect1("t3", [6], "127.0.0.1:2");
    await settle();
    w.clock.advance(SETTINGS.transferTimeoutMs);
    d.expire(w.clock.now());
    // The unmeasured link: the timeout alone. t1 and t2 share theirs: its time for both (5
    // blocks, 500 ms), whichever finishes first.
    expect(state("t3")).toBe("DRAINING");
    expect(state("t1")).toBe("MOVING");
    expect(state("t2")).toBe("MOVING");
    to(at + SETTINGS.transferTimeoutMs + 499);
    d.expire(w.clock.now());
    expect([state("t1"), state("t2")]).toEqual(["MOVING", "MOVING"]);
    to(at + SETTINGS.transferTimeoutMs + 500);
    d.expire(w.clock.now());
    expect([state("t1"), state("t2")]).toEqual(["DRAINING", "DRAINING"]);
    expect(failedWith("t1")).toBe(
      `no KV within ${SETTINGS.transferTimeoutMs} ms and the 500 ms its link's measured rate allowed`,
    );
    expect(failedWith("t3")).toBe(`no KV within ${SETTINGS.transferTimeoutMs} ms`);
  });

  it("the watchdog after PushReg: KvFailed now, blocks back only when P's registration lease is surely over", async () => {
    const { w, d, state } = setup();
    d.expectKv(expectKv("t1"), false);
    await settle();
    const registeredAt = w.clock.now();
    w.clock.advance(SETTINGS.transferTimeoutMs);
    d.expire(w.clock.now());
    expect(state("t1")).toBe("DRAINING");
    expect(w.engineSaid("t1")).toEqual(["kvFailed"]);
    expect(w.peerSaid("t1")).toEqual(["pushReg", "abort"]);
    // The drain's end: the last renewal (at registration) + P's lease + the grace.
    const end = registeredAt + PUSH_DRAIN_MS;
    expect(w.clock.now()).toBeGreaterThanOrEqual(end); // already past it: next sweep ends it
    d.expire(w.clock.now());
    expect(state("t1")).toBe("EXPIRED");
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.EXPIRED}`]);
    expect(w.eventsOf("t1")).toEqual(["EXPIRED"]);
  });

  it("the engine aborts a push: blocks wait for P's AbortAck (or the lease), then ABORTED", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1"), false);
    d.expectKv(expectKv("t2", false, "", [6, 7]), false);
    await settle();
    d.heartbeatIds(w.clock.now()); // renews both registrations now
    d.abort("t1");
    d.abort("t2");
    expect(state("t1")).toBe("DRAINING");
    expect(w.engineSaid("t1")).toEqual(["kvFailed"]);
    // t1: P acknowledges -> blocks back at once.
    d.abortAck(p, "t1");
    expect(state("t1")).toBe("ABORTED");
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.ABORTED}`]);
    // t2: P never answers -> blocks back when the lease (+ grace) is surely over, not before.
    w.clock.advance(PUSH_DRAIN_MS - 1);
    d.expire(w.clock.now());
    expect(state("t2")).toBe("DRAINING");
    w.clock.advance(1);
    d.expire(w.clock.now());
    expect(state("t2")).toBe("ABORTED");
    expect(w.eventsOf("t1")).toEqual(["ABORTED"]);
    expect(w.eventsOf("t2")).toEqual(["ABORTED"]);
  });

  it("heartbeats move the drain bound: the registration lease runs from the last renewal", async () => {
    const { w, d, state } = setup();
    d.expectKv(expectKv("t1"), false);
    await settle();
    w.clock.advance(500);
    d.heartbeatIds(w.clock.now());
    d.abort("t1");
    w.clock.advance(PUSH_DRAIN_MS - 1);
    d.expire(w.clock.now());
    expect(state("t1"), "P may still write until its renewed lease ends").toBe("DRAINING");
    w.clock.advance(1);
    d.expire(w.clock.now());
    expect(state("t1")).toBe("ABORTED");
  });

  it("P's Failed for a push: its writes are over, blocks back at once", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1"), false);
    await settle();
    expect(d.peerFailed(p, "t1", "ERR_LEASE_EXPIRED", "lease")).toBe(true);
    expect(state("t1")).toBe("FAILED");
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.FAILED}`]);
    // From another peer, or for an unknown transfer: not D's.
    expect(d.peerFailed(w.peer("other"), "t1", "ERR_X", "")).toBe(false);
    expect(d.peerFailed(p, "nope", "ERR_X", "")).toBe(false);
  });

  it("P goes down: a push drains to the lease, a pull with no reads in flight fails at once", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("push"), false);
    await settle();
    d.expectKv(expectKv("pull", true, "", [6, 7]), true);
    await settle();
    w.agent.landAll();
    await settle();
    expect(state("pull")).toBe("CONFIRMING");
    d.peerDown(p, "silent");
    expect(state("push")).toBe("DRAINING");
    expect(state("pull")).toBe("FAILED");
    expect(d.liveWith(p)).toBe(true);
    w.clock.advance(PUSH_DRAIN_MS);
    d.expire(w.clock.now());
    expect(state("push")).toBe("FAILED");
    expect(d.liveWith(p)).toBe(false);
    expect(w.eventsOf("push")).toEqual(["FAILED"]);
    expect(w.eventsOf("pull")).toEqual(["FAILED"]);
  });

  it("pull: reads, then P's ReadAck; 'unknown' asks again 10 ms later, 'held' makes it ready", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    expect(state("t1")).toBe("MOVING");
    w.agent.landAll();
    await settle();
    expect(state("t1")).toBe("CONFIRMING");
    expect(w.peerSaid("t1")).toEqual(["readDone"]);
    d.readAck(p, "t1", false, true);
    expect(w.peerSaid("t1")).toEqual(["readDone"]);
    w.clock.advance(10);
    expect(w.peerSaid("t1")).toEqual(["readDone", "readDone"]);
    d.readAck(p, "t1", true, false);
    expect(state("t1")).toBe("KV_READY");
    expect(w.eventsOf("t1")).toEqual(["KV_READY"]);
  });

  it("pull: a transfer P still does not know after UNKNOWN_GIVE_UP_MS fails then, not at the watchdog", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    w.agent.landAll();
    await settle();
    for (let ms = 0; ms < UNKNOWN_GIVE_UP_MS; ms += 10) {
      d.readAck(p, "t1", false, true);
      expect(state("t1")).toBe("CONFIRMING");
      w.clock.advance(10);
    }
    d.readAck(p, "t1", false, true);
    expect(state("t1")).toBe("FAILED");
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.FAILED}`]);
  });

  it("pull: P released the blocks before confirming: FAILED, never ready", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    w.agent.landAll();
    await settle();
    d.readAck(p, "t1", false, false);
    expect(state("t1")).toBe("FAILED");
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.FAILED}`]);
  });

  it("an abort during a pull's reads: blocks back only once the reads settle", async () => {
    const { w, d, state } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    expect(state("t1")).toBe("MOVING");
    d.abort("t1");
    expect(state("t1")).toBe("DRAINING");
    expect(w.engineSaid("t1")).toEqual(["kvFailed"]);
    expect(w.peerSaid("t1")).toEqual(["abort"]);
    w.clock.advance(60_000);
    d.expire(w.clock.now());
    expect(state("t1"), "reads in flight hold the blocks, whatever the time").toBe("DRAINING");
    w.agent.failAll();
    await settle();
    expect(state("t1")).toBe("ABORTED");
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.ABORTED}`]);
    expect(w.eventsOf("t1")).toEqual(["ABORTED"]);
  });

  it("blocks a live transfer writes are refused to another (ERR_BLOCKS_IN_USE) until it ends", async () => {
    const { w, d, p } = setup();
    d.expectKv(expectKv("t1"), false);
    d.expectKv(expectKv("t2"), false);
    expect(w.refused).toEqual([{ transferId: "t2", code: "ERR_BLOCKS_IN_USE" }]);
    await settle();
    d.xferDone(p, 0, 0, xferDone("t1"));
    d.expectKv(expectKv("t2"), false);
    expect(w.refused).toHaveLength(1);
  });

  it("XferDone counts only for a moving push of its own peer: bytes summed, P's latency kept", async () => {
    const w = new FakeWorld({}, smallTp(2));
    const p = w.peer("p0");
    const d = new DecodeSide(w.ctx, () => Promise.resolve(p));
    const state = (id: string) => d.list().find((t) => t.transferId === id)?.state;
    const done = (id: string, src: number, dst: number, bytes: bigint, ms: number) =>
      create(XferDoneSchema, {
        transferId: id,
        srcRank: src,
        dstRank: dst,
        bytes,
        sincePrefillDoneMs: ms,
      });
    // A pull never takes an XferDone, however well formed.
    d.expectKv(expectKv("pull1", true), true);
    await settle();
    d.xferDone(p, 0, 0, done("pull1", 0, 0, 1n, 1));
    d.xferDone(p, 1, 1, done("pull1", 1, 1, 1n, 1));
    expect(state("pull1")).toBe("MOVING");
    expect(w.engineSaid("pull1")).toEqual([]);
    // A push over two rank pairs: ready at the second, not before; a repeat of the first is no pair.
    d.expectKv(expectKv("t1", false, "", [6, 7]), false);
    await settle();
    const startedBefore = d.list().find((t) => t.transferId === "t1")!.timings.dataStartedMs;
    expect(startedBefore).toBe(0);
    w.clock.advance(5);
    d.xferDone(p, 0, 0, done("t1", 0, 0, 3000n, 7));
    const started = d.list().find((t) => t.transferId === "t1")!.timings.dataStartedMs;
    expect(started).toBe(w.clock.now());
    w.clock.advance(5);
    d.xferDone(p, 0, 0, done("t1", 0, 0, 3000n, 7));
    expect(state("t1")).toBe("MOVING");
    expect(d.list().find((t) => t.transferId === "t1")!.timings.dataStartedMs, "set once").toBe(
      started,
    );
    d.xferDone(p, 1, 1, done("t1", 1, 1, 5000n, 4));
    expect(state("t1")).toBe("KV_READY");
    // The bytes of each pair once, and P's longest time from PrefillDone (not the last one's).
    expect(w.ready).toEqual([{ mode: "push", latencyMs: 7, bytes: 8000 }]);
    expect(d.list().find((t) => t.transferId === "t1")!.bytes).toBe(8000);
  });

  it("P's ReadAck counts only for a confirming pull of its own peer", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    d.readAck(p, "t1", true, false); // reads still in flight: not confirming yet
    expect(state("t1")).toBe("MOVING");
    w.agent.landAll();
    await settle();
    expect(state("t1")).toBe("CONFIRMING");
    d.readAck(w.peer("intruder"), "t1", true, false); // another engine's answer
    expect(state("t1")).toBe("CONFIRMING");
    d.readAck(p, "no-such", true, false);
    d.readAck(p, "t1", true, false);
    expect(state("t1")).toBe("KV_READY");
    expect(w.ready.map((r) => r.mode)).toEqual(["pull"]);
  });

  it("P's AbortAck and Failed count only for their own peer's live transfer", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1"), false);
    await settle();
    d.abort("t1"); // DRAINING: blocks wait for P's AbortAck
    expect(state("t1")).toBe("DRAINING");
    d.abortAck(w.peer("intruder"), "t1");
    expect(state("t1"), "another engine's AbortAck").toBe("DRAINING");
    expect(d.peerFailed(w.peer("intruder"), "t1", "ERR_X", "x")).toBe(false);
    expect(state("t1")).toBe("DRAINING");
    d.abortAck(p, "t1");
    expect(state("t1")).toBe("ABORTED");
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.ABORTED}`]);
    // Ended: P's late Failed is not this transfer's any more.
    expect(d.peerFailed(p, "t1", "ERR_X", "x")).toBe(false);
    expect(w.eventsOf("t1")).toEqual(["ABORTED"]);
  });

  // --- cases aimed at mutants that survived the mutation run (docs/testing.md) ---------------

  it("a duplicate ExpectKv is refused and leaves the first transfer as it was; its tombstone outlives a sweep", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1"), false);
    await settle();
    d.expectKv(expectKv("t1", false, "", [4, 5]), false); // live: refused, not replaced
    expect(w.refused).toEqual([{ transferId: "t1", code: "ERR_DUPLICATE" }]);
    expect(state("t1")).toBe("MOVING");
    expect(d.list().find((t) => t.transferId === "t1")!.peer).toBe("p0");
    d.xferDone(p, 0, 0, xferDone("t1"));
    expect(state("t1")).toBe("KV_READY");
    // Ended: remembered for tombstoneMs, across sweeps, then forgotten.
    w.clock.advance(1);
    d.expire(w.clock.now());
    d.expectKv(expectKv("t1"), false);
    expect(w.refused.at(-1)).toEqual({ transferId: "t1", code: "ERR_DUPLICATE" });
    w.clock.advance(SETTINGS.tombstoneMs - 2);
    d.expire(w.clock.now());
    expect(state("t1")).toBe("KV_READY");
    w.clock.advance(1);
    d.expire(w.clock.now());
    expect(state("t1")).toBeUndefined();
    d.expectKv(expectKv("t1"), false); // a new transfer under the old id
    expect(w.refused).toHaveLength(2);
    expect(state("t1")).toBe("WAITING");
  });

  it("a failed transfer's tombstone also outlives a sweep", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1"), false);
    await settle();
    expect(d.peerFailed(p, "t1", "ERR_X", "x")).toBe(true);
    expect(state("t1")).toBe("FAILED");
    w.clock.advance(1);
    d.expire(w.clock.now());
    expect(state("t1")).toBe("FAILED");
    w.clock.advance(SETTINGS.tombstoneMs);
    d.expire(w.clock.now());
    expect(state("t1")).toBeUndefined();
  });

  it("blocks of a cached prefix are not claimed: two transfers sharing only prefix blocks both go on", async () => {
    const { w, d, state } = setup({ maxTransfers: 8 });
    // Block size 16: 20 tokens with 16 cached write block 1 only (block 0 holds the prefix).
    const a = expectKv("a", false, "", [7, 8]);
    a.prefixTokens = 16;
    const b = expectKv("b", false, "", [7, 9]);
    b.prefixTokens = 16;
    d.expectKv(a, false);
    d.expectKv(b, false);
    expect(w.refused).toEqual([]);
    await settle();
    expect([state("a"), state("b")]).toEqual(["MOVING", "MOVING"]);
    // A block past the prefix is claimed: a third transfer writing block 8 is refused.
    const c = expectKv("c", false, "", [8, 10]);
    d.expectKv(c, false);
    expect(w.refused).toEqual([{ transferId: "c", code: "ERR_BLOCKS_IN_USE" }]);
  });

  it("a pull's heartbeats name it while its reads run and while P confirms them", async () => {
    const { w, d, state } = setup();
    d.expectKv(expectKv("pull1", true), true);
    await settle();
    expect(state("pull1")).toBe("MOVING");
    const named = () => [...d.heartbeatIds(w.clock.now())].map(([p, ids]) => [p.engineId, ids]);
    expect(named(), "reads in flight").toEqual([["p0", ["pull1"]]]);
    w.agent.landAll();
    await settle();
    expect(w.peerSaid("pull1")).toEqual(["readDone"]);
    expect(state("pull1")).toBe("CONFIRMING");
    expect(named(), "waiting for P's ReadAck").toEqual([["p0", ["pull1"]]]);
  });

  it("an ExpectKv refused while draining: P, if named, hears ERR_DRAINING with the token", async () => {
    const { w, d } = setup();
    const m = expectKv("t9", true, "tok-9");
    m.source = "p0";
    d.tellSourceDraining(m);
    await settle();
    expect(w.peerSaid("t9")).toEqual(["failed:ERR_DRAINING"]);
    const said = w.toPeer.find((x) => x.body.case === "failed")!.body.value as { token: string };
    expect(said.token).toBe("tok-9");
    const unnamed = expectKv("t10", true);
    unnamed.source = "";
    d.tellSourceDraining(unnamed); // no source: nobody to tell
    // P unreachable: nothing sent, nothing thrown.
    const unreachable = new DecodeSide(w.ctx, () => Promise.reject(new Error("no route")));
    const m2 = expectKv("t11", true);
    m2.source = "p9";
    unreachable.tellSourceDraining(m2);
    await settle();
    expect(w.peerSaid("t10")).toEqual([]);
    expect(w.peerSaid("t11")).toEqual([]);
    expect(d.list()).toEqual([]);
  });

  it("heartbeats name every live transfer with a peer, per peer, and none that is draining or ended", async () => {
    const { w, d, p } = setup({ maxTransfers: 8 });
    for (const id of ["t1", "t2", "t3"])
      d.expectKv(expectKv(id, false, "", [10 + 2 * Number(id[1]), 11 + 2 * Number(id[1])]), false);
    await settle();
    expect([...d.heartbeatIds(w.clock.now())].map(([peer, ids]) => [peer.engineId, ids])).toEqual([
      ["p0", ["t1", "t2", "t3"]],
    ]);
    d.abort("t2"); // DRAINING: its lease must run out, not be renewed
    d.xferDone(p, 0, 0, xferDone("t3")); // ended
    expect([...d.heartbeatIds(w.clock.now())].map(([peer, ids]) => [peer.engineId, ids])).toEqual([
      ["p0", ["t1"]],
    ]);
  });

  it("P's Failed names the reason D reports: a lapsed lease is LEASE_EXPIRED, anything else PEER_FAILED", async () => {
    const { w, d, p } = setup();
    d.expectKv(expectKv("t1"), false);
    d.expectKv(expectKv("t2", false, "", [6, 7]), false);
    await settle();
    expect(d.peerFailed(p, "t1", "ERR_LEASE_EXPIRED", "lease over")).toBe(true);
    expect(d.peerFailed(p, "t2", "ERR_TRANSFER", "write failed")).toBe(true);
    const failed = (id: string) =>
      w.engine.find((m) => m.case === "kvFailed" && m.value.transferId === id)!.value as {
        reason: number;
      };
    expect(failed("t1").reason).toBe(FailureReason.LEASE_EXPIRED);
    expect(failed("t2").reason).toBe(FailureReason.PEER_FAILED);
  });

  it("P's Failed during a pull's reads: KvFailed at once, blocks back only once the reads settle; a push's at once", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    expect(state("t1")).toBe("MOVING"); // reads posted, not landed
    expect(d.peerFailed(p, "t1", "ERR_TRANSFER", "P gave up")).toBe(true);
    expect(w.engineSaid("t1")).toEqual(["kvFailed"]);
    expect(state("t1"), "the reads may still write D's blocks").toBe("DRAINING");
    w.agent.failAll();
    await settle();
    expect(state("t1")).toBe("FAILED");
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.FAILED}`]);
    // A pull whose reads all landed (waiting for P's ReadAck): nothing can write, blocks back at once.
    d.expectKv(expectKv("t3", true, "", [6, 7]), true);
    await settle();
    w.agent.landAll();
    await settle();
    expect(state("t3")).toBe("CONFIRMING");
    expect(d.peerFailed(p, "t3", "ERR_TRANSFER", "P gave up")).toBe(true);
    expect(w.engineSaid("t3")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.FAILED}`]);
    // A push: P's Failed means its writes are over, so the blocks go back at once.
    d.expectKv(expectKv("t2", false, "", [4, 5]), false);
    await settle();
    expect(d.peerFailed(p, "t2", "ERR_TRANSFER", "P gave up")).toBe(true);
    expect(w.engineSaid("t2")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.FAILED}`]);
  });
});

describe("DecodeSide: each failure path by name, and the timings it reports", () => {
  /** The KvFailed D sent for `id`. */
  const kvFailed = (w: FakeWorld, id: string) => {
    const m = w.engine.find((x) => x.case === "kvFailed" && x.value.transferId === id);
    return m?.value as { reason: FailureReason; message: string };
  };

  it("a pull without source block ids is refused ERR_NO_SOURCE_BLOCKS and claims nothing", async () => {
    const { w, d, state } = setup();
    const m = expectKv("t1", true);
    m.hasSourceBlockIds = false;
    m.sourceBlockIds = [];
    d.expectKv(m, true);
    expect(w.refused).toEqual([{ transferId: "t1", code: "ERR_NO_SOURCE_BLOCKS" }]);
    expect(state("t1")).toBeUndefined();
    // The same blocks are free for the next transfer; a push needs no source blocks.
    d.expectKv(m, false);
    await settle();
    expect(state("t1")).toBe("MOVING");
    expect(w.refused).toHaveLength(1);
  });

  it("a handshake that fails: FAILED at once, INCOMPATIBLE for a layout D cannot pair with, else UNREACHABLE", async () => {
    const w = new FakeWorld();
    const codes = ["ERR_LAYOUT_INCOMPATIBLE", "ERR_UNREACHABLE", "ERR_TIMEOUT"];
    let i = 0;
    const d = new DecodeSide(w.ctx, () =>
      Promise.reject(Object.assign(new Error(`no: ${codes[i]}`), { code: codes[i++] })),
    );
    d.expectKv(expectKv("a", false, "", [2, 3]), false);
    await settle();
    d.expectKv(expectKv("b", true, "", [4, 5]), true);
    await settle();
    d.expectKv(expectKv("c", false, "", [6, 7]), false);
    await settle();
    expect(d.list().map((t) => [t.transferId, t.state, t.reason])).toEqual([
      ["a", "FAILED", "ERR_LAYOUT_INCOMPATIBLE"],
      ["b", "FAILED", "ERR_UNREACHABLE"],
      ["c", "FAILED", "ERR_TIMEOUT"],
    ]);
    expect([kvFailed(w, "a").reason, kvFailed(w, "b").reason, kvFailed(w, "c").reason]).toEqual([
      FailureReason.INCOMPATIBLE,
      FailureReason.UNREACHABLE,
      FailureReason.UNREACHABLE,
    ]);
    expect(kvFailed(w, "b").message).toBe("no: ERR_UNREACHABLE");
    for (const id of ["a", "b", "c"])
      expect(w.engineSaid(id)).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.FAILED}`]);
    expect(w.toPeer).toEqual([]);
    expect(w.failures).toEqual(["ERR_LAYOUT_INCOMPATIBLE", "ERR_UNREACHABLE", "ERR_TIMEOUT"]);
  });

  it("aborted while the handshake runs: a pull tells P to let go once it is reached, a push tells P nothing", async () => {
    const w = new FakeWorld();
    const p = w.peer("p0");
    const waiting: (() => void)[] = [];
    const d = new DecodeSide(
      w.ctx,
      () => new Promise<PeerState>((res) => waiting.push(() => res(p))),
    );
    const state = (id: string) => d.list().find((t) => t.transferId === id)?.state;
    d.expectKv(expectKv("pull", true, "tok", [2, 3]), true);
    d.expectKv(expectKv("push", false, "", [4, 5]), false);
    d.abort("pull");
    d.abort("push");
    expect([state("pull"), state("push")]).toEqual(["ABORTED", "ABORTED"]);
    expect(w.engineSaid("pull")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.ABORTED}`]);
    for (const go of waiting) go();
    await settle();
    expect(w.toPeer).toEqual([
      {
        peer: "p0",
        body: {
          case: "abort",
          value: { transferId: "pull", reason: "ERR_ABORTED", token: "tok" },
        },
      },
    ]);
    expect(w.agent.ops).toEqual([]);
    expect([state("pull"), state("push")]).toEqual(["ABORTED", "ABORTED"]);
  });

  it("a pull D cannot plan (fewer source blocks than tokens): FAILED BAD_REQUEST, P told to let go, no read posted", async () => {
    const { w, d, state } = setup();
    const m = expectKv("t1", true);
    m.sourceBlockIds = [0];
    d.expectKv(m, true);
    await settle();
    expect(state("t1")).toBe("FAILED");
    expect(kvFailed(w, "t1").reason).toBe(FailureReason.BAD_REQUEST);
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.FAILED}`]);
    expect(w.peerSaid("t1")).toEqual(["abort"]);
    expect(w.agent.ops).toEqual([]);
  });

  it("a read the addon refuses to post, or one that fails: FAILED TRANSFER_ERROR, P told why, blocks back at once", async () => {
    const { w, d, state } = setup();
    w.agent.failToPost = true;
    d.expectKv(expectKv("t1", true), true);
    await settle();
    expect(state("t1")).toBe("FAILED");
    expect(kvFailed(w, "t1").reason).toBe(FailureReason.TRANSFER_ERROR);
    // P hears why, then (as for any pull D gives up on) that it may let go of its blocks.
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_OUT_OF_BOUNDS", "abort"]);
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.FAILED}`]);
    w.agent.failToPost = false;
    d.expectKv(expectKv("t2", true, "", [4, 5]), true);
    await settle();
    expect(state("t2")).toBe("MOVING");
    expect(d.readingFrom(w.peer("p0"))).toBe(false); // another PeerState of the same engine
    w.agent.failAll("UCS_ERR_IO_ERROR");
    await settle();
    expect(state("t2")).toBe("FAILED");
    expect(w.peerSaid("t2")).toEqual(["failed:ERR_TRANSFER", "abort"]);
    expect(kvFailed(w, "t2").message).toBe("UCS_ERR_IO_ERROR");
  });

  it("the watchdog during a pull's reads: KvFailed at once, EXPIRED only once the reads settle", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    expect(d.readingFrom(p)).toBe(true);
    w.clock.advance(SETTINGS.transferTimeoutMs);
    d.expire(w.clock.now());
    expect(state("t1")).toBe("DRAINING");
    expect(kvFailed(w, "t1").reason).toBe(FailureReason.TIMEOUT);
    expect(w.peerSaid("t1")).toEqual(["abort"]);
    w.agent.landAll();
    await settle();
    expect(state("t1")).toBe("EXPIRED");
    expect(d.readingFrom(p)).toBe(false);
    expect(w.peerSaid("t1"), "no ReadDone for reads of a transfer given up").toEqual(["abort"]);
    expect(w.engineSaid("t1")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.EXPIRED}`]);
  });

  it("P's Failed while D drains: a push ends at once (P's writes are over), a pull still waits for its reads", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("push"), false);
    d.expectKv(expectKv("pull", true, "", [4, 5]), true);
    await settle();
    d.abort("push");
    d.abort("pull");
    expect([state("push"), state("pull")]).toEqual(["DRAINING", "DRAINING"]);
    expect(d.peerFailed(p, "push", "ERR_ABORTED", "ok")).toBe(true);
    expect(d.peerFailed(p, "pull", "ERR_ABORTED", "ok")).toBe(true);
    expect([state("push"), state("pull")]).toEqual(["ABORTED", "DRAINING"]);
    expect(d.peerFailed(p, "push", "ERR_ABORTED", "again")).toBe(false);
    w.agent.landAll();
    await settle();
    expect(state("pull")).toBe("ABORTED");
  });

  it("a push's timings and metrics: registered, data from the first XferDone to the last, P's latency", async () => {
    const { w, d, p } = setup({ layout: smallTp(2) });
    const t0 = w.clock.now();
    d.expectKv(expectKv("t1"), false);
    await settle();
    w.clock.advance(5);
    const done = (src: number, dst: number, ms: number) =>
      create(XferDoneSchema, {
        transferId: "t1",
        srcRank: src,
        dstRank: dst,
        bytes: 100n,
        sincePrefillDoneMs: ms,
      });
    d.xferDone(p, 0, 0, done(0, 0, 9), { receivedUs: 11, deliveredUs: 12 });
    w.clock.advance(3);
    d.xferDone(p, 1, 1, done(1, 1, 4));
    const info = d.list()[0]!;
    expect(info.timings).toMatchObject({
      registeredMs: t0,
      dataStartedMs: t0 + 5,
      dataDoneMs: t0 + 8,
      readyMs: t0 + 8,
      endedMs: t0 + 8,
    });
    expect(info.bytes).toBe(200);
    expect(info.trace).toEqual(
      expect.arrayContaining([
        { hop: "pair 0>0 xferDone received", us: 11 },
        { hop: "pair 0>0 xferDone delivered", us: 12 },
      ]),
    );
    expect(w.ready).toEqual([{ mode: "push", latencyMs: 9, bytes: 200 }]);
    expect(w.moved).toBe(200);
  });

  it("a pull's timings and metrics: data from the reads' start to their end, latency from registration", async () => {
    const { w, d, p } = setup();
    const t0 = w.clock.now();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    w.clock.advance(4);
    w.agent.landAll();
    await settle();
    w.clock.advance(2);
    d.readAck(p, "t1", true, false, { receivedUs: 21, deliveredUs: 22 });
    const info = d.list()[0]!;
    expect(info.timings).toMatchObject({
      registeredMs: t0,
      dataStartedMs: t0,
      dataDoneMs: t0 + 4,
      readyMs: t0 + 6,
      endedMs: t0 + 6,
    });
    expect(info.bytes).toBeGreaterThan(0);
    expect(info.descriptors).toBeGreaterThan(0);
    expect(info.trace).toEqual(
      expect.arrayContaining([
        { hop: "peer.readAck received", us: 21 },
        { hop: "peer.readAck delivered", us: 22 },
      ]),
    );
    expect(w.ready).toEqual([{ mode: "pull", latencyMs: 6, bytes: info.bytes }]);
  });

  it("an ended transfer is forgotten after the tombstone time, not before", async () => {
    const { w, d, p } = setup();
    d.expectKv(expectKv("t1"), false);
    await settle();
    d.xferDone(p, 0, 0, xferDone("t1"));
    w.clock.advance(SETTINGS.tombstoneMs - 1);
    d.expire(w.clock.now());
    expect(d.list()).toHaveLength(1);
    w.clock.advance(1);
    d.expire(w.clock.now());
    expect(d.list()).toEqual([]);
  });
});

describe("DecodeSide: the edges", () => {
  it("an XferDone for a transfer D never had is noted by name and changes nothing", async () => {
    const { w, d, p } = setup();
    d.xferDone(p, 0, 0, xferDone("nobody"));
    expect(w.errors).toEqual([
      "XferDone from 'p0' for unknown transfer 'nobody': ERR_UNKNOWN_TRANSFER",
    ]);
    expect(d.list()).toEqual([]);
    expect(w.engine).toEqual([]);
  });
});

describe("DecodeSide: traces, peers and words", () => {
  it("traces a push and a pull: each hop once, in order, the pull's reads named by their pair", async () => {
    const { w, d, p } = setup();
    d.expectKv(expectKv("push"), false, 100);
    await settle();
    d.xferDone(p, 0, 0, xferDone("push"), { receivedUs: 200, deliveredUs: 300 });
    const hops = (id: string) => d.infoOf(id)!.trace.map((h) => h.hop);
    expect(hops("push")).toEqual([
      "engine.expectKv",
      "peer.resolved",
      "peer.pushReg sent",
      "pair 0>0 xferDone received",
      "pair 0>0 xferDone delivered",
      "engine.kvReady sent",
      "event.appended",
    ]);
    expect(d.infoOf("push")!.trace[0]!.us).toBe(100);
    d.expectKv(expectKv("pull", true, "", [4, 5]), true, 400);
    await settle();
    w.agent.landAll();
    await settle();
    d.readAck(p, "pull", true, false);
    const pull = hops("pull");
    expect(pull.slice(0, 3)).toEqual(["engine.expectKv", "peer.resolved", "planned"]);
    expect(pull).toContain("pair 0>0 submitted");
    expect(pull).toContain("pair 0>0 flushed");
    expect(pull.slice(-3)).toEqual(["peer.readDone sent", "engine.kvReady sent", "event.appended"]);
    // A failed transfer's trace ends with its event too.
    d.expectKv(expectKv("aborted", false, "", [6, 7]), false);
    d.abort("aborted");
    await settle(); // its peer resolves after the abort: no hop for it
    expect(hops("aborted")).toEqual(["engine.expectKv", "event.appended"]);
  });

  it("one P going down fails only its own transfers; a pull's reads in flight keep the blocks", async () => {
    const { w, d, p1, p2, expectFrom } = twoPeers();
    const state = (id: string) => d.infoOf(id)?.state;
    expectFrom("a", "p1", true, [0, 1]);
    expectFrom("b", "p2", true, [2, 3]);
    expectFrom("c", "p2", false, [4, 5]);
    await settle();
    d.peerDown(p1, "gone");
    expect([state("a"), state("b"), state("c")]).toEqual(["DRAINING", "MOVING", "MOVING"]);
    expect(w.engineSaid("a")).toEqual(["kvFailed"]);
    expect(w.peerSaid("a"), "P is gone: no abort sent to it").toEqual([]);
    expect(d.readingFrom(p1)).toBe(true);
    expect(d.readingFrom(p2)).toBe(true);
    expect(d.liveWith(p2)).toBe(true);
    w.agent.failAll();
    await settle();
    expect(state("a")).toBe("FAILED");
    expect(d.infoOf("a")!.reason).toBe("ERR_PEER_DOWN");
    expect(w.engineSaid("a")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.FAILED}`]);
  });

  it("P's Failed for a pull: no abort sent back; the engine aborting a draining transfer changes nothing", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    w.agent.landAll();
    await settle();
    expect(d.peerFailed(p, "t1", "ERR_LEASE_EXPIRED", "lease")).toBe(true);
    expect(w.peerSaid("t1")).toEqual(["readDone"]);
    d.expectKv(expectKv("t2", false, "", [4, 5]), false);
    await settle();
    d.abort("t2");
    expect(state("t2")).toBe("DRAINING");
    d.abort("t2");
    d.expire(w.clock.now());
    expect(w.engineSaid("t2")).toEqual(["kvFailed"]);
    expect(w.peerSaid("t2")).toEqual(["pushReg", "abort"]);
    expect(state("t2")).toBe("DRAINING");
  });

  it("refusals and failures say what was wrong", async () => {
    const { w, d, p } = setup({ maxTransfers: 2 });
    d.expectKv(expectKv("t1"), false);
    d.expectKv(expectKv("t1"), false);
    const m = expectKv("t3", true, "", [4, 5]);
    m.hasSourceBlockIds = false;
    d.expectKv(m, true);
    d.expectKv(expectKv("t2", false, "", [2, 6]), false);
    d.expectKv(expectKv("t4", false, "", [6, 7]), false);
    d.expectKv(expectKv("t5", false, "", [0, 1]), false);
    expect(w.refusedText).toEqual([
      "ERR_DUPLICATE: ExpectKv for transfer 't1' already received",
      "ERR_NO_SOURCE_BLOCKS: pull mode needs ExpectKv.source_block_ids",
      "ERR_BLOCKS_IN_USE: block_ids[0] = 2 is held by live transfer 't1' (two live transfers may not claim one block; retry once it ends)",
      "ERR_OVERLOADED: 2 transfers live",
    ]);
    await settle();
    w.clock.advance(SETTINGS.transferTimeoutMs);
    d.expire(w.clock.now());
    const failed = w.engine.filter((x) => x.case === "kvFailed").map((x) => x.value);
    expect(failed.map((v) => [v.transferId, (v as { message: string }).message])).toEqual([
      ["t1", `no KV within ${SETTINGS.transferTimeoutMs} ms`],
      ["t4", `no KV within ${SETTINGS.transferTimeoutMs} ms`],
    ]);
    expect(w.events.filter((e) => e.kind !== "KV_READY").map((e) => e.reason)).toEqual([]);
    w.clock.advance(PUSH_DRAIN_MS);
    d.expire(w.clock.now());
    expect(w.events.map((e) => `${e.transferId} ${e.kind} ${e.reason}`)).toEqual([
      "t1 EXPIRED ERR_TIMEOUT",
      "t4 EXPIRED ERR_TIMEOUT",
    ]);
    d.expectKv(expectKv("t6", true, "", [0, 1]), true);
    await settle();
    w.agent.landAll();
    await settle();
    d.readAck(p, "t6", false, false);
    expect(w.engine.at(-2)).toMatchObject({
      case: "kvFailed",
      value: { transferId: "t6", message: "P released the blocks before D's read was confirmed" },
    });
    expect(d.infoOf("t6")!.reason).toBe("ERR_LEASE_EXPIRED");
    d.expectKv(expectKv("t7", false, "", [0, 1]), false);
    await settle();
    d.peerFailed(p, "t7", "ERR_TRANSFER", "disk on fire");
    expect(w.engine.at(-2)).toMatchObject({
      case: "kvFailed",
      value: { transferId: "t7", message: "prefill side: disk on fire" },
    });
  });
});

describe("DecodeSide: block claims", () => {
  it("a clash names the position in block_ids, counted past the cached prefix", () => {
    const { w, d } = setup({ maxTransfers: 5 });
    d.expectKv(expectKv("t1", false, "", [2, 3]), false);
    const m = expectKv("t2", false, "", [0, 5, 3]);
    m.numTokens = 40;
    m.prefixTokens = 16; // block 0 is a cached prefix: read, not written, not claimed
    d.expectKv(m, false);
    expect(w.refusedText).toEqual([
      "ERR_BLOCKS_IN_USE: block_ids[2] = 3 is held by live transfer 't1' (two live transfers may not claim one block; retry once it ends)",
    ]);
  });
});

describe("DecodeSide: what a live transfer lists", () => {
  it("no peer and no reason while the handshake runs; the ready event has no reason", async () => {
    const { d, w, p, answer } = setup({ reachable: false });
    d.expectKv(expectKv("t1"), false);
    expect(d.infoOf("t1")).toMatchObject({ state: "WAITING", peer: "", reason: "", mode: "push" });
    answer();
    await settle();
    expect(d.infoOf("t1")).toMatchObject({ state: "MOVING", peer: "p0", reason: "" });
    d.xferDone(p, 0, 0, xferDone("t1"));
    expect(w.events).toEqual([{ kind: "KV_READY", transferId: "t1", side: "decode", reason: "" }]);
  });
});

describe("DecodeSide: late and stray messages", () => {
  it("blocks past the tokens are not claimed: another transfer may write them", () => {
    const { w, d } = setup({ maxTransfers: 5 });
    d.expectKv(expectKv("t1", false, "", [2, 3, 4]), false); // 20 tokens: two blocks written
    d.expectKv(expectKv("t2", false, "", [4, 5]), false);
    expect(w.refused).toEqual([]);
  });

  it("the engine's abort tells the engine why; a failed transfer's end is stamped and its event names its peer", async () => {
    const { w, d } = setup();
    d.expectKv(expectKv("t1"), false);
    await settle();
    w.clock.advance(3);
    d.abort("t1");
    expect(w.engine[0]).toMatchObject({
      case: "kvFailed",
      value: { transferId: "t1", reason: FailureReason.ABORTED, message: "aborted by the engine" },
    });
    const abortedAt = w.clock.now();
    w.clock.advance(PUSH_DRAIN_MS);
    d.expire(w.clock.now());
    expect(d.infoOf("t1")).toMatchObject({ state: "ABORTED" });
    expect(d.infoOf("t1")!.timings.endedMs).toBe(w.clock.now());
    expect(d.infoOf("t1")!.timings.endedMs).toBeGreaterThan(abortedAt);
    // The tombstone lasts tombstoneMs from the end, not from an earlier deadline.
    w.clock.advance(SETTINGS.tombstoneMs - 1);
    d.expire(w.clock.now());
    expect(d.infoOf("t1")).toBeDefined();
    expect(w.eventPeers).toEqual(["t1 p0"]);
    // A transfer that failed before it had a peer names none.
    const u = setup({ reachable: false });
    u.d.expectKv(expectKv("t2"), false);
    u.d.abort("t2");
    expect(u.w.eventPeers).toEqual(["t2 "]);
  });

  it("the exact trace of a pull: no hop for a pair that did not read", async () => {
    const { w, d, p } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    w.agent.landAll();
    await settle();
    d.readAck(p, "t1", true, false);
    expect(d.infoOf("t1")!.trace.map((h) => h.hop)).toEqual([
      "engine.expectKv",
      "peer.resolved",
      "planned",
      ...OP_STEPS.map((s) => `pair 0>0 ${s}`),
      "peer.readDone sent",
      "engine.kvReady sent",
      "event.appended",
    ]);
  });

  it("a ReadAck 'unknown' asks again only while D still waits for it", async () => {
    const { w, d, p } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    w.agent.landAll();
    await settle();
    d.readAck(p, "t1", false, true);
    d.abort("t1");
    w.clock.advance(10);
    expect(w.peerSaid("t1")).toEqual(["readDone", "abort"]);
  });

  it("an XferDone before the handshake ends, or while draining, is ignored quietly; one arriving at the wrong D rank is refused", async () => {
    const { w, d, p, state, answer } = setup({ reachable: false });
    d.expectKv(expectKv("t1"), false);
    d.xferDone(p, 0, 0, xferDone("t1"));
    expect(state("t1")).toBe("WAITING");
    answer();
    await settle();
    d.abort("t1");
    d.xferDone(p, 0, 0, xferDone("t1"));
    expect(state("t1")).toBe("DRAINING");
    expect(w.errors).toEqual([]);
    const { w: w2, d: d2, p: p2 } = setup({ layout: smallTp(2) });
    d2.expectKv(expectKv("t2"), false);
    await settle();
    d2.xferDone(p2, 0, 1, xferDone("t2")); // names 0->0, came 0->1
    expect(w2.errors).toEqual(["XferDone for t2 names ranks 0->0 but came 0->1"]);
  });

  it("P's AbortAck does not end a draining pull whose reads are in flight", async () => {
    const { w, d, p, state } = setup();
    d.expectKv(expectKv("t1", true), true);
    await settle();
    d.abort("t1");
    d.abortAck(p, "t1");
    expect(state("t1")).toBe("DRAINING");
    w.agent.landAll();
    await settle();
    expect(state("t1")).toBe("ABORTED");
  });

  it("liveWith follows each peer's own transfers", async () => {
    const { d, p1, p2, expectFrom } = twoPeers();
    expectFrom("b", "p2", false, [2, 3]);
    await settle();
    expect([d.liveWith(p1), d.liveWith(p2)]).toEqual([false, true]);
  });
});

describe("DecodeSide after a partition: what it owes a prefill peer it dropped", () => {
  /** D whose resolver answers `answers` in turn (a peer, or a failed handshake). */
  function world(maxTransfers = 10) {
    // Leases long enough for a few retries (the notes last as long as P's leases).
    const w = new FakeWorld({ maxTransfers, leaseMs: 10_000, regLeaseMs: 8_000 });
    const p = w.peer("p0");
    p.dialedAddress = "198.18.54.1:7000";
    const answers: (PeerState | Error | "hang")[] = [p];
    const dialed: string[] = [];
    const d = new DecodeSide(w.ctx, (address) => {
      dialed.push(address);
      const a = answers.length > 1 ? answers.shift()! : answers[0]!;
      if (a === "hang") return new Promise<PeerState>(() => undefined);
      return a instanceof Error ? Promise.reject(a) : Promise.resolve(a);
    });
    const state = (id: string) => d.list().find((t) => t.transferId === id)?.state;
    /** The same engine at the same epoch, as a new handshake brings it (a new PeerState). */
    const again = (epoch = 7n): PeerState => {
      const q =
        epoch === 7n
          ? w.peer("p0")
          : new PeerState(
              peerMetadata("p0", epoch),
              singleGroup(w.layout),
              w.ctx.kvs.kv!.agents,
              "none",
              w.ctx.log,
              w.clock.now(),
              false,
            );
      q.dialedAddress = p.dialedAddress;
      return q;
    };
    return { w, d, p, answers, dialed, state, again };
  }

  /** A push draining, a pull failed, one ready transfer: P dropped meanwhile. */
  async function dropped(o: ReturnType<typeof world>): Promise<void> {
    const { w, d, p } = o;
    const m = expectKv("done", false, "", [8, 9]);
    m.source = p.dialedAddress;
    d.expectKv(m, false);
    for (const [id, pull, blocks] of [
      ["push", false, [2, 3]],
      ["pull", true, [6, 7]],
    ] as const) {
      const e = expectKv(id, pull, `tok-${id}`, [...blocks]);
      e.source = p.dialedAddress;
      d.expectKv(e, pull);
    }
    await settle();
    d.xferDone(p, 0, 0, xferDone("done"));
    w.agent.landAll();
    await settle();
    d.peerDown(p, "silent for 2000 ms");
  }

  it("tells P, once a handshake gets through, of each transfer it gave up on; P's AbortAck through it (same epoch) ends the push's drain", async () => {
    const o = world();
    const { w, d, answers, dialed, state, again } = o;
    await dropped(o);
    answers.length = 0;
    answers.push(new Error("partitioned"), new Error("partitioned"), again());
    expect(state("done")).toBe("KV_READY");
    expect(state("push")).toBe("DRAINING");
    expect(state("pull")).toBe("FAILED");
    const before = dialed.length;
    // Retried every heartbeat period (1 s by default) while P cannot be reached.
    for (let i = 0; i < 3; i++) {
      w.clock.advance(999);
      d.expire(w.clock.now());
      await settle();
      expect(dialed.length).toBe(before + i);
      w.clock.advance(1);
      d.expire(w.clock.now());
      await settle();
      expect(dialed.length).toBe(before + i + 1);
    }
    // The third dial got through: an Abort for each, none for the ready one.
    expect(w.peerSaid("push").slice(-1)).toEqual(["abort"]);
    expect(w.peerSaid("pull").slice(-1)).toEqual(["abort"]);
    expect(w.peerSaid("done")).toEqual(["pushReg"]);
    const aborts = w.toPeer.filter((m) => m.body.case === "abort").map((m) => m.body.value);
    expect(aborts).toContainEqual({
      transferId: "pull",
      reason: "peer down: silent for 2000 ms",
      token: "tok-pull",
    });
    // An AbortAck from another epoch of P says nothing of the old process's writes: not taken.
    d.abortAck(again(8n), "push");
    expect(state("push")).toBe("DRAINING");
    // P's AbortAck through the new handshake: P sends it once its writes for the transfer are
    // over in UCX (abandoned ones settled), so nothing more can land. The drain ends.
    d.abortAck(again(), "push");
    expect(state("push")).toBe("FAILED");
    expect(w.eventsOf("push")).toEqual(["FAILED"]);
    // Nothing owed any more: no more dials.
    w.clock.advance(5_000);
    d.expire(w.clock.now());
    await settle();
    expect(dialed.length).toBe(before + 3);
  });

  it("another handshake that reaches P (a new transfer's) delivers what is owed at once, while the owed aborts' own dial still hangs", async () => {
    const o = world();
    const { w, d, answers, dialed, state, again } = o;
    await dropped(o);
    answers.length = 0;
    answers.push("hang"); // dialed in the partition: stalled in TCP's backed-off connect
    const before = dialed.length;
    w.clock.advance(1000);
    d.expire(w.clock.now());
    await settle();
    expect(dialed.length).toBe(before + 1);
    const aborts = () => w.toPeer.filter((m) => m.body.case === "abort").length;
    const sent = aborts();
    // The link heals; a new transfer's handshake reaches P at the same epoch.
    d.peerReached(again());
    expect(aborts()).toBe(sent + 2);
    expect(w.peerSaid("push").slice(-1)).toEqual(["abort"]);
    expect(w.peerSaid("pull").slice(-1)).toEqual(["abort"]);
    d.abortAck(again(), "push");
    expect(state("push")).toBe("FAILED");
    // Told once; the hung dial is not retried, nothing is owed any more.
    w.clock.advance(5_000);
    d.expire(w.clock.now());
    await settle();
    expect(dialed.length).toBe(before + 1);
    expect(aborts()).toBe(sent + 2);
  });

  it("a push still draining asks again through every later handshake that reaches the same P process, until its AbortAck", async () => {
    const o = world();
    const { w, d, state, again } = o;
    await dropped(o);
    const aborts = (id: string) =>
      w.toPeer.filter((m) => m.body.case === "abort" && m.body.value.transferId === id).length;
    const [push0, pull0] = [aborts("push"), aborts("pull")];
    // The first handshake after the heal delivers what is owed, once each; its AbortAck is lost.
    d.peerReached(again());
    expect([aborts("push") - push0, aborts("pull") - pull0]).toEqual([1, 1]);
    expect(state("push")).toBe("DRAINING");
    // Another handshake reaches the same P process: the push, still draining, asks again (the
    // pull's drain is D's own reads: nothing to ask P).
    d.peerReached(again());
    expect([aborts("push") - push0, aborts("pull") - pull0]).toEqual([2, 1]);
    // Another P process (a new epoch) is not asked; its handshake ends the drain (peerUp).
    d.peerReached(again(8n));
    expect(aborts("push") - push0).toBe(2);
    d.abortAck(again(), "push");
    expect(state("push")).toBe("FAILED");
    d.peerReached(again());
    expect(aborts("push") - push0).toBe(2);
  });

  it("a push draining on the handshake its Abort went through: should that P state go down before the AbortAck, the Abort is owed again and the next dial that gets through repeats it", async () => {
    const o = world();
    const { w, d, answers, dialed, state, again } = o;
    await dropped(o);
    const aborts = () =>
      w.toPeer.filter((m) => m.body.case === "abort" && m.body.value.transferId === "push").length;
    const push0 = aborts();
    // The heal: a handshake delivers the Abort; P's AbortAck is lost with P's stale endpoint.
    const first = again();
    d.peerReached(first);
    expect(aborts() - push0).toBe(1);
    expect(state("push")).toBe("DRAINING");
    // The drain now waits on that P state: it is live with it (silence there is noticed).
    expect(d.liveWith(first)).toBe(true);
    d.peerDown(first, "endpoint failed: UCS_ERR_CONNECTION_RESET");
    expect(state("push")).toBe("DRAINING");
    answers.length = 0;
    answers.push(again());
    const before = dialed.length;
    w.clock.advance(1000);
    d.expire(w.clock.now());
    await settle();
    expect(dialed.length).toBe(before + 1);
    expect(aborts() - push0).toBe(2);
    d.abortAck(again(), "push");
    expect(state("push")).toBe("FAILED");
  });

  it("a P back at a new epoch is told nothing (it holds nothing of the old one's)", async () => {
    const o = world();
    await dropped(o);
    o.answers.length = 0;
    o.answers.push(o.again(8n));
    const said = o.w.toPeer.length;
    o.w.clock.advance(1000);
    o.d.expire(o.w.clock.now());
    await settle();
    expect(o.w.toPeer.length).toBe(said);
    // The handshake installed P's new epoch: the old process is gone, and with it any write it
    // could still post. The push's drain ends at once, long before its lease and settle bound.
    expect(o.state("push")).toBe("DRAINING");
    o.d.peerUp(o.again(8n));
    expect(o.state("push")).toBe("FAILED");
  });

  it("a P never reached again: the notes go once its leases have surely run out", async () => {
    const o = world();
    await dropped(o);
    o.answers.length = 0;
    o.answers.push(new Error("gone"));
    // P's hold lease + the grace + the settle bound.
    o.w.clock.advance(10_000 + SETTINGS.abortGraceMs + SETTINGS.settleBoundMs!);
    o.d.expire(o.w.clock.now());
    await settle();
    const dials = o.dialed.length;
    o.w.clock.advance(10_000);
    o.d.expire(o.w.clock.now());
    await settle();
    expect(o.dialed.length).toBe(dials);
  });
});
