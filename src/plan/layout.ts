import { PlanError } from "./errors.js";

/**
 * Order of tokens and heads inside one block of one (layer, K|V) slot: `HND` is
 * `[head][token][dim]` (heads outer), `NHD` is `[token][head][dim]` (tokens outer). With explicit
 * `headStride`/`tokenStride` the order still says which of the two is outer.
 */
export type KvBlockOrder = "HND" | "NHD";

/** Where one (layer, K|V) slot lives: block `b` starts at `offset + b * blockStride` in `region`. */
export interface KvSlotAddress {
  readonly region: number;
  readonly offset: number;
}

/**
 * The KV cache of one tensor-parallel rank. Every rank of one engine has the same layout apart
 * from `tpRank`; the planner uses one layout per engine as the template for all its ranks.
 *
 * A slot is one (layer, K|V) pair, or one layer's latent for MLA; slot index is
 * `layer * kvPerLayer + kv` with `kv` 0 for K and 1 for V. Each slot's blocks are `blockStride`
 * bytes apart, starting at the slot's `offset` in its `region`, so one layout type covers one
 * region per layer (K then V, or blocks-first with K and V interleaved), one region per layer
 * per K|V, and one region for all layers (see `kvLayout`).
 */
export interface KvLayout {
  readonly numLayers: number;
  /** Multi-head latent attention: one latent per layer instead of K and V, replicated on every rank. */
  readonly mla: boolean;
  /** KV heads of the whole model (1 for MLA). */
  readonly totalKvHeads: number;
  /** Elements per head (for MLA the latent width, rope included, e.g. 576). */
  readonly headDim: number;
  /** Element type name, e.g. `bfloat16`; P and D must agree exactly. */
  readonly dtype: string;
  readonly dtypeBytes: number;
  /** Tokens per block. */
  readonly blockSize: number;
  /** Blocks per slot on this rank; block ids run from 0 to `numBlocks - 1`. */
  readonly numBlocks: number;
  readonly order: KvBlockOrder;
  readonly tpSize: number;
  readonly tpRank: number;
  /** Bytes between block `b` and block `b + 1` of one slot. */
  readonly blockStride: number;
  /** One address per slot, `numLayers * kvPerLayer` entries. */
  readonly slots: readonly KvSlotAddress[];
  /** Size in bytes of each region of this rank; a slot's `region` indexes this list. */
  readonly regionBytes: readonly number[];
  /**
   * Bytes between rank-local head `h` and `h + 1` of one slot inside a block. Absent or 0: dense,
   * as `order` implies (`blockSize * row` for HND, `row` for NHD, `row = headDim * dtypeBytes`).
   * Read it through `headStride(layout)`.
   */
  readonly headStride?: number;
  /**
   * Bytes between token `t` and `t + 1` of one head inside a block. Absent or 0: dense (`row` for
   * HND, `kvHeadsPerRank * row` for NHD). Read it through `tokenStride(layout)`.
   */
  readonly tokenStride?: number;
  /**
   * The `blockSize` rows of one head in one block (`blockSize * row` bytes from the head's start)
   * hold its tokens in an order private to the engine: vLLM's CPU attention keeps K column-major
   * (`[dim][token]`) and V row-major. Only whole (block, head) runs can move, so P and D must both
   * be opaque with one block size, the prefix must be block-aligned, and the request's last block
   * moves whole (its tail past the last token is the engine's scratch on both sides). Needs HND
   * with dense rows inside a head. Absent: false.
   */
  readonly opaqueBlocks?: boolean;
  /**
   * How each (block, head) run of a K and of a V slot orders its `blockSize x headDim` elements,
   * one entry per kv (K, then V; one for MLA); absent: plain rows. With it, runs that are not
   * plain rows can still be cut by token, so P and D may use different block sizes (see
   * `KvRunOrder`); it supersedes `opaqueBlocks`, which an engine keeps setting for peers that
   * predate this field. Needs HND with dense rows inside a head.
   */
  readonly runOrders?: readonly KvRunOrder[];
}

