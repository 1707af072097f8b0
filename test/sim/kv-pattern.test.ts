// The simulated engines' KV pattern against the planner: P fills, the plan is applied with plain
// copies, D verifies every byte; and every kind of wrong byte is caught.
import { describe, expect, it } from "vitest";

import {
  type KvBlockOrder,
  type KvLayout,
  type KvLayoutShape,
  type KvRegionScheme,
  kvLayout,
  planTransfer,
  validateKvLayout,
} from "../../src/plan/index.js";
import { fillKv, kvPatternByte, transferSeed, verifyKv } from "../../sim/kv-pattern.js";
import { llama8b, scatteredLayout, stridedLayout } from "../plan/cases.js";
import { addressOf, applyPlan, headsOf, rng } from "../plan/reference.js";

interface Model {
  numLayers: number;
  mla: boolean;
  totalKvHeads: number;
  headDim: number;
  dtypeBytes: number;
}

const small: Model = { numLayers: 3, mla: false, totalKvHeads: 4, headDim: 8, dtypeBytes: 2 };
const mla: Model = { numLayers: 3, mla: true, totalKvHeads: 1, headDim: 12, dtypeBytes: 2 };
const odd: Model = { numLayers: 2, mla: false, totalKvHeads: 2, headDim: 3, dtypeBytes: 1 };

function shapeOf(
  m: Model,
  tpSize: number,
  blockSize: number,
  numBlocks: number,
  order: KvBlockOrder,
): KvLayoutShape {
  return {
    ...m,
    dtype: m.dtypeBytes === 1 ? "fp8" : "bfloat16",
    blockSize,
    numBlocks,
    order,
    tpSize,
    tpRank: 0,
  };
}

function noise(layout: KvLayout, seed: number): Uint8Array[] {
  const next = rng(seed);
  return layout.regionBytes.map((n) => {
    const m = new Uint8Array(n);
    for (let i = 0; i < n; i++) m[i] = (next() * 256) | 0;
    return m;
  });
}

/** `count` distinct block ids out of `numBlocks`, shuffled (non-contiguous). */
function randomBlocks(numBlocks: number, count: number, seed: number): number[] {
  const next = rng(seed);
  const all = Array.from({ length: numBlocks }, (_, i) => i);
  for (let i = all.length - 1; i > 0; i--) {
    const j = Math.floor(next() * (i + 1));
    [all[i], all[j]] = [all[j]!, all[i]!];
  }
  return all.slice(0, count);
}

interface Case {
  name: string;
  src: KvLayout;
  dst: KvLayout;
  tokens: number;
  prefix: number;
}

function layoutFor(
  shape: KvLayoutShape,
  scheme: KvRegionScheme | "scattered" | "strided",
  seed = 1,
): KvLayout {
  if (scheme === "scattered") return scatteredLayout(shape, seed);
  if (scheme === "strided") return stridedLayout(shape, seed);
  return kvLayout(shape, scheme);
}

const cases: Case[] = [
  {
    name: "HND TP 1 -> 1, block 16 -> 16",
    src: layoutFor(shapeOf(small, 1, 16, 12, "HND"), "region-per-layer"),
    dst: layoutFor(shapeOf(small, 1, 16, 12, "HND"), "region-per-layer"),
    tokens: 70,
    prefix: 0,
  },
  {
    name: "NHD TP 2 -> 4, block 16 -> 32, blocks-first on D",
    src: layoutFor(shapeOf(small, 2, 16, 10, "NHD"), "region-per-layer"),
    dst: layoutFor(shapeOf(small, 4, 32, 6, "NHD"), "region-per-layer-blocks-first"),
    tokens: 100,
    prefix: 0,
  },
  {
    name: "HND TP 4 -> 1, block 32 -> 16, cached prefix of 21 tokens",
    src: layoutFor(shapeOf(small, 4, 32, 6, "HND"), "one-region-layers-first"),
    dst: layoutFor(shapeOf(small, 1, 16, 12, "HND"), "region-per-layer-kv"),
    tokens: 90,
    prefix: 21,
  },
  {
    name: "MLA TP 2 -> 4, one region blocks-first",
    src: layoutFor(shapeOf(mla, 2, 16, 8, "HND"), "one-region-blocks-first"),
    dst: layoutFor(shapeOf(mla, 4, 16, 8, "HND"), "region-per-layer"),
    tokens: 77,
    prefix: 0,
  },
  {
    name: "GQA with more ranks than heads (TP 1 -> 4 of 2 heads), odd rows, scattered D",
    src: layoutFor(shapeOf(odd, 1, 8, 12, "HND"), "region-per-layer"),
    dst: layoutFor(shapeOf(odd, 4, 8, 12, "NHD"), "scattered", 7),
    tokens: 60,
    prefix: 5,
  },
  {
    name: "vLLM CPU layout (K|V per head) TP 2 -> fused cells TP 4, block 16 -> 32, prefix 9",
    src: layoutFor(shapeOf(small, 2, 16, 10, "HND"), "one-region-kv-in-block"),
    dst: layoutFor(shapeOf(small, 4, 32, 6, "NHD"), "region-per-layer-kv-in-cell"),
    tokens: 100,
    prefix: 9,
  },
  {
    name: "explicit padded strides both sides, TP 4 -> 2, block 8 -> 4",
    src: layoutFor(shapeOf(small, 4, 8, 12, "NHD"), "strided", 3),
    dst: layoutFor(shapeOf(small, 2, 4, 24, "HND"), "strided", 4),
    tokens: 75,
    prefix: 0,
  },
];

