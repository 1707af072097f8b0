import { create } from "@bufbuild/protobuf";
import {
  KvBlockOrder as KvBlockOrderPb,
  type KvLayout as KvLayoutPb,
  KvLayoutSchema,
  KvRunOrderSchema,
  KvSlotAddressSchema,
} from "../gen/kvxfer/v1/layout_pb.js";
import { PlanError } from "./errors.js";
import { type KvLayout, validateKvLayout } from "./layout.js";

/** The wire form of a layout (`kvxfer.v1.KvLayout`). */
export function kvLayoutToProto(layout: KvLayout): KvLayoutPb {
  return create(KvLayoutSchema, {
    numLayers: layout.numLayers,
    mla: layout.mla,
    totalKvHeads: layout.totalKvHeads,
    headDim: layout.headDim,
    dtype: layout.dtype,
    dtypeBytes: layout.dtypeBytes,
    blockSize: layout.blockSize,
    numBlocks: layout.numBlocks,
    order: layout.order === "HND" ? KvBlockOrderPb.HND : KvBlockOrderPb.NHD,
    tpSize: layout.tpSize,
    tpRank: layout.tpRank,
    blockStride: BigInt(layout.blockStride),
    slots: layout.slots.map((s) =>
      create(KvSlotAddressSchema, { region: s.region, offset: BigInt(s.offset) }),
    ),
    regionBytes: layout.regionBytes.map((n) => BigInt(n)),
    // Absent (dense) travels as 0, which the wire defines as dense too.
    headStride: BigInt(layout.headStride ?? 0),
    tokenStride: BigInt(layout.tokenStride ?? 0),
    opaqueBlocks: layout.opaqueBlocks === true,
    runOrders: (layout.runOrders ?? []).map((o) =>
      create(KvRunOrderSchema, { dimGroup: o.dimGroup, tokenTile: o.tokenTile }),
    ),
  });
}

function toNumber(v: bigint, field: string): number {
  if (v > BigInt(Number.MAX_SAFE_INTEGER)) {
    throw new PlanError("ERR_LAYOUT_INVALID", field, `${field} ${v} is beyond 2^53 bytes`);
  }
  return Number(v);
}

/**
 * A layout from the wire, validated (`validateKvLayout`): a peer's layout is not trusted.
 * Throws `PlanError` `ERR_LAYOUT_INVALID`.
 */
export function kvLayoutFromProto(msg: KvLayoutPb): KvLayout {
  let order: KvLayout["order"];
  if (msg.order === KvBlockOrderPb.HND) order = "HND";
  else if (msg.order === KvBlockOrderPb.NHD) order = "NHD";
  else throw new PlanError("ERR_LAYOUT_INVALID", "order", `order ${msg.order} is not HND or NHD`);
  const layout: KvLayout = {
    numLayers: msg.numLayers,
    mla: msg.mla,
    totalKvHeads: msg.totalKvHeads,
    headDim: msg.headDim,
    dtype: msg.dtype,
    dtypeBytes: msg.dtypeBytes,
    blockSize: msg.blockSize,
    numBlocks: msg.numBlocks,
    order,
    tpSize: msg.tpSize,
    tpRank: msg.tpRank,
    blockStride: toNumber(msg.blockStride, "blockStride"),
    slots: msg.slots.map((s) => ({ region: s.region, offset: toNumber(s.offset, "slots") })),
    regionBytes: msg.regionBytes.map((n) => toNumber(n, "regionBytes")),
    // 0 on the wire is dense; the field is left out then, as `kvLayout` leaves it out.
    ...(msg.headStride !== 0n ? { headStride: toNumber(msg.headStride, "headStride") } : {}),
    ...(msg.tokenStride !== 0n ? { tokenStride: toNumber(msg.tokenStride, "tokenStride") } : {}),
    ...(msg.opaqueBlocks ? { opaqueBlocks: true } : {}),
    // None on the wire is plain rows; the field is left out then.
    ...(msg.runOrders.length > 0
      ? { runOrders: msg.runOrders.map((o) => ({ dimGroup: o.dimGroup, tokenTile: o.tokenTile })) }
      : {}),
  };
  validateKvLayout(layout);
  return layout;
}
