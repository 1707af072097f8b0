/**
 * Protobuf's wire format written by hand, for the few small messages every transfer sends on its
 * critical path (P's XferDone, D's KvReady). protobuf-es encodes by walking the schema, which
 * costs 50-65 µs for a one-field message when it has not run for 20 ms (3-5 µs back to back),
 * and on one request at a time every transfer finds it so. Each encoder here writes exactly the
 * bytes `toBinary` writes (proto3: fields in declaration order, defaults left out); the tests
 * compare the two over many values and check that the schemas still have the fields these
 * encoders know, so a field added to the .proto cannot be dropped silently. Anything else, and any
 * value outside what an encoder handles, goes to `toBinary`.
 */

const LENGTH_DELIMITED = 2;
const VARINT = 0;

/** Appends protobuf fields to a buffer sized up front. */
export class WireWriter {
  private readonly buf: Uint8Array;
  private at = 0;

  /** `capacity`: an upper bound of the bytes written. */
  constructor(capacity: number) {
    this.buf = new Uint8Array(capacity);
  }

  /** A non-negative safe integer as a varint. */
  private varint(n: number): void {
    while (n >= 0x80) {
      this.buf[this.at++] = (n % 0x80) | 0x80;
      n = Math.floor(n / 0x80);
    }
    this.buf[this.at++] = n;
  }

  private varint64(n: bigint): void {
    while (n >= 0x80n) {
      this.buf[this.at++] = Number(n & 0x7fn) | 0x80;
      n >>= 7n;
    }
    this.buf[this.at++] = Number(n);
  }

  /** A uint32 field; 0 is left out. */
  uint32(field: number, n: number): this {
    if (n !== 0) {
      this.varint((field << 3) | VARINT);
      this.varint(n);
    }
    return this;
  }

  /** A uint64 field; 0 is left out. */
  uint64(field: number, n: bigint): this {
    if (n !== 0n) {
      this.varint((field << 3) | VARINT);
      this.varint64(n);
    }
    return this;
  }

  /** A string field (UTF-8); empty is left out. */
  string(field: number, s: string): this {
    if (s.length === 0) return this;
    // Ids are ASCII: copied a code unit at a time (no call into the runtime's UTF-8 encoder).
    let ascii = true;
    for (let i = 0; i < s.length && ascii; i++) ascii = s.charCodeAt(i) < 0x80;
    if (!ascii) return this.bytes(field, Buffer.from(s, "utf8"));
    this.varint((field << 3) | LENGTH_DELIMITED);
    this.varint(s.length);
    for (let i = 0; i < s.length; i++) this.buf[this.at++] = s.charCodeAt(i);
    return this;
  }

  /** A length-delimited field written even when empty (a oneof's message, a nested message). */
  bytes(field: number, b: Uint8Array): this {
    this.varint((field << 3) | LENGTH_DELIMITED);
    this.varint(b.length);
    this.buf.set(b, this.at);
    this.at += b.length;
    return this;
  }

  finish(): Uint8Array {
    return this.buf.subarray(0, this.at);
  }
}

/** Most bytes a field's tag and a 64-bit varint take. */
export const FIELD_OVERHEAD = 2 + 10;

/** Whether `n` is what a uint32 field holds (else the generic encoder, which names the problem). */
export function isUint32(n: number): boolean {
  return Number.isInteger(n) && n >= 0 && n <= 0xffff_ffff;
}

/** Whether `n` is what a uint64 field holds. */
export function isUint64(n: bigint): boolean {
  return n >= 0n && n <= 0xffff_ffff_ffff_ffffn;
}

/** An upper bound of a string's UTF-8 bytes. */
export function utf8Bound(s: string): number {
  return 3 * s.length;
}
