// The messages written by hand on the critical path (src/wire.ts): byte for byte what
// protobuf-es writes, and still every field the schema has; the ones built by hand, what
// protobuf-es's create builds.
import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import {
  decodeEventResponse,
  encodeEventResponse,
  EVENT_FIELDS,
  eventToProto,
} from "../../src/api/convert.js";
import {
  decodePrefillDone,
  encodeSidecarToEngine,
  KV_READY_FIELDS,
  PREFILL_DONE_FIELDS,
} from "../../src/engine/link.js";
import { WireReader } from "../../src/wire.js";
import {
  EngineToSidecarSchema,
  KvReadySchema,
  PrefillDoneSchema,
  SidecarToEngineSchema,
} from "../../src/gen/kvxfer/v1/engine_pb.js";
import {
  type PeerMessage,
  PeerMessageSchema,
  ReadAckSchema,
  ReadDoneSchema,
  XferDoneSchema,
} from "../../src/gen/kvxfer/v1/peer_pb.js";
import {
  type EventKind,
  EventSchema,
  WatchEventsResponseSchema,
} from "../../src/gen/kvxfer/v1/sidecar_pb.js";
import {
  decodeNotification,
  encodePeerMessage,
  parsePeerMessage,
  type PeerBody,
  READ_ACK_FIELDS,
  READ_DONE_FIELDS,
  XFER_DONE_FIELDS,
} from "../../src/peer/messages.js";
import type { SidecarEvent } from "../../src/sidecar/view.js";

// A fixed sequence (a linear congruential generator), so a failure can be run again.
let seed = 12345;
const next = (): number => (seed = (seed * 1103515245 + 12345) % 2 ** 31);
const pick = <T>(xs: readonly T[]): T => xs[next() % xs.length]!;

const IDS = ["", "a", "req-00012-abcdef", "ü-Ω-😀", "x".repeat(200), "y".repeat(256)];
const U32 = [0, 1, 127, 128, 16_384, 2 ** 31, 0xffff_ffff];
const U64 = [0n, 1n, 127n, 128n, 2n ** 32n, 2n ** 53n + 1n, 2n ** 63n, 2n ** 64n - 1n];

/** An Event's fields, random (kinds this client does not know among them). */
const randomEvent = () => ({
  seq: pick(U64),
  kind: pick([0, 1, 2, 3, 5, 7, 9, 300]),
  timeMs: pick(U64),
  transferId: pick(IDS),
  peer: pick(IDS),
  side: pick([0, 1, 2]),
  reason: pick(["", "ERR_LEASE_EXPIRED", "ü"]),
  bytes: pick(U64),
  mode: pick([0, 1, 2]),
});

/** The bodies written and read by hand, each with random values. */
const BODIES = {
  xferDone: () => ({
    transferId: pick(IDS),
    srcRank: pick(U32),
    dstRank: pick(U32),
    bytes: pick(U64),
    sincePrefillDoneMs: pick(U32),
  }),
  readDone: () => ({ transferId: pick(IDS), bytes: pick(U64), token: pick(["", "s3cret", "ü"]) }),
  readAck: () => ({
    transferId: pick(IDS),
    held: pick([true, false]),
    unknown: pick([true, false]),
  }),
};
type BodyCase = keyof typeof BODIES;
const CASES = Object.keys(BODIES) as BodyCase[];
const body = (c: BodyCase) => ({ case: c, value: BODIES[c]() }) as PeerBody;