/**
 * The order of one (block, head) run of `blockSize` tokens x `headDim` elements: the head's dims in
 * groups of `dimGroup` elements, groups outermost (`[headDim / dimGroup][blockSize][dimGroup]`),
 * and tokens in tiles of `tokenTile` whose `tokenTile * dimGroup` elements are in an order private
 * to the engine. Plain rows are `{ dimGroup: headDim, tokenTile: 1 }`; vLLM's CPU attention (ISA
 * `vec`) keeps K column-major, `{ dimGroup: 1, tokenTile: 1 }`. Tokens `[a, a + n)` of a head,
 * `a` and `n` whole tiles, are then `headDim / dimGroup` byte ranges of `n * dimGroup` elements,
 * `blockSize * dimGroup` elements apart: the ranges move between any two block sizes.
 */
export interface KvRunOrder {
  readonly dimGroup: number;
  readonly tokenTile: number;
}

/** The shape of a layout without its addressing, as `kvLayout` takes it. */
export type KvLayoutShape = Omit<
  KvLayout,
  | "blockStride"
  | "slots"
  | "regionBytes"
  | "headStride"
  | "tokenStride"
  | "opaqueBlocks"
  | "runOrders"
>;

/**
 * Common ways engines place a rank's KV cache in memory. `outer` and `inner` are heads and tokens
 * in the layout's `order` (HND: heads outer); the first five keep each slot's block dense.
 * - `region-per-layer`: one region per layer holding `[K|V][block]` (vLLM FlashAttention).
 * - `region-per-layer-kv`: one region per slot holding `[block]`.
 * - `region-per-layer-blocks-first`: one region per layer holding `[block][K|V]` (FlashInfer).
 * - `one-region-blocks-first`: one region holding `[block][layer][K|V]` (cross-layer layout).
 * - `one-region-layers-first`: one region holding `[layer][K|V][block]`.
 * - `one-region-kv-in-block`: one region holding `[layer][block][outer][K|V][inner]`; with HND,
 *   vLLM's CPU backend (`[layer][block][head][K|V][token]`: a head's K rows, then its V rows).
 * - `region-per-layer-kv-in-cell`: one region per layer holding `[block][outer][inner][K|V]`;
 *   with NHD, the fused cells of vLLM's GPU backends (per token and head, K's dims then V's).
 */
export type KvRegionScheme =
  | "region-per-layer"
  | "region-per-layer-kv"
  | "region-per-layer-blocks-first"
  | "one-region-blocks-first"
  | "one-region-layers-first"
  | "one-region-kv-in-block"
  | "region-per-layer-kv-in-cell";

/** Every `KvRegionScheme`, in the order above. */
export const KV_REGION_SCHEMES: readonly KvRegionScheme[] = [
  "region-per-layer",
  "region-per-layer-kv",
  "region-per-layer-blocks-first",
  "one-region-blocks-first",
  "one-region-layers-first",
  "one-region-kv-in-block",
  "region-per-layer-kv-in-cell",
];

/** 2 for K and V, 1 for an MLA latent. */
export function kvPerLayer(layout: Pick<KvLayout, "mla">): number {
  return layout.mla ? 1 : 2;
}

/** Where each layer's KV lies in one region: disjoint byte ranges, sorted by start. */
export interface LayerSpans {
  readonly starts: Float64Array;
  readonly ends: Float64Array;
  readonly layers: Int32Array;
}

/**
 * For each region of `layout`, the byte range each layer's slots take in it (every block of
 * the slot: `offset .. offset + (numBlocks - 1) * blockStride + footprint`), or undefined when
 * two layers' ranges overlap there (blocks that hold every layer, say): a transfer's copies can
 * then be told apart by layer only where it is defined (layer-wise push).
 */
export function layerSpans(layout: KvLayout): (LayerSpans | undefined)[] {
  const perLayer = kvPerLayer(layout);
  const reach = (layout.numBlocks - 1) * layout.blockStride + kvBlockFootprint(layout);
  const byRegion = layout.regionBytes.map(() => new Map<number, [number, number]>());
  layout.slots.forEach((slot, s) => {
    const layer = Math.floor(s / perLayer);
    const m = byRegion[slot.region]!;
    const span = m.get(layer);
    const end = slot.offset + reach;
    if (span === undefined) m.set(layer, [slot.offset, end]);
    else m.set(layer, [Math.min(span[0], slot.offset), Math.max(span[1], end)]);
  });
  return byRegion.map((m) => {
    const spans = [...m.entries()].sort((a, b) => a[1][0] - b[1][0]);
    for (let i = 1; i < spans.length; i++)
      if (spans[i]![1][0] < spans[i - 1]![1][1]) return undefined;
    return {
      starts: Float64Array.from(spans, (x) => x[1][0]),
      ends: Float64Array.from(spans, (x) => x[1][1]),
      layers: Int32Array.from(spans, (x) => x[0]),
    };
  });
}

