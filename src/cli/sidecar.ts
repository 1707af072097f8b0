/**
 * `kvxfer sidecar`: one sidecar process next to one engine. Settings come
 * from flags, then KVXFER_* environment variables, then a JSON config file
 * (--config), then defaults. Logs are JSON (pino) on stderr; stdout carries
 * one `{"event":"ready",...}` line once the sidecar is listening, for
 * whatever started it.
 */
import { X509Certificate } from "node:crypto";
import { readFileSync, statSync } from "node:fs";
import { totalmem } from "node:os";
import { resolve } from "node:path";
import { format, parseArgs } from "node:util";
import * as grpc from "@grpc/grpc-js";
import { pino, type Logger } from "pino";

import { startApiServer, type ApiServer } from "../api/server.js";
import { startBootstrapServer } from "../api/bootstrap.js";
import { splitHostPort, type HttpServer } from "../api/http.js";
import { SidecarMetrics, startMetricsServer, type MetricsServer } from "../api/metrics.js";
import { ZmqNotifier } from "../api/zmq-notify.js";
import { EngineLinkServer, defaultEngineEndpoint } from "../engine/link.js";
import { KvxferError } from "../errors.js";
import { isLoopback, validityProblem, type PeerCredentials } from "../peer/side-channel.js";
import { EventLog } from "../sidecar/event-log.js";
import { stderrSink } from "../sidecar/log-sink.js";
import { Sidecar, type SidecarOptions } from "../sidecar/sidecar.js";
import type { SidecarRole, TransferMode } from "../sidecar/view.js";
import { startOtlpTracing } from "./otel.js";

