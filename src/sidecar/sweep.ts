/**
 * The sidecar's clockwork: every sweepMs one sweep runs each part's expiry (a KV file that
 * shrank, both sides' deadlines, silent peers, peers over their budget) and reports the queue
 * depths; every heartbeatMs the heartbeats go to the peers.
 */
import type { Logger } from "pino";

import type { PeerTable } from "../peer/peer-table.js";
import type { Clock } from "./clock.js";
import type { ErrorPort } from "./context.js";
import type { DecodeSide } from "./decode.js";
import type { KvRegistry } from "./kv-registration.js";
import type { TransferMetrics } from "./metrics.js";
import { MAX_QUEUED_NOTIFICATIONS, type PeerDispatch } from "./peer-dispatch.js";
import type { PrefillSide } from "./prefill.js";

/** What the sweep visits. */
export interface SweepParts {
  readonly clock: Clock;
  readonly log: Logger;
  readonly kvs: KvRegistry;
  readonly peers: PeerTable;
  readonly prefill: PrefillSide;
  readonly decode: DecodeSide;
  /** Sends the heartbeats. */
  readonly peerIn: PeerDispatch;
  /** Notifications processed per second per peer, at most (for the error line). */
  readonly messagesPerSec: number;
  readonly tally: { readonly metrics: TransferMetrics | undefined };
  readonly errors: ErrorPort;
}

export class Sweeper {
  private sweepTimer: NodeJS.Timeout | undefined;
  private heartbeatTimer: NodeJS.Timeout | undefined;

  constructor(private readonly parts: SweepParts) {}

  start(sweepMs: number, heartbeatMs: number): void {
    this.sweepTimer = setInterval(() => this.sweep(), sweepMs);
    this.heartbeatTimer = setInterval(() => this.parts.peerIn.sendHeartbeats(), heartbeatMs);
  }

  stop(): void {
    clearInterval(this.sweepTimer);
    clearInterval(this.heartbeatTimer);
  }

  /** Every part's expiry; deadlines are not ordered, so each visits its whole table. */
  sweep(): void {
    const { kvs, peers, prefill, decode } = this.parts;
    const now = this.parts.clock.now();
    // A KV file that shrank is found within one sweep, even with no transfer starting: its size
    // is given back (no fault) and what P holds for a pull fails (D hears "not held").
    const broken = kvs.newlyBroken();
    if (broken !== undefined) {
      this.parts.errors.note(`ERR_REGION_CHANGED: ${broken}`);
      this.parts.log.error({ problem: broken }, "a KV file shrank under the sidecar");
      prefill.failHeld("ERR_REGION_CHANGED");
    }
    prefill.expire(now);
    decode.expire(now);
    const metrics = this.parts.tally.metrics;
    if (metrics !== undefined) {
      metrics.setQueueDepth("prefill_live", prefill.live());
      metrics.setQueueDepth("decode_live", decode.live());
      metrics.setQueueDepth(
        "agents_inflight",
        (kvs.kv?.agents ?? []).reduce((n, a) => n + a.inflight, 0),
      );
    }
    peers.expire(now);
    const displaced = prefill.takeDisplaced();
    if (displaced > 0)
      this.parts.errors.note(
        `${displaced} registrations before prefill displaced to make room (ERR_OVERLOADED; the engine holding the most loses its oldest)`,
      );
    for (const [engineId, n] of peers.badMacReport())
      this.parts.errors.note(
        `${n} more notifications claiming '${engineId}' refused: ERR_UNAUTHENTICATED (bad MAC)`,
      );
    for (const [engineId, n] of peers.overBudget())
      this.parts.errors.note(
        engineId === ""
          ? `${n} notifications from agents that are no connected peer dropped (ERR_OVERLOADED)`
          : `${n} notifications from '${engineId}' dropped: over its share of ${this.parts.messagesPerSec}/s (ERR_OVERLOADED)`,
      );
    const behind = this.parts.peerIn.takeBehind();
    if (behind > 0)
      this.parts.errors.note(
        `${behind} notifications dropped: ${MAX_QUEUED_NOTIFICATIONS} were waiting to be processed (ERR_OVERLOADED)`,
      );
  }
}
