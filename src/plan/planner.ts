import { assertCompatible } from "./compat.js";
import { DescriptorList, type RegionPairDescriptors } from "./descriptor-list.js";
import {
  type KvLayout,
  type KvRunOrder,
  kvBlockFootprint,
  kvPerLayer,
  kvRowBytes,
  runOrderOf,
} from "./layout.js";
import { relativePieces, runOrderPieces } from "./pieces.js";
import { type DstRankSources, type HeadSource, mapRanks } from "./ranks.js";
import {
  type Chunks,
  type PlanOptions,
  type PlanRequest,
  buildChunks,
  checkRanks,
  checkRequest,
} from "./request.js";

export type { PlanOptions, PlanRequest } from "./request.js";
export type { RegionPairDescriptors } from "./descriptor-list.js";

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
  /**
   * Tokens that move only together, counted from a block's start: 1 for rows, a whole block for
   * opaque blocks without run orders, else the least common multiple of the run orders' tiles.
   */
  readonly tokenUnit: number;
  /**
   * Per kv (K, V; one for MLA), the run order both sides share, when some run is not plain rows:
   * slots are then planned kv by kv (`runOrderPieces`), not with one set of pieces for all.
   */
  readonly runOrders: readonly KvRunOrder[] | undefined;
  /**
   * With run orders and one block size on both sides: a request whose prefix is whole blocks moves
   * whole (block, head) runs, planned as rows (a block of a layer in one copy, as for opaque
   * blocks; the last block's tail goes along) instead of cut by run order.
   */
  readonly wholeBlocks: boolean;
}

function gcd(a: number, b: number): number {
  while (b !== 0) [a, b] = [b, a % b];
  return a;
}

/** `tokenUnit` and `runOrders` of a compatible pair (see `LayoutPairing`). */
function pairRunOrders(
  src: KvLayout,
  dst: KvLayout,
): { tokenUnit: number; runOrders: readonly KvRunOrder[] | undefined } {
  const orders: KvRunOrder[] = [];
  for (let kv = 0; kv < kvPerLayer(src); kv++) {
    const o = runOrderOf(src, kv);
    // Opaque on either side with no run order: whole blocks, one block size (compat checked).
    if (o === undefined || runOrderOf(dst, kv) === undefined) {
      return { tokenUnit: src.blockSize, runOrders: undefined };
    }
    orders.push(o);
  }
  let tokenUnit = 1;
  for (const o of orders) tokenUnit = (tokenUnit / gcd(tokenUnit, o.tokenTile)) * o.tokenTile;
  const rows = orders.every((o) => o.dimGroup === src.headDim);
  return { tokenUnit, runOrders: rows ? undefined : orders };
}

/**
 * Pairs P's layout (`src`) with D's (`dst`). Throws `PlanError` (`ERR_LAYOUT_INVALID`,
 * `ERR_LAYOUT_INCOMPATIBLE`) as `assertCompatible` does.
 */
export function pairLayouts(src: KvLayout, dst: KvLayout): LayoutPairing {
  assertCompatible(src, dst);
  const { tokenUnit, runOrders } = pairRunOrders(src, dst);
  const wholeBlocks = runOrders !== undefined && src.blockSize === dst.blockSize;
  // Whether some plan of this pair may be planned as rows (else always by run order).
  const rows = runOrders === undefined || wholeBlocks;
  // Planned slots: every (layer, K|V) slot, or with fused K|V rows on both sides one slot per
  // layer (the K slot, rows `2 * row` wide covering K's row and V's). Plans by run order take
  // every slot, so run orders never fuse.
  const wide = runOrders === undefined && kvRowsAdjacent(src) && kvRowsAdjacent(dst);
  const slotStep = wide ? 2 : 1;
  const interleaved = !wide && rows && slotsInterleaved(src) && slotsInterleaved(dst);
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
    kvPaired: !wide && !interleaved && rows && kvRowsInterleaved(src) && kvRowsInterleaved(dst),
    slotPair,
    pairKeys,
    slotsPerPair,
    srcOff,
    dstOff,
    tokenUnit,
    runOrders,
    wholeBlocks,
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
  const prefix = checkRequest(src, dst, request, pairing.tokenUnit);
  checkRanks("srcRanks", options.srcRanks, src.tpSize);
  checkRanks("dstRanks", options.dstRanks, dst.tpSize);
  const coalesce = options.coalesce ?? true;
  const whole = pairing.wholeBlocks && prefix % src.blockSize === 0;
  const byRunOrder = pairing.runOrders !== undefined && !whole;
  const chunks = buildChunks(src, dst, request, prefix, whole ? src.blockSize : pairing.tokenUnit);
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
      if (byRunOrder) {
        const pair = planRunOrders(pairing, chunks, sources, coalesce, srcRank, dstRank);
        pairs.push(pair);
        bytes += pair.bytes;
        descriptorCount += pair.descriptorCount;
        rawDescriptorCount += pair.rawDescriptorCount;
        continue;
      }
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

/** One rank pair's plan when slots have run orders: each kv's pieces, placed slot by slot. */
function planRunOrders(
  pairing: LayoutPairing,
  chunks: Chunks,
  sources: readonly HeadSource[],
  coalesce: boolean,
  srcRank: number,
  dstRank: number,
): RankPairPlan {
  const { src, dst, slotPair, pairKeys, slotsPerPair, srcOff, dstOff } = pairing;
  const orders = pairing.runOrders!;
  const dstRegions = dst.regionBytes.length;
  const pieces = orders.map((o) => runOrderPieces(src, dst, chunks, sources, coalesce, o));
  const most = Math.max(...pieces.map((p) => p.n));
  const lists = pairKeys.map(
    (key, i) =>
      new DescriptorList(
        Math.floor(key / dstRegions),
        key % dstRegions,
        most * slotsPerPair[i]!,
        coalesce,
      ),
  );
  let bytes = 0;
  let raw = 0;
  for (let s = 0; s < srcOff.length; s++) {
    const p = pieces[s % orders.length]!;
    lists[slotPair[s]!]!.append(srcOff[s]!, dstOff[s]!, p.src, p.dst, p.len, 0, p.n);
    bytes += p.bytes;
    raw += p.raw;
  }
  const regionPairs = lists.filter((l) => l.count > 0).map((l) => l.finish());
  return {
    srcRank,
    dstRank,
    bytes,
    descriptorCount: regionPairs.reduce((sum, r) => sum + r.count, 0),
    rawDescriptorCount: raw,
    regionPairs,
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
