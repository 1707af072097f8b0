import { fromBinary, toBinary, create } from "@bufbuild/protobuf";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { KvBlockOrder, KvLayoutSchema } from "../../src/gen/kvxfer/v1/layout_pb.js";
import {
  type KvLayout,
  MAX_KV_LAYERS,
  PlanError,
  assertCompatible,
  findIncompatibility,
  headStride,
  kvBlockFootprint,
  kvLayout,
  mapRanks,
  planTransfer,
  tokenStride,
  validateKvLayout,
} from "../../src/plan/index.js";
import { kvLayoutFromProto, kvLayoutToProto } from "../../src/plan/layout-proto.js";
import { type Model, SCHEMES, TP_COMBOS, llama8b, makeLayout, shape } from "./cases.js";
import { headsOf } from "./reference.js";

function base(over: Partial<KvLayout> = {}, tpSize = 2): KvLayout {
  const l = kvLayout(shape(llama8b, { tpSize, blockSize: 16, numBlocks: 100, order: "HND" }));
  return { ...l, ...over };
}

function refusal(fn: () => unknown): PlanError {
  try {
    fn();
  } catch (err) {
    expect(err).toBeInstanceOf(PlanError);
    return err as PlanError;
  }
  throw new Error("expected a PlanError");
}

describe("compatibility check", () => {
  const mla = kvLayout(
    shape(
      { ...llama8b, mla: true, totalKvHeads: 1, headDim: 576 },
      { tpSize: 2, blockSize: 16, numBlocks: 100, order: "HND" },
    ),
  );
  const refused: [string, KvLayout, KvLayout, string, string][] = [
    ["layer count", base(), kvLayout({ ...base(), numLayers: 80 }), "numLayers", "32"],
    ["head size", base(), kvLayout({ ...base(), headDim: 64 }), "headDim", "64"],
    ["dtype", base(), base({ dtype: "float16" }), "dtype", "float16"],
    [
      "dtype size",
      base(),
      kvLayout({ ...base(), dtype: "bfloat16", dtypeBytes: 1 }),
      "dtypeBytes",
      "1",
    ],
    ["total KV heads", base(), kvLayout({ ...base(), totalKvHeads: 4 }), "totalKvHeads", "4"],
    ["MLA vs not", base(), { ...mla, headDim: 128 }, "mla", "true"],
    ["TP 2 vs 3", base(), kvLayout({ ...base(), totalKvHeads: 6, tpSize: 3 }), "totalKvHeads", "6"],
  ];
  for (const [what, p, d, field, value] of refused) {
    it(`refuses a different ${what}, naming ${field} and both values`, () => {
      const err = refusal(() => assertCompatible(p, d));
      expect(err.code).toBe("ERR_LAYOUT_INCOMPATIBLE");
      expect(err.field).toBe(field);
      expect(err.message).toContain(field);
      expect(err.message).toContain(String(p[field as keyof KvLayout]));
      expect(err.message).toContain(value);
      expect(findIncompatibility(p, d)?.field).toBe(field);
    });
  }

  it("refuses TP sizes where neither divides the other, either direction", () => {
    const model = { ...llama8b, totalKvHeads: 12 };
    for (const [a, b] of [
      [4, 6],
      [6, 4],
      [2, 3],
      [3, 4],
    ] as const) {
      const p = kvLayout(shape(model, { tpSize: a, blockSize: 16, numBlocks: 10, order: "HND" }));
      const d = kvLayout(shape(model, { tpSize: b, blockSize: 16, numBlocks: 10, order: "HND" }));
      const err = refusal(() =>
        planTransfer(p, d, { numTokens: 0, srcBlockIds: [], dstBlockIds: [] }),
      );
      expect(err.code).toBe("ERR_LAYOUT_INCOMPATIBLE");
      expect(err.field).toBe("tpSize");
      expect(err.message).toContain(`P has ${a}, D has ${b}`);
    }
  });

  it("refuses heads that do not split over a TP size, naming the side and field", () => {
    const p = base({ tpSize: 3 });
    const err = refusal(() => assertCompatible(p, base()));
    expect(err.code).toBe("ERR_LAYOUT_INVALID");
    expect(err.field).toBe("src.tpSize");
    expect(err.message).toContain("the 8 KV heads");
    expect(err.message).toContain("TP 3");
    const err2 = refusal(() => assertCompatible(base(), base({ tpSize: 5 })));
    expect(err2.field).toBe("dst.tpSize");
  });

  it("accepts every TP pairing 1-8 that divides, any block sizes, orders and addressing", () => {
    fc.assert(
      fc.property(
        fc.constantFrom(...TP_COMBOS),
        fc.integer({ min: 1, max: 256 }),
        fc.integer({ min: 1, max: 256 }),
        fc.constantFrom(...SCHEMES, "scattered" as const),
        fc.constantFrom("HND" as const, "NHD" as const),
        ([h, p, d], bp, bd, scheme, order) => {
          const model = { ...llama8b, numLayers: 2, totalKvHeads: h };
          const src = makeLayout(
            shape(model, { tpSize: p, blockSize: bp, numBlocks: 3, order }),
            scheme,
          );
          const dst = makeLayout(
            shape(model, { tpSize: d, blockSize: bd, numBlocks: 5, order: "NHD" }),
            "scattered",
            bp,
          );
          expect(findIncompatibility(src, dst)).toBeUndefined();
        },
      ),
    );
  });

  it("refuses any one model field changed, naming it", () => {
    const fields = ["numLayers", "totalKvHeads", "headDim", "dtype", "dtypeBytes", "mla"] as const;
    fc.assert(
      fc.property(fc.constantFrom(...fields), fc.boolean(), (field, flip) => {
        const p = base();
        let changed: Model = { ...llama8b };
        if (field === "mla") changed = { ...llama8b, mla: true, totalKvHeads: 1 };
        else if (field === "dtype") changed = { ...llama8b, dtype: "float16" };
        else changed = { ...llama8b, [field]: llama8b[field] * 2 };
        const d = kvLayout(
          shape(changed, { tpSize: 2, blockSize: 32, numBlocks: 7, order: "NHD" }),
        );
        const err = flip ? findIncompatibility(d, p) : findIncompatibility(p, d);
        expect(err?.code).toBe("ERR_LAYOUT_INCOMPATIBLE");
        expect(err?.field).toBe(field);
      }),
    );
  });
});

