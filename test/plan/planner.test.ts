import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  type KvBlockOrder,
  type KvLayout,
  type KvRegionScheme,
  PlanError,
  assertCompatible,
  descriptorsForSide,
  kvLayout,
  pairLayouts,
  planPaired,
  planTransfer,
} from "../../src/plan/index.js";
import {
  type Model,
  type PlanCase,
  blockIds,
  checkByteExact,
  llama8b,
  makeLayout,
  planCaseArb,
  shape,
  stridedLayout,
} from "./cases.js";
import { addressOf } from "./reference.js";

const deepseekMla: Model = {
  numLayers: 61,
  mla: true,
  totalKvHeads: 1,
  headDim: 576,
  dtype: "bfloat16",
  dtypeBytes: 2,
};

function layout(
  model: Model,
  tpSize: number,
  blockSize: number,
  numBlocks: number,
  order: KvBlockOrder = "HND",
  scheme: KvRegionScheme = "region-per-layer",
): KvLayout {
  return kvLayout(shape(model, { tpSize, blockSize, numBlocks, order }), scheme);
}

function fixedCase(
  src: KvLayout,
  dst: KvLayout,
  numTokens: number,
  prefixTokens: number,
  seed: number,
): PlanCase {
  const srcIds = blockIds(Math.ceil(numTokens / src.blockSize), src.numBlocks, seed);
  const dstIds = blockIds(Math.ceil(numTokens / dst.blockSize), dst.numBlocks, seed + 1);
  return {
    src,
    dst,
    numTokens,
    prefixTokens,
    srcIds,
    dstIds,
    srcIdsGiven: srcIds,
    dstIdsGiven: dstIds,
  };
}

