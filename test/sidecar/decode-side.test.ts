// D's side in process (decode.ts) with fake agents, a fake peer resolver and a manual clock: the
// watchdog, the abort drain, P's Failed and AbortAck, P going down, pull confirmation, in
// milliseconds. Each case checks when D's blocks go back (never while a write may land) and the
// one terminal event.
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { FailureReason, ReleaseReason } from "../../src/gen/kvxfer/v1/engine_pb.js";
import { XferDoneSchema } from "../../src/gen/kvxfer/v1/peer_pb.js";
import { DecodeSide } from "../../src/sidecar/decode.js";
import type { PeerState } from "../../src/sidecar/peers.js";
import { FakeWorld, SETTINGS, expectKv, settle, smallTp } from "./fakes.js";

function setup(opts: { reachable?: boolean; maxTransfers?: number } = {}) {
  const w = new FakeWorld(
    opts.maxTransfers !== undefined ? { maxTransfers: opts.maxTransfers } : {},
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
    const end = registeredAt + SETTINGS.regLeaseMs + SETTINGS.abortGraceMs;
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
    w.clock.advance(SETTINGS.regLeaseMs + SETTINGS.abortGraceMs - 1);
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
    w.clock.advance(SETTINGS.regLeaseMs + SETTINGS.abortGraceMs - 1);
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
    w.clock.advance(SETTINGS.regLeaseMs + SETTINGS.abortGraceMs);
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
