/**
 * `--notify-zmq tcp://HOST:PORT`: on every KV_READY of this sidecar's decode side, one ZeroMQ
 * PUSH message in the form production-stack's router waits for (its `ZmqProxy`, a PULL socket
 * that `msgspec.msgpack.decode`s a `NixlMsg` struct with one field, `req_id`, or else a map with
 * a "req_id" key): a MessagePack map {"req_id": <transfer id>}. So that router's existing path
 * works with kvxfer unchanged.
 *
 * It never holds a transfer up: messages wait in a bounded queue (one send at a time, as
 * zeromq.js allows), and one that cannot be queued, or cannot be handed to a connected router at
 * once (the router down: the socket does not queue for a peer it has not got), is dropped and
 * counted (`kvxfer_notify_zmq_total{result}`).
 */
import { encode } from "@msgpack/msgpack";
import { Push } from "zeromq";

import { KvxferError } from "../errors.js";
import type { EventLog, EventSubscription } from "../sidecar/event-log.js";
import type { MetricsRegistry } from "./metrics.js";

/** Messages waiting for the socket, at most; more are dropped. */
export const NOTIFY_QUEUE_LIMIT = 1024;

/** MessagePack of {"req_id": id}. */
export function encodeReqId(id: string): Buffer {
  const packed = encode({ req_id: id });
  return Buffer.from(packed.buffer, packed.byteOffset, packed.byteLength);
}

export type NotifyResult = "sent" | "dropped_queue_full" | "dropped_no_router";

export class ZmqNotifier {
  private readonly socket = new Push({
    // Only to a connected router: while it is down, nothing piles up (a late "ready" is useless).
    immediate: true,
    sendHighWaterMark: NOTIFY_QUEUE_LIMIT,
    sendTimeout: 0,
    linger: 0,
  });
  private readonly queue: Buffer[] = [];
  private sending = false;
  private sub: EventSubscription | undefined;
  private closed = false;
  /** What happened to each message, by result (also in the metrics when given). */
  readonly counts: Record<NotifyResult, number> = {
    sent: 0,
    dropped_queue_full: 0,
    dropped_no_router: 0,
  };
  private readonly onResult: (r: NotifyResult) => void;

  constructor(
    readonly endpoint: string,
    registry?: MetricsRegistry,
  ) {
    if (!/^(tcp|ipc):\/\/.+/.test(endpoint))
      throw new KvxferError(
        "ERR_CONFIG",
        `--notify-zmq must be a ZeroMQ endpoint such as tcp://127.0.0.1:7500, got '${endpoint}'`,
      );
    const counter = registry?.counter(
      "kvxfer_notify_zmq_total",
      "KV_READY notifications to the --notify-zmq router, by result.",
      { labelNames: ["result"], maxSeries: 4 },
    );
    this.onResult = (r) => {
      this.counts[r]++;
      counter?.inc({ result: r });
    };
    try {
      this.socket.connect(endpoint);
    } catch (err) {
      this.socket.close();
      throw new KvxferError("ERR_CONFIG", `--notify-zmq ${endpoint}: ${(err as Error).message}`);
    }
  }

  /** From now on, every decode-side KV_READY appended to `events` is announced. */
  start(events: EventLog): void {
    this.sub = events.subscribe(
      0,
      { kinds: ["KV_READY"] },
      {
        onEvent: (ev) => {
          if (ev.side === "decode") this.notify(ev.transferId);
        },
        onEnd: () => undefined,
      },
      { liveOnly: true },
    );
  }

  /** Queues one message; never waits. */
  notify(transferId: string): void {
    if (this.closed) return;
    if (this.queue.length >= NOTIFY_QUEUE_LIMIT) return this.onResult("dropped_queue_full");
    this.queue.push(encodeReqId(transferId));
    if (!this.sending) void this.pump();
  }

  private async pump(): Promise<void> {
    this.sending = true;
    while (this.queue.length > 0 && !this.closed) {
      const msg = this.queue.shift()!;
      try {
        await this.socket.send(msg);
        this.onResult("sent");
      } catch {
        // EAGAIN: no router connected (or its queue is full); the socket closed under us.
        if (!this.closed) this.onResult("dropped_no_router");
      }
    }
    this.sending = false;
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.sub?.close();
    this.queue.length = 0;
    this.socket.close();
  }
}
