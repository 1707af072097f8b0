/**
 * What D measured of each prefill peer's link: engine blocks landed per millisecond the link was
 * busy with them, from the transfers that became ready lately (issue 52: a large transfer's
 * deadline scales with its size and the rate its link was measured at, so a slow link that is
 * delivering does not time out; a dead one is the peer timeout's to find).
 *
 * "Busy" is the union of the recent transfers' [start, ready] intervals: transfers that ran at
 * once share it (16 in flight over one link measure the link, not a sixteenth of it), and the
 * idle gaps between transfers count for nothing. Pure and bounded: at most `maxSources` links
 * and `keep` transfers each.
 */

/** One transfer that became ready: when its data began to move, when it was ready, its blocks. */
export interface Landed {
  readonly startMs: number;
  readonly readyMs: number;
  readonly blocks: number;
}

/** Milliseconds covered by the union of the intervals [startMs, readyMs]. */
export function busyMs(landed: readonly Landed[]): number {
  const spans = landed
    .map((l) => [l.startMs, Math.max(l.startMs, l.readyMs)] as const)
    .sort((a, b) => a[0] - b[0]);
  let total = 0;
  let from = -Infinity;
  let to = -Infinity;
  for (const [s, e] of spans) {
    if (s > to) {
      if (to > from) total += to - from;
      from = s;
      to = e;
    } else if (e > to) {
      to = e;
    }
  }
  if (to > from) total += to - from;
  return total;
}

export class LinkRates {
  private readonly bySource = new Map<string, Landed[]>();

  constructor(
    private readonly maxSources = 1024,
    private readonly keep = 32,
  ) {}

  /** A transfer from `source` became ready. */
  landed(source: string, l: Landed): void {
    if (!(l.blocks > 0) || !(l.readyMs >= l.startMs)) return;
    const list = this.bySource.get(source) ?? [];
    // The most recently used source goes last: the first is the one to drop at the cap.
    this.bySource.delete(source);
    list.push(l);
    if (list.length > this.keep) list.shift();
    this.bySource.set(source, list);
    if (this.bySource.size > this.maxSources)
      this.bySource.delete(this.bySource.keys().next().value!);
  }

  /** Blocks per busy millisecond the link from `source` delivered lately; undefined if unmeasured. */
  blocksPerMs(source: string): number | undefined {
    const list = this.bySource.get(source);
    if (list === undefined) return undefined;
    const busy = busyMs(list);
    const blocks = list.reduce((n, l) => n + l.blocks, 0);
    // A transfer ready within the clock's millisecond: at least 1 ms, never an infinite rate.
    return blocks / Math.max(1, busy);
  }
}