describe("layout validation", () => {
  const cases: [string, Partial<KvLayout>, string][] = [
    ["zero layers", { numLayers: 0 }, "numLayers"],
    ["fractional head size", { headDim: 1.5 }, "headDim"],
    ["rank beyond TP", { tpRank: 2 }, "tpRank"],
    ["unknown order", { order: "HDN" as "HND" }, "order"],
    ["empty dtype", { dtype: "" }, "dtype"],
    ["MLA with 8 heads", { mla: true }, "totalKvHeads"],
    ["missing slots", { slots: [] }, "slots"],
    ["slot past its region", { regionBytes: new Array<number>(32).fill(1000) }, "slots"],
    ["slot in a missing region", {}, "slots"],
    ["stride below a block", { blockStride: 100 }, "blockStride"],
    ["negative region size", {}, "regionBytes"],
  ];
  for (const [what, over, field] of cases) {
    it(`refuses ${what} (${field})`, () => {
      let l = base(over);
      if (what === "slot in a missing region") {
        l = { ...l, slots: l.slots.map((s, i) => (i === 5 ? { ...s, region: 32 } : s)) };
      }
      if (what === "negative region size")
        l = { ...l, regionBytes: [-1, ...l.regionBytes.slice(1)] };
      const err = refusal(() => validateKvLayout(l));
      expect(err.code).toBe("ERR_LAYOUT_INVALID");
      expect(err.field).toBe(field);
    });
  }

  it("refuses overlapping slots, and accepts interleaved ones that only touch", () => {
    const l = kvLayout(
      shape(llama8b, { tpSize: 8, blockSize: 16, numBlocks: 10, order: "HND" }),
      "region-per-layer-blocks-first",
    );
    expect(() => validateKvLayout(l)).not.toThrow();
    const bb = 16 * 128 * 2;
    const roomy = { ...l, regionBytes: l.regionBytes.map(() => 80 * bb) };
    expect(() => validateKvLayout(roomy)).not.toThrow();
    const shifted = {
      ...roomy,
      slots: l.slots.map((s, i) => (i === 1 ? { ...s, offset: bb - 1 } : s)),
    };
    expect(refusal(() => validateKvLayout(shifted)).message).toContain("overlap");
    // Slot 1 moved to the far end of slot 0's last block: V's block 0 meets K's block 9.
    const far = {
      ...roomy,
      slots: l.slots.map((s, i) => (i === 1 ? { ...s, offset: 9 * 2 * bb + 5 } : s)),
    };
    expect(refusal(() => validateKvLayout(far)).message).toContain("overlap");
    const past = {
      ...roomy,
      slots: l.slots.map((s, i) => (i === 1 ? { ...s, offset: 20 * bb } : s)),
    };
    expect(() => validateKvLayout(past)).not.toThrow();
  });
});

