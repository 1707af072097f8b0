// The planner's public face. Protobuf conversion lives in `layout-proto.ts`, so importing this
// module pulls in no generated code.
export { PlanError, type PlanErrorCode } from "./errors.js";
export {
  type KvBlockOrder,
  type KvLayout,
  type KvLayoutShape,
  type KvRunOrder,
  type KvRegionScheme,
  type KvSlotAddress,
  KV_REGION_SCHEMES,
  MAX_KV_LAYERS,
  firstKvHeadOfRank,
  headStride,
  kvBlockBytes,
  kvBlockFootprint,
  kvHeadsPerRank,
  kvLayout,
  kvPerLayer,
  layerSpans,
  splitByLayer,
  type LayerSpans,
  kvRowBytes,
  runOrderOf,
  tokenStride,
  validateKvLayout,
} from "./layout.js";
export { assertCompatible, findIncompatibility } from "./compat.js";
export { type DstRankSources, type HeadSource, mapRanks } from "./ranks.js";
export {
  type LayoutPairing,
  type PlanOptions,
  type PlanRequest,
  type RankPairPlan,
  type RegionPairDescriptors,
  type TransferPlan,
  descriptorsForSide,
  pairLayouts,
  planPaired,
  planTransfer,
} from "./planner.js";
export {
  type BlockList,
  type GroupsPairing,
  type GroupsPlanRequest,
  type KvGroup,
  type KvGroupKind,
  MAX_KV_GROUPS,
  allBlockIds,
  blockLists,
  writtenBlocks,
  findGroupsIncompatibility,
  groupName,
  groupProblem,
  pairGroups,
  planGroups,
  singleGroup,
} from "./groups.js";
