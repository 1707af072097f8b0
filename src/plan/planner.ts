import { assertCompatible } from "./compat.js";
import { PlanError } from "./errors.js";
import {
  type KvLayout,
  headStride,
  kvBlockFootprint,
  kvPerLayer,
  kvRowBytes,
  tokenStride,
} from "./layout.js";
import { type DstRankSources, type HeadSource, mapRanks } from "./ranks.js";

/** One request: which tokens move and where they live on each side. */
export interface PlanRequest {
  /** Tokens of the request held by P (prompt length). */
  readonly numTokens: number;
  /** Tokens `0 .. prefixTokens - 1` are already on D and do not move; need not be block-aligned. */
  readonly prefixTokens?: number;
  /**
   * P's block table for the request: entry `i` holds tokens `i * P.blockSize ..`. Entries for
   * blocks wholly inside the prefix are not read; entries past the last token are ignored.
   */
  readonly srcBlockIds: ArrayLike<number>;
  /** D's block table, the same way round with D's block size. */
  readonly dstBlockIds: ArrayLike<number>;
}

export interface PlanOptions {
  /** Plan only these P ranks (default: all). */
  readonly srcRanks?: readonly number[];
  /** Plan only these D ranks (default: all). */
  readonly dstRanks?: readonly number[];
  /** Merge adjacent copies (default true). Off only to inspect the raw pieces. */
  readonly coalesce?: boolean;
}

/** The copies between one P region and one D region of one rank pair. */
export interface RegionPairDescriptors {
  readonly srcRegion: number;
  readonly dstRegion: number;
  /**
   * `(srcOffset, dstOffset, length)` triples, byte offsets relative to the start of each region;
   * `descriptors.length === 3 * count`. Push posts them as (local, remote, length) as they are;
   * pull swaps the first two (see `descriptorsForSide`).
   */
  readonly descriptors: Float64Array;
  readonly count: number;
  readonly bytes: number;
}

/** Everything one P rank sends to one D rank. */
export interface RankPairPlan {
  readonly srcRank: number;
  readonly dstRank: number;
  /** Bytes the pair moves; 0 when the prefix covers every token (the pair still exists). */
  readonly bytes: number;
  /** Descriptors after coalescing, over all region pairs. */
  readonly descriptorCount: number;
  /** Copies before coalescing (a row of K and its row of V side by side on both sides count once). */
  readonly rawDescriptorCount: number;
  /** In order of first use by slot (layer, K|V). */
  readonly regionPairs: readonly RegionPairDescriptors[];
}

/** The copies of one request, for every (P rank, D rank) pair that shares heads. */
export interface TransferPlan {
  readonly numTokens: number;
  readonly prefixTokens: number;
  /** Ordered by D rank, then P rank. */
  readonly pairs: readonly RankPairPlan[];
  readonly bytes: number;
  readonly descriptorCount: number;
  readonly rawDescriptorCount: number;
}

function requestError(field: string, message: string): PlanError {
  return new PlanError("ERR_PLAN_INVALID", field, message);
}

/**
 * A growable list of `(src, dst, len)` triples that merges a copy into the previous one when it
 * continues it on both sides. Sized up front from an upper bound, so it rarely grows.
 */
class DescriptorList {
  data: Float64Array;
  count = 0;
  bytes = 0;
  private srcEnd = -1;
  private dstEnd = -1;

  constructor(
    readonly srcRegion: number,
    readonly dstRegion: number,
    capacity: number,
    private readonly coalesce: boolean,
  ) {
    this.data = new Float64Array(3 * Math.max(capacity, 1));
  }

