// The engine link over real ZeroMQ (ipc in a temp dir): every message both ways, bad frames
// refused without harm, close idempotent; and the field checks of engine messages.
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { create, equals } from "@bufbuild/protobuf";
import { pino } from "pino";
import { afterEach, beforeEach, describe, expect, it } from "vitest";

import {
  type EnginePeer,
  EngineLinkClient,
  EngineLinkServer,
  engineMessage,
  sidecarMessage,
} from "../../src/engine/link.js";
import { checkEngineMessage, checkRegisterKvCache } from "../../src/engine/validate.js";
import {
  AbortSchema,
  type EngineToSidecar,
  EngineToSidecarSchema,
  ExpectKvSchema,
  FailureReason,
  KvFailedSchema,
  KvReadySchema,
  PrefillDoneSchema,
  RankKvCacheSchema,
  RefusedSchema,
  RegionFileSchema,
  RegisterKvCacheSchema,
  RegisteredSchema,
  ReleaseBlocksSchema,
  ReleaseReason,
  type SidecarToEngine,
  SidecarToEngineSchema,
} from "../../src/gen/kvxfer/v1/engine_pb.js";
import { type KvLayout, kvLayout, singleGroup } from "../../src/plan/index.js";
import { kvLayoutToProto } from "../../src/plan/layout-proto.js";
import { until } from "../until.js";

const log = pino({ level: "silent" });

const layout: KvLayout = kvLayout({
  numLayers: 2,
  mla: false,
  totalKvHeads: 4,
  headDim: 8,
  dtype: "bfloat16",
  dtypeBytes: 2,
  blockSize: 16,
  numBlocks: 32,
  order: "HND",
  tpSize: 2,
  tpRank: 0,
});

function registerMsg(l: KvLayout = layout) {
  return create(RegisterKvCacheSchema, {
    engineId: "engine-a",
    layout: kvLayoutToProto(l),
    ranks: Array.from({ length: l.tpSize }, (_, rank) =>
      create(RankKvCacheSchema, {
        rank,
        regions: l.regionBytes.map((n, g) =>
          create(RegionFileSchema, {
            path: `/dev/shm/x-r${rank}-g${g}`,
            offset: 0n,
            length: BigInt(n),
          }),
        ),
      }),
    ),
  });
}