/** Every setting: flag name, kind, default, help. The env name is KVXFER_ + flag in UPPER_SNAKE. */
export const SIDECAR_SETTINGS = {
  "engine-id": { type: "string", default: "", help: "this engine's id (required)" },
  role: { type: "string", default: "both", help: "prefill | decode | both" },
  "engine-socket": {
    type: "string",
    default: "",
    help: "ZeroMQ endpoint of the engine link (default ipc:///tmp/kvxfer-<engine-id>.sock)",
  },
  "engine-max-frame-bytes": {
    type: "string",
    default: String(16 << 20),
    help: "largest engine link frame answered (ERR_TOO_LARGE above); above 4x this ZeroMQ drops the connection before buffering",
  },
  listen: {
    type: "string",
    default: "127.0.0.1:0",
    help: "side channel host:port for peer handshakes",
  },
  "peer-cert": {
    type: "string",
    default: "",
    help: "PEM certificate for the side channel, subject CN = --engine-id, signed by --peer-ca (peers authenticate with mutual TLS)",
  },
  "peer-key": { type: "string", default: "", help: "PEM private key for --peer-cert" },
  "peer-ca": {
    type: "string",
    default: "",
    help: "PEM CA of the cluster: only peers with a certificate it signed get metadata or remote keys",
  },
  "insecure-peers": {
    type: "string",
    default: "false",
    help: "true: allow a non-loopback --listen without peer credentials (anyone reaching it can read and write the KV)",
  },
  mode: { type: "string", default: "auto", help: "push | pull | auto" },
  transports: {
    type: "string",
    default: "",
    help: "UCX transports for every agent (UCX_TLS), e.g. shm,self or tcp",
  },
  "net-devices": {
    type: "string",
    default: "",
    help: "UCX net devices, comma-separated: one per rank, or one for all",
  },
  "error-mode": {
    type: "string",
    default: "none",
    help: "none | peer (UCX peer failure detection; disables shared memory)",
  },
  "busy-poll": {
    type: "string",
    default: "false",
    help: "true: each agent's progress thread spins instead of sleeping (lower latency, one core per rank)",
  },
  "spin-us": {
    type: "string",
    default: "auto",
    help: "after any activity, progress threads keep polling this many microseconds before sleeping; auto: 200 when each rank's agent has two cores, else 0",
  },
  "lease-ms": {
    type: "string",
    default: "30000",
    help: "P holds finished blocks this long without D's heartbeat",
  },
  "reg-lease-ms": {
    type: "string",
    default: "30000",
    help: "a push registration on P lives this long without renewal",
  },
  "transfer-timeout-ms": {
    type: "string",
    default: "60000",
    help: "D gives up on a transfer after this long",
  },
  "heartbeat-ms": { type: "string", default: "1000", help: "heartbeat period between peers" },
  "peer-timeout-ms": {
    type: "string",
    default: "5000",
    help: "a silent peer with live transfers is down after this long",
  },
  "abort-grace-ms": {
    type: "string",
    default: "2000",
    help: "extra wait past P's registration lease before D reuses blocks of an unacknowledged abort",
  },
  "max-transfers": { type: "string", default: "65536", help: "live transfers per side at most" },
  "max-per-peer": {
    type: "string",
    default: "",
    help: "P: transfers one decode engine may open by PushReg before PrefillDone (default max-transfers / 8)",
  },
  "peer-messages-per-sec": {
    type: "string",
    default: "20000",
    help: "notifications of one peer processed per second at most (burst: two seconds' worth)",
  },
  "kv-dir": {
    type: "string",
    default: "/dev/shm",
    help: "the engine's KV files must be regular files owned by this uid under this directory, reached without symbolic links",
  },
  "max-registration-bytes": {
    type: "string",
    default: "",
    help: "most bytes one RegisterKvCache may map (all ranks); suffixes K, M, G, T (binary); empty: this machine's memory",
  },
  "max-kv-bytes": {
    type: "string",
    default: "",
    help: "most bytes of KV files mapped by this sidecar at once; suffixes as above; empty: this machine's memory",
  },
  prefault: {
    type: "string",
    default: "false",
    help: "true: map KV files with every page faulted in at registration (resident at once; first transfers faster)",
  },
  "exclusive-prefill-blocks": {
    type: "string",
    default: "false",
    help: "true: refuse a PrefillDone listing a block a live transfer holds (engines that never share blocks); false: allowed (vLLM's prefix cache shares read-only blocks)",
  },
  "tombstone-ms": {
    type: "string",
    default: "60000",
    help: "ended transfers are remembered this long (to refuse duplicates, replays, late requests)",
  },
  "event-log-capacity": {
    type: "string",
    default: "100000",
    help: "events kept for WatchEvents replay and AwaitTransfer",
  },
  grpc: {
    type: "string",
    default: "127.0.0.1:0",
    help: "gRPC address for routers and operators (status, events, health)",
  },
  metrics: {
    type: "string",
    default: "",
    help: "Prometheus metrics host:port (GET /metrics); empty: off",
  },
  advertise: {
    type: "string",
    default: "",
    help: "the side channel's address as others must dial it (host:port), for --bootstrap; empty: --listen as bound",
  },
  bootstrap: {
    type: "string",
    default: "",
    help: "serve this prefill engine's id and side channel at GET /query on host:port, for a router that asks for them up front (vllm-router --kv-connector mooncake: --prefill URL PORT); empty: off",
  },
  "notify-zmq": {
    type: "string",
    default: "",
    help: "on each KV_READY (decode side), push production-stack's ZMQ message (msgpack {req_id: transfer id}) to this endpoint, e.g. tcp://router:7500; empty: off",
  },
  "otlp-endpoint": {
    type: "string",
    default: "",
    help: "send each transfer's trace as OpenTelemetry spans over OTLP/HTTP to this URL (e.g. http://127.0.0.1:4318/v1/traces); empty: off",
  },
  "tls-cert": {
    type: "string",
    default: "",
    help: "PEM server certificate for gRPC (enables TLS)",
  },
  "tls-key": { type: "string", default: "", help: "PEM private key for --tls-cert" },
  "tls-ca": {
    type: "string",
    default: "",
    help: "PEM CA for client certificates (enables mutual TLS)",
  },
  "drain-ms": {
    type: "string",
    default: "10000",
    help: "on SIGTERM, how long in-flight transfers get to finish",
  },
  "engine-lease-ms": {
    type: "string",
    default: "0",
    help:
      "> 0: once the engine is provably gone (its connection ended and its KV files were " +
      "removed, or it stayed away this long) end what it held, tell peers and exit 75 so the " +
      "supervisor restarts the sidecar for the next engine; 0: off",
  },
  "log-level": { type: "string", default: "info", help: "pino level" },
  config: {
    type: "string",
    default: "",
    help: "JSON file with any of these settings (flag names as keys)",
  },
} as const;

export type SettingName = keyof typeof SIDECAR_SETTINGS;

function envName(flag: string): string {
  return `KVXFER_${flag.replace(/-/g, "_").toUpperCase()}`;
}

