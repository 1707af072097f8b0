// Sealing a peer notification without the generic protobuf encoder and OpenSSL's HMAC set-up:
// the MAC is HMAC-SHA256 bit for bit, the envelope is what protobuf-es writes, and what a
// different encoder writes still opens.
import { createHmac, randomBytes } from "node:crypto";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { SealedPeerMessageSchema } from "../../src/gen/kvxfer/v1/peer_pb.js";
import { hmacSha256, JS_MAX_BYTES } from "../../src/peer/hmac.js";
import {
  encodePeerMessage,
  openPeerMessage,
  PeerMessageError,
  sealPeerMessage,
} from "../../src/peer/messages.js";

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

describe("hmacSha256", () => {
  it("matches RFC 4231's test case 2", () => {
    const mac = hmacSha256(Buffer.from("Jefe"), Buffer.from("what do ya want for nothing?"));
    expect(Buffer.from(mac).toString("hex")).toBe(
      "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
    );
  });

  it("matches OpenSSL for every message length around the block and padding edges, and past the JavaScript limit", () => {
    const lengths = [0, 1, 54, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 200];
    lengths.push(JS_MAX_BYTES - 1, JS_MAX_BYTES, JS_MAX_BYTES + 1, 4096);
    for (const keyBytes of [1, 32, 63, 64, 65, 100]) {
      const key = randomBytes(keyBytes);
      for (const n of lengths) {
        const m = randomBytes(n);
        expect(
          Buffer.from(hmacSha256(key, m)).toString("hex"),
          `key ${keyBytes}, message ${n}`,
        ).toBe(openssl(key, m).toString("hex"));
      }
    }
  });

  it("keeps keys apart: the same message under two keys, each prepared once, in turns", () => {
    const a = randomBytes(32);
    const b = randomBytes(32);
    const m = randomBytes(120);
    for (let i = 0; i < 3; i++) {
      expect(Buffer.from(hmacSha256(a, m))).toEqual(openssl(a, m));
      expect(Buffer.from(hmacSha256(b, m))).toEqual(openssl(b, m));
    }
  });

  it("a view into a larger buffer hashes only its own bytes", () => {
    const key = randomBytes(32);
    const whole = randomBytes(300);
    const view = whole.subarray(17, 17 + 130);
    expect(Buffer.from(hmacSha256(key, view))).toEqual(openssl(key, Buffer.from(view)));
  });
});

describe("sealPeerMessage", () => {
  it("writes the bytes protobuf-es writes, for lengths across each varint size", () => {
    const key = randomBytes(32);
    for (const n of [0, 1, 127, 128, 16_383, 16_384, 1 << 20]) {
      const message = randomBytes(n);
      const generic = toBinary(
        SealedPeerMessageSchema,
        create(SealedPeerMessageSchema, { message, mac: openssl(key, message) }),
      );
      expect(Buffer.from(sealPeerMessage(key, message)).equals(Buffer.from(generic)), `${n}`).toBe(
        true,
      );
    }
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
