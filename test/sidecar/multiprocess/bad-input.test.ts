// Bad input on every channel of a real sidecar pair (processes from dist/, simulated engines, UCX
// over shared memory, ZeroMQ, gRPC): the engine link, the handshake side channel, and UCX peer
// notifications from an agent this test runs itself. Each bad message is refused with a named
// reason and costs at most the transfer it names; a good transfer before and after verifies.
// `npm run build` first.
import * as tls from "node:tls";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { EngineToSidecarSchema } from "../../../src/gen/kvxfer/v1/engine_pb.js";
import {
  HandshakeRequestSchema,
  HandshakeResponseSchema,
  PeerMessageSchema,
} from "../../../src/gen/kvxfer/v1/peer_pb.js";
import { encodePeerMessage, sealPeerMessage } from "../../../src/peer/messages.js";
import { parseAddress } from "../../../src/peer/side-channel.js";
import { sharedPki } from "../../../sim/pki.js";
import { RoguePeer, credentials } from "./rogue-peer.js";
import { KvNode, type Pair, goodTransfer, startPair } from "./fixtures.js";
import { until } from "../../until.js";

const WAIT = 10_000;
/** Bytes no protobuf parser accepts: a field tag whose varint never ends. */
const NOT_PROTOBUF = Buffer.from("ffffffffffffffffffff", "hex");

async function lastErrors(node: KvNode): Promise<readonly string[]> {
  return (await node.client.getStatus()).lastErrors;
}

