import { type KvLayout, type KvRunOrder, headStride } from "./layout.js";
import { tokenStride } from "./layout.js";
import type { HeadSource } from "./ranks.js";
import type { Chunks } from "./request.js";

/** `walks` bits: the box is one byte range walked heads outer / tokens outer. */
const HEADS_OUTER = 1;
const TOKENS_OUTER = 2;

/**
 * How `hn` heads × `tn` tokens of one block, rows `hs` and `ts` bytes apart, form one contiguous
 * byte range: `HEADS_OUTER`, `TOKENS_OUTER`, both (one head or one token: one walk only), or 0
 * (not contiguous). A copy may cover a box only when both sides have a walk in common: the same
 * bytes in the same order.
 */
function walks(hs: number, ts: number, row: number, hn: number, tn: number): number {
  if (hn === 1) return tn === 1 || ts === row ? HEADS_OUTER | TOKENS_OUTER : 0;
  if (tn === 1) return hs === row ? HEADS_OUTER | TOKENS_OUTER : 0;
  if (ts === row && hs === tn * row) return HEADS_OUTER;
  if (hs === row && ts === hn * row) return TOKENS_OUTER;
  return 0;
}

/**
 * The copies of one rank pair for one slot, as offsets relative to the slot's start
 * (`blockId * blockStride + position in block`); adding a slot's offsets places them.
 */
export class RelativePieces {
  src: Float64Array;
  dst: Float64Array;
  len: Float64Array;
  n = 0;
  raw = 0;
  bytes = 0;
  /** Index of the first piece of each chunk, plus the end; used when slots are interleaved. */
  readonly chunkStart: Int32Array;

  constructor(capacity: number, chunks: number) {
    this.src = new Float64Array(Math.max(capacity, 1));
    this.dst = new Float64Array(Math.max(capacity, 1));
    this.len = new Float64Array(Math.max(capacity, 1));
    this.chunkStart = new Int32Array(chunks + 1);
  }

  add(src: number, dst: number, len: number, merge: boolean): void {
    this.raw++;
    this.bytes += len;
    const j = this.n - 1;
    if (
      merge &&
      j >= 0 &&
      this.src[j]! + this.len[j]! === src &&
      this.dst[j]! + this.len[j]! === dst
    ) {
      this.len[j]! += len;
      return;
    }
    if (this.n === this.src.length) {
      const grow = (a: Float64Array) => {
        const b = new Float64Array(a.length * 2);
        b.set(a);
        return b;
      };
      this.src = grow(this.src);
      this.dst = grow(this.dst);
      this.len = grow(this.len);
    }
    this.src[this.n] = src;
    this.dst[this.n] = dst;
    this.len[this.n] = len;
    this.n++;
  }
}

export function relativePieces(
  src: KvLayout,
  dst: KvLayout,
  chunks: Chunks,
  sources: readonly HeadSource[],
  coalesce: boolean,
  acrossChunks: boolean,
  row: number,
): RelativePieces {
  const sHs = headStride(src);
  const sTs = tokenStride(src);
  const dHs = headStride(dst);
  const dTs = tokenStride(dst);
  // Row by row, walk P's memory order (tokens outer for NHD), so rows of K and V interleaved per
  // row follow each other on both sides when D is laid out the same.
  const tokensOuter = src.order === "NHD";
  const out = new RelativePieces(chunks.n * sources.length, chunks.n);
  for (let c = 0; c < chunks.n; c++) {
    out.chunkStart[c] = out.n;
    const L = chunks.len[c]!;
    const p0 = chunks.srcPos[c]!;
    const d0 = chunks.dstPos[c]!;
    const sBase = chunks.srcBlock[c]! * src.blockStride;
    const dBase = chunks.dstBlock[c]! * dst.blockStride;
    for (let si = 0; si < sources.length; si++) {
      const s = sources[si]!;
      const n = s.numHeads;
      const a = s.srcHeadOffset;
      const b = s.dstHeadOffset;
      let hn: number;
      let tn: number;
      // The whole box, else one head or one token at a time, else row by row: each piece must be
      // one byte range on both sides, walked in the same order.
      if ((walks(sHs, sTs, row, n, L) & walks(dHs, dTs, row, n, L)) !== 0) {
        hn = n;
        tn = L;
      } else {
        const byHead = L === 1 || (sTs === row && dTs === row);
        const byToken = n === 1 || (sHs === row && dHs === row);
        if (byHead && (!byToken || n <= L)) {
          hn = 1;
          tn = L;
        } else if (byToken) {
          hn = n;
          tn = 1;
        } else {
          hn = 1;
          tn = 1;
        }
      }
      const len = hn * tn * row;
      const sStart = sBase + a * sHs + p0 * sTs;
      const dStart = dBase + b * dHs + d0 * dTs;
      const start = out.chunkStart[c]!;
      if (tokensOuter && hn < n && tn < L) {
        for (let t = 0; t < L; t++) {
          for (let h = 0; h < n; h++) {
            const merge = coalesce && (acrossChunks || out.n > start);
            out.add(sStart + h * sHs + t * sTs, dStart + h * dHs + t * dTs, len, merge);
          }
        }
      } else {
        for (let h = 0; h < n; h += hn) {
          for (let t = 0; t < L; t += tn) {
            const merge = coalesce && (acrossChunks || out.n > start);
            out.add(sStart + h * sHs + t * sTs, dStart + h * dHs + t * dTs, len, merge);
          }
        }
      }
    }
  }
  out.chunkStart[chunks.n] = out.n;
  return out;
}

/**
 * The copies of one rank pair for slots whose (block, head) runs are in run order `order`
 * (`KvRunOrder`; both sides dense HND, one order, checked by the pairing): per chunk, head and
 * group of dims, one byte range of the chunk's tokens, which stays one range in any block size.
 * Coalescing joins a group's range with the next when both sides continue (whole runs of
 * consecutive heads when the blocks match).
 */
export function runOrderPieces(
  src: KvLayout,
  dst: KvLayout,
  chunks: Chunks,
  sources: readonly HeadSource[],
  coalesce: boolean,
  order: KvRunOrder,
): RelativePieces {
  const sHs = headStride(src);
  const dHs = headStride(dst);
  const cell = order.dimGroup * src.dtypeBytes;
  const groups = src.headDim / order.dimGroup;
  const sGroup = src.blockSize * cell;
  const dGroup = dst.blockSize * cell;
  let heads = 0;
  for (const s of sources) heads += s.numHeads;
  const out = new RelativePieces(chunks.n * heads * groups, chunks.n);
  for (let c = 0; c < chunks.n; c++) {
    out.chunkStart[c] = out.n;
    const len = chunks.len[c]! * cell;
    const sBase = chunks.srcBlock[c]! * src.blockStride + chunks.srcPos[c]! * cell;
    const dBase = chunks.dstBlock[c]! * dst.blockStride + chunks.dstPos[c]! * cell;
    for (const s of sources) {
      for (let h = 0; h < s.numHeads; h++) {
        const sHead = sBase + (s.srcHeadOffset + h) * sHs;
        const dHead = dBase + (s.dstHeadOffset + h) * dHs;
        for (let g = 0; g < groups; g++) {
          out.add(sHead + g * sGroup, dHead + g * dGroup, len, coalesce);
        }
      }
    }
  }
  out.chunkStart[chunks.n] = out.n;
  return out;
}
