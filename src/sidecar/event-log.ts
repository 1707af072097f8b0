/**
 * The sidecar's event log: every terminal transfer event and peer event, with
 * a sequence number, in a bounded ring. Watchers (gRPC WatchEvents) read it
 * through subscriptions; AwaitTransfer waits on it through `waitFor`.
 *
 * A subscription is a cursor into the shared ring, not a queue of its own:
 * events waiting for a slow watcher cost that watcher no memory. Its "buffer"
 * is the number of events appended since it went live that it has not been
 * sent yet; when it pushes back (`pause()`, e.g. its gRPC stream is full)
 * and that number passes `bufferLimit`, it is ended with ERR_FELL_BEHIND (the
 * watcher resumes from its last seq, at once, while those events are
 * retained). A subscriber that is not pushing back is never judged behind: a
 * burst of any size appended in one tick reaches it at the next flush. When
 * the ring drops an event a subscription has not reached, it is ended with
 * ERR_OUT_OF_RANGE: those events are gone.
 */
import { KvxferError } from "../errors.js";
import { isTerminal } from "./lifecycle.js";
import type { EventKind, SidecarEvent, TransferSide } from "./view.js";

export const EVENT_KINDS: readonly EventKind[] = [
  "KV_READY",
  "FAILED",
  "EXPIRED",
  "ABORTED",
  "RELEASED",
  "PEER_UP",
  "PEER_DOWN",
];

export interface EventLogOptions {
  /** Events retained; older ones are dropped. Default 100 000. */
  readonly capacity?: number;
  /** Default `bufferLimit` of subscriptions. Default 10 000. */
  readonly bufferLimit?: number;
  /** Most concurrent `waitFor` calls; more are refused with ERR_TOO_MANY_WAITERS. Default 100 000. */
  readonly maxWaiters?: number;
}

export interface EventFilter {
  /** Only these transfers (peer events have no transfer id, so they are left out). */
  readonly transferIds?: readonly string[];
  readonly kinds?: readonly EventKind[];
}

export interface SubscriptionHandlers {
  /** One event, in seq order, never twice. May call `pause()`. */
  onEvent(ev: SidecarEvent): void;
  /**
   * The subscription ended: `err` is ERR_OUT_OF_RANGE (events it still needed
   * were dropped), ERR_FELL_BEHIND (more than `bufferLimit` live events were
   * waiting for it) or ERR_CLOSED (the log was closed); undefined after `close()`.
   */
  onEnd(err?: KvxferError): void;
  /** The replay reached the end of the log (called once; later events are live). */
  onCaughtUp?(): void;
}

export interface SubscribeOptions {
  /** Live events that may wait for this subscriber; default the log's `bufferLimit`. */
  readonly bufferLimit?: number;
  /** Start with the next event appended; `afterSeq` is ignored. */
  readonly liveOnly?: boolean;
}

export interface EventSubscription {
  /** Every event with seq <= scannedSeq was considered; matching ones were delivered. */
  readonly scannedSeq: number;
  /** The seq of the last event delivered (0: none yet). */
  readonly deliveredSeq: number;
  /** Live events appended and not yet scanned: what "buffer" means here. */
  readonly buffered: number;
  readonly caughtUp: boolean;
  readonly closed: boolean;
  /** Stop delivering (back-pressure); events wait in the log. */
  pause(): void;
  /** Deliver what is waiting, then live events. */
  resume(): void;
  /** Ends the subscription; `onEnd` is called with no error. Idempotent. */
  close(): void;
}

export interface WaitOptions {
  /** Wall-clock ms (Date.now() scale) after which the wait resolves undefined. */
  readonly deadlineMs?: number;
  /** Only this side's terminal event (default: the first one logged). */
  readonly side?: TransferSide;
  /** Aborting resolves the wait with undefined. */
  readonly signal?: AbortSignal;
}

/** What the log knows about a transfer's terminal event. */
export type TerminalLookup =
  | { readonly found: "retained"; readonly event: SidecarEvent }
  | { readonly found: "dropped"; readonly seq: number }
  | { readonly found: "unknown" };

