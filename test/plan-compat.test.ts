import { fromBinary, toBinary, create } from "@bufbuild/protobuf";
import fc from "fast-check";
import { describe, expect, it } from "vitest";
import { KvBlockOrder, KvLayoutSchema } from "../src/gen/kvxfer/v1/layout_pb.js";
import {
  type KvLayout,
  PlanError,
  assertCompatible,
  findIncompatibility,
  kvLayout,
  mapRanks,
  planTransfer,
  validateKvLayout,
} from "../src/plan/index.js";
import { kvLayoutFromProto, kvLayoutToProto } from "../src/plan/layout-proto.js";
import { type Model, SCHEMES, TP_COMBOS, makeLayout, shape } from "./plan/cases.js";
import { headsOf } from "./plan/reference.js";

const llama8b: Model = {
  numLayers: 32,
  mla: false,
  totalKvHeads: 8,
  headDim: 128,
  dtype: "bfloat16",
  dtypeBytes: 2,
};

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
    expect(err.message).toContain("totalKvHeads 8");
    expect(err.message).toContain("tpSize 3");
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
        fc.constantFrom(...SCHEMES, "scattered" as const),
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
  });
});
