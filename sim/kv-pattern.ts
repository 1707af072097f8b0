/**
 * Deterministic KV content for simulated engines. Every byte of (layer, K|V, token, global head,
 * byte of the head's row) of a transfer has a value derived from those coordinates and a hash of
 * the transfer id, so P can write it, D can check it, and neither has to send it. A byte that
 * landed in the wrong token, head, layer or K|V, or came from another transfer, does not match.
 *
 * Work is done one row (`headDim * dtypeBytes` bytes: one head of one token) at a time: a
 * per-row seed, then 32-bit words from (seed, word index), written as whole words when the row
 * is 4-byte aligned, so a Llama-3-8B token (128 KiB) takes well under a millisecond.
 */
import { endianness } from "node:os";

import {
  type KvLayout,
  firstKvHeadOfRank,
  headStride,
  kvHeadsPerRank,
  kvPerLayer,
  kvRowBytes,
  tokenStride,
} from "../src/plan/index.js";

export interface KvCheck {
  /** Bytes compared. */
  checkedBytes: number;
  /** Bytes that differ from the pattern. */
  mismatches: number;
  /** The first differing byte, described with its coordinates. */
  first?: string;
}

/** A 32-bit hash of a transfer id (FNV-1a over UTF-8, then mixed). */
export function transferSeed(transferId: string): number {
  const bytes = Buffer.from(transferId, "utf8");
  let h = 0x811c9dc5;
  for (const b of bytes) h = Math.imul(h ^ b, 0x01000193);
  return fmix(h);
}

function fmix(x: number): number {
  x = Math.imul(x ^ (x >>> 16), 0x85ebca6b);
  x = Math.imul(x ^ (x >>> 13), 0xc2b2ae35);
  return (x ^ (x >>> 16)) >>> 0;
}

/** The seed of one row: one head of one token of one (layer, K|V). */
export function rowSeed(
  seed: number,
  layer: number,
  kv: number,
  token: number,
  head: number,
): number {
  let h = fmix(seed ^ Math.imul(layer + 1, 0x9e3779b1));
  h = fmix(h ^ Math.imul(kv + 1, 0x7feb352d));
  h = fmix(h ^ Math.imul(token + 1, 0x846ca68b));
  return fmix(h ^ Math.imul(head + 1, 0x2c1b3c6d));
}

/** Word `i` of a row. */
function rowWord(seed: number, i: number): number {
  let x = (Math.imul(i, 0x9e3779b1) ^ seed) >>> 0;
  x = Math.imul(x ^ (x >>> 16), 0x85ebca6b);
  return (x ^ (x >>> 13)) >>> 0;
}

/** The pattern byte at `byte` of the row with seed `seed` (little-endian words). */
function rowByte(seed: number, byte: number): number {
  return (rowWord(seed, byte >>> 2) >>> ((byte & 3) * 8)) & 0xff;
}

/** The pattern value of one byte, from its coordinates (for tests and diagnostics). */
export function kvPatternByte(
  transferId: string,
  layer: number,
  kv: number,
  token: number,
  head: number,
  byte: number,
): number {
  return rowByte(rowSeed(transferSeed(transferId), layer, kv, token, head), byte);
}

const LITTLE_ENDIAN = endianness() === "LE";

interface Row {
  region: Uint8Array;
  regionIndex: number;
  offset: number;
  seed: number;
  layer: number;
  kv: number;
  token: number;
  head: number;
}

/**
 * Visits every row of tokens [fromToken, toToken) a rank holds, checking the block table and
 * the regions first (RangeError when they cannot hold the request).
 */
function forEachRow(
  layout: KvLayout,
  rank: number,
  regions: readonly Uint8Array[],
  transferId: string,
  blockIds: ArrayLike<number>,
  fromToken: number,
  toToken: number,
  visit: (row: Row) => boolean | void,
): void {
  if (!Number.isInteger(rank) || rank < 0 || rank >= layout.tpSize) {
    throw new RangeError(`rank ${rank} is not within 0..${layout.tpSize - 1}`);
  }
  if (!Number.isInteger(fromToken) || !Number.isInteger(toToken) || fromToken < 0) {
    throw new RangeError(`token range ${fromToken}..${toToken} is not a range of integers >= 0`);
  }
  if (toToken <= fromToken) return;
  const bs = layout.blockSize;
  const needBlocks = Math.ceil(toToken / bs);
  if (blockIds.length < needBlocks) {
    throw new RangeError(
      `block table has ${blockIds.length} ids, tokens up to ${toToken} need ${needBlocks}`,
    );
  }
  for (let i = Math.floor(fromToken / bs); i < needBlocks; i++) {
    const b = blockIds[i]!;
    if (!Number.isInteger(b) || b < 0 || b >= layout.numBlocks) {
      throw new RangeError(`block id ${b} (entry ${i}) is not within 0..${layout.numBlocks - 1}`);
    }
  }
  if (regions.length < layout.regionBytes.length) {
    throw new RangeError(
      `${regions.length} regions given, the layout has ${layout.regionBytes.length}`,
    );
  }
  layout.regionBytes.forEach((n, g) => {
    if (regions[g]!.length < n) {
      throw new RangeError(`region ${g} has ${regions[g]!.length} bytes, the layout needs ${n}`);
    }
  });

  const seed = transferSeed(transferId);
  const nKv = kvPerLayer(layout);
  const heads = kvHeadsPerRank(layout);
  const firstHead = firstKvHeadOfRank(layout, rank);
  const hs = headStride(layout);
  const ts = tokenStride(layout);
  const row: Row = {
    region: regions[0]!,
    regionIndex: 0,
    offset: 0,
    seed: 0,
    layer: 0,
    kv: 0,
    token: 0,
    head: 0,
  };
  for (let layer = 0; layer < layout.numLayers; layer++) {
    for (let kv = 0; kv < nKv; kv++) {
      const slot = layout.slots[layer * nKv + kv]!;
      row.region = regions[slot.region]!;
      row.regionIndex = slot.region;
      row.layer = layer;
      row.kv = kv;
      for (let t = fromToken; t < toToken; t++) {
        const tokenBase =
          slot.offset + blockIds[Math.floor(t / bs)]! * layout.blockStride + (t % bs) * ts;
        row.token = t;
        for (let h = 0; h < heads; h++) {
          row.offset = tokenBase + h * hs;
          row.head = firstHead + h;
          row.seed = rowSeed(seed, layer, kv, t, row.head);
          if (visit(row) === false) return;
        }
      }
    }
  }
}

