/**
 * HMAC-SHA256 (RFC 2104, FIPS 180-4) of short messages, for sealing and checking peer
 * notifications on the transfer's critical path.
 *
 * Why not only `node:crypto`: each transfer seals or checks a notification of about 120 bytes
 * once, 20 ms or more after the last one. Code left that long falls out of this VM's caches, and
 * `createHmac` then takes 30-100 µs (3 µs back to back), most of it OpenSSL finding and setting up
 * its algorithm and hashing the key. Here the key's two padded blocks are hashed once per key and
 * a message costs its own compression rounds, in one small function: 12-18 µs cold, the same
 * 2-3 µs hot. OpenSSL is far faster per byte (SHA extensions), so messages longer than
 * `JS_MAX_BYTES` (a PushReg with many block ids) still go to it; both give the same MAC.
 */
import { createHmac } from "node:crypto";

/** Longest message hashed here; longer ones go to OpenSSL (faster per byte beyond ~0.5 KiB). */
export const JS_MAX_BYTES = 512;

// The first 32 bits of the fractional parts of the cube roots of the first 64 primes (FIPS 180-4).
const ROUND = new Int32Array([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
]);
// The first 32 bits of the fractional parts of the square roots of the first 8 primes.
const INITIAL = new Int32Array([
  0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
]);

const BLOCK = 64;
/** Bytes of an HMAC-SHA256. */
export const HMAC_SHA256_BYTES = 32;
// Scratch, reused (JavaScript runs one call at a time).
const schedule = new Int32Array(64);
const tail = new Uint8Array(2 * BLOCK);
const state = new Int32Array(8);
const innerDigest = new Uint8Array(HMAC_SHA256_BYTES);

/** One SHA-256 compression of the 64 bytes at `bytes[at]` into `h`. */
function compress(h: Int32Array, bytes: Uint8Array, at: number): void {
  const w = schedule;
  for (let i = 0; i < 16; i++) {
    const j = at + 4 * i;
    w[i] = (bytes[j]! << 24) | (bytes[j + 1]! << 16) | (bytes[j + 2]! << 8) | bytes[j + 3]!;
  }
  for (let i = 16; i < 64; i++) {
    const x = w[i - 15]!;
    const y = w[i - 2]!;
    const s0 = ((x >>> 7) | (x << 25)) ^ ((x >>> 18) | (x << 14)) ^ (x >>> 3);
    const s1 = ((y >>> 17) | (y << 15)) ^ ((y >>> 19) | (y << 13)) ^ (y >>> 10);
    w[i] = (w[i - 16]! + s0 + w[i - 7]! + s1) | 0;
  }
  let a = h[0]!;
  let b = h[1]!;
  let c = h[2]!;
  let d = h[3]!;
  let e = h[4]!;
  let f = h[5]!;
  let g = h[6]!;
  let k = h[7]!;
  for (let i = 0; i < 64; i++) {
    const s1 = ((e >>> 6) | (e << 26)) ^ ((e >>> 11) | (e << 21)) ^ ((e >>> 25) | (e << 7));
    const t1 = (k + s1 + ((e & f) ^ (~e & g)) + ROUND[i]! + w[i]!) | 0;
    const s0 = ((a >>> 2) | (a << 30)) ^ ((a >>> 13) | (a << 19)) ^ ((a >>> 22) | (a << 10));
    const t2 = (s0 + ((a & b) ^ (a & c) ^ (b & c))) | 0;
    k = g;
    g = f;
    f = e;
    e = (d + t1) | 0;
    d = c;
    c = b;
    b = a;
    a = (t1 + t2) | 0;
  }
  h[0] = (h[0]! + a) | 0;
  h[1] = (h[1]! + b) | 0;
  h[2] = (h[2]! + c) | 0;
  h[3] = (h[3]! + d) | 0;
  h[4] = (h[4]! + e) | 0;
  h[5] = (h[5]! + f) | 0;
  h[6] = (h[6]! + g) | 0;
  h[7] = (h[7]! + k) | 0;
}

/**
 * Hashes `message` into `h`, a state that has already taken one 64-byte block (the padded key),
 * pads it and writes the digest to `out`.
 */
function finish(h: Int32Array, message: Uint8Array, out: Uint8Array): void {
  const n = message.length;
  let at = 0;
  for (; at + BLOCK <= n; at += BLOCK) compress(h, message, at);
  const rest = n - at;
  tail.fill(0);
  tail.set(message.subarray(at), 0);
  tail[rest] = 0x80;
  const blocks = rest < BLOCK - 8 ? 1 : 2;
  const end = blocks * BLOCK;
  // The length in bits, key block included, as a 64-bit big-endian number.
  const bits = (BLOCK + n) * 8;
  const hi = Math.floor(bits / 0x1_0000_0000);
  tail[end - 8] = hi >>> 24;
  tail[end - 7] = hi >>> 16;
  tail[end - 6] = hi >>> 8;
  tail[end - 5] = hi;
  tail[end - 4] = bits >>> 24;
  tail[end - 3] = bits >>> 16;
  tail[end - 2] = bits >>> 8;
  tail[end - 1] = bits;
  compress(h, tail, 0);
  if (blocks === 2) compress(h, tail, BLOCK);
  for (let i = 0; i < 8; i++) {
    const v = h[i]!;
    out[4 * i] = v >>> 24;
    out[4 * i + 1] = v >>> 16;
    out[4 * i + 2] = v >>> 8;
    out[4 * i + 3] = v;
  }
}

/** A MAC key with its inner and outer padded blocks already hashed. */
class PreparedKey {
  readonly inner = new Int32Array(INITIAL);
  readonly outer = new Int32Array(INITIAL);

  /** `key`: at most one block (`hmacSha256` hands longer keys to OpenSSL). */
  constructor(key: Uint8Array) {
    const block = new Uint8Array(BLOCK);
    const pad = new Uint8Array(BLOCK);
    block.set(key);
    for (let i = 0; i < BLOCK; i++) pad[i] = block[i]! ^ 0x36;
    compress(this.inner, pad, 0);
    for (let i = 0; i < BLOCK; i++) pad[i] = block[i]! ^ 0x5c;
    compress(this.outer, pad, 0);
  }
}

// Keys are never changed in place (a new key is a new array), so one preparation per array.
const prepared = new WeakMap<Uint8Array, PreparedKey>();

/** HMAC-SHA256 of `message` under `key`, as HMAC_SHA256_BYTES new bytes. */
export function hmacSha256(key: Uint8Array, message: Uint8Array): Uint8Array {
  if (message.length > JS_MAX_BYTES || key.length > BLOCK)
    return createHmac("sha256", key).update(message).digest();
  let p = prepared.get(key);
  if (p === undefined) {
    p = new PreparedKey(key);
    prepared.set(key, p);
  }
  state.set(p.inner);
  finish(state, message, innerDigest);
  state.set(p.outer);
  const out = new Uint8Array(HMAC_SHA256_BYTES);
  finish(state, innerDigest, out);
  return out;
}
