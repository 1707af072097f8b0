// A reference model of KV memory, written from the layout definition alone (it shares no code
// with src/plan beyond the KvLayout type), so it can catch planner bugs: fill a logical KV tensor
// [layer][k|v][token][head][dim-byte] into P rank memories, apply a plan with plain copies into D
// rank memories, and compare every D byte with what it should be.
import type { KvLayout, TransferPlan } from "../../src/plan/index.js";
import { prng } from "../../sim/prng.js";

/** Small deterministic PRNG (mulberry32) for backgrounds and test layouts. */
export const rng = prng;

/** Global KV heads a rank holds, straight from the definition (vLLM's head split/replication). */
export function headsOf(layout: KvLayout, rank: number): number[] {
  if (layout.mla) return [0];
  const H = layout.totalKvHeads;
  const tp = layout.tpSize;
  if (tp <= H) {
    const per = H / tp;
    return Array.from({ length: per }, (_, i) => rank * per + i);
  }
  return [Math.floor((rank * H) / tp)];
}

/**
 * Byte address of (layer, kv, token, local head index, byte in row) in a rank's region; with run
 * orders (`KvRunOrder`) a row's bytes are not one range, so ask byte by byte.
 */
export function addressOf(
  layout: KvLayout,
  blockIds: ArrayLike<number>,
  layer: number,
  kv: number,
  token: number,
  localHead: number,
  byte: number,
  headsHere: number,
): { region: number; offset: number } {
  const nKv = layout.mla ? 1 : 2;
  const slot = layout.slots[layer * nKv + kv]!;
  const blockIndex = Math.floor(token / layout.blockSize);
  const pos = token % layout.blockSize;
  const block = blockIds[blockIndex]!;
  const rowBytes = layout.headDim * layout.dtypeBytes;
  // Absent or 0 strides are dense in the layout's order: HND [head][token], NHD [token][head].
  const hnd = layout.order === "HND";
  const headStride = layout.headStride || (hnd ? layout.blockSize * rowBytes : rowBytes);
  const tokenStride = layout.tokenStride || (hnd ? rowBytes : headsHere * rowBytes);
  const run = layout.runOrders?.[kv];
  if (run) {
    // A (block, head) run is [dim group][token][dim in group], tokens in tiles whose private
    // order is, here, the tile's elements reversed.
    const e = layout.dtypeBytes;
    const d = Math.floor(byte / e);
    const g = run.dimGroup;
    const u = run.tokenTile;
    const inTile = (pos % u) * g + (d % g);
    const element =
      Math.floor(d / g) * layout.blockSize * g +
      Math.floor(pos / u) * u * g +
      (u > 1 ? u * g - 1 - inTile : inTile);
    return {
      region: slot.region,
      offset:
        slot.offset +
        block * layout.blockStride +
        localHead * headStride +
        element * e +
        (byte % e),
    };
  }
  return {
    region: slot.region,
    offset:
      slot.offset + block * layout.blockStride + localHead * headStride + pos * tokenStride + byte,
  };
}

/** Writes one row's bytes (`byteOf(b)`) where a layout keeps them: per byte when runs reorder. */
function writeRow(
  mem: RankMemory,
  layout: KvLayout,
  blockIds: ArrayLike<number>,
  coords: [layer: number, kv: number, token: number, localHead: number],
  headsHere: number,
  byteOf: (b: number) => number,
) {
  const [l, kv, t, lh] = coords;
  const rowBytes = layout.headDim * layout.dtypeBytes;
  if (layout.runOrders?.[kv]) {
    for (let b = 0; b < rowBytes; b++) {
      const a = addressOf(layout, blockIds, l, kv, t, lh, b, headsHere);
      mem[a.region]![a.offset] = byteOf(b);
    }
    return;
  }
  const a = addressOf(layout, blockIds, l, kv, t, lh, 0, headsHere);
  for (let b = 0; b < rowBytes; b++) mem[a.region]![a.offset + b] = byteOf(b);
}

/** The byte the logical tensor holds at these coordinates (a 32-bit mix, low byte). */
export function kvByte(layer: number, kv: number, token: number, head: number, byte: number) {
  let h = 0x9e3779b1 ^ layer;
  h = Math.imul(h ^ (h >>> 15), 0x85ebca6b) ^ kv;
  h = Math.imul(h ^ (h >>> 13), 0xc2b2ae35) ^ token;
  h = Math.imul(h ^ (h >>> 16), 0x27d4eb2f) ^ head;
  h = Math.imul(h ^ (h >>> 15), 0x165667b1) ^ byte;
  h = Math.imul(h ^ (h >>> 13), 0x85ebca6b);
  return (h ^ (h >>> 16)) & 0xff;
}

export type RankMemory = Uint8Array[];

function noise(layout: KvLayout, seed: number): RankMemory {
  const next = rng(seed);
  return layout.regionBytes.map((n) => {
    const m = new Uint8Array(n);
    for (let i = 0; i < n; i++) m[i] = (next() * 256) | 0;
    return m;
  });
}