describe("slot overlap check", () => {
  it("agrees with a block-by-block comparison", () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 1, max: 5 }),
        fc.integer({ min: 0, max: 3 }),
        fc.array(fc.integer({ min: 0, max: 60 }), { minLength: 2, maxLength: 2 }),
        (numBlocks, pad, offsets) => {
          // One layer, K and V in one region; block bytes 4 (4 tokens x 1 head x 1 byte).
          const model = { ...llama8b, numLayers: 1, totalKvHeads: 1, headDim: 1, dtypeBytes: 1 };
          const l = kvLayout(shape(model, { tpSize: 1, blockSize: 4, numBlocks, order: "HND" }));
          const stride = 4 + pad;
          const layout: KvLayout = {
            ...l,
            blockStride: stride,
            regionBytes: [200],
            slots: offsets.map((offset) => ({ region: 0, offset })),
          };
          let brute = false;
          for (let i = 0; i < numBlocks; i++)
            for (let j = 0; j < numBlocks; j++) {
              const a = offsets[0]! + i * stride;
              const b = offsets[1]! + j * stride;
              if (a < b + 4 && b < a + 4) brute = true;
            }
          if (brute) expect(refusal(() => validateKvLayout(layout)).message).toContain("overlap");
          else expect(() => validateKvLayout(layout)).not.toThrow();
        },
      ),
      { numRuns: 500 },
    );
  });
});

describe("request checks", () => {
  const p = base();
  const d = base({}, 4);
  const ids = [0, 1, 2, 3];
  const cases: [string, Parameters<typeof planTransfer>[2], string][] = [
    ["a negative token count", { numTokens: -1, srcBlockIds: ids, dstBlockIds: ids }, "numTokens"],
    [
      "a prefix past the end",
      { numTokens: 50, prefixTokens: 51, srcBlockIds: ids, dstBlockIds: ids },
      "prefixTokens",
    ],
    [
      "too few P blocks",
      { numTokens: 50, srcBlockIds: [0, 1, 2], dstBlockIds: ids },
      "srcBlockIds",
    ],
    [
      "a D block past numBlocks",
      { numTokens: 50, srcBlockIds: ids, dstBlockIds: [0, 1, 2, 100] },
      "dstBlockIds",
    ],
    [
      "a P block id that is not an integer",
      { numTokens: 50, srcBlockIds: [0, 1.5, 2, 3], dstBlockIds: ids },
      "srcBlockIds",
    ],
    [
      "a D block listed twice",
      { numTokens: 50, srcBlockIds: ids, dstBlockIds: [0, 1, 1, 3] },
      "dstBlockIds",
    ],
    [
      "a -1 D block that is read",
      { numTokens: 50, prefixTokens: 16, srcBlockIds: ids, dstBlockIds: [-1, -1, 2, 3] },
      "dstBlockIds",
    ],
  ];
  for (const [what, req, field] of cases) {
    it(`refuses ${what}`, () => {
      const err = refusal(() => planTransfer(p, d, req));
      expect(err.code).toBe("ERR_PLAN_INVALID");
      expect(err.field).toBe(field);
    });
  }

  it("refuses ranks outside the layouts", () => {
    const req = { numTokens: 10, srcBlockIds: ids, dstBlockIds: ids };
    expect(refusal(() => planTransfer(p, d, req, { srcRanks: [2] })).field).toBe("srcRanks");
    expect(refusal(() => planTransfer(p, d, req, { dstRanks: [-1] })).field).toBe("dstRanks");
  });
});

