// Every refusal of P's side and of the peer table, by its exact code, in process: duplicates,
// block claims, competing registrations and tokens, bad token counts; malformed, incompatible or
// unauthenticated handshakes. Each costs only the message (or the transfer) it belongs to.
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { HandshakeRequestSchema, PushRegSchema } from "../../src/gen/kvxfer/v1/peer_pb.js";
import { newMacKey } from "../../src/peer/messages.js";
import { PrefillSide } from "../../src/sidecar/prefill.js";
import {
  FakeWorld,
  PeerTableWorld,
  SETTINGS,
  peerMetadata,
  prefillDone,
  settle,
  smallTp,
} from "./fakes.js";

const pushReg = (transferId: string, token = "", o: { numTokens?: number; prefix?: number } = {}) =>
  create(PushRegSchema, {
    transferId,
    blockIds: [4, 5],
    numTokens: o.numTokens ?? 20,
    prefixTokens: o.prefix ?? 0,
    leaseMs: SETTINGS.regLeaseMs,
    token,
  });

describe("P's refusals", () => {
  it("a second PrefillDone is ERR_DUPLICATE and changes nothing", () => {
    const w = new FakeWorld();
    const p = new PrefillSide(w.ctx);
    p.prefillDone(prefillDone("t1"));
    p.prefillDone(prefillDone("t1"));
    expect(w.refused).toEqual([{ transferId: "t1", code: "ERR_DUPLICATE" }]);
    expect(w.engineSaid("t1")).toEqual([]);
    expect(p.live()).toBe(1);
  });

  it("exclusive blocks: a PrefillDone naming a held block is refused (no ReleaseBlocks) until the holder ends", () => {
    const w = new FakeWorld({ exclusivePrefillBlocks: true });
    const p = new PrefillSide(w.ctx);
    const d = w.peer("d0");
    p.prefillDone(prefillDone("first", "", [0, 1]));
    p.prefillDone(prefillDone("second", "", [1, 2]));
    expect(w.refused).toEqual([{ transferId: "second", code: "ERR_BLOCKS_IN_USE" }]);
    expect(w.engineSaid("second")).toEqual([]);
    p.readDone(d, "first", 10, ""); // pull: the first one ends, its blocks go back
    p.prefillDone(prefillDone("second", "", [1, 2]));
    expect(w.refused).toHaveLength(1);
    expect(p.list().find((t) => t.transferId === "second")?.state).toBe("HELD");
  });

  it("registrations before PrefillDone: the token picks the decode engine, the others are refused", async () => {
    const w = new FakeWorld();
    w.agent.autoLand = true;
    const p = new PrefillSide(w.ctx);
    const [d0, d1, d2, d3, d4, d5] = ["d0", "d1", "d2", "d3", "d4", "d5"].map((n) => w.peer(n));
    p.pushReg(d0!, pushReg("t1", "wrong"));
    p.pushReg(d1!, pushReg("t1", "right"));
    p.pushReg(d1!, pushReg("t1", "right")); // the same engine again: idempotent
    for (const d of [d2!, d3!, d4!]) p.pushReg(d, pushReg("t1", "other"));
    p.pushReg(d5!, pushReg("t1", "late")); // a sixth engine: kept too (no cap per transfer)
    const by = (peer: string) =>
      w.toPeer.filter((m) => m.peer === peer).map((m) => (m.body.value as { code?: string }).code);
    expect(by("d5")).toEqual([]);
    p.peerAbort(d4!, "t1", ""); // a waiting registration withdrawn: acknowledged
    expect(w.toPeer.filter((m) => m.peer === "d4").map((m) => m.body.case)).toEqual(["abortAck"]);
    p.prefillDone(prefillDone("t1", "right"));
    await settle();
    expect(p.list()[0]!.state).toBe("RELEASED");
    expect(p.list()[0]!.peer).toBe("d1");
    // The trace shows the first registration and each one kept aside (d1 to d5; d1's repeat
    // leaves none).
    const hops = p.list()[0]!.trace.map((h) => h.hop);
    expect(hops.filter((h) => h === "peer.pushReg")).toHaveLength(1);
    expect(hops.filter((h) => h === "peer.pushReg kept aside")).toHaveLength(5);
    expect(by("d0")).toEqual(["ERR_BAD_TRANSFER_TOKEN"]);
    expect(by("d2")).toEqual(["ERR_BAD_TRANSFER_TOKEN"]);
    expect(by("d5")).toEqual(["ERR_BAD_TRANSFER_TOKEN"]);
    expect(by("d1")).toEqual([]);
  });

  it("without a token the first registration wins; the others are ERR_DUPLICATE", async () => {
    const w = new FakeWorld();
    w.agent.autoLand = true;
    const p = new PrefillSide(w.ctx);
    const [d0, d1] = [w.peer("d0"), w.peer("d1")];
    p.pushReg(d0, pushReg("t1"));
    p.pushReg(d1, pushReg("t1"));
    p.prefillDone(prefillDone("t1"));
    await settle();
    expect(p.list()[0]!.peer).toBe("d0");
    expect(w.toPeer.find((m) => m.peer === "d1")?.body).toMatchObject({
      case: "failed",
      value: { code: "ERR_DUPLICATE" },
    });
    // After PrefillDone, another registration is refused at once.
    p.pushReg(w.peer("d2"), pushReg("t2"));
    p.prefillDone(prefillDone("t2", "tok"));
    p.pushReg(w.peer("d3"), pushReg("t2", "nope"));
    expect(w.peerSaid("t2")).toEqual([
      "failed:ERR_BAD_TRANSFER_TOKEN",
      "failed:ERR_BAD_TRANSFER_TOKEN",
    ]);
  });

  it("bad token counts, a token mismatch with prefill, a ReadDone or Failed with the wrong token", async () => {
    const w = new FakeWorld();
    const p = new PrefillSide(w.ctx);
    const d = w.peer("d0");
    p.pushReg(d, pushReg("zero", "", { numTokens: 0 }));
    p.pushReg(d, pushReg("prefix", "", { numTokens: 10, prefix: 11 }));
    expect(w.peerSaid("zero")).toEqual(["failed:ERR_BAD_TOKENS"]);
    expect(w.peerSaid("prefix")).toEqual(["failed:ERR_BAD_TOKENS"]);
    // D expects 20 tokens, P prefilled 40: refused before any write.
    p.pushReg(d, pushReg("count"));
    p.prefillDone({ ...prefillDone("count"), numTokens: 40 });
    await settle();
    expect(w.agent.ops).toEqual([]);
    expect(w.peerSaid("count")).toEqual(["failed:ERR_BAD_TOKENS"]);
    // Pull with the wrong token: refused, the blocks stay held.
    p.prefillDone(prefillDone("pull", "tok"));
    p.readDone(d, "pull", 10, "not-tok");
    expect(w.peerSaid("pull")).toEqual(["failed:ERR_BAD_TRANSFER_TOKEN"]);
    expect(p.peerFailed(d, "pull", "ERR_X", "not-tok")).toBe(true);
    expect(p.list().find((t) => t.transferId === "pull")?.state).toBe("HELD");
    expect(w.errors.some((e) => e.includes("Failed for 'pull' from 'd0' refused"))).toBe(true);
    // An unknown transfer: D is told P has no record (it asks again).
    p.readDone(d, "unknown", 10, "");
    expect(w.toPeer.at(-1)?.body).toMatchObject({ case: "readAck", value: { unknown: true } });
    // Failed with the right token ends it.
    expect(p.peerFailed(d, "pull", "ERR_X", "tok")).toBe(true);
    expect(p.list().find((t) => t.transferId === "pull")?.state).toBe("FAILED");
    expect(p.peerFailed(d, "pull", "ERR_X", "tok")).toBe(false);
  });
});