describe("planTransfer against the reference model", () => {
  it("is byte-exact over random layout pairs, TP sizes, block sizes, prefixes and block ids", () => {
    fc.assert(
      fc.property(planCaseArb, (c) => {
        checkByteExact(c);
      }),
      { numRuns: 1000 },
    );
  });

  it("is byte-exact without coalescing too, and coalescing only merges", () => {
    fc.assert(
      fc.property(planCaseArb, (c) => {
        const raw = checkByteExact(c, { coalesce: false });
        expect(raw.descriptorCount).toBe(raw.rawDescriptorCount);
        const merged = planTransfer(c.src, c.dst, {
          numTokens: c.numTokens,
          prefixTokens: c.prefixTokens,
          srcBlockIds: c.srcIdsGiven,
          dstBlockIds: c.dstIdsGiven,
        });
        expect(merged.rawDescriptorCount).toBe(raw.rawDescriptorCount);
        expect(merged.bytes).toBe(raw.bytes);
      }),
      { numRuns: 300 },
    );
  });

  it("plans from a pairing reused across requests exactly as from the two layouts", () => {
    fc.assert(
      fc.property(planCaseArb, fc.nat(), (c, cut) => {
        const pairing = pairLayouts(c.src, c.dst);
        const req = {
          numTokens: c.numTokens,
          prefixTokens: c.prefixTokens,
          srcBlockIds: c.srcIdsGiven,
          dstBlockIds: c.dstIdsGiven,
        };
        // A second request through the same pairing: fewer tokens, or a longer prefix.
        const span = c.numTokens - c.prefixTokens;
        const numTokens = span > 0 ? c.prefixTokens + 1 + (cut % span) : c.numTokens;
        const other = {
          numTokens,
          prefixTokens: c.prefixTokens,
          srcBlockIds: c.srcIdsGiven.slice(0, Math.ceil(numTokens / c.src.blockSize)),
          dstBlockIds: c.dstIdsGiven.slice(0, Math.ceil(numTokens / c.dst.blockSize)),
        };
        for (const r of [req, other, req]) {
          expect(planPaired(pairing, r)).toEqual(planTransfer(c.src, c.dst, r));
        }
      }),
      { numRuns: 300 },
    );
  });

  it("refuses to pair incompatible layouts with assertCompatible's error", () => {
    const src = layout(llama8b, 2, 16, 8);
    const dst = layout({ ...llama8b, headDim: 64 }, 2, 16, 8);
    const expected = (() => {
      try {
        assertCompatible(src, dst);
      } catch (err) {
        return err as PlanError;
      }
      throw new Error("assertCompatible accepted them");
    })();
    expect(expected.code).toBe("ERR_LAYOUT_INCOMPATIBLE");
    expect(() => pairLayouts(src, dst)).toThrow(expected.message);
    try {
      pairLayouts(src, dst);
    } catch (err) {
      expect(err).toBeInstanceOf(PlanError);
      expect((err as PlanError).field).toBe("headDim");
    }
  });

  it("plans rank subsets as the matching part of the full plan", () => {
    fc.assert(
      fc.property(planCaseArb, fc.nat(), fc.nat(), (c, a, b) => {
        const req = {
          numTokens: c.numTokens,
          prefixTokens: c.prefixTokens,
          srcBlockIds: c.srcIdsGiven,
          dstBlockIds: c.dstIdsGiven,
        };
        const full = planTransfer(c.src, c.dst, req);
        const srcRank = a % c.src.tpSize;
        const dstRank = b % c.dst.tpSize;
        const part = planTransfer(c.src, c.dst, req, { srcRanks: [srcRank], dstRanks: [dstRank] });
        expect(part.pairs).toEqual(
          full.pairs.filter((p) => p.srcRank === srcRank && p.dstRank === dstRank),
        );
      }),
      { numRuns: 100 },
    );
  });

  it("covers the corners: partial last block, unaligned prefix, P block < = > D block, NHD head split", () => {
    const model: Model = { ...llama8b, numLayers: 2, headDim: 4 };
    for (const [bp, bd] of [
      [16, 16],
      [16, 64],
      [64, 16],
      [16, 24],
      [1, 256],
      [256, 1],
    ] as const) {
      for (const [tpP, tpD] of [
        [2, 4],
        [4, 2],
        [1, 8],
        [8, 1],
      ] as const) {
        for (const [op, od] of [
          ["HND", "HND"],
          ["NHD", "NHD"],
          ["HND", "NHD"],
          ["NHD", "HND"],
        ] as const) {
          const numTokens = 301;
          const src = layout(model, tpP, bp, Math.ceil(numTokens / bp) + 3, op);
          const dst = layout(model, tpD, bd, Math.ceil(numTokens / bd) + 3, od);
          checkByteExact(fixedCase(src, dst, numTokens, 37, bp * 31 + bd));
        }
      }
    }
  });

  it("moves nothing when the prefix covers every token, but keeps the rank pairs", () => {
    const src = layout(llama8b, 2, 16, 8);
    const dst = layout(llama8b, 4, 16, 8);
    const plan = planTransfer(src, dst, {
      numTokens: 40,
      prefixTokens: 40,
      srcBlockIds: [-1, -1, -1],
      dstBlockIds: [-1, -1, -1],
    });
    expect(plan.bytes).toBe(0);
    expect(plan.descriptorCount).toBe(0);
    expect(plan.pairs.map((p) => [p.srcRank, p.dstRank])).toEqual([
      [0, 0],
      [0, 1],
      [1, 2],
      [1, 3],
    ]);
  });
});

