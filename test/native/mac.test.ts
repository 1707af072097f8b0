// MacKey (native/src/mac.cc): HMAC-SHA256 in the addon, as peer notifications are sealed and
// verified. Checked against node:crypto's createHmac over random keys and messages of every size
// class, and for what it must refuse.
import { createHmac, randomBytes } from "node:crypto";
import { describe, expect, it } from "vitest";

import { KvxferError, MacKey } from "../../src/native/index.js";

describe("MacKey", () => {
  it("computes node:crypto's HMAC-SHA256 for random keys and messages", () => {
    for (const keyLen of [1, 16, 32, 64, 65, 200]) {
      const key = randomBytes(keyLen);
      const k = new MacKey(key);
      for (const len of [0, 1, 55, 56, 63, 64, 65, 110, 1000, 70_000]) {
        const m = randomBytes(len);
        const want = createHmac("sha256", key).update(m).digest();
        const got = k.sign(m);
        expect(got.equals(want), `key ${keyLen} B, message ${len} B`).toBe(true);
        expect(k.verify(m, want)).toBe(true);
      }
    }
  });

  it("signs a view at its offset, not its whole buffer", () => {
    const key = randomBytes(32);
    const whole = randomBytes(300);
    const view = whole.subarray(17, 160);
    expect(new MacKey(key).sign(view).equals(createHmac("sha256", key).update(view).digest())).toBe(
      true,
    );
  });

  it("refuses a MAC that is wrong, short, long, or made under another key", () => {
    const key = randomBytes(32);
    const k = new MacKey(key);
    const m = randomBytes(120);
    const mac = k.sign(m);
    const flipped = Buffer.from(mac);
    flipped[31] = flipped[31]! ^ 1;
    expect(k.verify(m, flipped)).toBe(false);
    expect(k.verify(m, mac.subarray(0, 31))).toBe(false);
    expect(k.verify(m, Buffer.concat([mac, Buffer.alloc(1)]))).toBe(false);
    expect(k.verify(m, new Uint8Array(0))).toBe(false);
    expect(new MacKey(randomBytes(32)).verify(m, mac)).toBe(false);
    const other = Buffer.from(m);
    other[0] = other[0]! ^ 0x80;
    expect(k.verify(other, mac)).toBe(false);
  });

  it("names what is wrong with a bad key or message", () => {
    expect(() => new MacKey(new Uint8Array(0))).toThrow(KvxferError);
    expect(() => new MacKey(new Uint8Array(0))).toThrow(/key is empty/);
    expect(() => new MacKey("secret" as unknown as Uint8Array)).toThrow(/key must be a Uint8Array/);
    const k = new MacKey(randomBytes(32));
    expect(() => k.sign("x" as unknown as Uint8Array)).toThrow(/message must be a Uint8Array/);
    expect(() => k.verify(new Uint8Array(1), [1, 2] as unknown as Uint8Array)).toThrow(
      /MAC must be a Uint8Array/,
    );
  });
});