/** Visits every (layer, kv, token, local head) row a rank holds for tokens [from, to). */
function forEachRow(
  layout: KvLayout,
  rank: number,
  from: number,
  to: number,
  fn: (layer: number, kv: number, t: number, localHead: number, head: number) => void,
) {
  const heads = headsOf(layout, rank);
  const nKv = layout.mla ? 1 : 2;
  for (let l = 0; l < layout.numLayers; l++)
    for (let kv = 0; kv < nKv; kv++)
      for (let t = from; t < to; t++)
        for (let h = 0; h < heads.length; h++) fn(l, kv, t, h, heads[h]!);
}

/** P rank memories: noise, with every token of the request written at its place. */
export function prefillMemories(
  src: KvLayout,
  srcBlockIds: ArrayLike<number>,
  numTokens: number,
  seed: number,
): RankMemory[] {
  const mems: RankMemory[] = [];
  for (let q = 0; q < src.tpSize; q++) {
    const mem = noise(src, seed + q);
    const nHeads = headsOf(src, q).length;
    forEachRow(src, q, 0, numTokens, (l, kv, t, lh, g) => {
      writeRow(mem, src, srcBlockIds, [l, kv, t, lh], nHeads, (b) => kvByte(l, kv, t, g, b));
    });
    mems.push(mem);
  }
  return mems;
}

/** D rank memories before the transfer (noise), and what they must hold after it. */
export function decodeMemories(
  dst: KvLayout,
  dstBlockIds: ArrayLike<number>,
  numTokens: number,
  prefixTokens: number,
  seed: number,
): { before: RankMemory[]; expected: RankMemory[]; bytesPerRank: number[] } {
  const before: RankMemory[] = [];
  const expected: RankMemory[] = [];
  const bytesPerRank: number[] = [];
  for (let r = 0; r < dst.tpSize; r++) {
    const mem = noise(dst, seed + 1000 + r);
    const exp = mem.map((m) => m.slice());
    const nHeads = headsOf(dst, r).length;
    let n = 0;
    const rowBytes = dst.headDim * dst.dtypeBytes;
    forEachRow(dst, r, prefixTokens, numTokens, (l, kv, t, lh, g) => {
      writeRow(exp, dst, dstBlockIds, [l, kv, t, lh], nHeads, (b) => kvByte(l, kv, t, g, b));
      n += rowBytes;
    });
    before.push(mem);
    expected.push(exp);
    bytesPerRank.push(n);
  }
  return { before, expected, bytesPerRank };
}

/**
 * Applies a plan with plain copies (as push would), checking every descriptor's bounds.
 * Returns bytes written per D rank.
 */
export function applyPlan(plan: TransferPlan, srcMem: RankMemory[], dstMem: RankMemory[]) {
  const written = dstMem.map(() => 0);
  for (const pair of plan.pairs) {
    let pairBytes = 0;
    let pairCount = 0;
    for (const rp of pair.regionPairs) {
      const from = srcMem[pair.srcRank]![rp.srcRegion];
      const to = dstMem[pair.dstRank]![rp.dstRegion];
      if (!from || !to) throw new Error(`pair ${pair.srcRank}->${pair.dstRank}: bad region pair`);
      const d = rp.descriptors;
      if (d.length !== 3 * rp.count) throw new Error("descriptor array length is not 3 x count");
      let rpBytes = 0;
      for (let i = 0; i < d.length; i += 3) {
        const so = d[i]!;
        const dOff = d[i + 1]!;
        const len = d[i + 2]!;
        if (
          !(len > 0) ||
          !Number.isInteger(so) ||
          !Number.isInteger(dOff) ||
          !Number.isInteger(len)
        )
          throw new Error(`bad descriptor ${so},${dOff},${len}`);
        if (so < 0 || so + len > from.length) throw new Error(`src out of bounds ${so}+${len}`);
        if (dOff < 0 || dOff + len > to.length) throw new Error(`dst out of bounds ${dOff}+${len}`);
        to.set(from.subarray(so, so + len), dOff);
        rpBytes += len;
      }
      if (rpBytes !== rp.bytes) throw new Error(`region pair bytes ${rp.bytes} != ${rpBytes}`);
      pairBytes += rpBytes;
      pairCount += rp.count;
    }
    if (pairBytes !== pair.bytes) throw new Error(`pair bytes ${pair.bytes} != ${pairBytes}`);
    if (pairCount !== pair.descriptorCount) throw new Error("pair descriptorCount mismatch");
    written[pair.dstRank]! += pairBytes;
  }
  return written;
}

/** First differing byte between D memories and the expectation, described, or undefined. */
export function firstDifference(actual: RankMemory[], expected: RankMemory[]): string | undefined {
  for (let r = 0; r < expected.length; r++) {
    for (let g = 0; g < expected[r]!.length; g++) {
      const a = actual[r]![g]!;
      const e = expected[r]![g]!;
      if (Buffer.compare(a, e) === 0) continue;
      for (let i = 0; i < e.length; i++) {
        if (a[i] !== e[i]) return `D rank ${r} region ${g} byte ${i}: got ${a[i]}, want ${e[i]}`;
      }
    }
  }
  return undefined;
}