describe("sidecar bad input (multi-process)", () => {
  let pair: Pair;
  let p: KvNode;
  let d: KvNode;

  beforeAll(async () => {
    pair = await startPair({ mode: "auto" });
    p = pair.p;
    d = pair.d;
    await goodTransfer(p, d, "good-first");
    await goodTransfer(p, d, "good-first-pull", { pull: true });
  }, 60_000);

  afterAll(async () => {
    await pair?.close();
  }, 30_000);

  it("engine link: malformed protobuf, an empty message and an oversized frame are refused by name", async () => {
    expect(() => fromBinary(EngineToSidecarSchema, NOT_PROTOBUF)).toThrow();
    for (const node of [p, d]) {
      let n = node.engine.events.length;
      await node.engine.call("send-raw", { hex: NOT_PROTOBUF.toString("hex") });
      expect((await node.refusal("", n)).code).toBe("ERR_MALFORMED");
      n = node.engine.events.length;
      await node.engine.call("send", { message: {} });
      expect((await node.refusal("", n)).code).toBe("ERR_MALFORMED");
    }
    // 16 MiB + 1: above the link's cap (below 4x the cap, where ZeroMQ would drop the connection).
    const n = p.engine.events.length;
    await p.engine.call("send-raw", { hex: Buffer.alloc((16 << 20) + 1).toString("hex") }, 60_000);
    const big = await p.refusal("", n);
    expect(big.code).toBe("ERR_TOO_LARGE");
    // The operator sees them in GetStatus.
    const errs = (await lastErrors(p)).join("\n");
    expect(errs).toMatch(/engine frame refused: ERR_MALFORMED/);
    expect(errs).toMatch(/engine frame refused: ERR_TOO_LARGE/);
    await goodTransfer(p, d, "good-after-frames");
  }, 90_000);

  it("engine link: unknown transfer in Abort, block ids out of range or repeated, each named", async () => {
    let n = d.engine.events.length;
    await d.engine.call("send", { message: { abort: { transferId: "no-such-transfer" } } });
    expect((await d.refusal("no-such-transfer", n)).code).toBe("ERR_UNKNOWN_TRANSFER");

    n = p.engine.events.length;
    await p.engine.call("send", {
      message: { prefillDone: { transferId: "bad-blocks-p", blockIds: [9999], numTokens: 16 } },
    });
    const badP = await p.refusal("bad-blocks-p", n);
    expect(badP.code).toBe("ERR_BAD_BLOCKS");
    expect(String(badP.message)).toContain("9999");

    n = d.engine.events.length;
    await d.engine.call("send", {
      message: {
        expectKv: {
          transferId: "bad-blocks-d",
          source: p.sideChannel,
          blockIds: [3, 3],
          numTokens: 20,
        },
      },
    });
    const badD = await d.refusal("bad-blocks-d", n);
    expect(badD.code).toBe("ERR_BAD_BLOCKS");
    expect(String(badD.message)).toContain("twice");

    // P's block ids (for a pull) out of P's range: checked against P's layout, costs that transfer.
    await d.engine.expect({
      transferId: "bad-src-blocks",
      tokens: 40,
      source: p.sideChannel,
      sourceBlockIds: [0, 1, 99_999],
    });
    const failed = await d.engineEvent("bad-src-blocks", "failed", WAIT);
    expect(failed.reason).toBe("BAD_REQUEST");
    expect((await d.engineEvent("bad-src-blocks", "released", WAIT)).reason).toBe("FAILED");
    const ev = await d.client.awaitTransfer("bad-src-blocks", WAIT, { side: "decode" });
    expect(ev.kind).toBe("FAILED");
    expect(ev.reason).toBe("ERR_PLAN_INVALID");

    await goodTransfer(p, d, "good-after-blocks");
    await p.allBlocksFree();
    await d.allBlocksFree();
  }, 60_000);

  it("engine link: duplicated and replayed PrefillDone / ExpectKv are refused ERR_DUPLICATE and cost nothing", async () => {
    // PrefillDone twice while P holds the blocks; then the transfer completes.
    const { blockIds: pBlocks } = await p.engine.prefill("dup-p", 40, 0);
    const prefillDone = { prefillDone: { transferId: "dup-p", blockIds: pBlocks, numTokens: 40 } };
    let n = p.engine.events.length;
    await p.engine.call("send", { message: prefillDone });
    expect((await p.refusal("dup-p", n)).code).toBe("ERR_DUPLICATE");
    await d.engine.expect({ transferId: "dup-p", tokens: 40, source: p.sideChannel });
    expect((await d.engineEvent("dup-p", "verified", WAIT)).ok).toBe(true);
    expect((await p.engineEvent("dup-p", "released", WAIT)).reason).toBe("TRANSFERRED");

    // ExpectKv twice while D waits for P; then P prefills and the transfer completes.
    const { blockIds: dBlocks } = await d.engine.expect({
      transferId: "dup-d",
      tokens: 40,
      source: p.sideChannel,
    });
    const expectKv = {
      expectKv: { transferId: "dup-d", source: p.sideChannel, blockIds: dBlocks, numTokens: 40 },
    };
    n = d.engine.events.length;
    await d.engine.call("send", { message: expectKv });
    expect((await d.refusal("dup-d", n)).code).toBe("ERR_DUPLICATE");
    await p.engine.prefill("dup-d", 40, 0);
    expect((await d.engineEvent("dup-d", "verified", WAIT)).ok).toBe(true);
    await p.engineEvent("dup-d", "released", WAIT);

    // Replays after both ended: refused, no second release, no second KvReady.
    n = p.engine.events.length;
    await p.engine.call("send", { message: prefillDone });
    expect((await p.refusal("dup-p", n)).code).toBe("ERR_DUPLICATE");
    const m = d.engine.events.length;
    await d.engine.call("send", { message: expectKv });
    expect((await d.refusal("dup-d", m)).code).toBe("ERR_DUPLICATE");
    await p.barrier("dups");
    await d.barrier("dups");
    for (const node of [p, d]) {
      const extra = node.engine.events
        .slice(node === p ? n : m)
        .filter((e) => e.event !== "refused");
      expect(extra, `${node.role} engine events after the replay`).toEqual([]);
      expect(node.terminal("dup-p")).toHaveLength(1);
      expect(node.terminal("dup-d")).toHaveLength(1);
    }
    const ps = await p.allBlocksFree();
    const ds = await d.allBlocksFree();
    expect(ps.badReleases + ds.badReleases).toBe(0);
    expect(d.engine.events.some((e) => e.event === "unexpected")).toBe(false);
    await goodTransfer(p, d, "good-after-dups");
  }, 60_000);

  it("peer link: a decode sidecar with an incompatible layout fails its transfer INCOMPATIBLE, naming the field", async () => {
    const d2 = await KvNode.start({ role: "decode", mode: "push", engine: { headDim: 32 } });
    try {
      await d2.engine.expect({ transferId: "incompatible", tokens: 40, source: p.sideChannel });
      const failed = await d2.engineEvent("incompatible", "failed", WAIT);
      expect(failed.reason).toBe("INCOMPATIBLE");
      expect(String(failed.message)).toContain("headDim");
      expect((await d2.engineEvent("incompatible", "released", WAIT)).reason).toBe("FAILED");
      const ev = await d2.client.awaitTransfer("incompatible", WAIT, { side: "decode" });
      expect(ev.kind).toBe("FAILED");
      expect(ev.reason).toBe("ERR_LAYOUT_INCOMPATIBLE");
      await d2.allBlocksFree();
      // P adopted no peer for it.
      const st = await p.client.getStatus();
      expect(st.peers.map((x) => x.engineId)).not.toContain(d2.engineId);
    } finally {
      await d2.close();
    }
    await goodTransfer(p, d, "good-after-incompatible");
  }, 60_000);

  it("side channel: garbage, an oversized length and an empty request are answered with a named refusal", async () => {
    // An insider: credentials from the cluster's CA (without them TLS refuses first, see
    // test/sidecar/multiprocess/security.test.ts).
    const creds = credentials(sharedPki(), "rogue-frames");
    const ask = (payload: Buffer): Promise<{ code: string; error: string }> =>
      new Promise((resolve, reject) => {
        const { host, port } = parseAddress(p.sideChannel);
        const sock = tls.connect({ host, port, ...creds, checkServerIdentity: () => undefined });
        const timer = setTimeout(() => {
          sock.destroy();
          reject(new Error("no answer"));
        }, WAIT);
        const chunks: Buffer[] = [];
        sock.on("secureConnect", () => sock.write(payload));
        sock.on("data", (c: Buffer) => chunks.push(c));
        sock.on("error", (e) => {
          clearTimeout(timer);
          reject(e);
        });
        sock.on("end", () => {
          clearTimeout(timer);
          const all = Buffer.concat(chunks);
          const res = fromBinary(HandshakeResponseSchema, all.subarray(4, 4 + all.readUInt32BE(0)));
          sock.destroy();
          resolve({ code: res.errorCode, error: res.error });
        });
      });
    const framed = (body: Buffer): Buffer => {
      const head = Buffer.alloc(4);
      head.writeUInt32BE(body.length);
      return Buffer.concat([head, body]);
    };
    expect((await ask(framed(NOT_PROTOBUF))).code).toBe("ERR_MALFORMED");
    // A length above the cap is refused from the header alone: nothing more is read.
    const huge = Buffer.alloc(4);
    huge.writeUInt32BE(1 << 30);
    const big = await ask(huge);
    expect(big.code).toBe("ERR_TOO_LARGE");
    expect(big.error).toContain("1073741824");
    // A well-formed request without metadata.
    const empty = Buffer.from(toBinary(HandshakeRequestSchema, create(HandshakeRequestSchema, {})));
    const r = await ask(framed(empty));
    expect(r.code).toBe("ERR_MALFORMED");
    expect(r.error).toContain("metadata");
    const errs = (await lastErrors(p)).join("\n");
    expect(errs).toMatch(/handshake refused: ERR_TOO_LARGE/);
    expect(errs).toMatch(/handshake refused: ERR_MALFORMED: handshake carries no metadata/);
    await goodTransfer(p, d, "good-after-side-channel");
  }, 60_000);

  it("UCX notifications: garbage, oversized, stale epochs, bad MACs, replays, unknown transfers and bad PushReg blocks are refused; P keeps serving", async () => {
    const layout = p.engine.ready!.layout;
    const myId = "rogue-peer";
    const myEpoch = 0x1234_5678_9abcn;
    const rogue = new RoguePeer(myId, myEpoch, layout);
    try {
      // An authenticated insider: its own certificate, a layout compatible with P's.
      const res = await rogue.handshake(p.sideChannel, {
        creds: credentials(sharedPki(), myId),
      });
      expect(res.errorCode).toBe("");
      const pEpoch = res.metadata!.epoch;
      expect(String(pEpoch)).toBe(p.ready.epoch);
      const send = (bytes: Uint8Array): Promise<void> => rogue.send(bytes);
      // lastErrors is bounded (the newest 20), each entry led by its ISO time.
      const since = new Date().toISOString();
      const newErrors = async (): Promise<string[]> =>
        (await lastErrors(p)).filter((e) => e.slice(0, since.length) >= since);
      // P holds a transfer of the real D: a forged abort must not touch it.
      await p.engine.prefill("forged-target", 40, 0);

      // Garbage bytes.
      await send(NOT_PROTOBUF);
      // Oversized: above P's notification cap (1 MiB); the native layer drops it unread and says so.
      await send(Buffer.alloc((1 << 20) + 4096, 7));
      // Well-formed, but addressed to an epoch P does not have.
      await send(rogue.seal({ case: "heartbeat", value: {} }, { receiverEpoch: pEpoch + 2n }));
      // Well-formed, but claiming a sender epoch other than the one we handshook with.
      await send(
        rogue.seal(
          { case: "heartbeat", value: {} },
          { as: { engineId: myId, epoch: myEpoch + 2n } },
        ),
      );
      // Forged: claims to be the real D (its id and epoch) from an agent that is not D's (a
      // forger that also names its agent after D meets the MAC check: test/sidecar/multiprocess/security.test.ts).
      await send(
        rogue.seal(
          { case: "abort", value: { transferId: "forged-target", reason: "forged" } },
          { as: { engineId: d.engineId, epoch: BigInt(d.ready.epoch) } },
        ),
      );
      // XferDone for a transfer P never heard of (and P does not decode).
      await send(
        rogue.seal({
          case: "xferDone",
          value: { transferId: "no-such-transfer", srcRank: 0, dstRank: 0, bytes: 1n },
        }),
      );
      // A PeerMessage with no body, sealed properly.
      await send(
        sealPeerMessage(
          rogue.macKey,
          toBinary(
            PeerMessageSchema,
            create(PeerMessageSchema, {
              senderEngineId: myId,
              senderEpoch: myEpoch,
              receiverEpoch: pEpoch,
              seq: ++rogue.seq,
            }),
          ),
        ),
      );
      // A PeerMessage that is not sealed at all.
      await send(encodePeerMessage(myId, myEpoch, pEpoch, { case: "heartbeat", value: {} }, 99n));

      let errs: string[] = [];
      await until(
        async () => {
          errs = await newErrors();
          const e = errs.join("\n");
          return (
            (e.match(/ERR_MALFORMED/g) ?? []).length >= 3 &&
            /refused: ERR_TOO_LARGE \(1052672 bytes\)/.test(e) &&
            (e.match(/ERR_STALE_EPOCH/g) ?? []).length >= 3 &&
            e.includes("ERR_UNKNOWN_TRANSFER")
          );
        },
        WAIT,
        () => `P's new lastErrors: ${JSON.stringify(errs)}`,
        50,
      );
      expect(
        errs.some((e) => e.includes(`from '${d.engineId}'`) && e.includes("ERR_STALE_EPOCH")),
      ).toBe(true);

      console.log(
        `[bad-input] P's lastErrors after the rogue notifications:\n  ${errs.join("\n  ")}`,
      );
      // The transfer the forged abort named is still held by P, and completes.
      expect(p.terminal("forged-target")).toHaveLength(0);
      await d.engine.expect({ transferId: "forged-target", tokens: 40, source: p.sideChannel });
      expect((await d.engineEvent("forged-target", "verified", WAIT)).ok).toBe(true);
      expect((await p.engineEvent("forged-target", "released", WAIT)).reason).toBe("TRANSFERRED");

      // PushReg with D block ids beyond our layout, for blocks P holds (no token: the first
      // authenticated registration gets it): costs that transfer only.
      const { blockIds } = await p.engine.prefill("rogue-push", 40, 0);
      expect(blockIds).toHaveLength(3);
      const pushReg = rogue.seal({
        case: "pushReg",
        value: {
          transferId: "rogue-push",
          blockIds: [0, 1, 99_999],
          numTokens: 40,
          prefixTokens: 0,
          leaseMs: 5000,
        },
      });
      await send(pushReg);
      await until(
        () => rogue.received.some((m) => m.body.case === "failed"),
        WAIT,
        () => `P's Failed; got ${JSON.stringify(rogue.received.map((m) => m.body.case))}`,
      );
      const f = rogue.received.find((m) => m.body.case === "failed")!;
      expect(f.body.case === "failed" && f.body.value.transferId).toBe("rogue-push");
      expect(f.body.case === "failed" && f.body.value.code).toBe("ERR_PLAN_INVALID");
      expect(f.senderEngineId).toBe(p.engineId);
      expect(f.receiverEpoch).toBe(myEpoch);
      expect(rogue.badMacs).toBe(0);
      expect((await p.engineEvent("rogue-push", "released", WAIT)).reason).toBe("FAILED");
      const pEv = await p.client.awaitTransfer("rogue-push", WAIT, { side: "prefill" });
      expect(pEv.kind).toBe("FAILED");
      // The same sealed registration replayed: refused unread (its number was seen).
      rogue.received.length = 0;
      await send(pushReg);
      await until(
        async () => (await newErrors()).some((e) => e.includes("ERR_REPLAY")),
        WAIT,
        "P's ERR_REPLAY",
      );
      // Sent again as a new message: refused, the transfer has ended.
      await send(
        rogue.seal({
          case: "pushReg",
          value: {
            transferId: "rogue-push",
            blockIds: [0, 1, 2],
            numTokens: 40,
            prefixTokens: 0,
            leaseMs: 5000,
          },
        }),
      );
      await until(() => rogue.received.length > 0, WAIT, "P's answer to the new registration");
      expect(rogue.received[0]!.body.case === "failed" && rogue.received[0]!.body.value.code).toBe(
        "ERR_ENDED",
      );
      expect(p.terminal("rogue-push")).toHaveLength(1);
      // Nothing was written into our buffers.
      expect(rogue.untouched()).toBe(true);
      await p.allBlocksFree();
    } finally {
      rogue.close();
    }
    await goodTransfer(p, d, "good-last");
    await goodTransfer(p, d, "good-last-pull", { pull: true });
    await p.allBlocksFree();
    await d.allBlocksFree();
  }, 60_000);
});
