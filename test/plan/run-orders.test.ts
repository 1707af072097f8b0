// Run orders (`KvRunOrder`): (block, head) runs that are not plain rows, such as vLLM's CPU
// attention with K column-major, planned between different block sizes and checked byte by byte
// against the reference model, which places every element from the definition alone.
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import {
  type KvLayout,
  type KvRunOrder,
  type TransferPlan,
  kvLayout,
  planTransfer,
} from "../../src/plan/index.js";
import { kvLayoutFromProto, kvLayoutToProto } from "../../src/plan/layout-proto.js";
import { type Model, TP_COMBOS, blockIds, llama8b, scatteredLayout, shape } from "./cases.js";
import { applyPlan, decodeMemories, firstDifference, prefillMemories } from "./reference.js";

/** vLLM's CPU attention, ISA `vec`/`vec16`: K column-major, V rows (probed in test_layout.py). */
const VEC: readonly KvRunOrder[] = [
  { dimGroup: 1, tokenTile: 1 },
  { dimGroup: 32, tokenTile: 1 },
];

const tiny: Model = { ...llama8b, numLayers: 2, totalKvHeads: 2, headDim: 32 };

/** vLLM's CPU KV cache (`[layer][block][head][K rows | V rows]`) with run orders. */
function cpu(
  blockSize: number,
  numBlocks: number,
  runOrders: readonly KvRunOrder[] = VEC,
  tp = 1,
  model: Model = tiny,
): KvLayout {
  return {
    ...kvLayout(
      shape(model, { tpSize: tp, blockSize, numBlocks, order: "HND" }),
      "one-region-kv-in-block",
    ),
    opaqueBlocks: true,
    runOrders,
  };
}

/**
 * Plans tokens `prefix .. n - 1` and applies the plan; D must then hold, for tokens
 * `prefix .. end - 1` (`end`: `n` up to the run orders' whole tile), exactly what an engine with
 * D's layout holds for them (the reference model), and nothing else on D may change.
 */
function moveAndCheck(
  src: KvLayout,
  dst: KvLayout,
  n: number,
  prefix: number,
  seed = 3,
  end = n,
): TransferPlan {
  const srcIds = blockIds(Math.ceil(n / src.blockSize), src.numBlocks, seed);
  const dstIds = blockIds(Math.ceil(n / dst.blockSize), dst.numBlocks, seed + 1);
  const plan = planTransfer(src, dst, {
    numTokens: n,
    prefixTokens: prefix,
    srcBlockIds: srcIds,
    dstBlockIds: dstIds,
  });
  const srcMem = prefillMemories(src, srcIds, end, seed);
  const { before, expected, bytesPerRank } = decodeMemories(dst, dstIds, end, prefix, seed);
  const written = applyPlan(plan, srcMem, before);
  const diff = firstDifference(before, expected);
  if (diff !== undefined) expect.fail(diff);
  expect(written).toEqual(bytesPerRank);
  return plan;
}

