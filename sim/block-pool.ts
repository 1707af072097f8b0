/**
 * A simulated engine's KV blocks on one rank: which are free, in what order they
 * are handed out, and the requests waiting for blocks to come back.
 */

import { ControlError } from "./engine-input.js";

/**
 * Free blocks of the engine's cache, handed out in random order (so tables are non-contiguous).
 * A request that needs more blocks than are free waits for releases, first come first served, as
 * a scheduler queues a request until its KV fits; one that needs more than the whole cache, or
 * that waited `waitMs`, is refused with ERR_NO_BLOCKS.
 */
export class BlockPool {
  private readonly free: number[];
  private readonly waiters: {
    n: number;
    grant: (ids: number[]) => void;
    refuse: (err: Error) => void;
    timer: NodeJS.Timeout;
  }[] = [];
  constructor(
    readonly total: number,
    private readonly random: () => number,
    private readonly waitMs: number,
  ) {
    this.free = Array.from({ length: total }, (_, i) => i);
  }
  get freeCount(): number {
    return this.free.length;
  }
  async take(n: number): Promise<number[]> {
    if (n > this.total) {
      throw new ControlError(
        "ERR_NO_BLOCKS",
        `need ${n} blocks, the cache has ${this.total} in all`,
      );
    }
    if (this.waiters.length === 0 && n <= this.free.length) return this.pick(n);
    if (this.waitMs === 0) {
      throw new ControlError("ERR_NO_BLOCKS", `need ${n} blocks, ${this.free.length} are free`);
    }
    return new Promise((resolve, reject) => {
      const waiter = {
        n,
        grant: resolve,
        refuse: reject,
        timer: setTimeout(() => {
          const i = this.waiters.indexOf(waiter);
          if (i >= 0) this.waiters.splice(i, 1);
          reject(
            new ControlError(
              "ERR_NO_BLOCKS",
              `need ${n} blocks, ${this.free.length} were free after waiting ${this.waitMs} ms for releases`,
            ),
          );
          this.serve(); // a smaller request behind this one may fit now
        }, this.waitMs),
      };
      this.waiters.push(waiter);
    });
  }
  give(ids: Iterable<number>): void {
    for (const id of ids) this.free.push(id);
    this.serve();
  }
  /** Refuses every waiting request (the engine stops). */
  refuseWaiting(): void {
    for (const w of this.waiters.splice(0)) {
      clearTimeout(w.timer);
      w.refuse(
        new ControlError("ERR_ABORTED", "the engine stopped while this request waited for blocks"),
      );
    }
  }
  private serve(): void {
    while (this.waiters.length > 0 && this.waiters[0]!.n <= this.free.length) {
      const w = this.waiters.shift()!;
      clearTimeout(w.timer);
      w.grant(this.pick(w.n));
    }
  }
  private pick(n: number): number[] {
    const out: number[] = [];
    for (let i = 0; i < n; i++) {
      const j = Math.floor(this.random() * this.free.length);
      out.push(this.free[j]!);
      this.free[j] = this.free[this.free.length - 1]!;
      this.free.pop();
    }
    return out;
  }
}
