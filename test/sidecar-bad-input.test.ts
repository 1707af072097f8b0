// Bad input on every channel of a real sidecar pair (processes from dist/, simulated engines, UCX
// over shared memory, ZeroMQ, gRPC): the engine link, the handshake side channel, and UCX peer
// notifications from an agent this test runs itself. Each bad message is refused with a named
// reason and costs at most the transfer it names; a good transfer before and after verifies.
// `npm run build` first.
import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { Dealer } from "zeromq";

import { EngineToSidecarSchema } from "../src/gen/kvxfer/v1/engine_pb.js";
import {
  AgentMetadataSchema,
  HandshakeRequestSchema,
  HandshakeResponseSchema,
  PeerMessageSchema,
  RankMetadataSchema,
  Role,
} from "../src/gen/kvxfer/v1/peer_pb.js";
import { Agent, type Endpoint, type Region } from "../src/native/index.js";
import {
  agentName,
  encodePeerMessage,
  parsePeerMessage,
  type ParsedPeerMessage,
} from "../src/peer/messages.js";
import { handshake, zmqEndpoint } from "../src/peer/side-channel.js";
import { kvLayoutToProto } from "../src/plan/layout-proto.js";
import type { SimEngineEvent } from "../src/sim/engine-client.js";
import { KvNode, type Pair, goodTransfer, sleep, startPair, until } from "./sidecar-fixtures.js";

const WAIT = 10_000;
/** Bytes no protobuf parser accepts: a field tag whose varint never ends. */
const NOT_PROTOBUF = Buffer.from("ffffffffffffffffffff", "hex");

