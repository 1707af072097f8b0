/**
 * The sidecar: takes its engine's events, finds the peer, plans the copy,
 * moves the KV with one native agent per rank, and tells both engines when
 * they may proceed. Every transfer reaches exactly one terminal state per
 * side, within a bound, as one event (docs/protocol.md).
 */
import { create, equals, type MessageInitShape } from "@bufbuild/protobuf";
import { randomBytes } from "node:crypto";
import { realpathSync, statSync } from "node:fs";
import type { Logger } from "pino";

import {
  FailureReason,
  RegisterKvCacheSchema,
  ReleaseReason,
  SidecarToEngineSchema,
  type EngineToSidecar,
  type ExpectKv,
  type PrefillDone,
  type RegisterKvCache,
  type SidecarToEngine,
} from "../gen/kvxfer/v1/engine_pb.js";
import {
  AgentMetadataSchema,
  HandshakeRequestSchema,
  HandshakeResponseSchema,
  RankMetadataSchema,
  Role,
  type AgentMetadata,
  type HandshakeRequest,
  type HandshakeResponse,
} from "../gen/kvxfer/v1/peer_pb.js";
import {
  Agent,
  KvxferError,
  type Endpoint,
  type ErrorMode,
  type Notification,
  type Region,
} from "../native/index.js";
import {
  PlanError,
  descriptorsForSide,
  findIncompatibility,
  mapRanks,
  planTransfer,
  type KvLayout,
  type TransferPlan,
} from "../plan/index.js";
import { kvLayoutFromProto, kvLayoutToProto } from "../plan/layout-proto.js";
import { checkEngineMessage, checkRegisterKvCache, engineIdProblem } from "../engine/validate.js";
import {
  MAX_PEER_MESSAGE_BYTES,
  PeerMessageError,
  agentName,
  encodePeerMessage,
  openPeerMessage,
  sealPeerMessage,
  tokensEqual,
  MAC_KEY_BYTES,
  newMacKey,
  parseAgentName,
  type OpenedPeerMessage,
  type PeerBody,
} from "../peer/messages.js";
import {
  SideChannelServer,
  checkCredentials,
  handshake,
  isLoopback,
  parseAddress,
  refusal,
  type PeerCredentials,
  type PeerIdentity,
} from "../peer/side-channel.js";
import type { SidecarMetrics } from "../api/metrics.js";
import { PeerState } from "./peers.js";
import type {
  EventKind,
  SidecarEvent,
  SidecarRole,
  SidecarStatus,
  SidecarView,
  TerminalKind,
  TransferFilter,
  TransferInfo,
  TransferMode,
  TransferState,
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
  /** After any activity, progress threads poll this long (µs) before sleeping. */
  spinUs?: number;
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
}

/** Where a sidecar sends what its engine must hear. */
export type EngineSender = (msg: SidecarToEngine) => void;

/**
 * The engine link connection a message came from, as far as ownership goes (link.ts): the link
 * belongs to the connection whose registration was accepted, and only the sidecar decides that.
 */
export interface EngineConnection {
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

interface Timings {
  registeredMs: number;
  prefillDoneMs: number;
  dataStartedMs: number;
  dataDoneMs: number;
  readyMs: number;
  endedMs: number;
}

function timings(): Timings {
  return {
    registeredMs: 0,
    prefillDoneMs: 0,
    dataStartedMs: 0,
    dataDoneMs: 0,
    readyMs: 0,
    endedMs: 0,
  };
}

interface Registration {
  peer: PeerState;
  token: string;
  dstBlocks: number[];
  numTokens: number;
  prefixTokens: number;
  leaseMs: number;
}

/** P's side of one transfer. */
interface PTransfer {
  id: string;
  state: TransferState;
  blocks: number[] | undefined;
  numTokens: number;
  reg: Registration | undefined;
  /** Registrations from other decode engines before PrefillDone named the token (at most 4). */
  otherRegs: Registration[];
  /** PrefillDone.token: only a D presenting it may register, confirm, abort or fail the transfer. */
  token: string;
  /** Lease of held blocks (HELD), of a registration waiting for prefill (WAITING), or the tombstone's end. */
  deadline: number;
  /** No write for the registration may start after this (renewed by D's heartbeats). */
  regDeadline: number;
  /** Who the blocks went to (peer engine id), once known. */
  peer: string;
  mode: "push" | "pull" | "";
  abortWanted: "" | "engine" | "peer";
  bytes: number;
  descriptors: number;
  reason: string;
  t: Timings;
}

/** D's side of one transfer. */
interface DTransfer {
  id: string;
  state: TransferState;
  source: string;
  peer: PeerState | undefined;
  dstBlocks: number[];
  srcBlocks: number[] | undefined;
  numTokens: number;
  prefixTokens: number;
  /** ExpectKv.token, presented to P. */
  token: string;
  mode: "push" | "pull";
  expectedPairs: Set<string>;
  donePairs: Set<string>;
  /** Watchdog, or (while draining an abort) when the blocks may be released. */
  deadline: number;
  /** Last time D renewed P's registration (push), for the abort drain bound. */
  lastRenewMs: number;
  /** Set once the engine has been told KvFailed; the terminal state follows once safe. */
  failing:
    { kind: TerminalKind; reason: FailureReason; code: string; release: ReleaseReason } | undefined;
  readsInFlight: number;
  /** Push: P's time from PrefillDone to the last XferDone. */
  sincePrefillDoneMs: number;
  bytes: number;
  descriptors: number;
  reason: string;
  t: Timings;
}

/** Peers known at once at most; an idle peer is forgotten after the tombstone time. */
const MAX_PEERS = 4096;

const TERMINAL = new Set<TransferState>(["KV_READY", "FAILED", "EXPIRED", "ABORTED", "RELEASED"]);

function isTerminal(s: TransferState): boolean {
  return TERMINAL.has(s);
}

function roleToProto(role: SidecarRole): Role {
  return role === "prefill" ? Role.PREFILL : role === "decode" ? Role.DECODE : Role.BOTH;
}

export class Sidecar implements SidecarView {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly role: SidecarRole;
  readonly mode: TransferMode;
  readonly startedMs = Date.now();
  private readonly opts: Required<
    Omit<SidecarOptions, "netDevices" | "transports" | "logger" | "peerCredentials">
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
  private metrics: SidecarMetrics | undefined;

  private layout: KvLayout | undefined;
  /** The accepted registration, and the identity (device, inode) of each file it mapped. */
  private registration: { msg: RegisterKvCache; files: string[] } | undefined;
  private agents: Agent[] = [];
  private regions: Region[][] = [];
  /** The KV directory with symbolic links resolved (the operator's setting may name a link). */
  private readonly kvDirResolved: string;
  /**
   * Bytes of KV files mapped now (checked against maxKvBytes). A sidecar holds one registration
   * today; code that drops or replaces one (re-registration) must subtract its bytes.
   */
  private mappedBytes = 0;
  /**
   * Blocks claimed by live transfers, block id -> transfer id, so that two live transfers never
   * claim one block (a refused message names the holder). On D a transfer claims the blocks it
   * writes: `block_ids` entries floor(prefix_tokens / block) .. ceil(num_tokens / block) - 1 (the
   * prefix blocks before them are only read by the engine, and vLLM's prefix cache legitimately
   * shares them between requests; ids past the tokens are not written). Claimed from ExpectKv
   * until the transfer's terminal state (KV_READY, or the ReleaseBlocks after a failure: a
   * failing transfer still holds them, as a write may still land). On P (only with
   * exclusivePrefillBlocks) a transfer claims its whole `block_ids` from PrefillDone until
   * endP; by default P's blocks are not claimed, since P only reads them and vLLM's prefix
   * cache shares a prompt's cached blocks between requests, each released per request.
   */
  private readonly dClaims = new Map<number, string>();
  private readonly pClaims = new Map<number, string>();
  private readonly side: SideChannelServer;
  private sideChannel = "";

  private readonly peers = new Map<string, PeerState>();
  /** Side channel address -> engine id, for the D side's cache. */
  private readonly peerByAddress = new Map<string, string>();
  private readonly handshakes = new Map<string, Promise<PeerState>>();
  private readonly pTransfers = new Map<string, PTransfer>();
  private readonly dTransfers = new Map<string, DTransfer>();

