/**
 * The sidecar, a thin facade: its options, the engine's KV registration, dispatch of engine and
 * peer messages to the part that owns them (PrefillSide, DecodeSide, PeerTable), one sweep that
 * runs each part's expiry, heartbeats, and the status view. Every transfer reaches exactly one
 * terminal state per side, within a bound, as one event (lifecycle.ts, docs/protocol.md).
 * Reading order: src/sidecar/README.md.
 */
import { create, equals } from "@bufbuild/protobuf";
import { randomBytes } from "node:crypto";
import {
  closeSync,
  constants,
  fstatSync,
  ftruncateSync,
  openSync,
  realpathSync,
  statSync,
} from "node:fs";
import { availableParallelism } from "node:os";
import type { Tracer } from "@opentelemetry/api";
import type { Logger } from "pino";

import {
  RegisterKvCacheSchema,
  type AllocateKv,
  ReleaseReason,
  SidecarToEngineSchema,
  type EngineToSidecar,
  type ExpectKv,
  type RegisterKvCache,
  type SidecarToEngine,
} from "../gen/kvxfer/v1/engine_pb.js";
import { KvxferError } from "../errors.js";
import type { KvLayout } from "../plan/index.js";
import {
  Agent,
  describeUcx,
  ucxInfo,
  type ErrorMode,
  type Notification,
  type Region,
} from "../native/index.js";
import {
  checkAllocateKv,
  checkEngineMessage,
  checkRegisterKvCache,
  engineIdProblem,
  type RegionSource,
} from "../engine/validate.js";
import { MAX_PEER_MESSAGE_BYTES, agentName } from "../peer/messages.js";
import {
  SideChannelServer,
  checkCredentials,
  isLoopback,
  parseAddress,
  type PeerCredentials,
} from "../peer/side-channel.js";
import { KvAllocations } from "./allocations.js";
import { systemClock, type Clock } from "./clock.js";
import type { EngineMessage, SideContext } from "./context.js";
import { DecodeSide } from "./decode.js";
import { SidecarLifecycle } from "./sidecar-lifecycle.js";
import type { TransferMetrics } from "./metrics.js";
import { PeerTable, type PeerTableHost, type RegisteredKv } from "./peers.js";
import { PrefillSide } from "./prefill.js";
import { isTerminal } from "./lifecycle.js";
import { exportTransferSpans } from "./otel.js";
import { monoUs } from "./trace.js";
import type {
  EventKind,
  SidecarEvent,
  SidecarRole,
  SidecarStatus,
  SidecarView,
  TransferFilter,
  TransferInfo,
  TransferMode,
  TransferSide,
} from "./view.js";

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
  /** Extra wait on D, after P's registration lease, before blocks of an unacknowledged abort are released. */
  abortGraceMs?: number;
  handshakeTimeoutMs?: number;
  /** Terminal transfers are remembered this long (duplicates, replays, late requests). */
  tombstoneMs?: number;
  /** Live transfers per side at most. */
  maxTransfers?: number;
  /** P: transfers one decode engine may create by PushReg before PrefillDone (default maxTransfers / 8). */
  maxPerPeer?: number;
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

/** A KV file mapped for a region: a descriptor of the mapped inode and the bytes it must hold. */
interface KvFile {
  /** Opened read-write: a file that shrank is given its size back (ftruncate), see kvShrunk. */
  readonly fd: number;
  readonly path: string;
  readonly end: number;
  readonly rank: number;
  readonly region: number;
}

/** Where a sidecar sends what its engine must hear. */
export type EngineSender = (msg: SidecarToEngine) => void;

/**
 * The engine link connection a message came from, as far as ownership goes (link.ts): the link
 * belongs to the connection whose registration was accepted, and only the sidecar decides that.
 */
export interface EngineConnection {
  /** The connection's id (stable for its life); allocations are freed when it ends. */
  readonly id?: string;
  /** This connection owns the link. */
  readonly isOwner: boolean;
  /** The owner's connection is up (false: no owner yet, or its connection ended). */
  readonly ownerConnected: boolean;
  /** Makes this connection the owner (called once a registration from it is accepted). */
  adopt(): void;
}
/** Where terminal and peer events go (the event log). */
export interface EventSink {
  append(ev: Omit<SidecarEvent, "seq">): unknown;
}

/** The spin after activity that "auto" gives a registration whose agents have two cores each. */
export const AUTO_SPIN_US = 200;

/** `--spin-us` for a registration of `agents` ranks ("auto": see SidecarOptions.spinUs). */
export function spinFor(
  spinUs: number | "auto",
  agents: number,
  cores = availableParallelism(),
): number {
  if (spinUs !== "auto") return spinUs;
  return agents * 2 <= cores ? AUTO_SPIN_US : 0;
}

/**
 * The SidecarToEngine carrying KvReady that `create` builds, written out: D sends one on every
 * transfer's critical path, and `create` walks the schema each time (20-27 µs cold here, the
 * literal a few).
 */
export function kvReadyMessage(transferId: string): SidecarToEngine {
  return {
    $typeName: "kvxfer.v1.SidecarToEngine",
    msg: { case: "kvReady", value: { $typeName: "kvxfer.v1.KvReady", transferId } },
  };
}

