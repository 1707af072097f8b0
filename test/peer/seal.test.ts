// Sealing a peer notification: HMAC-SHA256 (node:crypto) of the encoded PeerMessage in a
// SealedPeerMessage; what a different encoder writes still opens, and the MAC is checked over the
// bytes received, never over a re-encoding of what was parsed.
import { createHmac, randomBytes } from "node:crypto";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import {
  PeerMessageSchema,
  SealedPeerMessageSchema,
  XferDoneSchema,
} from "../../src/gen/kvxfer/v1/peer_pb.js";
import {
  encodePeerMessage,
  openPeerMessage,
  PeerMessageError,
  sealPeerMessage,
} from "../../src/peer/messages.js";
import { GOLDEN } from "./golden.js";

const openssl = (key: Uint8Array, m: Uint8Array): Buffer =>
  createHmac("sha256", key).update(m).digest();

const xferDone = (id: string): Uint8Array =>
  encodePeerMessage(
    "engine-p",
    7n,
    9n,
    {
      case: "xferDone",
      value: { transferId: id, srcRank: 0, dstRank: 1, bytes: 2n ** 21n, sincePrefillDoneMs: 3 },
    },
    42n,
  );

describe("sealPeerMessage", () => {
  it("writes the envelope the previous release wrote, byte for byte (peers of either version read each other)", () => {
    const key = Buffer.alloc(32, 7);
    const message = Buffer.from(GOLDEN.xferDone, "hex");
    expect(Buffer.from(sealPeerMessage(key, message)).toString("hex")).toBe(GOLDEN.xferDoneSealed);
  });

  it("opens what it sealed, under that key only", () => {
    const key = randomBytes(32);
    const opened = openPeerMessage(sealPeerMessage(key, xferDone("t-1")));
    expect(opened.body.case).toBe("xferDone");
    expect(opened.seq).toBe(42n);
    expect(opened.verify(key)).toBe(true);
    expect(opened.verify(randomBytes(32))).toBe(false);
  });

  it("opens a notification another encoder laid out differently (MAC first, an unknown field), and checks it the same", () => {
    const key = randomBytes(32);
    const message = xferDone("t-2");
    const mac = openssl(key, message);
    const macFirst = Buffer.concat([
      Buffer.from([0x12, 32]),
      mac,
      Buffer.from([0x18, 0x05]), // field 3, varint: unknown here
      Buffer.from([0x0a, message.length]),
      message,
    ]);
    const opened = openPeerMessage(macFirst);
    expect(opened.senderEngineId).toBe("engine-p");
    expect(opened.verify(key)).toBe(true);
    // One bit of the message flipped: the MAC no longer fits.
    const forged = Buffer.from(sealPeerMessage(key, message));
    forged[10] = forged[10]! ^ 1;
    expect(openPeerMessage(forged).verify(key)).toBe(false);
  });

  it("checks the MAC over the PeerMessage bytes as they came, even when a re-encoding would differ", () => {
    const key = randomBytes(32);
    const body = toBinary(XferDoneSchema, create(XferDoneSchema, { transferId: "t-5", bytes: 5n }));
    // Valid protobuf in another layout than protobuf-es writes: the body before the sender, the
    // seq written as a 10-byte varint, an unknown field (99) at the end.
    const message = Buffer.concat([
      Buffer.from([0x5a, body.length]),
      body,
      Buffer.from([0x0a, 1, 0x70, 0x20, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0]),
      Buffer.from([0x98, 0x06, 0x01]),
    ]);
    const parsed = fromBinary(PeerMessageSchema, message);
    expect(Buffer.from(toBinary(PeerMessageSchema, parsed)).equals(message)).toBe(false);
    const sealed = toBinary(
      SealedPeerMessageSchema,
      create(SealedPeerMessageSchema, { message, mac: openssl(key, message) }),
    );
    const opened = openPeerMessage(sealed);
    expect(opened).toMatchObject({ senderEngineId: "p", seq: 1n });
    expect(opened.body).toMatchObject({ case: "xferDone", value: { transferId: "t-5" } });
    expect(opened.verify(key)).toBe(true);
    // A MAC over the re-encoding does not pass for these bytes.
    const reencoded = toBinary(PeerMessageSchema, parsed);
    const wrong = toBinary(
      SealedPeerMessageSchema,
      create(SealedPeerMessageSchema, { message, mac: openssl(key, reencoded) }),
    );
    expect(openPeerMessage(wrong).verify(key)).toBe(false);
  });

  it("refuses an envelope whose MAC is cut short, or whose length runs past its end, naming why", () => {
    const key = randomBytes(32);
    const sealed = Buffer.from(sealPeerMessage(key, xferDone("t-3")));
    const short = sealed.subarray(0, sealed.length - 1);
    expect(() => openPeerMessage(short)).toThrow(PeerMessageError);
    try {
      openPeerMessage(short);
    } catch (err) {
      // The generic decoder reads it: a field cut short is malformed.
      expect((err as PeerMessageError).code).toBe("ERR_MALFORMED");
    }
    const long = Buffer.from(sealed);
    long[1] = 0x7f; // the message's length now runs past the end
    expect(() => openPeerMessage(long)).toThrow(/not a SealedPeerMessage/);
    // A MAC of the wrong size, well formed otherwise.
    const odd = toBinary(
      SealedPeerMessageSchema,
      create(SealedPeerMessageSchema, { message: xferDone("t-4"), mac: new Uint8Array(31) }),
    );
    expect(() => openPeerMessage(odd)).toThrow(/carries no MAC/);
    expect(fromBinary(SealedPeerMessageSchema, odd).mac.length).toBe(31);
  });
});