describe("kv pattern through the planner", () => {
  for (const c of cases) {
    it(c.name, () => {
      const tid = `req-${c.name.length}`;
      const srcIds = randomBlocks(c.src.numBlocks, Math.ceil(c.tokens / c.src.blockSize), 11);
      const dstIds = randomBlocks(c.dst.numBlocks, Math.ceil(c.tokens / c.dst.blockSize), 12);
      const srcMem = Array.from({ length: c.src.tpSize }, (_, r) => noise(c.src, 100 + r));
      const dstMem = Array.from({ length: c.dst.tpSize }, (_, r) => noise(c.dst, 200 + r));
      for (let r = 0; r < c.src.tpSize; r++) {
        fillKv(c.src, r, srcMem[r]!, tid, srcIds, 0, c.tokens);
      }
      // D holds the prefix itself ("already cached"), as the simulated engine does.
      for (let r = 0; r < c.dst.tpSize; r++) {
        fillKv(c.dst, r, dstMem[r]!, tid, dstIds, 0, c.prefix);
      }
      // Before the transfer the tail does not match (noise), the prefix does.
      const before = verifyKv(c.dst, 0, dstMem[0]!, tid, dstIds, 0, c.tokens);
      expect(before.mismatches).toBeGreaterThan(0);
      const plan = planTransfer(c.src, c.dst, {
        numTokens: c.tokens,
        prefixTokens: c.prefix,
        srcBlockIds: srcIds,
        dstBlockIds: dstIds,
      });
      applyPlan(plan, srcMem, dstMem);
      for (let r = 0; r < c.dst.tpSize; r++) {
        const check = verifyKv(c.dst, r, dstMem[r]!, tid, dstIds, 0, c.tokens);
        expect(check.first).toBeUndefined();
        expect(check.mismatches).toBe(0);
        const rows = c.dst.numLayers * (c.dst.mla ? 1 : 2) * c.tokens * headsOf(c.dst, r).length;
        expect(check.checkedBytes).toBe(rows * c.dst.headDim * c.dst.dtypeBytes);
      }

      // One flipped byte in the moved tail is found, and named.
      const r = c.dst.tpSize - 1;
      const token = c.tokens - 1;
      const layer = c.dst.numLayers - 1;
      const heads = headsOf(c.dst, r);
      const a = addressOf(c.dst, dstIds, layer, 0, token, heads.length - 1, 1, heads.length);
      dstMem[r]![a.region]![a.offset]! ^= 0x40;
      const bad = verifyKv(c.dst, r, dstMem[r]!, tid, dstIds, 0, c.tokens);
      expect(bad.mismatches).toBe(1);
      expect(bad.first).toContain(`layer ${layer}`);
      expect(bad.first).toContain(`token ${token}`);
      expect(bad.first).toContain(`head ${heads[heads.length - 1]}`);
      expect(bad.first).toContain("byte 1 ");
    });
  }

  it("matches kvPatternByte byte for byte at the reference model's addresses", () => {
    for (const layout of [
      kvLayout(shapeOf(odd, 2, 4, 6, "NHD"), "region-per-layer"),
      kvLayout(shapeOf(small, 2, 4, 6, "HND"), "one-region-blocks-first"),
      scatteredLayout(shapeOf(mla, 1, 4, 6, "HND"), 3),
      kvLayout(shapeOf(small, 2, 4, 6, "HND"), "one-region-kv-in-block"),
      kvLayout(shapeOf(odd, 1, 4, 6, "NHD"), "region-per-layer-kv-in-cell"),
      stridedLayout(shapeOf(small, 1, 4, 6, "NHD"), 5, "in-block"),
      stridedLayout(shapeOf(small, 2, 4, 6, "HND"), 6, "in-cell"),
    ]) {
      expect(() => validateKvLayout(layout)).not.toThrow();
      const ids = [4, 1, 5];
      for (let r = 0; r < layout.tpSize; r++) {
        const mem = layout.regionBytes.map((n) => new Uint8Array(n));
        fillKv(layout, r, mem, "t", ids, 0, 11);
        const heads = headsOf(layout, r);
        for (let l = 0; l < layout.numLayers; l++)
          for (let kv = 0; kv < (layout.mla ? 1 : 2); kv++)
            for (let t = 0; t < 11; t++)
              for (let h = 0; h < heads.length; h++)
                for (let b = 0; b < layout.headDim * layout.dtypeBytes; b++) {
                  const a = addressOf(layout, ids, l, kv, t, h, b, heads.length);
                  expect(mem[a.region]![a.offset]).toBe(kvPatternByte("t", l, kv, t, heads[h]!, b));
                }
      }
    }
  });

  it("tells transfers, tokens and blocks apart", () => {
    const layout = kvLayout(shapeOf(small, 1, 4, 8, "HND"), "region-per-layer");
    const mem = layout.regionBytes.map((n) => new Uint8Array(n));
    const ids = [3, 0, 6];
    fillKv(layout, 0, mem, "a", ids, 0, 12);
    expect(verifyKv(layout, 0, mem, "a", ids, 0, 12).mismatches).toBe(0);
    // Another transfer's KV is not this one's.
    const other = verifyKv(layout, 0, mem, "b", ids, 0, 12);
    expect(other.mismatches).toBeGreaterThan(other.checkedBytes * 0.9);
    // Blocks swapped in the table: the right bytes in the wrong place.
    expect(verifyKv(layout, 0, mem, "a", [0, 3, 6], 0, 12).mismatches).toBeGreaterThan(0);
    // K and V swapped.
    const swapped = mem.map((m) => m.slice());
    const kOff = layout.slots[0]!.offset;
    const vOff = layout.slots[1]!.offset;
    const slab = layout.numBlocks * layout.blockStride;
    swapped[0]!.set(mem[0]!.subarray(vOff, vOff + slab), kOff);
    swapped[0]!.set(mem[0]!.subarray(kOff, kOff + slab), vOff);
    expect(verifyKv(layout, 0, swapped, "a", ids, 0, 12).mismatches).toBeGreaterThan(0);
    expect(transferSeed("a")).not.toBe(transferSeed("b"));
  });

  it("refuses block tables and regions that cannot hold the request", () => {
    const layout = kvLayout(shapeOf(small, 2, 4, 8, "HND"), "region-per-layer");
    const mem = layout.regionBytes.map((n) => new Uint8Array(n));
    expect(() => fillKv(layout, 0, mem, "a", [1, 2], 0, 9)).toThrow(RangeError);
    expect(() => fillKv(layout, 0, mem, "a", [1, 8, 2], 0, 9)).toThrow(/block id 8/);
    expect(() => fillKv(layout, 2, mem, "a", [1, 2, 3], 0, 9)).toThrow(/rank 2/);
    expect(() => fillKv(layout, 0, mem.slice(1), "a", [1, 2, 3], 0, 9)).toThrow(/regions/);
    expect(() => fillKv(layout, 0, [new Uint8Array(8), ...mem.slice(1)], "a", [1], 0, 1)).toThrow(
      /region 0/,
    );
  });

  it("fills and verifies a 1000-token Llama-3-8B request (128 MiB) in well under a second", () => {
    const layout = kvLayout(
      {
        ...llama8b,
        blockSize: 16,
        numBlocks: 64,
        order: "HND",
        tpSize: 1,
        tpRank: 0,
      },
      "region-per-layer",
    );
    const mem = layout.regionBytes.map((n) => new Uint8Array(n));
    const ids = randomBlocks(64, 63, 5);
    const t0 = performance.now();
    fillKv(layout, 0, mem, "perf", ids, 0, 1000);
    const t1 = performance.now();
    const check = verifyKv(layout, 0, mem, "perf", ids, 0, 1000);
    const t2 = performance.now();
    expect(check.mismatches).toBe(0);
    expect(check.checkedBytes).toBe(1000 * 128 * 1024);
    console.log(`fill ${(t1 - t0).toFixed(0)} ms, verify ${(t2 - t1).toFixed(0)} ms for 128 MiB`);
    expect(t1 - t0).toBeLessThan(1000);
    expect(t2 - t1).toBeLessThan(1000);
  });
});
