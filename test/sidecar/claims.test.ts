// The block claims table (claims.ts) on its own: what a clash names, that a transfer never
// clashes with itself, and that releasing only ever drops the releaser's own claims.
import { describe, expect, it } from "vitest";

import { BlockClaims } from "../../src/sidecar/claims.js";

describe("BlockClaims", () => {
  it("a clash names the first block another live transfer holds, by its position", () => {
    const c = new BlockClaims();
    c.claim([4, 5], "a");
    expect(c.clash([1, 2, 5, 4], 3, "b")).toBe(
      "block_ids[5] = 5 is held by live transfer 'a' (two live transfers may not claim one block; retry once it ends)",
    );
    expect(c.clash([1, 2], 0, "b")).toBeUndefined();
  });

  it("a transfer's own claims never clash with it", () => {
    const c = new BlockClaims();
    c.claim([4, 5], "a");
    expect(c.clash([4, 5], 0, "a")).toBeUndefined();
  });

  it("releasing drops only the releaser's claims; unclaiming ids it never claimed is harmless", () => {
    const c = new BlockClaims();
    c.claim([4, 5], "a");
    c.claim([6], "b");
    c.release([5, 6, 7], "b");
    expect(c.clash([5], 0, "c")).toContain("held by live transfer 'a'");
    expect(c.clash([6], 0, "c")).toBeUndefined();
    c.release([4, 5], "a");
    expect(c.clash([4, 5, 6], 0, "c")).toBeUndefined();
  });
});
