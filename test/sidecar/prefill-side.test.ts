// P's side in process (prefill.ts) with fake agents and a manual clock: the lease, the
// registration lease, aborts racing writes, D going down and the transfer cap, in milliseconds.
// Each case also checks the one terminal event and the one ReleaseBlocks.
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { ReleaseReason } from "../../src/gen/kvxfer/v1/engine_pb.js";
import { PushRegSchema, type PushReg } from "../../src/gen/kvxfer/v1/peer_pb.js";
import { PrefillSide } from "../../src/sidecar/prefill.js";
import { PeerState } from "../../src/peer/peer-state.js";
import {
  FakeWorld,
  OP_STEPS,
  SETTINGS,
  SMALL,
  peerMetadata,
  prefillDone,
  settle,
  smallTp,
} from "./fakes.js";

function pushReg(transferId: string, token = "", leaseMs = SETTINGS.regLeaseMs): PushReg {
  return create(PushRegSchema, {
    transferId,
    blockIds: [4, 5],
    numTokens: 20,
    prefixTokens: 0,
    leaseMs,
    token,
  });
}

function setup(settings = {}) {
  const w = new FakeWorld(settings);
  const p = new PrefillSide(w.ctx);
  const state = (id: string) => p.list().find((t) => t.transferId === id)?.state;
  return { w, p, d: w.peer("d0"), state };
}