describe("rank mapping", () => {
  it("gives each D head exactly one P rank holding it, and spreads replicas", () => {
    fc.assert(
      fc.property(fc.constantFrom(...TP_COMBOS), fc.boolean(), ([h, p, d], mla) => {
        const model = mla ? { ...llama8b, mla, totalKvHeads: 1 } : { ...llama8b, totalKvHeads: h };
        const src = kvLayout(
          shape(model, { tpSize: p, blockSize: 16, numBlocks: 1, order: "HND" }),
        );
        const dst = kvLayout(
          shape(model, { tpSize: d, blockSize: 16, numBlocks: 1, order: "HND" }),
        );
        const map = mapRanks(src, dst);
        expect(map.map((m) => m.dstRank)).toEqual(Array.from({ length: d }, (_, i) => i));
        const chosen = new Map<number, number[]>(); // head -> P ranks chosen by D ranks
        for (const { dstRank, sources } of map) {
          const want = headsOf(dst, dstRank);
          const got: number[] = [];
          for (const s of sources) {
            const held = headsOf(src, s.srcRank);
            for (let i = 0; i < s.numHeads; i++) {
              expect(s.dstHeadOffset + i).toBe(got.length);
              const head = want[s.dstHeadOffset + i]!;
              expect(held[s.srcHeadOffset + i]).toBe(head);
              got.push(head);
              chosen.set(head, [...(chosen.get(head) ?? []), s.srcRank]);
            }
          }
          expect(got).toEqual(want);
        }
        // D ranks sharing a head use distinct P replicas while replicas last.
        for (const [head, ranks] of chosen) {
          const replicas = [...Array(p).keys()].filter((q) =>
            headsOf(src, q).includes(head),
          ).length;
          expect(new Set(ranks).size).toBe(Math.min(ranks.length, replicas));
        }
      }),
    );
  });

  it("maps Llama-3-8B P TP 2 -> D TP 8 and P TP 8 -> D TP 2 by head slices", () => {
    const m = (p: number, d: number) =>
      mapRanks(base({}, p), base({}, d)).map((x) => x.sources.map((s) => ({ ...s })));
    expect(m(2, 8)[5]).toEqual([{ srcRank: 1, srcHeadOffset: 1, dstHeadOffset: 0, numHeads: 1 }]);
    expect(m(8, 2)[1]).toEqual(
      [4, 5, 6, 7].map((q, i) => ({ srcRank: q, srcHeadOffset: 0, dstHeadOffset: i, numHeads: 1 })),
    );
  });
});