  private sweepTimer: NodeJS.Timeout | undefined;
  private heartbeatTimer: NodeJS.Timeout | undefined;
  private closed = false;
  draining = false;
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
    this.opts = {
      engineId: options.engineId,
      role: options.role,
      mode: options.mode,
      listen: options.listen,
      transports: options.transports ?? "",
      netDevices: options.netDevices ?? [],
      errorMode: options.errorMode ?? "none",
      busyPoll: options.busyPoll ?? false,
      spinUs: options.spinUs ?? 0,
      leaseMs: options.leaseMs ?? 30_000,
      regLeaseMs: options.regLeaseMs ?? options.leaseMs ?? 30_000,
      transferTimeoutMs: options.transferTimeoutMs ?? 60_000,
      heartbeatMs: options.heartbeatMs ?? 1000,
      peerTimeoutMs: options.peerTimeoutMs ?? 5000,
      abortGraceMs: options.abortGraceMs ?? 2000,
      handshakeTimeoutMs: options.handshakeTimeoutMs ?? 5000,
      tombstoneMs: options.tombstoneMs ?? 60_000,
      maxTransfers: options.maxTransfers ?? 65_536,
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
    this.side = new SideChannelServer(
      (req, identity) => this.onHandshake(req, identity),
      this.log.child({ component: "side-channel" }),
      (code, message) => this.noteError(`handshake refused: ${code}: ${message}`),
      options.peerCredentials,
    );
  }