describe("PrefillSide", () => {
  it("holds blocks for D's read under the lease; a heartbeat renews it; then EXPIRED, blocks back once", () => {
    const { w, p, d, state } = setup();
    p.prefillDone(prefillDone("t1"));
    expect(state("t1")).toBe("HELD");
    w.clock.advance(SETTINGS.leaseMs - 1);
    p.expire(w.clock.now());
    expect(state("t1")).toBe("HELD");
    p.renewLeases(d, ["t1"]); // D's heartbeat
    w.clock.advance(SETTINGS.leaseMs - 1);
    p.expire(w.clock.now());
    expect(state("t1"), "the heartbeat renewed the lease").toBe("HELD");
    w.clock.advance(2);
    p.expire(w.clock.now());
    expect(state("t1")).toBe("EXPIRED");
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.EXPIRED}`]);
    expect(w.eventsOf("t1")).toEqual(["EXPIRED"]);
    // A late ReadDone is told the blocks were not held; nothing is released twice.
    p.readDone(d, "t1", 100, "");
    expect(w.peerSaid("t1")).toEqual(["readAck"]);
    expect(w.toPeer.at(-1)?.body).toMatchObject({ case: "readAck", value: { held: false } });
    expect(w.eventsOf("t1")).toEqual(["EXPIRED"]);
    // The tombstone goes after its time.
    w.clock.advance(SETTINGS.tombstoneMs);
    p.expire(w.clock.now());
    expect(state("t1")).toBeUndefined();
  });

  it("pull: D's ReadDone while held releases the blocks as transferred", () => {
    const { w, p, d, state } = setup();
    p.prefillDone(prefillDone("t1", "tok"));
    p.readDone(d, "t1", 4096, "tok");
    expect(state("t1")).toBe("RELEASED");
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.TRANSFERRED}`]);
    expect(w.eventsOf("t1")).toEqual(["RELEASED"]);
    expect(w.moved).toBe(4096);
  });

  it("push: registration then prefill writes every pair, XferDone after the data, RELEASED", async () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    expect(state("t1")).toBe("WAITING");
    p.prefillDone(prefillDone("t1"));
    expect(state("t1")).toBe("MOVING");
    expect(w.agent.ops.length).toBeGreaterThan(0);
    await settle();
    expect(w.sealed, "no XferDone before the writes land").toEqual([]);
    w.agent.landAll();
    await settle();
    expect(w.sealed.map((b) => b.case)).toEqual(["xferDone"]);
    expect(state("t1")).toBe("RELEASED");
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.TRANSFERRED}`]);
    expect(w.eventsOf("t1")).toEqual(["RELEASED"]);
  });

  it("traces the push: each hop once, in the order it happened; mark() adds one, unknown ids nothing", async () => {
    const { w, p, d } = setup();
    p.pushReg(d, pushReg("t1"), 100);
    p.prefillDone(prefillDone("t1"), 200);
    w.agent.landAll();
    await settle();
    const hops = (): string[] => p.infoOf("t1")!.trace.map((h) => h.hop);
    const names = hops();
    // The pair's name comes from the plan (one rank pair here); its steps come from the addon.
    const pair = names.find((h) => h.endsWith(" submitted"))!;
    const prefix = pair.slice(0, -" submitted".length);
    // The writes and their XferDone are one operation: "notified" is the XferDone leaving.
    expect(names).toEqual([
      "peer.pushReg",
      "engine.prefillDone",
      "planned",
      ...OP_STEPS.map((s) => `${prefix} ${s}`).toSpliced(
        OP_STEPS.indexOf("flushed") + 1,
        0,
        `${prefix} notified`,
      ),
      "engine.releaseBlocks sent",
      "event.appended",
    ]);
    // The times given for the messages' arrival are kept as given.
    const trace = p.list()[0]!.trace;
    expect(trace.slice(0, 2).map((h) => h.us)).toEqual([100, 200]);
    p.mark("t1", "event.written");
    expect(hops().at(-1)).toBe("event.written");
    p.mark("no-such-transfer", "event.written");
    expect(p.infoOf("no-such-transfer")).toBeUndefined();
    expect(p.list().map((t) => t.transferId)).toEqual(["t1"]);
  });

  it("D aborts while writes are in flight: ABORTING, AbortAck once they settle, ABORTED", async () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    p.peerAbort(d, "t1", "");
    expect(state("t1")).toBe("ABORTING");
    expect(w.peerSaid("t1"), "no AbortAck while writes are in flight").toEqual([]);
    expect(w.engineSaid("t1")).toEqual([]);
    w.agent.failAll();
    await settle();
    expect(state("t1")).toBe("ABORTED");
    expect(w.peerSaid("t1")).toEqual(["abortAck"]);
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.ABORTED}`]);
    expect(w.eventsOf("t1")).toEqual(["ABORTED"]);
    expect(w.events[0]!.reason).toBe("ERR_ABORTED");
  });

  it("an abort whose writes all landed anyway ends RELEASED (the KV is there), acknowledged", async () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    p.peerAbort(d, "t1", "");
    w.agent.landAll();
    await settle();
    expect(state("t1")).toBe("RELEASED");
    expect(w.peerSaid("t1")).toEqual(["abortAck"]);
    expect(w.eventsOf("t1")).toEqual(["RELEASED"]);
  });

  it("the engine aborts while writes are in flight: D hears Failed, not AbortAck", async () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    p.abort("t1");
    expect(state("t1")).toBe("ABORTING");
    w.agent.failAll();
    await settle();
    expect(state("t1")).toBe("ABORTED");
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_TRANSFER"]);
    expect(w.eventsOf("t1")).toEqual(["ABORTED"]);
  });

  it("no write once the registration's lease is over: D may have reused its blocks", async () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    w.clock.advance(SETTINGS.regLeaseMs + 1); // no heartbeat, and no sweep ran yet
    p.prefillDone(prefillDone("t1"));
    await settle();
    expect(w.agent.ops, "nothing posted").toEqual([]);
    expect(state("t1")).toBe("FAILED");
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_ABORTED"]);
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.FAILED}`]);
  });

  it("a registration nobody's prefill finishes expires; the late PrefillDone gets its blocks straight back", () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    w.clock.advance(SETTINGS.regLeaseMs);
    p.expire(w.clock.now());
    // D is told; P's transfer waits for PrefillDone to say whose registration that was.
    expect(state("t1")).toBe("WAITING");
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_TIMEOUT"]);
    expect(w.engineSaid("t1")).toEqual([]);
    expect(w.eventsOf("t1")).toEqual([]);
    expect(p.livePeers().size, "no heartbeat for a registration that is over").toBe(0);
    p.prefillDone(prefillDone("t1"));
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.EXPIRED}`]);
    expect(w.eventsOf("t1")).toEqual(["EXPIRED"]);
    // And a late PushReg is refused by name.
    p.pushReg(w.peer("d1"), pushReg("t1"));
    expect(w.peerSaid("t1").at(-1)).toBe("failed:ERR_LEASE_EXPIRED");
  });

  it("writes abandoned to a dropped D: its Abort through a new handshake of the same process is answered only once UCX holds none of them", async () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    p.peerDown(d);
    expect(state("t1")).toBe("ABORTING");
    // The peer table gives up on the writes (they reject at once) but UCX still holds them.
    for (const ep of d.endpointList()) ep.abandon();
    w.agent.failAll("UCS_ERR_CONNECTION_RESET");
    await settle();
    expect(state("t1"), "blocks held while an abandoned write may still land").toBe("ABORTING");
    expect(w.engineSaid("t1")).toEqual([]);
    // D, back through a new handshake (same engine, same epoch), tells P it gave up.
    const again = w.peer(d.engineId);
    expect(again).not.toBe(d);
    p.peerAbort(again, "t1", "");
    await settle();
    expect(w.peerSaid("t1"), "no AbortAck before the writes settled").toEqual([]);
    // Another epoch of D is not the process that registered: refused, changes nothing.
    const other = new PeerState(
      peerMetadata(d.engineId, 8n, SMALL),
      d.groups,
      w.ctx.kvs.kv!.agents,
      "none",
      w.ctx.log,
      w.clock.now(),
      false,
    );
    p.peerAbort(other, "t1", "");
    expect(w.errors.at(-1)).toBe(
      `Abort for 't1' from '${d.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
    );
    w.agent.settleAbandoned();
    await settle();
    expect(state("t1")).toBe("ABORTED");
    const acks = w.toPeerState.filter((_, i) => w.toPeer[i]!.body.case === "abortAck");
    expect(acks, "to the handshake the Abort came through").toEqual([again]);
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.ABORTED}`]);
  });

  it("D goes down: a waiting registration fails; writes in flight abort once they settle", async () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    p.pushReg(d, pushReg("t2"));
    p.prefillDone(prefillDone("t2"));
    expect(p.writingTo(d)).toBe(true);
    p.peerDown(d);
    // t1: D's registration is withdrawn; it counts when PrefillDone names its token ("").
    expect(state("t1")).toBe("WAITING");
    expect(state("t2")).toBe("ABORTING");
    p.prefillDone(prefillDone("t1", "", [6, 7]));
    expect(state("t1")).toBe("FAILED");
    w.agent.failAll();
    await settle();
    expect(state("t2")).toBe("ABORTED");
    expect(w.eventsOf("t1")).toEqual(["FAILED"]);
    expect(w.eventsOf("t2")).toEqual(["ABORTED"]);
    expect(p.liveWith(d)).toBe(false);
  });

  it("the transfer cap: one PrefillDone too many is refused ERR_OVERLOADED and its blocks go back", () => {
    const { w, p } = setup({ maxTransfers: 2 });
    p.prefillDone(prefillDone("t1"));
    p.prefillDone(prefillDone("t2"));
    p.prefillDone(prefillDone("t3"));
    expect(w.refused).toEqual([{ transferId: "t3", code: "ERR_OVERLOADED" }]);
    expect(w.engineSaid("t3")).toEqual([`releaseBlocks:${ReleaseReason.FAILED}`]);
    expect(p.live()).toBe(2);
  });

  it("a registration with the wrong token is refused; the transfer waits for the right one", async () => {
    const { w, p, state } = setup();
    p.prefillDone(prefillDone("t1", "right"));
    const rogue = w.peer("rogue");
    p.pushReg(rogue, pushReg("t1", "wrong"));
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_BAD_TRANSFER_TOKEN"]);
    expect(state("t1")).toBe("HELD");
    w.agent.autoLand = true;
    p.pushReg(w.peer("d0"), pushReg("t1", "right"));
    await settle();
    expect(state("t1")).toBe("RELEASED");
    expect(w.eventsOf("t1")).toEqual(["RELEASED"]);
  });

  it("a registration's lease is clamped to 100 ms .. 10 min; the same engine registering again is one registration", () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("short", "", 1)); // asks for 1 ms: gets 100
    w.clock.advance(99);
    p.expire(w.clock.now());
    expect(state("short")).toBe("WAITING");
    w.clock.advance(1);
    p.expire(w.clock.now());
    expect(w.peerSaid("short")).toEqual(["failed:ERR_TIMEOUT"]);
    expect(p.livePeers().size).toBe(0);
    p.pushReg(d, pushReg("long", "", 24 * 3600_000)); // asks for a day: gets 10 min
    p.pushReg(d, pushReg("long", "", 24 * 3600_000)); // the same engine again: nothing new
    expect(w.peerSaid("long")).toEqual([]);
    w.clock.advance(10 * 60_000 - 1);
    p.expire(w.clock.now());
    expect(state("long")).toBe("WAITING");
    w.clock.advance(1);
    p.expire(w.clock.now());
    expect(w.peerSaid("long")).toEqual(["failed:ERR_TIMEOUT"]);
  });

  it("which decode engine may act: only the registered one, or (no registration) the token's holder", async () => {
    const { w, p, d } = setup();
    const other = w.peer("d1");
    p.pushReg(d, pushReg("t1"));
    expect(p.liveWith(d)).toBe(true);
    expect(p.liveWith(other)).toBe(false);
    expect([...p.livePeers()].map((x) => x.engineId)).toEqual(["d0"]);
    p.prefillDone(prefillDone("t1"));
    expect(p.writingTo(d)).toBe(true);
    expect(p.writingTo(other)).toBe(false);
    // Another engine's abort or failure of a registered transfer changes nothing.
    p.peerAbort(other, "t1", "");
    expect(p.list()[0]!.state).toBe("MOVING");
    expect(p.peerFailed(other, "t1", "ERR_X", "")).toBe(false); // writes in flight: not now anyway
    // Another engine going down is not this transfer's business.
    p.peerDown(other);
    expect(p.list()[0]!.state).toBe("MOVING");
    w.agent.landAll();
    await settle();
    expect(p.list()[0]!.state).toBe("RELEASED");
    expect(p.writingTo(d)).toBe(false);
    expect(p.liveWith(d)).toBe(false);
    expect(p.livePeers().size).toBe(0);
    // Held for a pull (no registration): the token's holder may fail it, anyone else not.
    p.prefillDone(prefillDone("t2", "tok"));
    expect(p.peerFailed(other, "t2", "ERR_X", "wrong")).toBe(true);
    expect(p.list().find((t) => t.transferId === "t2")!.state).toBe("HELD");
    p.peerAbort(other, "t2", "tok");
    expect(p.list().find((t) => t.transferId === "t2")!.state).toBe("ABORTED");
  });

  // --- cases aimed at mutants that survived the mutation run (docs/testing.md) ---------------

  it("a registration waiting for prefill lives on its own lease, renewed only by its D's heartbeat", () => {
    const { w, p, d, state } = setup();
    const other = w.peer("d1");
    p.pushReg(d, pushReg("t1", "", 1000));
    expect(state("t1")).toBe("WAITING");
    expect(p.leased()).toBe(1);
    expect([...p.livePeers()].map((x) => x.engineId)).toEqual(["d0"]);
    w.clock.advance(900);
    p.renewLeases(other, ["t1"]); // not the registered D: changes nothing
    w.clock.advance(101);
    p.expire(w.clock.now());
    // D is told, the registration is over (the other engine's heartbeat did not renew it).
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_TIMEOUT"]);
    expect(p.livePeers().size).toBe(0);
    // Nothing waits for it any more: after the lease the entry goes, with no event.
    w.clock.advance(SETTINGS.leaseMs);
    p.expire(w.clock.now());
    expect(state("t1")).toBeUndefined();
    expect(w.eventsOf("t1")).toEqual([]);
    expect(p.leased()).toBe(0);
    expect(p.live()).toBe(0);

    p.pushReg(d, pushReg("t2", "", 1000));
    w.clock.advance(900);
    p.renewLeases(d, ["t2", "unknown", "t1"]); // its own D: renewed; unknown and ended ids skipped
    w.clock.advance(900);
    p.expire(w.clock.now());
    expect(state("t2"), "renewed 900 ms ago for 1000 ms").toBe("WAITING");
    w.clock.advance(101);
    p.expire(w.clock.now());
    expect(w.peerSaid("t2")).toEqual(["failed:ERR_TIMEOUT"]);
  });

  it("a held transfer's lease is renewed by a heartbeat only for a D that registered it, or any D before one did", () => {
    const { w, p, d, state } = setup();
    p.prefillDone(prefillDone("t1"));
    p.prefillDone(prefillDone("t2", "", [2, 3]));
    expect(p.leased()).toBe(2);
    w.clock.advance(SETTINGS.leaseMs - 10);
    p.renewLeases(d, ["t1"]); // pull: no registration, D's heartbeat renews the hold
    w.clock.advance(20);
    p.expire(w.clock.now());
    expect([state("t1"), state("t2")]).toEqual(["HELD", "EXPIRED"]);
    expect(p.leased()).toBe(1);
  });

  it("D going down fails only what that D registered; others' and unregistered held transfers go on", () => {
    const { w, p, d, state } = setup({ maxTransfers: 8 });
    const other = w.peer("d1");
    p.pushReg(d, pushReg("mine"));
    p.pushReg(other, pushReg("theirs"));
    p.prefillDone(prefillDone("held", "", [6, 7]));
    expect(p.liveWith(d)).toBe(true);
    p.peerDown(d);
    // "mine" waits on (withdrawn: PrefillDone with its token ends it); the others go on.
    expect([state("mine"), state("theirs"), state("held")]).toEqual(["WAITING", "WAITING", "HELD"]);
    expect(p.liveWith(d)).toBe(false);
    expect(p.liveWith(other)).toBe(true);
    expect([...p.livePeers()].map((x) => x.engineId)).toEqual(["d1"]);
  });

  it("an ended transfer's tombstone outlives sweeps until tombstoneMs: a late PrefillDone is no new transfer", () => {
    const { w, p, d, state } = setup();
    p.prefillDone(prefillDone("t1"));
    p.readDone(d, "t1", 100, "");
    expect(state("t1")).toBe("RELEASED");
    w.clock.advance(1);
    p.expire(w.clock.now());
    expect(state("t1")).toBe("RELEASED");
    w.clock.advance(SETTINGS.tombstoneMs - 2);
    p.expire(w.clock.now());
    expect(state("t1")).toBe("RELEASED");
    w.clock.advance(1);
    p.expire(w.clock.now());
    expect(state("t1")).toBeUndefined();
  });
});

