// Test layouts and requests: fast-check arbitraries and a byte-exact check through the reference.
import fc from "fast-check";
import { expect } from "vitest";
import {
  type KvBlockOrder,
  type KvLayout,
  type KvLayoutShape,
  type KvRegionScheme,
  type PlanOptions,
  type TransferPlan,
  KV_REGION_SCHEMES,
  kvLayout,
  planTransfer,
} from "../../src/plan/index.js";
import {
  applyPlan,
  decodeMemories,
  firstDifference,
  headsOf,
  prefillMemories,
  rng,
} from "./reference.js";

export const SCHEMES: readonly KvRegionScheme[] = KV_REGION_SCHEMES;

/**
 * A scheme name; `scattered`: random regions, padded block stride, gaps, shuffled slots;
 * `strided`: explicit head and token strides with padding, K and V apart or interleaved.
 */
export type Addressing = KvRegionScheme | "scattered" | "strided";

/**
 * Slots spread over 1-3 regions in a shuffled order, with a block stride above the block size
 * and gaps between slots: addressing no engine uses, to keep the planner honest.
 */
export function scatteredLayout(shape: KvLayoutShape, seed: number): KvLayout {
  const base = kvLayout(shape, "region-per-layer-kv");
  const next = rng(seed);
  const bb = base.blockStride;
  const nRegions = 1 + Math.floor(next() * 3);
  const blockStride = bb + Math.floor(next() * 3) * (1 + Math.floor(next() * 5));
  const order = base.slots.map((_, i) => i).sort(() => next() - 0.5);
  const cursor = new Array<number>(nRegions).fill(0).map(() => Math.floor(next() * 7));
  const slots = new Array<{ region: number; offset: number }>(base.slots.length);
  for (const s of order) {
    const region = Math.floor(next() * nRegions);
    slots[s] = { region, offset: cursor[region]! };
    cursor[region]! +=
      (shape.numBlocks - 1) * blockStride + bb + Math.floor(next() * 2) * Math.floor(next() * 9);
  }
  return {
    ...shape,
    blockStride,
    slots,
    regionBytes: cursor.map((c) => c + Math.floor(next() * 5)),
  };
}

/** How K and V of a layer sit in a `stridedLayout`. */
export type KvPlacement = "apart" | "in-block" | "in-cell";

/**
 * A layout with explicit strides, written from the definition (byte of (slot, block, head, token)
 * = `offset + block * blockStride + head * headStride + token * tokenStride`), not from
 * `kvLayout`: rows `inner` stride apart (tokens for HND, heads for NHD), groups of them `outer`
 * stride apart, with random padding at every level. K and V of a layer are `apart` (each its own
 * block), interleaved `in-block` (`[outer][K|V][inner]`, vLLM's CPU layout for HND) or `in-cell`
 * (`[outer][inner][K|V]`, fused cells for NHD), sometimes V first. The units (a slot, or a layer's
 * K and V) go one after another over 1-3 regions in a shuffled order with gaps, or side by side
 * in every block. A stride equal to its dense default is sometimes left out.
 */
