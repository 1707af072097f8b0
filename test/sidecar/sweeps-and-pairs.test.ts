// The two kinds of test the held-out mutation audit found missing (issue 31, "Tests the suite
// still lacks"), in process:
// (a) invariant 5: a sweep visits every entry because deadlines are not ordered: for each table
//     the sidecar sweeps (P's transfers in each state and their registrations, D's transfers,
//     the peer table), an expired entry that sits behind live ones (later in the table's order)
//     is expired, and the live ones are not;
// (b) invariant 1 against an insider: a well-sealed P, on the right agent pair, that sends
//     XferDone for rank pairs the transfer does not expect, repeats, or a ReadAck before the
//     reads are done never brings D closer to ready, for several TP pairings.
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import {
  HandshakeRequestSchema,
  PushRegSchema,
  XferDoneSchema,
} from "../../src/gen/kvxfer/v1/peer_pb.js";
import { newMacKey } from "../../src/peer/messages.js";
import { singleGroup, type KvLayout } from "../../src/plan/index.js";
import { DecodeSide } from "../../src/sidecar/decode.js";
import { PrefillSide } from "../../src/sidecar/prefill.js";
import {
  FakeWorld,
  PeerTableWorld,
  PUSH_DRAIN_MS,
  SETTINGS,
  expectKv,
  peerMetadata,
  prefillDone,
  settle,
  smallTp,
} from "./fakes.js";

const pushReg = (transferId: string, leaseMs: number) =>
  create(PushRegSchema, {
    transferId,
    blockIds: [4, 5],
    numTokens: 20,
    prefixTokens: 0,
    leaseMs,
    token: "",
  });

describe("(a) an expired entry behind live ones is swept", () => {
  it("P, HELD: a lease that ran out behind two renewed ones", () => {
    const w = new FakeWorld({ maxTransfers: 8 });
    const p = new PrefillSide(w.ctx);
    const d = w.peer("d0");
    p.prefillDone(prefillDone("live-1", "", [0, 1]));
    p.prefillDone(prefillDone("live-2", "", [2, 3]));
    p.prefillDone(prefillDone("stale", "", [4, 5]));
    w.clock.advance(SETTINGS.leaseMs / 2);
    p.renewLeases(d, ["live-1", "live-2"]);
    w.clock.advance(SETTINGS.leaseMs / 2);
    p.expire(w.clock.now());
    expect(["live-1", "live-2", "stale"].map((id) => p.infoOf(id)!.state)).toEqual([
      "HELD",
      "HELD",
      "EXPIRED",
    ]);
  });

  it("P, WAITING: a short registration lease behind long ones, across transfers and within one", () => {
    const w = new FakeWorld({ maxTransfers: 8 });
    const p = new PrefillSide(w.ctx);
    const [d0, d1] = [w.peer("d0"), w.peer("d1")];
    p.pushReg(d0, pushReg("long-1", 10_000));
    p.pushReg(d0, pushReg("long-2", 10_000));
    p.pushReg(d0, pushReg("short", 100));
    p.pushReg(d1, pushReg("long-1", 100)); // behind d0's long one in long-1's own list
    w.clock.advance(100);
    p.expire(w.clock.now());
    const timedOut = w.toPeer
      .filter((m) => m.body.case === "failed")
      .map((m) => `${m.peer} ${(m.body.value as { transferId: string }).transferId}`);
    expect(timedOut).toEqual(["d1 long-1", "d0 short"]);
    expect([...p.livePeers()].map((x) => x.engineId)).toEqual(["d0"]);
  });

  it("P, tombstones and emptied entries: one past its time behind live ones is forgotten", () => {
    const w = new FakeWorld({ maxTransfers: 8 });
    const p = new PrefillSide(w.ctx);
    const d = w.peer("d0");
    p.prefillDone(prefillDone("live", "", [0, 1]));
    p.pushReg(d, pushReg("waiting", 600_000));
    p.prefillDone(prefillDone("ended", "", [2, 3]));
    p.abort("ended");
    p.pushReg(d, pushReg("emptied", 600_000));
    p.peerAbort(d, "emptied", ""); // withdrawn: remembered for a late PrefillDone, then gone
    for (let i = 0; i < 10; i++) {
      w.clock.advance(SETTINGS.tombstoneMs / 10);
      p.renewLeases(d, ["live", "waiting"]);
      p.expire(w.clock.now());
    }
    expect(p.infoOf("ended")).toBeUndefined();
    expect(p.infoOf("emptied")).toBeUndefined();
    expect([p.infoOf("live")?.state, p.infoOf("waiting")?.state]).toEqual(["HELD", "WAITING"]);
    expect(p.live()).toBe(2);
  });

  it("D: an abort's drain behind two moving pushes ends; a tombstone behind live ones is forgotten", async () => {
    const w = new FakeWorld({ maxTransfers: 8, transferTimeoutMs: 60_000, tombstoneMs: 1000 });
    const p0 = w.peer("p0");
    const d = new DecodeSide(w.ctx, () => Promise.resolve(p0));
    d.expectKv(expectKv("live-1", false, "", [0, 1]), false);
    d.expectKv(expectKv("live-2", false, "", [2, 3]), false);
    d.expectKv(expectKv("draining", false, "", [4, 5]), false);
    d.expectKv(expectKv("ended", true, "", [6, 7]), true);
    await settle();
    d.abort("draining"); // waits for P's AbortAck or P's registration lease plus the grace
    w.agent.landAll();
    await settle();
    d.abort("ended");
    w.clock.advance(PUSH_DRAIN_MS);
    d.expire(w.clock.now());
    expect(d.infoOf("draining")!.state).toBe("ABORTED");
    expect([d.infoOf("live-1")!.state, d.infoOf("live-2")!.state]).toEqual(["MOVING", "MOVING"]);
    w.clock.advance(1000);
    d.expire(w.clock.now());
    expect(d.infoOf("ended")).toBeUndefined();
    expect(d.infoOf("draining")).toBeUndefined();
    expect(d.live()).toBe(2);
  });

  it("peers: one silent past the timeout behind two that spoke is dropped; an idle one behind them forgotten", () => {
    const world = new PeerTableWorld();
    const { table, clock, downs } = world;
    // Each D keeps its key when it handshakes again (the same session).
    const keys = new Map<string, Uint8Array>();
    const hello = (id: string) =>
      table.onHandshake(
        create(HandshakeRequestSchema, {
          metadata: peerMetadata(id, 7n),
          macKey: keys.get(id) ?? keys.set(id, newMacKey()).get(id)!,
        }),
        undefined,
      );
    for (const id of ["d0", "d1", "silent"]) hello(id);
    clock.advance(4000);
    hello("d0"); // the same epoch again: seen now
    hello("d1");
    clock.advance(1000);
    table.expire(clock.now());
    expect(downs.map((x) => x.peer)).toEqual(["silent"]);
    expect(table.list().map((x) => x.engineId)).toEqual(["d0", "d1"]);
    // Idle (no live transfers) and unheard of past the tombstone: forgotten, the others kept.
    world.live = false;
    hello("idle");
    clock.advance(30_000);
    hello("d0");
    hello("d1");
    clock.advance(30_001);
    table.expire(clock.now());
    expect(table.list().map((x) => x.engineId)).toEqual(["d0", "d1"]);
  });
});

