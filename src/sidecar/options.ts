/**
 * The sidecar's options (what `kvxfer sidecar`'s flags set) and their defaults, resolved once.
 */
import type { Tracer } from "@opentelemetry/api";
import type { Logger } from "pino";

import { KvxferError } from "../errors.js";
import type { ErrorMode } from "../native/index.js";
import { isLoopback, parseAddress, type PeerCredentials } from "../peer/side-channel.js";
import type { Clock } from "./clock.js";
import { DEFAULT_SETTLE_BOUND_MS } from "./context.js";
import type { SidecarRole, TransferMode } from "./view.js";

export interface SidecarOptions {
  engineId: string;
  role: SidecarRole;
  mode: TransferMode;
  /** Side channel "host:port" (port 0: any). */
  listen: string;
  /** UCX transports (UCX_TLS) for every agent; empty: UCX's choice. */
  transports?: string;
  /** UCX net devices, one entry per rank or one for all. */
  netDevices?: readonly string[];
  errorMode?: ErrorMode;
  /** Progress threads spin instead of sleeping on the worker's event fd. */
  busyPoll?: boolean;
  /**
   * Each transfer's trace as OpenTelemetry spans once it has ended on this side (otel.ts);
   * default none.
   */
  tracer?: Tracer;
  /**
   * After any activity, progress threads poll this long (µs) before sleeping. "auto" (the
   * default): AUTO_SPIN_US when the registration's agents (one per rank) have two cores each,
   * else 0: on an oversubscribed host the polling takes the cores the transfers need.
   */
  spinUs?: number | "auto";
  /** P holds finished blocks this long without a heartbeat from D. */
  leaseMs?: number;
  /** A push registration on P lives this long without renewal. */
  regLeaseMs?: number;
  /** D gives up on a transfer after this long. */
  transferTimeoutMs?: number;
  heartbeatMs?: number;
  /** A peer silent this long (while transfers are live) is down. */
  peerTimeoutMs?: number;
  /** Heartbeats go on this long after a peer's last transfer (0: only while transfers are live). */
  peerKeepaliveMs?: number;
  /** Extra wait on D, after P's registration lease, before blocks of an unacknowledged abort are released. */
  abortGraceMs?: number;
  /**
   * Most time blocks stay held for reads or writes abandoned to a silent peer, until UCX holds
   * none of them (default 960 000: Linux gives up retransmitting after about 925 s).
   */
  settleBoundMs?: number;
  handshakeTimeoutMs?: number;
  /** Terminal transfers are remembered this long (duplicates, replays, late requests). */
  tombstoneMs?: number;
  /** Live transfers per side at most. */
  maxTransfers?: number;
  /** P: registrations one decode engine may keep by PushReg before PrefillDone (default maxTransfers / 8). */
  maxPerPeer?: number;
  /** P: registrations kept before PrefillDone, all decode engines together (default maxTransfers / 8). */
  maxUnconfirmed?: number;
  /** P: the lease of a registration before P's engine names its id (default 5 000 ms). */
  unconfirmedLeaseMs?: number;
  /** Notifications of one peer processed per second at most (burst: two seconds' worth). */
  peerMessagesPerSec?: number;
  /**
   * The engine's KV files must be regular files with one link, owned by this process's uid,
   * under this absolute directory, reached without a symbolic link or `..` (default /dev/shm).
   */
  kvDir?: string;
  /** Most bytes one registration may map, all ranks and regions together. */
  maxRegistrationBytes?: number;
  /** Most bytes of KV files mapped at once by this sidecar. */
  maxKvBytes?: number;
  /** Map KV files with every page faulted in (MAP_POPULATE); default false. */
  prefault?: boolean;
  /** Refuse a PrefillDone listing a block a live transfer holds (default false: P may share). */
  exclusivePrefillBlocks?: boolean;
  sweepMs?: number;
  /**
   * Certificate (subject CN = engine id), key and cluster CA for the side channel:
   * peers authenticate each other with mutual TLS before any metadata leaves.
   */
  peerCredentials?: PeerCredentials;
  /** Run without peer credentials on a non-loopback side channel (logged as a warning). */
  insecurePeers?: boolean;
  logger: Logger;
  /** Time and timers (tests pass a manual clock); default the system's. */
  clock?: Clock;
}

