/**
 * What P's and D's sides share: the table of one side's transfers, its lifecycle (built from the
 * side's table in lifecycle.ts and its entry and exit effects), live counts, the cap and the
 * listing. Each side adds its handlers.
 */
import type { SideContext } from "./context.js";
import { begin, isTerminal, type Lifecycle, type Tracked } from "./lifecycle.js";
import type { TransferTrace } from "./trace.js";
import type { TerminalKind, TransferInfo, TransferSide } from "./view.js";

export abstract class SideTable<S extends string, T extends Tracked<S> & { trace: TransferTrace }> {
  protected readonly transfers = new Map<string, T>();
  protected readonly lc: Lifecycle<S, T>;
  /** Live (non-terminal) entries, kept as they start and end: every cap check is O(1). */
  private liveCount = 0;

  constructor(
    protected readonly ctx: SideContext,
    side: TransferSide,
    initial: readonly S[],
    next: Readonly<Record<S, readonly S[]>>,
  ) {
    this.lc = {
      side,
      initial,
      next,
      log: ctx.log,
      enter: (t, to) => this.enter(t, to),
      exit: (t, kind) => {
        this.liveCount--;
        this.exit(t, kind);
      },
      refused: (problem) => ctx.errors.note(`ERR_INTERNAL: ${problem}`),
    };
  }

  /** Entry effects of `to` on this side: timing stamps, the state's deadline. */
  protected abstract enter(t: T, to: S): void;
  /** The one exit on this side: blocks back to the engine, the one event. */
  protected abstract exit(t: T, kind: S & TerminalKind): void;
  /** How a transfer is listed (gRPC ListTransfers, `kvxfer status`). */
  protected abstract info(t: T): TransferInfo;

  /** Adds `t` to the table and starts it in `state`. */
  protected track(t: T, state: S, why: string): void {
    this.transfers.set(t.id, t);
    // Counted whatever begin says: a refused start is reported and the entry still live.
    begin(this.lc, t, state, why);
    this.liveCount++;
  }

  /** Removes `t`, an entry of the table (a tombstone, or a live entry that never started here). */
  protected forget(t: T): void {
    this.transfers.delete(t.id);
    if (!isTerminal(t.state)) this.liveCount--;
  }

  has(transferId: string): boolean {
    return this.transfers.has(transferId);
  }

  live(): number {
    return this.liveCount;
  }

  /** Live entries at the cap (O(1): tombstones do not count). */
  protected atCapacity(): boolean {
    return this.liveCount >= this.ctx.settings.maxTransfers;
  }

  /** Adds a hop to a transfer's trace (now); unknown ids: nothing. */
  mark(transferId: string, hop: string): void {
    this.transfers.get(transferId)?.trace.mark(hop);
  }

  /** One transfer as listed, or undefined. */
  infoOf(transferId: string): TransferInfo | undefined {
    const t = this.transfers.get(transferId);
    return t === undefined ? undefined : this.info(t);
  }

  list(): TransferInfo[] {
    return [...this.transfers.values()].map((t) => this.info(t));
  }
}
