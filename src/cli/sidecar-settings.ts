/**
 * The settings of `kvxfer sidecar`: every flag with its default and help, and their resolution
 * (flags, then KVXFER_* environment variables, then a JSON config file given by --config, then
 * defaults). Values stay strings here; `sidecar-options.ts` checks and converts them.
 */
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";

import { KvxferError } from "../errors.js";

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
    help: "a silent peer with live transfers is down after this long (and a UCX TCP connection unacknowledged twice this long is given up)",
  },
  "peer-keepalive-ms": {
    type: "string",
    default: "600000",
    help: "heartbeats go on this long after a peer's last transfer, so the next transfer needs no new handshake (the authenticated channel stays up while the peer is in use); 0: only while transfers are live",
  },
  "abort-grace-ms": {
    type: "string",
    default: "2000",
    help: "extra wait past P's registration lease before D reuses blocks of an unacknowledged abort",
  },
  "settle-bound-ms": {
    type: "string",
    default: "960000",
    help: "most time blocks stay held for reads or writes given up on a silent peer, until UCX holds none of them (a partition's old connection may still deliver their bytes when it heals); Linux stops retransmitting after about 925 s",
  },
  "max-transfers": { type: "string", default: "65536", help: "live transfers per side at most" },
  "max-per-peer": {
    type: "string",
    default: "",
    help: "P: registrations one decode engine may keep by PushReg before PrefillDone (default max-transfers / 8)",
  },
  "max-unconfirmed": {
    type: "string",
    default: "",
    help: "P: registrations kept before PrefillDone, every decode engine together, apart from the transfer table; when full the engine holding the most loses its oldest (default max-transfers / 8)",
  },
  "unconfirmed-lease-ms": {
    type: "string",
    default: "5000",
    help: "P: a registration for an id P's engine has not named lives this long unless D's heartbeats renew it",
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