/** The layer whose span holds byte `at`, or -1. */
function layerAt(spans: LayerSpans, at: number): number {
  let lo = 0;
  let hi = spans.starts.length - 1;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    if (at < spans.starts[mid]!) hi = mid - 1;
    else if (at >= spans.ends[mid]!) lo = mid + 1;
    else return spans.layers[mid]!;
  }
  return -1;
}

/**
 * One region pair's `(src, dst, length)` triples split by the layer of the source bytes they
 * read (a copy that runs into the next layer's range goes with the later one), in layer order;
 * undefined when some copy reads bytes outside every layer's range.
 */
export function splitByLayer(
  descriptors: Float64Array,
  count: number,
  spans: LayerSpans,
): { layer: number; descriptors: Float64Array }[] | undefined {
  const of = new Int32Array(count);
  const sizes = new Map<number, number>();
  for (let i = 0; i < count; i++) {
    const src = descriptors[3 * i]!;
    const first = layerAt(spans, src);
    const last = layerAt(spans, src + descriptors[3 * i + 2]! - 1);
    if (first < 0 || last < 0) return undefined;
    const layer = Math.max(first, last);
    of[i] = layer;
    sizes.set(layer, (sizes.get(layer) ?? 0) + 1);
  }
  const out = [...sizes.keys()]
    .sort((a, b) => a - b)
    .map((layer) => ({ layer, descriptors: new Float64Array(3 * sizes.get(layer)!), n: 0 }));
  const index = new Map(out.map((o) => [o.layer, o]));
  for (let i = 0; i < count; i++) {
    const o = index.get(of[i]!)!;
    o.descriptors.set(descriptors.subarray(3 * i, 3 * i + 3), 3 * o.n++);
  }
  return out.map(({ layer, descriptors: d }) => ({ layer, descriptors: d }));
}

/** KV heads each rank holds: a slice of the heads, or one head when ranks outnumber heads. */
export function kvHeadsPerRank(layout: Pick<KvLayout, "mla" | "totalKvHeads" | "tpSize">): number {
  if (layout.mla || layout.tpSize >= layout.totalKvHeads) return 1;
  return layout.totalKvHeads / layout.tpSize;
}

/**
 * The first global KV head `rank` holds. Ranks hold consecutive slices; with more ranks than
 * heads, `tpSize / totalKvHeads` consecutive ranks hold the same head (as vLLM replicates them).
 */
export function firstKvHeadOfRank(
  layout: Pick<KvLayout, "mla" | "totalKvHeads" | "tpSize">,
  rank: number,
): number {
  if (layout.mla) return 0;
  if (layout.tpSize >= layout.totalKvHeads) {
    return Math.floor(rank / (layout.tpSize / layout.totalKvHeads));
  }
  return rank * kvHeadsPerRank(layout);
}

/**
 * The run order of K (`kv` 0) or V (1) slots: the layout's own, plain rows when it has none, or
 * `undefined` when its blocks are opaque with no run order (whole blocks only).
 */
export function runOrderOf(
  layout: Pick<KvLayout, "headDim" | "opaqueBlocks" | "runOrders">,
  kv: number,
): KvRunOrder | undefined {
  const own = layout.runOrders?.[kv];
  if (own) return own;
  if (layout.opaqueBlocks === true) return undefined;
  return { dimGroup: layout.headDim, tokenTile: 1 };
}

/** Bytes of one block of one slot on one rank. */
export function kvBlockBytes(
  layout: Pick<
    KvLayout,
    "mla" | "totalKvHeads" | "tpSize" | "blockSize" | "headDim" | "dtypeBytes"
  >,
): number {
  return layout.blockSize * kvHeadsPerRank(layout) * layout.headDim * layout.dtypeBytes;
}