describe("run orders: vLLM CPU blocks (K column-major) between block sizes", () => {
  const row = 32 * 2;

  it("P block 32 -> D block 64 lands as a block-64 engine holds it, prefix or not", () => {
    const p = moveAndCheck(cpu(32, 12), cpu(64, 6), 100, 0);
    // Every token once: 100 tokens x 2 layers x K|V x 2 heads x one row.
    expect(p.bytes).toBe(100 * 2 * 2 * 2 * row);
    // Per (chunk, head): K is 32 column ranges, V one range of rows; 4 chunks (32+32+32+4).
    expect(p.rawDescriptorCount).toBe(4 * 2 * 2 * (32 + 1));
    moveAndCheck(cpu(32, 12), cpu(64, 6), 200, 64, 9);
    moveAndCheck(cpu(32, 12), cpu(64, 6), 64, 64);
  });

  it("D block 64 -> P block 32, 16 <-> 32, and one block size (whole runs coalesce)", () => {
    moveAndCheck(cpu(64, 6), cpu(32, 12), 130, 32);
    moveAndCheck(cpu(16, 20), cpu(32, 10), 77, 16);
    moveAndCheck(cpu(32, 10), cpu(16, 20), 77, 5);
    const same = moveAndCheck(cpu(32, 8), cpu(32, 8), 64, 0, 4);
    // One block size: whole blocks, K and V of all heads of a layer's block in one copy.
    expect(same.descriptorCount).toBe(2 * 2);
  });

  it("one block size: whole blocks as before when the prefix allows, by run order when not", () => {
    const { runOrders: _, ...opaque } = cpu(32, 8);
    const ids = { srcBlockIds: [3, 1, 6], dstBlockIds: [0, 5, 2] };
    const req = { numTokens: 70, prefixTokens: 32, ...ids };
    const before = planTransfer(opaque, opaque, req);
    const now = planTransfer(cpu(32, 8), cpu(32, 8), req);
    expect(now.pairs).toEqual(before.pairs);
    expect(now.bytes).toBe(2 * 32 * 2 * 2 * 2 * row);
    // A prefix inside a block (no vLLM prefix cache makes one) moves exactly the tokens after it.
    const p = moveAndCheck(cpu(32, 8), cpu(32, 8), 70, 5);
    expect(p.bytes).toBe(65 * 2 * 2 * 2 * row);
  });

  it("TP 2 -> 1 and 1 -> 2 with a head split", () => {
    const four: Model = { ...tiny, totalKvHeads: 4 };
    moveAndCheck(cpu(32, 12, VEC, 2, four), cpu(64, 6, VEC, 1, four), 90, 32);
    moveAndCheck(cpu(64, 6, VEC, 1, four), cpu(32, 12, VEC, 2, four), 90, 0);
  });

  it("tiles move whole: an AMX-like order (K tiles of 16 rows, V pairs of tokens in dim groups)", () => {
    const amx: KvRunOrder[] = [
      { dimGroup: 32, tokenTile: 16 },
      { dimGroup: 16, tokenTile: 2 },
    ];
    // 70 tokens: the last tile (64..79) moves whole, so D gets tokens up to 80.
    const p = moveAndCheck(cpu(32, 12, amx), cpu(64, 6, amx), 70, 16, 5, 80);
    expect(p.bytes).toBe((80 - 16) * 2 * 2 * 2 * row);
    expect(() =>
      planTransfer(cpu(32, 12, amx), cpu(64, 6, amx), {
        numTokens: 70,
        prefixTokens: 8,
        srcBlockIds: [0, 1, 2],
        dstBlockIds: [0, 1],
      }),
    ).toThrow(
      expect.objectContaining({
        code: "ERR_PLAN_INVALID",
        field: "prefixTokens",
        message:
          "prefixTokens 8 is not a multiple of 16 tokens: the run order moves whole tiles of 16",
      }),
    );
  });

  it("random layouts, TP pairs, block sizes and run orders, byte-exact", () => {
    fc.assert(
      fc.property(
        fc.record({
          combo: fc.constantFrom(...TP_COMBOS),
          numLayers: fc.integer({ min: 1, max: 2 }),
          headDim: fc.constantFrom(1, 2, 4, 6),
          dtypeBytes: fc.constantFrom(1, 2),
          tile: fc.constantFrom(1, 1, 2, 4),
          blocks: fc.tuple(fc.integer({ min: 1, max: 6 }), fc.integer({ min: 1, max: 6 })),
          groups: fc.tuple(fc.nat(8), fc.nat(8)),
          tiles: fc.tuple(fc.boolean(), fc.boolean()),
          scattered: fc.tuple(fc.boolean(), fc.boolean()),
          n: fc.integer({ min: 0, max: 60 }),
          prefixFrac: fc.double({ min: 0, max: 1, noNaN: true }),
          seed: fc.integer({ min: 1, max: 1 << 30 }),
        }),
        (r) => {
          const [heads, tpP, tpD] = r.combo;
          const model: Model = {
            numLayers: r.numLayers,
            mla: false,
            totalKvHeads: heads,
            headDim: r.headDim,
            dtype: `int${8 * r.dtypeBytes}`,
            dtypeBytes: r.dtypeBytes,
          };
          const divisors = [1, 2, 3, 6].filter((d) => r.headDim % d === 0);
          const orders: KvRunOrder[] = [0, 1].map((kv) => ({
            dimGroup: divisors[r.groups[kv]! % divisors.length]!,
            tokenTile: r.tiles[kv] ? r.tile : 1,
          }));
          const [bp, bd] = r.blocks.map((b) => b * r.tile);
          const make = (tp: number, bs: number, scattered: boolean, seed: number): KvLayout => {
            const s = shape(model, {
              tpSize: tp,
              blockSize: bs!,
              numBlocks: Math.ceil(60 / bs!) + 2,
              order: "HND",
            });
            const base = scattered
              ? scatteredLayout(s, seed)
              : kvLayout(s, "one-region-kv-in-block");
            return { ...base, runOrders: orders };
          };
          const src = make(tpP, bp!, r.scattered[0], r.seed);
          const dst = make(tpD, bd!, r.scattered[1], r.seed + 7);
          const unit = Math.max(...orders.map((o) => o.tokenTile));
          const prefix = Math.min(r.n, unit * Math.floor((r.prefixFrac * r.n) / unit));
          // What moves past the last token: the last tile, or with one block size and a prefix of
          // whole blocks, the last block.
          const whole =
            bp === bd && prefix % bp! === 0 && orders.some((o) => o.dimGroup < r.headDim);
          const last = whole ? bp! : unit;
          const end = prefix < r.n ? Math.ceil(r.n / last) * last : r.n;
          moveAndCheck(src, dst, r.n, prefix, r.seed, end);
        },
      ),
      { numRuns: 150 },
    );
  });
});