/** The engine's `refused` event for `transferId` after `since` events (the latest one). */
async function refusal(node: KvNode, transferId: string, since: number): Promise<SimEngineEvent> {
  let found: SimEngineEvent | undefined;
  await until(
    () =>
      (found = node.engine.events
        .slice(since)
        .find((e) => e.event === "refused" && e.transferId === transferId)) !== undefined,
    WAIT,
    () =>
      `a refusal of '${transferId}' on ${node.role}; last ${JSON.stringify(node.engine.events.slice(-3))}`,
  );
  return found!;
}

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
      expect((await refusal(node, "", n)).code).toBe("ERR_MALFORMED");
      n = node.engine.events.length;
      await node.engine.call("send", { message: {} });
      expect((await refusal(node, "", n)).code).toBe("ERR_MALFORMED");
    }
    // 16 MiB + 1: above the link's cap (below 4x the cap, where ZeroMQ would drop the connection).
    const n = p.engine.events.length;
    await p.engine.call("send-raw", { hex: Buffer.alloc((16 << 20) + 1).toString("hex") }, 60_000);
    const big = await refusal(p, "", n);
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
    expect((await refusal(d, "no-such-transfer", n)).code).toBe("ERR_UNKNOWN_TRANSFER");

    n = p.engine.events.length;
    await p.engine.call("send", {
      message: { prefillDone: { transferId: "bad-blocks-p", blockIds: [9999], numTokens: 16 } },
    });
    const badP = await refusal(p, "bad-blocks-p", n);
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
    const badD = await refusal(d, "bad-blocks-d", n);
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
    expect((await refusal(p, "dup-p", n)).code).toBe("ERR_DUPLICATE");
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
    expect((await refusal(d, "dup-d", n)).code).toBe("ERR_DUPLICATE");
    await p.engine.prefill("dup-d", 40, 0);
    expect((await d.engineEvent("dup-d", "verified", WAIT)).ok).toBe(true);
    await p.engineEvent("dup-d", "released", WAIT);

    // Replays after both ended: refused, no second release, no second KvReady.
    n = p.engine.events.length;
    await p.engine.call("send", { message: prefillDone });
    expect((await refusal(p, "dup-p", n)).code).toBe("ERR_DUPLICATE");
    const m = d.engine.events.length;
    await d.engine.call("send", { message: expectKv });
    expect((await refusal(d, "dup-d", m)).code).toBe("ERR_DUPLICATE");
    await sleep(300);
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

  it("side channel: garbage, extra frames and an oversized handshake are answered with a named refusal", async () => {
    const ask = async (frames: Buffer[]): Promise<{ code: string; error: string }> => {
      const sock = new Dealer({ linger: 0, receiveTimeout: WAIT, sendTimeout: WAIT });
      try {
        sock.connect(zmqEndpoint(p.sideChannel));
        await sock.send(frames);
        const reply = await sock.receive();
        const res = fromBinary(HandshakeResponseSchema, reply[reply.length - 1]!);
        return { code: res.errorCode, error: res.error };
      } finally {
        sock.close();
      }
    };
    expect((await ask([NOT_PROTOBUF])).code).toBe("ERR_MALFORMED");
    expect((await ask([Buffer.from("a"), Buffer.from("b")])).code).toBe("ERR_MALFORMED");
    expect((await ask([Buffer.alloc((4 << 20) + 1)])).code).toBe("ERR_TOO_LARGE");
    // A well-formed request without metadata.
    const empty = Buffer.from(toBinary(HandshakeRequestSchema, create(HandshakeRequestSchema, {})));
    const r = await ask([empty]);
    expect(r.code).toBe("ERR_MALFORMED");
    expect(r.error).toContain("metadata");
    const errs = (await lastErrors(p)).join("\n");
    expect(errs).toMatch(/handshake refused: ERR_TOO_LARGE/);
    expect(errs).toMatch(/handshake refused: ERR_MALFORMED: handshake carries no metadata/);
    await goodTransfer(p, d, "good-after-side-channel");
  }, 60_000);

  it("UCX notifications: garbage, oversized, stale or forged epochs, unknown transfers and bad PushReg blocks are refused; P keeps serving", async () => {
    const layout = p.engine.ready!.layout;
    const myId = "rogue-peer";
    const myEpoch = 0x1234_5678_9abcn;
    const agent = new Agent({ name: agentName(myId, myEpoch, 0), transports: "shm,self" });
    const regions: Region[] = [];
    const received: ParsedPeerMessage[] = [];
    agent.on("notifications", (batch) => {
      for (const n of batch) {
        try {
          received.push(parsePeerMessage(n.data));
        } catch {
          // not ours to judge here
        }
      }
    });
    try {
      for (const bytes of layout.regionBytes)
        regions.push(agent.registerMemory(Buffer.alloc(bytes)));
      // A valid handshake, with a layout compatible with P's and keys of our own buffers.
      const res = await handshake(
        p.sideChannel,
        create(HandshakeRequestSchema, {
          metadata: create(AgentMetadataSchema, {
            engineId: myId,
            epoch: myEpoch,
            role: Role.DECODE,
            layout: kvLayoutToProto(layout),
            ranks: [
              create(RankMetadataSchema, {
                rank: 0,
                workerAddress: agent.address,
                remoteKeys: regions.map((r) => r.remoteKey()),
              }),
            ],
          }),
        }),
        WAIT,
      );
      expect(res.errorCode).toBe("");
      const pEpoch = res.metadata!.epoch;
      expect(String(pEpoch)).toBe(p.ready.epoch);
      const ep: Endpoint = agent.connect(res.metadata!.ranks[0]!.workerAddress);
      const send = (bytes: Uint8Array): Promise<void> => agent.notify(ep, bytes);
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
      await send(encodePeerMessage(myId, myEpoch, pEpoch + 2n, { case: "heartbeat", value: {} }));
      // Well-formed, but claiming a sender epoch other than the one we handshook with.
      await send(encodePeerMessage(myId, myEpoch + 2n, pEpoch, { case: "heartbeat", value: {} }));
      // Forged: claims to be the real D, sent from our agent.
      await send(
        encodePeerMessage(d.engineId, BigInt(d.ready.epoch), pEpoch, {
          case: "abort",
          value: { transferId: "forged-target", reason: "forged" },
        }),
      );
      // XferDone for a transfer P never heard of (and P does not decode).
      await send(
        encodePeerMessage(myId, myEpoch, pEpoch, {
          case: "xferDone",
          value: { transferId: "no-such-transfer", srcRank: 0, dstRank: 0, bytes: 1n },
        }),
      );
      // A PeerMessage with no body.
      await send(
        toBinary(
          PeerMessageSchema,
          create(PeerMessageSchema, {
            senderEngineId: myId,
            senderEpoch: myEpoch,
            receiverEpoch: pEpoch,
          }),
        ),
      );

      let errs: string[] = [];
      await until(
        async () => {
          errs = await newErrors();
          const e = errs.join("\n");
          return (
            (e.match(/ERR_MALFORMED/g) ?? []).length >= 2 &&
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
        errs.filter((e) => e.includes(`from '${myId}`) && e.includes("ERR_MALFORMED")),
      ).toHaveLength(2);
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

      // PushReg with D block ids beyond our layout, for blocks P holds: costs that transfer only.
      const { blockIds } = await p.engine.prefill("rogue-push", 40, 0);
      expect(blockIds).toHaveLength(3);
      const pushReg = encodePeerMessage(myId, myEpoch, pEpoch, {
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
        () => received.some((m) => m.body.case === "failed"),
        WAIT,
        () => `P's Failed; got ${JSON.stringify(received.map((m) => m.body.case))}`,
      );
      const f = received.find((m) => m.body.case === "failed")!;
      expect(f.body.case === "failed" && f.body.value.transferId).toBe("rogue-push");
      expect(f.body.case === "failed" && f.body.value.code).toBe("ERR_PLAN_INVALID");
      expect(f.senderEngineId).toBe(p.engineId);
      expect(f.receiverEpoch).toBe(myEpoch);
      expect((await p.engineEvent("rogue-push", "released", WAIT)).reason).toBe("FAILED");
      const pEv = await p.client.awaitTransfer("rogue-push", WAIT, { side: "prefill" });
      expect(pEv.kind).toBe("FAILED");
      // The same registration replayed: refused, the transfer has ended.
      received.length = 0;
      await send(pushReg);
      await until(() => received.length > 0, WAIT, "P's answer to the replay");
      expect(received[0]!.body.case === "failed" && received[0]!.body.value.code).toBe("ERR_ENDED");
      expect(p.terminal("rogue-push")).toHaveLength(1);
      // Nothing was written into our buffers.
      for (const r of regions) expect(r.bytes().every((b) => b === 0)).toBe(true);
      await p.allBlocksFree();
    } finally {
      agent.close();
    }
    await goodTransfer(p, d, "good-last");
    await goodTransfer(p, d, "good-last-pull", { pull: true });
    await p.allBlocksFree();
    await d.allBlocksFree();
  }, 60_000);
});
