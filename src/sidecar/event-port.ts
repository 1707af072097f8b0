/**
 * The sidecar's events as the sides and the peer table emit them: appended to the event log
 * (gRPC WatchEvents, AwaitTransfer), and, with a tracer, a finished transfer's spans exported
 * once watchers have had its event.
 */
import type { Tracer } from "@opentelemetry/api";
import type { Logger } from "pino";

import type { PeerEventPort } from "../peer/peer-table.js";
import type { Clock } from "./clock.js";
import type { EventPort } from "./context.js";
import { isTerminal } from "./lifecycle.js";
import { exportTransferSpans } from "./otel.js";
import type { EventKind, SidecarEvent, TransferInfo, TransferSide } from "./view.js";

/** Where terminal and peer events go (the event log). */
export interface EventSink {
  append(ev: Omit<SidecarEvent, "seq">): unknown;
}

export class EventOutbox implements EventPort, PeerEventPort {
  /** The event log, once the sidecar starts; nothing before. */
  sink: EventSink = { append: () => undefined };

  constructor(
    private readonly clock: Clock,
    private readonly engineId: string,
    private readonly log: Logger,
    private readonly tracer: Tracer | undefined,
    /** One transfer as the status view shows it (its trace hops go into the spans). */
    private readonly infoOf: (side: TransferSide, transferId: string) => TransferInfo | undefined,
  ) {}

  emit(
    kind: EventKind,
    transferId: string,
    peer: string,
    side: TransferSide | "",
    reason: string,
    bytes: number,
    mode: string,
  ): void {
    this.sink.append({
      kind,
      timeMs: this.clock.now(),
      transferId,
      peer,
      side,
      reason,
      bytes,
      mode,
    });
    const tracer = this.tracer;
    if (tracer !== undefined && side !== "" && transferId !== "" && isTerminal(kind)) {
      // After the event's delivery to watchers (a microtask away), so its hops are in the span.
      setImmediate(() => {
        const info = this.infoOf(side, transferId);
        try {
          if (info !== undefined) exportTransferSpans(tracer, this.engineId, info);
        } catch (err) {
          this.log.warn({ err, transferId }, "cannot export the transfer's spans");
        }
      });
    }
  }

  /** A peer event (PEER_UP, PEER_DOWN): no transfer, no side. */
  peerEvent(kind: "PEER_UP" | "PEER_DOWN", peer: string, reason: string): void {
    this.emit(kind, "", peer, "", reason, 0, "");
  }
}