/** Bytes of one head of one token: `headDim * dtypeBytes`. */
export function kvRowBytes(layout: Pick<KvLayout, "headDim" | "dtypeBytes">): number {
  return layout.headDim * layout.dtypeBytes;
}

type StrideFields =
  | "mla"
  | "totalKvHeads"
  | "tpSize"
  | "blockSize"
  | "headDim"
  | "dtypeBytes"
  | "order"
  | "headStride"
  | "tokenStride";

/** Bytes between head `h` and `h + 1` of one slot in a block: the field, or its dense default. */
export function headStride(layout: Pick<KvLayout, StrideFields>): number {
  const s = layout.headStride;
  if (s !== undefined && s !== 0) return s;
  return layout.order === "HND" ? layout.blockSize * kvRowBytes(layout) : kvRowBytes(layout);
}

/** Bytes between token `t` and `t + 1` of one head in a block: the field, or its dense default. */
export function tokenStride(layout: Pick<KvLayout, StrideFields>): number {
  const s = layout.tokenStride;
  if (s !== undefined && s !== 0) return s;
  return layout.order === "HND" ? kvRowBytes(layout) : kvHeadsPerRank(layout) * kvRowBytes(layout);
}

/**
 * Bytes from the start of a slot's block to the end of its last row:
 * `(heads - 1) * headStride + (blockSize - 1) * tokenStride + row`. Equals `kvBlockBytes` for a
 * dense block; blocks `blockStride` apart must not be closer than this.
 */
export function kvBlockFootprint(layout: Pick<KvLayout, StrideFields>): number {
  return (
    (kvHeadsPerRank(layout) - 1) * headStride(layout) +
    (layout.blockSize - 1) * tokenStride(layout) +
    kvRowBytes(layout)
  );
}

/** Builds a layout with one of the common addressing schemes (tightly packed, no padding). */
export function kvLayout(
  shape: KvLayoutShape,
  scheme: KvRegionScheme = "region-per-layer",
): KvLayout {
  const nKv = kvPerLayer(shape);
  const nSlots = shape.numLayers * nKv;
  const bb = kvBlockBytes(shape);
  const slabBytes = shape.numBlocks * bb;
  const slots: KvSlotAddress[] = [];
  let blockStride: number;
  let regionBytes: number[];
  switch (scheme) {
    case "region-per-layer":
      blockStride = bb;
      regionBytes = new Array<number>(shape.numLayers).fill(nKv * slabBytes);
      for (let s = 0; s < nSlots; s++) {
        slots.push({ region: Math.floor(s / nKv), offset: (s % nKv) * slabBytes });
      }
      break;
    case "region-per-layer-kv":
      blockStride = bb;
      regionBytes = new Array<number>(nSlots).fill(slabBytes);
      for (let s = 0; s < nSlots; s++) slots.push({ region: s, offset: 0 });
      break;
    case "region-per-layer-blocks-first":
      blockStride = nKv * bb;
      regionBytes = new Array<number>(shape.numLayers).fill(nKv * slabBytes);
      for (let s = 0; s < nSlots; s++) {
        slots.push({ region: Math.floor(s / nKv), offset: (s % nKv) * bb });
      }
      break;
    case "one-region-blocks-first":
      blockStride = nSlots * bb;
      regionBytes = [nSlots * slabBytes];
      for (let s = 0; s < nSlots; s++) slots.push({ region: 0, offset: s * bb });
      break;
    case "one-region-layers-first":
      blockStride = bb;
      regionBytes = [nSlots * slabBytes];
      for (let s = 0; s < nSlots; s++) slots.push({ region: 0, offset: s * slabBytes });
      break;
    case "one-region-kv-in-block":
    case "region-per-layer-kv-in-cell": {
      // K and V share every block: [outer][K|V][inner] or [outer][inner][K|V].
      const row = kvRowBytes(shape);
      const hnd = shape.order === "HND";
      const nInner = hnd ? shape.blockSize : kvHeadsPerRank(shape);
      const inCell = scheme === "region-per-layer-kv-in-cell";
      const innerStride = inCell ? nKv * row : row;
      const outerStride = nKv * nInner * row;
      const kvStep = inCell ? row : nInner * row;
      blockStride = nKv * bb;
      const strides = hnd
        ? { headStride: outerStride, tokenStride: innerStride }
        : { headStride: innerStride, tokenStride: outerStride };
      // kv-in-cell: one region per layer; kv-in-block: one region, layers one after another.
      const layerBytes = shape.numBlocks * blockStride;
      regionBytes = inCell
        ? new Array<number>(shape.numLayers).fill(layerBytes)
        : [shape.numLayers * layerBytes];
      for (let s = 0; s < nSlots; s++) {
        const layer = Math.floor(s / nKv);
        slots.push({
          region: inCell ? layer : 0,
          offset: (inCell ? 0 : layer * layerBytes) + (s % nKv) * kvStep,
        });
      }
      return { ...shape, blockStride, slots, regionBytes, ...strides };
    }
  }
  return { ...shape, blockStride, slots, regionBytes };
}

