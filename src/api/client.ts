/**
 * A typed client of the sidecar's gRPC API, speaking the view types of
 * src/sidecar/view.ts. Used by the CLI, the simulated router and tests.
 * `watchResumable` is how a router should learn about transfers: it resumes
 * after a disconnect from the last seq it delivered, so every event is
 * delivered once, and it stops (rather than skip events) when the sidecar no
 * longer has the ones it missed.
 */
import * as grpc from "@grpc/grpc-js";
import { isIP } from "node:net";
import { checkServerIdentity } from "node:tls";
import { create } from "@bufbuild/protobuf";
import {
  type HealthCheckResponse,
  HealthCheckRequestSchema,
  HealthCheckResponse_ServingStatus as ServingStatus,
} from "../gen/grpc/health/v1/health_pb.js";
import {
  type AwaitTransferResponse,
  AwaitTransferRequestSchema,
  type GetStatusResponse,
  GetStatusRequestSchema,
  type ListTransfersResponse,
  ListTransfersRequestSchema,
  TransferSide as PbTransferSide,
  type WatchEventsRequest,
  WatchEventsRequestSchema,
  type WatchEventsResponse,
} from "../gen/kvxfer/v1/sidecar_pb.js";
import type {
  EventKind,
  SidecarEvent,
  TransferFilter,
  TransferInfo,
  TransferSide,
} from "../sidecar/view.js";
import {
  type SidecarStatusReply,
  eventFromProto,
  eventKinds,
  statusFromProto,
  transferFromProto,
  transferSides,
  transferStates,
} from "./convert.js";
import { type MethodDef, healthService, method, sidecarService } from "./service.js";

export type { SidecarStatusReply } from "./convert.js";

export interface ClientTlsOptions {
  /** PEM CA bundle the server certificate must chain to (default: the system roots). */
  readonly ca?: Buffer | string;
  /** PEM client certificate and key, for mutual TLS. */
  readonly cert?: Buffer | string;
  readonly key?: Buffer | string;
  /** Name to check the server certificate against, when it differs from the address host. */
  readonly serverName?: string;
}

export interface SidecarClientOptions {
  readonly tls?: ClientTlsOptions;
  /** Timeout of unary calls other than awaitTransfer; default 10 000 ms. */
  readonly timeoutMs?: number;
}

export type HealthStatus = "UNKNOWN" | "SERVING" | "NOT_SERVING" | "SERVICE_UNKNOWN";

export interface EventWatchFilter {
  readonly transferIds?: readonly string[];
  /** Unknown names are sent as kind 0, which the server refuses (INVALID_ARGUMENT). */
  readonly kinds?: readonly (EventKind | string)[];
}

export interface WatchOptions extends EventWatchFilter {
  /** Events with seq > afterSeq (default 0: everything retained). */
  readonly afterSeq?: number;
  /** Only events appended from now on. */
  readonly liveOnly?: boolean;
  /** The epoch afterSeq belongs to; the server refuses a resume into another epoch. */
  readonly epoch?: bigint;
  /** Called for each progress message (the first carries the server's epoch). */
  readonly onProgress?: (p: WatchProgressInfo) => void;
}

export interface WatchProgressInfo {
  readonly seq: number;
  readonly epoch: bigint;
  readonly firstSeq: number;
  readonly caughtUp: boolean;
}

export interface EventWatch {
  /** Last seq delivered or reported by a progress message (the resume point). */
  readonly lastSeq: number;
  /** The server's epoch, once its first message arrived. */
  readonly epoch: bigint | undefined;
  /** Resolves when cancelled or when the server ends the stream cleanly; rejects with a grpc.ServiceError. */
  readonly done: Promise<void>;
  cancel(): void;
}

export interface ResumableWatchOptions extends WatchOptions {
  /** Reconnect attempts in a row before giving up (default: unlimited). */
  readonly maxRetries?: number;
  /** First and largest wait between attempts; default 50 and 2 000 ms. */
  readonly minBackoffMs?: number;
  readonly maxBackoffMs?: number;
  /** Told about each reconnect (for logs). */
  readonly onReconnect?: (attempt: number, err: grpc.ServiceError | undefined) => void;
}

export interface ResumableWatch extends EventWatch {
  /** How many times the stream was reopened. */
  readonly reconnects: number;
}

/**
 * Status codes after which resuming cannot help: the events are gone
 * (OUT_OF_RANGE), the sidecar restarted (FAILED_PRECONDITION), or the request
 * itself is wrong.
 */