export function stridedLayout(
  shape: KvLayoutShape,
  seed: number,
  placement?: KvPlacement,
): KvLayout {
  const next = rng(seed);
  const pad = () => (next() < 0.5 ? 0 : 1 + Math.floor(next() * 6));
  const row = shape.headDim * shape.dtypeBytes;
  const hpr = shape.mla ? 1 : Math.max(1, shape.totalKvHeads / shape.tpSize);
  const nKv = shape.mla ? 1 : 2;
  const hnd = shape.order === "HND";
  const nOuter = hnd ? hpr : shape.blockSize;
  const nInner = hnd ? shape.blockSize : hpr;
  const kvPlace: KvPlacement =
    nKv === 1
      ? "apart"
      : (placement ?? (["apart", "in-block", "in-cell"] as const)[(next() * 3) | 0]!);
  let innerStride: number;
  let outerStride: number;
  let kvStep = 0;
  if (kvPlace === "in-cell") {
    kvStep = row + pad();
    innerStride = kvStep + row + pad();
    outerStride = (nInner - 1) * innerStride + kvStep + row + pad();
  } else {
    innerStride = row + pad();
    const innerSpan = (nInner - 1) * innerStride + row;
    if (kvPlace === "in-block") {
      kvStep = innerSpan + pad();
      outerStride = kvStep + innerSpan + pad();
    } else {
      outerStride = innerSpan + pad();
    }
  }
  // One slot's block spans `footprint`; a unit (a slot, or K and V together) `unitBlock`.
  const footprint = (nOuter - 1) * outerStride + (nInner - 1) * innerStride + row;
  const unitBlock = footprint + kvStep;
  const perUnit = kvPlace === "apart" ? 1 : 2;
  const nUnits = (shape.numLayers * nKv) / perUnit;
  const vFirst = next() < 0.3;
  const unitSlots = (u: number): number[] =>
    perUnit === 1 ? [u] : vFirst ? [2 * u + 1, 2 * u] : [2 * u, 2 * u + 1];
  const slots = new Array<{ region: number; offset: number }>(shape.numLayers * nKv);
  let blockStride: number;
  let regionBytes: number[];
  if (next() < 0.3) {
    // Side by side in every block, in one region.
    let cursor = pad();
    for (let u = 0; u < nUnits; u++) {
      unitSlots(u).forEach((s, i) => (slots[s] = { region: 0, offset: cursor + i * kvStep }));
      cursor += unitBlock + pad();
    }
    blockStride = cursor;
    regionBytes = [(shape.numBlocks - 1) * blockStride + cursor + pad()];
  } else {
    blockStride = unitBlock + pad();
    const unitSpan = (shape.numBlocks - 1) * blockStride + unitBlock;
    const nRegions = 1 + Math.floor(next() * 3);
    const cursor = Array.from({ length: nRegions }, () => pad());
    const order = Array.from({ length: nUnits }, (_, u) => u).sort(() => next() - 0.5);
    for (const u of order) {
      const region = Math.floor(next() * nRegions);
      unitSlots(u).forEach((s, i) => (slots[s] = { region, offset: cursor[region]! + i * kvStep }));
      cursor[region]! += unitSpan + pad();
    }
    regionBytes = cursor.map((c) => c + pad());
  }
  const headStride = hnd ? outerStride : innerStride;
  const tokenStride = hnd ? innerStride : outerStride;
  const denseHead = hnd ? shape.blockSize * row : row;
  const denseToken = hnd ? row : hpr * row;
  return {
    ...shape,
    blockStride,
    slots,
    regionBytes,
    ...(headStride !== denseHead || next() < 0.5 ? { headStride } : {}),
    ...(tokenStride !== denseToken || next() < 0.5 ? { tokenStride } : {}),
  };
}

export function makeLayout(shape: KvLayoutShape, addressing: Addressing, seed = 1): KvLayout {
  if (addressing === "scattered") return scatteredLayout(shape, seed);
  if (addressing === "strided") return stridedLayout(shape, seed);
  return kvLayout(shape, addressing);
}

export interface Model {
  numLayers: number;
  mla: boolean;
  totalKvHeads: number;
  headDim: number;
  dtype: string;
  dtypeBytes: number;
}

/** Llama 3 8B's KV: 32 layers, 8 KV heads of 128, bfloat16. */
export const llama8b: Model = {
  numLayers: 32,
  mla: false,
  totalKvHeads: 8,
  headDim: 128,
  dtype: "bfloat16",
  dtypeBytes: 2,
};

export function shape(
  model: Model,
  side: {
    tpSize: number;
    blockSize: number;
    numBlocks: number;
    order: KvBlockOrder;
    tpRank?: number;
  },
): KvLayoutShape {
  return { ...model, tpRank: 0, ...side };
}