/** Resolves every setting: flag > environment > config file > default. */
export function resolveSettings(
  argv: string[],
  env: NodeJS.ProcessEnv = process.env,
): Record<SettingName, string> {
  const options = Object.fromEntries(
    Object.keys(SIDECAR_SETTINGS).map((k) => [k, { type: "string" as const }]),
  );
  const { values } = parseArgs({ args: argv, options, strict: true });
  const flags = values as Partial<Record<SettingName, string>>;
  const configPath = flags.config ?? env[envName("config")] ?? "";
  let file: Record<string, unknown> = {};
  if (configPath !== "") {
    try {
      file = JSON.parse(readFileSync(configPath, "utf8")) as Record<string, unknown>;
    } catch (err) {
      throw new KvxferError(
        "ERR_CONFIG",
        `cannot read config file '${configPath}': ${(err as Error).message}`,
      );
    }
    for (const k of Object.keys(file)) {
      if (!(k in SIDECAR_SETTINGS))
        throw new KvxferError("ERR_CONFIG", `config file '${configPath}': unknown setting '${k}'`);
    }
  }
  const out = {} as Record<SettingName, string>;
  for (const [name, spec] of Object.entries(SIDECAR_SETTINGS) as [
    SettingName,
    { default: string },
  ][]) {
    const fromFile = file[name];
    out[name] =
      flags[name] ??
      env[envName(name)] ??
      (fromFile === undefined ? undefined : String(fromFile)) ??
      spec.default;
  }
  return out;
}

function oneOf<T extends string>(name: string, value: string, allowed: readonly T[]): T {
  if (!(allowed as readonly string[]).includes(value)) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--${name} must be one of ${allowed.join(", ")}, got '${value}'`,
    );
  }
  return value as T;
}

function spinUs(value: string): number | "auto" {
  if (value === "auto") return "auto";
  const n = Number(value);
  if (value.trim() === "" || !Number.isSafeInteger(n) || n < 0)
    throw new KvxferError(
      "ERR_CONFIG",
      `--spin-us must be auto or a non-negative integer (µs), got '${value}'`,
    );
  return n;
}

function nonNegativeInt(name: string, value: string): number {
  const n = Number(value);
  if (!Number.isSafeInteger(n) || n < 0) {
    throw new KvxferError("ERR_CONFIG", `--${name} must be a non-negative integer, got '${value}'`);
  }
  return n;
}

function positiveInt(name: string, value: string): number {
  const n = Number(value);
  if (!Number.isSafeInteger(n) || n <= 0)
    throw new KvxferError("ERR_CONFIG", `--${name} must be a positive integer, got '${value}'`);
  return n;
}

const SIZE_UNITS: Record<string, number> = {
  "": 1,
  k: 2 ** 10,
  m: 2 ** 20,
  g: 2 ** 30,
  t: 2 ** 40,
};

/** A byte count: digits with an optional binary suffix (K, M, G, T; "Gi", "GiB", "GB" alike); empty: `empty`. */
export function byteSize(name: string, value: string, empty: number): number {
  if (value.trim() === "") return empty;
  const m = /^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$/i.exec(value);
  const n = m === null ? NaN : Number(m[1]) * SIZE_UNITS[m[2]!.toLowerCase()]!;
  if (!Number.isSafeInteger(n) || n <= 0) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--${name} must be a positive byte count (e.g. 68719476736 or 64G), got '${value}'`,
    );
  }
  return n;
}

/** The KV directory, absolute; it must exist and be a directory. */
export function kvDirectory(value: string): string {
  if (value === "") throw new KvxferError("ERR_CONFIG", "--kv-dir must not be empty");
  const dir = resolve(value);
  let st;
  try {
    st = statSync(dir);
  } catch (err) {
    throw new KvxferError("ERR_CONFIG", `--kv-dir '${dir}': ${(err as Error).message}`);
  }
  if (!st.isDirectory())
    throw new KvxferError("ERR_CONFIG", `--kv-dir '${dir}' is not a directory`);
  return dir;
}