const FINAL_CODES: ReadonlySet<grpc.status> = new Set([
  grpc.status.OUT_OF_RANGE,
  grpc.status.FAILED_PRECONDITION,
  grpc.status.INVALID_ARGUMENT,
  grpc.status.UNAUTHENTICATED,
  grpc.status.PERMISSION_DENIED,
  grpc.status.UNIMPLEMENTED,
  grpc.status.NOT_FOUND,
]);

const healthNames: Record<number, HealthStatus> = {
  [ServingStatus.UNKNOWN]: "UNKNOWN",
  [ServingStatus.SERVING]: "SERVING",
  [ServingStatus.NOT_SERVING]: "NOT_SERVING",
  [ServingStatus.SERVICE_UNKNOWN]: "SERVICE_UNKNOWN",
};

const M = {
  getStatus: method(sidecarService, "GetStatus"),
  listTransfers: method(sidecarService, "ListTransfers"),
  watchEvents: method(sidecarService, "WatchEvents"),
  awaitTransfer: method(sidecarService, "AwaitTransfer"),
  check: method(healthService, "Check"),
  healthWatch: method(healthService, "Watch"),
};

export function isServiceError(err: unknown): err is grpc.ServiceError {
  return err instanceof Error && typeof (err as { code?: unknown }).code === "number";
}

/** The host part of host:port, [v6]:port, or a bare host. */
function hostOf(address: string): string {
  const target = address.replace(/^dns:(\/\/[^/]*\/)?/, "");
  const v6 = /^\[([^\]]+)\]/.exec(target);
  if (v6 !== null) return v6[1]!;
  const i = target.lastIndexOf(":");
  return i >= 0 && target.indexOf(":") === i ? target.slice(0, i) : target;
}

/**
 * TLS to an IP address: grpc-js would send the IP as the TLS server name,
 * which Node refuses with a deprecation warning (DEP0123) on every call. The
 * SNI name is then a placeholder and the certificate is still checked against
 * the IP address (its subjectAltName IP entries).
 */
const IP_SNI_PLACEHOLDER = "kvxfer-sidecar";

function credentials(
  tls: ClientTlsOptions | undefined,
  address: string,
): { creds: grpc.ChannelCredentials; nameOverride?: string } {
  if (tls === undefined) return { creds: grpc.credentials.createInsecure() };
  const buf = (v: Buffer | string | undefined): Buffer | null =>
    v === undefined ? null : Buffer.from(v);
  const host = hostOf(address);
  if (tls.serverName === undefined && isIP(host) !== 0) {
    return {
      creds: grpc.credentials.createSsl(buf(tls.ca), buf(tls.key), buf(tls.cert), {
        checkServerIdentity: (_name, cert) => checkServerIdentity(host, cert),
      }),
      nameOverride: IP_SNI_PLACEHOLDER,
    };
  }
  return {
    creds: grpc.credentials.createSsl(buf(tls.ca), buf(tls.key), buf(tls.cert)),
    ...(tls.serverName !== undefined ? { nameOverride: tls.serverName } : {}),
  };
}

export class SidecarClient {
  readonly address: string;
  private readonly client: grpc.Client;
  private readonly timeoutMs: number;

  constructor(address: string, opts: SidecarClientOptions = {}) {
    this.address = address;
    this.timeoutMs = opts.timeoutMs ?? 10_000;
    const options: grpc.ChannelOptions = {
      // Our server's caps are small; a stream's events are tiny.
      "grpc.max_receive_message_length": 64 << 20,
    };
    const { creds, nameOverride } = credentials(opts.tls, address);
    if (nameOverride !== undefined) options["grpc.ssl_target_name_override"] = nameOverride;
    this.client = new grpc.Client(address, creds, options);
  }

  /** Resolves when the channel is connected; rejects after `timeoutMs`. */
  connect(timeoutMs = this.timeoutMs): Promise<void> {
    return new Promise((resolve, reject) =>
      this.client.waitForReady(Date.now() + timeoutMs, (err) => (err ? reject(err) : resolve())),
    );
  }

  close(): void {
    this.client.close();
  }

  async getStatus(): Promise<SidecarStatusReply> {
    const res = await this.unary<GetStatusResponse>(
      M.getStatus,
      create(GetStatusRequestSchema, {}),
      this.timeoutMs,
    );
    return statusFromProto(res);
  }

