import { create } from "@bufbuild/protobuf";
import {
  KvBlockOrder as KvBlockOrderPb,
  type KvBlockList as KvBlockListPb,
  KvBlockListSchema,
  type KvCacheGroup as KvCacheGroupPb,
  KvCacheGroupSchema,
  KvGroupKind as KvGroupKindPb,
  type KvLayout as KvLayoutPb,
  KvLayoutSchema,
  KvRunOrderSchema,
  KvSlotAddressSchema,
} from "../gen/kvxfer/v1/layout_pb.js";
import { PlanError } from "./errors.js";
import {
  type BlockList,
  type KvGroup,
  type KvGroupKind,
  MAX_KV_GROUPS,
  groupProblem,
  singleGroup,
} from "./groups.js";
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

const KIND_TO_PB: Record<KvGroupKind, KvGroupKindPb> = {
  full: KvGroupKindPb.FULL,
  sliding: KvGroupKindPb.SLIDING,
  state: KvGroupKindPb.STATE,
};

/** The wire form of an engine's groups (`kvxfer.v1.KvCacheGroup`). */
export function kvGroupsToProto(groups: readonly KvGroup[]): KvCacheGroupPb[] {
  return groups.map((g) =>
    create(KvCacheGroupSchema, {
      kind: KIND_TO_PB[g.kind],
      slidingWindow: g.slidingWindow ?? 0,
      layout: kvLayoutToProto(g.layout),
      stateShape: g.stateShape ?? "",
    }),
  );
}

/**
 * An engine's groups from the wire (a registration, a peer's metadata), each layout validated:
 * none is one full group with `layout` (the message's own). Throws `PlanError`
 * `ERR_LAYOUT_INVALID` with the field prefixed `groups[g].`.
 */
export function kvGroupsFromProto(
  msgs: readonly KvCacheGroupPb[],
  layout: KvLayout,
): readonly KvGroup[] {
  if (msgs.length === 0) return singleGroup(layout);
  if (msgs.length > MAX_KV_GROUPS) {
    throw new PlanError(
      "ERR_LAYOUT_INVALID",
      "groups",
      `${msgs.length} groups, more than ${MAX_KV_GROUPS}`,
    );
  }
  const out: KvGroup[] = [];
  for (const [g, m] of msgs.entries()) {
    const field = `groups[${g}]`;
    let kind: KvGroupKind;
    if (m.kind === KvGroupKindPb.FULL) kind = "full";
    else if (m.kind === KvGroupKindPb.SLIDING) kind = "sliding";
    else if (m.kind === KvGroupKindPb.STATE) kind = "state";
    else throw new PlanError("ERR_LAYOUT_INVALID", `${field}.kind`, `kind ${m.kind} is not known`);
    if (m.layout === undefined)
      throw new PlanError("ERR_LAYOUT_INVALID", `${field}.layout`, "layout is missing");
    let gl: KvLayout;
    try {
      gl = kvLayoutFromProto(m.layout);
    } catch (err) {
      if (!(err instanceof PlanError)) throw err;
      throw new PlanError(err.code, `${field}.layout.${err.field}`, err.message);
    }
    if (gl.tpSize !== layout.tpSize) {
      throw new PlanError(
        "ERR_LAYOUT_INVALID",
        `${field}.layout.tpSize`,
        `group ${g} has tpSize ${gl.tpSize}, the engine ${layout.tpSize}`,
      );
    }
    if (
      gl.regionBytes.length !== layout.regionBytes.length ||
      gl.regionBytes.some((n, i) => n !== layout.regionBytes[i])
    ) {
      throw new PlanError(
        "ERR_LAYOUT_INVALID",
        `${field}.layout.regionBytes`,
        `group ${g} addresses other regions than the engine registered`,
      );
    }
    const group: KvGroup = {
      kind,
      layout: { ...gl, tpRank: layout.tpRank },
      ...(kind === "sliding" ? { slidingWindow: m.slidingWindow } : {}),
      ...(m.slidingWindow !== 0 && kind !== "sliding" ? { slidingWindow: m.slidingWindow } : {}),
      ...(kind === "state" ? { stateShape: m.stateShape } : {}),
    };
    const problem = groupProblem(group);
    if (problem !== undefined) throw new PlanError("ERR_LAYOUT_INVALID", field, problem);
    out.push(group);
  }
  return out;
}

/** A block list from the wire; `undefined` entries are checked by the caller. */
export function blockListFromProto(m: KvBlockListPb): BlockList {
  return { first: m.firstBlock, ids: m.blockIds };
}

export function blockListToProto(l: BlockList): KvBlockListPb {
  return create(KvBlockListSchema, { firstBlock: l.first, blockIds: [...l.ids] });
}