/**
 * Most layers a layout may have. Slots that share a region are checked against each other in
 * pairs, so a layout from the network with a million slots would stall the process; no model
 * comes near this (Llama-3-405B has 126 layers).
 */
export const MAX_KV_LAYERS = 1024;

function invalid(field: string, message: string): PlanError {
  return new PlanError("ERR_LAYOUT_INVALID", field, message);
}

function checkCount(layout: KvLayout, field: keyof KvLayout, min: number): void {
  const v = layout[field];
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < min) {
    throw invalid(field, `${field} must be an integer >= ${min}, got ${String(v)}`);
  }
}

/** An explicit stride: absent or 0 (dense), or a byte count of at least one row. */
function checkStride(layout: KvLayout, field: "headStride" | "tokenStride", row: number): void {
  const v = layout[field];
  if (v === undefined || v === 0) return;
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < row) {
    throw invalid(
      field,
      `${field} must be 0 (dense) or a byte count >= one row (${row} bytes), got ${String(v)}`,
    );
  }
}

/**
 * Checks a layout on its own: positive sizes, heads that split over `tpSize`, strides that keep
 * the rows of one block apart, one address per slot, every block of every slot inside its region,
 * and no two rows of two slots overlapping. A layout from the network passes this before it is
 * planned with. Throws `PlanError` `ERR_LAYOUT_INVALID`.
 */