describe("Llama-3-8B (32 layers, 8 KV heads, head 128, bf16, block 16)", () => {
  const tps = [1, 2, 4, 8];
  const numTokens = 1000;
  const row = 128 * 2;

  for (const tpP of tps) {
    for (const tpD of tps) {
      it(`P TP ${tpP} -> D TP ${tpD}: pairs, bytes and descriptors per pair`, () => {
        const nb = Math.ceil(numTokens / 16);
        const src = layout(llama8b, tpP, 16, nb + 10);
        const dst = layout(llama8b, tpD, 16, nb + 10);
        const ids = blockIds(nb, nb + 10, tpP * 10 + tpD);
        const plan = planTransfer(src, dst, {
          numTokens,
          prefixTokens: 100,
          srcBlockIds: ids,
          dstBlockIds: ids,
        });
        const moved = numTokens - 100;
        expect(plan.bytes).toBe(moved * 64 * 8 * row);
        expect(plan.pairs.length).toBe(Math.max(tpP, tpD));
        for (const pair of plan.pairs) {
          expect(pair.bytes).toBe((moved * 64 * 8 * row) / Math.max(tpP, tpD));
          // Blocks 6..62 move (the prefix ends inside block 6, token 999 inside block 62). A
          // whole HND block is one copy for any head slice; the two partial blocks cost one
          // copy per head the pair shares.
          const heads = Math.min(8 / tpP, 8 / tpD);
          expect(pair.rawDescriptorCount).toBe((55 + 2 * heads) * 64);
          expect(pair.regionPairs.length).toBe(32);
        }
      });
    }
  }

  it("is byte-exact on 2 layers between TP 1/2/4/8, HND and NHD", () => {
    const model = { ...llama8b, numLayers: 2 };
    for (const tpP of tps) {
      for (const tpD of tps) {
        for (const order of ["HND", "NHD"] as const) {
          const src = layout(model, tpP, 16, 12, order);
          const dst = layout(model, tpD, 16, 12, order);
          checkByteExact(fixedCase(src, dst, 70, 21, tpP * 8 + tpD));
        }
      }
    }
  });

  it("NHD with a head split costs one copy per token and head slice, HND one per block", () => {
    const nb = 64;
    const ids = Array.from({ length: nb }, (_, i) => i);
    const req = { numTokens: nb * 16, srcBlockIds: ids, dstBlockIds: ids };
    const hnd = planTransfer(layout(llama8b, 2, 16, nb), layout(llama8b, 4, 16, nb), req);
    const nhd = planTransfer(
      layout(llama8b, 2, 16, nb, "NHD"),
      layout(llama8b, 4, 16, nb, "NHD"),
      req,
    );
    const pair = (p: typeof hnd) => p.pairs[0]!;
    expect(pair(hnd).rawDescriptorCount).toBe(nb * 64);
    // D gets whole blocks, but P's half-blocks are not adjacent across blocks: nothing merges.
    expect(pair(hnd).descriptorCount).toBe(nb * 64);
    expect(pair(nhd).rawDescriptorCount).toBe(nb * 16 * 64);
    expect(pair(nhd).descriptorCount).toBe(nb * 16 * 64);
    expect(pair(nhd).bytes).toBe(pair(hnd).bytes);
  });
});

describe("DeepSeek-style MLA (61 layers, one 576-wide bf16 latent)", () => {
  it("maps each D rank to one P rank, spread over P ranks", () => {
    for (const [tpP, tpD] of [
      [1, 8],
      [8, 1],
      [4, 8],
      [8, 2],
      [8, 8],
    ] as const) {
      const src = layout(deepseekMla, tpP, 64, 40, "HND", "region-per-layer-kv");
      const dst = layout(deepseekMla, tpD, 64, 40, "HND", "region-per-layer-kv");
      const ids = blockIds(32, 40, 3);
      const plan = planTransfer(src, dst, { numTokens: 2000, srcBlockIds: ids, dstBlockIds: ids });
      expect(plan.pairs.map((p) => [p.srcRank, p.dstRank])).toEqual(
        Array.from({ length: tpD }, (_, r) => [r % tpP, r]),
      );
      for (const p of plan.pairs) {
        expect(p.bytes).toBe(2000 * 61 * 576 * 2);
        expect(p.rawDescriptorCount).toBe(32 * 61);
      }
    }
  });

  it("is byte-exact on 3 layers with P block 64 and D block 32/64/128", () => {
    const model = { ...deepseekMla, numLayers: 3, headDim: 24 };
    for (const bd of [32, 64, 128]) {
      for (const [tpP, tpD] of [
        [2, 4],
        [4, 1],
      ] as const) {
        const src = layout(model, tpP, 64, 12, "HND", "region-per-layer-kv");
        const dst = layout(
          model,
          tpD,
          bd,
          Math.ceil(600 / bd) + 2,
          "NHD",
          "one-region-blocks-first",
        );
        checkByteExact(fixedCase(src, dst, 600, 130, bd + tpP));
      }
    }
  });
});

