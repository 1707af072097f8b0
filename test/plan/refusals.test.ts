// The planner's refusals of a bad request, each by its field and exact text: what an engine or
// a peer sees when its block ids, token counts or rank lists are wrong.
import { describe, expect, it } from "vitest";

import { kvLayout, planTransfer, type KvLayout, type PlanRequest } from "../../src/plan/index.js";
import { llama8b, shape } from "./cases.js";

const L: KvLayout = kvLayout(
  shape(llama8b, { tpSize: 1, blockSize: 16, numBlocks: 8, order: "HND" }),
);
const OPAQUE: KvLayout = { ...L, opaqueBlocks: true };

/** `field: message` of the planner's refusal, or "planned" when it plans. */
function refusal(req: Partial<PlanRequest> & { numTokens: number }, src = L, dst = L, opts = {}) {
  const full = { srcBlockIds: [0, 1], dstBlockIds: [2, 3], ...req } as PlanRequest;
  try {
    planTransfer(src, dst, full, opts);
    return "planned";
  } catch (err) {
    const e = err as { code: string; field: string; message: string };
    expect(e.code).toBe("ERR_PLAN_INVALID");
    return `${e.field}: ${e.message}`;
  }
}

describe("planTransfer refuses a bad request by field and text", () => {
  it("token counts", () => {
    expect(refusal({ numTokens: -1 })).toBe("numTokens: numTokens must be an integer >= 0, got -1");
    expect(refusal({ numTokens: 1.5 })).toBe(
      "numTokens: numTokens must be an integer >= 0, got 1.5",
    );
    expect(refusal({ numTokens: 20, prefixTokens: 21 })).toBe(
      "prefixTokens: prefixTokens 21 is not within 0..20",
    );
    expect(refusal({ numTokens: 20, prefixTokens: -1 })).toBe(
      "prefixTokens: prefixTokens -1 is not within 0..20",
    );
    expect(refusal({ numTokens: 20, prefixTokens: 0.5 })).toBe(
      "prefixTokens: prefixTokens 0.5 is not within 0..20",
    );
    expect(refusal({ numTokens: 20, prefixTokens: 20 })).toBe("planned");
    expect(refusal({ numTokens: 20, prefixTokens: 0 })).toBe("planned");
  });

  it("a prefix inside a block of opaque blocks", () => {
    expect(refusal({ numTokens: 20, prefixTokens: 3 }, OPAQUE, OPAQUE)).toBe(
      "prefixTokens: prefixTokens 3 is not a multiple of the block size 16: opaque blocks move whole",
    );
    expect(refusal({ numTokens: 20, prefixTokens: 16 }, OPAQUE, OPAQUE)).toBe("planned");
  });

  it("block id lists too short, missing, or not lists", () => {
    expect(refusal({ numTokens: 20, srcBlockIds: [0] })).toBe(
      "srcBlockIds: srcBlockIds has 1 blocks; 20 tokens in blocks of 16 need 2",
    );
    expect(refusal({ numTokens: 20, dstBlockIds: [] })).toBe(
      "dstBlockIds: dstBlockIds has 0 blocks; 20 tokens in blocks of 16 need 2",
    );
    expect(refusal({ numTokens: 20, dstBlockIds: null as unknown as number[] })).toBe(
      "dstBlockIds: dstBlockIds has undefined blocks; 20 tokens in blocks of 16 need 2",
    );
    expect(refusal({ numTokens: 20, srcBlockIds: { length: "2" } as unknown as number[] })).toBe(
      "srcBlockIds: srcBlockIds has 2 blocks; 20 tokens in blocks of 16 need 2",
    );
  });

  it("block ids out of range, and a D block listed twice", () => {
    expect(refusal({ numTokens: 20, srcBlockIds: [0, 8] })).toBe(
      "srcBlockIds: srcBlockIds[1] = 8 is not a block id below numBlocks 8",
    );
    expect(refusal({ numTokens: 20, dstBlockIds: [-1, 3] })).toBe(
      "dstBlockIds: dstBlockIds[0] = -1 is not a block id below numBlocks 8",
    );
    expect(refusal({ numTokens: 20, dstBlockIds: [3, 3] })).toBe(
      "dstBlockIds: dstBlockIds lists block 3 twice",
    );
  });

  it("rank lists", () => {
    expect(refusal({ numTokens: 20 }, L, L, { srcRanks: [1] })).toBe(
      "srcRanks: srcRanks lists rank 1, not within 0..0",
    );
    expect(refusal({ numTokens: 20 }, L, L, { dstRanks: [-1] })).toBe(
      "dstRanks: dstRanks lists rank -1, not within 0..0",
    );
  });
});