interface Waiter {
  readonly transferId: string;
  readonly side: TransferSide | undefined;
  resolve(ev: SidecarEvent | undefined): void;
}

/** Validates a filter: unknown kinds, empty ids. Throws ERR_INVALID_ARGUMENT. */
export function checkEventFilter(filter: EventFilter): void {
  for (const k of filter.kinds ?? [])
    if (!EVENT_KINDS.includes(k))
      throw new KvxferError(
        "ERR_INVALID_ARGUMENT",
        `unknown event kind '${String(k)}' (known: ${EVENT_KINDS.join(", ")})`,
      );
  for (const id of filter.transferIds ?? [])
    if (id.length === 0)
      throw new KvxferError("ERR_INVALID_ARGUMENT", "empty transfer id in filter");
}

/** A transfer's terminal events still in the ring: the first logged, and each side's first. */
interface Terminals {
  any: SidecarEvent | undefined;
  prefill: SidecarEvent | undefined;
  decode: SidecarEvent | undefined;
}

export class EventLog {
  readonly capacity: number;
  readonly bufferLimit: number;
  readonly maxWaiters: number;
  private readonly ring: (SidecarEvent | undefined)[];
  private last = 0;
  /** Terminal events still in the ring, by transfer id (one lookup per terminal event). */
  private readonly terminal = new Map<string, Terminals>();
  /** Transfers whose terminal event was dropped from the ring: id -> seq; at most `capacity`. */
  private readonly dropped = new Map<string, number>();
  private readonly subs = new Set<Subscription>();
  private readonly waiters = new Map<string, Set<Waiter>>();
  private waiterCount = 0;
  private flushScheduled = false;
  private isClosed = false;

  constructor(opts: EventLogOptions = {}) {
    this.capacity = opts.capacity ?? 100_000;
    this.bufferLimit = opts.bufferLimit ?? 10_000;
    this.maxWaiters = opts.maxWaiters ?? 100_000;
    if (!Number.isInteger(this.capacity) || this.capacity < 1)
      throw new RangeError(`capacity must be a positive integer, got ${this.capacity}`);
    if (!Number.isInteger(this.bufferLimit) || this.bufferLimit < 1)
      throw new RangeError(`bufferLimit must be a positive integer, got ${this.bufferLimit}`);
    this.ring = new Array<SidecarEvent | undefined>(this.capacity);
  }

  /** Oldest retained seq (lastSeq + 1 when the log is empty). */
  get firstSeq(): number {
    return Math.max(1, this.last - this.capacity + 1);
  }
  /** Newest seq (0 before the first append). */
  get lastSeq(): number {
    return this.last;
  }
  /** Events currently retained. */
  get size(): number {
    return this.last - this.firstSeq + 1;
  }
  get subscriberCount(): number {
    return this.subs.size;
  }
  get waiterTotal(): number {
    return this.waiterCount;
  }
  /** Live events waiting for each subscriber (for metrics and tests). */
  subscriberBuffers(): number[] {
    return [...this.subs].map((s) => s.buffered);
  }

  /** Appends one event, assigning the next seq; returns it as stored. */
  append(ev: Omit<SidecarEvent, "seq">): SidecarEvent {
    if (this.isClosed) throw new KvxferError("ERR_CLOSED", "event log is closed");
    const seq = this.last + 1;
    const slot = (seq - 1) % this.capacity;
    const old = this.ring[slot];
    if (old !== undefined) this.forget(old);
    const stored: SidecarEvent = Object.freeze({ ...ev, seq });
    this.ring[slot] = stored;
    this.last = seq;
    if (isTerminal(stored.kind) && stored.transferId !== "") this.index(stored);
    if (this.subs.size > 0) {
      for (const s of this.subs) s.onAppend();
      if (!this.flushScheduled) {
        this.flushScheduled = true;
        queueMicrotask(() => this.flush());
      }
    }
    return stored;
  }