describe("KvLayout protobuf", () => {
  it("round-trips every layout through the wire form", () => {
    fc.assert(
      fc.property(
        fc.constantFrom(...TP_COMBOS),
        fc.constantFrom(...SCHEMES, "scattered" as const, "strided" as const),
        fc.constantFrom("HND" as const, "NHD" as const),
        fc.boolean(),
        fc.integer({ min: 1, max: 1 << 20 }),
        ([h, p], scheme, order, mla, numBlocks) => {
          const model = mla
            ? { ...llama8b, mla, totalKvHeads: 1, headDim: 576 }
            : { ...llama8b, totalKvHeads: h };
          const l = makeLayout(
            shape(model, { tpSize: p, tpRank: p - 1, blockSize: 16, numBlocks, order }),
            scheme,
            numBlocks,
          );
          const wire = toBinary(KvLayoutSchema, kvLayoutToProto(l));
          expect(kvLayoutFromProto(fromBinary(KvLayoutSchema, wire))).toEqual(l);
        },
      ),
      { numRuns: 50 },
    );
  });

  it("refuses a wire layout without an order, or with offsets beyond 2^53, or inconsistent", () => {
    const good = kvLayoutToProto(base());
    const noOrder = create(KvLayoutSchema, { ...good, order: KvBlockOrder.UNSPECIFIED });
    expect(refusal(() => kvLayoutFromProto(noOrder)).field).toBe("order");
    const huge = create(KvLayoutSchema, { ...good, blockStride: 1n << 60n });
    expect(refusal(() => kvLayoutFromProto(huge)).field).toBe("blockStride");
    const short = create(KvLayoutSchema, { ...good, slots: good.slots.slice(1) });
    expect(refusal(() => kvLayoutFromProto(short)).field).toBe("slots");
    for (const field of ["headStride", "tokenStride"] as const) {
      const far = create(KvLayoutSchema, { ...good, [field]: 1n << 53n });
      expect(refusal(() => kvLayoutFromProto(far)).field).toBe(field);
      const tight = create(KvLayoutSchema, { ...good, [field]: 255n });
      expect(refusal(() => kvLayoutFromProto(tight)).field).toBe(field);
    }
  });

  it("carries strides as head_stride = 15 and token_stride = 16, 0 when dense", () => {
    const cpu = kvLayout(
      shape(llama8b, { tpSize: 1, blockSize: 32, numBlocks: 10, order: "HND" }),
      "one-region-kv-in-block",
    );
    const msg = kvLayoutToProto(cpu);
    expect([msg.headStride, msg.tokenStride]).toEqual([2n * 32n * 256n, 256n]);
    expect(KvLayoutSchema.fields.find((f) => f.number === 15)?.localName).toBe("headStride");
    expect(KvLayoutSchema.fields.find((f) => f.number === 16)?.localName).toBe("tokenStride");
    expect(kvLayoutFromProto(fromBinary(KvLayoutSchema, toBinary(KvLayoutSchema, msg)))).toEqual(
      cpu,
    );
    const dense = kvLayoutToProto(base());
    expect([dense.headStride, dense.tokenStride]).toEqual([0n, 0n]);
    const back = kvLayoutFromProto(dense);
    expect("headStride" in back || "tokenStride" in back).toBe(false);
    // A dense stride given explicitly travels as given.
    const explicit = { ...base(), headStride: 16 * 256, tokenStride: 256 };
    expect(kvLayoutFromProto(kvLayoutToProto(explicit))).toEqual(explicit);
  });
});

