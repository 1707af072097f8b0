// RegisterKvCache with CUDA regions (placement `device`, issue 32): a region named by its
// allocation's 64-byte CUDA IPC handle passes through to the sidecar with its device and offset;
// anything else about it is refused naming the field. Opening it is the addon's (cuda*.test.ts).
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { checkRegisterKvCache } from "../../src/engine/validate.js";
import {
  RankKvCacheSchema,
  RegionFileSchema,
  RegisterKvCacheSchema,
} from "../../src/gen/kvxfer/v1/engine_pb.js";
import { kvLayout } from "../../src/plan/index.js";
import { kvLayoutToProto } from "../../src/plan/layout-proto.js";

const layout = kvLayout({
  numLayers: 2,
  mla: false,
  totalKvHeads: 8,
  headDim: 128,
  dtype: "bfloat16",
  dtypeBytes: 2,
  blockSize: 16,
  numBlocks: 64,
  order: "NHD",
  tpSize: 2,
  tpRank: 0,
});

function handle(seed: number): Uint8Array {
  return Uint8Array.from({ length: 64 }, (_, i) => (i * 31 + seed) & 0xff);
}

function registerMsg() {
  return create(RegisterKvCacheSchema, {
    engineId: "gpu-p",
    layout: kvLayoutToProto(layout),
    ranks: Array.from({ length: 2 }, (_, rank) =>
      create(RankKvCacheSchema, {
        rank,
        regions: layout.regionBytes.map((n) =>
          create(RegionFileSchema, {
            cudaIpcHandle: handle(rank),
            cudaDevice: rank,
            offset: 4096n,
            length: BigInt(n),
          }),
        ),
      }),
    ),
  });
}

describe("RegisterKvCache with CUDA IPC regions", () => {
  it("carries each rank's handle, device and offset into the allocation", () => {
    const r = checkRegisterKvCache(registerMsg());
    if (!r.ok) throw new Error(r.problem.message);
    for (const rank of [0, 1]) {
      const g = r.cache.ranks[rank]!.regions[0]!;
      expect(g.path).toBe("");
      expect(g.segment).toBeUndefined();
      expect(g.offset).toBe(4096);
      expect(g.cudaIpc?.device).toBe(rank);
      expect(Array.from(g.cudaIpc!.handle)).toEqual(Array.from(handle(rank)));
    }
  });

  it("refuses a handle of the wrong size, or a handle with a path or a segment", () => {
    const bad = (edit: (m: ReturnType<typeof registerMsg>) => void): string => {
      const m = registerMsg();
      edit(m);
      const r = checkRegisterKvCache(m);
      if (r.ok) throw new Error("accepted");
      expect(r.problem.code).toBe("ERR_BAD_REGIONS");
      return r.problem.message;
    };
    expect(bad((m) => (m.ranks[1]!.regions[0]!.cudaIpcHandle = new Uint8Array(63)))).toBe(
      "ranks[1].regions[0].cuda_ipc_handle has 63 bytes, a CUDA IPC handle 64",
    );
    expect(bad((m) => (m.ranks[0]!.regions[0]!.path = "/dev/shm/x"))).toMatch(
      /names a CUDA IPC handle: path must be empty/,
    );
    expect(bad((m) => (m.ranks[0]!.regions[0]!.segment = 7))).toMatch(/no segment given/);
    expect(bad((m) => (m.ranks[0]!.regions[0]!.length = 10n))).toMatch(/is below the region's/);
  });
});