/** The options with every default filled in. */
export type ResolvedOptions = Required<
  Omit<
    SidecarOptions,
    "netDevices" | "transports" | "logger" | "peerCredentials" | "clock" | "tracer"
  >
> & {
  netDevices: readonly string[];
  transports: string;
  peerCredentials: PeerCredentials | undefined;
};

export function resolveOptions(options: SidecarOptions): ResolvedOptions {
  return {
    engineId: options.engineId,
    role: options.role,
    mode: options.mode,
    listen: options.listen,
    transports: options.transports ?? "",
    netDevices: options.netDevices ?? [],
    errorMode: options.errorMode ?? "none",
    busyPoll: options.busyPoll ?? false,
    spinUs: options.spinUs ?? "auto",
    leaseMs: options.leaseMs ?? 30_000,
    regLeaseMs: options.regLeaseMs ?? options.leaseMs ?? 30_000,
    transferTimeoutMs: options.transferTimeoutMs ?? 60_000,
    heartbeatMs: options.heartbeatMs ?? 1000,
    peerTimeoutMs: options.peerTimeoutMs ?? 5000,
    peerKeepaliveMs: options.peerKeepaliveMs ?? 600_000,
    abortGraceMs: options.abortGraceMs ?? 2000,
    settleBoundMs: options.settleBoundMs ?? DEFAULT_SETTLE_BOUND_MS,
    handshakeTimeoutMs: options.handshakeTimeoutMs ?? 5000,
    tombstoneMs: options.tombstoneMs ?? 60_000,
    maxTransfers: options.maxTransfers ?? 65_536,
    maxPerPeer: options.maxPerPeer ?? Math.max(1, Math.floor((options.maxTransfers ?? 65_536) / 8)),
    maxUnconfirmed:
      options.maxUnconfirmed ?? Math.max(1, Math.floor((options.maxTransfers ?? 65_536) / 8)),
    unconfirmedLeaseMs: options.unconfirmedLeaseMs ?? 5_000,
    peerMessagesPerSec: options.peerMessagesPerSec ?? 20_000,
    kvDir: options.kvDir ?? "/dev/shm",
    maxRegistrationBytes: options.maxRegistrationBytes ?? Number.MAX_SAFE_INTEGER,
    maxKvBytes: options.maxKvBytes ?? Number.MAX_SAFE_INTEGER,
    prefault: options.prefault ?? false,
    exclusivePrefillBlocks: options.exclusivePrefillBlocks ?? false,
    sweepMs: options.sweepMs ?? 100,
    peerCredentials: options.peerCredentials,
    insecurePeers: options.insecurePeers ?? false,
  };
}

/**
 * Peers without credentials are not authenticated: refused (ERR_CONFIG) when the side channel
 * is reachable beyond this machine, unless --insecure-peers says so knowingly; a warning
 * in the log whenever they are not authenticated.
 */
export function checkPeerExposure(opts: ResolvedOptions, log: Logger): void {
  const { host } = parseAddress(opts.listen);
  if (opts.peerCredentials === undefined) {
    if (!isLoopback(host) && !opts.insecurePeers) {
      throw new KvxferError(
        "ERR_CONFIG",
        `the side channel ${opts.listen} is reachable beyond this machine: give peer ` +
          "credentials (--peer-cert, --peer-key, --peer-ca) or, knowingly, --insecure-peers",
      );
    }
    log.warn(
      { listen: opts.listen },
      "peers are NOT authenticated: any process that reaches the side channel gets this " +
        "sidecar's remote keys (give --peer-cert/--peer-key/--peer-ca; docs/security.md)",
    );
  }
}