describe("PrefillSide: what it reports", () => {
  it("a push's XferDone: the pair, its bytes, and the time from PrefillDone to the writes' posting (it is sealed then, sent once they land); timings, bytes and descriptors exact", async () => {
    const w = new FakeWorld({}, smallTp(2));
    const p = new PrefillSide(w.ctx);
    const d = w.peer("d0");
    const t0 = w.clock.now();
    p.pushReg(d, pushReg("t1"));
    w.clock.advance(7);
    p.prefillDone(prefillDone("t1"));
    w.clock.advance(3);
    w.agent.landAll();
    await settle();
    const done = w.sealed.map((b) => (b.case === "xferDone" ? b.value : undefined));
    expect(done.map((x) => [x?.transferId, x?.srcRank, x?.dstRank, x?.sincePrefillDoneMs])).toEqual(
      [
        ["t1", 0, 0, 0],
        ["t1", 1, 1, 0],
      ],
    );
    const info = p.infoOf("t1")!;
    const perPair = done.map((x) => Number(x!.bytes));
    expect(perPair[0]).toBeGreaterThan(0);
    expect(info.bytes).toBe(perPair[0]! + perPair[1]!);
    expect(info.descriptors).toBeGreaterThan(0);
    expect([info.peer, info.mode, info.state, info.reason]).toEqual([
      "d0",
      "push",
      "RELEASED",
      "transferred",
    ]);
    expect(info.timings).toMatchObject({
      registeredMs: t0,
      prefillDoneMs: t0 + 7,
      dataStartedMs: t0 + 7,
      dataDoneMs: t0 + 10,
      endedMs: t0 + 10,
    });
    expect(w.moved).toBe(info.bytes);
  });

  it("a pull's ReadDone: the reader becomes the peer, its bytes the transfer's", () => {
    const { w, p, d } = setup();
    p.prefillDone(prefillDone("t1"));
    w.clock.advance(4);
    p.readDone(d, "t1", 4096, "", { receivedUs: 31, deliveredUs: 32 });
    const info = p.infoOf("t1")!;
    expect([info.peer, info.mode, info.bytes, info.state]).toEqual([
      "d0",
      "pull",
      4096,
      "RELEASED",
    ]);
    expect(info.timings.endedMs).toBe(info.timings.prefillDoneMs + 4);
    expect(info.trace.map((h) => [h.hop, h.us]).slice(1, 3)).toEqual([
      ["peer.readDone received", 31],
      ["peer.readDone delivered", 32],
    ]);
    expect(info.trace.map((h) => h.hop).slice(3)).toEqual([
      "peer.readAck sent",
      "engine.releaseBlocks sent",
      "event.appended",
    ]);
  });

  it("each terminal state hands the blocks back with its own reason", async () => {
    const { w, p, d, state } = setup({ maxTransfers: 10 });
    p.prefillDone(prefillDone("released", "", [0, 1]));
    p.readDone(d, "released", 1, "");
    p.prefillDone(prefillDone("aborted", "", [2, 3]));
    p.abort("aborted");
    p.prefillDone(prefillDone("expired", "", [4, 5]));
    p.pushReg(d, { ...pushReg("failed"), numTokens: 40 });
    p.prefillDone(prefillDone("failed", "", [6, 7])); // D expects 40 tokens, P has 20
    await settle();
    w.clock.advance(SETTINGS.leaseMs);
    p.expire(w.clock.now());
    expect(["released", "aborted", "expired", "failed"].map(state)).toEqual([
      "RELEASED",
      "ABORTED",
      "EXPIRED",
      "FAILED",
    ]);
    expect(w.engineSaid("released")).toEqual([`releaseBlocks:${ReleaseReason.TRANSFERRED}`]);
    expect(w.engineSaid("aborted")).toEqual([`releaseBlocks:${ReleaseReason.ABORTED}`]);
    expect(w.engineSaid("expired")).toEqual([`releaseBlocks:${ReleaseReason.EXPIRED}`]);
    expect(w.engineSaid("failed")).toEqual([`releaseBlocks:${ReleaseReason.FAILED}`]);
    expect(w.peerSaid("failed")).toEqual(["failed:ERR_BAD_TOKENS"]);
    expect(p.infoOf("failed")!.reason).toBe("ERR_BAD_TOKENS");
    expect(w.agent.ops).toEqual([]);
  });

  it("a write the addon refuses to post: D hears Failed with its code, the transfer FAILED, blocks back", async () => {
    const { w, p, d, state } = setup();
    w.agent.failToPost = true;
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    await settle();
    expect(state("t1")).toBe("FAILED");
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_OUT_OF_BOUNDS"]);
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.FAILED}`]);
    expect(w.sealed).toEqual([]);
    expect(w.moved).toBe(0);
  });
});

describe("PrefillSide: the edges", () => {
  it("registrations before PrefillDone live apart from the table: a full table keeps them, a full pool refuses them (D hears ERR_OVERLOADED, P records nothing)", () => {
    const { w, p, d, state } = setup({ maxUnconfirmed: 1 }); // maxTransfers 2
    p.prefillDone(prefillDone("a", "", [0, 1]));
    p.prefillDone(prefillDone("b", "", [2, 3]));
    p.pushReg(d, pushReg("c"));
    expect(w.peerSaid("c")).toEqual([]);
    expect(state("c")).toBe("WAITING");
    p.pushReg(d, pushReg("c2"));
    expect(w.peerSaid("c2")).toEqual(["failed:ERR_OVERLOADED"]);
    expect(state("c2")).toBeUndefined();
    expect(w.toPeer.at(-1)?.body.value).toMatchObject({
      message: "1 registrations wait for prefill on P, and yours are as many as any engine's",
    });
    // The waiting one does not take the room of a real PrefillDone, nor is it taken by one.
    p.prefillDone(prefillDone("c", "", [4, 5]));
    expect(state("c")).toBe("MOVING");
    // A registration for a transfer P already has is no new transfer: not refused by the cap.
    p.pushReg(d, pushReg("a"));
    expect(w.peerSaid("a")).toEqual([]);
    expect(state("a")).toBe("MOVING");
  });

  it("an abort from D for a transfer P does not have, or has ended, is acknowledged at once", () => {
    const { w, p, d } = setup();
    p.peerAbort(d, "never", "");
    p.prefillDone(prefillDone("t1"));
    p.readDone(d, "t1", 1, "");
    p.peerAbort(d, "t1", "");
    expect(w.peerSaid("never")).toEqual(["abortAck"]);
    expect(w.peerSaid("t1")).toEqual(["readAck", "abortAck"]);
    expect(w.eventsOf("t1")).toEqual(["RELEASED"]);
  });

  it("the engine aborting twice while writes are in flight: nothing more until they settle, one end", async () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    p.abort("t1");
    p.abort("t1");
    expect(state("t1")).toBe("ABORTING");
    expect(w.peerSaid("t1")).toEqual([]);
    w.agent.failAll();
    await settle();
    expect(state("t1")).toBe("ABORTED");
    expect(w.eventsOf("t1")).toEqual(["ABORTED"]);
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.ABORTED}`]);
  });

  it("the engine aborting a transfer D registered before prefill ended: D hears Failed ERR_ABORTED", () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    p.abort("t1");
    expect(state("t1")).toBe("ABORTED");
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_ABORTED"]);
    // No blocks were ever given: nothing goes back to the engine until its late PrefillDone.
    expect(w.engineSaid("t1")).toEqual([]);
    p.prefillDone(prefillDone("t1"));
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.ABORTED}`]);
  });

  it("the engine giving up a transfer before D registered: D's registration fails at once, until the tombstone time", () => {
    const { w, p, d } = setup();
    p.giveUp("g1");
    expect(p.has("g1")).toBe(false); // nothing held, no event
    p.pushReg(d, pushReg("g1"));
    expect(w.peerSaid("g1")).toEqual(["failed:ERR_ABORTED"]);
    expect(p.has("g1")).toBe(false);
    expect(w.eventsOf("g1")).toEqual([]);
    // Forgotten after --tombstone-ms: a registration then is an ordinary one.
    w.clock.advance(SETTINGS.tombstoneMs + 1);
    p.expire(w.clock.now());
    p.pushReg(d, pushReg("g1"));
    expect(w.peerSaid("g1")).toEqual(["failed:ERR_ABORTED"]);
    expect(p.has("g1")).toBe(true);
  });

  it("what the engine gave up is bounded by the transfer cap: the oldest is forgotten first", () => {
    const { w, p, d } = setup({ maxTransfers: 2 });
    for (const id of ["a", "b", "c"]) p.giveUp(id);
    for (const id of ["a", "b", "c"]) p.pushReg(d, pushReg(id));
    expect(w.peerSaid("a")).toEqual([]);
    expect(w.peerSaid("b")).toEqual(["failed:ERR_ABORTED"]);
    expect(w.peerSaid("c")).toEqual(["failed:ERR_ABORTED"]);
  });
});

describe("PrefillSide: the words it ends and refuses with", () => {
  /** The reason of `id`'s one terminal event. */
  const reasonOf = (w: FakeWorld, id: string) => {
    const evs = w.events.filter((e) => e.transferId === id);
    expect(evs).toHaveLength(1);
    return `${evs[0]!.kind} ${evs[0]!.reason}`;
  };
  /** The Failed message D was sent about `id` (code: message). */
  const failedTo = (w: FakeWorld, id: string) =>
    w.toPeer
      .filter((m) => m.body.case === "failed" && m.body.value.transferId === id)
      .map((m) => {
        const v = m.body.value as { code: string; message: string };
        return `${v.code}: ${v.message}`;
      });

  it("each way a transfer ends names its reason in the event", async () => {
    const { w, p, d } = setup({ maxTransfers: 20 });
    const blocks = (i: number) => [2 * i, 2 * i + 1];
    p.prefillDone(prefillDone("pull", "", blocks(0)));
    p.readDone(d, "pull", 1, "");
    p.pushReg(d, pushReg("push"));
    p.prefillDone(prefillDone("push", "", blocks(1)));
    w.agent.landAll();
    await settle();
    p.prefillDone(prefillDone("engine-abort", "", blocks(2)));
    p.abort("engine-abort");
    p.pushReg(d, pushReg("engine-abort-registered"));
    p.abort("engine-abort-registered");
    p.prefillDone(prefillDone("decode-abort", "", blocks(3)));
    p.peerAbort(d, "decode-abort", "");
    // Before PrefillDone, D's Failed, D going down and the registration's lease withdraw the
    // registration; each counts at PrefillDone (the token, "", is the registrant's).
    p.pushReg(d, pushReg("decode-failed"));
    p.peerFailed(d, "decode-failed", "ERR_TIMEOUT", "");
    p.prefillDone(prefillDone("decode-failed", "", blocks(5)));
    p.pushReg(d, pushReg("peer-down"));
    p.peerDown(d);
    p.prefillDone(prefillDone("peer-down", "", blocks(6)));
    p.prefillDone(prefillDone("held", "", blocks(4)));
    p.pushReg(d, pushReg("registered"));
    w.clock.advance(SETTINGS.leaseMs);
    p.expire(w.clock.now());
    p.prefillDone(prefillDone("registered", "", blocks(7)));
    expect(
      [
        "pull",
        "push",
        "engine-abort",
        "engine-abort-registered",
        "decode-abort",
        "decode-failed",
        "peer-down",
        "held",
        "registered",
      ].map((id) => `${id}: ${reasonOf(w, id)}`),
    ).toEqual([
      "pull: RELEASED transferred",
      "push: RELEASED transferred",
      "engine-abort: ABORTED aborted by the engine",
      "engine-abort-registered: ABORTED aborted by the engine",
      "decode-abort: ABORTED aborted by decode",
      "decode-failed: FAILED ERR_TIMEOUT",
      "peer-down: FAILED ERR_PEER_DOWN",
      "held: EXPIRED lease expired",
      "registered: EXPIRED registration lease expired",
    ]);
    expect(failedTo(w, "engine-abort-registered")).toEqual([
      "ERR_ABORTED: aborted by the prefill engine",
    ]);
    expect(failedTo(w, "registered")).toEqual([
      "ERR_TIMEOUT: no prefill before the registration lease ran out",
    ]);
    expect(w.toPeer.filter((m) => m.body.case === "abortAck").map((m) => m.body.value)).toEqual([
      { transferId: "decode-abort" },
    ]);
  });

  it("a push's writes that fail, or an abort during them, end with the reason they had", async () => {
    const { w, p, d, state } = setup({ maxTransfers: 20 });
    p.pushReg(d, pushReg("fails"));
    p.prefillDone(prefillDone("fails", "", [0, 1]));
    w.agent.failAll("UCS_ERR_IO_ERROR");
    await settle();
    expect(w.events.at(-1)).toMatchObject({ transferId: "fails", reason: "ERR_TRANSFER" });
    expect(failedTo(w, "fails")).toEqual(["ERR_TRANSFER: UCS_ERR_IO_ERROR"]);
    // D aborts while the writes are in flight and they fail: ABORTED, AbortAck, no Failed.
    w.agent.ops.length = 0;
    p.pushReg(d, pushReg("d-abort"));
    p.prefillDone(prefillDone("d-abort", "", [2, 3]));
    p.peerAbort(d, "d-abort", "");
    p.peerAbort(d, "d-abort", ""); // again while ABORTING: still one AbortAck, later
    expect(w.peerSaid("d-abort")).toEqual([]);
    w.agent.failAll();
    await settle();
    expect(state("d-abort")).toBe("ABORTED");
    expect(w.events.at(-1)).toMatchObject({ transferId: "d-abort", reason: "ERR_ABORTED" });
    expect(w.peerSaid("d-abort")).toEqual(["abortAck"]);
    // The engine aborts while they are in flight and they fail: ABORTED with the write's code.
    w.agent.ops.length = 0;
    p.pushReg(d, pushReg("e-abort"));
    p.prefillDone(prefillDone("e-abort", "", [4, 5]));
    p.abort("e-abort");
    w.agent.failAll();
    await settle();
    expect(w.events.at(-1)).toMatchObject({
      transferId: "e-abort",
      kind: "ABORTED",
      reason: "ERR_TRANSFER",
    });
    expect(failedTo(w, "e-abort")).toEqual(["ERR_TRANSFER: UCS_ERR_CANCELED"]);
  });

  it("refusals say what was wrong: D's registration, a late one, P's duplicates and its cap", async () => {
    const { w, p, d, state } = setup({ maxTransfers: 3 });
    const d2 = w.peer("d2");
    p.pushReg(d, { ...pushReg("t0"), numTokens: 0 });
    p.pushReg(d, { ...pushReg("t0"), prefixTokens: 21 });
    p.pushReg(d, { ...pushReg("t0"), prefixTokens: 20 }); // all tokens cached: accepted
    expect(failedTo(w, "t0")).toEqual([
      "ERR_BAD_TOKENS: bad token counts in PushReg",
      "ERR_BAD_TOKENS: bad token counts in PushReg",
    ]);
    expect(state("t0")).toBe("WAITING");
    p.prefillDone(prefillDone("t1", "tok", [0, 1]));
    p.pushReg(d2, pushReg("t1", "wrong"));
    expect(failedTo(w, "t1")).toEqual([
      "ERR_BAD_TRANSFER_TOKEN: the transfer's token does not match",
    ]);
    expect(w.errors.at(-1)).toBe("PushReg for 't1' from 'd2' refused: ERR_BAD_TRANSFER_TOKEN");
    p.pushReg(d, pushReg("t1", "tok"));
    p.pushReg(d2, pushReg("t1", "tok"));
    expect(failedTo(w, "t1").at(-1)).toBe(
      "ERR_DUPLICATE: another decode engine registered for this transfer",
    );
    expect(w.errors.at(-1)).toBe(
      "PushReg for 't1' from 'd2' refused: ERR_DUPLICATE (registered by 'd0')",
    );
    p.prefillDone(prefillDone("t1", "tok", [0, 1]));
    expect(w.refused.at(-1)).toEqual({ transferId: "t1", code: "ERR_DUPLICATE" });
    p.prefillDone(prefillDone("t2", "", [2, 3]));
    // t0 waits for PrefillDone: it takes none of the table's room (issue 48).
    p.prefillDone(prefillDone("t3", "", [4, 5]));
    p.prefillDone(prefillDone("t4", "", [6, 7]));
    expect(w.refused.at(-1)).toEqual({ transferId: "t4", code: "ERR_OVERLOADED" });
    expect(w.engine.at(-1)).toMatchObject({
      case: "releaseBlocks",
      value: { transferId: "t4", blockIds: [6, 7], reason: ReleaseReason.FAILED },
    });
    // A registration for a transfer that ended: refused with how it ended.
    w.agent.landAll();
    await settle();
    expect(state("t1")).toBe("RELEASED");
    p.pushReg(d2, pushReg("t1", "tok"));
    expect(failedTo(w, "t1").at(-1)).toBe("ERR_ENDED: transfer ended on P as RELEASED");
  });

  it("a ReadDone or an Abort with the wrong token is refused by name and changes nothing", () => {
    const { w, p, d, state } = setup();
    p.prefillDone(prefillDone("t1", "tok"));
    p.readDone(d, "t1", 1, "bad");
    expect(w.errors).toEqual(["ReadDone for 't1' from 'd0' refused: ERR_BAD_TRANSFER_TOKEN"]);
    expect(failedTo(w, "t1")).toEqual([
      "ERR_BAD_TRANSFER_TOKEN: the transfer's token does not match",
    ]);
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_BAD_TRANSFER_TOKEN"]); // no ReadAck
    p.peerAbort(d, "t1", "bad");
    expect(w.errors.at(-1)).toBe("Abort for 't1' from 'd0' refused: ERR_BAD_TRANSFER_TOKEN");
    p.peerFailed(d, "t1", "ERR_TIMEOUT", "bad");
    expect(w.errors.at(-1)).toBe("Failed for 't1' from 'd0' refused: ERR_BAD_TRANSFER_TOKEN");
    expect(state("t1")).toBe("HELD");
    // A ReadDone for a transfer P has not seen yet: unknown, not held, and nothing recorded.
    p.readDone(d, "later", 1, "");
    expect(w.toPeer.at(-1)?.body).toEqual({
      case: "readAck",
      value: { transferId: "later", held: false, unknown: true },
    });
    expect(state("later")).toBeUndefined();
  });
});

describe("PrefillSide: what a live transfer lists", () => {
  it("a held transfer has no peer, mode or reason yet; a registration names its D and push", () => {
    const { p, d } = setup();
    p.prefillDone(prefillDone("t1"));
    expect(p.infoOf("t1")).toMatchObject({ state: "HELD", peer: "", mode: "", reason: "" });
    p.pushReg(d, pushReg("t2"));
    expect(p.infoOf("t2")).toMatchObject({
      state: "WAITING",
      peer: "d0",
      mode: "push",
      reason: "",
    });
  });
});

describe("PrefillSide: races the multi-process tests leave to chance", () => {
  it("writes in flight hold the transfer: past every deadline, D down, D's Failed, nothing ends it until they settle", async () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    expect(state("t1")).toBe("MOVING");
    w.clock.advance(SETTINGS.leaseMs + SETTINGS.regLeaseMs + 1);
    p.expire(w.clock.now());
    expect(state("t1")).toBe("MOVING");
    expect(w.toPeer).toEqual([]);
    p.abort("t1");
    expect(state("t1")).toBe("ABORTING");
    expect(p.writingTo(d)).toBe(true);
    expect(p.peerFailed(d, "t1", "ERR_TIMEOUT", "")).toBe(false);
    p.peerDown(d);
    p.peerAbort(d, "t1", "");
    p.peerAbort(d, "t1", "");
    expect(state("t1")).toBe("ABORTING");
    expect(w.errors).toEqual([]);
    expect(w.engineSaid("t1")).toEqual([]);
    w.agent.landAll();
    await settle();
    expect(state("t1")).toBe("RELEASED"); // every write landed: the KV is there
    expect(w.peerSaid("t1")).toEqual(["abortAck"]);
    expect(p.writingTo(d)).toBe(false);
  });

  it("a write exactly at the registration's deadline is still allowed; one past it is not, and D hears why", async () => {
    const { w, p, d } = setup();
    p.pushReg(d, pushReg("t1"));
    w.clock.advance(SETTINGS.regLeaseMs);
    p.prefillDone(prefillDone("t1"));
    expect(w.agent.ops).toHaveLength(1);
    const late = setup();
    late.p.pushReg(late.d, pushReg("t2"));
    late.w.clock.advance(SETTINGS.regLeaseMs + 1);
    late.p.prefillDone(prefillDone("t2"));
    await settle();
    expect(late.w.toPeer.at(-1)?.body.value).toMatchObject({
      code: "ERR_ABORTED",
      message: "registration expired, aborted, or peer down before the write",
    });
  });

  it("each rank pair's writes are one operation carrying every region pair", async () => {
    const { w, p, d } = setup();
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    expect(w.agent.partCounts).toEqual([SMALL.regionBytes.length]);
    w.agent.landAll();
    await settle();
    const hops = p.infoOf("t1")!.trace.map((h) => h.hop);
    expect(hops).toContain("pair 0>0 submitted");
    expect(hops).toContain("pair 0>0 notified");
    expect(w.sealed.map((b) => b.case)).toEqual(["xferDone"]);
  });

  it("the same D registering twice before prefill is one registration: it is never refused", async () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1"));
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    w.agent.landAll();
    await settle();
    expect(state("t1")).toBe("RELEASED");
    expect(w.peerSaid("t1")).toEqual([]);
    expect(w.errors).toEqual([]);
  });

  it("a second D withdrawing its waiting registration is acknowledged, and not refused later", async () => {
    const { w, p, d } = setup();
    const d2 = w.peer("d2");
    p.pushReg(d, pushReg("t1"));
    p.pushReg(d2, pushReg("t1"));
    p.peerAbort(d2, "t1", "");
    expect(w.toPeer.at(-1)).toEqual({
      peer: "d2",
      body: { case: "abortAck", value: { transferId: "t1" } },
    });
    p.prefillDone(prefillDone("t1"));
    expect(w.toPeer.filter((m) => m.peer === "d2").map((m) => m.body.case)).toEqual(["abortAck"]);
  });

  it("a registration with a token for a transfer without one: refused ERR_BAD_TRANSFER_TOKEN at PrefillDone, and P holds for a pull", () => {
    const { w, p, d, state } = setup();
    p.pushReg(d, pushReg("t1", "x"));
    p.prefillDone(prefillDone("t1", ""));
    expect(w.toPeer.map((m) => m.body)).toEqual([
      {
        case: "failed",
        value: {
          transferId: "t1",
          code: "ERR_BAD_TRANSFER_TOKEN",
          message: "not the decode engine this transfer names",
        },
      },
    ]);
    expect(w.errors).toEqual(["PushReg for 't1' from 'd0' refused: ERR_BAD_TRANSFER_TOKEN"]);
    expect(state("t1")).toBe("HELD");
    expect(p.infoOf("t1")).toMatchObject({ peer: "", mode: "" });
  });

  it("a ReadDone while only a registration waits (no blocks yet) is answered: not held, not unknown", () => {
    const { w, p, d } = setup();
    p.pushReg(d, pushReg("t1"));
    p.readDone(d, "t1", 1, "x");
    expect(w.toPeer.at(-1)?.body).toEqual({
      case: "readAck",
      value: { transferId: "t1", held: false, unknown: false },
    });
    expect(w.errors).toEqual([]);
  });

  it("blocks shared by two live transfers are fine by default (vLLM shares prefix blocks)", () => {
    const { w, p, state } = setup();
    p.prefillDone(prefillDone("t1", "", [0, 1]));
    p.prefillDone(prefillDone("t2", "", [1, 2]));
    expect(w.refused).toEqual([]);
    expect([state("t1"), state("t2")]).toEqual(["HELD", "HELD"]);
  });

  it("refusal texts: a duplicate PrefillDone, the cap, a second late PrefillDone; the late one's blocks go back by id", () => {
    const { w, p, d } = setup({ maxTransfers: 2 });
    p.pushReg(d, pushReg("late"));
    w.clock.advance(SETTINGS.regLeaseMs);
    p.expire(w.clock.now());
    p.prefillDone(prefillDone("late", "", [6, 7]));
    expect(w.engine.at(-1)).toMatchObject({
      case: "releaseBlocks",
      value: { transferId: "late", blockIds: [6, 7], reason: ReleaseReason.EXPIRED },
    });
    p.prefillDone(prefillDone("late", "", [6, 7]));
    p.prefillDone(prefillDone("a", "", [0, 1]));
    p.prefillDone(prefillDone("a", "", [0, 1]));
    p.prefillDone(prefillDone("b", "", [2, 3]));
    p.prefillDone(prefillDone("c", "", [4, 5]));
    expect(w.refusedText).toEqual([
      "ERR_DUPLICATE: PrefillDone for transfer 'late' already received",
      "ERR_DUPLICATE: PrefillDone for transfer 'a' already received",
      "ERR_OVERLOADED: 2 transfers live",
    ]);
    // A registration before PrefillDone is not refused by the table's cap (issue 48).
    p.pushReg(w.peer("d9"), pushReg("d"));
    expect(w.peerSaid("d")).toEqual([]);
    p.pushReg(d, { ...pushReg("a"), numTokens: 40 });
    expect(w.toPeer.at(-1)?.body.value).toMatchObject({
      code: "ERR_BAD_TOKENS",
      message: "D expects 40 tokens, P prefilled 20",
    });
  });
});