describe("the peer table's refusals of a handshake", () => {
  const good = () => ({ metadata: peerMetadata("d0", 7n), macKey: newMacKey() });

  const cases: [string, () => object, string, object?][] = [
    ["no metadata", () => ({ macKey: newMacKey() }), "ERR_MALFORMED"],
    [
      "a bad engine id",
      () => ({ ...good(), metadata: { ...peerMetadata("d0", 7n), engineId: "a b" } }),
      "ERR_MALFORMED",
    ],
    ["epoch 0", () => ({ ...good(), metadata: peerMetadata("d0", 0n) }), "ERR_MALFORMED"],
    [
      "no layout",
      () => ({ ...good(), metadata: { ...peerMetadata("d0", 7n), layout: undefined } }),
      "ERR_MALFORMED",
    ],
    [
      "ranks that do not match tp_size",
      () => ({ ...good(), metadata: { ...peerMetadata("d0", 7n), ranks: [] } }),
      "ERR_MALFORMED",
    ],
    [
      "a rank without a key per region",
      () => {
        const md = peerMetadata("d0", 7n);
        md.ranks[0]!.remoteKeys = [];
        return { ...good(), metadata: md };
      },
      "ERR_MALFORMED",
    ],
    ["a short MAC key", () => ({ ...good(), macKey: new Uint8Array(3) }), "ERR_MALFORMED"],
    [
      "an incompatible layout",
      () => ({ ...good(), metadata: peerMetadata("d0", 7n, smallTp(1, 16)) }),
      "ERR_LAYOUT_INCOMPATIBLE",
    ],
    ["any handshake before the engine registered", good, "ERR_NOT_READY", { notAccepting: true }],
    ["a certificate naming another engine", good, "ERR_UNAUTHENTICATED", { authenticated: true }],
  ];
  for (const [what, req, code, opts] of cases) {
    it(`${what}: ${code}`, () => {
      const { table: t, errors } = new PeerTableWorld(opts as never);
      const res = t.onHandshake(create(HandshakeRequestSchema, req() as never), "someone-else");
      expect(res.errorCode).toBe(code);
      expect(res.metadata).toBeUndefined();
      expect(t.list()).toEqual([]);
      expect(errors.at(-1)).toContain(code);
    });
  }
});
