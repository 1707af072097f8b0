/**
 * What the gRPC services share: request checks, status mapping, and `ApiState` (the sidecar's
 * view and event log, the settings, the open calls).
 */
import type { PeerCertificate } from "node:tls";

import * as grpc from "@grpc/grpc-js";
import { create } from "@bufbuild/protobuf";
import { pino, type Logger } from "pino";
import { type HealthCheckRequest } from "../gen/grpc/health/v1/health_pb.js";
import {
  type WatchEventsRequest,
  type WatchEventsResponse,
  WatchEventsResponseSchema,
} from "../gen/kvxfer/v1/sidecar_pb.js";
import { KvxferError } from "../errors.js";
import { transferIdCharProblem } from "../peer/messages.js";
import type { EventLog, EventSubscription } from "../sidecar/event-log.js";
import type { SidecarEvent, SidecarView } from "../sidecar/view.js";
import { type EnumMap, encodeEventResponse, eventInit } from "./convert.js";
import { CallShares } from "./call-shares.js";
import type { ApiServerOptions } from "./server-options.js";

const MAX_TRANSFER_ID = 512;
export const MAX_FILTER_IDS = 10_000;
export const DEFAULT_LIST_LIMIT = 1000;
export const MAX_LIST_LIMIT = 10_000;

export type ServiceError = Partial<grpc.StatusObject> & { code: grpc.status; details: string };

export function fail(code: grpc.status, details: string): ServiceError {
  return { code, details, metadata: new grpc.Metadata() };
}

/** The gRPC status for an error thrown by the event log (or anything else). */
export function toStatus(err: unknown): ServiceError {
  if (err instanceof KvxferError) {
    switch (err.code) {
      case "ERR_INVALID_ARGUMENT":
        return fail(grpc.status.INVALID_ARGUMENT, err.message);
      case "ERR_OUT_OF_RANGE":
        return fail(grpc.status.OUT_OF_RANGE, err.message);
      case "ERR_FELL_BEHIND":
      case "ERR_TOO_MANY_WAITERS":
        return fail(grpc.status.RESOURCE_EXHAUSTED, err.message);
      case "ERR_NOT_FOUND":
        return fail(grpc.status.NOT_FOUND, err.message);
      case "ERR_CLOSED":
        return fail(grpc.status.UNAVAILABLE, err.message);
    }
  }
  return fail(grpc.status.INTERNAL, err instanceof Error ? err.message : String(err));
}

export { clientOf } from "./call-shares.js";

/** Enum numbers from a request as names; `what` ("event kind") names an unknown one. */
export function namesFromProto<N extends string>(
  map: EnumMap<N, number>,
  nums: readonly number[],
  what: string,
): N[] {
  return nums.map((n) => {
    const name = map.name(n);
    if (name === undefined)
      throw new KvxferError(
        "ERR_INVALID_ARGUMENT",
        `unknown ${what} ${n} (known: ${map.names().join(", ")})`,
      );
    return name;
  });
}

export function checkTransferId(id: string, what: string): void {
  if (id.length === 0) throw new KvxferError("ERR_INVALID_ARGUMENT", `${what} is empty`);
  if (id.length > MAX_TRANSFER_ID)
    throw new KvxferError(
      "ERR_INVALID_ARGUMENT",
      `${what} is ${id.length} characters long (at most ${MAX_TRANSFER_ID})`,
    );
  const bad = transferIdCharProblem(id, what);
  if (bad !== undefined) throw new KvxferError("ERR_INVALID_ARGUMENT", bad);
}

export function seqFromProto(v: bigint, what: string): number {
  if (v > BigInt(Number.MAX_SAFE_INTEGER))
    throw new KvxferError(
      "ERR_OUT_OF_RANGE",
      `${what} ${v} is beyond any sequence number of this log`,
    );
  return Number(v);
}

export function deadlineMs(call: { getDeadline(): grpc.Deadline }): number {
  const d = call.getDeadline();
  const ms = d instanceof Date ? d.getTime() : d;
  return Number.isFinite(ms) ? ms : Infinity;
}