export function sidecarOptions(s: Record<SettingName, string>, logger: Logger): SidecarOptions {
  if (s["engine-id"] === "") throw new KvxferError("ERR_CONFIG", "--engine-id is required");
  return {
    engineId: s["engine-id"],
    role: oneOf<SidecarRole>("role", s.role, ["prefill", "decode", "both"]),
    mode: oneOf<TransferMode>("mode", s.mode, ["push", "pull", "auto"]),
    listen: s.listen,
    transports: s.transports,
    netDevices: s["net-devices"] === "" ? [] : s["net-devices"].split(","),
    errorMode: oneOf("error-mode", s["error-mode"], ["none", "peer"] as const),
    busyPoll: oneOf("busy-poll", s["busy-poll"], ["true", "false"] as const) === "true",
    spinUs: spinUs(s["spin-us"]),
    leaseMs: positiveInt("lease-ms", s["lease-ms"]),
    regLeaseMs: positiveInt("reg-lease-ms", s["reg-lease-ms"]),
    transferTimeoutMs: positiveInt("transfer-timeout-ms", s["transfer-timeout-ms"]),
    heartbeatMs: positiveInt("heartbeat-ms", s["heartbeat-ms"]),
    peerTimeoutMs: positiveInt("peer-timeout-ms", s["peer-timeout-ms"]),
    abortGraceMs: positiveInt("abort-grace-ms", s["abort-grace-ms"]),
    maxTransfers: positiveInt("max-transfers", s["max-transfers"]),
    ...(s["max-per-peer"] === ""
      ? {}
      : { maxPerPeer: positiveInt("max-per-peer", s["max-per-peer"]) }),
    peerMessagesPerSec: positiveInt("peer-messages-per-sec", s["peer-messages-per-sec"]),
    tombstoneMs: positiveInt("tombstone-ms", s["tombstone-ms"]),
    kvDir: kvDirectory(s["kv-dir"]),
    maxRegistrationBytes: byteSize(
      "max-registration-bytes",
      s["max-registration-bytes"],
      totalmem(),
    ),
    maxKvBytes: byteSize("max-kv-bytes", s["max-kv-bytes"], totalmem()),
    prefault: oneOf("prefault", s.prefault, ["true", "false"] as const) === "true",
    exclusivePrefillBlocks:
      oneOf("exclusive-prefill-blocks", s["exclusive-prefill-blocks"], [
        "true",
        "false",
      ] as const) === "true",
    ...peerCredentials(s),
    insecurePeers:
      oneOf("insecure-peers", s["insecure-peers"], ["true", "false"] as const) === "true",
    logger,
  };
}

/** --peer-cert/--peer-key/--peer-ca: all three or none. */
function peerCredentials(s: Record<SettingName, string>): { peerCredentials?: PeerCredentials } {
  const given = (["peer-cert", "peer-key", "peer-ca"] as const).filter((f) => s[f] !== "");
  if (given.length === 0) return {};
  if (given.length !== 3)
    throw new KvxferError(
      "ERR_CONFIG",
      `--peer-cert, --peer-key and --peer-ca go together (got only ${given.map((f) => `--${f}`).join(", ")})`,
    );
  return {
    peerCredentials: {
      cert: readPem("peer-cert", s["peer-cert"]),
      key: readPem("peer-key", s["peer-key"]),
      ca: readPem("peer-ca", s["peer-ca"]),
    },
  };
}

export interface RunningSidecar {
  sidecar: Sidecar;
  link: EngineLinkServer;
  events: EventLog;
  api: ApiServer;
  metrics: MetricsServer | undefined;
  /** `--bootstrap`'s server, when asked for. */
  bootstrap: HttpServer | undefined;
  /** NOT_SERVING, refuse new transfers, wait (bounded) for in-flight ones to end. */
  drain(deadlineMs: number): Promise<number>;
  /**
   * Settles (with why) once the registered engine is provably gone (`--engine-lease-ms` > 0):
   * its transfers were ended and its peers told; the caller stops the sidecar. Never settles
   * otherwise.
   */
  readonly engineGone: Promise<string>;
  close(): Promise<void>;
  /** The part `close()` is closing now ("" when not closing, or closed). */
  readonly closing: string;
}

export function readPem(flag: string, path: string): Buffer {
  try {
    return readFileSync(path);
  } catch (err) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--${flag}: cannot read '${path}': ${(err as Error).message}`,
    );
  }
}

/**
 * Reads a CA file and checks it holds at least one certificate, each PEM certificate block
 * parsing as X.509: gRPC would otherwise start with it and refuse every client.
 */
export function readCa(flag: string, path: string): Buffer {
  const pem = readPem(flag, path);
  const blocks =
    pem.toString("latin1").match(/-----BEGIN CERTIFICATE-----[\s\S]*?-----END CERTIFICATE-----/g) ??
    [];
  if (blocks.length === 0) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--${flag} '${path}' holds no PEM certificate (-----BEGIN CERTIFICATE-----)`,
    );
  }
  for (const [i, block] of blocks.entries()) {
    try {
      new X509Certificate(block);
    } catch (err) {
      throw new KvxferError(
        "ERR_CONFIG",
        `--${flag} '${path}': certificate ${i + 1} of ${blocks.length} does not parse: ${(err as Error).message}`,
      );
    }
  }
  return pem;
}