  /** Binds the side channel and starts the sweep and heartbeats. */
  async start(
    engineSend: EngineSender,
    events: EventSink,
    metrics?: SidecarMetrics,
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
      },
      "sidecar started",
    );
    return this.sideChannel;
  }

  get sideChannelAddress(): string {
    return this.sideChannel;
  }

  /** Live (non-terminal) transfers on both sides. */
  liveTransfers(): number {
    let n = 0;
    for (const t of this.pTransfers.values()) if (!isTerminal(t.state)) n++;
    for (const t of this.dTransfers.values()) if (!isTerminal(t.state)) n++;
    return n;
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    clearInterval(this.sweepTimer);
    clearInterval(this.heartbeatTimer);
    await this.side.close();
    for (const p of this.peers.values()) p.close();
    this.peers.clear();
    for (const a of this.agents) a.close();
    this.agents = [];
  }

  /**
   * True once the engine's KV cache is registered and the sidecar is not draining: it can
   * answer peer handshakes (before, they get ERR_NOT_READY). gRPC health follows this.
   */
  get acceptsHandshakes(): boolean {
    return this.layout !== undefined && !this.draining;
  }

  // --- the engine link ---------------------------------------------------------

  /**
   * Handles one message from the engine; never throws. `reply` reaches the connection that sent
   * it: refusals and the answer to a registration go there (an engine that is not, or no longer,
   * registered still hears why its message was refused), everything else to the registered engine.
   */
  onEngineMessage(msg: EngineToSidecar, reply?: EngineSender, conn?: EngineConnection): void {
    this.replyTo = reply;
    try {
      if (msg.msg.case === "register") {
        this.onRegister(msg.msg.value, conn);
        return;
      }
      // One place checks engine messages' fields; a problem costs only the message.
      const problem = checkEngineMessage(msg, this.layout);
      if (problem !== undefined) {
        this.refuse(problem.transferId, problem.code, problem.message);
        return;
      }
      if (this.draining && (msg.msg.case === "prefillDone" || msg.msg.case === "expectKv")) {
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
        this.refuse(
          msg.msg.value.transferId,
          "ERR_DRAINING",
          "the sidecar is draining (SIGTERM): no new transfers",
        );
        return;
      }
      switch (msg.msg.case) {
        case "prefillDone":
          this.onPrefillDone(msg.msg.value);
          break;
        case "expectKv":
          this.onExpectKv(msg.msg.value);
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

  private send(msg: NonNullable<MessageInitShape<typeof SidecarToEngineSchema>["msg"]>): void {
    this.engineSend(create(SidecarToEngineSchema, { msg }));
  }

  private refuse(transferId: string, code: string, message: string): void {
    this.noteError(`${code}: ${message}`);
    this.log.warn({ transferId, code }, message);
    this.answer({ case: "refused", value: { transferId, code, message } });
  }

  /** To the sender of the engine message being handled (else the registered engine). */
  private answer(msg: NonNullable<MessageInitShape<typeof SidecarToEngineSchema>["msg"]>): void {
    (this.replyTo ?? this.engineSend)(create(SidecarToEngineSchema, { msg }));
  }

  /** Keeps the last errors for GetStatus (bounded). */
  noteError(text: string): void {
    this.lastErrors.push(`${new Date().toISOString()} ${text}`);
    if (this.lastErrors.length > 20) this.lastErrors.shift();
  }

  /** (device, inode) of every file of a registration, in order; "" for a file stat cannot see. */
  private static fileIdentities(reg: RegisterKvCache): string[] {
    return reg.ranks.flatMap((rk) =>
      rk.regions.map((f) => {
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
    if (this.layout !== undefined) {
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
            "other memory; a new engine process needs a new sidecar (restart the sidecar: new epoch)",
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
    const agents: Agent[] = [];
    const regions: Region[][] = [];
    try {
      for (const rk of ranks) {
        const netDevices = this.opts.netDevices[rk.rank] ?? this.opts.netDevices[0];
        const agent = new Agent({
          name: agentName(this.engineId, this.epoch, rk.rank),
          ...(this.opts.transports !== "" ? { transports: this.opts.transports } : {}),
          ...(netDevices !== undefined ? { netDevices } : {}),
          maxNotificationBytes: MAX_PEER_MESSAGE_BYTES,
          busyPoll: this.opts.busyPoll,
          spinUs: this.opts.spinUs,
        });
        agents.push(agent);
        regions.push(
          rk.regions.map((f, i) => {
            try {
              return agent.mapFile(f.path, {
                offset: f.offset,
                length: layout.regionBytes[i]!,
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
              throw new KvxferError(e.code, `rank ${rk.rank} region ${i}: ${e.message}${hint}`);
            }
          }),
        );
        agent.on("notifications", (batch) => this.onNotifications(rk.rank, batch));
        agent.on("endpointFailed", (ep, code) => this.onEndpointFailed(ep, code));
        agent.on("notificationDropped", (peer, bytes) =>
          this.noteError(
            `peer message from '${peer.slice(0, 200)}' refused: ERR_TOO_LARGE (${bytes} bytes)`,
          ),
        );
      }
    } catch (err) {
      for (const a of agents) a.close();
      const e = KvxferError.from(err);
      return fail(`${e.code}: ${e.message}`);
    }
    this.layout = layout;
    this.agents = agents;
    this.regions = regions;
    this.mappedBytes += bytes;
    this.registration = { msg: reg, files: Sidecar.fileIdentities(reg) };
    conn?.adopt();
    this.log.info({ tp: layout.tpSize, regions: layout.regionBytes.length }, "KV cache registered");
    this.answer({
      case: "registered",
      value: { ok: true, error: "", sideChannel: this.sideChannel, epoch: this.epoch },
    });
  }

  // --- prefill side --------------------------------------------------------------

  private onPrefillDone(m: PrefillDone): void {
    if (this.role === "decode")
      return this.refuse(m.transferId, "ERR_WRONG_ROLE", "PrefillDone sent to a decode sidecar");
    if (this.opts.exclusivePrefillBlocks) {
      // Refused without a ReleaseBlocks: another live transfer holds these blocks.
      const clash = this.claimClash(this.pClaims, m.blockIds, 0, m.transferId);
      if (clash !== undefined) return this.refuse(m.transferId, "ERR_BLOCKS_IN_USE", clash);
    }
    const now = Date.now();
    const existing = this.pTransfers.get(m.transferId);
    if (existing !== undefined && isTerminal(existing.state) && existing.blocks === undefined) {
      // The transfer ended before prefill did (D aborted, its registration ran out, D went
      // down): nobody will read these blocks, so they go straight back. Its one terminal event
      // was already emitted; a second PrefillDone is a duplicate (blocks are now set).
      existing.blocks = [...m.blockIds];
      this.send({
        case: "releaseBlocks",
        value: {
          transferId: m.transferId,
          blockIds: existing.blocks,
          reason:
            existing.state === "ABORTED"
              ? ReleaseReason.ABORTED
              : existing.state === "EXPIRED"
                ? ReleaseReason.EXPIRED
                : ReleaseReason.FAILED,
        },
      });
      return;
    }
    if (existing !== undefined && (existing.blocks !== undefined || isTerminal(existing.state))) {
      return this.refuse(
        m.transferId,
        "ERR_DUPLICATE",
        `PrefillDone for transfer '${m.transferId}' already received`,
      );
    }
    if (existing === undefined && this.atCapacity(this.pTransfers)) {
      // The engine gets its blocks back at once: nobody will read them.
      this.send({
        case: "releaseBlocks",
        value: {
          transferId: m.transferId,
          blockIds: [...m.blockIds],
          reason: ReleaseReason.FAILED,
        },
      });
      return this.refuse(
        m.transferId,
        "ERR_OVERLOADED",
        `${this.opts.maxTransfers} transfers live`,
      );
    }
    const t: PTransfer = existing ?? {
      id: m.transferId,
      state: "HELD",
      blocks: undefined,
      numTokens: 0,
      reg: undefined,
      otherRegs: [],
      token: "",
      deadline: 0,
      regDeadline: 0,
      peer: "",
      mode: "",
      abortWanted: "",
      bytes: 0,
      descriptors: 0,
      reason: "",
      t: timings(),
    };
    t.blocks = [...m.blockIds];
    if (this.opts.exclusivePrefillBlocks) this.claim(this.pClaims, t.blocks, t.id);
    t.numTokens = m.numTokens;
    t.token = m.token;
    t.t.prefillDoneMs = now;
    t.deadline = now + this.opts.leaseMs;
    this.pTransfers.set(t.id, t);
    this.settleRegistrations(t);
    if (t.reg !== undefined) {
      void this.push(t);
    } else {
      t.state = "HELD";
    }
  }

  private onPushReg(
    peer: PeerState,
    m: {
      transferId: string;
      blockIds: number[];
      numTokens: number;
      prefixTokens: number;
      leaseMs: number;
      token: string;
    },
  ): void {
    const now = Date.now();
    const existing = this.pTransfers.get(m.transferId);
    const fail = (code: string, message: string): void => {
      this.sendPeer(peer, { case: "failed", value: { transferId: m.transferId, code, message } });
    };
    if (this.layout === undefined || this.role === "decode")
      return fail("ERR_WRONG_ROLE", "this sidecar does not prefill");
    if (existing !== undefined && isTerminal(existing.state)) {
      // A late registration for blocks already released (lease expired, aborted): refused.
      return fail(
        existing.state === "EXPIRED" ? "ERR_LEASE_EXPIRED" : "ERR_ENDED",
        `transfer ended on P as ${existing.state}`,
      );
    }
    if (existing?.reg?.peer === peer || existing?.otherRegs.some((r) => r.peer === peer)) return; // the same engine's registration again: idempotent
    if (m.numTokens === 0 || m.prefixTokens > m.numTokens)
      return fail("ERR_BAD_TOKENS", "bad token counts in PushReg");
    if (existing?.blocks !== undefined && !tokensEqual(existing.token, m.token)) {
      // The transfer names its decode engine by its token: anyone else is refused, and the
      // transfer goes on waiting for the right one.
      this.noteError(
        `PushReg for '${m.transferId}' from '${peer.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
      );
      return fail("ERR_BAD_TRANSFER_TOKEN", "the transfer's token does not match");
    }
    const leaseMsOf = Math.min(Math.max(m.leaseMs, 100), 10 * 60_000);
    const reg: Registration = {
      peer,
      token: m.token,
      dstBlocks: [...m.blockIds],
      numTokens: m.numTokens,
      prefixTokens: m.prefixTokens,
      leaseMs: leaseMsOf,
    };
    if (existing?.reg !== undefined) {
      if (existing.blocks !== undefined || existing.otherRegs.length >= 4) {
        this.noteError(
          `PushReg for '${m.transferId}' from '${peer.engineId}' refused: ERR_DUPLICATE ` +
            `(registered by '${existing.reg.peer.engineId}')`,
        );
        return fail("ERR_DUPLICATE", "another decode engine registered for this transfer");
      }
      // Before PrefillDone nobody knows whose token is right: keep it until then.
      existing.otherRegs.push(reg);
      return;
    }
    if (existing === undefined && this.atCapacity(this.pTransfers)) {
      return fail("ERR_OVERLOADED", `${this.opts.maxTransfers} transfers live on P`);
    }
    const leaseMs = leaseMsOf;
    const t: PTransfer = existing ?? {
      id: m.transferId,
      state: "WAITING",
      blocks: undefined,
      numTokens: 0,
      reg: undefined,
      otherRegs: [],
      token: "",
      deadline: now + leaseMs,
      regDeadline: now + leaseMs,
      peer: peer.engineId,
      mode: "push",
      abortWanted: "",
      bytes: 0,
      descriptors: 0,
      reason: "",
      t: timings(),
    };
    t.reg = reg;
    t.regDeadline = now + leaseMs;
    t.peer = peer.engineId;
    t.mode = "push";
    t.t.registeredMs = now;
    this.pTransfers.set(t.id, t);
    if (t.blocks !== undefined) void this.push(t);
  }

  /**
   * At PrefillDone: keeps the registration whose token matches the transfer's
   * (the first one when the transfer has no token) and refuses the others.
   */
  private settleRegistrations(t: PTransfer): void {
    const all = t.reg === undefined ? t.otherRegs : [t.reg, ...t.otherRegs];
    t.otherRegs = [];
    const chosen = all.find((r) => tokensEqual(r.token, t.token));
    for (const r of all) {
      if (r === chosen) continue;
      const code =
        t.token === "" && chosen !== undefined ? "ERR_DUPLICATE" : "ERR_BAD_TRANSFER_TOKEN";
      this.noteError(`PushReg for '${t.id}' from '${r.peer.engineId}' refused: ${code}`);
      this.sendPeer(r.peer, {
        case: "failed",
        value: { transferId: t.id, code, message: "not the decode engine this transfer names" },
      });
    }
    if (chosen === undefined) {
      t.reg = undefined;
      t.peer = "";
      t.mode = "";
      t.state = "HELD";
      return;
    }
    if (chosen !== t.reg) {
      t.reg = chosen;
      t.peer = chosen.peer.engineId;
      t.regDeadline = Date.now() + chosen.leaseMs;
    }
  }

  /** P writes every rank pair's KV into D's blocks, each pair followed by its XferDone. */
  private async push(t: PTransfer): Promise<void> {
    const reg = t.reg!;
    const layout = this.layout!;
    const peer = reg.peer;
    t.state = "MOVING";
    t.t.dataStartedMs = Date.now();
    let plan: TransferPlan;
    try {
      if (reg.numTokens !== t.numTokens) {
        throw new KvxferError(
          "ERR_BAD_TOKENS",
          `D expects ${reg.numTokens} tokens, P prefilled ${t.numTokens}`,
        );
      }
      plan = planTransfer(layout, peer.layout, {
        numTokens: t.numTokens,
        prefixTokens: reg.prefixTokens,
        srcBlockIds: t.blocks!,
        dstBlockIds: reg.dstBlocks,
      });
    } catch (err) {
      const e =
        err instanceof PlanError
          ? new KvxferError(e2code(err), err.message)
          : KvxferError.from(err);
      this.sendPeer(peer, {
        case: "failed",
        value: { transferId: t.id, code: e.code, message: e.message },
      });
      this.endP(t, "FAILED", e.code, ReleaseReason.FAILED);
      return;
    }
    const plannedAt = performance.now();
    // A registration whose lease ran out must not be written to: D may have released the blocks.
    const results = await Promise.allSettled(
      plan.pairs.map(async (pair) => {
        const agent = this.agents[pair.srcRank]!;
        const ep = peer.endpoint(pair.srcRank, pair.dstRank);
        const writes: Promise<void>[] = [];
        try {
          for (const rp of pair.regionPairs) {
            if (rp.count === 0) continue;
            if (Date.now() > t.regDeadline || t.abortWanted !== "" || peer.state !== "connected") {
              throw new KvxferError(
                "ERR_ABORTED",
                "registration expired, aborted, or peer down before the write",
              );
            }
            const remote = peer.remote(pair.srcRank, pair.dstRank, rp.dstRegion);
            writes.push(
              agent.write(ep, this.regions[pair.srcRank]![rp.srcRegion]!, remote, rp.descriptors),
            );
          }
        } catch (err) {
          // Writes already posted for this pair must settle before the failure is reported:
          // D releases its blocks on our Failed / AbortAck.
          await Promise.allSettled(writes);
          throw err;
        }
        // The XferDone follows only once every write of the pair is remotely complete.
        const settled = await Promise.allSettled(writes);
        const bad = settled.find((s) => s.status === "rejected");
        if (bad !== undefined) throw (bad as PromiseRejectedResult).reason;
        await agent.notify(
          ep,
          this.encode(peer, {
            case: "xferDone",
            value: {
              transferId: t.id,
              srcRank: pair.srcRank,
              dstRank: pair.dstRank,
              bytes: BigInt(pair.bytes),
              sincePrefillDoneMs: Math.max(0, Date.now() - t.t.prefillDoneMs),
            },
          }),
        );
      }),
    );
    t.t.dataDoneMs = Date.now();
    t.bytes = plan.bytes;
    t.descriptors = plan.descriptorCount;
    this.log.debug(
      {
        transferId: t.id,
        bytes: plan.bytes,
        descriptors: plan.descriptorCount,
        ms: t.t.dataDoneMs - t.t.dataStartedMs,
        moveMs: Math.round((performance.now() - plannedAt) * 100) / 100,
      },
      "push writes settled",
    );
    const failed = results.find((r) => r.status === "rejected");
    if (failed !== undefined) {
      const e = KvxferError.from((failed as PromiseRejectedResult).reason);
      if (t.abortWanted === "peer") {
        this.sendPeer(peer, { case: "abortAck", value: { transferId: t.id } });
        this.endP(t, "ABORTED", "ERR_ABORTED", ReleaseReason.ABORTED);
      } else {
        this.sendPeer(peer, {
          case: "failed",
          value: { transferId: t.id, code: e.code, message: e.message },
        });
        this.endP(
          t,
          t.abortWanted === "engine" ? "ABORTED" : "FAILED",
          e.code,
          t.abortWanted === "engine" ? ReleaseReason.ABORTED : ReleaseReason.FAILED,
        );
      }
      return;
    }
    if (t.abortWanted === "peer")
      this.sendPeer(peer, { case: "abortAck", value: { transferId: t.id } });
    this.bytesMoved += plan.bytes;
    this.transfersMoved++;
    this.endP(t, "RELEASED", "transferred", ReleaseReason.TRANSFERRED);
  }

  /** P's terminal state: blocks back to the engine, one event. */
  private endP(t: PTransfer, kind: TerminalKind, reason: string, release: ReleaseReason): void {
    if (isTerminal(t.state)) return;
    t.state = kind;
    t.reason = reason;
    const now = Date.now();
    t.t.endedMs = now;
    t.deadline = now + this.opts.tombstoneMs;
    if (t.blocks !== undefined) {
      if (this.opts.exclusivePrefillBlocks) this.unclaim(this.pClaims, t.blocks, t.id);
      this.send({
        case: "releaseBlocks",
        value: { transferId: t.id, blockIds: t.blocks, reason: release },
      });
    }
    this.emit(kind, t.id, t.peer, "prefill", reason, t.bytes, t.mode);
  }

  private onReadDone(peer: PeerState, transferId: string, bytes: number, token: string): void {
    const t = this.pTransfers.get(transferId);
    if (t !== undefined && t.blocks !== undefined && !tokensEqual(t.token, token)) {
      this.noteError(
        `ReadDone for '${transferId}' from '${peer.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
      );
      this.sendPeer(peer, {
        case: "failed",
        value: {
          transferId,
          code: "ERR_BAD_TRANSFER_TOKEN",
          message: "the transfer's token does not match",
        },
      });
      return;
    }
    const held = t !== undefined && t.state === "HELD" && t.blocks !== undefined;
    // D reports ready only if P says the blocks were still held when it read them.
    // The router may have told D about the blocks before P's sidecar processed the
    // engine's PrefillDone: then P has no record at all, and D asks again.
    this.sendPeer(peer, { case: "readAck", value: { transferId, held, unknown: t === undefined } });
    if (held) {
      t.peer = peer.engineId;
      t.mode = "pull";
      t.bytes = bytes;
      this.bytesMoved += t.bytes;
      this.transfersMoved++;
      this.endP(t, "RELEASED", "transferred", ReleaseReason.TRANSFERRED);
    }
  }

  private onPeerAbort(peer: PeerState, transferId: string, token: string): void {
    const t = this.pTransfers.get(transferId);
    if (t === undefined || isTerminal(t.state)) {
      this.sendPeer(peer, { case: "abortAck", value: { transferId } });
      return;
    }
    if (!this.mayActOn(t, peer, token)) {
      const other = t.otherRegs.findIndex((r) => r.peer === peer);
      if (other >= 0) {
        // A registration still waiting for PrefillDone withdrawn: nothing was written for it.
        t.otherRegs.splice(other, 1);
        this.sendPeer(peer, { case: "abortAck", value: { transferId } });
        return;
      }
      this.noteError(
        `Abort for '${transferId}' from '${peer.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
      );
      return;
    }
    if (t.state === "MOVING") {
      t.abortWanted = "peer"; // acknowledged once the writes in flight have completed
      return;
    }
    this.sendPeer(peer, { case: "abortAck", value: { transferId } });
    this.endP(t, "ABORTED", "aborted by decode", ReleaseReason.ABORTED);
  }

  // --- decode side ---------------------------------------------------------------

  private onExpectKv(m: ExpectKv): void {
    if (this.role === "prefill")
      return this.refuse(m.transferId, "ERR_WRONG_ROLE", "ExpectKv sent to a prefill sidecar");
    const existing = this.dTransfers.get(m.transferId);
    if (existing !== undefined) {
      return this.refuse(
        m.transferId,
        "ERR_DUPLICATE",
        `ExpectKv for transfer '${m.transferId}' already received`,
      );
    }
    if (this.atCapacity(this.dTransfers)) {
      return this.refuse(
        m.transferId,
        "ERR_OVERLOADED",
        `${this.opts.maxTransfers} transfers live`,
      );
    }
    // The blocks this transfer writes (see dClaims); the engine's checks guarantee the count.
    const bs = this.layout!.blockSize;
    const firstWritten = Math.floor(m.prefixTokens / bs);
    const written = m.blockIds.slice(firstWritten, Math.ceil(m.numTokens / bs));
    const clash = this.claimClash(this.dClaims, written, firstWritten, m.transferId);
    if (clash !== undefined) return this.refuse(m.transferId, "ERR_BLOCKS_IN_USE", clash);
    const hasSrc = m.hasSourceBlockIds;
    let mode: "push" | "pull";
    if (this.mode === "pull" || (this.mode === "auto" && hasSrc)) {
      if (!hasSrc)
        return this.refuse(
          m.transferId,
          "ERR_NO_SOURCE_BLOCKS",
          "pull mode needs ExpectKv.source_block_ids",
        );
      mode = "pull";
    } else {
      mode = "push";
    }
    const now = Date.now();
    const t: DTransfer = {
      id: m.transferId,
      state: "WAITING",
      source: m.source,
      peer: undefined,
      dstBlocks: [...m.blockIds],
      srcBlocks: hasSrc ? [...m.sourceBlockIds] : undefined,
      numTokens: m.numTokens,
      prefixTokens: m.prefixTokens,
      token: m.token,
      mode,
      expectedPairs: new Set(),
      donePairs: new Set(),
      deadline: now + this.opts.transferTimeoutMs,
      lastRenewMs: now,
      failing: undefined,
      readsInFlight: 0,
      sincePrefillDoneMs: 0,
      bytes: 0,
      descriptors: 0,
      reason: "",
      t: timings(),
    };
    t.t.registeredMs = now;
    this.dTransfers.set(t.id, t);
    this.claim(this.dClaims, written, t.id);
    void this.startD(t);
  }

  private async startD(t: DTransfer): Promise<void> {
    let peer: PeerState;
    try {
      peer = await this.resolvePeer(t.source);
    } catch (err) {
      const e = KvxferError.from(err);
      const reason =
        e.code === "ERR_LAYOUT_INCOMPATIBLE"
          ? FailureReason.INCOMPATIBLE
          : FailureReason.UNREACHABLE;
      // Nothing was registered with P: the blocks are safe at once.
      this.failD(t, "FAILED", reason, e.code, e.message, ReleaseReason.FAILED, true);
      return;
    }
    if (isTerminal(t.state) || t.failing !== undefined) {
      // Given up on while the handshake ran (abort, watchdog): a pull tells P it can let go.
      if (t.mode === "pull")
        this.sendPeer(peer, {
          case: "abort",
          value: { transferId: t.id, reason: t.reason, token: t.token },
        });
      return;
    }
    t.peer = peer;
    const layout = this.layout!;
    for (const d of mapRanks(peer.layout, layout)) {
      for (const s of d.sources) t.expectedPairs.add(`${s.srcRank}:${d.dstRank}`);
    }
    if (t.mode === "push") {
      t.state = "MOVING";
      t.lastRenewMs = Date.now();
      this.sendPeer(peer, {
        case: "pushReg",
        value: {
          transferId: t.id,
          blockIds: t.dstBlocks,
          numTokens: t.numTokens,
          prefixTokens: t.prefixTokens,
          leaseMs: this.opts.regLeaseMs,
          token: t.token,
        },
      });
    } else {
      await this.pull(t, peer);
    }
  }

  /** D reads every rank pair's KV from P's blocks, then asks P whether they were held throughout. */
  private async pull(t: DTransfer, peer: PeerState): Promise<void> {
    let plan: TransferPlan;
    try {
      plan = planTransfer(peer.layout, this.layout!, {
        numTokens: t.numTokens,
        prefixTokens: t.prefixTokens,
        srcBlockIds: t.srcBlocks!,
        dstBlockIds: t.dstBlocks,
      });
    } catch (err) {
      const e =
        err instanceof PlanError
          ? new KvxferError(e2code(err), err.message)
          : KvxferError.from(err);
      this.failD(
        t,
        "FAILED",
        FailureReason.BAD_REQUEST,
        e.code,
        e.message,
        ReleaseReason.FAILED,
        true,
      );
      return;
    }
    t.state = "MOVING";
    t.t.dataStartedMs = Date.now();
    t.bytes = plan.bytes;
    t.descriptors = plan.descriptorCount;
    const reads: Promise<void>[] = [];
    try {
      for (const pair of plan.pairs) {
        const agent = this.agents[pair.dstRank]!;
        const ep = peer.endpoint(pair.dstRank, pair.srcRank);
        for (const rp of pair.regionPairs) {
          if (rp.count === 0) continue;
          const remote = peer.remote(pair.dstRank, pair.srcRank, rp.srcRegion);
          reads.push(
            agent.read(
              ep,
              this.regions[pair.dstRank]![rp.dstRegion]!,
              remote,
              descriptorsForSide(rp.descriptors, "dst"),
            ),
          );
        }
      }
    } catch (err) {
      reads.push(Promise.reject(err));
    }
    t.readsInFlight = reads.length;
    const settled = await Promise.allSettled(reads);
    t.readsInFlight = 0;
    t.t.dataDoneMs = Date.now();
    const bad = settled.find((s) => s.status === "rejected");
    if (t.failing !== undefined) {
      // Aborted or timed out while reading: the reads are over, the blocks are safe now.
      this.finishFailingD(t);
      return;
    }
    if (bad !== undefined) {
      const e = KvxferError.from((bad as PromiseRejectedResult).reason);
      this.sendPeer(peer, {
        case: "failed",
        value: { transferId: t.id, code: e.code, message: e.message, token: t.token },
      });
      this.failD(
        t,
        "FAILED",
        FailureReason.TRANSFER_ERROR,
        e.code,
        e.message,
        ReleaseReason.FAILED,
        true,
      );
      return;
    }
    t.state = "CONFIRMING";
    this.sendPeer(peer, {
      case: "readDone",
      value: { transferId: t.id, bytes: BigInt(t.bytes), token: t.token },
    });
  }

  private onReadAck(peer: PeerState, transferId: string, held: boolean, unknown: boolean): void {
    const t = this.dTransfers.get(transferId);
    if (t === undefined || t.peer !== peer || t.state !== "CONFIRMING" || t.mode !== "pull") return;
    if (unknown) {
      // P has not seen PrefillDone yet, so it cannot have released the blocks: ask again
      // shortly (the watchdog bounds how long).
      setTimeout(() => {
        if (t.state === "CONFIRMING" && t.failing === undefined && t.peer !== undefined) {
          this.sendPeer(t.peer, {
            case: "readDone",
            value: { transferId: t.id, bytes: BigInt(t.bytes), token: t.token },
          });
        }
      }, 10);
      return;
    }
    if (held) {
      this.readyD(t);
    } else {
      this.failD(
        t,
        "FAILED",
        FailureReason.LEASE_EXPIRED,
        "ERR_LEASE_EXPIRED",
        "P released the blocks before D's read was confirmed",
        ReleaseReason.FAILED,
        true,
      );
    }
  }

  private onXferDone(
    peer: PeerState,
    fromRank: number,
    toRank: number,
    m: {
      transferId: string;
      srcRank: number;
      dstRank: number;
      bytes: bigint;
      sincePrefillDoneMs: number;
    },
  ): void {
    const t = this.dTransfers.get(m.transferId);
    if (t === undefined) {
      // Never expected here (or its tombstone is gone): a peer bug or a forgery, worth seeing.
      this.noteError(
        `XferDone from '${peer.engineId}' for unknown transfer '${m.transferId}': ERR_UNKNOWN_TRANSFER`,
      );
      return;
    }
    if (t.peer !== peer || t.mode !== "push" || t.state !== "MOVING") {
      this.log.debug({ transferId: m.transferId }, "XferDone for no moving push transfer: ignored");
      return;
    }
    // The notification must come from the agent pair it names (it follows that pair's data).
    if (m.srcRank !== fromRank || m.dstRank !== toRank) {
      this.noteError(
        `XferDone for ${m.transferId} names ranks ${m.srcRank}->${m.dstRank} but came ${fromRank}->${toRank}`,
      );
      return;
    }
    const key = `${m.srcRank}:${m.dstRank}`;
    if (!t.expectedPairs.has(key)) return;
    if (t.t.dataStartedMs === 0) t.t.dataStartedMs = Date.now();
    t.donePairs.add(key);
    t.bytes += Number(m.bytes);
    t.sincePrefillDoneMs = Math.max(t.sincePrefillDoneMs, m.sincePrefillDoneMs);
    if (t.donePairs.size === t.expectedPairs.size) {
      t.t.dataDoneMs = Date.now();
      this.bytesMoved += t.bytes;
      this.transfersMoved++;
      this.readyD(t);
    }
  }

  private readyD(t: DTransfer): void {
    const now = Date.now();
    t.state = "KV_READY";
    this.unclaim(this.dClaims, t.dstBlocks, t.id);
    t.t.readyMs = now;
    t.t.endedMs = now;
    t.deadline = now + this.opts.tombstoneMs;
    this.send({ case: "kvReady", value: { transferId: t.id } });
    // Prefill done -> ready: for push P reports its side; for pull the router sent
    // ExpectKv only once prefill was done, so registration stands in for it.
    const latency = t.mode === "push" ? t.sincePrefillDoneMs : now - t.t.registeredMs;
    this.metrics?.transferReady(t.mode, latency, t.bytes, t.descriptors);
    this.emit("KV_READY", t.id, t.peer?.engineId ?? "", "decode", "", t.bytes, t.mode);
  }

  /**
   * D's failure path. The engine hears KvFailed at once (it may recompute);
   * its blocks come back only when no write into them can still arrive:
   * at once when `safe`, else on P's AbortAck, on reads settling, or when P's
   * registration lease (plus a grace) has surely run out.
   */
  private failD(
    t: DTransfer,
    kind: TerminalKind,
    reason: FailureReason,
    code: string,
    message: string,
    release: ReleaseReason,
    safe: boolean,
  ): void {
    if (isTerminal(t.state) || t.failing !== undefined) return;
    t.failing = { kind, reason, code, release };
    t.reason = code;
    this.metrics?.transferFailed(code);
    this.send({ case: "kvFailed", value: { transferId: t.id, reason, message } });
    // A pull that D gives up on (abort, watchdog): P need not hold its blocks to the lease.
    if (
      t.mode === "pull" &&
      t.peer !== undefined &&
      reason !== FailureReason.LEASE_EXPIRED &&
      reason !== FailureReason.PEER_FAILED
    ) {
      this.sendPeer(t.peer, {
        case: "abort",
        value: { transferId: t.id, reason: code, token: t.token },
      });
    }
    if (safe) {
      this.finishFailingD(t);
      return;
    }
    t.state = "CONFIRMING";
    if (t.mode === "push" && t.peer !== undefined) {
      this.sendPeer(t.peer, {
        case: "abort",
        value: { transferId: t.id, reason: code, token: t.token },
      });
      t.deadline = t.lastRenewMs + this.opts.regLeaseMs + this.opts.abortGraceMs;
    } else if (t.readsInFlight === 0) {
      this.finishFailingD(t);
    }
  }

  private finishFailingD(t: DTransfer): void {
    const f = t.failing;
    if (f === undefined || isTerminal(t.state)) return;
    const now = Date.now();
    t.state = f.kind;
    this.unclaim(this.dClaims, t.dstBlocks, t.id);
    t.t.endedMs = now;
    t.deadline = now + this.opts.tombstoneMs;
    this.send({
      case: "releaseBlocks",
      value: { transferId: t.id, blockIds: t.dstBlocks, reason: f.release },
    });
    this.emit(f.kind, t.id, t.peer?.engineId ?? "", "decode", f.code, t.bytes, t.mode);
  }

  private onEngineAbort(transferId: string): void {
    const d = this.dTransfers.get(transferId);
    const p = this.pTransfers.get(transferId);
    if (d === undefined && p === undefined)
      return this.refuse(transferId, "ERR_UNKNOWN_TRANSFER", `no transfer '${transferId}'`);
    if (d !== undefined && !isTerminal(d.state)) {
      const safe = d.state === "WAITING" && d.mode === "pull";
      this.failD(
        d,
        "ABORTED",
        FailureReason.ABORTED,
        "ERR_ABORTED",
        "aborted by the engine",
        ReleaseReason.ABORTED,
        safe || (d.state === "WAITING" && d.peer === undefined),
      );
    }
    if (p !== undefined && !isTerminal(p.state)) {
      if (p.state === "MOVING") {
        p.abortWanted = "engine";
      } else {
        if (p.reg !== undefined)
          this.sendPeer(p.reg.peer, {
            case: "failed",
            value: { transferId, code: "ERR_ABORTED", message: "aborted by the prefill engine" },
          });
        this.endP(p, "ABORTED", "aborted by the engine", ReleaseReason.ABORTED);
      }
    }
  }

  /**
   * True when `peer` may act on P's transfer `t`: it is the registered decode engine,
   * or (no registration) it presents the transfer's token.
   */
  private mayActOn(t: PTransfer, peer: PeerState, token: string): boolean {
    if (t.reg !== undefined) return t.reg.peer === peer;
    return t.blocks === undefined || tokensEqual(t.token, token);
  }

  private onPeerFailed(
    peer: PeerState,
    transferId: string,
    code: string,
    message: string,
    token: string,
  ): void {
    const d = this.dTransfers.get(transferId);
    if (d !== undefined && d.peer === peer && !isTerminal(d.state)) {
      if (d.failing !== undefined) {
        // P failed after our abort: its writes are over.
        if (d.mode === "push") this.finishFailingD(d);
        return;
      }
      // P sends Failed only once its writes for the transfer are over.
      const safe = d.mode === "push" || d.readsInFlight === 0;
      const reason =
        code === "ERR_LEASE_EXPIRED" ? FailureReason.LEASE_EXPIRED : FailureReason.PEER_FAILED;
      this.failD(d, "FAILED", reason, code, `prefill side: ${message}`, ReleaseReason.FAILED, safe);
      return;
    }
    const p = this.pTransfers.get(transferId);
    if (p !== undefined && !isTerminal(p.state) && p.state !== "MOVING") {
      if (!this.mayActOn(p, peer, token)) {
        this.noteError(
          `Failed for '${transferId}' from '${peer.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
        );
        return;
      }
      this.endP(p, "FAILED", code, ReleaseReason.FAILED);
    }
  }

  private onAbortAck(peer: PeerState, transferId: string): void {
    const d = this.dTransfers.get(transferId);
    // Only a push waits for P's acknowledgement; a pull waits for its own reads to settle.
    if (d === undefined || d.peer !== peer || d.failing === undefined || d.mode !== "push") return;
    this.finishFailingD(d);
  }

  // --- peers -----------------------------------------------------------------------

  private myMetadata(): AgentMetadata {
    const layout = this.layout!;
    return create(AgentMetadataSchema, {
      engineId: this.engineId,
      epoch: this.epoch,
      role: roleToProto(this.role),
      layout: kvLayoutToProto(layout),
      sideChannel: this.sideChannel,
      ranks: this.agents.map((a, rank) =>
        create(RankMetadataSchema, {
          rank,
          workerAddress: a.address,
          remoteKeys: this.regions[rank]!.map((r) => r.remoteKey()),
        }),
      ),
    });
  }

  /** Checks a peer's metadata; throws KvxferError naming the field. */
  private checkMetadata(md: AgentMetadata | undefined): KvLayout {
    if (md === undefined) throw new KvxferError("ERR_MALFORMED", "handshake carries no metadata");
    const idProblem = engineIdProblem(md.engineId, "metadata.engine_id");
    if (idProblem !== undefined) throw new KvxferError("ERR_MALFORMED", idProblem);
    if (md.epoch === 0n) throw new KvxferError("ERR_MALFORMED", "metadata.epoch is 0");
    if (md.layout === undefined)
      throw new KvxferError("ERR_MALFORMED", "metadata.layout is missing");
    let layout: KvLayout;
    try {
      layout = kvLayoutFromProto(md.layout);
    } catch (err) {
      throw new KvxferError("ERR_LAYOUT_INVALID", (err as Error).message);
    }
    if (md.ranks.length !== layout.tpSize)
      throw new KvxferError(
        "ERR_MALFORMED",
        `metadata has ${md.ranks.length} ranks for tp_size ${layout.tpSize}`,
      );
    for (let r = 0; r < layout.tpSize; r++) {
      const rk = md.ranks.find((x) => x.rank === r);
      if (rk === undefined) throw new KvxferError("ERR_MALFORMED", `metadata has no rank ${r}`);
      if (rk.remoteKeys.length !== layout.regionBytes.length)
        throw new KvxferError(
          "ERR_MALFORMED",
          `rank ${r} has ${rk.remoteKeys.length} keys for ${layout.regionBytes.length} regions`,
        );
    }
    return layout;
  }

  /** Prefill side: D introduces itself; we answer with our metadata. */
  private onHandshake(req: HandshakeRequest, identity: PeerIdentity): HandshakeResponse {
    const res = this.answerHandshake(req, identity);
    if (res.errorCode !== "") this.noteError(`handshake refused: ${res.errorCode}: ${res.error}`);
    return res;
  }

  private answerHandshake(req: HandshakeRequest, identity: PeerIdentity): HandshakeResponse {
    if (this.layout === undefined)
      return refusal("ERR_NOT_READY", "the engine has not registered its KV cache");
    if (this.draining) return refusal("ERR_DRAINING", "the sidecar is draining");
    let layout: KvLayout;
    try {
      layout = this.checkMetadata(req.metadata);
    } catch (err) {
      const e = KvxferError.from(err);
      return refusal(e.code, e.message);
    }
    const md = req.metadata!;
    // With credentials, a peer is who its certificate says, and nobody else.
    if (this.side.authenticated && identity !== md.engineId) {
      return refusal(
        "ERR_UNAUTHENTICATED",
        `metadata claims engine '${md.engineId}' but the certificate names '${identity ?? ""}'`,
      );
    }
    if (req.macKey.length !== MAC_KEY_BYTES)
      return refusal("ERR_MALFORMED", `mac_key must be ${MAC_KEY_BYTES} bytes`);
    const mismatch = findIncompatibility(this.layout, layout);
    if (mismatch !== undefined)
      return refusal("ERR_LAYOUT_INCOMPATIBLE", `${mismatch.field}: ${mismatch.message}`);
    const peer = this.adoptPeer(md, layout);
    peer.setRecvKey(req.macKey);
    return create(HandshakeResponseSchema, { metadata: this.myMetadata(), macKey: peer.sendKey });
  }

  /** Installs a peer's metadata; a new epoch replaces the old peer and fails what it had. */
  private adoptPeer(md: AgentMetadata, layout: KvLayout): PeerState {
    const old = this.peers.get(md.engineId);
    if (old !== undefined && old.epoch === md.epoch && old.state === "connected") {
      old.lastSeenMs = Date.now();
      return old;
    }
    if (old !== undefined)
      this.dropPeer(old, old.epoch === md.epoch ? "peer failed" : "peer restarted (new epoch)");
    if (this.peers.size >= MAX_PEERS) {
      throw new KvxferError("ERR_OVERLOADED", `${MAX_PEERS} peers known; refusing another`);
    }
    const peer = new PeerState(md, layout, this.agents, this.opts.errorMode, this.log);
    this.peers.set(md.engineId, peer);
    this.emit("PEER_UP", "", md.engineId, "", `epoch ${md.epoch}`, 0, "");
    return peer;
  }

  /** Decode side: the peer at `address`, from the cache while it is fresh, else by handshake. */
  private async resolvePeer(address: string): Promise<PeerState> {
    const known = this.peerByAddress.get(address);
    const cached = known === undefined ? undefined : this.peers.get(known);
    if (
      cached !== undefined &&
      cached.state === "connected" &&
      Date.now() - cached.lastSeenMs < 2 * this.opts.heartbeatMs
    ) {
      return cached;
    }
    let pending = this.handshakes.get(address);
    if (pending === undefined) {
      pending = this.dial(address, cached).finally(() => this.handshakes.delete(address));
      this.handshakes.set(address, pending);
    }
    return pending;
  }

  private async dial(address: string, cached: PeerState | undefined): Promise<PeerState> {
    // Re-handshaking a peer we know keeps our key: notifications in flight stay valid.
    const macKey = cached?.state === "connected" ? cached.sendKey : newMacKey();
    const req = create(HandshakeRequestSchema, {
      metadata: this.myMetadata(),
      expectedEpoch: cached?.epoch ?? 0n,
      macKey,
    });
    const { response: res, peer: identity } = await handshake(
      address,
      req,
      this.opts.handshakeTimeoutMs,
      this.opts.peerCredentials,
    );
    if (res.errorCode !== "")
      throw new KvxferError(res.errorCode, `handshake with ${address} refused: ${res.error}`);
    const layout = this.checkMetadata(res.metadata);
    if (this.opts.peerCredentials !== undefined && identity !== res.metadata!.engineId) {
      throw new KvxferError(
        "ERR_UNAUTHENTICATED",
        `${address} claims engine '${res.metadata!.engineId}' but its certificate names '${identity ?? ""}'`,
      );
    }
    if (res.macKey.length !== MAC_KEY_BYTES)
      throw new KvxferError("ERR_MALFORMED", `handshake answer from ${address} has no mac_key`);
    const mismatch = findIncompatibility(layout, this.layout!);
    if (mismatch !== undefined)
      throw new KvxferError("ERR_LAYOUT_INCOMPATIBLE", `${mismatch.field}: ${mismatch.message}`);
    const peer = this.adoptPeer(res.metadata!, layout);
    peer.sendKey = macKey;
    peer.setRecvKey(res.macKey);
    peer.dialedAddress = address;
    this.peerByAddress.set(address, peer.engineId);
    return peer;
  }

  /** A peer is gone (restart, silence, endpoint failure): fail what depended on it. */
  private dropPeer(peer: PeerState, why: string): void {
    if (peer.state === "failed" && this.peers.get(peer.engineId) !== peer) return;
    peer.state = "failed";
    this.emit("PEER_DOWN", "", peer.engineId, "", why, 0, "");
    this.log.warn({ peer: peer.engineId, epoch: String(peer.epoch), why }, "peer down");
    for (const d of this.dTransfers.values()) {
      if (d.peer !== peer || isTerminal(d.state)) continue;
      if (d.failing !== undefined) continue; // already draining; its deadline bounds it
      // A push may still have writes in flight from a peer we merely stopped hearing:
      // the blocks wait for the registration lease. Reads settle by themselves.
      this.failD(
        d,
        "FAILED",
        FailureReason.PEER_FAILED,
        "ERR_PEER_DOWN",
        why,
        ReleaseReason.FAILED,
        d.mode === "pull" && d.readsInFlight === 0,
      );
    }
    for (const p of this.pTransfers.values()) {
      if (isTerminal(p.state) || p.reg?.peer !== peer) continue;
      if (p.state === "MOVING") {
        p.abortWanted = "engine";
        continue;
      }
      this.endP(p, "FAILED", "ERR_PEER_DOWN", ReleaseReason.FAILED);
    }
    if (this.peers.get(peer.engineId) === peer) this.peers.delete(peer.engineId);
    const endpoints = peer.endpointList();
    // Endpoints close once their operations settle; the native layer defers the close.
    peer.close();
    // Reads from a dead peer may never settle (UCX without peer error mode, measured here over
    // shared memory: a READ from a SIGKILLed sidecar hung forever and D's blocks stayed held).
    // Writes to one neither (measured: P's pushes to a SIGKILLed D stayed MOVING, and P's engine
    // kept their blocks for good). A grace later, whatever is still in flight to it is given up:
    // the reads and writes reject, the transfer ends and its blocks go back to the engine. (D's
    // blocks do not depend on this: D waits for P's registration lease, and P posts no write
    // after it.)
    const stuck =
      [...this.dTransfers.values()].some(
        (d) => d.peer === peer && d.mode === "pull" && d.readsInFlight > 0,
      ) || [...this.pTransfers.values()].some((p) => p.reg?.peer === peer && p.state === "MOVING");
    if (stuck) {
      setTimeout(() => {
        if (this.closed) return;
        this.log.warn(
          { peer: peer.engineId, graceMs: this.opts.abortGraceMs },
          "abandoning reads and writes to a dead peer",
        );
        for (const ep of endpoints) ep.abandon();
      }, this.opts.abortGraceMs).unref();
    }
  }

  private onEndpointFailed(ep: Endpoint, code: string): void {
    for (const peer of this.peers.values()) {
      if (peer.owns(ep)) {
        this.dropPeer(peer, `endpoint failed: ${code}`);
        return;
      }
    }
  }

  /** One notification to `peer`: numbered, and sealed with our key for it. */
  private encode(peer: PeerState, body: PeerBody): Uint8Array {
    peer.sendSeq += 1n;
    return sealPeerMessage(
      peer.sendKey,
      encodePeerMessage(this.engineId, this.epoch, peer.epoch, body, peer.sendSeq),
    );
  }

  /** Control messages go from our rank 0 agent to the peer's rank 0 agent. */
  private sendPeer(peer: PeerState, body: PeerBody): void {
    if (peer.state !== "connected") return;
    // Closed (the agents are gone): transfers ending during the stop notify no one.
    const agent = this.agents[0];
    if (agent === undefined) return;
    try {
      agent.notify(peer.endpoint(0, 0), this.encode(peer, body)).catch((err: unknown) => {
        this.log.warn({ err, peer: peer.engineId, msg: body.case }, "peer notification failed");
      });
    } catch (err) {
      this.log.warn({ err, peer: peer.engineId, msg: body.case }, "peer notification failed");
    }
  }

  private onNotifications(rank: number, batch: Notification[]): void {
    for (const n of batch) {
      let m: OpenedPeerMessage;
      try {
        m = openPeerMessage(n.data);
      } catch (err) {
        const code = err instanceof PeerMessageError ? err.code : "ERR_MALFORMED";
        this.noteError(`peer message from '${n.peer.slice(0, 200)}' refused: ${code}`);
        continue;
      }
      const from = parseAgentName(n.peer);
      const peer = this.peers.get(m.senderEngineId);
      // Stale or forged: the sender must be a known peer at the epoch we hold, and name us at ours.
      if (
        peer === undefined ||
        peer.state !== "connected" ||
        m.senderEpoch !== peer.epoch ||
        m.receiverEpoch !== this.epoch ||
        from === undefined ||
        from.engineId !== m.senderEngineId ||
        from.epoch !== m.senderEpoch
      ) {
        this.noteError(
          `peer message from '${m.senderEngineId}' (epoch ${m.senderEpoch}) refused: ERR_STALE_EPOCH`,
        );
        this.log.debug(
          { sender: m.senderEngineId, msg: m.body.case },
          "stale or unknown peer message refused",
        );
        continue;
      }
      // It must be sealed with the key that engine gave us in its handshake, and new.
      if (!peer.verifies(m.verify)) {
        this.noteError(
          `peer message from '${m.senderEngineId}' refused: ERR_UNAUTHENTICATED (bad MAC)`,
        );
        continue;
      }
      if (!peer.replay.accept(m.seq)) {
        this.noteError(
          `peer message from '${m.senderEngineId}' refused: ERR_REPLAY (sequence ${m.seq} seen)`,
        );
        continue;
      }
      peer.lastSeenMs = Date.now();
      const b = m.body;
      switch (b.case) {
        case "pushReg":
          this.onPushReg(peer, b.value);
          break;
        case "xferDone":
          this.onXferDone(peer, from.rank, rank, b.value);
          break;
        case "readDone":
          this.onReadDone(peer, b.value.transferId, Number(b.value.bytes), b.value.token);
          break;
        case "readAck":
          this.onReadAck(peer, b.value.transferId, b.value.held, b.value.unknown);
          break;
        case "heartbeat":
          this.onHeartbeat(peer, b.value.transferIds);
          break;
        case "abort":
          this.onPeerAbort(peer, b.value.transferId, b.value.token);
          break;
        case "abortAck":
          this.onAbortAck(peer, b.value.transferId);
          break;
        case "failed":
          this.onPeerFailed(peer, b.value.transferId, b.value.code, b.value.message, b.value.token);
          break;
      }
    }
  }

  /** D's heartbeat renews the leases of the transfers it names. */
  private onHeartbeat(peer: PeerState, ids: string[]): void {
    const now = Date.now();
    for (const id of ids) {
      const t = this.pTransfers.get(id);
      if (t === undefined || isTerminal(t.state)) continue;
      if (t.reg !== undefined && t.reg.peer !== peer) continue;
      if (t.reg !== undefined) t.regDeadline = now + t.reg.leaseMs;
      if (t.state === "HELD") t.deadline = now + this.opts.leaseMs;
      else if (t.state === "WAITING" && t.reg !== undefined) t.deadline = t.regDeadline;
    }
  }

  /** One heartbeat per peer with live transfers, naming the ones whose lease it renews. */
  private sendHeartbeats(): void {
    const byPeer = new Map<PeerState, string[]>();
    const now = Date.now();
    for (const d of this.dTransfers.values()) {
      if (d.peer === undefined || isTerminal(d.state) || d.failing !== undefined) continue;
      let ids = byPeer.get(d.peer);
      if (ids === undefined) byPeer.set(d.peer, (ids = []));
      ids.push(d.id);
      if (d.mode === "push") d.lastRenewMs = now;
    }
    for (const p of this.pTransfers.values()) {
      const peer = p.reg?.peer;
      if (peer === undefined || isTerminal(p.state)) continue;
      if (!byPeer.has(peer)) byPeer.set(peer, []);
    }
    for (const [peer, ids] of byPeer)
      this.sendPeer(peer, { case: "heartbeat", value: { transferIds: ids } });
  }

  // --- the sweep -------------------------------------------------------------------

  /** Visits every entry of every table: deadlines are not ordered. */
  private sweep(): void {
    const now = Date.now();
    for (const t of this.pTransfers.values()) {
      if (now < t.deadline) continue;
      if (isTerminal(t.state)) {
        this.pTransfers.delete(t.id);
      } else if (t.state === "HELD") {
        this.endP(t, "EXPIRED", "lease expired", ReleaseReason.EXPIRED);
      } else if (t.state === "WAITING") {
        // A registration nobody's prefill finished in time.
        if (t.reg !== undefined)
          this.sendPeer(t.reg.peer, {
            case: "failed",
            value: {
              transferId: t.id,
              code: "ERR_TIMEOUT",
              message: "no prefill before the registration lease ran out",
            },
          });
        this.endP(t, "EXPIRED", "registration lease expired", ReleaseReason.EXPIRED);
      }
      // MOVING ends when its writes settle; each write is bounded by the endpoint.
    }
    for (const t of this.dTransfers.values()) {
      if (now < t.deadline) continue;
      if (isTerminal(t.state)) {
        this.dTransfers.delete(t.id);
      } else if (t.failing !== undefined) {
        if (t.readsInFlight === 0) this.finishFailingD(t); // P's registration lease has run out
      } else {
        this.failD(
          t,
          "EXPIRED",
          FailureReason.TIMEOUT,
          "ERR_TIMEOUT",
          `no KV within ${this.opts.transferTimeoutMs} ms`,
          ReleaseReason.EXPIRED,
          t.state === "WAITING" && t.peer === undefined,
        );
      }
    }
    if (this.metrics !== undefined) {
      this.metrics.setQueueDepth("prefill_live", this.countLive(this.pTransfers));
      this.metrics.setQueueDepth("decode_live", this.countLive(this.dTransfers));
      this.metrics.setQueueDepth(
        "agents_inflight",
        this.agents.reduce((n, a) => n + a.inflight, 0),
      );
    }
    for (const peer of [...this.peers.values()]) {
      if (peer.state !== "connected" || now - peer.lastSeenMs < this.opts.peerTimeoutMs) continue;
      if (this.hasLiveTransfersWith(peer)) {
        this.dropPeer(peer, `silent for ${now - peer.lastSeenMs} ms`);
      } else if (now - peer.lastSeenMs > this.opts.tombstoneMs) {
        // Idle and unheard of for long: forget it (a new transfer handshakes again).
        this.peers.delete(peer.engineId);
        if (this.peerByAddress.get(peer.dialedAddress) === peer.engineId)
          this.peerByAddress.delete(peer.dialedAddress);
        peer.close();
      }
    }
  }

  /** Why `ids` may not be claimed by `transferId` (the first block another transfer holds). */
  private claimClash(
    claims: Map<number, string>,
    ids: readonly number[],
    firstIndex: number,
    transferId: string,
  ): string | undefined {
    for (const [i, id] of ids.entries()) {
      const holder = claims.get(id);
      if (holder !== undefined && holder !== transferId) {
        return (
          `block_ids[${firstIndex + i}] = ${id} is held by live transfer '${holder}' ` +
          `(two live transfers may not claim one block; retry once it ends)`
        );
      }
    }
    return undefined;
  }

  private claim(claims: Map<number, string>, ids: readonly number[], transferId: string): void {
    for (const id of ids) claims.set(id, transferId);
  }

  /** Drops `transferId`'s claims among `ids` (unclaiming ids it never claimed is harmless). */
  private unclaim(claims: Map<number, string>, ids: readonly number[], transferId: string): void {
    for (const id of ids) if (claims.get(id) === transferId) claims.delete(id);
  }

  private hasLiveTransfersWith(peer: PeerState): boolean {
    for (const d of this.dTransfers.values())
      if (d.peer === peer && !isTerminal(d.state)) return true;
    for (const p of this.pTransfers.values())
      if (p.reg?.peer === peer && !isTerminal(p.state)) return true;
    return false;
  }

  /** Live entries at the cap. Cheap while the table (tombstones included) is below it. */
  private atCapacity(table: Map<string, { state: TransferState }>): boolean {
    return table.size >= this.opts.maxTransfers && this.countLive(table) >= this.opts.maxTransfers;
  }

  private countLive(table: Map<string, { state: TransferState }>): number {
    let n = 0;
    for (const t of table.values()) if (!isTerminal(t.state)) n++;
    return n;
  }

  private emit(
    kind: EventKind,
    transferId: string,
    peer: string,
    side: "prefill" | "decode" | "",
    reason: string,
    bytes: number,
    mode: string,
  ): void {
    this.events.append({ kind, timeMs: Date.now(), transferId, peer, side, reason, bytes, mode });
  }

  // --- SidecarView -------------------------------------------------------------------

  status(): SidecarStatus {
    const byState: Record<string, number> = {};
    for (const t of this.pTransfers.values())
      byState[`prefill:${t.state}`] = (byState[`prefill:${t.state}`] ?? 0) + 1;
    for (const t of this.dTransfers.values())
      byState[`decode:${t.state}`] = (byState[`decode:${t.state}`] ?? 0) + 1;
    const l = this.layout;
    let lease = 0;
    for (const t of this.pTransfers.values())
      if (t.state === "HELD" || t.state === "WAITING") lease++;
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
      draining: this.draining,
      peers: [...this.peers.values()].map((p) => ({
        engineId: p.engineId,
        epoch: p.epoch,
        state: p.state,
        lastSeenMs: p.lastSeenMs,
        sideChannel: p.sideChannel,
      })),
      transfersByState: byState,
      bytesMoved: this.bytesMoved,
      transfersMoved: this.transfersMoved,
      leaseTableSize: lease,
      lastErrors: [...this.lastErrors],
    };
  }

  transfers(filter: TransferFilter = {}): TransferInfo[] {
    const out: TransferInfo[] = [];
    const want = filter.states === undefined ? undefined : new Set(filter.states);
    const add = (info: TransferInfo): void => {
      if (want !== undefined && !want.has(info.state)) return;
      if (filter.peer !== undefined && filter.peer !== "" && info.peer !== filter.peer) return;
      out.push(info);
    };
    for (const t of this.pTransfers.values()) {
      add({
        transferId: t.id,
        side: "prefill",
        mode: t.mode,
        state: t.state,
        peer: t.peer,
        bytes: t.bytes,
        descriptors: t.descriptors,
        reason: t.reason,
        timings: { ...t.t },
      });
    }
    for (const t of this.dTransfers.values()) {
      add({
        transferId: t.id,
        side: "decode",
        mode: t.mode,
        state: t.state,
        peer: t.peer?.engineId ?? "",
        bytes: t.bytes,
        descriptors: t.descriptors,
        reason: t.reason,
        timings: { ...t.t },
      });
    }
    return out;
  }
}

function e2code(err: PlanError): string {
  return err.code === "ERR_LAYOUT_INCOMPATIBLE" ? "ERR_LAYOUT_INCOMPATIBLE" : err.code;
}