  /**
   * Appends pieces `from .. to - 1` of `ps`/`pd`/`pl` shifted by `srcBase`/`dstBase`. One call
   * per run of pieces keeps the hot loop on locals.
   */
  append(
    srcBase: number,
    dstBase: number,
    ps: Float64Array,
    pd: Float64Array,
    pl: Float64Array,
    from: number,
    to: number,
  ): void {
    this.reserve(to - from);
    const d = this.data;
    const merge = this.coalesce;
    let j = 3 * this.count;
    let srcEnd = this.srcEnd;
    let dstEnd = this.dstEnd;
    let bytes = 0;
    for (let i = from; i < to; i++) {
      const src = srcBase + ps[i]!;
      const dst = dstBase + pd[i]!;
      const len = pl[i]!;
      bytes += len;
      if (merge && src === srcEnd && dst === dstEnd) {
        d[j - 1]! += len;
      } else {
        d[j] = src;
        d[j + 1] = dst;
        d[j + 2] = len;
        j += 3;
      }
      srcEnd = src + len;
      dstEnd = dst + len;
    }
    this.count = j / 3;
    this.srcEnd = srcEnd;
    this.dstEnd = dstEnd;
    this.bytes += bytes;
  }

  /**
   * Appends pieces `0 .. n - 1` for two slots at once, piece by piece: `a`'s piece `i`, then
   * `b`'s, then `a`'s piece `i + 1`. For K and V whose rows interleave inside a block (vLLM's CPU
   * layout: a head's K rows, then its V rows; fused cells: a row of K, then its row of V), that
   * is address order, so a whole block of both becomes one copy instead of one per head or row.
   */
  appendPaired(
    aSrc: number,
    aDst: number,
    bSrc: number,
    bDst: number,
    ps: Float64Array,
    pd: Float64Array,
    pl: Float64Array,
    n: number,
  ): void {
    this.reserve(2 * n);
    const d = this.data;
    const merge = this.coalesce;
    let j = 3 * this.count;
    let srcEnd = this.srcEnd;
    let dstEnd = this.dstEnd;
    let bytes = 0;
    for (let i = 0; i < n; i++) {
      const len = pl[i]!;
      bytes += 2 * len;
      for (let k = 0; k < 2; k++) {
        const src = (k === 0 ? aSrc : bSrc) + ps[i]!;
        const dst = (k === 0 ? aDst : bDst) + pd[i]!;
        if (merge && src === srcEnd && dst === dstEnd) {
          d[j - 1]! += len;
        } else {
          d[j] = src;
          d[j + 1] = dst;
          d[j + 2] = len;
          j += 3;
        }
        srcEnd = src + len;
        dstEnd = dst + len;
      }
    }
    this.count = j / 3;
    this.srcEnd = srcEnd;
    this.dstEnd = dstEnd;
    this.bytes += bytes;
  }

  /**
   * Appends every chunk's pieces for every slot, chunk by chunk (`[block][slot]` order), for
   * layouts whose blocks hold all slots back to back: the one list of such a pair.
   */
  appendInterleaved(
    srcOff: Float64Array,
    dstOff: Float64Array,
    ps: Float64Array,
    pd: Float64Array,
    pl: Float64Array,
    chunkStart: Int32Array,
    chunks: number,
  ): void {
    const nSlots = srcOff.length;
    // The merge loop of `append`, inlined on purpose: calling `append` per (chunk, slot) made the
    // 128k-token cross-layer plan about 40% slower (51 -> 70-84 ms in bench/plan).
    const merge = this.coalesce;
    let srcEnd = this.srcEnd;
    let dstEnd = this.dstEnd;
    let bytes = 0;
    for (let c = 0; c < chunks; c++) {
      const from = chunkStart[c]!;
      const to = chunkStart[c + 1]!;
      this.reserve((to - from) * nSlots);
      const d = this.data;
      let j = 3 * this.count;
      for (let s = 0; s < nSlots; s++) {
        const so = srcOff[s]!;
        const dOff = dstOff[s]!;
        for (let i = from; i < to; i++) {
          const src = so + ps[i]!;
          const dst = dOff + pd[i]!;
          const len = pl[i]!;
          bytes += len;
          if (merge && src === srcEnd && dst === dstEnd) {
            d[j - 1]! += len;
          } else {
            d[j] = src;
            d[j + 1] = dst;
            d[j + 2] = len;
            j += 3;
          }
          srcEnd = src + len;
          dstEnd = dst + len;
        }
      }
      this.count = j / 3;
    }
    this.srcEnd = srcEnd;
    this.dstEnd = dstEnd;
    this.bytes += bytes;
  }

