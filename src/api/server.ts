/**
 * The sidecar's gRPC server: kvxfer.v1.Sidecar (status, transfers, events)
 * and grpc.health.v1.Health. It reads the sidecar only through `SidecarView`
 * and the `EventLog`; status codes are listed in docs/api.md.
 */
import * as grpc from "@grpc/grpc-js";
import { create, toBinary } from "@bufbuild/protobuf";
import { pino, type Logger } from "pino";
import {
  type HealthCheckRequest,
  HealthCheckResponseSchema,
  HealthCheckResponse_ServingStatus as ServingStatus,
} from "../gen/grpc/health/v1/health_pb.js";
import {
  type AwaitTransferRequest,
  AwaitTransferResponseSchema,
  type GetStatusResponse,
  type ListTransfersRequest,
  type ListTransfersResponse,
  ListTransfersResponseSchema,
  TransferSide as PbTransferSide,
  type WatchEventsRequest,
  type WatchEventsResponse,
  WatchEventsResponseSchema,
} from "../gen/kvxfer/v1/sidecar_pb.js";
import { KvxferError } from "../errors.js";
import type { EventLog, EventSubscription } from "../sidecar/event-log.js";
import type {
  EventKind,
  SidecarEvent,
  SidecarView,
  TransferSide,
  TransferState,
} from "../sidecar/view.js";
import {
  eventKinds,
  eventToProto,
  statusToProto,
  transferStates,
  transferToProto,
} from "./convert.js";
import {
  SIDECAR_SERVICE_NAME,
  asServiceDefinition,
  healthService,
  sidecarService,
} from "./service.js";

export interface ApiTlsOptions {
  /** PEM server certificate chain. */
  readonly cert: Buffer | string;
  /** PEM private key. */
  readonly key: Buffer | string;
  /** PEM CA bundle that client certificates must chain to (mutual TLS). */
  readonly ca?: Buffer | string;
  /** Refuse clients without a certificate signed by `ca`. Default: true when `ca` is given. */
  readonly requireClientCert?: boolean;
}

export interface ApiServerOptions {
  readonly view: SidecarView;
  readonly events: EventLog;
  /** "host:port"; default "127.0.0.1:0" (loopback, any free port). */
  readonly address?: string;
  readonly tls?: ApiTlsOptions;
  /** The server logs under a child `{ component: "api" }`. Default: silent. */
  readonly logger?: Logger;
  /** Longest AwaitTransfer wait when the call has no (or a later) deadline. Default 300 000. */
  readonly maxAwaitMs?: number;
  /** How often a filtered watcher is told how far the server has looked. Default 5 000. */
  readonly progressIntervalMs?: number;
  /** Live events that may wait for one watcher before it is ended (RESOURCE_EXHAUSTED). */
  readonly watchBufferLimit?: number;
  /** Most concurrent WatchEvents streams; more get RESOURCE_EXHAUSTED. Default 1 000. */
  readonly maxWatchers?: number;
  /**
   * Health at start. Default true; the sidecar starts NOT_SERVING and turns SERVING once its
   * engine has registered (readiness), see `setServing`.
   */
  readonly serving?: boolean;
}

export interface ApiServer {
  readonly port: number;
  /** "host:port" actually bound. */
  readonly address: string;
  readonly serving: boolean;
  /** Open WatchEvents streams. */
  readonly watchers: number;
  /**
   * Health of both "" and "kvxfer.v1.Sidecar": SERVING or NOT_SERVING. The
   * sidecar is NOT_SERVING until its engine has registered (it cannot answer
   * handshakes before), SERVING after, and calls setServing(false) when it starts
   * draining (SIGTERM); the
   * Sidecar service itself keeps answering, so routers still learn how the
   * in-flight transfers end.
   */
  setServing(serving: boolean): void;
  /** NOT_SERVING; the same as setServing(false). */
  drain(): void;
  /**
   * Ends open streams (UNAVAILABLE) and waits, then stops the server; after
   * `graceMs` (default 5 000) whatever is left is cut.
   */
  close(graceMs?: number): Promise<void>;
}

const MAX_TRANSFER_ID = 512;
const MAX_FILTER_IDS = 10_000;
const DEFAULT_LIST_LIMIT = 1000;
const MAX_LIST_LIMIT = 10_000;

type ServiceError = Partial<grpc.StatusObject> & { code: grpc.status; details: string };

function fail(code: grpc.status, details: string): ServiceError {
  return { code, details, metadata: new grpc.Metadata() };
}