describe("coalescing", () => {
  const model: Model = { ...llama8b, numLayers: 4 };
  const runs = [[5, 6, 7, 8], [20, 21], [3], [11, 12, 13]];
  const ids = runs.flat();
  const req = { numTokens: ids.length * 16, srcBlockIds: ids, dstBlockIds: ids };

  const cases: [KvRegionScheme, number][] = [
    // K and V share a region per layer: one descriptor per slot per run.
    ["region-per-layer", 2 * runs.length],
    ["region-per-layer-kv", runs.length],
    ["one-region-layers-first", 8 * runs.length],
    // Each block holds every layer back to back: one descriptor per run for the whole model.
    ["one-region-blocks-first", runs.length],
  ];
  for (const [scheme, perRegionPair] of cases) {
    it(`${scheme}: contiguous block ids give one descriptor per region pair per run`, () => {
      for (const tp of [1, 4]) {
        const src = kvLayout(
          shape(model, { tpSize: tp, blockSize: 16, numBlocks: 32, order: "HND" }),
          scheme,
        );
        const dst = kvLayout(
          shape(model, { tpSize: tp, blockSize: 16, numBlocks: 32, order: "HND" }),
          scheme,
        );
        const plan = planTransfer(src, dst, req);
        for (const pair of plan.pairs) {
          expect(pair.rawDescriptorCount).toBe(ids.length * 8);
          for (const rp of pair.regionPairs) expect(rp.count).toBe(perRegionPair);
          expect(pair.descriptorCount).toBe(perRegionPair * pair.regionPairs.length);
        }
      }
    });
  }

  it("merges a run whose P and D block sizes differ (P 16, D 64, aligned ids)", () => {
    const src = kvLayout(shape(model, { tpSize: 2, blockSize: 16, numBlocks: 64, order: "NHD" }));
    const dst = kvLayout(shape(model, { tpSize: 2, blockSize: 64, numBlocks: 16, order: "NHD" }));
    const plan = planTransfer(src, dst, {
      numTokens: 256,
      srcBlockIds: Array.from({ length: 16 }, (_, i) => 16 + i),
      dstBlockIds: [4, 5, 6, 7],
    });
    for (const pair of plan.pairs) {
      expect(pair.descriptorCount).toBe(8);
      expect(pair.rawDescriptorCount).toBe(16 * 8);
    }
  });

  it("scattered addressing still coalesces nothing it should not (checked byte-exact)", () => {
    const src = makeLayout(
      shape(model, { tpSize: 2, blockSize: 4, numBlocks: 30, order: "HND" }),
      "scattered",
      5,
    );
    const dst = makeLayout(
      shape(model, { tpSize: 4, blockSize: 8, numBlocks: 20, order: "HND" }),
      "scattered",
      9,
    );
    checkByteExact(fixedCase(src, dst, 90, 3, 17));
  });
});

describe("descriptorsForSide", () => {
  it("passes P's triples through and swaps the offsets for D", () => {
    const d = new Float64Array([1, 2, 3, 10, 20, 30]);
    expect(descriptorsForSide(d, "src")).toBe(d);
    expect([...descriptorsForSide(d, "dst")]).toEqual([2, 1, 3, 20, 10, 30]);
  });
});