  /** Makes room for `extra` more triples. */
  private reserve(extra: number): void {
    const need = 3 * (this.count + extra);
    if (need > this.data.length) {
      const grown = new Float64Array(Math.max(2 * this.data.length, need));
      grown.set(this.data.subarray(0, 3 * this.count));
      this.data = grown;
    }
  }

  finish(): RegionPairDescriptors {
    const n = 3 * this.count;
    return {
      srcRegion: this.srcRegion,
      dstRegion: this.dstRegion,
      descriptors: n === this.data.length ? this.data : this.data.slice(0, n),
      count: this.count,
      bytes: this.bytes,
    };
  }
}

/**
 * Token ranges `[t, t + len)` that stay inside one P block and one D block, from the first token
 * that moves to the last: the unit every copy is cut from.
 */
interface Chunks {
  readonly n: number;
  readonly srcBlock: Float64Array;
  readonly srcPos: Int32Array;
  readonly dstBlock: Float64Array;
  readonly dstPos: Int32Array;
  readonly len: Int32Array;
}

function readBlockId(ids: ArrayLike<number>, i: number, layout: KvLayout, field: string): number {
  const id = ids[i];
  if (typeof id !== "number" || !Number.isInteger(id) || id < 0 || id >= layout.numBlocks) {
    throw requestError(
      field,
      `${field}[${i}] = ${String(id)} is not a block id below numBlocks ${layout.numBlocks}`,
    );
  }
  return id;
}