export interface ActiveWatch {
  readonly call: grpc.ServerWritableStream<WatchEventsRequest, WatchEventsResponse | Uint8Array>;
  sub: EventSubscription | undefined;
  lastSentSeq: number;
  paused: boolean;
  /** Ends the stream (set once it is being served); displacement ends it with a status. */
  end?: (status: ServiceError | undefined) => void;
}

export type HealthWatch = grpc.ServerWritableStream<HealthCheckRequest, unknown>;

/** An AwaitTransfer waiting: cancelled at close, or to make room for another client. */
export interface ActiveAwait {
  readonly abort: AbortController;
  /** Why it was displaced (set before `abort`): it answers RESOURCE_EXHAUSTED with this. */
  displaced?: string;
}

/** What the RPC groups share: the sidecar's view and log, the settings, and the open calls. */
export class ApiState {
  readonly view: SidecarView;
  readonly events: EventLog;
  readonly log: Logger;
  readonly maxAwaitMs: number;
  readonly progressIntervalMs: number;
  readonly maxWatchers: number;
  readonly maxWatchersPerClient: number;
  /** Open WatchEvents streams, shared between clients (O(1) checks; call-shares.ts). */
  readonly watchShares: CallShares<ActiveWatch>;
  /** Waiting AwaitTransfer calls, shared between clients. */
  readonly awaitShares: CallShares<ActiveAwait>;
  /** Open Health Watch streams, shared between clients. */
  readonly healthShares: CallShares<HealthWatch>;
  readonly watchBufferLimit: number | undefined;
  /** The epoch never changes during a sidecar's life; watchers check it on resume. */
  readonly epoch: bigint;
  serving: boolean;
  closing = false;
  readonly watches = new Set<ActiveWatch>();
  readonly awaits = new Set<ActiveAwait>();
  readonly healthWatches = new Set<HealthWatch>();
  /** Told of every call as its handler starts (the server's connection slots). */
  callSeen: (call: {
    getPeer(): string;
    getAuthContext(): { sslPeerCertificate?: PeerCertificate };
  }) => void = () => undefined;
  /** Each event is encoded once, whatever the number of watchers. */
  private readonly encoded = new WeakMap<SidecarEvent, Uint8Array>();

  constructor(opts: ApiServerOptions) {
    this.log = (opts.logger ?? pino({ level: "silent" })).child({ component: "api" });
    this.view = opts.view;
    this.events = opts.events;
    this.maxAwaitMs = opts.maxAwaitMs ?? 300_000;
    this.progressIntervalMs = opts.progressIntervalMs ?? 5_000;
    this.maxWatchers = opts.maxWatchers ?? 1_000;
    this.maxWatchersPerClient =
      opts.maxWatchersPerClient ?? Math.max(1, Math.floor(this.maxWatchers / 4));
    this.watchShares = new CallShares(
      "WatchEvents streams",
      this.maxWatchers,
      this.maxWatchersPerClient,
    );
    const maxAwaits = opts.maxAwaits ?? 8_192;
    this.awaitShares = new CallShares(
      "AwaitTransfer calls",
      maxAwaits,
      opts.maxAwaitsPerClient ?? Math.max(1, Math.floor(maxAwaits / 4)),
    );
    const maxHealth = opts.maxHealthWatches ?? 1_000;
    this.healthShares = new CallShares(
      "Health Watch streams",
      maxHealth,
      Math.max(1, Math.floor(maxHealth / 4)),
    );
    this.watchBufferLimit = opts.watchBufferLimit;
    this.epoch = opts.view.status().epoch;
    this.serving = opts.serving ?? true;
  }

  encodeEvent(ev: SidecarEvent): Uint8Array {
    let bytes = this.encoded.get(ev);
    if (bytes === undefined) {
      bytes = encodeEventResponse(eventInit(ev));
      this.encoded.set(ev, bytes);
    }
    return bytes;
  }

  progress(seq: number, caughtUp: boolean): WatchEventsResponse {
    return create(WatchEventsResponseSchema, {
      msg: {
        case: "progress",
        value: {
          seq: BigInt(seq),
          epoch: this.epoch,
          firstSeq: BigInt(this.events.lastSeq === 0 ? 0 : this.events.firstSeq),
          caughtUp,
        },
      },
    });
  }
}
