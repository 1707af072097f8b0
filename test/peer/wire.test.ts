// The messages written by hand on the critical path (src/wire.ts): byte for byte what
// protobuf-es writes, and still every field the schema has.
import { create, toBinary } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { encodeEventResponse, EVENT_FIELDS } from "../../src/api/convert.js";
import { encodeSidecarToEngine, KV_READY_FIELDS } from "../../src/engine/link.js";
import { KvReadySchema, SidecarToEngineSchema } from "../../src/gen/kvxfer/v1/engine_pb.js";
import { PeerMessageSchema, XferDoneSchema } from "../../src/gen/kvxfer/v1/peer_pb.js";
import {
  type EventKind,
  EventSchema,
  WatchEventsResponseSchema,
} from "../../src/gen/kvxfer/v1/sidecar_pb.js";
import { encodePeerMessage, parsePeerMessage, XFER_DONE_FIELDS } from "../../src/peer/messages.js";

// A fixed sequence (a linear congruential generator), so a failure can be run again.
let seed = 12345;
const next = (): number => (seed = (seed * 1103515245 + 12345) % 2 ** 31);
const pick = <T>(xs: readonly T[]): T => xs[next() % xs.length]!;

const IDS = ["", "a", "req-00012-abcdef", "ü-Ω-😀", "x".repeat(200), "y".repeat(256)];
const U32 = [0, 1, 127, 128, 16_384, 2 ** 31, 0xffff_ffff];
const U64 = [0n, 1n, 127n, 128n, 2n ** 32n, 2n ** 53n + 1n, 2n ** 63n, 2n ** 64n - 1n];

describe("encodePeerMessage, XferDone", () => {
  it("writes what protobuf-es writes, over many values (defaults, each varint size, multi-byte text)", () => {
    for (let i = 0; i < 500; i++) {
      const sender = pick(IDS);
      const [se, re, seq] = [pick(U64), pick(U64), pick(U64)];
      const value = {
        transferId: pick(IDS),
        srcRank: pick(U32),
        dstRank: pick(U32),
        bytes: pick(U64),
        sincePrefillDoneMs: pick(U32),
      };
      const generic = toBinary(
        PeerMessageSchema,
        create(PeerMessageSchema, {
          senderEngineId: sender,
          senderEpoch: se,
          receiverEpoch: re,
          seq,
          msg: { case: "xferDone", value },
        }),
      );
      const fast = encodePeerMessage(sender, se, re, { case: "xferDone", value }, seq);
      expect(Buffer.from(fast).toString("hex"), `#${i}`).toBe(Buffer.from(generic).toString("hex"));
    }
  });

  it("a value the hand encoder does not take goes to protobuf-es, which names it", () => {
    const body = {
      case: "xferDone" as const,
      value: { transferId: "t", srcRank: 0, dstRank: 0, bytes: 1n, sincePrefillDoneMs: 0.5 },
    };
    expect(() => encodePeerMessage("p", 1n, 1n, body, 1n)).toThrow(/since_prefill_done_ms/);
    expect(() =>
      encodePeerMessage("p", -1n, 1n, { ...body, value: { transferId: "t" } }, 1n),
    ).toThrow(/sender_epoch/);
  });

  it("round-trips through the parser", () => {
    const m = parsePeerMessage(
      encodePeerMessage(
        "p",
        3n,
        4n,
        { case: "xferDone", value: { transferId: "t-9", bytes: 7n } },
        5n,
      ),
    );
    expect(m.body).toMatchObject({ case: "xferDone", value: { transferId: "t-9", bytes: 7n } });
    expect([m.senderEpoch, m.receiverEpoch, m.seq]).toEqual([3n, 4n, 5n]);
  });

  it("knows every field the schemas have (a field added to the .proto must be added by hand too)", () => {
    expect(XferDoneSchema.fields.map((f) => f.localName)).toEqual([...XFER_DONE_FIELDS]);
    expect(
      PeerMessageSchema.fields.filter((f) => f.oneof === undefined).map((f) => f.localName),
    ).toEqual(["senderEngineId", "senderEpoch", "receiverEpoch", "seq"]);
    expect(PeerMessageSchema.fields.find((f) => f.localName === "xferDone")?.number).toBe(11);
  });
});

describe("encodeSidecarToEngine", () => {
  it("writes KvReady as protobuf-es does, and knows all its fields", () => {
    for (const transferId of IDS) {
      const msg = create(SidecarToEngineSchema, {
        msg: { case: "kvReady", value: { transferId } },
      });
      expect(Buffer.from(encodeSidecarToEngine(msg))).toEqual(
        Buffer.from(toBinary(SidecarToEngineSchema, msg)),
      );
    }
    expect(KvReadySchema.fields.map((f) => f.localName)).toEqual([...KV_READY_FIELDS]);
    expect(SidecarToEngineSchema.fields.find((f) => f.localName === "kvReady")?.number).toBe(2);
  });

  it("writes every other message with protobuf-es", () => {
    const msg = create(SidecarToEngineSchema, {
      msg: { case: "releaseBlocks", value: { transferId: "t", blockIds: [1, 2, 300] } },
    });
    expect(Buffer.from(encodeSidecarToEngine(msg))).toEqual(
      Buffer.from(toBinary(SidecarToEngineSchema, msg)),
    );
  });
});

describe("encodeEventResponse", () => {
  const KINDS = [0, 1, 2, 5, 9];
  it("writes an event as protobuf-es does, over many values, and knows all the fields", () => {
    for (let i = 0; i < 300; i++) {
      const e = create(EventSchema, {
        seq: pick(U64),
        kind: pick(KINDS),
        timeMs: pick(U64),
        transferId: pick(IDS),
        peer: pick(IDS),
        side: pick([0, 1, 2]),
        reason: pick(["", "ERR_LEASE_EXPIRED", "ü"]),
        bytes: pick(U64),
        mode: pick([0, 1, 2]),
      });
      const generic = toBinary(
        WatchEventsResponseSchema,
        create(WatchEventsResponseSchema, { msg: { case: "event", value: e } }),
      );
      expect(Buffer.from(encodeEventResponse(e)).toString("hex"), `#${i}`).toBe(
        Buffer.from(generic).toString("hex"),
      );
    }
    expect(EventSchema.fields.map((f) => f.localName)).toEqual([...EVENT_FIELDS]);
    expect(WatchEventsResponseSchema.fields.find((f) => f.localName === "event")?.number).toBe(1);
  });

  it("an enum number the hand encoder does not take (negative) goes to protobuf-es", () => {
    const e = create(EventSchema, { seq: 1n, kind: -1 as EventKind });
    const generic = toBinary(
      WatchEventsResponseSchema,
      create(WatchEventsResponseSchema, { msg: { case: "event", value: e } }),
    );
    expect(Buffer.from(encodeEventResponse(e))).toEqual(Buffer.from(generic));
  });
});