describe("engine link", () => {
  let dir: string;
  let endpoint: string;
  let server: EngineLinkServer | undefined;
  let client: EngineLinkClient | undefined;
  let got: { msg: EngineToSidecar; from: EnginePeer }[];
  let back: SidecarToEngine[];

  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), "kvxfer-link-"));
    endpoint = `ipc://${join(dir, "engine.sock")}`;
    got = [];
    back = [];
  });

  afterEach(async () => {
    await client?.close();
    await server?.close();
    client = undefined;
    server = undefined;
    rmSync(dir, { recursive: true, force: true });
  });

  async function open(maxFrameBytes?: number): Promise<void> {
    server = new EngineLinkServer({
      endpoint,
      logger: log,
      onMessage: (msg, from) => got.push({ msg, from }),
      ...(maxFrameBytes === undefined ? {} : { maxFrameBytes }),
    });
    await server.start();
    client = new EngineLinkClient({ endpoint, logger: log, onMessage: (m) => back.push(m) });
  }

  function refusals(): { code: string; message: string; transferId: string }[] {
    return back.flatMap((m) => (m.msg.case === "refused" ? [m.msg.value] : []));
  }

  it("carries every engine message to the sidecar and every sidecar message back", async () => {
    await open();
    const sent: EngineToSidecar[] = [
      engineMessage("register", registerMsg()),
      engineMessage(
        "prefillDone",
        create(PrefillDoneSchema, { transferId: "t1", blockIds: [7, 3, 9], numTokens: 40 }),
      ),
      engineMessage(
        "expectKv",
        create(ExpectKvSchema, {
          transferId: "t1",
          source: "127.0.0.1:5555",
          blockIds: [1, 2],
          numTokens: 20,
          prefixTokens: 3,
          sourceBlockIds: [7, 3, 9],
          hasSourceBlockIds: true,
        }),
      ),
      engineMessage("abort", create(AbortSchema, { transferId: "t1" })),
    ];
    for (const m of sent) await client!.send(m);
    await until(() => got.length === sent.length, 5000, "engine messages");
    got.forEach((g, i) => expect(equals(EngineToSidecarSchema, g.msg, sent[i]!)).toBe(true));
    const from = got[0]!.from;
    expect(got.every((g) => g.from.id === from.id)).toBe(true);
    // Only the handler's acceptance (adopt) binds the link to a connection.
    expect(server!.registeredEngine).toBeUndefined();
    server!.adopt(from);
    expect(server!.registeredEngine?.id).toBe(from.id);

    const replies: SidecarToEngine[] = [
      sidecarMessage(
        "registered",
        create(RegisteredSchema, { ok: true, sideChannel: "127.0.0.1:5555" }),
      ),
      sidecarMessage("kvReady", create(KvReadySchema, { transferId: "t1" })),
      sidecarMessage(
        "kvFailed",
        create(KvFailedSchema, {
          transferId: "t2",
          reason: FailureReason.LEASE_EXPIRED,
          message: "lease ran out",
        }),
      ),
      sidecarMessage(
        "releaseBlocks",
        create(ReleaseBlocksSchema, {
          transferId: "t1",
          blockIds: [7, 3, 9],
          reason: ReleaseReason.TRANSFERRED,
        }),
      ),
      sidecarMessage(
        "refused",
        create(RefusedSchema, { transferId: "t3", code: "ERR_BAD_BLOCKS", message: "x" }),
      ),
    ];
    expect(await server!.send(from, replies[0]!)).toBe(true);
    for (const r of replies.slice(1)) expect(await server!.sendToRegistered(r)).toBe(true);
    await until(() => back.length === replies.length, 5000, "sidecar messages");
    back.forEach((b, i) => expect(equals(SidecarToEngineSchema, b, replies[i]!)).toBe(true));
  });

  it("refuses malformed frames with ERR_MALFORMED and keeps serving", async () => {
    await open();
    await client!.sendRaw(Buffer.from([0xff, 0xff, 0xff, 0xff]));
    await until(() => refusals().length === 1, 5000, "the first refusal");
    // An empty frame decodes, but carries no message.
    await client!.sendRaw(new Uint8Array(0));
    // Two frames in one message.
    await client!.sendRaw([Buffer.from([1]), Buffer.from([2])]);
    await until(() => refusals().length === 3, 5000, "three refusals");
    expect(refusals().map((r) => r.code)).toEqual([
      "ERR_MALFORMED",
      "ERR_MALFORMED",
      "ERR_MALFORMED",
    ]);
    expect(refusals()[1]!.message).toMatch(/no message/);
    expect(refusals()[2]!.message).toMatch(/one frame/);
    expect(got).toHaveLength(0);
    await client!.send(engineMessage("abort", create(AbortSchema, { transferId: "ok" })));
    await until(() => got.length === 1, 5000, "a good message after bad ones");
    expect(got[0]!.msg.msg.case).toBe("abort");
  });

  it("refuses frames over the cap with ERR_TOO_LARGE, and survives a far larger one", async () => {
    await open(1024);
    const big = create(PrefillDoneSchema, {
      transferId: "big",
      blockIds: Array.from({ length: 600 }, (_, i) => i + 1000),
      numTokens: 1,
    });
    await client!.send(engineMessage("prefillDone", big));
    await until(() => refusals().length === 1, 5000, "a refusal");
    expect(refusals()[0]!.code).toBe("ERR_TOO_LARGE");
    expect(got).toHaveLength(0);
    // Beyond 4x the cap ZeroMQ drops the connection; the engine's DEALER reconnects by itself.
    await client!.sendRaw(new Uint8Array(64 * 1024));
    await new Promise((r) => setTimeout(r, 100));
    await until(
      () => {
        if (got.length === 0) {
          void client!.send(engineMessage("abort", create(AbortSchema, { transferId: "again" })));
        }
        return got.length > 0;
      },
      5000,
      "a message after the connection was dropped",
    );
    expect(got[0]!.msg.msg.case).toBe("abort");
  });

  it("belongs to the adopted connection: others get ERR_NOT_OWNER; while the owner is away its messages are held for a takeover", async () => {
    await open();
    await client!.send(engineMessage("register", registerMsg()));
    await until(() => got.length === 1, 5000, "the registration");
    const a = got[0]!.from;
    server!.adopt(a);
    expect(server!.ownerConnected).toBe(true);

    const otherBack: SidecarToEngine[] = [];
    const other = new EngineLinkClient({
      endpoint,
      logger: log,
      onMessage: (m) => otherBack.push(m),
    });
    try {
      await other.send(engineMessage("abort", create(AbortSchema, { transferId: "t9" })));
      await until(() => otherBack.length === 1, 5000, "the refusal");
      expect(otherBack[0]!.msg.case).toBe("refused");
      expect(otherBack[0]!.msg.value).toMatchObject({ code: "ERR_NOT_OWNER", transferId: "t9" });
      // A registration is the handler's to judge: it passes, and the owner stays.
      await other.send(engineMessage("register", registerMsg()));
      await until(() => got.length === 2, 5000, "the second registration");
      expect(got.map((g) => g.msg.msg.case)).toEqual(["register", "register"]);
      expect(server!.isOwner(got[1]!.from)).toBe(false);
      expect(server!.registeredEngine?.id).toBe(a.id);

      // The owner goes away: what is sent to it waits for the next owner.
      await client!.close();
      client = undefined;
      await until(() => !server!.ownerConnected, 5000, "the owner's connection to end");
      const ready = sidecarMessage("kvReady", create(KvReadySchema, { transferId: "t1" }));
      expect(await server!.sendToRegistered(ready)).toBe(true);
      server!.adopt(got[1]!.from);
      await until(() => otherBack.length === 2, 5000, "the held message");
      expect(equals(SidecarToEngineSchema, otherBack[1]!, ready)).toBe(true);
    } finally {
      await other.close();
    }
  });

  it("keeps serving when the handler throws, and reports unroutable sends as false", async () => {
    let n = 0;
    server = new EngineLinkServer({
      endpoint,
      logger: log,
      onMessage: (msg, from) => {
        n++;
        if (n === 1) throw new Error("handler bug");
        got.push({ msg, from });
      },
    });
    await server.start();
    client = new EngineLinkClient({ endpoint, logger: log, onMessage: (m) => back.push(m) });
    await client.send(engineMessage("abort", create(AbortSchema, { transferId: "a" })));
    await client.send(engineMessage("abort", create(AbortSchema, { transferId: "b" })));
    await until(() => got.length === 1, 5000, "the second message");
    const ghost: EnginePeer = { id: "00", routingId: Buffer.from([0, 1, 2, 3, 4]) };
    const ready = sidecarMessage("kvReady", create(KvReadySchema, { transferId: "a" }));
    expect(await server.send(ghost, ready)).toBe(false);
    // No engine registered yet.
    expect(await server.sendToRegistered(ready)).toBe(false);
    // An owner whose connection is gone before ZeroMQ said so: the message is held, not lost,
    // and the next owner gets it.
    server.adopt(ghost);
    expect(await server.sendToRegistered(ready)).toBe(true);
    expect(server.ownerConnected).toBe(false);
    server.adopt(got[0]!.from);
    await until(() => back.length === 1, 5000, "the held message");
    expect(equals(SidecarToEngineSchema, back[0]!, ready)).toBe(true);
  });

  it("closes idempotently, and refuses use after close", async () => {
    await open();
    await expect(server!.start()).rejects.toMatchObject({ code: "ERR_STATE" });
    await Promise.all([server!.close(), server!.close()]);
    await server!.close();
    const from = { id: "00", routingId: Buffer.from([0, 1, 2, 3, 4]) };
    expect(
      await server!.send(
        from,
        sidecarMessage("kvReady", create(KvReadySchema, { transferId: "x" })),
      ),
    ).toBe(false);
    await client!.close();
    await client!.close();
    await expect(
      client!.send(engineMessage("abort", create(AbortSchema, { transferId: "x" }))),
    ).rejects.toMatchObject({ code: "ERR_CLOSED" });
    // A closed server that never started.
    const unused = new EngineLinkServer({ endpoint, logger: log, onMessage: () => undefined });
    await unused.close();
    await unused.close();
  });

  it("fails start() with ERR_BIND on an endpoint in use", async () => {
    server = new EngineLinkServer({
      endpoint: "tcp://127.0.0.1:0",
      logger: log,
      onMessage: () => undefined,
    });
    await server.start();
    const taken = server.boundEndpoint;
    expect(taken).toMatch(/^tcp:\/\/127\.0\.0\.1:\d+$/);
    const second = new EngineLinkServer({
      endpoint: taken,
      logger: log,
      onMessage: () => undefined,
    });
    await expect(second.start()).rejects.toMatchObject({ code: "ERR_BIND" });
    await second.close();
  });
});