export class Sidecar implements SidecarView {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly role: SidecarRole;
  readonly mode: TransferMode;
  readonly startedMs = Date.now();
  private readonly opts: Required<
    Omit<
      SidecarOptions,
      "netDevices" | "transports" | "logger" | "peerCredentials" | "clock" | "tracer"
    >
  > & {
    netDevices: readonly string[];
    transports: string;
    peerCredentials: PeerCredentials | undefined;
  };
  private readonly log: Logger;
  private engineSend: EngineSender = () => {};
  /** The sender of the engine message being handled, while it is handled. */
  private replyTo: EngineSender | undefined;
  private events: EventSink = { append: () => undefined };
  private metrics: TransferMetrics | undefined;
  private readonly clock: Clock;
  private readonly tracer: Tracer | undefined;

  /** The engine's KV cache once registered: layout, one agent per rank, its regions. */
  private kv: RegisteredKv | undefined;
  /** The accepted registration, and the identity (device, inode) of each file it mapped. */
  private registration: { msg: RegisterKvCache; files: string[] } | undefined;
  /** The KV directory with symbolic links resolved (the operator's setting may name a link). */
  private readonly kvDirResolved: string;
  /**
   * Bytes of KV files mapped now (checked against maxKvBytes). A sidecar holds one registration
   * today; code that drops or replaces one (re-registration) must subtract its bytes.
   */
  private mappedBytes = 0;
  /** The KV files mapped, watched for shrinking (openKvFiles). */
  private kvFiles: KvFile[] = [];
  /** Why the registered KV is broken (a file shrank after registration), once it is. */
  private kvBroken: string | undefined;
  /** Regions allocated for the engine (AllocateKv) that no registration took yet. */
  private readonly allocations = new KvAllocations();
  private readonly side: SideChannelServer;
  private sideChannel = "";

  private readonly peers: PeerTable;
  private readonly prefill: PrefillSide;
  private readonly decode: DecodeSide;

  private sweepTimer: NodeJS.Timeout | undefined;
  private heartbeatTimer: NodeJS.Timeout | undefined;
  /** UNREGISTERED, SERVING, DRAINING, CLOSED (sidecar-lifecycle.ts). */
  private readonly life = new SidecarLifecycle();
  private bytesMoved = 0;
  private transfersMoved = 0;
  private readonly lastErrors: string[] = [];