/** Whole-word views of each region (undefined where a region is not 4-byte aligned). */
function wordViews(regions: readonly Uint8Array[]): (Uint32Array | undefined)[] {
  return regions.map((r) =>
    LITTLE_ENDIAN && r.byteOffset % 4 === 0
      ? new Uint32Array(r.buffer, r.byteOffset, Math.floor(r.length / 4))
      : undefined,
  );
}

/** The index of the row's first word in its region's word view, or -1 when it is unaligned. */
function firstWord(views: (Uint32Array | undefined)[], row: Row, rowBytes: number): number {
  if (rowBytes % 4 !== 0 || row.offset % 4 !== 0 || views[row.regionIndex] === undefined) return -1;
  return row.offset / 4;
}

/**
 * Writes the pattern of `transferId` for tokens [fromToken, toToken) into one rank's memory
 * (`regions[g]` is region `g` of the layout), through the request's block table `blockIds`;
 * only layers [layerFrom, layerTo) when given (a layer-wise prefill saves one at a time).
 */
export function fillKv(
  layout: KvLayout,
  rank: number,
  regions: readonly Uint8Array[],
  transferId: string,
  blockIds: ArrayLike<number>,
  fromToken: number,
  toToken: number,
  layerFrom = 0,
  layerTo = layout.numLayers,
): void {
  const rowBytes = kvRowBytes(layout);
  const nWords = rowBytes / 4;
  const views = wordViews(regions);
  forEachRow(layout, rank, regions, transferId, blockIds, fromToken, toToken, (row) => {
    if (row.layer < layerFrom || row.layer >= layerTo) return;
    const seed = row.seed;
    const w0 = firstWord(views, row, rowBytes);
    if (w0 >= 0) {
      const words = views[row.regionIndex]!;
      for (let i = 0; i < nWords; i++) words[w0 + i] = rowWord(seed, i);
      return;
    }
    const r = row.region;
    const o = row.offset;
    for (let j = 0; j < rowBytes; j++) r[o + j] = rowByte(seed, j);
  });
}

/**
 * Compares one rank's memory with the pattern of `transferId` for tokens [fromToken, toToken).
 * Every byte is checked; `first` describes the first mismatch.
 */
export function verifyKv(
  layout: KvLayout,
  rank: number,
  regions: readonly Uint8Array[],
  transferId: string,
  blockIds: ArrayLike<number>,
  fromToken: number,
  toToken: number,
): KvCheck {
  const rowBytes = kvRowBytes(layout);
  const out: KvCheck = { checkedBytes: 0, mismatches: 0 };
  const mismatchAt = (row: Row, j: number, got: number, want: number): void => {
    out.mismatches++;
    if (out.first === undefined) {
      out.first =
        `rank ${rank} layer ${row.layer} ${layout.mla ? "latent" : row.kv === 0 ? "K" : "V"} ` +
        `token ${row.token} head ${row.head} byte ${j} (region ${row.regionIndex} offset ` +
        `${row.offset + j}): got ${got}, want ${want}`;
    }
  };
  const nWords = rowBytes / 4;
  const views = wordViews(regions);
  forEachRow(layout, rank, regions, transferId, blockIds, fromToken, toToken, (row) => {
    const seed = row.seed;
    const w0 = firstWord(views, row, rowBytes);
    const r = row.region;
    const o = row.offset;
    if (w0 >= 0) {
      const words = views[row.regionIndex]!;
      for (let i = 0; i < nWords; i++) {
        const want = rowWord(seed, i);
        if (words[w0 + i] !== want) {
          for (let k = 0; k < 4; k++) {
            const j = i * 4 + k;
            const w = (want >>> (k * 8)) & 0xff;
            if (r[o + j] !== w) mismatchAt(row, j, r[o + j]!, w);
          }
        }
      }
    } else {
      for (let j = 0; j < rowBytes; j++) {
        const w = rowByte(seed, j);
        if (r[o + j] !== w) mismatchAt(row, j, r[o + j]!, w);
      }
    }
    out.checkedBytes += rowBytes;
  });
  return out;
}