  /** The retained event with this seq, if any. */
  get(seq: number): SidecarEvent | undefined {
    if (!Number.isInteger(seq) || seq < this.firstSeq || seq > this.last) return undefined;
    return this.ring[(seq - 1) % this.capacity];
  }

  /**
   * Retained events with seq > afterSeq, oldest first (at most `limit`).
   * Throws ERR_OUT_OF_RANGE when some of them were already dropped.
   */
  since(afterSeq: number, limit = Infinity): SidecarEvent[] {
    this.checkAfterSeq(afterSeq);
    const out: SidecarEvent[] = [];
    for (let seq = Math.max(afterSeq + 1, this.firstSeq); seq <= this.last; seq++) {
      if (out.length >= limit) break;
      out.push(this.ring[(seq - 1) % this.capacity]!);
    }
    return out;
  }

  /** The terminal event of a transfer: retained, dropped from the log, or never seen. */
  findTerminal(transferId: string, side?: TransferSide): TerminalLookup {
    const t = this.terminal.get(transferId);
    const ev = side === undefined ? t?.any : side === "prefill" ? t?.prefill : t?.decode;
    if (ev !== undefined) return { found: "retained", event: ev };
    const seq = this.dropped.get(transferId);
    if (seq !== undefined) return { found: "dropped", seq };
    return { found: "unknown" };
  }

