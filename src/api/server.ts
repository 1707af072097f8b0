/**
 * The sidecar's gRPC server: kvxfer.v1.Sidecar (status, transfers, events)
 * and grpc.health.v1.Health. It reads the sidecar only through `SidecarView`
 * and the `EventLog`; status codes are listed in docs/api.md.
 */
import * as net from "node:net";

import * as grpc from "@grpc/grpc-js";
import { create } from "@bufbuild/protobuf";
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
import { transferIdCharProblem } from "../peer/messages.js";
import { ConnectionSlots } from "../peer/side-channel.js";
import { splitHostPort } from "./http.js";
import type { EventLog, EventSubscription } from "../sidecar/event-log.js";
import type { SidecarEvent, SidecarView, TransferSide } from "../sidecar/view.js";
import {
  type EnumMap,
  eventKinds,
  encodeEventResponse,
  eventToProto,
  statusToProto,
  transferSides,
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
   * Most WatchEvents streams from one client address: the rest of maxWatchers stays free for
   * other clients (routers). Default maxWatchers / 4.
   */
  readonly maxWatchersPerClient?: number;
  /** Connections at once, and from one client address. Default 256 and 32. */
  readonly maxConnections?: number;
  readonly maxConnectionsPerClient?: number;
  /**
   * A connection with no call for this long is closed (GOAWAY; a client reconnects when it
   * next calls). Default 60 000.
   */
  readonly maxConnectionIdleMs?: number;
  /** A connection that sends no byte for this long after accept is closed. Default 10 000. */
  readonly silentConnectionMs?: number;
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
  /** Open connections (each holds one of its slots). */
  readonly connections: number;
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

/** A call's client address from grpc-js's peer string ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678"). */
function clientOf(peer: string): string {
  const m = /^(?:ipv4:|ipv6:)?\[?(.*?)\]?:\d+$/.exec(peer);
  return (m?.[1] ?? peer).replace(/^::ffff:/, "");
}

/** Enum numbers from a request as names; `what` ("event kind") names an unknown one. */
function namesFromProto<N extends string>(
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

function checkTransferId(id: string, what: string): void {
  if (id.length === 0) throw new KvxferError("ERR_INVALID_ARGUMENT", `${what} is empty`);
  if (id.length > MAX_TRANSFER_ID)
    throw new KvxferError(
      "ERR_INVALID_ARGUMENT",
      `${what} is ${id.length} characters long (at most ${MAX_TRANSFER_ID})`,
    );
  const bad = transferIdCharProblem(id, what);
  if (bad !== undefined) throw new KvxferError("ERR_INVALID_ARGUMENT", bad);
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

type HealthWatch = grpc.ServerWritableStream<HealthCheckRequest, unknown>;

/** What the RPC groups share: the sidecar's view and log, the settings, and the open calls. */
class ApiState {
  readonly view: SidecarView;
  readonly events: EventLog;
  readonly log: Logger;
  readonly maxAwaitMs: number;
  readonly progressIntervalMs: number;
  readonly maxWatchers: number;
  readonly maxWatchersPerClient: number;
  /** Open WatchEvents streams per client address (O(1) cap check). */
  readonly watchersByClient = new Map<string, number>();
  readonly watchBufferLimit: number | undefined;
  /** The epoch never changes during a sidecar's life; watchers check it on resume. */
  readonly epoch: bigint;
  serving: boolean;
  closing = false;
  readonly watches = new Set<ActiveWatch>();
  readonly awaits = new Set<AbortController>();
  readonly healthWatches = new Set<HealthWatch>();
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
    this.watchBufferLimit = opts.watchBufferLimit;
    this.epoch = opts.view.status().epoch;
    this.serving = opts.serving ?? true;
  }

  encodeEvent(ev: SidecarEvent): Uint8Array {
    let bytes = this.encoded.get(ev);
    if (bytes === undefined) {
      bytes = encodeEventResponse(eventToProto(ev));
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

/** kvxfer.v1.Sidecar: GetStatus, ListTransfers, WatchEvents, AwaitTransfer. */
class SidecarRpcs {
  constructor(private readonly s: ApiState) {}

  /** The handlers grpc-js calls, by method name. */
  handlers(): grpc.UntypedServiceImplementation {
    return {
      GetStatus: this.getStatus.bind(this),
      ListTransfers: this.listTransfers.bind(this),
      WatchEvents: this.watchEvents.bind(this),
      AwaitTransfer: this.awaitTransfer.bind(this),
    };
  }

  getStatus(
    call: grpc.ServerUnaryCall<unknown, GetStatusResponse>,
    cb: grpc.sendUnaryData<GetStatusResponse>,
  ): void {
    const { view, events, watches } = this.s;
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
      this.s.log.error({ err }, "GetStatus failed");
      cb(toStatus(err));
    }
  }

  listTransfers(
    call: grpc.ServerUnaryCall<ListTransfersRequest, ListTransfersResponse>,
    cb: grpc.sendUnaryData<ListTransfersResponse>,
  ): void {
    try {
      const req = call.request;
      const states = namesFromProto(transferStates, req.states, "transfer state");
      if (req.limit > MAX_LIST_LIMIT)
        throw new KvxferError(
          "ERR_INVALID_ARGUMENT",
          `limit ${req.limit} is above the most one call returns (${MAX_LIST_LIMIT})`,
        );
      const limit = req.limit === 0 ? DEFAULT_LIST_LIMIT : req.limit;
      const all = this.s.view.transfers({
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
      if (!(err instanceof KvxferError)) this.s.log.error({ err }, "ListTransfers failed");
      cb(toStatus(err));
    }
  }

  watchEvents(call: ActiveWatch["call"]): void {
    const { s } = this;
    const { events, watches } = s;
    const req = call.request;
    const w: ActiveWatch = { call, sub: undefined, lastSentSeq: 0, paused: false };
    const client = clientOf(call.getPeer());
    const byClient = s.watchersByClient;
    const release = (): void => {
      if (!watches.delete(w)) return;
      const n = (byClient.get(client) ?? 1) - 1;
      if (n <= 0) byClient.delete(client);
      else byClient.set(client, n);
    };
    const finish = (status: ServiceError | undefined): void => {
      if (!watches.has(w)) return;
      release();
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
      if (s.closing) throw new KvxferError("ERR_CLOSED", "the sidecar is shutting down");
      if (watches.size >= s.maxWatchers)
        throw new KvxferError(
          "ERR_TOO_MANY_WAITERS",
          `${watches.size} watchers already (most ${s.maxWatchers})`,
        );
      const mine = byClient.get(client) ?? 0;
      if (mine >= s.maxWatchersPerClient)
        throw new KvxferError(
          "ERR_TOO_MANY_WAITERS",
          `${mine} watchers from ${client} already (most ${s.maxWatchersPerClient} per client; the rest are kept for others)`,
        );
      const kinds = namesFromProto(eventKinds, req.kinds, "event kind");
      if (req.transferIds.length > MAX_FILTER_IDS)
        throw new KvxferError(
          "ERR_INVALID_ARGUMENT",
          `${req.transferIds.length} transfer ids in the filter (at most ${MAX_FILTER_IDS})`,
        );
      for (const id of req.transferIds) checkTransferId(id, "a transfer id in the filter");
      if (req.epoch !== 0n && req.epoch !== s.epoch)
        return void call.emit(
          "error",
          fail(
            grpc.status.FAILED_PRECONDITION,
            `the sidecar's epoch is ${s.epoch}, not ${req.epoch}: it restarted and numbers events from 1 again; resume from after_seq 0`,
          ),
        );
      const afterSeq = req.liveOnly ? events.lastSeq : seqFromProto(req.afterSeq, "after_seq");
      watches.add(w);
      byClient.set(client, mine + 1);
      w.sub = events.subscribe(
        afterSeq,
        {
          ...(kinds.length > 0 ? { kinds } : {}),
          ...(req.transferIds.length > 0 ? { transferIds: req.transferIds } : {}),
        },
        {
          onEvent: (ev) => {
            w.lastSentSeq = ev.seq;
            send(s.encodeEvent(ev));
            if (ev.transferId !== "") s.view.traced?.(ev.transferId, ev.side, "event.written");
          },
          onCaughtUp: () => {
            w.lastSentSeq = Math.max(w.lastSentSeq, w.sub?.scannedSeq ?? 0);
            send(s.progress(w.sub?.scannedSeq ?? events.lastSeq, true));
          },
          onEnd: (err) => finish(err === undefined ? undefined : toStatus(err)),
        },
        {
          liveOnly: req.liveOnly,
          ...(s.watchBufferLimit !== undefined ? { bufferLimit: s.watchBufferLimit } : {}),
        },
      );
      // First message: where the stream starts and which epoch it belongs to.
      send(s.progress(afterSeq, false));
    } catch (err) {
      release();
      call.emit("error", toStatus(err));
      return;
    }
    call.on("drain", () => {
      w.paused = false;
      w.sub?.resume();
    });
    call.on("cancelled", () => finish(undefined));
    call.on("error", () => finish(undefined));
  }

  awaitTransfer(
    call: grpc.ServerUnaryCall<AwaitTransferRequest, unknown>,
    cb: grpc.sendUnaryData<unknown>,
  ): void {
    const { s } = this;
    const req = call.request;
    let side: TransferSide | undefined;
    try {
      if (s.closing) throw new KvxferError("ERR_CLOSED", "the sidecar is shutting down");
      checkTransferId(req.transferId, "transfer_id");
      if (req.side !== PbTransferSide.UNSPECIFIED) {
        side = transferSides.name(req.side);
        if (side === undefined)
          throw new KvxferError("ERR_INVALID_ARGUMENT", `unknown side ${req.side}`);
      }
    } catch (err) {
      return cb(toStatus(err));
    }
    const callDeadline = deadlineMs(call);
    const capped = Date.now() + s.maxAwaitMs;
    const abort = new AbortController();
    s.awaits.add(abort);
    call.on("cancelled", () => abort.abort());
    s.events
      .waitFor(req.transferId, {
        deadlineMs: Math.min(callDeadline, capped),
        ...(side !== undefined ? { side } : {}),
        signal: abort.signal,
      })
      .then(
        (ev) => {
          if (ev !== undefined) {
            cb(null, create(AwaitTransferResponseSchema, { event: eventToProto(ev) }));
            s.view.traced?.(ev.transferId, ev.side, "event.answered");
            return;
          }
          if (call.cancelled) return;
          if (s.closing) return cb(fail(grpc.status.UNAVAILABLE, "the sidecar is shutting down"));
          cb(
            fail(
              grpc.status.DEADLINE_EXCEEDED,
              capped < callDeadline
                ? `transfer '${req.transferId}' has not ended within the server's longest wait (${s.maxAwaitMs} ms)`
                : `transfer '${req.transferId}' has not ended before the deadline`,
            ),
          );
        },
        (err: unknown) => cb(toStatus(err)),
      )
      .finally(() => s.awaits.delete(abort));
  }

  /**
   * Tells filtered watchers how far the server has looked, so they can resume
   * from a retained seq even when none of their own events came for a while.
   */
  sendProgress(): void {
    for (const w of this.s.watches) {
      const scanned = w.sub?.scannedSeq ?? 0;
      if (!w.paused && w.sub?.caughtUp && scanned > w.lastSentSeq) {
        w.lastSentSeq = scanned;
        if (!w.call.write(this.s.progress(scanned, false))) {
          w.paused = true;
          w.sub.pause();
        }
      }
    }
  }

  /** Ends every open stream (UNAVAILABLE) and wait (server stopping). */
  endAll(): void {
    const shutdown = fail(grpc.status.UNAVAILABLE, "the sidecar is shutting down");
    for (const w of [...this.s.watches]) {
      this.s.watches.delete(w);
      w.sub?.close();
      if (!w.call.cancelled) w.call.emit("error", shutdown);
    }
    for (const a of this.s.awaits) a.abort();
  }
}

/** grpc.health.v1.Health: Check and Watch, and the serving state they report. */
class HealthRpcs {
  constructor(private readonly s: ApiState) {}

  /** The handlers grpc-js calls, by method name. */
  handlers(): grpc.UntypedServiceImplementation {
    return { Check: this.check.bind(this), Watch: this.watch.bind(this) };
  }

  /** SERVING or NOT_SERVING for "" and the Sidecar service; undefined for any other. */
  private status(service: string): ServingStatus | undefined {
    if (service !== "" && service !== SIDECAR_SERVICE_NAME) return undefined;
    return this.s.serving ? ServingStatus.SERVING : ServingStatus.NOT_SERVING;
  }

  private answer(call: HealthWatch): void {
    call.write(
      create(HealthCheckResponseSchema, {
        status: this.status(call.request.service) ?? ServingStatus.SERVICE_UNKNOWN,
      }),
    );
  }

  check(
    call: grpc.ServerUnaryCall<HealthCheckRequest, unknown>,
    cb: grpc.sendUnaryData<unknown>,
  ): void {
    const status = this.status(call.request.service);
    if (status === undefined)
      return cb(fail(grpc.status.NOT_FOUND, `unknown service '${call.request.service}'`));
    cb(null, create(HealthCheckResponseSchema, { status }));
  }

  watch(call: HealthWatch): void {
    if (this.s.closing)
      return void call.emit("error", fail(grpc.status.UNAVAILABLE, "shutting down"));
    this.s.healthWatches.add(call);
    this.answer(call);
    const done = (): void => void this.s.healthWatches.delete(call);
    call.on("cancelled", done);
    call.on("error", done);
  }

  setServing(next: boolean): void {
    if (next === this.s.serving) return;
    this.s.serving = next;
    this.s.log.info({ serving: next }, "health changed");
    for (const call of this.s.healthWatches) this.answer(call);
  }

  /** Ends every Health/Watch stream (server stopping). */
  endAll(): void {
    for (const call of this.s.healthWatches) call.end();
    this.s.healthWatches.clear();
  }
}

function serverCredentials(tls: ApiTlsOptions | undefined): grpc.ServerCredentials {
  return tls === undefined
    ? grpc.ServerCredentials.createInsecure()
    : grpc.ServerCredentials.createSsl(
        tls.ca === undefined ? null : Buffer.from(tls.ca),
        [{ cert_chain: Buffer.from(tls.cert), private_key: Buffer.from(tls.key) }],
        tls.requireClientCert ?? tls.ca !== undefined,
      );
}

/** Stops `server` gracefully, cutting what is left after `graceMs`. */
function shutdown(server: grpc.Server, graceMs: number): Promise<void> {
  return new Promise<void>((resolve) => {
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
}

export async function startApiServer(opts: ApiServerOptions): Promise<ApiServer> {
  const state = new ApiState(opts);
  const { log } = state;
  const sidecar = new SidecarRpcs(state);
  const health = new HealthRpcs(state);

  const server = new grpc.Server({
    // Requests are small; anything large is a mistake or an attack.
    "grpc.max_receive_message_length": 1 << 20,
    "grpc.keepalive_time_ms": 30_000,
    "grpc.keepalive_timeout_ms": 10_000,
    "grpc.max_connection_idle_ms": opts.maxConnectionIdleMs ?? 60_000,
  });
  server.addService(asServiceDefinition(sidecarService), sidecar.handlers());
  server.addService(asServiceDefinition(healthService), health.handlers());

  const address = opts.address ?? "127.0.0.1:0";
  const hp = splitHostPort(address);
  if (hp === undefined)
    throw new KvxferError(
      "ERR_INVALID_ARGUMENT",
      `gRPC address must be host:port, got '${address}'`,
    );
  // Our own listener: every connection takes a slot (a cap, a cap per client address) before
  // grpc-js sees it; grpc-js has no connection cap of its own.
  const slots = new ConnectionSlots(
    {
      inFlight: opts.maxConnections ?? 256,
      perSource: opts.maxConnectionsPerClient ?? 32,
      deadlineMs: 0,
      // No HTTP/2 preface within this long: not a gRPC client (a silent one gives its slot back).
      silentMs: opts.silentConnectionMs ?? 10_000,
    },
    (code, message) => log.warn({ code }, `gRPC: ${message}`),
  );
  const injector = server.createConnectionInjector(serverCredentials(opts.tls));
  // No Nagle: events are small and latency is what a router waits on.
  const tcp = net.createServer({ noDelay: true }, (socket) => {
    if (slots.admit(socket)) injector.injectConnection(socket);
  });
  await new Promise<void>((resolve, reject) => {
    tcp.once("error", reject);
    tcp.listen(hp.port, hp.host, () => {
      tcp.off("error", reject);
      resolve();
    });
  });
  const port = (tcp.address() as net.AddressInfo).port;
  const host = address.slice(0, address.lastIndexOf(":"));
  const bound = `${host}:${port}`;

  const ticker = setInterval(() => sidecar.sendProgress(), state.progressIntervalMs);
  ticker.unref();

  log.info({ address: bound, tls: opts.tls !== undefined }, "gRPC API listening");

  return {
    port,
    address: bound,
    get serving() {
      return state.serving;
    },
    get watchers() {
      return state.watches.size;
    },
    get connections() {
      return slots.inFlight;
    },
    setServing: (next) => health.setServing(next),
    drain: () => health.setServing(false),
    async close(graceMs = 5_000) {
      if (state.closing) return;
      health.setServing(false);
      state.closing = true;
      clearInterval(ticker);
      sidecar.endAll();
      health.endAll();
      tcp.close();
      await shutdown(server, graceMs);
      injector.destroy();
      slots.destroyAll();
      log.info("gRPC API closed");
    },
  };
}