function buildChunks(src: KvLayout, dst: KvLayout, req: PlanRequest, first: number): Chunks {
  // Opaque blocks move whole: the last block's tail past the last token goes with it.
  const last =
    src.opaqueBlocks === true && first < req.numTokens
      ? Math.ceil(req.numTokens / src.blockSize) * src.blockSize
      : req.numTokens;
  const bp = src.blockSize;
  const bd = dst.blockSize;
  // A chunk ends at a P or D block boundary or the last token, so there are at most this many.
  const max =
    Math.ceil(last / bp) - Math.floor(first / bp) + Math.ceil(last / bd) - Math.floor(first / bd);
  const c: Chunks = {
    n: 0,
    srcBlock: new Float64Array(max),
    srcPos: new Int32Array(max),
    dstBlock: new Float64Array(max),
    dstPos: new Int32Array(max),
    len: new Int32Array(max),
  };
  // D blocks written twice would mix two token ranges; reading a P block twice is harmless.
  const seen = new Uint8Array(dst.numBlocks);
  let n = 0;
  let t = first;
  let lastDstIndex = -1;
  let srcId = 0;
  let dstId = 0;
  let lastSrcIndex = -1;
  while (t < last) {
    const pi = Math.floor(t / bp);
    const pp = t - pi * bp;
    const di = Math.floor(t / bd);
    const dp = t - di * bd;
    if (pi !== lastSrcIndex) {
      srcId = readBlockId(req.srcBlockIds, pi, src, "srcBlockIds");
      lastSrcIndex = pi;
    }
    if (di !== lastDstIndex) {
      dstId = readBlockId(req.dstBlockIds, di, dst, "dstBlockIds");
      if (seen[dstId]) {
        throw requestError("dstBlockIds", `dstBlockIds lists block ${dstId} twice`);
      }
      seen[dstId] = 1;
      lastDstIndex = di;
    }
    const len = Math.min(last - t, bp - pp, bd - dp);
    c.srcBlock[n] = srcId;
    c.srcPos[n] = pp;
    c.dstBlock[n] = dstId;
    c.dstPos[n] = dp;
    c.len[n] = len;
    n++;
    t += len;
  }
  return { ...c, n };
}

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
class RelativePieces {
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

function relativePieces(
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
 * Whether every block of a layout holds all slots back to back in slot order
 * (`[block][layer][K|V]` in one region). When both sides are like that, copies are issued block
 * by block across slots, so a whole block (and a run of blocks) becomes one descriptor.
 */
function slotsInterleaved(layout: KvLayout): boolean {
  const bb = kvBlockFootprint(layout);
  const slots = layout.slots;
  if (layout.blockStride !== slots.length * bb && layout.numBlocks > 1) return false;
  for (let s = 1; s < slots.length; s++) {
    if (slots[s]!.region !== slots[0]!.region) return false;
    if (slots[s]!.offset !== slots[s - 1]!.offset + bb) return false;
  }
  return true;
}

/**
 * Whether each layer's V row directly follows its K row (V at K's offset + one row in the same
 * region): fused cells. When both sides are like that, a layer's K and V are planned as one slot
 * of rows twice as wide, so a fused block is one piece instead of one per (head, token, K|V).
 */
function kvRowsAdjacent(layout: KvLayout): boolean {
  if (layout.mla) return false;
  const row = kvRowBytes(layout);
  const slots = layout.slots;
  for (let s = 0; s + 1 < slots.length; s += 2) {
    const k = slots[s]!;
    const v = slots[s + 1]!;
    if (k.region !== v.region || v.offset !== k.offset + row) return false;
  }
  return true;
}

/**
 * Whether each layer's K and V share a region and their rows interleave inside a block (V starts
 * within K's block footprint: vLLM's CPU layout, fused cells). When both sides are like that, K
 * and V are issued piece by piece together (`appendPaired`).
 */
function kvRowsInterleaved(layout: KvLayout): boolean {
  if (layout.mla) return false;
  const fp = kvBlockFootprint(layout);
  const slots = layout.slots;
  for (let s = 0; s + 1 < slots.length; s += 2) {
    const k = slots[s]!;
    const v = slots[s + 1]!;
    if (k.region !== v.region || Math.abs(v.offset - k.offset) >= fp) return false;
  }
  return true;
}

function checkRequest(src: KvLayout, dst: KvLayout, req: PlanRequest): number {
  const n = req.numTokens;
  if (!Number.isSafeInteger(n) || n < 0) {
    throw requestError("numTokens", `numTokens must be an integer >= 0, got ${String(n)}`);
  }
  const k = req.prefixTokens ?? 0;
  if (!Number.isSafeInteger(k) || k < 0 || k > n) {
    throw requestError("prefixTokens", `prefixTokens ${String(k)} is not within 0..${n}`);
  }
  if (src.opaqueBlocks === true && k % src.blockSize !== 0 && k !== n) {
    throw requestError(
      "prefixTokens",
      `prefixTokens ${k} is not a multiple of the block size ${src.blockSize}: opaque blocks move whole`,
    );
  }
  for (const [field, ids, layout] of [
    ["srcBlockIds", req.srcBlockIds, src],
    ["dstBlockIds", req.dstBlockIds, dst],
  ] as const) {
    const need = Math.ceil(n / layout.blockSize);
    if (ids == null || typeof ids.length !== "number" || ids.length < need) {
      throw requestError(
        field,
        `${field} has ${String(ids?.length)} blocks; ${n} tokens in blocks of ${layout.blockSize} need ${need}`,
      );
    }
  }
  return k;
}

function checkRanks(field: string, ranks: readonly number[] | undefined, tpSize: number): void {
  for (const r of ranks ?? []) {
    if (!Number.isInteger(r) || r < 0 || r >= tpSize) {
      throw requestError(field, `${field} lists rank ${String(r)}, not within 0..${tpSize - 1}`);
    }
  }
}

/**
 * What every plan from one layout (`src`, P's) to another (`dst`, D's) shares, worked out once:
 * the two layouts checked compatible, each D rank's heads mapped to P ranks, and the region pair
 * and offsets of each planned (layer, K|V) slot. A sidecar pairs its layout with a peer's at the
 * handshake, so a transfer's plan starts from here (`planPaired`). Read-only once made.
 */
export interface LayoutPairing {
  readonly src: KvLayout;
  readonly dst: KvLayout;
  readonly ranks: readonly DstRankSources[];
  /** Bytes of one planned row (K's and V's together when they are adjacent on both sides). */
  readonly row: number;
  readonly interleaved: boolean;
  readonly kvPaired: boolean;
  /** Per planned slot: its index in `pairKeys` (region pairs, `srcRegion * D's regions + dstRegion`). */
  readonly slotPair: Int32Array;
  readonly pairKeys: readonly number[];
  readonly slotsPerPair: readonly number[];
  /** Per planned slot (one entry each): its offset within its block on each side. */
  readonly srcOff: Float64Array;
  readonly dstOff: Float64Array;
}

/**
 * Pairs P's layout (`src`) with D's (`dst`). Throws `PlanError` (`ERR_LAYOUT_INVALID`,
 * `ERR_LAYOUT_INCOMPATIBLE`) as `assertCompatible` does.
 */
export function pairLayouts(src: KvLayout, dst: KvLayout): LayoutPairing {
  assertCompatible(src, dst);
  // Planned slots: every (layer, K|V) slot, or with fused K|V rows on both sides one slot per
  // layer (the K slot, rows `2 * row` wide covering K's row and V's).
  const wide = kvRowsAdjacent(src) && kvRowsAdjacent(dst);
  const slotStep = wide ? 2 : 1;
  const interleaved = !wide && slotsInterleaved(src) && slotsInterleaved(dst);
  const nSlots = (src.numLayers * kvPerLayer(src)) / slotStep;

  // Region pairs are fixed by slot, the same for every rank pair.
  const dstRegions = dst.regionBytes.length;
  const slotPair = new Int32Array(nSlots);
  const pairKeys: number[] = [];
  const slotsPerPair: number[] = [];
  const keyIndex = new Map<number, number>();
  for (let s = 0; s < nSlots; s++) {
    const key = src.slots[s * slotStep]!.region * dstRegions + dst.slots[s * slotStep]!.region;
    let idx = keyIndex.get(key);
    if (idx === undefined) {
      idx = pairKeys.length;
      keyIndex.set(key, idx);
      pairKeys.push(key);
      slotsPerPair.push(0);
    }
    slotPair[s] = idx;
    slotsPerPair[idx]!++;
  }
  const srcOff = new Float64Array(nSlots);
  const dstOff = new Float64Array(nSlots);
  for (let s = 0; s < nSlots; s++) {
    srcOff[s] = src.slots[s * slotStep]!.offset;
    dstOff[s] = dst.slots[s * slotStep]!.offset;
  }
  return {
    src,
    dst,
    ranks: mapRanks(src, dst),
    row: kvRowBytes(src) * slotStep,
    interleaved,
    kvPaired: !wide && !interleaved && kvRowsInterleaved(src) && kvRowsInterleaved(dst),
    slotPair,
    pairKeys,
    slotsPerPair,
    srcOff,
    dstOff,
  };
}

/**
 * Plans moving tokens `prefixTokens .. numTokens - 1` of one request from P (`src`) to D
 * (`dst`): for each (P rank, D rank) pair sharing heads, the byte copies grouped by
 * (P region, D region), coalesced. The same plan serves push and pull. Throws `PlanError`:
 * `ERR_LAYOUT_INVALID` / `ERR_LAYOUT_INCOMPATIBLE` for the layouts, `ERR_PLAN_INVALID` for the
 * request (missing, out-of-range or repeated D block ids, bad token counts).
 */
export function planTransfer(
  src: KvLayout,
  dst: KvLayout,
  request: PlanRequest,
  options: PlanOptions = {},
): TransferPlan {
  return planPaired(pairLayouts(src, dst), request, options);
}

/** `planTransfer` from layouts already paired (`pairLayouts`): the request's part only. */
export function planPaired(
  pairing: LayoutPairing,
  request: PlanRequest,
  options: PlanOptions = {},
): TransferPlan {
  const { src, dst, row, interleaved, kvPaired, slotPair, pairKeys, slotsPerPair, srcOff, dstOff } =
    pairing;
  const nSlots = srcOff.length;
  const dstRegions = dst.regionBytes.length;
  const prefix = checkRequest(src, dst, request);
  checkRanks("srcRanks", options.srcRanks, src.tpSize);
  checkRanks("dstRanks", options.dstRanks, dst.tpSize);
  const coalesce = options.coalesce ?? true;
  const chunks = buildChunks(src, dst, request, prefix);
  const wantSrc = options.srcRanks ? new Set(options.srcRanks) : undefined;
  const wantDst = options.dstRanks ? new Set(options.dstRanks) : undefined;

  const pairs: RankPairPlan[] = [];
  let bytes = 0;
  let descriptorCount = 0;
  let rawDescriptorCount = 0;
  for (const { dstRank, sources } of pairing.ranks) {
    if (wantDst && !wantDst.has(dstRank)) continue;
    const bySrc = new Map<number, HeadSource[]>();
    for (const s of sources) {
      if (wantSrc && !wantSrc.has(s.srcRank)) continue;
      const list = bySrc.get(s.srcRank);
      if (list) list.push(s);
      else bySrc.set(s.srcRank, [s]);
    }
    for (const srcRank of [...bySrc.keys()].sort((x, y) => x - y)) {
      const sources = bySrc.get(srcRank)!;
      const pieces = relativePieces(src, dst, chunks, sources, coalesce, !interleaved, row);
      // Slot by slot, pieces.n per slot bounds a list exactly; interleaved layouts mostly merge
      // whole blocks across slots, so their lists start small and grow.
      const lists = pairKeys.map((key, i) => {
        const bound = pieces.n * slotsPerPair[i]!;
        return new DescriptorList(
          Math.floor(key / dstRegions),
          key % dstRegions,
          interleaved || kvPaired ? Math.min(bound, 4096) : bound,
          coalesce,
        );
      });
      const ps = pieces.src;
      const pd = pieces.dst;
      const pl = pieces.len;
      if (interleaved) {
        // Interleaved layouts keep every slot in one region on each side: one list.
        lists[0]!.appendInterleaved(srcOff, dstOff, ps, pd, pl, pieces.chunkStart, chunks.n);
      } else if (kvPaired) {
        // K and V of a layer share a region on each side, so one list; the slot that comes first
        // in P's memory goes first.
        for (let s = 0; s < nSlots; s += 2) {
          const [a, b] = srcOff[s]! <= srcOff[s + 1]! ? [s, s + 1] : [s + 1, s];
          lists[slotPair[s]!]!.appendPaired(
            srcOff[a]!,
            dstOff[a]!,
            srcOff[b]!,
            dstOff[b]!,
            ps,
            pd,
            pl,
            pieces.n,
          );
        }
      } else {
        for (let s = 0; s < nSlots; s++) {
          lists[slotPair[s]!]!.append(srcOff[s]!, dstOff[s]!, ps, pd, pl, 0, pieces.n);
        }
      }
      const regionPairs = lists.filter((l) => l.count > 0).map((l) => l.finish());
      const pairBytes = pieces.bytes * nSlots;
      const pairCount = regionPairs.reduce((sum, r) => sum + r.count, 0);
      const pairRaw = pieces.raw * nSlots;
      pairs.push({
        srcRank,
        dstRank,
        bytes: pairBytes,
        descriptorCount: pairCount,
        rawDescriptorCount: pairRaw,
        regionPairs,
      });
      bytes += pairBytes;
      descriptorCount += pairCount;
      rawDescriptorCount += pairRaw;
    }
  }
  return {
    numTokens: request.numTokens,
    prefixTokens: prefix,
    pairs,
    bytes,
    descriptorCount,
    rawDescriptorCount,
  };
}

/**
 * A region pair's descriptors as `(localOffset, remoteOffset, length)` for the side that posts
 * them: P posts (push) the plan's triples as they are; D posts (pull) them with the two offsets
 * swapped, which this copies.
 */
export function descriptorsForSide(descriptors: Float64Array, side: "src" | "dst"): Float64Array {
  if (side === "src") return descriptors;
  const out = new Float64Array(descriptors.length);
  for (let i = 0; i < descriptors.length; i += 3) {
    out[i] = descriptors[i + 1]!;
    out[i + 1] = descriptors[i]!;
    out[i + 2] = descriptors[i + 2]!;
  }
  return out;
}
