// Peer notifications (src/peer/messages.ts): protobuf-es writes the bytes the previous release
// wrote, and the parser's checks hold whatever the layout.
import { create, toBinary } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { XferDoneSchema } from "../../src/gen/kvxfer/v1/peer_pb.js";
import { encodePeerMessage, parsePeerMessage, type PeerBody } from "../../src/peer/messages.js";
import { GOLDEN } from "./golden.js";

const hex = (b: Uint8Array): string => Buffer.from(b).toString("hex");

const BODIES: Record<"xferDone" | "readDone" | "readAck" | "heartbeat", PeerBody> = {
  xferDone: {
    case: "xferDone",
    value: { transferId: "req-1", srcRank: 1, dstRank: 2, bytes: 2097152n, sincePrefillDoneMs: 3 },
  },
  readDone: { case: "readDone", value: { transferId: "req-2", bytes: 4096n, token: "tok" } },
  readAck: { case: "readAck", value: { transferId: "req-3", held: true, unknown: false } },
  heartbeat: { case: "heartbeat", value: { transferIds: ["a", "b"] } },
};

describe("encodePeerMessage", () => {
  it("writes what the previous release wrote for each notification on the critical path", () => {
    for (const [name, body] of Object.entries(BODIES))
      expect(hex(encodePeerMessage("p-engine", 11n, 22n, body, 5n)), name).toBe(
        GOLDEN[name as keyof typeof BODIES],
      );
  });

  it("names a value the schema cannot carry", () => {
    const body = {
      case: "xferDone" as const,
      value: { transferId: "t", srcRank: 0, dstRank: 0, bytes: 1n, sincePrefillDoneMs: 0.5 },
    };
    expect(() => encodePeerMessage("p", 1n, 1n, body, 1n)).toThrow(/since_prefill_done_ms/);
    expect(() =>
      encodePeerMessage("p", -1n, 1n, { ...body, value: { transferId: "t" } }, 1n),
    ).toThrow(/sender_epoch/);
  });

  it("round-trips through the parser, each body with its values", () => {
    for (const [name, body] of Object.entries(BODIES)) {
      const m = parsePeerMessage(encodePeerMessage("p-engine", 11n, 22n, body, 5n));
      expect(m.body, name).toMatchObject(body);
      expect([m.senderEngineId, m.senderEpoch, m.receiverEpoch, m.seq]).toEqual([
        "p-engine",
        11n,
        22n,
        5n,
      ]);
    }
  });
});

describe("parsePeerMessage", () => {
  it("a transfer id is checked by its UTF-8 bytes however it was read: 256 pass, 257 do not", () => {
    const parse = (transferId: string): unknown =>
      parsePeerMessage(
        encodePeerMessage("p", 1n, 1n, { case: "xferDone", value: { transferId } }, 1n),
      );
    expect(() => parse("x".repeat(256))).not.toThrow();
    expect(() => parse("x".repeat(257))).toThrow(/transfer id must be 1..256 bytes/);
    expect(() => parse("")).toThrow(/transfer id must be/);
    // 86 three-byte characters: 258 bytes in 86 units (read by protobuf-es, not ASCII), refused
    // by their length before their characters.
    expect(() => parse("€".repeat(86))).toThrow(/transfer id must be 1..256 bytes/);
    expect(() => parse("€".repeat(85))).toThrow(/U\+20AC at index 0/);
    // Printable ASCII other than space only (issues 31 and 48): control, format, separator,
    // space, combining, homoglyph, private-use and unassigned characters are refused by name.
    for (const [id, cp] of [
      ["a\u0000", "0000"],
      ["line\nbreak", "000A"],
      ["esc\u001b[31m", "001B"],
      ["c1\u0085", "0085"],
      ["bidi\u202e", "202E"],
      ["sep\u2028", "2028"],
      ["req 42", "0020"],
      ["req\u00a042", "00A0"], // no-break space
      ["req\u300042", "3000"], // ideographic space
      ["re\u0301q-42", "0301"], // combining acute accent
      ["r\u0435q-42", "0435"], // Cyrillic e, looks like "req-42"
      ["req-\ue00042", "E000"], // private use
      ["req-\u{e0001}", "E0001"], // a tag character
      ["req-\u{10ffff}", "10FFFF"], // unassigned
      ["cmpl-é", "00E9"],
    ] as const)
      expect(() => parse(id), id).toThrow(
        new RegExp(`U\\+${cp} at index \\d+: only printable characters of ASCII other than space`),
      );
    expect(() => parse("cmpl-3f2a_0.x~!#$%&'()*+,/:;<=>?@[\\]^`{|}\"ok")).not.toThrow();
  });

  it("reads another layout than protobuf-es writes (the body before the sender)", () => {
    const body = toBinary(XferDoneSchema, create(XferDoneSchema, { transferId: "t", bytes: 5n }));
    const reordered = Buffer.concat([
      Buffer.from([0x5a, body.length]),
      body,
      Buffer.from([0x0a, 1, 0x70]),
    ]);
    expect(parsePeerMessage(reordered)).toMatchObject({
      senderEngineId: "p",
      body: { case: "xferDone", value: { transferId: "t", bytes: 5n } },
    });
  });

  it("refuses a message with no body or no sender, or cut short, with its code", () => {
    const code = (b: Uint8Array): unknown => {
      try {
        parsePeerMessage(b);
        return "parsed";
      } catch (err) {
        return (err as { code?: unknown }).code;
      }
    };
    expect(code(Uint8Array.from([0x0a, 1, 0x70]))).toBe("ERR_MALFORMED");
    expect(code(encodePeerMessage("", 1n, 1n, BODIES.heartbeat, 1n))).toBe("ERR_MALFORMED");
    const whole = encodePeerMessage("p", 1n, 1n, BODIES.xferDone, 1n);
    expect(code(whole.subarray(0, whole.length - 1))).toBe("ERR_MALFORMED");
    expect(code(new Uint8Array((1 << 20) + 1))).toBe("ERR_TOO_LARGE");
  });
});