  /**
   * Resolves with the transfer's terminal event, at once when it is retained,
   * or when it is appended; undefined when the deadline passes or the signal
   * aborts. Throws ERR_NOT_FOUND when the event was dropped from the log.
   */
  waitFor(transferId: string, opts: WaitOptions = {}): Promise<SidecarEvent | undefined> {
    const hit = this.findTerminal(transferId, opts.side);
    if (hit.found === "retained") return Promise.resolve(hit.event);
    if (hit.found === "dropped")
      return Promise.reject(
        new KvxferError(
          "ERR_NOT_FOUND",
          `transfer '${transferId}' ended at seq ${hit.seq}, no longer retained (oldest retained seq ${this.firstSeq})`,
        ),
      );
    if (this.isClosed) return Promise.reject(new KvxferError("ERR_CLOSED", "event log is closed"));
    if (opts.signal?.aborted) return Promise.resolve(undefined);
    if (this.waiterCount >= this.maxWaiters)
      return Promise.reject(
        new KvxferError(
          "ERR_TOO_MANY_WAITERS",
          `${this.waiterCount} transfers are already awaited`,
        ),
      );
    return new Promise((resolve) => {
      let timer: NodeJS.Timeout | undefined;
      const onAbort = (): void => waiter.resolve(undefined);
      const waiter: Waiter = {
        transferId,
        side: opts.side,
        resolve: (ev) => {
          const set = this.waiters.get(transferId);
          if (set === undefined || !set.delete(waiter)) return; // already settled
          if (set.size === 0) this.waiters.delete(transferId);
          this.waiterCount--;
          if (timer !== undefined) clearTimeout(timer);
          opts.signal?.removeEventListener("abort", onAbort);
          resolve(ev);
        },
      };
      let set = this.waiters.get(transferId);
      if (set === undefined) this.waiters.set(transferId, (set = new Set()));
      set.add(waiter);
      this.waiterCount++;
      if (opts.deadlineMs !== undefined && Number.isFinite(opts.deadlineMs)) {
        // setTimeout holds at most ~24.8 days; longer deadlines are re-armed.
        const arm = (): void => {
          const left = opts.deadlineMs! - Date.now();
          if (left <= 0) return waiter.resolve(undefined);
          timer = setTimeout(arm, Math.min(left, 2 ** 31 - 1));
        };
        arm();
      }
      opts.signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  /**
   * Replays retained events with seq > afterSeq that match `filter`, then live
   * ones. Delivery starts after this returns (never inside `subscribe`). Throws
   * ERR_INVALID_ARGUMENT for a bad filter and ERR_OUT_OF_RANGE when afterSeq
   * is older than the log (events it asks for are gone) or newer than lastSeq.
   */
  subscribe(
    afterSeq: number,
    filter: EventFilter,
    handlers: SubscriptionHandlers,
    opts: SubscribeOptions = {},
  ): EventSubscription {
    if (this.isClosed) throw new KvxferError("ERR_CLOSED", "event log is closed");
    checkEventFilter(filter);
    const start = opts.liveOnly ? this.last : afterSeq;
    if (!opts.liveOnly) this.checkAfterSeq(afterSeq);
    const limit = opts.bufferLimit ?? this.bufferLimit;
    if (!Number.isInteger(limit) || limit < 1)
      throw new RangeError(`bufferLimit must be a positive integer, got ${limit}`);
    const sub = new Subscription(this, start, filter, handlers, limit);
    this.subs.add(sub);
    this.scheduleFlush();
    return sub;
  }

  /** Ends every subscription (ERR_CLOSED) and wait; later appends throw. */
  close(): void {
    if (this.isClosed) return;
    this.isClosed = true;
    for (const s of [...this.subs]) s.end(new KvxferError("ERR_CLOSED", "event log is closed"));
    for (const set of [...this.waiters.values()]) for (const w of [...set]) w.resolve(undefined);
  }

  /** @internal */
  checkAfterSeq(afterSeq: number): void {
    if (!Number.isSafeInteger(afterSeq) || afterSeq < 0)
      throw new KvxferError("ERR_INVALID_ARGUMENT", `after_seq must be >= 0, got ${afterSeq}`);
    if (afterSeq > this.last)
      throw new KvxferError(
        "ERR_OUT_OF_RANGE",
        `seq ${afterSeq} is beyond the newest seq ${this.last} of this log (did the sidecar restart?)`,
      );
    // 0 means "whatever is retained"; any other seq must leave no gap.
    if (afterSeq !== 0 && afterSeq < this.firstSeq - 1)
      throw new KvxferError(
        "ERR_OUT_OF_RANGE",
        `events after seq ${afterSeq} are no longer retained: the oldest retained seq is ${this.firstSeq}`,
      );
  }

  /** @internal */
  removeSubscription(s: Subscription): void {
    this.subs.delete(s);
  }

  /** @internal */
  scheduleFlush(): void {
    if (this.flushScheduled) return;
    this.flushScheduled = true;
    queueMicrotask(() => this.flush());
  }

  private flush(): void {
    this.flushScheduled = false;
    for (const s of [...this.subs]) {
      try {
        s.pump();
      } catch (err) {
        // A subscriber's handler threw: that subscriber ends, the others go on.
        s.end(KvxferError.from(err));
      }
    }
  }

  private index(ev: SidecarEvent): void {
    const id = ev.transferId;
    let t = this.terminal.get(id);
    if (t === undefined) {
      t = { any: ev, prefill: undefined, decode: undefined };
      this.terminal.set(id, t);
    } else {
      t.any ??= ev;
    }
    if (ev.side === "prefill") t.prefill ??= ev;
    else if (ev.side === "decode") t.decode ??= ev;
    if (this.dropped.size > 0) this.dropped.delete(id);
    const set = this.waiters.size > 0 ? this.waiters.get(id) : undefined;
    if (set !== undefined)
      for (const w of [...set]) if (w.side === undefined || w.side === ev.side) w.resolve(ev);
  }

  private forget(old: SidecarEvent): void {
    if (!isTerminal(old.kind) || old.transferId === "") return;
    const t = this.terminal.get(old.transferId);
    if (t !== undefined) {
      if (t.any === old) t.any = undefined;
      if (t.prefill === old) t.prefill = undefined;
      if (t.decode === old) t.decode = undefined;
      if (t.any === undefined && t.prefill === undefined && t.decode === undefined)
        this.terminal.delete(old.transferId);
    }
    this.dropped.delete(old.transferId); // re-insert: Map order is age order
    this.dropped.set(old.transferId, old.seq);
    if (this.dropped.size > this.capacity) {
      const oldest = this.dropped.keys().next();
      if (!oldest.done) this.dropped.delete(oldest.value);
    }
  }
}

class Subscription implements EventSubscription {
  private cursor: number; // scanned up to here
  private delivered = 0;
  private paused = false;
  private done = false;
  private pumping = false;
  private reachedHead = false;
  /** The log's lastSeq when this subscription went live (replay ends there). */
  private liveFrom: number;
  private readonly ids: ReadonlySet<string> | undefined;
  private readonly kinds: ReadonlySet<EventKind> | undefined;

  constructor(
    private readonly log: EventLog,
    afterSeq: number,
    filter: EventFilter,
    private readonly handlers: SubscriptionHandlers,
    private readonly limit: number,
  ) {
    this.cursor = afterSeq;
    this.liveFrom = log.lastSeq;
    this.ids = filter.transferIds?.length ? new Set(filter.transferIds) : undefined;
    this.kinds = filter.kinds?.length ? new Set(filter.kinds) : undefined;
  }

  get scannedSeq(): number {
    return this.cursor;
  }
  get deliveredSeq(): number {
    return this.delivered;
  }
  get buffered(): number {
    return this.log.lastSeq - Math.max(this.cursor, this.liveFrom);
  }
  get caughtUp(): boolean {
    return this.reachedHead;
  }
  get closed(): boolean {
    return this.done;
  }

  pause(): void {
    this.paused = true;
  }

  resume(): void {
    if (!this.paused || this.done) return;
    this.paused = false;
    this.log.scheduleFlush();
  }

  close(): void {
    this.end(undefined);
  }

  /** @internal Called on every append and when it pauses: enforces the bounds. */
  onAppend(): void {
    if (this.done) return;
    if (this.cursor < this.log.firstSeq - 1)
      this.end(
        new KvxferError(
          "ERR_OUT_OF_RANGE",
          `fell behind: events after seq ${this.cursor} were dropped (oldest retained seq ${this.log.firstSeq})`,
        ),
      );
    // Only a subscriber that pushes back (paused) can be behind: one that is
    // not gets the whole burst at the next flush, however large.
    else if (this.paused && this.buffered > this.limit)
      this.end(
        new KvxferError(
          "ERR_FELL_BEHIND",
          `fell behind: more than ${this.limit} events waiting; resume after seq ${this.delivered || this.cursor}`,
        ),
      );
  }

  /** @internal Delivers from the cursor to the head until paused. */
  pump(): void {
    if (this.done || this.paused || this.pumping) return;
    this.pumping = true;
    try {
      while (!this.done && !this.paused && this.cursor < this.log.lastSeq) {
        const seq = this.cursor + 1;
        const ev = this.log.get(seq);
        if (ev === undefined) {
          this.end(
            new KvxferError(
              "ERR_OUT_OF_RANGE",
              `fell behind: event ${seq} was dropped (oldest retained seq ${this.log.firstSeq})`,
            ),
          );
          return;
        }
        this.cursor = seq;
        if (this.matches(ev)) {
          this.delivered = seq;
          this.handlers.onEvent(ev);
        }
      }
      if (this.paused) this.onAppend(); // it pushed back with events still waiting
      if (!this.done && !this.reachedHead && this.cursor >= this.log.lastSeq) {
        this.reachedHead = true;
        this.liveFrom = this.cursor;
        this.handlers.onCaughtUp?.();
      }
    } finally {
      this.pumping = false;
    }
  }

  /** @internal */
  end(err: KvxferError | undefined): void {
    if (this.done) return;
    this.done = true;
    this.log.removeSubscription(this);
    this.handlers.onEnd(err);
  }

  private matches(ev: SidecarEvent): boolean {
    if (this.kinds !== undefined && !this.kinds.has(ev.kind)) return false;
    if (this.ids !== undefined && !this.ids.has(ev.transferId)) return false;
    return true;
  }
}
