// Races the multi-process tests leave to chance, forced here in process, every ordering on every
// run: completions from every source rank in every order (D is ready exactly when the last
// pair's XferDone is in, never before), both orders of PushReg and PrefillDone, aborts before,
// during and after the data on both sides, a write that fails to post, and D's transfer cap.
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { ReleaseReason } from "../../src/gen/kvxfer/v1/engine_pb.js";
import { PushRegSchema, XferDoneSchema } from "../../src/gen/kvxfer/v1/peer_pb.js";
import { mapRanks } from "../../src/plan/index.js";
import { DecodeSide } from "../../src/sidecar/decode.js";
import { PrefillSide } from "../../src/sidecar/prefill.js";
import { FakeWorld, SETTINGS, expectKv, prefillDone, settle, smallTp } from "./fakes.js";

function permutations<T>(items: readonly T[]): T[][] {
  if (items.length <= 1) return [[...items]];
  const out: T[][] = [];
  items.forEach((x, i) => {
    for (const rest of permutations([...items.slice(0, i), ...items.slice(i + 1)]))
      out.push([x, ...rest]);
  });
  return out;
}

const pushReg = (transferId: string) =>
  create(PushRegSchema, {
    transferId,
    blockIds: [4, 5],
    numTokens: 20,
    prefixTokens: 0,
    leaseMs: SETTINGS.regLeaseMs,
  });

describe("D is ready exactly when the last pair's data is in", () => {
  for (const [pTp, dTp] of [
    [2, 4],
    [4, 1],
    [2, 2],
  ] as const) {
    it(`P TP ${pTp} -> D TP ${dTp}: every order of XferDone`, async () => {
      const pLayout = smallTp(pTp, 16);
      const dLayout = smallTp(dTp, 32);
      const pairs = mapRanks(pLayout, dLayout).flatMap((d) =>
        d.sources.map((s) => [s.srcRank, d.dstRank] as const),
      );
      expect(pairs.length).toBeGreaterThan(1);
      const orders = permutations(pairs);
      for (const [n, order] of orders.entries()) {
        const w = new FakeWorld({}, dLayout);
        const p = w.peer("p0", pLayout);
        const d = new DecodeSide(w.ctx, () => Promise.resolve(p));
        const id = `t${n}`;
        d.expectKv(expectKv(id, false, "", [1]), false);
        await settle();
        const state = () => d.list()[0]!.state;
        for (const [i, [src, dst]] of order.entries()) {
          const done = create(XferDoneSchema, {
            transferId: id,
            srcRank: src,
            dstRank: dst,
            bytes: 100n,
          });
          d.xferDone(p, src, dst, done);
          if (i < order.length - 1) {
            // The same pair again (a duplicate or a replay that got through) counts once.
            d.xferDone(p, src, dst, done);
            expect(state(), `order ${n}, after ${i + 1} of ${order.length}`).toBe("MOVING");
            expect(w.engineSaid(id)).toEqual([]);
          }
        }
        expect(state(), `order ${n}`).toBe("KV_READY");
        expect(w.engineSaid(id)).toEqual(["kvReady"]);
        expect(w.eventsOf(id)).toEqual(["KV_READY"]);
      }
    });
  }
});

describe("P: both orders of PushReg and PrefillDone", () => {
  for (const order of ["PushReg first", "PrefillDone first"] as const) {
    it(order, async () => {
      const w = new FakeWorld();
      w.agent.autoLand = true;
      const p = new PrefillSide(w.ctx);
      const d = w.peer("d0");
      if (order === "PushReg first") {
        p.pushReg(d, pushReg("t1"));
        expect(p.list()[0]!.state).toBe("WAITING");
        p.prefillDone(prefillDone("t1"));
      } else {
        p.prefillDone(prefillDone("t1"));
        expect(p.list()[0]!.state).toBe("HELD");
        p.pushReg(d, pushReg("t1"));
      }
      expect(p.list()[0]!.state).toBe("MOVING");
      await settle();
      expect(p.list()[0]!.state).toBe("RELEASED");
      expect(w.sealed.map((b) => b.case)).toEqual(["xferDone"]);
      expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.TRANSFERRED}`]);
    });
  }

  it("a write that fails to post: nothing lands, D hears Failed, blocks back FAILED", async () => {
    const w = new FakeWorld();
    w.agent.failToPost = true;
    const p = new PrefillSide(w.ctx);
    const d = w.peer("d0");
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    await settle();
    expect(p.list()[0]!.state).toBe("FAILED");
    expect(w.sealed, "no XferDone").toEqual([]);
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_OUT_OF_BOUNDS"]);
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.FAILED}`]);
  });
});

