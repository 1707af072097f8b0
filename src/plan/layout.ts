import { PlanError } from "./errors.js";

/**
 * Order of tokens and heads inside one block of one (layer, K|V) slot:
 * `HND` is `[head][token][dim]`, `NHD` is `[token][head][dim]`.
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
}

/** The shape of a layout without its addressing, as `kvLayout` takes it. */
export type KvLayoutShape = Omit<KvLayout, "blockStride" | "slots" | "regionBytes">;

/**
 * Common ways engines place a rank's KV cache in memory:
 * - `region-per-layer`: one region per layer holding `[K|V][block]` (vLLM FlashAttention).
 * - `region-per-layer-kv`: one region per slot holding `[block]`.
 * - `region-per-layer-blocks-first`: one region per layer holding `[block][K|V]` (FlashInfer).
 * - `one-region-blocks-first`: one region holding `[block][layer][K|V]` (cross-layer layout).
 * - `one-region-layers-first`: one region holding `[layer][K|V][block]`.
 */
export type KvRegionScheme =
  | "region-per-layer"
  | "region-per-layer-kv"
  | "region-per-layer-blocks-first"
  | "one-region-blocks-first"
  | "one-region-layers-first";

/** 2 for K and V, 1 for an MLA latent. */
export function kvPerLayer(layout: Pick<KvLayout, "mla">): number {
  return layout.mla ? 1 : 2;
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

/** Bytes of one block of one slot on one rank. */
export function kvBlockBytes(
  layout: Pick<
    KvLayout,
    "mla" | "totalKvHeads" | "tpSize" | "blockSize" | "headDim" | "dtypeBytes"
  >,
): number {
  return layout.blockSize * kvHeadsPerRank(layout) * layout.headDim * layout.dtypeBytes;
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
  }
  return { ...shape, blockStride, slots, regionBytes };
}

function invalid(field: string, message: string): PlanError {
  return new PlanError("ERR_LAYOUT_INVALID", field, message);
}

function checkCount(layout: KvLayout, field: keyof KvLayout, min: number): void {
  const v = layout[field];
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < min) {
    throw invalid(field, `${field} must be an integer >= ${min}, got ${String(v)}`);
  }
}

/**
 * Checks a layout on its own: positive sizes, heads that split over `tpSize`, one address per
 * slot, every block of every slot inside its region, and no two blocks overlapping. A layout from
 * the network passes this before it is planned with. Throws `PlanError` `ERR_LAYOUT_INVALID`.
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
  checkCount(layout, "blockStride", 0);
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
      `totalKvHeads ${heads} cannot be split over tpSize ${layout.tpSize} (neither divides the other)`,
    );
  }
  const bb = kvBlockBytes(layout);
  if (!Number.isSafeInteger(bb * layout.numBlocks)) {
    throw invalid("numBlocks", `block bytes ${bb} x numBlocks ${layout.numBlocks} is too large`);
  }
  if (layout.numBlocks > 1 && layout.blockStride < bb) {
    throw invalid("blockStride", `blockStride ${layout.blockStride} is below block bytes ${bb}`);
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
  const span = (layout.numBlocks - 1) * layout.blockStride + bb;
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
  checkSlotsDisjoint(layout, bb);
}

/**
 * Two slots in one region overlap when some block of one meets some block of the other:
 * offsets `o1 + i * S` and `o2 + j * S` closer than a block. With `d = o2 - o1` that is
 * `|d + k * S| < bb` for some `k = j - i` in `[-(n - 1), n - 1]`; the `k` nearest `-d / S` decides.
 */
function checkSlotsDisjoint(layout: KvLayout, bb: number): void {
  const n = layout.numBlocks;
  const stride = layout.blockStride;
  const byRegion = new Map<number, number[]>();
  layout.slots.forEach((slot, s) => {
    const list = byRegion.get(slot.region);
    if (list) list.push(s);
    else byRegion.set(slot.region, [s]);
  });
  for (const list of byRegion.values()) {
    const offsets = Float64Array.from(list, (s) => layout.slots[s]!.offset);
    for (let x = 0; x < list.length; x++) {
      for (let y = x + 1; y < list.length; y++) {
        const d = offsets[y]! - offsets[x]!;
        let overlap = Math.abs(d) < bb;
        if (!overlap && n > 1 && stride > 0) {
          // f(k) = d + k * S grows with k: the k nearest its zero, clamped to the range, decides.
          const k0 = Math.floor(-d / stride);
          const lo = Math.min(n - 1, Math.max(1 - n, k0));
          const hi = Math.min(n - 1, Math.max(1 - n, k0 + 1));
          overlap = Math.abs(d + lo * stride) < bb || Math.abs(d + hi * stride) < bb;
        }
        if (overlap) {
          const a = list[x]!;
          const b = list[y]!;
          throw invalid(
            "slots",
            `slots[${a}] and slots[${b}] overlap in region ${layout.slots[a]!.region}`,
          );
        }
      }
    }
  }
}