  constructor(options: SidecarOptions) {
    const idProblem = engineIdProblem(options.engineId, "--engine-id");
    if (idProblem !== undefined) throw new KvxferError("ERR_INVALID_ARGUMENT", idProblem);
    this.engineId = options.engineId;
    this.role = options.role;
    this.mode = options.mode;
    // A random non-zero epoch: a restarted sidecar is a new peer.
    this.epoch = randomBytes(8).readBigUInt64BE() | 1n;
    this.log = options.logger.child({ component: "sidecar", engineId: options.engineId });
    this.clock = options.clock ?? systemClock;
    this.tracer = options.tracer;
    this.opts = {
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
      abortGraceMs: options.abortGraceMs ?? 2000,
      handshakeTimeoutMs: options.handshakeTimeoutMs ?? 5000,
      tombstoneMs: options.tombstoneMs ?? 60_000,
      maxTransfers: options.maxTransfers ?? 65_536,
      maxPerPeer:
        options.maxPerPeer ?? Math.max(1, Math.floor((options.maxTransfers ?? 65_536) / 8)),
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
    try {
      this.kvDirResolved = realpathSync(this.opts.kvDir);
    } catch {
      this.kvDirResolved = this.opts.kvDir;
    }
    if (options.peerCredentials !== undefined)
      checkCredentials(options.peerCredentials, options.engineId);
    this.peers = new PeerTable(this.peerHost(), this.opts);
    const ctx = this.sideContext();
    this.prefill = new PrefillSide(ctx);
    this.decode = new DecodeSide(ctx, (address) => this.peers.resolve(address));
    this.side = new SideChannelServer(
      (req, identity) => this.peers.onHandshake(req, identity),
      this.log.child({ component: "side-channel" }),
      (code, message) => this.noteError(`handshake refused: ${code}: ${message}`),
      options.peerCredentials,
    );
  }

  /** Binds the side channel and starts the sweep and heartbeats. */
  async start(
    engineSend: EngineSender,
    events: EventSink,
    metrics?: TransferMetrics,
  ): Promise<string> {
    this.engineSend = engineSend;
    this.events = events;
    this.metrics = metrics;
    const { host } = parseAddress(this.opts.listen);
    if (this.opts.peerCredentials === undefined) {
      if (!isLoopback(host) && !this.opts.insecurePeers) {
        throw new KvxferError(
          "ERR_CONFIG",
          `the side channel ${this.opts.listen} is reachable beyond this machine: give peer ` +
            "credentials (--peer-cert, --peer-key, --peer-ca) or, knowingly, --insecure-peers",
        );
      }
      this.log.warn(
        { listen: this.opts.listen },
        "peers are NOT authenticated: any process that reaches the side channel gets this " +
          "sidecar's remote keys (give --peer-cert/--peer-key/--peer-ca; docs/security.md)",
      );
    }
    this.sideChannel = await this.side.bind(this.opts.listen);
    this.sweepTimer = setInterval(() => this.sweep(), this.opts.sweepMs);
    this.heartbeatTimer = setInterval(() => this.sendHeartbeats(), this.opts.heartbeatMs);
    this.log.info(
      {
        sideChannel: this.sideChannel,
        epoch: String(this.epoch),
        role: this.role,
        mode: this.mode,
        ucx: describeUcx(ucxInfo(this.opts.transports)),
      },
      "sidecar started",
    );
    return this.sideChannel;
  }

  get sideChannelAddress(): string {
    return this.sideChannel;
  }

  /** Whether an engine's registration was accepted (it may have left since). */
  get registered(): boolean {
    return this.kv !== undefined;
  }

  /**
   * Whether the registered engine removed its KV: every file of the accepted registration is
   * gone from disk or replaced (the simulated engine and the vLLM connector remove theirs when
   * they end). A segment shows nothing here: false.
   */
  engineFilesGone(): boolean {
    const cur = this.registration;
    if (cur === undefined || cur.files.length === 0) return false;
    if (cur.files.some((id) => id === "" || id.startsWith("segment:"))) return false;
    const now = Sidecar.fileIdentities(cur.msg);
    return cur.files.every((id, i) => now[i] !== id);
  }

  /**
   * The registered engine is gone for good (issue 35): no new transfers, and every live one
   * fails now, each peer told (as at the drain's deadline), so peers recompute or free at once.
   * The caller then stops this sidecar: a new engine's memory needs a new epoch, since peers
   * hold remote keys for the old one and a late one-sided write cannot be recalled from a
   * process that keeps living.
   */
  abandonEngine(why: string): void {
    this.log.warn(
      { why, live: this.liveTransfers() },
      "engine gone: ending every transfer it held, telling peers",
    );
    this.noteError(`engine gone: ${why}`);
    this.beginDrain();
    this.abandonAll();
  }

  /** Live (non-terminal) transfers per side. */
  liveBySide(): { prefill: number; decode: number } {
    return { prefill: this.prefill.live(), decode: this.decode.live() };
  }

  /**
   * SIGTERM: new transfers are refused from now on, and what will not happen is told to the
   * peers at once (P: registrations waiting for a PrefillDone it will refuse).
   */
  beginDrain(): void {
    if (!this.life.on("DRAIN")) return;
    this.prefill.drain();
  }

  /** The drain's deadline passed: the transfers left fail now, each peer told (before close). */
  abandonAll(): void {
    this.prefill.abandon();
    this.decode.abandon();
  }

  /** Draining: no new transfers or handshakes (beginDrain). */
  get draining(): boolean {
    return this.life.draining;
  }

  /** Live (non-terminal) transfers on both sides. */
  liveTransfers(): number {
    return this.prefill.live() + this.decode.live();
  }

  async close(): Promise<void> {
    if (!this.life.on("CLOSE")) return;
    clearInterval(this.sweepTimer);
    clearInterval(this.heartbeatTimer);
    await this.side.close();
    this.peers.close();
    this.allocations.freeAll();
    for (const f of this.kvFiles.splice(0)) closeSync(f.fd);
    if (this.kv !== undefined) {
      // Every rank's shutdown starts at once: a stop waits out one deadline, not one per rank.
      for (const a of this.kv.agents) a.beginClose();
      for (const a of this.kv.agents) a.close();
      // Transfers ending during the stop notify no one (PeerTable.send finds no agent).
      this.kv = { ...this.kv, agents: [] };
    }
  }

  /**
   * True once the engine's KV cache is registered and the sidecar is not draining: it can
   * answer peer handshakes (before, they get ERR_NOT_READY). gRPC health follows this.
   */
  get acceptsHandshakes(): boolean {
    return this.life.serving;
  }

  // --- the engine link ---------------------------------------------------------

  /**
   * Handles one message from the engine; never throws. `reply` reaches the connection that sent
   * it: refusals and the answer to a registration go there (an engine that is not, or no longer,
   * registered still hears why its message was refused), everything else to the registered engine.
   */
  onEngineMessage(msg: EngineToSidecar, reply?: EngineSender, conn?: EngineConnection): void {
    const receivedUs = monoUs();
    this.replyTo = reply;
    try {
      if (msg.msg.case === "register") {
        this.onRegister(msg.msg.value, conn);
        return;
      }
      if (msg.msg.case === "allocate") {
        this.onAllocate(msg.msg.value, conn);
        return;
      }
      // One place checks engine messages' fields; a problem costs only the message.
      const problem = checkEngineMessage(msg, this.kv?.layout);
      if (problem !== undefined) {
        this.refuse(problem.transferId, problem.code, problem.message);
        return;
      }
      if (this.life.draining && (msg.msg.case === "prefillDone" || msg.msg.case === "expectKv")) {
        // Blocks of a refused PrefillDone go straight back: no one will read them.
        if (msg.msg.case === "prefillDone") {
          this.send({
            case: "releaseBlocks",
            value: {
              transferId: msg.msg.value.transferId,
              blockIds: msg.msg.value.blockIds,
              reason: ReleaseReason.FAILED,
            },
          });
        }
        if (msg.msg.case === "expectKv") this.tellSourceDraining(msg.msg.value);
        this.refuse(
          msg.msg.value.transferId,
          "ERR_DRAINING",
          "the sidecar is draining (SIGTERM): no new transfers",
        );
        return;
      }
      switch (msg.msg.case) {
        case "prefillDone":
          if (this.role === "decode")
            return this.refuse(
              msg.msg.value.transferId,
              "ERR_WRONG_ROLE",
              "PrefillDone sent to a decode sidecar",
            );
          this.prefill.prefillDone(msg.msg.value, receivedUs);
          break;
        case "expectKv":
          if (this.role === "prefill")
            return this.refuse(
              msg.msg.value.transferId,
              "ERR_WRONG_ROLE",
              "ExpectKv sent to a prefill sidecar",
            );
          // Pull when configured, or (auto) when the engine names P's blocks.
          this.decode.expectKv(
            msg.msg.value,
            this.mode === "pull" || (this.mode === "auto" && msg.msg.value.hasSourceBlockIds),
            receivedUs,
          );
          break;
        case "abort":
          this.onEngineAbort(msg.msg.value.transferId);
          break;
        default:
          this.refuse("", "ERR_MALFORMED", "engine message carries no body");
      }
    } catch (err) {
      const e = KvxferError.from(err);
      this.noteError(`engine message: ${e.code} ${e.message}`);
      this.log.error({ err }, "engine message failed");
    } finally {
      this.replyTo = undefined;
    }
  }

  private send(msg: EngineMessage): void {
    this.engineSend(
      msg.case === "kvReady"
        ? kvReadyMessage(msg.value.transferId ?? "")
        : create(SidecarToEngineSchema, { msg }),
    );
  }

  private refuse(transferId: string, code: string, message: string): void {
    this.noteError(`${code}: ${message}`);
    this.log.warn({ transferId, code }, message);
    this.answer({ case: "refused", value: { transferId, code, message } });
  }

  /** To the sender of the engine message being handled (else the registered engine). */
  private answer(msg: EngineMessage): void {
    (this.replyTo ?? this.engineSend)(create(SidecarToEngineSchema, { msg }));
  }

  /** Keeps the last errors for GetStatus (bounded). */
  noteError(text: string): void {
    this.lastErrors.push(`${new Date().toISOString()} ${text}`);
    if (this.lastErrors.length > 20) this.lastErrors.shift();
  }

  /**
   * A descriptor of every KV file mapped (the same inode, by device and inode), with the bytes
   * its region needs: how kvShrunk sees a file shrink under the mapping. Best effort: a file
   * that cannot be opened again is not checked.
   */
  private openKvFiles(reg: RegisterKvCache, layout: KvLayout): KvFile[] {
    const out: KvFile[] = [];
    for (const rk of reg.ranks)
      for (const [g, f] of rk.regions.entries()) {
        if (f.segment !== undefined) continue; // a SysV segment cannot shrink
        try {
          const fd = openSync(f.path, constants.O_RDWR | constants.O_NOFOLLOW);
          out.push({
            fd,
            path: f.path,
            end: Number(f.offset) + layout.regionBytes[g]!,
            rank: rk.rank,
            region: g,
          });
        } catch (err) {
          this.log.warn({ err, path: f.path }, "cannot reopen a KV file to watch its size");
        }
      }
    return out;
  }

  /** Why a mapped KV file no longer covers its region, or undefined (one fstat per file). */
  private kvShrunk(): string | undefined {
    for (const f of this.kvFiles) {
      let size: number;
      try {
        size = fstatSync(f.fd).size;
      } catch {
        continue;
      }
      if (size >= f.end) continue;
      // What the file held is gone, and every page past its end faults (SIGBUS) when touched,
      // by us or by a peer's read. Its size is given back at once (the lost pages read as
      // zeros, they fault no more), and the KV stays broken: every transfer fails from now on.
      this.kvBroken ??=
        `rank ${f.rank} region ${f.region}: KV file '${f.path}' shrank to ${size} bytes ` +
        `after registration; the region needs ${f.end} (restart the sidecar and the engine)`;
      try {
        ftruncateSync(f.fd, f.end);
      } catch (err) {
        this.log.error({ err, path: f.path }, "cannot give a shrunk KV file its size back");
      }
    }
    return this.kvBroken;
  }

  /**
   * (device, inode) of every file of a registration, in order ("" for a file stat cannot see);
   * a segment's id for a segment.
   */
  private static fileIdentities(reg: RegisterKvCache): string[] {
    return reg.ranks.flatMap((rk) =>
      rk.regions.map((f) => {
        if (f.segment !== undefined) return `segment:${f.segment}`;
        // A CUDA IPC handle names one allocation of a live process (the open mapping keeps it).
        if (f.cudaIpcHandle.length > 0) {
          return `cuda:${f.cudaDevice}:${Buffer.from(f.cudaIpcHandle).toString("hex")}`;
        }
        try {
          const st = statSync(f.path, { bigint: true });
          return `${st.dev}:${st.ino}`;
        } catch {
          return "";
        }
      }),
    );
  }

  /**
   * Whether `reg` describes exactly the KV cache already registered: the same message (engine
   * id, layout, files, offsets, lengths) and the same files on disk (a file recreated at the
   * same path is another file).
   */
  private isSameCache(reg: RegisterKvCache): boolean {
    const cur = this.registration;
    if (cur === undefined || !equals(RegisterKvCacheSchema, cur.msg, reg)) return false;
    const ids = Sidecar.fileIdentities(reg);
    return (
      ids.length === cur.files.length && ids.every((id, i) => id !== "" && id === cur.files[i])
    );
  }

  private onRegister(reg: RegisterKvCache, conn?: EngineConnection): void {
    const fail = (error: string): void => {
      this.noteError(`register: ${error}`);
      this.log.warn({ error }, "engine registration refused");
      this.answer({
        case: "registered",
        value: { ok: false, error, sideChannel: this.sideChannel, epoch: this.epoch },
      });
    };
    if (this.kv !== undefined) {
      if (conn === undefined || conn.isOwner)
        return fail("ERR_ALREADY_REGISTERED: the KV cache is already registered");
      if (conn.ownerConnected) {
        this.log.warn("a registration from a second engine connection refused: the link is taken");
        return fail(
          "ERR_ALREADY_REGISTERED: another live connection owns this engine link (one engine per sidecar)",
        );
      }
      if (!this.isSameCache(reg)) {
        return fail(
          "ERR_ALREADY_REGISTERED: the engine that registered is gone, but this registration names " +
            "other memory; a new engine process needs a new sidecar (new epoch): with " +
            "--engine-lease-ms this sidecar stops by itself once the old engine is provably gone " +
            "(its KV files removed, or its connection gone that long), else restart it",
        );
      }
      // The owner's connection ended and the same engine (same files) registers again from a
      // new connection: it reconnected. It takes the link back; what was held for it follows
      // the answer.
      this.log.warn(
        "the engine reconnected and registered again: link handed to its new connection",
      );
      this.answer({
        case: "registered",
        value: { ok: true, error: "", sideChannel: this.sideChannel, epoch: this.epoch },
      });
      conn.adopt();
      return;
    }
    const checked = checkRegisterKvCache(reg);
    if (!checked.ok) return fail(`${checked.problem.code}: ${checked.problem.message}`);
    const { layout, ranks } = checked.cache;
    if (checked.cache.engineId !== this.engineId) {
      return fail(
        `ERR_BAD_ENGINE_ID: engine id '${checked.cache.engineId}' is not this sidecar's '${this.engineId}'`,
      );
    }
    // What this registration maps: every region of every rank (the engine's files are
    // checked, and mapped, only if the total fits both caps).
    const bytes = layout.tpSize * layout.regionBytes.reduce((a, b) => a + b, 0);
    if (bytes > this.opts.maxRegistrationBytes) {
      return fail(
        `ERR_REGION_TOO_LARGE: the registration maps ${bytes} bytes (${ranks.length} ranks x ` +
          `${layout.regionBytes.length} regions), more than --max-registration-bytes ${this.opts.maxRegistrationBytes}`,
      );
    }
    if (this.mappedBytes + bytes > this.opts.maxKvBytes) {
      return fail(
        `ERR_REGION_TOO_LARGE: the registration maps ${bytes} bytes; with the ${this.mappedBytes} ` +
          `already mapped that is more than --max-kv-bytes ${this.opts.maxKvBytes}`,
      );
    }
    // A rank whose regions this sidecar allocated (AllocateKv) registers them by segment id,
    // with the agent that allocated them; every other rank gets a new agent.
    const agents: Agent[] = [];
    const created: Agent[] = [];
    const regions: Region[][] = [];
    const owned: number[] = [];
    try {
      for (const rk of ranks) {
        const own = this.allocations.get(rk.rank);
        const usesOwn =
          own !== undefined &&
          rk.regions.some((f) => own.regions.some((r) => r.segment === f.segment));
        if (usesOwn && own.tpSize !== layout.tpSize) {
          throw new KvxferError(
            "ERR_BAD_REGIONS",
            `rank ${rk.rank}: its regions were allocated for tp_size ${own.tpSize}, the layout has ${layout.tpSize}`,
          );
        }
        const agent = usesOwn ? own.agent : this.newAgent(rk.rank, ranks.length);
        if (usesOwn) owned.push(rk.rank);
        else created.push(agent);
        agents.push(agent);
        regions.push(
          rk.regions.map((f, i) =>
            this.regionOf(agent, rk.rank, i, f, layout.regionBytes[i]!, usesOwn ? own : undefined),
          ),
        );
      }
    } catch (err) {
      for (const a of created) a.close();
      const e = KvxferError.from(err);
      return fail(`${e.code}: ${e.message}`);
    }
    for (const [i, agent] of agents.entries()) {
      const rank = ranks[i]!.rank;
      agent.on("notifications", (batch) => this.onNotifications(rank, batch));
      agent.on("endpointFailed", (ep, code) => this.peers.endpointFailed(ep, code));
      agent.on("notificationDropped", (peer, bytes) =>
        this.noteError(
          `peer message from '${peer.slice(0, 200)}' refused: ERR_TOO_LARGE (${bytes} bytes)`,
        ),
      );
    }
    // The registration owns what it uses; what it does not use is freed.
    for (const rank of owned) this.allocations.take(rank);
    this.allocations.freeAll();
    this.kvFiles = this.openKvFiles(reg, layout);
    this.kv = { layout, agents, regions, shrunk: () => this.kvShrunk() };
    this.life.on("REGISTERED");
    this.mappedBytes += bytes;
    this.registration = { msg: reg, files: Sidecar.fileIdentities(reg) };
    conn?.adopt();
    this.log.info({ tp: layout.tpSize, regions: layout.regionBytes.length }, "KV cache registered");
    this.answer({
      case: "registered",
      value: { ok: true, error: "", sideChannel: this.sideChannel, epoch: this.epoch },
    });
  }

  /** A new agent for `rank` of `ranks`. */
  private newAgent(rank: number, ranks: number): Agent {
    const netDevices = this.opts.netDevices[rank] ?? this.opts.netDevices[0];
    return new Agent({
      name: agentName(this.engineId, this.epoch, rank),
      ...(this.opts.transports !== "" ? { transports: this.opts.transports } : {}),
      ...(netDevices !== undefined ? { netDevices } : {}),
      maxNotificationBytes: MAX_PEER_MESSAGE_BYTES,
      busyPoll: this.opts.busyPoll,
      spinUs: spinFor(this.opts.spinUs, ranks),
    });
  }

  /**
   * Region `g` of `rank` as a registration names it: a file under --kv-dir; a segment this
   * sidecar allocated for exactly that rank and region (`own`); or a segment it did not allocate
   * (one a previous sidecar allocated, named again by an engine that outlived it), attached and
   * registered like a file: owner-only and this user's, or refused.
   */
  private regionOf(
    agent: Agent,
    rank: number,
    g: number,
    f: RegionSource,
    need: number,
    own: { regions: readonly Region[] } | undefined,
  ): Region {
    const where = `rank ${rank} region ${g}`;
    if (f.cudaIpc !== undefined) {
      // The engine's GPU KV, registered in place (placement `device`, docs/gpu.md).
      try {
        return agent.openCudaIpc(f.cudaIpc.handle, {
          device: f.cudaIpc.device,
          offset: f.offset,
          length: need,
        });
      } catch (err) {
        const e = KvxferError.from(err);
        throw new KvxferError(e.code, `${where}: ${e.message}`);
      }
    }
    if (f.segment === undefined) {
      if (own !== undefined) {
        throw new KvxferError(
          "ERR_BAD_REGIONS",
          `${where}: a file, where the rank's other regions are the segments allocated for it ` +
            "(register every region of an allocated rank by its segment)",
        );
      }
      try {
        return agent.mapFile(f.path, {
          offset: f.offset,
          length: need,
          // The directory as configured, or as resolved when the engine names it so
          // (e.g. /dev/shm a link to /run/shm): below it nothing is followed.
          confineDir: f.path.startsWith(this.kvDirResolved + "/")
            ? this.kvDirResolved
            : this.opts.kvDir,
          populate: this.opts.prefault,
        });
      } catch (err) {
        const e = KvxferError.from(err);
        const hint = e.code.startsWith("ERR_REGION_") ? ` (--kv-dir ${this.opts.kvDir})` : "";
        throw new KvxferError(e.code, `${where}: ${e.message}${hint}`);
      }
    }
    if (own !== undefined) {
      const r = own.regions[g];
      if (r === undefined || r.segment !== f.segment) {
        throw new KvxferError(
          "ERR_BAD_REGIONS",
          `${where}: segment ${f.segment} is not the one allocated for it (${r?.segment ?? "none"})`,
        );
      }
      if (r.length < need) {
        throw new KvxferError(
          "ERR_BAD_REGIONS",
          `${where}: segment ${f.segment} has ${r.length} bytes, the region ${need}`,
        );
      }
      return r;
    }
    try {
      return agent.attachSegment(f.segment, need);
    } catch (err) {
      const e = KvxferError.from(err);
      throw new KvxferError(e.code, `${where}: ${e.message}`);
    }
  }

  /**
   * AllocateKv: one rank's regions as SysV segments UCX allocated (allocations.ts), answered
   * with their ids (Allocated). Refused once a registration was accepted, and beyond the caps.
   */
  private onAllocate(msg: AllocateKv, conn?: EngineConnection): void {
    const answer = (ok: boolean, error: string, segments: number[] = []): void =>
      this.answer({ case: "allocated", value: { rank: msg.rank, ok, error, segments } });
    const fail = (error: string): void => {
      this.noteError(`allocate: ${error}`);
      this.log.warn({ rank: msg.rank, error }, "KV allocation refused");
      answer(false, error);
    };
    if (this.kv !== undefined) {
      return fail(
        "ERR_ALREADY_REGISTERED: the KV cache is already registered (allocate before registering)",
      );
    }
    const problem = checkAllocateKv(msg);
    if (problem !== undefined) return fail(`${problem.code}: ${problem.message}`);
    const lengths = msg.lengths.map(Number);
    const bytes = lengths.reduce((a, b) => a + b, 0);
    const others = this.allocations.bytes - (this.allocations.get(msg.rank)?.bytes ?? 0);
    if (others + bytes > this.opts.maxRegistrationBytes) {
      return fail(
        `ERR_REGION_TOO_LARGE: allocating ${bytes} bytes for rank ${msg.rank} (${others} already ` +
          `allocated) is more than --max-registration-bytes ${this.opts.maxRegistrationBytes}`,
      );
    }
    if (this.mappedBytes + others + bytes > this.opts.maxKvBytes) {
      return fail(
        `ERR_REGION_TOO_LARGE: allocating ${bytes} bytes for rank ${msg.rank}; with the ` +
          `${this.mappedBytes + others} already mapped or allocated that is more than --max-kv-bytes ${this.opts.maxKvBytes}`,
      );
    }
    try {
      const a = this.allocations.allocate(
        msg.rank,
        msg.tpSize,
        lengths,
        conn?.id ?? "",
        () => this.newAgent(msg.rank, msg.tpSize),
        this.opts.prefault,
      );
      const segments = a.regions.map((r) => r.segment!);
      this.log.info({ rank: msg.rank, bytes, segments }, "KV regions allocated");
      answer(true, "", segments);
    } catch (err) {
      const e = KvxferError.from(err);
      fail(`${e.code}: rank ${msg.rank}: ${e.message}`);
    }
  }

  /** The engine link connection `id` ended: what it allocated and did not register is freed. */
  engineConnectionEnded(id: string): void {
    const n = this.allocations.freeConnection(id);
    if (n > 0)
      this.log.info({ ranks: n }, "unregistered KV allocations freed: their connection ended");
  }

  // --- the parts' contexts -----------------------------------------------------------

  /** What PrefillSide and DecodeSide may do: the narrow context (context.ts). */
  private sideContext(): SideContext {
    return {
      clock: this.clock,
      settings: this.opts,
      log: this.log,
      kv: () => this.kv,
      toEngine: (msg) => this.send(msg),
      refuse: (transferId, code, message) => this.refuse(transferId, code, message),
      toPeer: (peer, body) => this.peers.send(peer, body),
      seal: (peer, body) => this.peers.seal(peer, body),
      emit: (kind, transferId, peer, side, reason, bytes, mode) =>
        this.emit(kind, transferId, peer, side, reason, bytes, mode),
      moved: (bytes) => {
        this.bytesMoved += bytes;
        this.transfersMoved++;
      },
      noteError: (text) => this.noteError(text),
      metrics: () => this.metrics,
    };
  }

  /**
   * D refuses an ExpectKv while draining: P may hold the blocks for it (prefill done, waiting for
   * our read or registration). Told now, with the transfer's token, P frees them at once instead
   * of at its lease.
   */
  private tellSourceDraining(m: ExpectKv): void {
    if (m.source === "") return;
    this.peers
      .resolve(m.source)
      .then((peer) =>
        this.peers.send(peer, {
          case: "failed",
          value: {
            transferId: m.transferId,
            code: "ERR_DRAINING",
            message: "the decode sidecar is stopping",
            token: m.token,
          },
        }),
      )
      .catch((err: unknown) =>
        this.log.debug({ err, transferId: m.transferId }, "cannot tell P about a drain refusal"),
      );
  }

  /** What the peer table needs of this sidecar. */
  private peerHost(): PeerTableHost {
    return {
      engineId: this.engineId,
      epoch: this.epoch,
      role: this.role,
      clock: this.clock,
      log: this.log,
      sideChannel: () => this.sideChannel,
      kv: () => this.kv,
      notAccepting: () =>
        this.kv === undefined
          ? { code: "ERR_NOT_READY", message: "the engine has not registered its KV cache" }
          : this.life.draining
            ? { code: "ERR_DRAINING", message: "the sidecar is draining" }
            : undefined,
      authenticated: () => this.side.authenticated,
      emit: (kind, peer, reason) => this.emit(kind, "", peer, "", reason, 0, ""),
      noteError: (text) => this.noteError(text),
      peerDown: (peer, why) => {
        this.decode.peerDown(peer, why);
        this.prefill.peerDown(peer);
      },
      busyWith: (peer) => this.decode.readingFrom(peer) || this.prefill.writingTo(peer),
      liveWith: (peer) => this.decode.liveWith(peer) || this.prefill.liveWith(peer),
    };
  }

  // --- dispatch ----------------------------------------------------------------------

  private onEngineAbort(transferId: string): void {
    if (!this.decode.has(transferId) && !this.prefill.has(transferId)) {
      // P's engine may give up on a push before D registers: D's registration is refused then.
      if (this.role !== "decode") this.prefill.giveUp(transferId);
      return this.refuse(transferId, "ERR_UNKNOWN_TRANSFER", `no transfer '${transferId}'`);
    }
    this.decode.abort(transferId);
    this.prefill.abort(transferId);
  }

  /** Peer notifications that arrived at our agent `rank`: checked, then handed to their side. */
  private onNotifications(rank: number, batch: Notification[]): void {
    const now = this.clock.now();
    for (const n of batch) {
      const v = this.peers.verify(n);
      if (v === undefined) continue;
      const { peer, body: b } = v;
      // A peer's share of our work: past its budget its messages go unprocessed (O(1)). A
      // heartbeat costs by the ids it names (each is a lookup), one message per 64.
      const cost = b.case === "heartbeat" ? 1 + Math.floor(b.value.transferIds.length / 64) : 1;
      if (!peer.budget.take(now, this.opts.peerMessagesPerSec, cost)) continue;
      switch (b.case) {
        case "pushReg":
          if (this.role === "decode") {
            this.peers.send(peer, {
              case: "failed",
              value: {
                transferId: b.value.transferId,
                code: "ERR_WRONG_ROLE",
                message: "this sidecar does not prefill",
              },
            });
          } else {
            this.prefill.pushReg(peer, b.value, n.receivedUs);
          }
          break;
        case "xferDone":
          this.decode.xferDone(peer, v.fromRank, rank, b.value, n);
          break;
        case "readDone":
          this.prefill.readDone(peer, b.value.transferId, Number(b.value.bytes), b.value.token, n);
          break;
        case "readAck":
          this.decode.readAck(peer, b.value.transferId, b.value.held, b.value.unknown, n);
          break;
        case "heartbeat":
          this.prefill.renewLeases(peer, b.value.transferIds);
          break;
        case "abort":
          this.prefill.peerAbort(peer, b.value.transferId, b.value.token);
          break;
        case "abortAck":
          this.decode.abortAck(peer, b.value.transferId);
          break;
        case "failed":
          if (!this.decode.peerFailed(peer, b.value.transferId, b.value.code, b.value.message))
            this.prefill.peerFailed(peer, b.value.transferId, b.value.code, b.value.token);
          break;
      }
    }
  }

  /** One heartbeat per peer with live transfers, naming the ones whose lease it renews. */
  private sendHeartbeats(): void {
    const byPeer = this.decode.heartbeatIds(this.clock.now());
    for (const peer of this.prefill.livePeers()) if (!byPeer.has(peer)) byPeer.set(peer, []);
    for (const [peer, ids] of byPeer)
      this.peers.send(peer, { case: "heartbeat", value: { transferIds: ids } });
  }

  /** Every part's expiry; deadlines are not ordered, so each visits its whole table. */
  private sweep(): void {
    const now = this.clock.now();
    // A KV file that shrank is found within one sweep, even with no transfer starting: its size
    // is given back (no fault) and what P holds for a pull fails (D hears "not held").
    const wasBroken = this.kvBroken;
    if (this.kvFiles.length > 0 && this.kvShrunk() !== undefined && wasBroken === undefined) {
      this.noteError(`ERR_REGION_CHANGED: ${this.kvBroken!}`);
      this.log.error({ problem: this.kvBroken }, "a KV file shrank under the sidecar");
      this.prefill.failHeld("ERR_REGION_CHANGED");
    }
    this.prefill.expire(now);
    this.decode.expire(now);
    if (this.metrics !== undefined) {
      this.metrics.setQueueDepth("prefill_live", this.prefill.live());
      this.metrics.setQueueDepth("decode_live", this.decode.live());
      this.metrics.setQueueDepth(
        "agents_inflight",
        (this.kv?.agents ?? []).reduce((n, a) => n + a.inflight, 0),
      );
    }
    this.peers.expire(now);
    for (const [engineId, n] of this.peers.overBudget())
      this.noteError(
        `${n} notifications from '${engineId}' dropped: over ${this.opts.peerMessagesPerSec}/s (ERR_OVERLOADED)`,
      );
  }

  private emit(
    kind: EventKind,
    transferId: string,
    peer: string,
    side: TransferSide | "",
    reason: string,
    bytes: number,
    mode: string,
  ): void {
    this.events.append({
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
        const info = (side === "prefill" ? this.prefill : this.decode).infoOf(transferId);
        try {
          if (info !== undefined) exportTransferSpans(tracer, this.engineId, info);
        } catch (err) {
          this.log.warn({ err, transferId }, "cannot export the transfer's spans");
        }
      });
    }
  }