export function validateKvLayout(layout: KvLayout): void {
  for (const f of [
    "numLayers",
    "totalKvHeads",
    "headDim",
    "dtypeBytes",
    "blockSize",
    "numBlocks",
    "tpSize",
  ] as const) {
    checkCount(layout, f, 1);
  }
  checkCount(layout, "tpRank", 0);
  if (layout.numLayers > MAX_KV_LAYERS) {
    throw invalid("numLayers", `numLayers ${layout.numLayers} is above ${MAX_KV_LAYERS}`);
  }
  if (typeof layout.mla !== "boolean") throw invalid("mla", "mla must be a boolean");
  if (typeof layout.dtype !== "string" || layout.dtype === "") {
    throw invalid("dtype", "dtype must be a non-empty name");
  }
  if (layout.order !== "HND" && layout.order !== "NHD") {
    throw invalid("order", `order must be HND or NHD, got ${String(layout.order)}`);
  }
  if (layout.tpRank >= layout.tpSize) {
    throw invalid("tpRank", `tpRank ${layout.tpRank} is not below tpSize ${layout.tpSize}`);
  }
  const heads = layout.totalKvHeads;
  if (layout.mla && heads !== 1) {
    throw invalid("totalKvHeads", `an MLA layout has one latent head, got totalKvHeads ${heads}`);
  }
  if (!layout.mla && heads % layout.tpSize !== 0 && layout.tpSize % heads !== 0) {
    throw invalid(
      "tpSize",
      `TP ${layout.tpSize} does not divide the ${heads} KV heads (nor is it a multiple of them)`,
    );
  }
  // After the head split: a stride derived from an impossible split is not the problem to name.
  checkCount(layout, "blockStride", 0);
  const bb = kvBlockBytes(layout);
  if (!Number.isSafeInteger(bb * layout.numBlocks)) {
    throw invalid("numBlocks", `block bytes ${bb} x numBlocks ${layout.numBlocks} is too large`);
  }
  const row = kvRowBytes(layout);
  checkStride(layout, "headStride", row);
  checkStride(layout, "tokenStride", row);
  const hs = headStride(layout);
  const ts = tokenStride(layout);
  const hpr = kvHeadsPerRank(layout);
  const footprint = kvBlockFootprint(layout);
  if (!Number.isSafeInteger(footprint)) {
    throw invalid(
      layout.order === "HND" ? "headStride" : "tokenStride",
      "one block spans too many bytes",
    );
  }
  // The outer of heads and tokens must step over all of the inner: rows never overlap, and
  // `order` says which is outer. Exact: the last inner row must end by the next outer start.
  if (layout.order === "HND" && hpr > 1 && hs < (layout.blockSize - 1) * ts + row) {
    throw invalid(
      "headStride",
      `headStride ${hs} makes heads overlap: a head's ${layout.blockSize} tokens ${ts} bytes apart span ${(layout.blockSize - 1) * ts + row} bytes`,
    );
  }
  if (layout.order === "NHD" && layout.blockSize > 1 && ts < (hpr - 1) * hs + row) {
    throw invalid(
      "tokenStride",
      `tokenStride ${ts} makes tokens overlap: a token's ${hpr} heads ${hs} bytes apart span ${(hpr - 1) * hs + row} bytes`,
    );
  }
  if (layout.opaqueBlocks !== undefined && typeof layout.opaqueBlocks !== "boolean") {
    throw invalid("opaqueBlocks", "opaqueBlocks must be a boolean");
  }
  if (layout.opaqueBlocks === true && (layout.order !== "HND" || ts !== row)) {
    throw invalid(
      "opaqueBlocks",
      `opaque blocks need HND order with a head's rows dense (tokenStride ${row}), got ${layout.order} with tokenStride ${ts}`,
    );
  }
  checkRunOrders(layout, ts, row);
  if (layout.numBlocks > 1 && layout.blockStride < footprint) {
    throw invalid(
      "blockStride",
      `blockStride ${layout.blockStride} is below the ${footprint} bytes one block of a slot spans`,
    );
  }
  if (!Array.isArray(layout.regionBytes) || layout.regionBytes.length === 0) {
    throw invalid("regionBytes", "regionBytes must list at least one region");
  }
  layout.regionBytes.forEach((n, i) => {
    if (!Number.isSafeInteger(n) || n < 0) {
      throw invalid("regionBytes", `regionBytes[${i}] must be a byte count, got ${String(n)}`);
    }
  });
  const nSlots = layout.numLayers * kvPerLayer(layout);
  if (!Array.isArray(layout.slots) || layout.slots.length !== nSlots) {
    throw invalid(
      "slots",
      `slots must have numLayers x ${kvPerLayer(layout)} = ${nSlots} entries, got ${String(layout.slots?.length)}`,
    );
  }
  const span = (layout.numBlocks - 1) * layout.blockStride + footprint;
  if (!Number.isSafeInteger(span)) throw invalid("blockStride", "blocks span too many bytes");
  layout.slots.forEach((slot, s) => {
    const r = slot?.region;
    const size = typeof r === "number" ? layout.regionBytes[r] : undefined;
    if (!Number.isInteger(r) || size === undefined) {
      throw invalid("slots", `slots[${s}].region ${String(r)} is not a region of this layout`);
    }
    if (!Number.isSafeInteger(slot.offset) || slot.offset < 0 || slot.offset + span > size) {
      throw invalid(
        "slots",
        `slots[${s}] spans bytes ${slot.offset}..${slot.offset + span} of region ${r}, which has ${size}`,
      );
    }
  });
  const hnd = layout.order === "HND";
  const lattice = new Float64Array([
    layout.blockStride,
    layout.numBlocks,
    footprint,
    hnd ? hs : ts,
    hnd ? hpr : layout.blockSize,
    hnd ? (layout.blockSize - 1) * ts + row : (hpr - 1) * hs + row,
    hnd ? ts : hs,
    hnd ? layout.blockSize : hpr,
    row,
  ]);
  checkSlotsDisjoint(layout, lattice, span);
}