  /** Unknown state names are sent as 0, which the server refuses (INVALID_ARGUMENT). */
  async listTransfers(
    filter: TransferFilter & { readonly limit?: number } = {},
  ): Promise<{ transfers: TransferInfo[]; total: number }> {
    const res = await this.unary<ListTransfersResponse>(
      M.listTransfers,
      create(ListTransfersRequestSchema, {
        states: (filter.states ?? []).map((s) => transferStates.num(s) ?? 0),
        peer: filter.peer ?? "",
        limit: filter.limit ?? 0,
      }),
      this.timeoutMs,
    );
    return { transfers: res.transfers.map(transferFromProto), total: Number(res.total) };
  }

  /**
   * The transfer's terminal event. Rejects with a grpc.ServiceError:
   * DEADLINE_EXCEEDED when it has not ended within `timeoutMs`, NOT_FOUND when
   * it ended so long ago that the log no longer has it.
   */
  async awaitTransfer(
    transferId: string,
    timeoutMs: number,
    opts: { side?: TransferSide } = {},
  ): Promise<SidecarEvent> {
    const res = await this.unary<AwaitTransferResponse>(
      M.awaitTransfer,
      create(AwaitTransferRequestSchema, {
        transferId,
        side: transferSides.num(opts.side ?? "") ?? PbTransferSide.UNSPECIFIED,
      }),
      timeoutMs,
    );
    if (res.event === undefined) throw new Error("AwaitTransfer answered without an event");
    return eventFromProto(res.event);
  }

  /** grpc.health.v1 Check of `service` ("" = the whole server). */
  async health(service = ""): Promise<HealthStatus> {
    const res = await this.unary<HealthCheckResponse>(
      M.check,
      create(HealthCheckRequestSchema, { service }),
      this.timeoutMs,
    );
    return healthNames[res.status] ?? "UNKNOWN";
  }

  /** grpc.health.v1 Watch: the current status, then every change, until cancelled. */
  watchHealth(
    service: string,
    onStatus: (s: HealthStatus) => void,
  ): { cancel(): void; done: Promise<void> } {
    const call = this.client.makeServerStreamRequest(
      M.healthWatch.path,
      M.healthWatch.requestSerialize,
      M.healthWatch.responseDeserialize,
      create(HealthCheckRequestSchema, { service }),
    );
    let cancelled = false;
    call.on("data", (res: HealthCheckResponse) => onStatus(healthNames[res.status] ?? "UNKNOWN"));
    const done = streamDone(call, () => cancelled);
    return {
      cancel: () => {
        cancelled = true;
        call.cancel();
      },
      done,
    };
  }

  /** One WatchEvents stream; see `watchResumable` for one that survives disconnects. */
  watch(opts: WatchOptions, onEvent: (ev: SidecarEvent) => void): EventWatch {
    const req = create(WatchEventsRequestSchema, {
      afterSeq: BigInt(opts.afterSeq ?? 0),
      liveOnly: opts.liveOnly ?? false,
      transferIds: [...(opts.transferIds ?? [])],
      kinds: (opts.kinds ?? []).map((k) => eventKinds.num(k) ?? 0),
      epoch: opts.epoch ?? 0n,
    });
    return this.watchRequest(req, onEvent, opts.onProgress);
  }

  /** A WatchEvents stream from a raw request (for callers that build their own). */
  watchRequest(
    req: WatchEventsRequest,
    onEvent: (ev: SidecarEvent) => void,
    onProgress?: (p: WatchProgressInfo) => void,
  ): EventWatch {
    const call = this.client.makeServerStreamRequest(
      M.watchEvents.path,
      M.watchEvents.requestSerialize,
      M.watchEvents.responseDeserialize,
      req,
    );
    let lastSeq = req.liveOnly ? 0 : Number(req.afterSeq);
    let epoch: bigint | undefined;
    let cancelled = false;
    call.on("data", (res: WatchEventsResponse) => {
      if (res.msg.case === "event") {
        const ev = eventFromProto(res.msg.value);
        lastSeq = ev.seq;
        onEvent(ev);
      } else if (res.msg.case === "progress") {
        const p = res.msg.value;
        epoch = p.epoch;
        lastSeq = Math.max(lastSeq, Number(p.seq));
        onProgress?.({
          seq: Number(p.seq),
          epoch: p.epoch,
          firstSeq: Number(p.firstSeq),
          caughtUp: p.caughtUp,
        });
      }
    });
    const done = streamDone(call, () => cancelled);
    return {
      get lastSeq() {
        return lastSeq;
      },
      get epoch() {
        return epoch;
      },
      done,
      cancel: () => {
        cancelled = true;
        call.cancel();
      },
    };
  }