describe("run orders: what cannot move is refused", () => {
  const req = { numTokens: 64, srcBlockIds: [0, 1], dstBlockIds: [0, 1] };

  it("a different run order on either side, by name", () => {
    const other: KvRunOrder[] = [VEC[1]!, VEC[1]!];
    expect(() => planTransfer(cpu(32, 4), cpu(32, 4, other), req)).toThrow(
      expect.objectContaining({
        code: "ERR_LAYOUT_INCOMPATIBLE",
        field: "runOrders",
        message:
          "runOrders differ for K: P has dimGroup 1, tokenTile 1, D has dimGroup 32, tokenTile 1 (the engines order a head's elements differently)",
      }),
    );
    // Plain rows on D: V matches, K does not.
    const rows = kvLayout(
      shape(tiny, { tpSize: 1, blockSize: 32, numBlocks: 4, order: "HND" }),
      "one-region-kv-in-block",
    );
    expect(() => planTransfer(cpu(32, 4), rows, req)).toThrow(
      expect.objectContaining({ code: "ERR_LAYOUT_INCOMPATIBLE", field: "runOrders" }),
    );
  });

  it("a peer with opaque blocks and no run order: one block size, whole blocks", () => {
    const { runOrders: _, ...old } = cpu(32, 4);
    expect(() => planTransfer(old, cpu(64, 2), req)).toThrow(
      expect.objectContaining({ code: "ERR_LAYOUT_INCOMPATIBLE", field: "blockSize" }),
    );
    expect(() => planTransfer(cpu(64, 2), old, req)).toThrow(
      expect.objectContaining({ code: "ERR_LAYOUT_INCOMPATIBLE", field: "blockSize" }),
    );
    // One block size: the whole last block moves, as between two opaque layouts.
    const p = planTransfer(cpu(32, 4), old, { ...req, numTokens: 40 });
    expect(p.bytes).toBe(2 * 32 * 2 * 2 * 2 * 32 * 2);
  });

  it("run orders that do not fit the layout", () => {
    const bad = (runOrders: KvRunOrder[], field = "src.runOrders") =>
      expect(() => planTransfer({ ...cpu(32, 4), runOrders }, cpu(32, 4), req)).toThrow(
        expect.objectContaining({ code: "ERR_LAYOUT_INVALID", field }),
      );
    bad([{ dimGroup: 3, tokenTile: 1 }, VEC[1]!]);
    bad([{ dimGroup: 1, tokenTile: 5 }, VEC[1]!]);
    bad([VEC[0]!]);
    const nhd = {
      ...kvLayout(
        shape(tiny, { tpSize: 1, blockSize: 32, numBlocks: 4, order: "NHD" }),
        "region-per-layer-kv-in-cell",
      ),
      runOrders: VEC,
    };
    expect(() => planTransfer(nhd, nhd, req)).toThrow(
      expect.objectContaining({ code: "ERR_LAYOUT_INVALID", field: "src.runOrders" }),
    );
  });

  it("travel on the wire and back unchanged", () => {
    const l = cpu(64, 6);
    expect(kvLayoutFromProto(kvLayoutToProto(l))).toEqual(l);
    const rows = kvLayout(
      shape(tiny, { tpSize: 1, blockSize: 32, numBlocks: 4, order: "HND" }),
      "one-region-kv-in-block",
    );
    expect(kvLayoutFromProto(kvLayoutToProto(rows))).toEqual(rows);
  });
});
