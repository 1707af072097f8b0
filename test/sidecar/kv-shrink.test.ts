// A KV file that shrinks under its sidecar (issue 31, case 4), in process: the sidecar checks
// its files' sizes (kv.shrunk, one fstat per file) before it hands its memory to UCX, so the
// transfer fails ERR_REGION_CHANGED instead of the process dying of SIGBUS. The multi-process
// cases (a real `truncate -s 0`) are in multiprocess/attacks.test.ts.
import { describe, expect, it } from "vitest";

import { ReleaseReason } from "../../src/gen/kvxfer/v1/engine_pb.js";
import { DecodeSide } from "../../src/sidecar/decode.js";
import { PrefillSide } from "../../src/sidecar/prefill.js";
import { FakeWorld, expectKv, prefillDone, pushReg, settle } from "./fakes.js";

describe("a KV file that shrank under the sidecar (kv.shrunk)", () => {
  const shrink = (w: FakeWorld) => {
    Object.assign(w.ctx.kvs.kv!, { shrunk: () => "rank 0 region 0: KV file '/dev/shm/x' shrank" });
  };

  it("P: a PrefillDone fails at once (no pull may read the blocks), its D told; a push is refused before any write", async () => {
    const w = new FakeWorld({ maxTransfers: 16 });
    const p = new PrefillSide(w.ctx);
    const d = w.peer("d0");
    p.pushReg(d, pushReg("push", "tok"));
    shrink(w);
    p.prefillDone(prefillDone("push", "tok"));
    p.prefillDone(prefillDone("pull", "tok2", [2, 3]));
    await settle();
    expect(w.agent.ops).toEqual([]);
    expect(p.infoOf("push")).toMatchObject({ state: "FAILED", reason: "ERR_REGION_CHANGED" });
    expect(p.infoOf("pull")).toMatchObject({ state: "FAILED", reason: "ERR_REGION_CHANGED" });
    expect(w.peerSaid("push")).toEqual(["failed:ERR_REGION_CHANGED"]);
    expect(w.engineSaid("pull")).toEqual([`releaseBlocks:${ReleaseReason.FAILED}`]);
    expect(w.errors.at(-1)).toMatch(/shrank/);
  });

  it("D: an ExpectKv fails before registering or reading (nothing reaches P), the engine told", async () => {
    const w = new FakeWorld({ maxTransfers: 16 });
    const p0 = w.peer("p0");
    const d = new DecodeSide(w.ctx, () => Promise.resolve(p0));
    shrink(w);
    d.expectKv(expectKv("push", false, "tok", [2, 3]), false);
    d.expectKv(expectKv("pull", true, "tok2", [4, 5]), true);
    await settle();
    expect(w.toPeer).toEqual([]);
    expect(w.agent.ops).toEqual([]);
    expect(d.infoOf("push")).toMatchObject({ state: "FAILED", reason: "ERR_REGION_CHANGED" });
    expect(d.infoOf("pull")).toMatchObject({ state: "FAILED", reason: "ERR_REGION_CHANGED" });
    expect(w.engine.filter((m) => m.case === "kvFailed")).toHaveLength(2);
  });
});

describe("a KV file that shrank after PrefillDone", () => {
  it("P: a registration arriving for held blocks is refused before any write (ERR_REGION_CHANGED)", async () => {
    const w = new FakeWorld({ maxTransfers: 16 });
    const p = new PrefillSide(w.ctx);
    p.prefillDone(prefillDone("t1", "tok"));
    Object.assign(w.ctx.kvs.kv!, { shrunk: () => "rank 0 region 0: KV file shrank" });
    p.pushReg(w.peer("d0"), pushReg("t1", "tok"));
    await settle();
    expect(w.agent.ops).toEqual([]);
    expect(p.infoOf("t1")).toMatchObject({ state: "FAILED", reason: "ERR_REGION_CHANGED" });
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_REGION_CHANGED"]);
    expect(w.errors.at(-1)).toMatch(/push of 't1' refused: ERR_REGION_CHANGED/);
  });
});

describe("the registered KV broke (found by the sweep)", () => {
  it("P: what it holds for a pull fails ERR_REGION_CHANGED (D's read is not confirmed); a registration waiting goes on", () => {
    const w = new FakeWorld({ maxTransfers: 16 });
    const p = new PrefillSide(w.ctx);
    const d = w.peer("d0");
    p.prefillDone(prefillDone("held", "tok"));
    p.pushReg(d, pushReg("waiting", "tok2"));
    p.failHeld("ERR_REGION_CHANGED");
    expect(p.infoOf("held")).toMatchObject({ state: "FAILED", reason: "ERR_REGION_CHANGED" });
    expect(w.engineSaid("held")).toEqual([`releaseBlocks:${ReleaseReason.FAILED}`]);
    expect(p.infoOf("waiting")!.state).toBe("WAITING");
    p.readDone(d, "held", 1, "tok");
    expect(w.toPeer.at(-1)!.body).toMatchObject({ case: "readAck", value: { held: false } });
    // A push registering for it now hears why.
    p.pushReg(d, pushReg("held", "tok"));
    expect(w.peerSaid("held").at(-1)).toBe("failed:ERR_REGION_CHANGED");
  });
});