/** Run orders: one per kv, each a divisor of the head and of the block, over dense HND rows. */
function checkRunOrders(layout: KvLayout, ts: number, row: number): void {
  const orders = layout.runOrders;
  if (orders === undefined) return;
  const nKv = kvPerLayer(layout);
  if (!Array.isArray(orders) || orders.length !== nKv) {
    throw invalid(
      "runOrders",
      `runOrders must have ${nKv} entries (one per kv), got ${String(orders?.length)}`,
    );
  }
  orders.forEach((o, kv) => {
    const g = o?.dimGroup;
    const t = o?.tokenTile;
    if (!Number.isSafeInteger(g) || g < 1 || layout.headDim % g !== 0) {
      throw invalid(
        "runOrders",
        `runOrders[${kv}].dimGroup ${String(g)} does not divide headDim ${layout.headDim}`,
      );
    }
    if (!Number.isSafeInteger(t) || t < 1 || layout.blockSize % t !== 0) {
      throw invalid(
        "runOrders",
        `runOrders[${kv}].tokenTile ${String(t)} does not divide blockSize ${layout.blockSize}`,
      );
    }
  });
  if (layout.order !== "HND" || ts !== row) {
    throw invalid(
      "runOrders",
      `run orders need HND order with a head's rows dense (tokenStride ${row}), got ${layout.order} with tokenStride ${ts}`,
    );
  }
}

/**
 * Whether a slot's rows meet the same rows shifted by `e` bytes. A slot is a three-level lattice
 * (`lattice` holds `stride, count, span of one element` for blocks, the outer and the inner of
 * heads and tokens; the innermost element is one row). Level `i` meets its shift when some
 * `e + k * stride`, `|k| < count`, is closer than one element's span and the level below meets
 * that shift. Validation makes every stride at least the span below it, so only the two `k`
 * around `-e / stride` can be that close: at most 2^3 leaf tests per pair of slots.
 */
function latticeMeets(lattice: Float64Array, level: number, e: number): boolean {
  const stride = lattice[3 * level]!;
  const count = lattice[3 * level + 1]!;
  const span = lattice[3 * level + 2]!;
  const last = level === 2;
  if (count === 1) return last ? Math.abs(e) < span : latticeMeets(lattice, level + 1, e);
  // f(k) = e + k * stride grows with k; k0 is the last k with f(k) <= 0.
  let k0 = Math.floor(-e / stride);
  while (e + k0 * stride > 0) k0--;
  while (e + (k0 + 1) * stride <= 0) k0++;
  for (let k = k0; k <= k0 + 1; k++) {
    const kc = Math.min(count - 1, Math.max(1 - count, k));
    const f = e + kc * stride;
    if (Math.abs(f) < span && (last || latticeMeets(lattice, level + 1, f))) return true;
  }
  return false;
}

/**
 * Two slots of one region overlap when a row of one meets a row of the other. Every slot has the
 * same lattice, so that depends only on the difference of their offsets (`latticeMeets`). Slots
 * sorted by offset are compared only with those starting less than a slot's span further on, so
 * slots laid out one after another cost a comparison each, and K and V interleaved per head or
 * per row (vLLM's CPU and fused-cell layouts) are accepted while any real overlap is refused.
 */
function checkSlotsDisjoint(layout: KvLayout, lattice: Float64Array, span: number): void {
  const byRegion = new Map<number, number[]>();
  layout.slots.forEach((slot, s) => {
    const list = byRegion.get(slot.region);
    if (list) list.push(s);
    else byRegion.set(slot.region, [s]);
  });
  for (const list of byRegion.values()) {
    list.sort((a, b) => layout.slots[a]!.offset - layout.slots[b]!.offset);
    const offsets = Float64Array.from(list, (s) => layout.slots[s]!.offset);
    for (let x = 0; x < list.length; x++) {
      for (let y = x + 1; y < list.length && offsets[y]! - offsets[x]! < span; y++) {
        if (latticeMeets(lattice, 0, offsets[y]! - offsets[x]!)) {
          const a = Math.min(list[x]!, list[y]!);
          const b = Math.max(list[x]!, list[y]!);
          throw invalid(
            "slots",
            `slots[${a}] and slots[${b}] overlap in region ${layout.slots[a]!.region}`,
          );
        }
      }
    }
  }
}
