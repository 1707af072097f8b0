/**
 * Connection slots of one listening socket (the side channel, the gRPC API, the HTTP endpoints):
 * what a client that reaches the port can make the sidecar hold, bounded by time and by room,
 * never by refusing a newcomer (issue 48).
 *
 * A connection is first **opening** (it has proven nothing: no finished TLS handshake, no first
 * request), then **established** (authenticated, or it made its first request). The two are
 * separate pools, so opening connections never compete with established ones. Each pool is a
 * FairPool: when full, a newcomer takes the place of the oldest connection of the largest group
 * (opening: its address group, IPv4 /32 or IPv6 /64; established: its identity, or its address
 * group where nothing authenticates). An opening connection has `establishMs` to establish
 * itself, and every connection is destroyed `deadlineMs` after accept whatever it sends.
 */
import type * as net from "node:net";

import { FairPool, addressGroup } from "./fair-pool.js";

export interface SlotLimits {
  /** Opening connections held at once, all sources together; past it, one is displaced. */
  readonly opening: number;
  /** Established connections held at once; past it, one is displaced. */
  readonly established: number;
  /** Established connections of one group (identity or address) at once; its own oldest goes. */
  readonly perGroup: number;
  /** A connection not established this long after accept is destroyed (0: never). */
  readonly establishMs: number;
  /** Every connection is destroyed this long after accept, whatever it sends (0: never). */
  readonly deadlineMs: number;
}

/** What a slot set reports, at most once a second: connections displaced meanwhile. */
export type SlotReport = (code: string, message: string) => void;

interface Held {
  readonly group: string;
  readonly timers: NodeJS.Timeout[];
}

export class ConnectionSlots {
  private readonly opening: FairPool<net.Socket>;
  private readonly established: FairPool<net.Socket>;
  private readonly held = new Map<net.Socket, Held>();
  private displaced = 0;
  private lastDisplacedFrom = "";
  private reportTimer: NodeJS.Timeout | undefined;
  private closed = false;

  constructor(
    readonly limits: SlotLimits,
    /** Told (at most once a second) how many connections were displaced, and from where. */
    private readonly report?: SlotReport,
  ) {
    this.opening = new FairPool(Math.max(1, limits.opening));
    this.established = new FairPool(Math.max(1, limits.established));
  }

  /** Connections holding a slot now (opening and established). */
  get inFlight(): number {
    return this.opening.size + this.established.size;
  }

  /** Opening connections now. */
  get openingCount(): number {
    return this.opening.size;
  }

  /** Established connections now. */
  get establishedCount(): number {
    return this.established.size;
  }

  /** Whether `socket` holds an established slot. */
  isEstablished(socket: net.Socket): boolean {
    return this.established.has(socket);
  }

  /**
   * Gives an accepted connection an opening slot until it closes, displacing the oldest
   * opening connection of the largest address group when the pool is full (the newcomer's own
   * oldest if its group is the largest). Arms its deadlines.
   */
  admit(socket: net.Socket): void {
    if (this.closed) {
      socket.destroy();
      return;
    }
    const group = addressGroup(socket.remoteAddress);
    if (this.opening.full) this.displace(this.opening, this.opening.victimFor(group, true));
    this.opening.add(socket, group);
    const timers: NodeJS.Timeout[] = [];
    const { deadlineMs, establishMs } = this.limits;
    if (deadlineMs > 0) timers.push(setTimeout(() => socket.destroy(), deadlineMs));
    if (establishMs > 0)
      timers.push(
        setTimeout(() => {
          if (this.opening.has(socket)) socket.destroy();
        }, establishMs),
      );
    for (const t of timers) t.unref();
    this.held.set(socket, { group, timers });
    socket.once("close", () => this.release(socket));
    socket.on("error", () => socket.destroy());
  }

  /**
   * The connection established itself (finished its TLS handshake, made its first request):
   * it leaves the opening pool for the established one, under `group` (its identity; default
   * its address group). Past its group's share its own oldest established connection is
   * displaced; in a full pool, the oldest of the largest group. False when it holds no slot
   * (displaced or closed meanwhile); true when it was established already.
   */
  establish(socket: net.Socket, group?: string): boolean {
    if (this.established.has(socket)) return true;
    if (!this.opening.has(socket)) return false;
    const key = group ?? this.held.get(socket)!.group;
    this.opening.delete(socket);
    if (this.established.count(key) >= this.limits.perGroup)
      this.displace(this.established, this.established.oldest(key));
    else if (this.established.full)
      this.displace(this.established, this.established.victimFor(key, true));
    this.established.add(socket, key);
    return true;
  }

  /** Destroys every connection holding a slot. */
  destroyAll(): void {
    this.closed = true;
    clearTimeout(this.reportTimer);
    for (const s of [...this.held.keys()]) s.destroy();
  }

  private release(socket: net.Socket): void {
    const h = this.held.get(socket);
    if (h === undefined) return;
    this.held.delete(socket);
    for (const t of h.timers) clearTimeout(t);
    this.opening.delete(socket);
    this.established.delete(socket);
  }

  private displace(pool: FairPool<net.Socket>, victim: net.Socket | undefined): void {
    if (victim === undefined) return;
    // Out of the pool at once: its close event comes later, and the room is needed now.
    this.lastDisplacedFrom = pool.group(victim) ?? "?";
    pool.delete(victim);
    victim.destroy();
    this.displaced++;
    if (this.report !== undefined && this.reportTimer === undefined && !this.closed) {
      this.reportTimer = setTimeout(() => this.flushReport(), 1000);
      this.reportTimer.unref();
    }
  }

  private flushReport(): void {
    this.reportTimer = undefined;
    const n = this.displaced;
    this.displaced = 0;
    if (n === 0 || this.closed) return;
    this.report?.(
      "ERR_OVERLOADED",
      `${n} connection${n === 1 ? "" : "s"} displaced to make room (the oldest of the ` +
        `largest group; last from ${this.lastDisplacedFrom})`,
    );
  }
}