describe("aborts before, during and after the data", () => {
  it("P: the engine aborts before the registration, during the writes, after the release", async () => {
    const w = new FakeWorld();
    const p = new PrefillSide(w.ctx);
    const d = w.peer("d0");
    const state = (id: string) => p.list().find((t) => t.transferId === id)!.state;
    // Before: held, no registration yet.
    p.prefillDone(prefillDone("before"));
    p.abort("before");
    expect(state("before")).toBe("ABORTED");
    // A registration after that is refused by name; no write is posted.
    p.pushReg(d, pushReg("before"));
    expect(w.peerSaid("before")).toEqual(["failed:ERR_ENDED"]);
    // During: ABORTING until the writes settle.
    p.pushReg(d, pushReg("during"));
    p.prefillDone(prefillDone("during"));
    p.abort("during");
    expect(state("during")).toBe("ABORTING");
    w.agent.failAll();
    await settle();
    expect(state("during")).toBe("ABORTED");
    // After: RELEASED stays RELEASED.
    w.agent.autoLand = true;
    p.pushReg(d, pushReg("after"));
    p.prefillDone(prefillDone("after"));
    await settle();
    p.abort("after");
    expect(state("after")).toBe("RELEASED");
    for (const id of ["before", "during", "after"]) expect(w.engineSaid(id), id).toHaveLength(1); // one ReleaseBlocks each
    expect(w.events.map((e) => e.kind)).toEqual(["ABORTED", "ABORTED", "RELEASED"]);
  });

  it("D: the engine aborts before the handshake, during the data, after KV_READY", async () => {
    const w = new FakeWorld();
    const p = w.peer("p0");
    let answer: (() => void) | undefined;
    const d = new DecodeSide(
      w.ctx,
      () => new Promise((res) => (answer = () => res(p))), // each handshake waits for the test
    );
    const state = (id: string) => d.list().find((t) => t.transferId === id)!.state;
    // Before: nothing reached P, the blocks go back at once; the late handshake changes nothing.
    d.expectKv(expectKv("before", false, "", [1]), false);
    d.abort("before");
    expect(state("before")).toBe("ABORTED");
    expect(w.engineSaid("before")).toEqual(["kvFailed", `releaseBlocks:${ReleaseReason.ABORTED}`]);
    answer!();
    await settle();
    expect(w.peerSaid("before")).toEqual([]);
    // During: registered with P; blocks wait for P's AbortAck.
    d.expectKv(expectKv("during", false, "", [2]), false);
    answer!();
    await settle();
    d.abort("during");
    expect(state("during")).toBe("DRAINING");
    expect(w.engineSaid("during")).toEqual(["kvFailed"]);
    // A late XferDone while draining makes nothing ready.
    d.xferDone(p, 0, 0, create(XferDoneSchema, { transferId: "during", bytes: 1n }));
    expect(state("during")).toBe("DRAINING");
    d.abortAck(p, "during");
    expect(state("during")).toBe("ABORTED");
    // After: the KV is there; an abort changes nothing.
    d.expectKv(expectKv("after", false, "", [3]), false);
    answer!();
    await settle();
    d.xferDone(p, 0, 0, create(XferDoneSchema, { transferId: "after", bytes: 1n }));
    d.abort("after");
    expect(state("after")).toBe("KV_READY");
    expect(w.eventsOf("after")).toEqual(["KV_READY"]);
  });

  it("D's transfer cap: one ExpectKv too many is refused ERR_OVERLOADED, and a slot frees at the end", async () => {
    const w = new FakeWorld({ maxTransfers: 2 });
    const p = w.peer("p0");
    const d = new DecodeSide(w.ctx, () => Promise.resolve(p));
    d.expectKv(expectKv("t1", false, "", [1]), false);
    d.expectKv(expectKv("t2", false, "", [2]), false);
    d.expectKv(expectKv("t3", false, "", [3]), false);
    expect(w.refused).toEqual([{ transferId: "t3", code: "ERR_OVERLOADED" }]);
    await settle();
    d.xferDone(p, 0, 0, create(XferDoneSchema, { transferId: "t1", bytes: 1n }));
    d.expectKv(expectKv("t3", false, "", [3]), false);
    expect(w.refused).toHaveLength(1);
    expect(d.live()).toBe(2);
  });
});
