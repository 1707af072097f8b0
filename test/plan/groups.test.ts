import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  type BlockList,
  type KvGroup,
  type KvLayout,
  PlanError,
  findGroupsIncompatibility,
  kvLayout,
  pairGroups,
  pairLayouts,
  planGroups,
  planPaired,
  singleGroup,
  writtenBlocks,
} from "../../src/plan/index.js";

const attention = (tpSize: number, blockSize: number, numLayers = 2): KvLayout =>
  kvLayout(
    {
      numLayers,
      mla: false,
      totalKvHeads: 4,
      headDim: 16,
      dtype: "bfloat16",
      dtypeBytes: 2,
      blockSize,
      numBlocks: 64,
      order: "HND",
      tpSize,
      tpRank: 0,
    },
    "region-per-layer",
  );

/** A state group's layout: one slot per layer, a block of one token holding the state's bytes. */
const stateLayout = (tpSize: number, bytes = 96): KvLayout =>
  kvLayout(
    {
      numLayers: 1,
      mla: true,
      totalKvHeads: 1,
      headDim: bytes,
      dtype: "uint8",
      dtypeBytes: 1,
      blockSize: 1,
      numBlocks: 64,
      order: "HND",
      tpSize,
      tpRank: 0,
    },
    "region-per-layer",
  );

function hybrid(tp: number, block: number, window = 40): KvGroup[] {
  return [
    { kind: "full", layout: attention(tp, block) },
    { kind: "sliding", slidingWindow: window, layout: attention(tp, block, 3) },
    { kind: "state", stateShape: "float32[4,4]", layout: stateLayout(tp) },
  ];
}

/** Distinct ids for each group from `base` (one pool per engine). */
function lists(
  groups: readonly KvGroup[],
  numTokens: number,
  base: number,
  firsts: number[],
): BlockList[] {
  let next = base;
  return groups.map((g, i) => {
    if (g.kind === "state") return { first: 0, ids: [next++] };
    const n = Math.ceil(numTokens / g.layout.blockSize);
    const first = Math.min(firsts[i] ?? 0, n - 1);
    return { first, ids: Array.from({ length: n - first }, () => next++) };
  });
}

/** Every (pair, region pair, src, dst, len) copy of a plan, as strings, sorted. */
function copies(plan: {
  pairs: readonly {
    srcRank: number;
    dstRank: number;
    regionPairs: readonly {
      srcRegion: number;
      dstRegion: number;
      descriptors: Float64Array;
      count: number;
    }[];
  }[];
}): string[] {
  const out: string[] = [];
  for (const p of plan.pairs)
    for (const rp of p.regionPairs)
      for (let i = 0; i < rp.count; i++) {
        const d = rp.descriptors;
        out.push(
          `${p.srcRank}>${p.dstRank} ${rp.srcRegion}>${rp.dstRegion} ${d[3 * i]} ${d[3 * i + 1]} ${d[3 * i + 2]}`,
        );
      }
  return out.sort();
}

