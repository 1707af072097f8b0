/**
 * Protobuf's wire format by hand, for the few small messages every transfer handles on its
 * critical path: P reads its engine's PrefillDone and writes the XferDone; D reads the XferDone
 * and writes KvReady and the KV_READY event; a pull's ReadDone and ReadAck both ways; both sides
 * seal or open the notification's envelope; the router's client reads the event.
 * protobuf-es walks the schema for every message, which costs 50-100 µs for these when it has
 * not run for 20 ms (3-5 µs back to back), and with one request at a time every transfer finds
 * it so (docs/benchmarks.md, "Cold code").
 *
 * Each writer writes exactly the bytes `toBinary` writes (proto3: fields in declaration order,
 * defaults left out); each reader takes one strict layout and leaves anything else to
 * `fromBinary`. The tests compare both directions with protobuf-es over many values and damaged
 * bytes, and fail when a schema gains a field the code here does not know.
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

  /** A bool field; false is left out. */
  bool(field: number, b: boolean): this {
    if (b) {
      this.varint((field << 3) | VARINT);
      this.buf[this.at++] = 1;
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

/**
 * Reads protobuf fields in one strict layout: each field at most once, in increasing number,
 * one-byte tags, varints no longer than their type needs, ASCII strings. Reads name the field
 * they expect; an absent field reads as its default. Anything else clears `ok`, and the caller
 * then hands the bytes to protobuf-es, which takes every layout and names what is wrong; so
 * what is read here is what protobuf-es would read.
 */
export class WireReader {
  /** False once anything did not fit the layout. */
  ok = true;
  private at: number;
  private lastField = 0;

  constructor(
    private readonly buf: Uint8Array,
    start = 0,
    private readonly end = buf.length,
  ) {
    this.at = start;
  }

  /** Every byte read (and nothing went wrong). */
  get done(): boolean {
    return this.ok && this.at === this.end;
  }

  /** Takes field `field` of `wireType` if it comes next; false if absent or out of layout. */
  private take(field: number, wireType: number): boolean {
    if (!this.ok || this.at >= this.end) return false;
    const tag = this.buf[this.at]!;
    if (tag >> 3 !== field) {
      // Absent is fine; a field that should have come before this one is not.
      if (tag >= 0x80 || tag >> 3 < field) this.ok = false;
      return false;
    }
    if ((tag & 7) !== wireType || field <= this.lastField) return (this.ok = false);
    this.at++;
    this.lastField = field;
    return true;
  }

  /** A varint of at most `maxBytes` bytes (below 2^53 for `maxBytes` <= 7). */
  private varint(maxBytes: number): number {
    let n = 0;
    for (let i = 0, scale = 1; i < maxBytes && this.at < this.end; i++, scale *= 0x80) {
      const b = this.buf[this.at++]!;
      n += (b & 0x7f) * scale;
      if (b < 0x80) return n;
    }
    this.ok = false;
    return 0;
  }

  uint32(field: number): number {
    if (!this.take(field, VARINT)) return 0;
    const n = this.varint(5);
    if (n > 0xffff_ffff) this.ok = false;
    return n;
  }

  /** A bool written as protobuf writes it: one byte, 0 or 1 (anything else is out of layout). */
  bool(field: number): boolean {
    if (!this.take(field, VARINT)) return false;
    const n = this.varint(1);
    if (n > 1) this.ok = false;
    return n === 1;
  }

  /** The number of the field that comes next, if its tag is one byte (fields 1-15); else 0. */
  nextField(): number {
    if (!this.ok || this.at >= this.end) return 0;
    const tag = this.buf[this.at]!;
    return tag < 0x80 ? tag >> 3 : 0;
  }

  uint64(field: number): bigint {
    if (!this.take(field, VARINT)) return 0n;
    let n = 0n;
    for (let i = 0n; i < 10n && this.at < this.end; i++) {
      const b = this.buf[this.at++]!;
      n |= BigInt(b & 0x7f) << (7n * i);
      if (b < 0x80) {
        if (n > 0xffff_ffff_ffff_ffffn) this.ok = false;
        return n;
      }
    }
    this.ok = false;
    return 0n;
  }

  /** A length-delimited field's bounds, within this reader's. */
  private span(): [number, number] {
    const length = this.varint(5);
    if (!this.ok || this.at + length > this.end) {
      this.ok = false;
      return [this.at, this.at];
    }
    this.at += length;
    return [this.at - length, this.at];
  }

  /** A bytes field, as a view into the buffer (empty when absent). */
  bytes(field: number): Uint8Array {
    if (!this.take(field, LENGTH_DELIMITED)) return this.buf.subarray(0, 0);
    const [start, end] = this.span();
    return this.buf.subarray(start, end);
  }

  /** A string of ASCII text. */
  string(field: number): string {
    if (!this.take(field, LENGTH_DELIMITED)) return "";
    const [start, end] = this.span();
    let out = "";
    for (let i = start; i < end; i++) {
      const c = this.buf[i]!;
      if (c >= 0x80) this.ok = false;
      out += String.fromCharCode(c);
    }
    return out;
  }

  /** A packed repeated uint32 (an unpacked one is out of layout). */
  packedUint32(field: number): number[] {
    const out: number[] = [];
    if (!this.take(field, LENGTH_DELIMITED)) return out;
    const [start, end] = this.span();
    const items = new WireReader(this.buf, start, end);
    while (items.ok && items.at < end) {
      const n = items.varint(5);
      if (n > 0xffff_ffff) items.ok = false;
      out.push(n);
    }
    if (!items.ok) this.ok = false;
    return out;
  }

  /** A nested message that must be there: its own reader (not ok when absent). */
  message(field: number): WireReader {
    if (!this.take(field, LENGTH_DELIMITED)) {
      this.ok = false;
      return new WireReader(this.buf, this.at, this.at);
    }
    const [start, end] = this.span();
    return new WireReader(this.buf, start, end);
  }
}