  /**
   * Watches events across disconnects: after a stream ends for a reason
   * resuming can fix (UNAVAILABLE, RESOURCE_EXHAUSTED when it fell behind, a
   * cut connection), it reopens with after_seq = the last seq it delivered and
   * the epoch it saw, with backoff. Each event is delivered once, in seq
   * order. `done` rejects on OUT_OF_RANGE (events it missed are gone: resync
   * with listTransfers), FAILED_PRECONDITION (the sidecar restarted), bad
   * requests, or after `maxRetries` failed attempts in a row.
   */
  watchResumable(opts: ResumableWatchOptions, onEvent: (ev: SidecarEvent) => void): ResumableWatch {
    let lastSeq = opts.afterSeq ?? 0;
    let epoch = opts.epoch;
    let liveOnly = opts.liveOnly ?? false;
    let current: EventWatch | undefined;
    let cancelled = false;
    let reconnects = 0;
    let wake: (() => void) | undefined;
    const minBackoff = opts.minBackoffMs ?? 50;
    const maxBackoff = opts.maxBackoffMs ?? 2_000;
    const maxRetries = opts.maxRetries ?? Infinity;

    const run = async (): Promise<void> => {
      let failures = 0;
      for (;;) {
        if (cancelled) return;
        let healthy = false;
        const w = this.watch(
          {
            ...opts,
            afterSeq: lastSeq,
            liveOnly,
            ...(epoch !== undefined ? { epoch } : {}),
            onProgress: (p) => {
              healthy = true;
              epoch = p.epoch;
              // The server has looked at everything up to p.seq for us.
              if (p.seq > lastSeq) lastSeq = p.seq;
              opts.onProgress?.(p);
            },
          },
          (ev) => {
            healthy = true;
            if (ev.seq <= lastSeq) return; // never twice (cannot happen with a correct server)
            lastSeq = ev.seq;
            onEvent(ev);
          },
        );
        current = w;
        let err: grpc.ServiceError | undefined;
        try {
          await w.done;
        } catch (e) {
          if (!isServiceError(e)) throw e;
          err = e;
        }
        if (cancelled) return;
        if (err !== undefined && FINAL_CODES.has(err.code)) throw err;
        // Once the stream started, the replay from lastSeq covers what a live-only start skipped.
        if (epoch !== undefined) liveOnly = false;
        failures = healthy ? 1 : failures + 1;
        if (failures > maxRetries) throw err ?? new Error("watch stream ended");
        reconnects++;
        opts.onReconnect?.(reconnects, err);
        const backoff = Math.min(maxBackoff, minBackoff * 2 ** (failures - 1));
        await new Promise<void>((resolve) => {
          const t = setTimeout(resolve, backoff);
          wake = () => {
            clearTimeout(t);
            resolve();
          };
        });
        wake = undefined;
      }
    };
    const done = run();
    done.catch(() => {}); // the caller may not await it; the rejection stays on `done`
    return {
      get lastSeq() {
        return lastSeq;
      },
      get epoch() {
        return epoch;
      },
      get reconnects() {
        return reconnects;
      },
      done,
      cancel: () => {
        cancelled = true;
        current?.cancel();
        wake?.();
      },
    };
  }

  private unary<Res>(m: MethodDef, req: unknown, timeoutMs: number): Promise<Res> {
    return new Promise((resolve, reject) => {
      this.client.makeUnaryRequest(
        m.path,
        m.requestSerialize,
        m.responseDeserialize,
        req,
        new grpc.Metadata(),
        { deadline: Date.now() + timeoutMs },
        (err, res) => (err ? reject(err) : resolve(res as Res)),
      );
    });
  }
}

/** Resolves when a server stream ends OK or was cancelled by us; rejects with its status otherwise. */
function streamDone(
  call: grpc.ClientReadableStream<unknown>,
  cancelled: () => boolean,
): Promise<void> {
  const done = new Promise<void>((resolve, reject) => {
    call.on("error", (err: grpc.ServiceError) => {
      if (cancelled() && err.code === grpc.status.CANCELLED) resolve();
      else reject(err);
    });
    call.on("status", (s: grpc.StatusObject) => {
      if (s.code === grpc.status.OK) resolve();
    });
  });
  // Callers may look at `done` late (or never); its rejection must not be "unhandled".
  done.catch(() => {});
  return done;
}