describe("(b) a well-sealed P's notifications for pairs the transfer does not expect", () => {
  const cases: [string, KvLayout, KvLayout][] = [
    ["P tp2 -> D tp2", smallTp(2), smallTp(2)],
    ["P tp4 -> D tp2 (D gathers)", smallTp(4), smallTp(2)],
    ["P tp2 -> D tp4 (D takes a slice)", smallTp(2), smallTp(4)],
  ];
  for (const [name, pLayout, dLayout] of cases) {
    it(`${name}: unexpected, repeated and misrouted XferDones leave D short of ready; the expected ones make it ready`, async () => {
      const w = new FakeWorld({}, dLayout);
      const p = w.peer("p0", pLayout);
      const d = new DecodeSide(w.ctx, () => Promise.resolve(p));
      d.expectKv(expectKv("t1", false, "", [6, 7]), false);
      await settle();
      const expected = p
        .pairing(singleGroup(pLayout), singleGroup(dLayout))
        .rankPairs.map((r) => `${r.srcRank}:${r.dstRank}`);
      const done = (src: number, dst: number) =>
        create(XferDoneSchema, { transferId: "t1", srcRank: src, dstRank: dst, bytes: 100n });
      // Every pair the transfer does not expect, each on its own (right) agent pair, twice.
      for (let s = 0; s < pLayout.tpSize + 2; s++)
        for (let r = 0; r < dLayout.tpSize + 2; r++)
          if (!expected.includes(`${s}:${r}`)) {
            d.xferDone(p, s, r, done(s, r));
            d.xferDone(p, s, r, done(s, r));
          }
      // Every expected pair but the last, each repeated, and each also claimed from a wrong agent.
      const [last, ...firsts] = [...expected].reverse();
      for (const key of firsts) {
        const [s, r] = key.split(":").map(Number) as [number, number];
        d.xferDone(p, s, r, done(s, r));
        d.xferDone(p, s, r, done(s, r));
        d.xferDone(p, s + 1, r, done(s, r));
      }
      // The last pair claimed by its body but arriving from another agent pair.
      const [s, r] = last!.split(":").map(Number) as [number, number];
      d.xferDone(p, s + 1, r, done(s, r));
      d.xferDone(p, s, r + 1, done(s, r));
      expect(d.infoOf("t1")!.state).toBe("MOVING");
      expect(w.engineSaid("t1")).toEqual([]);
      d.xferDone(p, s, r, done(s, r));
      expect(d.infoOf("t1")!.state).toBe("KV_READY");
      expect(d.infoOf("t1")!.bytes, "only the expected pairs' bytes, once each").toBe(
        100 * expected.length,
      );
    });
  }

  it("pull: a ReadAck (held) before the reads are done, or for another transfer, never makes it ready", async () => {
    const w = new FakeWorld({}, smallTp(2));
    const p = w.peer("p0", smallTp(2));
    const d = new DecodeSide(w.ctx, () => Promise.resolve(p));
    d.expectKv(expectKv("t1", true, "", [6, 7]), true);
    d.expectKv(expectKv("t2", true, "", [2, 3]), true);
    await settle();
    d.readAck(p, "t1", true, false);
    d.readAck(p, "t1", true, false);
    expect(d.infoOf("t1")!.state).toBe("MOVING");
    w.agent.landAll();
    await settle();
    expect(d.infoOf("t1")!.state).toBe("CONFIRMING");
    d.readAck(w.peer("p-other", smallTp(2)), "t1", true, false); // not its P
    d.readAck(p, "t2", false, false); // another transfer's answer
    expect(d.infoOf("t1")!.state).toBe("CONFIRMING");
    d.readAck(p, "t1", true, false);
    expect(d.infoOf("t1")!.state).toBe("KV_READY");
  });
});