describe("engine message checks", () => {
  const check = (m: EngineToSidecar, l: KvLayout | undefined = layout) =>
    checkEngineMessage(m, l && singleGroup(l));
  const prefill = (f: Partial<{ transferId: string; blockIds: number[]; numTokens: number }>) =>
    engineMessage(
      "prefillDone",
      create(PrefillDoneSchema, { transferId: "t", blockIds: [1, 2], numTokens: 20, ...f }),
    );
  const expectKv = (f: Record<string, unknown>) =>
    engineMessage(
      "expectKv",
      create(ExpectKvSchema, {
        transferId: "t",
        source: "h:1",
        blockIds: [1, 2],
        numTokens: 20,
        ...f,
      }),
    );

  it("accepts good messages", () => {
    expect(check(prefill({}))).toBeUndefined();
    expect(check(expectKv({ prefixTokens: 20 }))).toBeUndefined();
    expect(check(expectKv({ sourceBlockIds: [4, 5], hasSourceBlockIds: true }))).toBeUndefined();
    expect(check(engineMessage("abort", create(AbortSchema, { transferId: "t" })))).toBeUndefined();
    const r = checkRegisterKvCache(registerMsg());
    expect(r.ok).toBe(true);
    if (r.ok) {
      expect(r.cache.ranks.map((x) => x.rank)).toEqual([0, 1]);
      expect(r.cache.ranks[1]!.regions[0]!.length).toBe(layout.regionBytes[0]);
      expect(r.cache.layout).toEqual(layout);
    }
  });

  it("names the field of each refusal", () => {
    const cases: [EngineToSidecar, string, RegExp, KvLayout | undefined][] = [
      [prefill({}), "ERR_NOT_REGISTERED", /RegisterKvCache/, undefined],
      [prefill({ transferId: "" }), "ERR_BAD_TRANSFER_ID", /transfer_id is empty/, layout],
      [
        prefill({ transferId: "x".repeat(257) }),
        "ERR_BAD_TRANSFER_ID",
        /transfer_id is 257/,
        layout,
      ],
      [
        prefill({ transferId: "t\u0000x" }),
        "ERR_BAD_TRANSFER_ID",
        /transfer_id holds U\+0000 at index 1: only printable characters/,
        layout,
      ],
      [
        expectKv({ transferId: "t\nx" }),
        "ERR_BAD_TRANSFER_ID",
        /transfer_id holds U\+000A/,
        layout,
      ],
      [prefill({ numTokens: 0 }), "ERR_BAD_TOKENS", /num_tokens/, layout],
      [
        prefill({ numTokens: 33 }),
        "ERR_BAD_BLOCKS",
        /block_ids lists 2 ids, the tokens need 3/,
        layout,
      ],
      [prefill({ blockIds: [1, 32] }), "ERR_BAD_BLOCKS", /block_ids\[1\] = 32/, layout],
      [prefill({ blockIds: [4, 4] }), "ERR_BAD_BLOCKS", /listed twice/, layout],
      [
        prefill({ blockIds: Array.from({ length: 33 }, (_, i) => i) }),
        "ERR_BAD_BLOCKS",
        /cache has 32 blocks/,
        layout,
      ],
      [expectKv({ source: "" }), "ERR_BAD_SOURCE", /source is empty/, layout],
      [expectKv({ prefixTokens: 21 }), "ERR_BAD_TOKENS", /prefix_tokens 21/, layout],
      [expectKv({ sourceBlockIds: [1] }), "ERR_BAD_BLOCKS", /has_source_block_ids/, layout],
      [
        expectKv({ sourceBlockIds: [1, 1], hasSourceBlockIds: true }),
        "ERR_BAD_BLOCKS",
        /source_block_ids\[1\]/,
        layout,
      ],
      [
        engineMessage("abort", create(AbortSchema, { transferId: "" })),
        "ERR_BAD_TRANSFER_ID",
        /transfer_id/,
        layout,
      ],
      [create(EngineToSidecarSchema, {}), "ERR_MALFORMED", /no message/, layout],
    ];
    for (const [m, code, re, l] of cases) {
      const p = checkEngineMessage(m, l && singleGroup(l));
      expect(p?.code, `${m.msg.case}: ${re}`).toBe(code);
      expect(p?.message).toMatch(re);
    }
    expect(checkEngineMessage(prefill({ numTokens: 0 }), singleGroup(layout))?.transferId).toBe(
      "t",
    );
  });

  it("refuses bad registrations", () => {
    const bad = (mutate: (m: ReturnType<typeof registerMsg>) => void) => {
      const m = registerMsg();
      mutate(m);
      const r = checkRegisterKvCache(m);
      if (r.ok) throw new Error("accepted");
      return r.problem;
    };
    expect(bad((m) => (m.engineId = "")).code).toBe("ERR_BAD_ENGINE_ID");
    expect(bad((m) => (m.layout = undefined)).code).toBe("ERR_BAD_LAYOUT");
    const p = bad((m) => (m.layout!.numLayers = 0));
    expect(p.code).toBe("ERR_BAD_LAYOUT");
    expect(p.message).toMatch(/layout\.numLayers/);
    expect(bad((m) => m.ranks.pop()).message).toMatch(/ranks lists 1 ranks/);
    expect(bad((m) => (m.ranks[1]!.rank = 0)).message).toMatch(/listed twice/);
    expect(bad((m) => (m.ranks[1]!.rank = 5)).message).toMatch(/not below tpSize/);
    expect(bad((m) => m.ranks[0]!.regions.pop()).message).toMatch(/regions lists 1 files/);
    expect(bad((m) => (m.ranks[0]!.regions[1]!.length = 10n)).message).toMatch(
      /ranks\[0\]\.regions\[1\]\.length 10/,
    );
    expect(bad((m) => (m.ranks[0]!.regions[0]!.path = "")).code).toBe("ERR_BAD_REGIONS");
  });
});
