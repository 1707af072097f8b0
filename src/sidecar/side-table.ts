/**
 * What P's and D's sides share: the table of one side's transfers, its lifecycle (built from the
 * side's table in lifecycle.ts and its entry and exit effects), live counts, the cap and the
 * listing. Each side adds its handlers.
 */
import type { SideContext } from "./context.js";
import { isTerminal, type Lifecycle, type Tracked } from "./lifecycle.js";
import type { TransferTrace } from "./trace.js";
import type { TerminalKind, TransferInfo, TransferSide } from "./view.js";

export abstract class SideTable<S extends string, T extends Tracked<S> & { trace: TransferTrace }> {
  protected readonly transfers = new Map<string, T>();
  protected readonly lc: Lifecycle<S, T>;

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
      exit: (t, kind) => this.exit(t, kind),
      refused: (problem) => ctx.noteError(`ERR_INTERNAL: ${problem}`),
    };
  }

  /** Entry effects of `to` on this side: timing stamps, the state's deadline. */
  protected abstract enter(t: T, to: S): void;
  /** The one exit on this side: blocks back to the engine, the one event. */
  protected abstract exit(t: T, kind: S & TerminalKind): void;
  /** How a transfer is listed (gRPC ListTransfers, `kvxfer status`). */
  protected abstract info(t: T): TransferInfo;

  has(transferId: string): boolean {
    return this.transfers.has(transferId);
  }

  /** Ids of the live (non-terminal) transfers, copied: ending one while iterating is safe. */
  liveIds(): string[] {
    const out: string[] = [];
    for (const t of this.transfers.values()) if (!isTerminal(t.state)) out.push(t.id);
    return out;
  }

  live(): number {
    let n = 0;
    for (const t of this.transfers.values()) if (!isTerminal(t.state)) n++;
    return n;
  }

  /** Live entries at the cap. Cheap while the table (tombstones included) is below it. */
  protected atCapacity(): boolean {
    const max = this.ctx.settings.maxTransfers;
    return this.transfers.size >= max && this.live() >= max;
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
