/**
 * HMAC-SHA256 under one key, in the addon (native/src/mac.cc, OpenSSL as Node carries it): the
 * key is set up once, each message costs a copy of that state, an update and a final.
 */
import { addon, call } from "./addon.js";

export class MacKey {
  private readonly native: {
    sign(m: Uint8Array): Buffer;
    verify(m: Uint8Array, mac: Uint8Array): boolean;
  };

  /** Throws a KvxferError for an empty key or one that is not a Uint8Array. */
  constructor(key: Uint8Array) {
    this.native = call(() => new addon.MacKey(key));
  }

  /** The 32-byte HMAC-SHA256 of `message`. */
  sign(message: Uint8Array): Buffer {
    return this.native.sign(message);
  }

  /** Whether `mac` is `message`'s HMAC-SHA256 (constant time over the MAC; false for a short one). */
  verify(message: Uint8Array, mac: Uint8Array): boolean {
    return this.native.verify(message, mac);
  }
}
