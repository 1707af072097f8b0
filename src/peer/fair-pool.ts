/**
 * Bounded pools shared fairly between groups (issue 48): what anyone can make a sidecar hold
 * (connections before they authenticate, streams, registrations no engine asked for) lives in
 * one of these. A pool never refuses room to a group smaller than the largest one: when it is
 * full, the oldest member of the largest group makes room. So a fixed share per group, which
 * more groups defeat, is not what bounds an attacker; an attacker holding more than any other
 * group is the first to lose its members, whatever number of groups it has, and a newcomer is
 * displaced only once the pool holds as many groups as it has room for.
 *
 * Every operation is O(1): groups are kept in buckets by size, and a group's members in the
 * order they came (a Set keeps insertion order).
 */
import { isIPv4, isIPv6 } from "node:net";

/** Members grouped by a key, at most `capacity` in all. */
export class FairPool<M> {
  private readonly groups = new Map<string, Set<M>>();
  private readonly groupOf = new Map<M, string>();
  /** Group size -> the groups of that size (in the order they reached it). */
  private readonly bySize = new Map<number, Set<string>>();
  private largest = 0;

  constructor(readonly capacity: number) {}

  get size(): number {
    return this.groupOf.size;
  }

  get full(): boolean {
    return this.groupOf.size >= this.capacity;
  }

  /** Members of `group` now. */
  count(group: string): number {
    return this.groups.get(group)?.size ?? 0;
  }

  /** The size of the largest group. */
  get largestGroup(): number {
    return this.largest;
  }

  has(m: M): boolean {
    return this.groupOf.has(m);
  }

  /** The group `m` is counted under, if it is a member. */
  group(m: M): string | undefined {
    return this.groupOf.get(m);
  }

  /** Adds `m` to `group` (the caller made room; a member already in is moved). */
  add(m: M, group: string): void {
    this.delete(m);
    let g = this.groups.get(group);
    if (g === undefined) this.groups.set(group, (g = new Set()));
    this.resize(group, g.size, g.size + 1);
    g.add(m);
    this.groupOf.set(m, group);
  }

  /** Removes `m`; false when it was not a member. */
  delete(m: M): boolean {
    const group = this.groupOf.get(m);
    if (group === undefined) return false;
    this.groupOf.delete(m);
    const g = this.groups.get(group)!;
    g.delete(m);
    this.resize(group, g.size + 1, g.size);
    if (g.size === 0) this.groups.delete(group);
    return true;
  }

  /** The oldest member of `group`. */
  oldest(group: string): M | undefined {
    return this.groups.get(group)?.values().next().value;
  }

  /**
   * Who makes room for a newcomer of `group` in a full pool: the oldest member of the largest
   * group when that group is larger than the newcomer's; when the newcomer's own group is (one
   * of) the largest, its own oldest member if `own`, else nobody (the newcomer is refused).
   */
  victimFor(group: string, own: boolean): M | undefined {
    if (this.count(group) >= this.largest) return own ? this.oldest(group) : undefined;
    return this.oldestOfLargest();
  }

  /** The oldest member of (the first group to reach) the largest size. */
  oldestOfLargest(): M | undefined {
    const top = this.bySize.get(this.largest);
    const first = top?.values().next().value;
    return first === undefined ? undefined : this.oldest(first);
  }

  members(): IterableIterator<M> {
    return this.groupOf.keys();
  }

  private resize(group: string, from: number, to: number): void {
    if (from > 0) {
      const b = this.bySize.get(from)!;
      b.delete(group);
      if (b.size === 0) this.bySize.delete(from);
    }
    if (to > 0) {
      let b = this.bySize.get(to);
      if (b === undefined) this.bySize.set(to, (b = new Set()));
      b.add(group);
    }
    if (to > this.largest) this.largest = to;
    else if (from === this.largest && !this.bySize.has(from)) this.largest = to;
  }
}

/**
 * The group a network address counts under for fairness: an IPv4 address by itself (/32), an
 * IPv6 address by its /64 (one host or subnet is given a /64: its 2^64 addresses are one
 * source), an IPv4-mapped IPv6 address as the IPv4 address. Anything else as it is.
 */
export function addressGroup(address: string | undefined): string {
  const a = (address ?? "?").replace(/^::ffff:(?=\d+\.\d+\.\d+\.\d+$)/i, "");
  if (isIPv4(a)) return a;
  if (!isIPv6(a)) return a;
  return `${ipv6Prefix64(a)}::/64`;
}

/** The first four 16-bit groups of an IPv6 address, in lower-case hex without leading zeros. */
function ipv6Prefix64(a: string): string {
  const bare = a.replace(/%.*$/, "").toLowerCase();
  const [head, tail] = bare.includes("::") ? bare.split("::") : [bare, undefined];
  const left = head === "" ? [] : head!.split(":");
  const right = tail === undefined || tail === "" ? [] : tail.split(":");
  // An embedded IPv4 tail (::1.2.3.4) is two groups, past the /64 anyway.
  const fill = tail === undefined ? 0 : 8 - left.length - right.length;
  const all = [...left, ...Array<string>(Math.max(0, fill)).fill("0"), ...right];
  return all
    .slice(0, 4)
    .map((g) => (/^[0-9a-f]{1,4}$/.test(g) ? parseInt(g, 16).toString(16) : "0"))
    .join(":");
}