/**
 * An endpoint listening beyond loopback without TLS: anyone who reaches it reads transfer ids,
 * peers and events (gRPC) or metrics. Warned at start-up (a log line and GetStatus lastErrors);
 * the gRPC API takes --tls-cert, the HTTP endpoints no TLS (keep them on a private network).
 */
function warnOpenEndpoints(
  logger: Logger,
  sidecar: Sidecar,
  endpoints: readonly (readonly [flag: string, address: string, tls: boolean])[],
): void {
  for (const [flag, address, tls] of endpoints) {
    if (address === "" || tls) continue;
    const host = address.slice(0, address.lastIndexOf(":")).replace(/^\[|\]$/g, "");
    if (isLoopback(host)) continue;
    const text =
      `${flag} ${address} listens beyond loopback without TLS: anyone who reaches it can read ` +
      (flag === "--grpc"
        ? "transfer ids, peers and events (give --tls-cert, --tls-key and --tls-ca)"
        : "it (keep the port on a private network)");
    logger.warn({ flag, address }, text);
    sidecar.noteError(`WARNING: ${text}`);
  }
}

/** Our own certificate must parse and be valid now: refused at start-up naming its dates. */
function checkOwnCertificate(flag: string, path: string): void {
  let cert: X509Certificate;
  try {
    cert = new X509Certificate(readPem(flag, path));
  } catch (err) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--${flag} '${path}' is not a PEM certificate: ${(err as Error).message}`,
    );
  }
  const when = validityProblem(cert, `--${flag} '${path}'`);
  if (when !== undefined) throw new KvxferError("ERR_CONFIG", when);
}

/** Why a listen failed, as an operator acts on it (by the errno in the error or its message). */
const LISTEN_CAUSES: [RegExp, string][] = [
  [
    /EADDRINUSE/,
    "the port is taken by another process (EADDRINUSE); choose another or stop that process",
  ],
  [
    /EACCES/,
    "not allowed to listen there (EACCES; ports below 1024 need privileges); choose a port above 1023",
  ],
  [
    /EADDRNOTAVAIL/,
    "the host is not an address of this machine (EADDRNOTAVAIL); use one of its addresses, 127.0.0.1 or 0.0.0.0",
  ],
];

/**
 * A listen of `--flag` that failed: one line naming the flag, the address and what to do.
 * Its `cause` is the raw error (logged at debug level).
 */
export class ListenError extends KvxferError {
  constructor(
    readonly flag: string,
    readonly address: string,
    cause: unknown,
  ) {
    const raw = cause instanceof Error ? cause.message : String(cause);
    const code = (cause as { code?: unknown } | undefined)?.code;
    const text = `${typeof code === "string" ? code : ""} ${raw}`;
    const why = LISTEN_CAUSES.find(([re]) => re.test(text))?.[1] ?? `cannot listen: ${raw}`;
    super("ERR_LISTEN", `--${flag} ${address}: ${why}`, { cause });
  }
}

/** Runs `start`; a failure to listen becomes a ListenError naming `--flag` and `address`. */
async function listening<T>(flag: string, address: string, start: () => Promise<T>): Promise<T> {
  try {
    return await start();
  } catch (err) {
    const code = (err as { code?: unknown } | undefined)?.code;
    const msg = err instanceof Error ? err.message : "";
    // Node's listen errors carry `code`; grpc-js folds them into "No address added ... errors: [...]".
    if (
      (typeof code === "string" && /^E(ADDRINUSE|ACCES|ADDRNOTAVAIL)$/.test(code)) ||
      msg.startsWith("No address added")
    )
      throw new ListenError(flag, address, err);
    throw err;
  }
}

/**
 * The side channel as a router or peer must dial it: `--advertise`, else the bound address, which
 * must then name a host (a wildcard bind would send D to 0.0.0.0).
 */
export function advertisedSideChannel(advertise: string, bound: string): string {
  if (advertise !== "") {
    const at = splitHostPort(advertise);
    if (at === undefined || at.port < 1 || isWildcard(at.host))
      throw new KvxferError(
        "ERR_CONFIG",
        `--advertise must be the host:port peers dial, got '${advertise}'`,
      );
    return advertise;
  }
  if (isWildcard(splitHostPort(bound)?.host ?? ""))
    throw new KvxferError(
      "ERR_CONFIG",
      `--bootstrap would tell routers and D to dial ${bound} (the side channel listens on every address): give --advertise HOST:PORT`,
    );
  return bound;
}

function isWildcard(host: string): boolean {
  return host === "" || host === "0.0.0.0" || host === "::";
}

/** Starts a sidecar from settings; returns once it listens on every channel. */
export async function startSidecar(
  s: Record<SettingName, string>,
  logger: Logger,
): Promise<RunningSidecar> {
  const tracing =
    s["otlp-endpoint"] !== ""
      ? await startOtlpTracing(s["otlp-endpoint"], s["engine-id"])
      : undefined;
  const sidecar = new Sidecar({
    ...sidecarOptions(s, logger),
    ...(tracing !== undefined ? { tracer: tracing.tracer } : {}),
  });
  const events = new EventLog({
    capacity: positiveInt("event-log-capacity", s["event-log-capacity"]),
  });
  const metrics = new SidecarMetrics();
  metrics.watchEventLog(events);
  // Read at each scrape: transfers not yet ended, per side (ended ones stay listed for
  // --tombstone-ms in status, so a count of the listing overstates what is live).
  const liveGauge = metrics.registry.gauge(
    "kvxfer_live_transfers",
    "Transfers not yet in a terminal state, by side.",
    { labelNames: ["side"], maxSeries: 2 },
  );
  metrics.registry.onCollect(() => {
    const n = sidecar.liveBySide();
    liveGauge.set({ side: "prefill" }, n.prefill);
    liveGauge.set({ side: "decode" }, n.decode);
  });
  if (s.bootstrap !== "" && s.role === "decode")
    throw new KvxferError(
      "ERR_CONFIG",
      "--bootstrap serves a prefill engine's coordinates: --role prefill or both",
    );
  if (s["notify-zmq"] !== "" && s.role === "prefill")
    throw new KvxferError(
      "ERR_CONFIG",
      "--notify-zmq announces KV_READY, which only a decode side has: --role decode or both",
    );
  const notifier =
    s["notify-zmq"] !== "" ? new ZmqNotifier(s["notify-zmq"], metrics.registry) : undefined;
  notifier?.start(events);
  if ((s["tls-cert"] === "") !== (s["tls-key"] === ""))
    throw new KvxferError("ERR_CONFIG", "--tls-cert and --tls-key go together");
  if (s["tls-ca"] !== "" && s["tls-cert"] === "")
    throw new KvxferError("ERR_CONFIG", "--tls-ca needs --tls-cert and --tls-key");
  // Read (and the CA checked) before anything listens: a TLS mistake stops the start.
  if (s["tls-cert"] !== "") checkOwnCertificate("tls-cert", s["tls-cert"]);
  const tls =
    s["tls-cert"] !== ""
      ? {
          cert: readPem("tls-cert", s["tls-cert"]),
          key: readPem("tls-key", s["tls-key"]),
          ...(s["tls-ca"] !== ""
            ? { ca: readCa("tls-ca", s["tls-ca"]), requireClientCert: true }
            : {}),
        }
      : undefined;
  let api: ApiServer | undefined;
  // Readiness follows the engine: SERVING only while a registered engine's connection is up.
  const engineReady = (): boolean => sidecar.acceptsHandshakes && link.ownerConnected;
  const link = new EngineLinkServer({
    endpoint:
      s["engine-socket"] !== "" ? s["engine-socket"] : defaultEngineEndpoint(s["engine-id"]),
    maxFrameBytes: positiveInt("engine-max-frame-bytes", s["engine-max-frame-bytes"]),
    onMessage: (msg, from) => {
      sidecar.onEngineMessage(msg, (m) => void link.send(from, m), {
        id: from.id,
        isOwner: link.isOwner(from),
        ownerConnected: link.ownerConnected,
        adopt: () => link.adopt(from),
      });
      // Readiness: SERVING once a registration was accepted (and not while draining).
      api?.setServing(engineReady());
    },
    onRefused: (code, message) => sidecar.noteError(`engine frame refused: ${code}: ${message}`),
    onConnectionEnded: (peer) => {
      sidecar.engineConnectionEnded(peer.id);
      // The link marks its owner away after telling us: look once it has.
      setImmediate(() => api?.setServing(engineReady()));
    },
    logger,
  });
  await link.start();
  let metricsServer: MetricsServer | undefined;
  let bootstrap: HttpServer | undefined;
  try {
    await listening("listen", s.listen, () =>
      sidecar.start((msg) => void link.sendToRegistered(msg), events, metrics),
    );
    api = await listening("grpc", s.grpc, () =>
      startApiServer({
        view: sidecar,
        events,
        address: s.grpc,
        logger,
        // Readiness: NOT_SERVING until the engine registers (an engine may have come first).
        serving: engineReady(),
        ...(tls !== undefined ? { tls } : {}),
      }),
    );
    api.setServing(engineReady());
    if (s.metrics !== "")
      metricsServer = await listening("metrics", s.metrics, () =>
        startMetricsServer({
          registry: metrics.registry,
          address: s.metrics,
          // The same answer as gRPC health's (SERVING while a registered engine is connected).
          ready: () => api?.serving === true,
        }),
      );
    if (s.bootstrap !== "")
      bootstrap = await listening("bootstrap", s.bootstrap, () =>
        startBootstrapServer({
          address: s.bootstrap,
          engineId: sidecar.engineId,
          sideChannel: advertisedSideChannel(s.advertise, sidecar.sideChannelAddress),
        }),
      );
    warnOpenEndpoints(logger, sidecar, [
      ["--grpc", s.grpc, tls !== undefined],
      ["--metrics", s.metrics, false],
      ["--bootstrap", s.bootstrap, false],
    ]);
  } catch (err) {
    await metricsServer?.close();
    await api?.close(0);
    await sidecar.close();
    await link.close();
    notifier?.close();
    await tracing?.shutdown(0);
    throw err;
  }
  const apiServer = api;
  let closed = false;
  let closing = "";
  const engineLeaseMs = nonNegativeInt("engine-lease-ms", s["engine-lease-ms"]);
  let goneWith: (why: string) => void = () => {};
  const engineGone = new Promise<string>((resolve) => (goneWith = resolve));
  let awaySince: number | undefined;
  const engineWatch =
    engineLeaseMs > 0
      ? setInterval(() => {
          if (!sidecar.registered || link.ownerConnected || sidecar.draining) {
            awaySince = undefined;
            return;
          }
          awaySince ??= Date.now();
          const why = sidecar.engineFilesGone()
            ? "its connection ended and its KV files were removed"
            : Date.now() - awaySince >= engineLeaseMs
              ? `its connection ended ${engineLeaseMs} ms ago (--engine-lease-ms) and it did not register again`
              : undefined;
          if (why === undefined) return;
          clearInterval(engineWatch);
          sidecar.abandonEngine(why);
          apiServer.setServing(false);
          goneWith(why);
        }, ENGINE_WATCH_MS)
      : undefined;
  engineWatch?.unref();
  return {
    engineGone,
    sidecar,
    link,
    events,
    api: apiServer,
    metrics: metricsServer,
    bootstrap,
    drain: async (deadlineMs) => {
      sidecar.beginDrain();
      apiServer.setServing(false);
      const end = Date.now() + deadlineMs;
      while (sidecar.liveTransfers() > 0 && Date.now() < end)
        await new Promise((r) => setTimeout(r, 50));
      const left = sidecar.liveTransfers();
      if (left > 0) {
        // Peers hear about every transfer this sidecar will not finish, before it closes.
        sidecar.abandonAll();
        await new Promise((r) => setTimeout(r, 100));
      }
      return left;
    },
    close: async () => {
      if (closed) return;
      closed = true;
      clearInterval(engineWatch);
      closing = "gRPC API";
      await apiServer.close(1000);
      closing = "metrics";
      await metricsServer?.close();
      closing = "bootstrap";
      await bootstrap?.close();
      closing = "sidecar (side channel, peers, UCX agents)";
      await sidecar.close();
      closing = "engine link";
      await link.close();
      notifier?.close();
      events.close();
      closing = "OpenTelemetry export";
      await tracing?.shutdown(2000);
      closing = "";
    },
    get closing() {
      return closing;
    },
  };
}

/** How long closing may take after the drain (or SIGINT) before the process exits anyway. */
const CLOSE_DEADLINE_MS = 5000;
/** How often a sidecar with --engine-lease-ms looks whether its absent engine is gone. */
const ENGINE_WATCH_MS = 200;
/** The exit code of a sidecar that stopped because its engine is gone (EX_TEMPFAIL): restart it. */
export const ENGINE_GONE_EXIT = 75;
/** How long a sidecar whose engine is gone waits for its peers to acknowledge the ends. */
const ENGINE_GONE_DRAIN_MS = 2000;

export async function runSidecar(argv: string[]): Promise<number> {
  const settings = resolveSettings(argv);
  const logger = pino({ level: settings["log-level"], base: { pid: process.pid } }, stderrSink());
  // Signals are caught from the start: one during start-up stops the sidecar once it is up
  // (start-up is bounded), so its engine socket is removed like on any other stop.
  let first = true;
  const signal = new Promise<string>((resolve) => {
    const on = (sig: string): void => {
      // A second signal leaves at once, whatever is still closing (the exit hook below
      // still removes the engine socket).
      if (!first) process.exit(1);
      first = false;
      resolve(sig);
    };
    process.on("SIGINT", () => on("SIGINT"));
    process.on("SIGTERM", () => on("SIGTERM"));
  });
  // grpc-js logs to stderr on its own ("E No address added ..."): its lines go through this
  // logger instead; a failed bind is reported once, below, as one line.
  grpc.setLogger({
    error: (m: unknown, ...p: unknown[]) => {
      const msg = format(m, ...p);
      if (msg.startsWith("No address added")) logger.debug({ component: "grpc-js" }, msg);
      else logger.error({ component: "grpc-js" }, msg);
    },
    info: (m: unknown, ...p: unknown[]) => logger.info({ component: "grpc-js" }, format(m, ...p)),
    debug: (m: unknown, ...p: unknown[]) => logger.debug({ component: "grpc-js" }, format(m, ...p)),
  });
  let running: RunningSidecar;
  try {
    running = await startSidecar(settings, logger);
  } catch (err) {
    // A port taken (or not allowed): one line naming the flag and the address, exit 1; the raw
    // error is in the log at debug level. Everything started was closed (engine socket and lock
    // removed) before the error got here.
    if (!(err instanceof ListenError)) throw err;
    logger.debug({ err: err.cause }, "listen failed");
    await new Promise((r) => setTimeout(r, 20));
    process.stderr.write(`kvxfer sidecar: ${err.message}\n`);
    return 1;
  }
  // Whatever ends the process from here (a second signal, the shutdown deadline, an uncaught
  // error), the engine socket and its lock go with it.
  process.once("exit", () => running.link.removeFiles());
  process.stdout.write(
    JSON.stringify({
      event: "ready",
      engineId: running.sidecar.engineId,
      epoch: String(running.sidecar.epoch),
      sideChannel: running.sidecar.sideChannelAddress,
      engineSocket: running.link.endpoint,
      grpc: running.api.address,
      ucx: running.sidecar.ucxStatus(),
      ...(running.metrics !== undefined ? { metrics: running.metrics.address } : {}),
      ...(running.bootstrap !== undefined ? { bootstrap: running.bootstrap.address } : {}),
    }) + "\n",
  );
  const sig = await Promise.race([signal, running.engineGone.then(() => "ENGINE_GONE")]);
  // Stopping is bounded too: the drain, then a few seconds to close everything.
  const drainMs = positiveInt("drain-ms", settings["drain-ms"]);
  setTimeout(() => {
    logger.error("shutdown took too long; exiting");
    process.exit(1);
  }, drainMs + 15_000).unref();
  // SIGTERM drains: health goes NOT_SERVING, new transfers are refused, and
  // in-flight ones get --drain-ms to end (each also has its own deadlines).
  if (sig === "ENGINE_GONE") {
    // Every transfer was ended and its peer told: wait (bounded) for the acknowledgements.
    const left = await running.drain(Math.min(drainMs, ENGINE_GONE_DRAIN_MS));
    logger.warn({ left, exitCode: ENGINE_GONE_EXIT }, "engine gone: stopping for a restart");
  } else if (sig === "SIGTERM") {
    logger.info({ drainMs, live: running.sidecar.liveTransfers() }, "draining");
    const left = await running.drain(drainMs);
    logger.info({ left }, left === 0 ? "drained" : "drain deadline passed");
  } else {
    logger.info({ signal: sig }, "stopping");
  }
  // Closing is bounded on its own: whoever started the sidecar may SIGKILL it soon after the
  // signal (which would leave the engine socket behind); past this the process exits (1) and
  // its exit hook still removes the socket and lock.
  let timer: NodeJS.Timeout | undefined;
  const closedInTime = await Promise.race([
    running.close().then(() => true),
    new Promise<false>((r) => (timer = setTimeout(() => r(false), CLOSE_DEADLINE_MS))),
  ]);
  clearTimeout(timer);
  if (!closedInTime)
    logger.error(
      { closing: running.closing, ms: CLOSE_DEADLINE_MS },
      "stopping took too long; exiting",
    );
  // Let the last log lines reach stderr (bounded: the sink never blocks).
  await new Promise((r) => setTimeout(r, 50));
  if (sig === "ENGINE_GONE") return ENGINE_GONE_EXIT;
  return closedInTime ? 0 : 1;
}