describe("KV cache groups", () => {
  it("one merged plan is every group's own plan, pair by pair and region pair by region pair", () => {
    fc.assert(
      fc.property(
        fc.constantFrom(1, 2, 4),
        fc.constantFrom(1, 2, 4),
        fc.constantFrom(8, 16),
        fc.constantFrom(8, 16),
        fc.integer({ min: 1, max: 200 }),
        fc.integer({ min: 0, max: 200 }),
        (ptp, dtp, pb, db, numTokens, prefixRaw) => {
          const src = hybrid(ptp, pb).filter((g) => g.kind !== "state" || ptp === dtp);
          const dst = hybrid(dtp, db).filter((g) => g.kind !== "state" || ptp === dtp);
          const prefixTokens = prefixRaw % (numTokens + 1);
          const srcLists = lists(src, numTokens, 1, [0, 3, 0]);
          const dstLists = lists(dst, numTokens, 1, [0, 2, 0]);
          const plan = planGroups(pairGroups(src, dst), {
            numTokens,
            prefixTokens,
            src: srcLists,
            dst: dstLists,
          });
          const expected: string[] = [];
          let bytes = 0;
          for (let g = 0; g < src.length; g++) {
            const pairing = pairLayouts(src[g]!.layout, dst[g]!.layout);
            const table = (l: BlockList) => [...new Array<number>(l.first).fill(-1), ...l.ids];
            const one =
              src[g]!.kind === "state"
                ? planPaired(pairing, {
                    numTokens: 1,
                    prefixTokens: prefixTokens >= numTokens ? 1 : 0,
                    srcBlockIds: srcLists[g]!.ids,
                    dstBlockIds: dstLists[g]!.ids,
                  })
                : planPaired(pairing, {
                    numTokens,
                    prefixTokens: Math.min(
                      numTokens,
                      Math.max(
                        prefixTokens,
                        srcLists[g]!.first * src[g]!.layout.blockSize,
                        dstLists[g]!.first * dst[g]!.layout.blockSize,
                      ),
                    ),
                    srcBlockIds: table(srcLists[g]!),
                    dstBlockIds: table(dstLists[g]!),
                  });
            expected.push(...copies(one));
            bytes += one.bytes;
          }
          expect(copies(plan)).toEqual(expected.sort());
          expect(plan.bytes).toBe(bytes);
          expect(plan.pairs.reduce((a, p) => a + p.bytes, 0)).toBe(bytes);
        },
      ),
      { numRuns: 150 },
    );
  });

  it("a sliding window moves only the tail both sides hold; the state moves its one slot", () => {
    const g = hybrid(1, 16);
    const pairing = pairGroups(g, g);
    // 100 tokens: 7 blocks; P holds the window's tail from block 4, D from block 5.
    const src = lists(g, 100, 1, [0, 4, 0]);
    const dst = lists(g, 100, 1, [0, 5, 0]);
    const plan = planGroups(pairing, { numTokens: 100, prefixTokens: 0, src, dst });
    const row = 16 * 2; // headDim x bytes
    const full = 2 * 2 * 4 * row * 100; // layers x K|V x heads x row x tokens
    const sliding = 3 * 2 * 4 * row * (100 - 5 * 16); // from D's first held block
    expect(plan.bytes).toBe(full + sliding + 96);
  });

  it("a full group must hold on P every token D needs", () => {
    const g = hybrid(1, 16);
    const src = lists(g, 100, 1, [2, 0, 0]);
    const dst = lists(g, 100, 1, [0, 0, 0]);
    expect(() =>
      planGroups(pairGroups(g, g), { numTokens: 100, prefixTokens: 0, src, dst }),
    ).toThrow(
      expect.objectContaining({ code: "ERR_PLAN_INVALID", field: "groups[0].src[0].first" }),
    );
    // A prefix that covers them: fine.
    expect(
      planGroups(pairGroups(g, g), { numTokens: 100, prefixTokens: 32, src, dst }).bytes,
    ).toBeGreaterThan(0);
  });

  it("refuses what a request cannot be, naming the group", () => {
    const g = hybrid(1, 16);
    const pairing = pairGroups(g, g);
    const ok = lists(g, 50, 1, [0, 0, 0]);
    const run = (src: BlockList[], dst: BlockList[]) => {
      try {
        planGroups(pairing, { numTokens: 50, prefixTokens: 0, src, dst });
      } catch (err) {
        return err as PlanError;
      }
      return undefined;
    };
    expect(run(ok.slice(0, 2), ok)?.field).toBe("groups");
    const twoSlots = [...ok.slice(0, 2), { first: 0, ids: [60, 61] }];
    expect(run(ok, twoSlots)).toMatchObject({ field: "groups[2].blockIds" });
    // One D block named by two groups would take both groups' bytes.
    const clash = [ok[0]!, ok[1]!, { first: 0, ids: [ok[0]!.ids[0]!] }];
    expect(run(ok, clash)).toMatchObject({
      code: "ERR_PLAN_INVALID",
      field: "groups[2].dstBlockIds",
    });
    const far = [ok[0]!, { first: 0, ids: [1, 2, 99, 4] }, ok[2]!];
    expect(run(far, ok)).toMatchObject({ field: "groups[1].srcBlockIds" });
  });

  it("pairs only groups of one kind each, one window, and state of one TP and shape", () => {
    const why = (a: readonly KvGroup[], b: readonly KvGroup[]) => findGroupsIncompatibility(a, b);
    const g = hybrid(1, 16);
    expect(why(g, g)).toBeUndefined();
    expect(why(g, g.slice(0, 2))).toMatchObject({
      field: "groups",
      code: "ERR_LAYOUT_INCOMPATIBLE",
    });
    expect(why(g, [g[1]!, g[0]!, g[2]!])).toMatchObject({ field: "groups[0].kind" });
    expect(why(g, hybrid(1, 16, 64))?.message).toContain(
      "group 1 (sliding): the window is 40 tokens on P, 64 on D",
    );
    expect(why(hybrid(1, 16), hybrid(2, 16))).toMatchObject({ field: "groups[2].tpSize" });
    const other = [g[0]!, g[1]!, { ...g[2]!, stateShape: "float32[4,8]" }];
    expect(why(g, other)).toMatchObject({ field: "groups[2].stateShape" });
    // Attention groups map between TP sizes and block sizes as one layout does.
    const noState = (tp: number, b: number) => hybrid(tp, b).slice(0, 2);
    expect(why(noState(1, 16), noState(4, 32))).toBeUndefined();
    const bad = [{ kind: "full" as const, layout: { ...attention(1, 16), headDim: 8 } }];
    expect(why(bad, [{ kind: "full", layout: attention(1, 16) }])).toMatchObject({
      field: "headDim",
    });
    // One full group each keeps the words it had before groups.
    expect(
      why(singleGroup(attention(1, 16)), singleGroup({ ...attention(1, 16), headDim: 8 }))?.field,
    ).toBe("headDim");
  });

  it("the blocks a transfer writes on D: the moved tail of each group, the state slot", () => {
    const g = hybrid(1, 16);
    const dst: BlockList[] = [
      { first: 0, ids: [1, 2, 3, 4] },
      { first: 2, ids: [7, 8] },
      { first: 0, ids: [9] },
    ];
    expect(writtenBlocks(g, dst, 20, 60)).toEqual([2, 3, 4, 7, 8, 9]);
    expect(writtenBlocks(g, dst, 60, 60)).toEqual([]);
  });
});
