// The fair pools everything an outsider can make a sidecar hold lives in (issue 48), and the
// address groups they count sources by (IPv4 /32, IPv6 /64).
import fc from "fast-check";
import { describe, expect, it } from "vitest";

import { FairPool, addressGroup } from "../../src/peer/fair-pool.js";

describe("FairPool", () => {
  it("names the oldest member of the largest group as the one to make room, never a smaller group's", () => {
    const p = new FairPool<string>(6);
    for (const m of ["a1", "a2", "a3", "b1", "b2", "c1"]) p.add(m, m[0]!);
    expect(p.full).toBe(true);
    expect(p.largestGroup).toBe(3);
    // A newcomer of a new group (d) or a small one (c, b) displaces a's oldest.
    expect(p.victimFor("d", false)).toBe("a1");
    expect(p.victimFor("c", false)).toBe("a1");
    expect(p.victimFor("b", false)).toBe("a1");
    // The largest group's own newcomer: its own oldest, or nobody.
    expect(p.victimFor("a", true)).toBe("a1");
    expect(p.victimFor("a", false)).toBeUndefined();
    p.delete("a1");
    p.add("d1", "d");
    // a and b now tie at 2: the group that was at 2 first (b; a came down to it) gives first.
    expect(p.largestGroup).toBe(2);
    expect(p.victimFor("d", false)).toBe("b1");
    expect(p.victimFor("b", false)).toBeUndefined();
    expect(p.victimFor("a", true)).toBe("a2");
  });

  it("keeps its counts right under any sequence of adds and deletes (checked against a model)", () => {
    fc.assert(
      fc.property(
        fc.array(
          fc.tuple(fc.boolean(), fc.integer({ min: 0, max: 30 }), fc.integer({ min: 0, max: 4 })),
          { maxLength: 300 },
        ),
        (ops) => {
          const p = new FairPool<number>(1000);
          const model = new Map<number, number>(); // member -> group
          for (const [add, m, g] of ops) {
            if (add) {
              p.add(m, `g${g}`);
              model.set(m, g);
            } else {
              expect(p.delete(m)).toBe(model.delete(m));
            }
            const sizes = new Map<number, number>();
            for (const gg of model.values()) sizes.set(gg, (sizes.get(gg) ?? 0) + 1);
            expect(p.size).toBe(model.size);
            expect(p.largestGroup).toBe(Math.max(0, ...sizes.values()));
            for (let k = 0; k <= 4; k++) expect(p.count(`g${k}`)).toBe(sizes.get(k) ?? 0);
            const v = p.oldestOfLargest();
            if (model.size === 0) expect(v).toBeUndefined();
            else expect(sizes.get(model.get(v!)!)).toBe(p.largestGroup);
          }
        },
      ),
      { numRuns: 200 },
    );
  });

  it("an attacker with more groups than anyone loses its own members first; a newcomer survives as long as there are fewer groups than room", () => {
    const room = 64;
    const p = new FairPool<string>(room);
    let n = 0;
    const join = (m: string, g: string): void => {
      if (p.full) {
        const v = p.victimFor(g, true)!;
        p.delete(v);
      }
      p.add(m, g);
    };
    // 19 attacker addresses, each reconnecting as fast as it likes.
    for (let i = 0; i < 10 * room; i++) join(`x${n++}`, `attacker-${i % 19}`);
    join("legit", "router");
    for (let i = 0; i < 100 * room; i++) join(`x${n++}`, `attacker-${i % 19}`);
    expect(p.has("legit")).toBe(true);
  });
});

describe("addressGroup", () => {
  it("counts IPv4 by the whole address and IPv6 by its /64", () => {
    expect(addressGroup("127.0.0.2")).toBe("127.0.0.2");
    expect(addressGroup("::ffff:127.0.0.2")).toBe("127.0.0.2");
    expect(addressGroup("::1")).toBe("0:0:0:0::/64");
    expect(addressGroup("2001:db8:1:2:aaaa::1")).toBe("2001:db8:1:2::/64");
    expect(addressGroup("2001:0db8:0001:0002:ffff:ffff:ffff:ffff")).toBe("2001:db8:1:2::/64");
    expect(addressGroup("2001:db8:1:3::1")).toBe("2001:db8:1:3::/64");
    expect(addressGroup("2001:db8::")).toBe("2001:db8:0:0::/64");
    expect(addressGroup("fe80::1%eth0")).toBe("fe80:0:0:0::/64");
    expect(addressGroup("::ffff:1.2.3.4")).toBe("1.2.3.4");
    expect(addressGroup(undefined)).toBe("?");
  });

  it("gives every address of one /64 the same group (random interface ids)", () => {
    fc.assert(
      fc.property(
        fc.array(fc.integer({ min: 0, max: 0xffff }), { minLength: 4, maxLength: 4 }),
        (iid) => {
          const a = `2001:db8:aa:bb:${iid.map((x) => x.toString(16)).join(":")}`;
          expect(addressGroup(a)).toBe("2001:db8:aa:bb::/64");
        },
      ),
    );
  });
});