describe("strided layout validation", () => {
  const row = 128 * 2;
  const cpu = kvLayout(
    shape(llama8b, { tpSize: 2, blockSize: 16, numBlocks: 10, order: "HND" }),
    "one-region-kv-in-block",
  );
  const fused = kvLayout(
    shape(llama8b, { tpSize: 2, blockSize: 16, numBlocks: 10, order: "NHD" }),
    "region-per-layer-kv-in-cell",
  );
  /** One slot per region with these strides, blocks `footprint + pad` apart. */
  const withStrides = (order: "HND" | "NHD", hs: number, ts: number, pad = 0): KvLayout => {
    const base = kvLayout(
      shape(llama8b, { tpSize: 2, blockSize: 16, numBlocks: 10, order }),
      "region-per-layer-kv",
    );
    const fp = 3 * hs + 15 * ts + row;
    return {
      ...base,
      headStride: hs,
      tokenStride: ts,
      blockStride: fp + pad,
      regionBytes: base.regionBytes.map(() => 10 * fp + 9 * pad),
    };
  };
  const moveSlot = (l: KvLayout, s: number, offset: number): KvLayout => ({
    ...l,
    slots: l.slots.map((x, i) => (i === s ? { ...x, offset } : x)),
  });

  it("accepts K and V interleaved per head (vLLM CPU) and per row (fused cells)", () => {
    expect(() => validateKvLayout(cpu)).not.toThrow();
    expect(() => validateKvLayout(fused)).not.toThrow();
    expect(cpu.slots[1]!.offset - cpu.slots[0]!.offset).toBe(16 * row);
    expect(fused.slots[1]!.offset - fused.slots[0]!.offset).toBe(row);
  });

  const cases: [string, KvLayout, string][] = [
    // Below a row as the inner stride, where no other check would notice: rows of one slot meet.
    ["a head stride below a row (NHD)", withStrides("NHD", row - 1, 4 * row), "headStride"],
    ["a token stride below a row (HND)", withStrides("HND", 16 * row, row - 2), "tokenStride"],
    ["a head stride below a row (CPU)", { ...cpu, headStride: row - 1 }, "headStride"],
    [
      "a fractional head stride",
      { ...withStrides("NHD", 2 * row, 7 * row), headStride: row + 0.5 },
      "headStride",
    ],
    ["a negative token stride", { ...fused, tokenStride: -row }, "tokenStride"],
    // HND: a head's 16 tokens a row apart span 16 rows; the next head may not start earlier.
    ["overlapping heads (HND)", withStrides("HND", 16 * row - 1, row), "headStride"],
    ["overlapping heads (CPU layout)", { ...cpu, headStride: 16 * row - 1 }, "headStride"],
    // NHD: a token's 4 heads two rows apart span 7 rows.
    ["overlapping tokens (NHD)", withStrides("NHD", 2 * row, 7 * row - 1), "tokenStride"],
    ["overlapping tokens (fused cells)", { ...fused, tokenStride: 7 * row - 1 }, "tokenStride"],
    ["a block beyond blockStride", withStrides("NHD", 2 * row, 9 * row, -1), "blockStride"],
    // K's blocks fit, but V's block b then runs into K's block b + 1.
    ["K and V blocks too close (CPU)", { ...cpu, blockStride: 112 * row }, "slots"],
    // V one row early: its head 0 meets K's last token of head 0.
    ["V overlapping K's rows (CPU)", moveSlot(cpu, 1, 15 * row), "slots"],
    // V where K's head 1 starts.
    ["V on K's next head (CPU)", moveSlot(cpu, 1, 32 * row), "slots"],
    ["V half a row after K (fused)", moveSlot(fused, 1, row / 2), "slots"],
    // Layer 1's K on layer 0's V, interleaved the same way: same rows.
    ["two layers on the same rows", moveSlot(cpu, 2, 16 * row), "slots"],
    [
      "a region too small for the last block's footprint",
      { ...cpu, regionBytes: [cpu.regionBytes[0]! - 1] },
      "slots",
    ],
    ["more layers than MAX_KV_LAYERS", { ...cpu, numLayers: MAX_KV_LAYERS + 1 }, "numLayers"],
  ];
  for (const [what, l, field] of cases) {
    it(`refuses ${what}, naming ${field}`, () => {
      const err = refusal(() => validateKvLayout(l));
      expect(err.code).toBe("ERR_LAYOUT_INVALID");
      expect(err.field).toBe(field);
      expect(err.message).toContain(
        field === "numLayers" ? "numLayers" : field.replace("slots", "slots["),
      );
    });
  }

  it("accepts the same strides one byte roomier, so each refusal above is at the edge", () => {
    for (const l of [
      withStrides("HND", 16 * row, row),
      withStrides("NHD", 2 * row, 7 * row),
      withStrides("NHD", 2 * row, 9 * row),
      withStrides("HND", 20 * row + 3, row + 1, 5),
      { ...cpu, blockStride: 128 * row },
      moveSlot(cpu, 1, 16 * row),
      moveSlot(fused, 1, row),
    ]) {
      expect(() => validateKvLayout(l)).not.toThrow();
    }
    // A dense NHD layout with a padded head stride needs a token stride to match.
    const nhd = kvLayout(shape(llama8b, { tpSize: 2, blockSize: 16, numBlocks: 10, order: "NHD" }));
    expect(refusal(() => validateKvLayout({ ...nhd, headStride: 2 * row })).field).toBe(
      "tokenStride",
    );
  });

  it("defaults absent or 0 strides to the dense ones of the order", () => {
    for (const order of ["HND", "NHD"] as const) {
      const l = kvLayout(shape(llama8b, { tpSize: 2, blockSize: 16, numBlocks: 4, order }));
      const dense = order === "HND" ? [16 * row, row] : [row, 4 * row];
      expect([headStride(l), tokenStride(l)]).toEqual(dense);
      expect([headStride({ ...l, headStride: 0 }), tokenStride({ ...l, tokenStride: 0 })]).toEqual(
        dense,
      );
      expect(kvBlockFootprint(l)).toBe(16 * 4 * row);
    }
    expect(kvBlockFootprint(cpu)).toBe((3 * 32 + 16) * row);
  });

  it("refuses exactly the slot placements whose rows meet (row by row comparison)", () => {
    // How the runs went: refused, accepted with all slots apart, accepted with rows interleaved.
    const seen = { refused: 0, apart: 0, interleaved: 0 };
    fc.assert(
      fc.property(
        fc.record({
          order: fc.constantFrom("HND" as const, "NHD" as const),
          heads: fc.integer({ min: 1, max: 3 }),
          blockSize: fc.integer({ min: 1, max: 4 }),
          numBlocks: fc.integer({ min: 1, max: 3 }),
          row: fc.integer({ min: 1, max: 3 }),
          pads: fc.array(fc.oneof(fc.constant(0), fc.integer({ min: 1, max: 9 })), {
            minLength: 3,
            maxLength: 3,
          }),
          offsets: fc.array(fc.integer({ min: 0, max: 90 }), { minLength: 2, maxLength: 6 }),
        }),
        ({ order, heads, blockSize, numBlocks, row, pads, offsets }) => {
          const numLayers = offsets.length >> 1;
          const slotOffsets = offsets.slice(0, 2 * numLayers);
          const hnd = order === "HND";
          const nInner = hnd ? blockSize : heads;
          const nOuter = hnd ? heads : blockSize;
          const inner = row + pads[0]!;
          const outer = (nInner - 1) * inner + row + pads[1]!;
          const footprint = (nOuter - 1) * outer + (nInner - 1) * inner + row;
          const blockStride = footprint + pads[2]!;
          const span = (numBlocks - 1) * blockStride + footprint;
          const l: KvLayout = {
            numLayers,
            mla: false,
            totalKvHeads: heads,
            headDim: row,
            dtype: "int8",
            dtypeBytes: 1,
            blockSize,
            numBlocks,
            order,
            tpSize: 1,
            tpRank: 0,
            blockStride,
            headStride: hnd ? outer : inner,
            tokenStride: hnd ? inner : outer,
            slots: slotOffsets.map((offset) => ({ region: 0, offset })),
            regionBytes: [Math.max(...slotOffsets) + span],
          };
          // Every byte each slot covers; a byte covered twice is an overlap.
          const owner = new Map<number, number>();
          let meet = false;
          slotOffsets.forEach((o, s) => {
            for (let b = 0; b < numBlocks; b++)
              for (let h = 0; h < heads; h++)
                for (let t = 0; t < blockSize; t++)
                  for (let e = 0; e < row; e++) {
                    const at = o + b * blockStride + h * l.headStride! + t * l.tokenStride! + e;
                    const prev = owner.get(at);
                    if (prev !== undefined && prev !== s) meet = true;
                    owner.set(at, s);
                  }
          });
          if (meet) {
            expect(refusal(() => validateKvLayout(l)).field).toBe("slots");
            seen.refused++;
          } else {
            expect(() => validateKvLayout(l)).not.toThrow();
            const near = slotOffsets.some((a, i) =>
              slotOffsets.some((b, j) => i !== j && Math.abs(a - b) < span),
            );
            seen[near ? "interleaved" : "apart"]++;
          }
        },
      ),
      { numRuns: 3000 },
    );
    // The runs must cover both verdicts, including slots whose blocks interleave.
    expect(seen.refused).toBeGreaterThan(300);
    expect(seen.apart).toBeGreaterThan(100);
    expect(seen.interleaved).toBeGreaterThan(100);
  });

  it("validates layouts of 160 slots in well under a millisecond each", () => {
    const l70 = { ...llama8b, numLayers: 80 };
    for (const scheme of ["one-region-kv-in-block", "one-region-blocks-first"] as const) {
      const l = kvLayout(
        shape(l70, { tpSize: 1, blockSize: 16, numBlocks: 8192, order: "HND" }),
        scheme,
      );
      const times: number[] = [];
      for (let i = 0; i < 30; i++) {
        const t0 = performance.now();
        validateKvLayout(l);
        times.push(performance.now() - t0);
      }
      const best = Math.min(...times);
      console.log(`validateKvLayout ${scheme}, 160 slots: best ${best.toFixed(3)} ms`);
      // Measured about 0.07 and 0.35 ms on a loaded 2-core machine.
      expect(best).toBeLessThan(3);
    }
  });
});