/** Whether `tp` can hold `heads` KV heads (split or replicated). */
export function tpFits(heads: number, tp: number): boolean {
  return heads % tp === 0 || tp % heads === 0;
}

/** (heads, P TP, D TP) triples over TP 1-8 that the planner must accept. */
export const TP_COMBOS: readonly [number, number, number][] = (() => {
  const out: [number, number, number][] = [];
  for (const h of [1, 2, 3, 4, 6, 8])
    for (let p = 1; p <= 8; p++)
      for (let d = 1; d <= 8; d++)
        if (tpFits(h, p) && tpFits(h, d) && (p % d === 0 || d % p === 0)) out.push([h, p, d]);
  return out;
})();

/** Distinct random block ids, `count` of them, below `numBlocks` (a shuffled sample). */
export function blockIds(count: number, numBlocks: number, seed: number): number[] {
  const next = rng(seed);
  const all = Array.from({ length: numBlocks }, (_, i) => i);
  for (let i = all.length - 1; i > 0; i--) {
    const j = Math.floor(next() * (i + 1));
    [all[i], all[j]] = [all[j]!, all[i]!];
  }
  return all.slice(0, count);
}

export interface PlanCase {
  src: KvLayout;
  dst: KvLayout;
  numTokens: number;
  prefixTokens: number;
  /** The real block tables (every entry valid). */
  srcIds: number[];
  dstIds: number[];
  /** What the planner is given: entries it must not read replaced by -1, maybe a trailing -1. */
  srcIdsGiven: number[];
  dstIdsGiven: number[];
}

/** Blocks wholly before `prefix` become -1 (the planner must not read them). */
function maskPrefix(ids: number[], blockSize: number, prefix: number, extra: boolean): number[] {
  const out = ids.map((id, i) => ((i + 1) * blockSize <= prefix ? -1 : id));
  if (extra) out.push(-1);
  return out;
}

/** Any addressing; explicit strides a third of the time. */
export const addressingArb: fc.Arbitrary<Addressing> = fc.oneof(
  { arbitrary: fc.constantFrom<Addressing>(...SCHEMES, "scattered"), weight: 2 },
  { arbitrary: fc.constant<Addressing>("strided"), weight: 1 },
);