describe("strided layouts: vLLM's CPU layout and fused cells", () => {
  const small: Model = { ...llama8b, numLayers: 3, headDim: 4 };

  it("is byte-exact over random pairs of strided layouts, with and without coalescing", () => {
    const strided = planCaseArb.filter(
      (c) => c.src.headStride !== undefined || c.dst.tokenStride !== undefined,
    );
    fc.assert(
      fc.property(
        fc.tuple(planCaseArb, fc.integer({ min: 1, max: 1 << 30 }), fc.boolean()),
        ([c, seed, coalesce]) => {
          const side = (l: KvLayout, s: number): KvLayout =>
            stridedLayout(
              {
                numLayers: l.numLayers,
                mla: l.mla,
                totalKvHeads: l.totalKvHeads,
                headDim: l.headDim,
                dtype: l.dtype,
                dtypeBytes: l.dtypeBytes,
                blockSize: l.blockSize,
                numBlocks: l.numBlocks,
                order: l.order,
                tpSize: l.tpSize,
                tpRank: 0,
              },
              s,
            );
          checkByteExact(
            { ...c, src: side(c.src, seed), dst: side(c.dst, seed + 1) },
            { coalesce },
          );
        },
      ),
      { numRuns: 500 },
    );
    // The mixed arbitrary draws strided layouts too (explicit strides on at least one side).
    fc.assert(
      fc.property(strided, (c) => void checkByteExact(c)),
      { numRuns: 100 },
    );
  });

  it("kvLayout one-region-kv-in-block (HND) is vLLM's CPU LBHNC layout", () => {
    // [layer][block][head][token][K dims + V dims] viewed as [2N][D] per (block, head): byte of
    // (l, kv, b, h, t) = ((((l * nb + b) * H + h) * 2 + kv) * N + t) * row.
    const N = 4;
    const nb = 5;
    const l = layout(small, 2, N, nb, "HND", "one-region-kv-in-block");
    const H = 4;
    const row = 8;
    expect(l.regionBytes).toEqual([3 * nb * H * 2 * N * row]);
    expect([l.blockStride, l.headStride, l.tokenStride]).toEqual([
      2 * H * N * row,
      2 * N * row,
      row,
    ]);
    expect(l.slots[2 * 2 + 1]).toEqual({ region: 0, offset: 2 * nb * 2 * H * N * row + N * row });
    const ids = [0, 1, 2, 3, 4];
    for (let layer = 0; layer < 3; layer++)
      for (let kv = 0; kv < 2; kv++)
        for (let t = 0; t < nb * N; t++)
          for (let h = 0; h < H; h++) {
            const b = Math.floor(t / N);
            const want = ((((layer * nb + b) * H + h) * 2 + kv) * N + (t % N)) * row + 3;
            expect(addressOf(l, ids, layer, kv, t, h, 3, H)).toEqual({ region: 0, offset: want });
          }
  });

  it("kvLayout region-per-layer-kv-in-cell (NHD) is the fused-cell layout", () => {
    // Per layer [block][token][head][K dims, V dims]: byte of (kv, b, h, t) =
    // (((b * N + t) * H + h) * 2 + kv) * row in the layer's region.
    const N = 4;
    const nb = 3;
    const l = layout(small, 2, N, nb, "NHD", "region-per-layer-kv-in-cell");
    const H = 4;
    const row = 8;
    expect([l.blockStride, l.headStride, l.tokenStride]).toEqual([
      2 * H * N * row,
      2 * row,
      2 * H * row,
    ]);
    const ids = [2, 0, 1];
    for (let layer = 0; layer < 3; layer++)
      for (let kv = 0; kv < 2; kv++)
        for (let t = 0; t < nb * N; t++)
          for (let h = 0; h < H; h++) {
            const b = ids[Math.floor(t / N)]!;
            const want = (((b * N + (t % N)) * H + h) * 2 + kv) * row + 5;
            expect(addressOf(l, ids, layer, kv, t, h, 5, H)).toEqual({
              region: layer,
              offset: want,
            });
          }
  });

  it("moves KV byte-exact between the CPU layout, fused cells and dense layouts, TP and block size both ways", () => {
    const cpu = (tp: number, block: number, nb: number) =>
      layout(small, tp, block, nb, "HND", "one-region-kv-in-block");
    const fused = (tp: number, block: number, nb: number) =>
      layout(small, tp, block, nb, "NHD", "region-per-layer-kv-in-cell");
    const flash = (tp: number, block: number, nb: number) => layout(small, tp, block, nb, "HND");
    const nhd = (tp: number, block: number, nb: number) => layout(small, tp, block, nb, "NHD");
    const numTokens = 150;
    for (const [p, d] of [
      [cpu, cpu],
      [fused, fused],
      [cpu, fused],
      [fused, cpu],
      [cpu, flash],
      [flash, cpu],
      [fused, nhd],
      [nhd, fused],
    ] as const) {
      for (const [bp, bd] of [
        [16, 16],
        [16, 32],
        [32, 16],
        [8, 24],
      ] as const) {
        for (const [tpP, tpD, prefix] of [
          [1, 1, 0],
          [1, 4, 37],
          [8, 2, 0],
        ] as const) {
          const src = p(tpP, bp, Math.ceil(numTokens / bp) + 2);
          const dst = d(tpD, bd, Math.ceil(numTokens / bd) + 2);
          checkByteExact(fixedCase(src, dst, numTokens, prefix, bp + bd + tpP));
        }
      }
    }
  });
});