describe("encodePeerMessage, XferDone, ReadDone and ReadAck", () => {
  it("writes what protobuf-es writes, over many values (defaults, each varint size, multi-byte text)", () => {
    for (const c of CASES)
      for (let i = 0; i < 300; i++) {
        const sender = pick(IDS);
        const [se, re, seq] = [pick(U64), pick(U64), pick(U64)];
        const msg = body(c);
        const generic = toBinary(
          PeerMessageSchema,
          create(PeerMessageSchema, {
            senderEngineId: sender,
            senderEpoch: se,
            receiverEpoch: re,
            seq,
            msg,
          }),
        );
        const fast = encodePeerMessage(sender, se, re, msg, seq);
        expect(Buffer.from(fast).toString("hex"), `${c} #${i}`).toBe(
          Buffer.from(generic).toString("hex"),
        );
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
    expect(ReadDoneSchema.fields.map((f) => f.localName)).toEqual([...READ_DONE_FIELDS]);
    expect(ReadAckSchema.fields.map((f) => f.localName)).toEqual([...READ_ACK_FIELDS]);
    expect(
      PeerMessageSchema.fields.filter((f) => f.oneof === undefined).map((f) => f.localName),
    ).toEqual(["senderEngineId", "senderEpoch", "receiverEpoch", "seq"]);
    const number = (name: string): number | undefined =>
      PeerMessageSchema.fields.find((f) => f.localName === name)?.number;
    expect([number("xferDone"), number("readDone"), number("readAck")]).toEqual([11, 12, 13]);
  });
});

/** One random change: a byte replaced, inserted or removed, or the end cut off. */
function damage(bytes: Uint8Array): Uint8Array {
  const b = Array.from(bytes);
  const at = next() % Math.max(1, b.length);
  switch (next() % 4) {
    case 0:
      b[at] = next() % 256;
      break;
    case 1:
      b.splice(at, 0, next() % 256);
      break;
    case 2:
      b.splice(at, 1);
      break;
    default:
      b.length = at;
  }
  return Uint8Array.from(b);
}

/**
 * Damages `sample()` 5000 times: whatever `fast` reads, protobuf-es (`generic`) must read the
 * same, and what protobuf-es refuses `fast` must not read. Both outcomes must happen.
 */
function fuzzAgainst(
  sample: () => Uint8Array,
  fast: (b: Uint8Array) => unknown,
  generic: (b: Uint8Array) => unknown,
): void {
  let readByBoth = 0;
  let refusedByBoth = 0;
  for (let i = 0; i < 5000; i++) {
    const bytes = damage(sample());
    const ours = fast(bytes);
    let theirs: unknown;
    try {
      theirs = generic(bytes);
    } catch {
      theirs = undefined;
    }
    if (ours !== undefined) {
      expect(theirs, `#${i}`).toStrictEqual(ours);
      readByBoth++;
    } else if (theirs === undefined) refusedByBoth++;
  }
  // Both happen (the damage is sometimes harmless, e.g. a changed digit).
  expect(readByBoth).toBeGreaterThan(100);
  expect(refusedByBoth).toBeGreaterThan(100);
}

describe("WireReader", () => {
  it("reads fields in order, absent ones as defaults, and stops at the first thing out of layout", () => {
    // Field 1 "ab", field 3 = 300.
    const ok = new WireReader(Uint8Array.from([0x0a, 2, 0x61, 0x62, 0x18, 0xac, 0x02]));
    expect([ok.string(1), ok.uint32(2), ok.uint32(3), ok.done]).toEqual(["ab", 0, 300, true]);
    // A length past the end.
    const long = new WireReader(Uint8Array.from([0x0a, 5, 0x61]));
    expect([long.string(1), long.ok]).toEqual(["", false]);
    // Field 1 after field 3: out of order, even before the end is checked.
    const late = new WireReader(Uint8Array.from([0x18, 1, 0x08, 1]));
    expect([late.uint32(3), late.uint32(4), late.ok]).toEqual([1, 0, false]);
    // A varint longer than its type, a value past uint32, a wire type that does not fit.
    const wide = new WireReader(Uint8Array.from([0x08, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]));
    expect([wide.uint32(1), wide.ok]).toEqual([0, false]);
    // 2^33 - 1: past uint32.
    const big = new WireReader(Uint8Array.from([0x08, 0xff, 0xff, 0xff, 0xff, 0x1f]));
    big.uint32(1);
    expect(big.ok).toBe(false);
    const typed = new WireReader(Uint8Array.from([0x0a, 1]));
    expect([typed.uint32(1), typed.ok]).toEqual([0, false]);
  });
});

describe("decodeNotification", () => {
  const sample = (c: BodyCase) => (): Uint8Array =>
    encodePeerMessage(pick(IDS), pick(U64), pick(U64), body(c), pick(U64));
  const text = (m: PeerMessage): string[] => {
    const v = m.msg.value as { transferId: string; token?: string };
    return [m.senderEngineId, v.transferId, v.token ?? ""];
  };

  it("reads what protobuf-es reads, for every body with ASCII text; leaves other text to it", () => {
    for (const c of CASES) {
      let read = 0;
      for (let i = 0; i < 500; i++) {
        const bytes = sample(c)();
        const generic = fromBinary(PeerMessageSchema, bytes);
        const fast = decodeNotification(bytes);
        if (text(generic).every((t) => /^[\x00-\x7f]*$/.test(t))) {
          expect(fast, `${c} #${i}`).toStrictEqual(generic);
          read++;
        } else {
          expect(fast, `${c} #${i}`).toBeUndefined();
        }
      }
      expect(read, c).toBeGreaterThan(100);
    }
  });

  for (const c of CASES)
    it(`${c}: anything it reads from damaged bytes, protobuf-es reads the same; what protobuf-es refuses, it does not read`, () => {
      fuzzAgainst(sample(c), decodeNotification, (b) => fromBinary(PeerMessageSchema, b));
    });

  it("leaves a bool written as anything but 0 or 1 to protobuf-es", () => {
    // ReadAck { transfer_id "t", held = 2 }: protobuf reads true, the strict layout does not.
    const inner = [0x0a, 1, 0x74, 0x10, 2];
    const bytes = Uint8Array.from([0x0a, 1, 0x70, 0x6a, inner.length, ...inner]);
    expect(decodeNotification(bytes)).toBeUndefined();
    expect(parsePeerMessage(bytes).body).toMatchObject({ case: "readAck", value: { held: true } });
    inner[4] = 1;
    const canonical = Uint8Array.from([0x0a, 1, 0x70, 0x6a, inner.length, ...inner]);
    expect(decodeNotification(canonical)).toStrictEqual(fromBinary(PeerMessageSchema, canonical));
  });

  it("a transfer id is checked by its UTF-8 bytes however it was read: 256 pass, 257 do not", () => {
    const parse = (transferId: string): unknown =>
      parsePeerMessage(
        encodePeerMessage("p", 1n, 1n, { case: "xferDone", value: { transferId } }, 1n),
      );
    expect(() => parse("x".repeat(256))).not.toThrow();
    expect(() => parse("x".repeat(257))).toThrow(/transfer id must be 1..256 bytes/);
    expect(() => parse("")).toThrow(/transfer id must be/);
    // 86 three-byte characters: 258 bytes in 86 units (read by protobuf-es, not ASCII).
    expect(() => parse("€".repeat(86))).toThrow(/transfer id must be 1..256 bytes/);
    expect(() => parse("€".repeat(85))).not.toThrow();
    // Printable characters only (issue 31): control, format and separator characters are refused.
    for (const [id, cp] of [
      ["a\u0000", "0000"],
      ["line\nbreak", "000A"],
      ["esc\u001b[31m", "001B"],
      ["c1\u0085", "0085"],
      ["bidi\u202e", "202E"],
      ["sep\u2028", "2028"],
    ] as const)
      expect(() => parse(id), id).toThrow(new RegExp(`U\\+${cp} at index \\d+: only printable`));
    expect(() => parse("cmpl-3f2a_0.é-漢字 ok")).not.toThrow();
  });

  it("leaves another layout and other bodies to protobuf-es", () => {
    const body = toBinary(XferDoneSchema, create(XferDoneSchema, { transferId: "t", bytes: 5n }));
    // The body first, then the sender: valid protobuf, not the layout read by hand.
    const reordered = Buffer.concat([
      Buffer.from([0x5a, body.length]),
      body,
      Buffer.from([0x0a, 1, 0x70]),
    ]);
    expect(decodeNotification(reordered)).toBeUndefined();
    expect(parsePeerMessage(reordered)).toMatchObject({
      senderEngineId: "p",
      body: { case: "xferDone", value: { transferId: "t", bytes: 5n } },
    });
    const heartbeat = encodePeerMessage("p", 1n, 1n, { case: "heartbeat", value: {} }, 1n);
    expect(decodeNotification(heartbeat)).toBeUndefined();
    expect(parsePeerMessage(heartbeat).body.case).toBe("heartbeat");
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
  it("writes an event as protobuf-es does, over many values, and knows all the fields", () => {
    for (let i = 0; i < 300; i++) {
      const e = create(EventSchema, randomEvent());
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

  it("eventToProto builds by hand the message create builds, for every kind, side and mode", () => {
    const kinds: SidecarEvent["kind"][] = ["KV_READY", "FAILED", "RELEASED", "PEER_UP"];
    for (let i = 0; i < 200; i++) {
      const ev: SidecarEvent = {
        seq: i + 1,
        kind: pick(kinds),
        timeMs: pick([0, 1, 1_700_000_000_123]),
        transferId: pick(IDS),
        peer: pick(IDS),
        side: pick(["", "prefill", "decode"] as const),
        reason: pick(["", "ERR_LEASE_EXPIRED"]),
        bytes: pick([0, 2 << 20, 2 ** 40]),
        mode: pick(["", "push", "pull"]),
      };
      const p = eventToProto(ev);
      // Without $typeName, or create would hand back its argument as it is.
      const { $typeName, ...fields } = p;
      expect($typeName).toBe(EventSchema.typeName);
      expect(p, `#${i}`).toStrictEqual(create(EventSchema, fields));
      // ... and every field carries the event's value, none left at a default by mistake.
      expect(p.kind).not.toBe(0);
      expect([p.seq, p.timeMs, p.bytes]).toEqual([ev.seq, ev.timeMs, ev.bytes].map(BigInt));
      expect([p.transferId, p.peer, p.reason]).toEqual([ev.transferId, ev.peer, ev.reason]);
      expect(p.side === 0).toBe(ev.side === "");
      expect(p.mode === 0).toBe(ev.mode === "");
    }
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

describe("decodeEventResponse", () => {
  const sample = (): Uint8Array =>
    toBinary(
      WatchEventsResponseSchema,
      create(WatchEventsResponseSchema, {
        msg: {
          case: "event",
          value: randomEvent(),
        },
      }),
    );

  it("reads what protobuf-es reads for ASCII text, leaves other text to it, and knows every field", () => {
    let read = 0;
    for (let i = 0; i < 500; i++) {
      const bytes = sample();
      const generic = fromBinary(WatchEventsResponseSchema, bytes);
      const e = generic.msg.value as { transferId: string; peer: string; reason: string };
      if (/^[\x00-\x7f]*$/.test(e.transferId + e.peer + e.reason)) {
        expect(decodeEventResponse(bytes), `#${i}`).toStrictEqual(generic);
        read++;
      } else expect(decodeEventResponse(bytes), `#${i}`).toBeUndefined();
    }
    expect(read).toBeGreaterThan(200);
    expect(EventSchema.fields.map((f) => f.localName)).toEqual([...EVENT_FIELDS]);
  });

  it("leaves a progress message, an empty response and an empty event's neighbours to protobuf-es", () => {
    const progress = toBinary(
      WatchEventsResponseSchema,
      create(WatchEventsResponseSchema, {
        msg: { case: "progress", value: { seq: 5n, caughtUp: true } },
      }),
    );
    expect(decodeEventResponse(progress)).toBeUndefined();
    expect(decodeEventResponse(new Uint8Array(0))).toBeUndefined();
    // An event with every field at its default is field 1 with length 0: read, as protobuf-es does.
    const empty = toBinary(
      WatchEventsResponseSchema,
      create(WatchEventsResponseSchema, { msg: { case: "event", value: {} } }),
    );
    expect(decodeEventResponse(empty)).toStrictEqual(fromBinary(WatchEventsResponseSchema, empty));
  });

  it("anything it reads from damaged bytes, protobuf-es reads the same; what protobuf-es refuses, it does not read", () => {
    fuzzAgainst(sample, decodeEventResponse, (b) => fromBinary(WatchEventsResponseSchema, b));
  });
});

describe("decodePrefillDone", () => {
  const sample = (): Uint8Array =>
    toBinary(
      EngineToSidecarSchema,
      create(EngineToSidecarSchema, {
        msg: {
          case: "prefillDone",
          value: {
            transferId: pick(IDS),
            blockIds: Array.from({ length: next() % 40 }, () => pick(U32)),
            numTokens: pick(U32),
            token: pick(["", "s3cret", "ü"]),
          },
        },
      }),
    );

  it("reads what protobuf-es reads for ASCII text, leaves other text to it, and knows every field", () => {
    let read = 0;
    for (let i = 0; i < 500; i++) {
      const bytes = sample();
      const generic = fromBinary(EngineToSidecarSchema, bytes);
      const v = generic.msg.value as { transferId: string; token: string };
      if (/^[\x00-\x7f]*$/.test(v.transferId + v.token)) {
        expect(decodePrefillDone(bytes), `#${i}`).toStrictEqual(generic);
        read++;
      } else expect(decodePrefillDone(bytes), `#${i}`).toBeUndefined();
    }
    expect(read).toBeGreaterThan(200);
    expect(PrefillDoneSchema.fields.map((f) => f.localName)).toEqual([...PREFILL_DONE_FIELDS]);
    expect(EngineToSidecarSchema.fields.find((f) => f.localName === "prefillDone")?.number).toBe(2);
  });

  it("anything it reads from damaged bytes, protobuf-es reads the same; what protobuf-es refuses, it does not read", () => {
    fuzzAgainst(sample, decodePrefillDone, (b) => fromBinary(EngineToSidecarSchema, b));
  });

  it("leaves block ids written unpacked (valid, another encoder's choice) to protobuf-es", () => {
    // PrefillDone { transfer_id "t", block_ids 7 and 9 as two unpacked fields }.
    const inner = Uint8Array.from([0x0a, 1, 0x74, 0x10, 7, 0x10, 9]);
    const bytes = Uint8Array.from([0x12, inner.length, ...inner]);
    expect(decodePrefillDone(bytes)).toBeUndefined();
    expect(fromBinary(EngineToSidecarSchema, bytes).msg.value).toMatchObject({ blockIds: [7, 9] });
  });
});
