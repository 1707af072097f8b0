import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";
import {
  EngineToSidecarSchema,
  ExpectKvSchema,
  PrefillDoneSchema,
  RankKvCacheSchema,
  RegionFileSchema,
  RegisterKvCacheSchema,
} from "../../src/gen/kvxfer/v1/engine_pb.js";
import { KvBlockListSchema } from "../../src/gen/kvxfer/v1/layout_pb.js";
import { checkEngineMessage, checkRegisterKvCache } from "../../src/engine/validate.js";
import { type KvGroup, type KvLayout, kvLayout } from "../../src/plan/index.js";
import { kvGroupsToProto, kvLayoutToProto } from "../../src/plan/layout-proto.js";

// A hybrid engine: full attention, a sliding window and a state group over one region.
const attention: KvLayout = kvLayout(
  {
    numLayers: 1,
    mla: false,
    totalKvHeads: 2,
    headDim: 8,
    dtype: "bfloat16",
    dtypeBytes: 2,
    blockSize: 16,
    numBlocks: 32,
    order: "HND",
    tpSize: 1,
    tpRank: 0,
  },
  "one-region-layers-first",
);
const state: KvLayout = {
  ...attention,
  mla: true,
  totalKvHeads: 1,
  headDim: 100,
  dtype: "uint8",
  dtypeBytes: 1,
  blockSize: 1,
  slots: [{ region: 0, offset: 0 }],
};
const GROUPS: KvGroup[] = [
  { kind: "full", layout: attention },
  { kind: "sliding", slidingWindow: 32, layout: attention },
  { kind: "state", stateShape: "uint8[100]", layout: state },
];

const list = (firstBlock: number, blockIds: number[]) =>
  create(KvBlockListSchema, { firstBlock, blockIds });

function register(groups = kvGroupsToProto(GROUPS), layout = kvLayoutToProto(attention)) {
  return create(RegisterKvCacheSchema, {
    engineId: "e",
    layout,
    groups,
    ranks: [
      create(RankKvCacheSchema, {
        rank: 0,
        regions: [
          create(RegionFileSchema, {
            path: "/dev/shm/x",
            length: BigInt(attention.regionBytes[0]!),
          }),
        ],
      }),
    ],
  });
}

const prefill = (groups: ReturnType<typeof list>[], f: Record<string, unknown> = {}) =>
  create(EngineToSidecarSchema, {
    msg: {
      case: "prefillDone",
      value: create(PrefillDoneSchema, { transferId: "t", numTokens: 70, groups, ...f }),
    },
  });
const expectKv = (f: Record<string, unknown>) =>
  create(EngineToSidecarSchema, {
    msg: {
      case: "expectKv",
      value: create(ExpectKvSchema, { transferId: "t", source: "h:1", numTokens: 70, ...f }),
    },
  });

describe("engine messages of a hybrid engine", () => {
  const good = [list(0, [1, 2, 3, 4, 5]), list(3, [8, 9]), list(0, [20])];

  it("a registration with groups gives each group its layout", () => {
    const r = checkRegisterKvCache(register());
    expect(r.ok).toBe(true);
    if (r.ok)
      expect(r.cache.groups.map((g) => [g.kind, g.slidingWindow, g.stateShape])).toEqual([
        ["full", undefined, undefined],
        ["sliding", 32, undefined],
        ["state", undefined, "uint8[100]"],
      ]);
  });

  it("refuses groups that do not describe the engine", () => {
    const bad = (
      groups: ReturnType<typeof kvGroupsToProto>,
      layout = kvLayoutToProto(attention),
    ) => {
      const r = checkRegisterKvCache(register(groups, layout));
      return r.ok ? undefined : r.problem.message;
    };
    expect(bad(kvGroupsToProto([GROUPS[2]!, GROUPS[0]!]))).toMatch(
      /layout must be groups\[0\]\.layout/,
    );
    expect(bad(kvGroupsToProto([{ ...GROUPS[0]!, kind: "sliding" }]))).toMatch(
      /groups\[0\]: slidingWindow undefined must be an integer >= 1|groups\[0\]: slidingWindow 0/,
    );
    expect(
      bad(kvGroupsToProto([GROUPS[0]!, { ...GROUPS[2]!, layout: { ...state, blockSize: 2 } }])),
    ).toMatch(/groups\[1\]: a state group's layout has blocks of one token/);
    expect(
      bad(
        kvGroupsToProto([
          GROUPS[0]!,
          { kind: "full", layout: { ...attention, regionBytes: [1 << 30] } },
        ]),
      ),
    ).toMatch(/groups\[1\].layout.regionBytes|groups\[1\].layout.slots/);
  });

  it("takes one list per group: null blocks before a window's tail are simply not named", () => {
    const groups = checkRegisterKvCache(register());
    if (!groups.ok) throw new Error(groups.problem.message);
    const g = groups.cache.groups;
    expect(checkEngineMessage(prefill(good), g)).toBeUndefined();
    expect(checkEngineMessage(expectKv({ groups: good }), g)).toBeUndefined();
    expect(
      checkEngineMessage(
        expectKv({ groups: good, sourceGroups: good, hasSourceBlockIds: true }),
        g,
      ),
    ).toBeUndefined();
    const refused = (m: ReturnType<typeof prefill>) => {
      const p = checkEngineMessage(m, g);
      return p === undefined ? undefined : `${p.code}: ${p.message}`;
    };
    expect(refused(prefill([]))).toMatch(
      /ERR_BAD_BLOCKS: block_ids is empty: the engine registered 3 KV cache groups/,
    );
    expect(refused(prefill(good.slice(0, 2)))).toMatch(
      /groups lists 2 block lists, the engine registered 3 groups/,
    );
    expect(refused(prefill(good, { blockIds: [1] }))).toMatch(
      /block_ids and groups are both given/,
    );
    expect(refused(prefill([list(1, [2, 3, 4, 5]), good[1]!, good[2]!]))).toMatch(
      /groups\[0\].first_block 1: group 0 \(full\) holds every block from 0/,
    );
    expect(refused(prefill([good[0]!, list(3, [8]), good[2]!]))).toMatch(
      /groups\[1\].block_ids lists 1 ids, the tokens need 2/,
    );
    expect(refused(prefill([good[0]!, good[1]!, list(0, [20, 21])]))).toMatch(
      /group 2 \(state\) names its one state slot, got 2 ids/,
    );
    // A real block named twice, in one group or across groups, is refused as before.
    expect(refused(prefill([good[0]!, list(3, [8, 8]), good[2]!]))).toMatch(
      /block_ids\[1\] = 8 is listed twice/,
    );
    expect(refused(prefill([good[0]!, list(3, [8, 1]), good[2]!]))).toMatch(
      /groups\[1\].block_ids\[1\] = 1 is listed twice in the transfer/,
    );
    expect(refused(prefill([good[0]!, good[1]!, list(0, [40])]))).toMatch(
      /= 40 is not below numBlocks 32/,
    );
    expect(
      refused(expectKv({ groups: good, sourceGroups: good.slice(1), hasSourceBlockIds: true })),
    ).toMatch(/source_groups lists 2 block lists, the engine registered 3 groups/);
  });
});