describe("coalescing with K and V interleaved inside a block", () => {
  // vLLM's CPU backend on Llama-3-8B: 32 layers, 8 KV heads x 128, bf16, block 32, one buffer
  // [layer][block][head][K rows][V rows]; 8192 tokens = 256 blocks, 300 blocks per layer.
  const cpu = (tp: number) => layout(llama8b, tp, 32, 300, "HND", "one-region-kv-in-block");
  const contiguous = Array.from({ length: 256 }, (_, i) => i);
  const shuffled = blockIds(256, 300, 99);
  const plan = (src: KvLayout, dst: KvLayout, s: number[], d: number[]) =>
    planTransfer(src, dst, { numTokens: 8192, srcBlockIds: s, dstBlockIds: d });

  it("CPU layout, equal blocks: one copy per layer for a run of blocks, one per (layer, block) otherwise", () => {
    const run = plan(cpu(1), cpu(1), contiguous, contiguous);
    expect(run.rawDescriptorCount).toBe(256 * 8 * 64);
    // K and V of a layer's blocks 0..255 are one byte range on both sides.
    expect(run.descriptorCount).toBe(32);
    expect(run.bytes).toBe(8192 * 32 * 2 * 8 * 256);
    const scattered = plan(cpu(1), cpu(1), shuffled, blockIds(256, 300, 7));
    expect(scattered.descriptorCount).toBe(256 * 32);
    // Same ids both sides but shuffled: still one per (layer, block), not 2 x heads per block.
    expect(plan(cpu(1), cpu(1), shuffled, shuffled).descriptorCount).toBe(256 * 32);
  });

  it("CPU layout with a head split (P TP 1 -> D TP 2): one copy per (layer, block) per D rank", () => {
    const split = plan(cpu(1), cpu(2), contiguous, contiguous);
    expect(split.pairs.map((p) => p.descriptorCount)).toEqual([256 * 32, 256 * 32]);
    expect(split.pairs.map((p) => p.rawDescriptorCount)).toEqual([256 * 4 * 64, 256 * 4 * 64]);
  });

  it("fused cells, equal blocks: one copy per layer for a run of blocks", () => {
    const fused = (tp: number) => layout(llama8b, tp, 32, 40, "NHD", "region-per-layer-kv-in-cell");
    const ids = Array.from({ length: 32 }, (_, i) => i + 3);
    const req = { numTokens: 1024, srcBlockIds: ids, dstBlockIds: ids };
    const whole = planTransfer(fused(1), fused(1), req);
    // K and V rows side by side on both sides: one slot of double rows per layer, whole blocks.
    expect(whole.rawDescriptorCount).toBe(32 * 32);
    expect(whole.descriptorCount).toBe(32);
    checkByteExact(
      fixedCase(
        layout(
          { ...llama8b, numLayers: 2, headDim: 4 },
          2,
          8,
          20,
          "NHD",
          "region-per-layer-kv-in-cell",
        ),
        layout(
          { ...llama8b, numLayers: 2, headDim: 4 },
          4,
          16,
          10,
          "NHD",
          "region-per-layer-kv-in-cell",
        ),
        130,
        11,
        3,
      ),
    );
    // D TP 2: a D rank's 4 heads of a token are one run on D but half a token on P.
    const split = planTransfer(fused(1), fused(2), req);
    expect(split.pairs.map((p) => p.descriptorCount)).toEqual([1024 * 32, 1024 * 32]);
  });

  it("K and V apart on one side: byte-exact, one copy per head per block per slot", () => {
    const flash = layout(llama8b, 1, 32, 300, "HND");
    const p = plan(cpu(1), flash, contiguous, contiguous);
    expect(p.descriptorCount).toBe(256 * 8 * 64);
    const model = { ...llama8b, numLayers: 2, headDim: 4 };
    checkByteExact(
      fixedCase(
        layout(model, 1, 32, 10, "HND", "one-region-kv-in-block"),
        layout(model, 1, 32, 10, "HND"),
        250,
        10,
        5,
      ),
    );
  });
});

