import { PlanError } from "./errors.js";
import { type KvLayout, kvPerLayer, runOrderOf, validateKvLayout } from "./layout.js";

/** The fields P and D must agree on exactly, in the order they are checked. */
const SAME_FIELDS = ["mla", "numLayers", "totalKvHeads", "headDim", "dtype", "dtypeBytes"] as const;

/**
 * Why KV cannot move from a P layout (`src`) to a D layout (`dst`), or `undefined` when it can.
 * Each layout must be valid on its own (`ERR_LAYOUT_INVALID`, field prefixed `src.` or `dst.`);
 * then the model shape must match and one TP size must divide the other
 * (`ERR_LAYOUT_INCOMPATIBLE`). The message names the field and both values. Block sizes, block
 * counts, HND/NHD order and addressing may differ freely, except that K and V runs must be in one
 * order on both sides (`runOrders`, plain rows when absent), and opaque blocks without run orders
 * (`opaqueBlocks`) need both sides opaque with one block size.
 */
export function findIncompatibility(src: KvLayout, dst: KvLayout): PlanError | undefined {
  for (const [side, layout] of [
    ["src", src],
    ["dst", dst],
  ] as const) {
    try {
      validateKvLayout(layout);
    } catch (err) {
      if (!(err instanceof PlanError)) throw err;
      return new PlanError(err.code, `${side}.${err.field}`, `${side} layout: ${err.message}`);
    }
  }
  for (const field of SAME_FIELDS) {
    if (src[field] !== dst[field]) {
      return new PlanError(
        "ERR_LAYOUT_INCOMPATIBLE",
        field,
        `${field} differs: P has ${String(src[field])}, D has ${String(dst[field])}`,
      );
    }
  }
  const runs = findRunOrderMismatch(src, dst);
  if (runs !== undefined) return runs;
  if (src.tpSize % dst.tpSize !== 0 && dst.tpSize % src.tpSize !== 0) {
    return new PlanError(
      "ERR_LAYOUT_INCOMPATIBLE",
      "tpSize",
      `tpSize does not divide either way: P has ${src.tpSize}, D has ${dst.tpSize}`,
    );
  }
  return undefined;
}

/** Throws the `PlanError` `findIncompatibility` returns. */
export function assertCompatible(src: KvLayout, dst: KvLayout): void {
  const err = findIncompatibility(src, dst);
  if (err) throw err;
}

/**
 * Run orders (`KvRunOrder`) must match kv by kv: bytes copied in one order cannot land in another.
 * Where either side is opaque with no run order, the whole-block rule: both opaque, one block size.
 */
function findRunOrderMismatch(src: KvLayout, dst: KvLayout): PlanError | undefined {
  const known = (l: KvLayout) => l.runOrders !== undefined || l.opaqueBlocks !== true;
  if (known(src) && known(dst)) {
    for (let kv = 0; kv < kvPerLayer(src); kv++) {
      const a = runOrderOf(src, kv)!;
      const b = runOrderOf(dst, kv)!;
      if (a.dimGroup !== b.dimGroup || a.tokenTile !== b.tokenTile) {
        const what = (o: typeof a) => `dimGroup ${o.dimGroup}, tokenTile ${o.tokenTile}`;
        return new PlanError(
          "ERR_LAYOUT_INCOMPATIBLE",
          "runOrders",
          `runOrders differ for ${kv === 0 ? "K" : "V"}: P has ${what(a)}, D has ${what(b)} (the engines order a head's elements differently)`,
        );
      }
    }
    return undefined;
  }
  const srcOpaque = src.opaqueBlocks === true;
  const dstOpaque = dst.opaqueBlocks === true;
  if (srcOpaque !== dstOpaque) {
    return new PlanError(
      "ERR_LAYOUT_INCOMPATIBLE",
      "opaqueBlocks",
      `opaqueBlocks differs: P has ${srcOpaque}, D has ${dstOpaque} (a token order private to one engine cannot be mapped to another's)`,
    );
  }
  if (src.blockSize !== dst.blockSize) {
    return new PlanError(
      "ERR_LAYOUT_INCOMPATIBLE",
      "blockSize",
      `blockSize differs: P has ${src.blockSize}, D has ${dst.blockSize}; opaque blocks move whole, so both sides need one block size`,
    );
  }
  return undefined;
}
