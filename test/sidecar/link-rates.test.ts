// D's measure of each prefill peer's link (link-rates.ts): blocks per busy millisecond, busy being
// the union of the recent transfers' intervals; bounded in sources and transfers.
import { describe, expect, it } from "vitest";

import { busyMs, LinkRates } from "../../src/sidecar/link-rates.js";

describe("busyMs", () => {
  it("is the union of the intervals: overlaps count once, gaps not at all", () => {
    expect(busyMs([])).toBe(0);
    expect(busyMs([{ startMs: 0, readyMs: 10, blocks: 1 }])).toBe(10);
    // Three at once over one link, then one alone after an idle gap.
    expect(
      busyMs([
        { startMs: 100, readyMs: 150, blocks: 1 },
        { startMs: 0, readyMs: 10, blocks: 1 },
        { startMs: 5, readyMs: 20, blocks: 1 },
        { startMs: 8, readyMs: 12, blocks: 1 },
      ]),
    ).toBe(20 + 50);
  });
});

describe("LinkRates", () => {
  it("measures the link, not one transfer's share of it: 16 at once, each 1 block in 50 ms", () => {
    const r = new LinkRates();
    expect(r.blocksPerMs("p")).toBeUndefined();
    for (let i = 0; i < 16; i++) r.landed("p", { startMs: 1000, readyMs: 1050, blocks: 1 });
    expect(r.blocksPerMs("p")).toBeCloseTo(16 / 50);
    expect(r.blocksPerMs("q")).toBeUndefined();
  });

  it("one after another with idle gaps: their own times only", () => {
    const r = new LinkRates();
    r.landed("p", { startMs: 0, readyMs: 100, blocks: 10 });
    r.landed("p", { startMs: 60_000, readyMs: 60_100, blocks: 30 });
    expect(r.blocksPerMs("p")).toBeCloseTo(40 / 200);
  });

  it("keeps the last `keep` transfers of a link and the last `maxSources` links used", () => {
    const r = new LinkRates(2, 3);
    r.landed("a", { startMs: 0, readyMs: 1000, blocks: 1 }); // slow, pushed out below
    for (let i = 1; i <= 3; i++) r.landed("a", { startMs: i * 10, readyMs: i * 10 + 5, blocks: 5 });
    expect(r.blocksPerMs("a")).toBeCloseTo(15 / 15);
    r.landed("b", { startMs: 0, readyMs: 10, blocks: 1 });
    r.landed("a", { startMs: 100, readyMs: 105, blocks: 5 }); // a used last: b is the oldest
    r.landed("c", { startMs: 0, readyMs: 10, blocks: 1 });
    expect(r.blocksPerMs("b")).toBeUndefined();
    expect(r.blocksPerMs("a")).toBeDefined();
    expect(r.blocksPerMs("c")).toBeCloseTo(0.1);
  });

  it("ignores what measures nothing, and a transfer ready within the clock's millisecond is 1 ms", () => {
    const r = new LinkRates();
    r.landed("p", { startMs: 10, readyMs: 20, blocks: 0 });
    r.landed("p", { startMs: 30, readyMs: 20, blocks: 4 });
    expect(r.blocksPerMs("p")).toBeUndefined();
    r.landed("p", { startMs: 10, readyMs: 10, blocks: 4 });
    expect(r.blocksPerMs("p")).toBe(4);
  });
});
