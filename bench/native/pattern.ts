/**
 * Deterministic byte patterns: both sides of a transfer can compute what a
 * region must hold without sending it.
 */
import { createHash } from "node:crypto";

export { prng } from "../../sim/prng.js";

function word(seed: number, index: number): number {
  let x = (Math.imul(index, 0x9e3779b1) ^ seed) >>> 0;
  x = Math.imul(x ^ (x >>> 16), 0x85ebca6b) >>> 0;
  return (x ^ (x >>> 13)) >>> 0;
}

/**
 * Fills `buf` with a pattern derived from `seed` and each byte's absolute
 * offset (`baseOffset` is the offset of buf[0]), so any sub-range can be
 * recomputed on its own.
 */
export function fillPattern(buf: Uint8Array, seed: number, baseOffset = 0): void {
  let i = 0;
  if (buf.byteOffset % 4 === 0 && baseOffset % 4 === 0) {
    // Fast path: whole little-endian words.
    const words = Math.floor(buf.byteLength / 4);
    const view = new Uint32Array(buf.buffer, buf.byteOffset, words);
    const first = baseOffset / 4;
    for (let w = 0; w < words; w++) view[w] = word(seed, first + w);
    i = words * 4;
  }
  for (; i < buf.byteLength; i++) {
    const p = baseOffset + i;
    buf[i] = (word(seed, Math.floor(p / 4)) >>> ((p % 4) * 8)) & 0xff;
  }
}

export function sha256(buf: Uint8Array): string {
  return createHash("sha256").update(buf).digest("hex");
}

/**
 * Random non-overlapping descriptors: `count` pieces of 1..maxLen bytes at
 * random local and remote offsets inside regions of `size` bytes. Destination
 * ranges never overlap, so the expected result is well defined.
 */
export function randomDescriptors(
  rand: () => number,
  size: number,
  count: number,
  maxLen: number,
): Float64Array {
  const slot = Math.floor(size / count);
  if (slot < 1) throw new Error("region too small for that many descriptors");
  const order = Array.from({ length: count }, (_, i) => i);
  for (let i = order.length - 1; i > 0; i--) {
    const j = Math.floor(rand() * (i + 1));
    [order[i], order[j]] = [order[j]!, order[i]!];
  }
  const out = new Float64Array(count * 3);
  for (let i = 0; i < count; i++) {
    const len = 1 + Math.floor(rand() * Math.min(maxLen, slot));
    const remote = i * slot + Math.floor(rand() * (slot - len + 1));
    const localSlot = order[i]!;
    const local = localSlot * slot + Math.floor(rand() * (slot - len + 1));
    out[3 * i] = local;
    out[3 * i + 1] = remote;
    out[3 * i + 2] = len;
  }
  return out;
}

/** Applies descriptors with memcpy semantics: the reference result of a WRITE. */
export function applyDescriptors(
  src: Uint8Array,
  dst: Uint8Array,
  descs: Float64Array,
  srcIsLocal = true,
): void {
  for (let i = 0; i < descs.length; i += 3) {
    const local = descs[i]!;
    const remote = descs[i + 1]!;
    const len = descs[i + 2]!;
    if (srcIsLocal) dst.set(src.subarray(local, local + len), remote);
    else dst.set(src.subarray(remote, remote + len), local);
  }
}
