// A stopping sidecar tells its peers (issue 31, case 5), in process: P's drain fails what waits
// for a PrefillDone it will refuse and tells each registered D at once; new registrations are
// refused ERR_DRAINING; at the drain's deadline what is left fails, its D told. D's abandon
// fails its transfers and tells P (Abort), so P frees its blocks before its lease.
import { describe, expect, it } from "vitest";

import { ReleaseReason } from "../../src/gen/kvxfer/v1/engine_pb.js";
import { DecodeSide } from "../../src/sidecar/decode.js";
import { PrefillSide } from "../../src/sidecar/prefill.js";
import { FakeWorld, expectKv, prefillDone, pushReg, settle } from "./fakes.js";

describe("drain tells the peer", () => {
  it("P: registrations waiting for prefill fail at once, D told ERR_DRAINING; new ones refused; held ones go on until the deadline", async () => {
    const w = new FakeWorld({ maxTransfers: 16 });
    const p = new PrefillSide(w.ctx);
    const d = w.peer("d0");
    p.pushReg(d, pushReg("waiting-1"));
    p.pushReg(d, pushReg("waiting-2"));
    p.prefillDone(prefillDone("held-pull", "tok", [6, 7]));
    p.prefillDone(prefillDone("held-push", "tok2", [2, 3]));
    p.drain();
    expect(w.peerSaid("waiting-1")).toEqual(["failed:ERR_DRAINING"]);
    expect(w.peerSaid("waiting-2")).toEqual(["failed:ERR_DRAINING"]);
    expect(w.eventsOf("waiting-1")).toEqual(["FAILED"]);
    expect(p.live()).toBe(2);
    // A new registration is refused at once; one for a held transfer is served.
    p.pushReg(d, pushReg("new"));
    expect(w.peerSaid("new")).toEqual(["failed:ERR_DRAINING"]);
    expect(p.infoOf("new")).toBeUndefined();
    w.agent.autoLand = true;
    p.pushReg(d, pushReg("held-push", "tok2"));
    await settle();
    expect(p.infoOf("held-push")!.state).toBe("RELEASED");
    // The deadline: the pull nobody read fails now, its blocks back.
    p.abandon();
    expect(p.infoOf("held-pull")!.state).toBe("FAILED");
    expect(w.engineSaid("held-pull")).toEqual([`releaseBlocks:${ReleaseReason.FAILED}`]);
    expect(p.live()).toBe(0);
  });

  it("D: the transfers left fail, the engine told KvFailed; P told Abort (pull: at once; push: its writes stop)", async () => {
    const w = new FakeWorld({ maxTransfers: 16 });
    const p0 = w.peer("p0");
    const d = new DecodeSide(w.ctx, () => Promise.resolve(p0));
    d.expectKv(expectKv("pull", true, "tok", [2, 3]), true);
    d.expectKv(expectKv("push", false, "tok2", [4, 5]), false);
    await settle();
    d.abandon();
    expect(w.engine.filter((m) => m.case === "kvFailed").map((m) => m.value.transferId)).toEqual([
      "pull",
      "push",
    ]);
    const aborts = w.toPeer.filter((m) => m.body.case === "abort").map((m) => m.body.value);
    expect(aborts).toMatchObject([
      { transferId: "pull", reason: "ERR_DRAINING", token: "tok" },
      { transferId: "push", reason: "ERR_DRAINING", token: "tok2" },
    ]);
  });
});

describe("drain: what is already over, or never reached P", () => {
  it("D's abandon skips ended and draining transfers; one whose handshake never answered ends at once", async () => {
    const w = new FakeWorld({ maxTransfers: 16 });
    const p0 = w.peer("p0");
    const d = new DecodeSide(w.ctx, (src) =>
      src === "hangs" ? new Promise(() => undefined) : Promise.resolve(p0),
    );
    d.expectKv(expectKv("ended", true, "", [0, 1]), true);
    d.expectKv(expectKv("draining", false, "", [2, 3]), false);
    d.expectKv({ ...expectKv("no-answer", false, "", [4, 5]), source: "hangs" }, false);
    await settle();
    d.abort("ended"); // pull, reads in flight: ends when they settle
    w.agent.landAll();
    await settle();
    d.abort("draining"); // push registered: waits for P's AbortAck
    expect([d.infoOf("ended")!.state, d.infoOf("draining")!.state]).toEqual([
      "ABORTED",
      "DRAINING",
    ]);
    const before = w.toPeer.length;
    d.abandon();
    expect(d.infoOf("no-answer")).toMatchObject({ state: "ABORTED", reason: "ERR_DRAINING" });
    expect(d.infoOf("draining")!.state).toBe("DRAINING");
    expect(w.toPeer.length, "nothing new to P: the handshake never answered").toBe(before);
  });
});