  // --- SidecarView -------------------------------------------------------------------

  status(): SidecarStatus {
    const byState: Record<string, number> = {};
    for (const t of [...this.prefill.list(), ...this.decode.list()]) {
      const key = `${t.side}:${t.state}`;
      byState[key] = (byState[key] ?? 0) + 1;
    }
    const l = this.kv?.layout;
    return {
      engineId: this.engineId,
      epoch: this.epoch,
      role: this.role,
      mode: this.mode,
      tpSize: l?.tpSize ?? 0,
      layoutSummary:
        l === undefined
          ? "not registered"
          : `${l.numLayers} layers, ${l.mla ? "MLA latent" : `${l.totalKvHeads} KV heads`} x ${l.headDim}, ${l.dtype}, block ${l.blockSize}, ${l.order}, ${l.numBlocks} blocks/rank`,
      startedMs: this.startedMs,
      draining: this.life.draining,
      peers: this.peers.list(),
      transfersByState: byState,
      bytesMoved: this.bytesMoved,
      transfersMoved: this.transfersMoved,
      leaseTableSize: this.prefill.leased(),
      lastErrors: [...this.lastErrors],
      ucx: this.ucxStatus(),
    };
  }

  /**
   * The UCX the agents run on: what the first registered agent's context opened, or before any
   * registration what a context with this sidecar's transport list opens.
   */
  ucxStatus(): { version: string; transports: string[]; memoryTypes: string[] } {
    const agent = this.kv?.agents[0];
    const base = ucxInfo(this.opts.transports);
    if (agent === undefined || agent.closed) return base;
    return { version: base.version, transports: agent.transports, memoryTypes: agent.memoryTypes };
  }

  traced(transferId: string, side: TransferSide | "", hop: string): void {
    if (side !== "decode") this.prefill.mark(transferId, hop);
    if (side !== "prefill") this.decode.mark(transferId, hop);
  }

  transfers(filter: TransferFilter = {}): TransferInfo[] {
    const want = filter.states === undefined ? undefined : new Set(filter.states);
    return [...this.prefill.list(), ...this.decode.list()].filter(
      (info) =>
        (want === undefined || want.has(info.state)) &&
        (filter.peer === undefined || filter.peer === "" || info.peer === filter.peer),
    );
  }
}
