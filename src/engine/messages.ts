/** Builders of the engine link's messages (protobuf-es `create`), for either end. */
import { create } from "@bufbuild/protobuf";

import {
  type EngineToSidecar,
  EngineToSidecarSchema,
  RankKvCacheSchema,
  RegionFileSchema,
  type RegisterKvCache,
  RegisterKvCacheSchema,
  type SidecarToEngine,
  SidecarToEngineSchema,
} from "../gen/kvxfer/v1/engine_pb.js";
import type { KvLayout } from "../plan/index.js";
import { kvLayoutToProto } from "../plan/layout-proto.js";

/** Wraps one engine message for `EngineLinkClient.send`. */
export function engineMessage<K extends NonNullable<EngineToSidecar["msg"]["case"]>>(
  kind: K,
  value: Extract<EngineToSidecar["msg"], { case: K }>["value"],
): EngineToSidecar {
  return create(EngineToSidecarSchema, { msg: { case: kind, value } as EngineToSidecar["msg"] });
}

/**
 * A `RegisterKvCache` for `layout`, whole regions: region `g` of rank `r` is `regions[r][g]`,
 * a file's path, or the id of a segment the sidecar allocated (`AllocateKv`).
 */
export function kvCacheRegistration(
  engineId: string,
  layout: KvLayout,
  regions: readonly (readonly (string | number)[])[],
): RegisterKvCache {
  return create(RegisterKvCacheSchema, {
    engineId,
    layout: kvLayoutToProto(layout),
    ranks: regions.map((sources, rank) =>
      create(RankKvCacheSchema, {
        rank,
        regions: sources.map((source, g) =>
          create(RegionFileSchema, {
            path: typeof source === "string" ? source : "",
            offset: 0n,
            length: BigInt(layout.regionBytes[g]!),
            ...(typeof source === "number" ? { segment: source } : {}),
          }),
        ),
      }),
    ),
  });
}

/** Wraps one sidecar message for `EngineLinkServer.send`. */
export function sidecarMessage<K extends NonNullable<SidecarToEngine["msg"]["case"]>>(
  kind: K,
  value: Extract<SidecarToEngine["msg"], { case: K }>["value"],
): SidecarToEngine {
  return create(SidecarToEngineSchema, { msg: { case: kind, value } as SidecarToEngine["msg"] });
}