describe("opaque blocks (vLLM CPU: K column-major inside a (block, head))", () => {
  // 2 layers, 4 KV heads x 32, bf16, block 32: small enough to check every byte.
  const tiny: Model = { ...llama8b, numLayers: 2, totalKvHeads: 4, headDim: 32 };
  const cpu = (tp: number, blockSize = 32): KvLayout => ({
    ...layout(tiny, tp, blockSize, 12, "HND", "one-region-kv-in-block"),
    opaqueBlocks: true,
  });
  const row = 32 * 2;

  /** Random source bytes, the plan applied with memcpy, and the expected whole-run copies. */
  function moveAndCheck(src: KvLayout, dst: KvLayout, numTokens: number, prefixTokens: number) {
    const n = Math.ceil(numTokens / src.blockSize);
    const srcIds = blockIds(n, src.numBlocks, 5);
    const dstIds = blockIds(n, dst.numBlocks, 6);
    const plan = planTransfer(src, dst, {
      numTokens,
      prefixTokens,
      srcBlockIds: srcIds,
      dstBlockIds: dstIds,
    });
    const srcMem = Array.from({ length: src.tpSize }, (_, r) =>
      src.regionBytes.map((b) =>
        Uint8Array.from({ length: b }, (_, i) => (i * 31 + r * 7 + 1) & 0xff),
      ),
    );
    const dstMem = Array.from({ length: dst.tpSize }, () =>
      dst.regionBytes.map((b) => new Uint8Array(b)),
    );
    for (const pair of plan.pairs) {
      for (const rp of pair.regionPairs) {
        const d = rp.descriptors;
        for (let i = 0; i < d.length; i += 3) {
          const from = srcMem[pair.srcRank]![rp.srcRegion]!;
          dstMem[pair.dstRank]![rp.dstRegion]!.set(
            from.subarray(d[i]!, d[i]! + d[i + 2]!),
            d[i + 1]!,
          );
        }
      }
    }
    // Every (layer, K|V, block past the prefix, head) run arrives whole; nothing else is written.
    const expected = Array.from({ length: dst.tpSize }, () =>
      dst.regionBytes.map((b) => new Uint8Array(b)),
    );
    const hd = 4 / dst.tpSize;
    const hs = 4 / src.tpSize;
    for (let dr = 0; dr < dst.tpSize; dr++) {
      for (let s = 0; s < src.slots.length; s++) {
        for (let b = prefixTokens / src.blockSize; b < n; b++) {
          for (let h = 0; h < hd; h++) {
            const g = dr * hd + h;
            const sr = Math.floor(g / hs);
            const so =
              src.slots[s]!.offset +
              srcIds[b]! * src.blockStride +
              (g - sr * hs) * (src.headStride ?? 0);
            const dOff =
              dst.slots[s]!.offset + dstIds[b]! * dst.blockStride + h * (dst.headStride ?? 0);
            expected[dr]![0]!.set(srcMem[sr]![0]!.subarray(so, so + src.blockSize * row), dOff);
          }
        }
      }
    }
    for (let dr = 0; dr < dst.tpSize; dr++) {
      expect(Buffer.from(dstMem[dr]![0]!).equals(Buffer.from(expected[dr]![0]!))).toBe(true);
    }
    return plan;
  }

  it("moves whole (block, head) runs, the last block's tail included, TP 1 -> 1 and 2 -> 4", () => {
    const p = moveAndCheck(cpu(1), cpu(1), 70, 0);
    // 3 blocks x 2 layers x (K and V): every byte of the 3 blocks, not just 70 tokens.
    expect(p.bytes).toBe(3 * 2 * 2 * 4 * 32 * row);
    moveAndCheck(cpu(2), cpu(4), 70, 32);
    moveAndCheck(cpu(4), cpu(1), 96, 64);
  });

  it("refuses an unaligned prefix, and moves nothing when the prefix is every token", () => {
    const ids = [0, 1, 2];
    expect(() =>
      planTransfer(cpu(1), cpu(1), {
        numTokens: 70,
        prefixTokens: 20,
        srcBlockIds: ids,
        dstBlockIds: ids,
      }),
    ).toThrow(expect.objectContaining({ code: "ERR_PLAN_INVALID", field: "prefixTokens" }));
    const none = planTransfer(cpu(1), cpu(1), {
      numTokens: 70,
      prefixTokens: 70,
      srcBlockIds: ids,
      dstBlockIds: ids,
    });
    expect(none.bytes).toBe(0);
  });

  it("needs both sides opaque, one block size, HND with dense rows", () => {
    const ids = [0, 1, 2];
    const req = { numTokens: 64, srcBlockIds: ids, dstBlockIds: ids };
    const dense = layout(tiny, 1, 32, 12, "HND", "one-region-kv-in-block");
    expect(() => planTransfer(cpu(1), dense, req)).toThrow(
      expect.objectContaining({ code: "ERR_LAYOUT_INCOMPATIBLE", field: "opaqueBlocks" }),
    );
    expect(() => planTransfer(cpu(1, 32), cpu(1, 64), req)).toThrow(
      expect.objectContaining({ code: "ERR_LAYOUT_INCOMPATIBLE", field: "blockSize" }),
    );
    const nhd = {
      ...layout(tiny, 1, 32, 12, "NHD", "region-per-layer-kv-in-cell"),
      opaqueBlocks: true,
    };
    expect(() => planTransfer(nhd, nhd, req)).toThrow(
      expect.objectContaining({ code: "ERR_LAYOUT_INVALID", field: "src.opaqueBlocks" }),
    );
  });
});