/** Random compatible pairs of layouts and a request, kept small so a run takes milliseconds. */
export const planCaseArb: fc.Arbitrary<PlanCase> = fc
  .record({
    combo: fc.constantFrom(...TP_COMBOS),
    mla: fc.boolean(),
    numLayers: fc.integer({ min: 1, max: 3 }),
    headDim: fc.integer({ min: 1, max: 4 }),
    dtypeBytes: fc.constantFrom(1, 2, 4),
    blockSizes: fc.tuple(
      fc.oneof(fc.integer({ min: 1, max: 8 }), fc.integer({ min: 1, max: 256 })),
      fc.oneof(fc.integer({ min: 1, max: 8 }), fc.integer({ min: 1, max: 256 })),
    ),
    orders: fc.tuple(
      fc.constantFrom<KvBlockOrder>("HND", "NHD"),
      fc.constantFrom<KvBlockOrder>("HND", "NHD"),
    ),
    addressing: fc.tuple(addressingArb, addressingArb),
    numTokens: fc.oneof(fc.integer({ min: 0, max: 40 }), fc.integer({ min: 0, max: 300 })),
    prefixFrac: fc.oneof(fc.constant(0), fc.double({ min: 0, max: 1, noNaN: true })),
    spareBlocks: fc.tuple(fc.integer({ min: 0, max: 6 }), fc.integer({ min: 0, max: 6 })),
    contiguous: fc.boolean(),
    extraIds: fc.boolean(),
    seed: fc.integer({ min: 1, max: 1 << 30 }),
  })
  .map((r) => {
    const [heads, tpP, tpD] = r.mla ? [1, r.combo[1], r.combo[2]] : r.combo;
    const model: Model = {
      numLayers: r.numLayers,
      mla: r.mla,
      totalKvHeads: heads,
      headDim: r.headDim,
      dtype: `int${8 * r.dtypeBytes}`,
      dtypeBytes: r.dtypeBytes,
    };
    const [bp, bd] = r.blockSizes;
    const needP = Math.ceil(r.numTokens / bp);
    const needD = Math.ceil(r.numTokens / bd);
    const nbP = needP + r.spareBlocks[0] + (r.extraIds ? 1 : 0);
    const nbD = needD + r.spareBlocks[1];
    const src = makeLayout(
      shape(model, { tpSize: tpP, blockSize: bp, numBlocks: Math.max(nbP, 1), order: r.orders[0] }),
      r.addressing[0],
      r.seed,
    );
    const dst = makeLayout(
      shape(model, { tpSize: tpD, blockSize: bd, numBlocks: Math.max(nbD, 1), order: r.orders[1] }),
      r.addressing[1],
      r.seed + 7,
    );
    const prefixTokens = Math.min(r.numTokens, Math.floor(r.prefixFrac * (r.numTokens + 1)));
    const srcIds = r.contiguous
      ? Array.from({ length: needP }, (_, i) => i + r.spareBlocks[0])
      : blockIds(needP, src.numBlocks, r.seed + 1);
    const dstIds = r.contiguous
      ? Array.from({ length: needD }, (_, i) => i + r.spareBlocks[1])
      : blockIds(needD, dst.numBlocks, r.seed + 2);
    return {
      src,
      dst,
      numTokens: r.numTokens,
      prefixTokens,
      srcIds,
      dstIds,
      srcIdsGiven: maskPrefix(srcIds, bp, prefixTokens, r.extraIds),
      dstIdsGiven: maskPrefix(dstIds, bd, prefixTokens, r.extraIds),
    };
  });

/**
 * Plans the case, applies it to reference memories and checks: every byte D should get has the
 * logical tensor's value, nothing else on D changed (prefix included), each D rank got exactly its
 * bytes (no byte written twice), and the plan's totals add up.
 */
export function checkByteExact(c: PlanCase, options: PlanOptions = {}, seed = 11): TransferPlan {
  const plan = planTransfer(
    c.src,
    c.dst,
    {
      numTokens: c.numTokens,
      prefixTokens: c.prefixTokens,
      srcBlockIds: c.srcIdsGiven,
      dstBlockIds: c.dstIdsGiven,
    },
    options,
  );
  const srcMem = prefillMemories(c.src, c.srcIds, c.numTokens, seed);
  const { before, expected, bytesPerRank } = decodeMemories(
    c.dst,
    c.dstIds,
    c.numTokens,
    c.prefixTokens,
    seed,
  );
  const written = applyPlan(plan, srcMem, before);
  const diff = firstDifference(before, expected);
  if (diff !== undefined) expect.fail(diff);
  expect(written).toEqual(bytesPerRank);
  expect(plan.bytes).toBe(bytesPerRank.reduce((a, b) => a + b, 0));
  expect(plan.descriptorCount).toBe(plan.pairs.reduce((a, p) => a + p.descriptorCount, 0));
  expect(plan.descriptorCount).toBeLessThanOrEqual(plan.rawDescriptorCount);
  // Every D rank has exactly one source per head it holds, each from a P rank holding that head.
  for (let r = 0; r < c.dst.tpSize; r++) {
    const srcRanks = plan.pairs.filter((p) => p.dstRank === r).map((p) => p.srcRank);
    expect(new Set(srcRanks).size).toBe(srcRanks.length);
    for (const q of srcRanks) {
      const held = headsOf(c.src, q);
      expect(headsOf(c.dst, r).some((h) => held.includes(h))).toBe(true);
    }
  }
  return plan;
}