/** The gRPC status for an error thrown by the event log (or anything else). */
function toStatus(err: unknown): ServiceError {
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

function kindsFromProto(kinds: readonly number[]): EventKind[] {
  return kinds.map((k) => {
    const name = eventKinds.name(k);
    if (name === undefined)
      throw new KvxferError(
        "ERR_INVALID_ARGUMENT",
        `unknown event kind ${k} (known: ${eventKinds.names().join(", ")})`,
      );
    return name;
  });
}

function statesFromProto(states: readonly number[]): TransferState[] {
  return states.map((s) => {
    const name = transferStates.name(s);
    if (name === undefined)
      throw new KvxferError(
        "ERR_INVALID_ARGUMENT",
        `unknown transfer state ${s} (known: ${transferStates.names().join(", ")})`,
      );
    return name;
  });
}

function checkTransferId(id: string, what: string): void {
  if (id.length === 0) throw new KvxferError("ERR_INVALID_ARGUMENT", `${what} is empty`);
  if (id.length > MAX_TRANSFER_ID)
    throw new KvxferError(
      "ERR_INVALID_ARGUMENT",
      `${what} is ${id.length} characters long (at most ${MAX_TRANSFER_ID})`,
    );
}

function seqFromProto(v: bigint, what: string): number {
  if (v > BigInt(Number.MAX_SAFE_INTEGER))
    throw new KvxferError(
      "ERR_OUT_OF_RANGE",
      `${what} ${v} is beyond any sequence number of this log`,
    );
  return Number(v);
}

function deadlineMs(call: { getDeadline(): grpc.Deadline }): number {
  const d = call.getDeadline();
  const ms = d instanceof Date ? d.getTime() : d;
  return Number.isFinite(ms) ? ms : Infinity;
}

interface ActiveWatch {
  readonly call: grpc.ServerWritableStream<WatchEventsRequest, WatchEventsResponse | Uint8Array>;
  sub: EventSubscription | undefined;
  lastSentSeq: number;
  paused: boolean;
}

export async function startApiServer(opts: ApiServerOptions): Promise<ApiServer> {
  const log = (opts.logger ?? pino({ level: "silent" })).child({ component: "api" });
  const { view, events } = opts;
  const maxAwaitMs = opts.maxAwaitMs ?? 300_000;
  const progressIntervalMs = opts.progressIntervalMs ?? 5_000;
  const maxWatchers = opts.maxWatchers ?? 1_000;
  // The epoch never changes during a sidecar's life; watchers check it on resume.
  const epoch = view.status().epoch;

  let serving = opts.serving ?? true;
  let closing = false;
  const watches = new Set<ActiveWatch>();
  const awaits = new Set<AbortController>();
  const healthWatches = new Set<grpc.ServerWritableStream<HealthCheckRequest, unknown>>();
  // Each event is encoded once, whatever the number of watchers.
  const encoded = new WeakMap<SidecarEvent, Uint8Array>();

  const encodeEvent = (ev: SidecarEvent): Uint8Array => {
    let bytes = encoded.get(ev);
    if (bytes === undefined) {
      bytes = toBinary(
        WatchEventsResponseSchema,
        create(WatchEventsResponseSchema, { msg: { case: "event", value: eventToProto(ev) } }),
      );
      encoded.set(ev, bytes);
    }
    return bytes;
  };

  const progress = (seq: number, caughtUp: boolean): WatchEventsResponse =>
    create(WatchEventsResponseSchema, {
      msg: {
        case: "progress",
        value: {
          seq: BigInt(seq),
          epoch,
          firstSeq: BigInt(events.lastSeq === 0 ? 0 : events.firstSeq),
          caughtUp,
        },
      },
    });

  const healthStatus = (service: string): ServingStatus | undefined => {
    if (service !== "" && service !== SIDECAR_SERVICE_NAME) return undefined;
    return serving ? ServingStatus.SERVING : ServingStatus.NOT_SERVING;
  };

  const sidecarHandlers: grpc.UntypedServiceImplementation = {
    GetStatus(
      call: grpc.ServerUnaryCall<unknown, GetStatusResponse>,
      cb: grpc.sendUnaryData<GetStatusResponse>,
    ) {
      try {
        const status = view.status();
        cb(
          null,
          statusToProto(
            status,
            { firstSeq: events.firstSeq, lastSeq: events.lastSeq, watchers: watches.size },
            Date.now(),
          ),
        );
      } catch (err) {
        log.error({ err }, "GetStatus failed");
        cb(toStatus(err));
      }
    },

    ListTransfers(
      call: grpc.ServerUnaryCall<ListTransfersRequest, ListTransfersResponse>,
      cb: grpc.sendUnaryData<ListTransfersResponse>,
    ) {
      try {
        const req = call.request;
        const states = statesFromProto(req.states);
        if (req.limit > MAX_LIST_LIMIT)
          throw new KvxferError(
            "ERR_INVALID_ARGUMENT",
            `limit ${req.limit} is above the most one call returns (${MAX_LIST_LIMIT})`,
          );
        const limit = req.limit === 0 ? DEFAULT_LIST_LIMIT : req.limit;
        const all = view.transfers({
          ...(states.length > 0 ? { states } : {}),
          ...(req.peer !== "" ? { peer: req.peer } : {}),
        });
        cb(
          null,
          create(ListTransfersResponseSchema, {
            transfers: all.slice(0, limit).map(transferToProto),
            total: BigInt(all.length),
          }),
        );
      } catch (err) {
        if (!(err instanceof KvxferError)) log.error({ err }, "ListTransfers failed");
        cb(toStatus(err));
      }
    },

    WatchEvents(call: ActiveWatch["call"]) {
      const req = call.request;
      const w: ActiveWatch = { call, sub: undefined, lastSentSeq: 0, paused: false };
      const finish = (status: ServiceError | undefined): void => {
        if (!watches.delete(w)) return;
        w.sub?.close();
        if (call.cancelled) return;
        if (status === undefined) call.end();
        else call.emit("error", status);
      };
      const send = (msg: WatchEventsResponse | Uint8Array): void => {
        if (!call.write(msg)) {
          w.paused = true;
          w.sub?.pause();
        }
      };
      try {
        if (closing) throw new KvxferError("ERR_CLOSED", "the sidecar is shutting down");
        if (watches.size >= maxWatchers)
          throw new KvxferError(
            "ERR_TOO_MANY_WAITERS",
            `${watches.size} watchers already (most ${maxWatchers})`,
          );
        const kinds = kindsFromProto(req.kinds);
        if (req.transferIds.length > MAX_FILTER_IDS)
          throw new KvxferError(
            "ERR_INVALID_ARGUMENT",
            `${req.transferIds.length} transfer ids in the filter (at most ${MAX_FILTER_IDS})`,
          );
        for (const id of req.transferIds) checkTransferId(id, "a transfer id in the filter");
        if (req.epoch !== 0n && req.epoch !== epoch)
          return void call.emit(
            "error",
            fail(
              grpc.status.FAILED_PRECONDITION,
              `the sidecar's epoch is ${epoch}, not ${req.epoch}: it restarted and numbers events from 1 again; resume from after_seq 0`,
            ),
          );
        const afterSeq = req.liveOnly ? events.lastSeq : seqFromProto(req.afterSeq, "after_seq");
        watches.add(w);
        w.sub = events.subscribe(
          afterSeq,
          {
            ...(kinds.length > 0 ? { kinds } : {}),
            ...(req.transferIds.length > 0 ? { transferIds: req.transferIds } : {}),
          },
          {
            onEvent: (ev) => {
              w.lastSentSeq = ev.seq;
              send(encodeEvent(ev));
            },
            onCaughtUp: () => {
              w.lastSentSeq = Math.max(w.lastSentSeq, w.sub?.scannedSeq ?? 0);
              send(progress(w.sub?.scannedSeq ?? events.lastSeq, true));
            },
            onEnd: (err) => finish(err === undefined ? undefined : toStatus(err)),
          },
          {
            liveOnly: req.liveOnly,
            ...(opts.watchBufferLimit !== undefined ? { bufferLimit: opts.watchBufferLimit } : {}),
          },
        );
        // First message: where the stream starts and which epoch it belongs to.
        send(progress(afterSeq, false));
      } catch (err) {
        watches.delete(w);
        call.emit("error", toStatus(err));
        return;
      }
      call.on("drain", () => {
        w.paused = false;
        w.sub?.resume();
      });
      call.on("cancelled", () => finish(undefined));
      call.on("error", () => finish(undefined));
    },

    AwaitTransfer(
      call: grpc.ServerUnaryCall<AwaitTransferRequest, unknown>,
      cb: grpc.sendUnaryData<unknown>,
    ) {
      const req = call.request;
      let side: TransferSide | undefined;
      try {
        if (closing) throw new KvxferError("ERR_CLOSED", "the sidecar is shutting down");
        checkTransferId(req.transferId, "transfer_id");
        if (req.side === PbTransferSide.PREFILL) side = "prefill";
        else if (req.side === PbTransferSide.DECODE) side = "decode";
        else if (req.side !== PbTransferSide.UNSPECIFIED)
          throw new KvxferError("ERR_INVALID_ARGUMENT", `unknown side ${req.side}`);
      } catch (err) {
        return cb(toStatus(err));
      }
      const callDeadline = deadlineMs(call);
      const capped = Date.now() + maxAwaitMs;
      const abort = new AbortController();
      awaits.add(abort);
      call.on("cancelled", () => abort.abort());
      events
        .waitFor(req.transferId, {
          deadlineMs: Math.min(callDeadline, capped),
          ...(side !== undefined ? { side } : {}),
          signal: abort.signal,
        })
        .then(
          (ev) => {
            if (ev !== undefined)
              return cb(null, create(AwaitTransferResponseSchema, { event: eventToProto(ev) }));
            if (call.cancelled) return;
            if (closing) return cb(fail(grpc.status.UNAVAILABLE, "the sidecar is shutting down"));
            cb(
              fail(
                grpc.status.DEADLINE_EXCEEDED,
                capped < callDeadline
                  ? `transfer '${req.transferId}' has not ended within the server's longest wait (${maxAwaitMs} ms)`
                  : `transfer '${req.transferId}' has not ended before the deadline`,
              ),
            );
          },
          (err: unknown) => cb(toStatus(err)),
        )
        .finally(() => awaits.delete(abort));
    },
  };

  const healthHandlers: grpc.UntypedServiceImplementation = {
    Check(
      call: grpc.ServerUnaryCall<HealthCheckRequest, unknown>,
      cb: grpc.sendUnaryData<unknown>,
    ) {
      const status = healthStatus(call.request.service);
      if (status === undefined)
        return cb(fail(grpc.status.NOT_FOUND, `unknown service '${call.request.service}'`));
      cb(null, create(HealthCheckResponseSchema, { status }));
    },
    Watch(call: grpc.ServerWritableStream<HealthCheckRequest, unknown>) {
      if (closing) return void call.emit("error", fail(grpc.status.UNAVAILABLE, "shutting down"));
      healthWatches.add(call);
      call.write(
        create(HealthCheckResponseSchema, {
          status: healthStatus(call.request.service) ?? ServingStatus.SERVICE_UNKNOWN,
        }),
      );
      const done = (): void => void healthWatches.delete(call);
      call.on("cancelled", done);
      call.on("error", done);
    },
  };

  const server = new grpc.Server({
    // Requests are small; anything large is a mistake or an attack.
    "grpc.max_receive_message_length": 1 << 20,
    "grpc.keepalive_time_ms": 30_000,
    "grpc.keepalive_timeout_ms": 10_000,
  });
  server.addService(asServiceDefinition(sidecarService), sidecarHandlers);
  server.addService(asServiceDefinition(healthService), healthHandlers);

  const creds =
    opts.tls === undefined
      ? grpc.ServerCredentials.createInsecure()
      : grpc.ServerCredentials.createSsl(
          opts.tls.ca === undefined ? null : Buffer.from(opts.tls.ca),
          [{ cert_chain: Buffer.from(opts.tls.cert), private_key: Buffer.from(opts.tls.key) }],
          opts.tls.requireClientCert ?? opts.tls.ca !== undefined,
        );
  const address = opts.address ?? "127.0.0.1:0";
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync(address, creds, (err, p) => (err ? reject(err) : resolve(p))),
  );
  const host = address.slice(0, address.lastIndexOf(":"));
  const bound = `${host}:${port}`;

  // Tells filtered watchers how far the server has looked, so they can resume
  // from a retained seq even when none of their own events came for a while.
  const ticker = setInterval(() => {
    for (const w of watches) {
      const scanned = w.sub?.scannedSeq ?? 0;
      if (!w.paused && w.sub?.caughtUp && scanned > w.lastSentSeq) {
        w.lastSentSeq = scanned;
        if (!w.call.write(progress(scanned, false))) {
          w.paused = true;
          w.sub.pause();
        }
      }
    }
  }, progressIntervalMs);
  ticker.unref();

  const setServing = (next: boolean): void => {
    if (next === serving) return;
    serving = next;
    log.info({ serving }, "health changed");
    for (const call of healthWatches)
      call.write(
        create(HealthCheckResponseSchema, {
          status: healthStatus(call.request.service) ?? ServingStatus.SERVICE_UNKNOWN,
        }),
      );
  };

  log.info({ address: bound, tls: opts.tls !== undefined }, "gRPC API listening");

  return {
    port,
    address: bound,
    get serving() {
      return serving;
    },
    get watchers() {
      return watches.size;
    },
    setServing,
    drain: () => setServing(false),
    async close(graceMs = 5_000) {
      if (closing) return;
      setServing(false);
      closing = true;
      clearInterval(ticker);
      const shutdown = fail(grpc.status.UNAVAILABLE, "the sidecar is shutting down");
      for (const w of [...watches]) {
        watches.delete(w);
        w.sub?.close();
        if (!w.call.cancelled) w.call.emit("error", shutdown);
      }
      for (const a of awaits) a.abort();
      for (const call of healthWatches) call.end();
      healthWatches.clear();
      await new Promise<void>((resolve) => {
        const timer = setTimeout(() => {
          server.forceShutdown();
          resolve();
        }, graceMs);
        timer.unref();
        server.tryShutdown(() => {
          clearTimeout(timer);
          resolve();
        });
      });
      log.info("gRPC API closed");
    },
  };
}
