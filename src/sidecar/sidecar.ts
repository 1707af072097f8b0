/**
 * The sidecar, a thin facade: its options, the engine's KV registration, dispatch of engine and
 * peer messages to the part that owns them (PrefillSide, DecodeSide, PeerTable), one sweep that
 * runs each part's expiry, heartbeats, and the status view. Every transfer reaches exactly one
 * terminal state per side, within a bound, as one event (lifecycle.ts, docs/protocol.md).
 * Reading order: src/sidecar/README.md.
 */
import { randomBytes } from "node:crypto";
import type { Tracer } from "@opentelemetry/api";
import type { Logger } from "pino";

import { ReleaseReason, type EngineToSidecar } from "../gen/kvxfer/v1/engine_pb.js";
import { KvxferError } from "../errors.js";
import { describeUcx, ucxInfo, type Notification } from "../native/index.js";
import { checkEngineMessage, engineIdProblem } from "../engine/validate.js";
import {
  SideChannelServer,
  checkCredentials,
  isLoopback,
  parseAddress,
} from "../peer/side-channel.js";
import { systemClock, type Clock } from "./clock.js";
import type { SideContext } from "./context.js";
import { DecodeSide } from "./decode.js";
import { EngineOutbox, LastErrors, type EngineSender } from "./engine-port.js";

import { KvRegistry, type EngineConnection } from "./kv-registration.js";
import { resolveOptions, type ResolvedOptions, type SidecarOptions } from "./options.js";
import { SidecarLifecycle } from "./sidecar-lifecycle.js";

import type { TransferMetrics } from "./metrics.js";
import { PeerTable, type PeerTableHost } from "../peer/peer-table.js";
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

/** Where terminal and peer events go (the event log). */
export interface EventSink {
  append(ev: Omit<SidecarEvent, "seq">): unknown;
}

export type { EngineSender } from "./engine-port.js";
export type { SidecarOptions } from "./options.js";

export class Sidecar implements SidecarView {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly role: SidecarRole;
  readonly mode: TransferMode;
  readonly startedMs = Date.now();
  private readonly opts: ResolvedOptions;
  private readonly log: Logger;
  /** Kept for GetStatus. */
  private readonly errors = new LastErrors();
  /** The engine: messages to it, answers to the sender of the message being handled. */
  private readonly engine: EngineOutbox;
  private events: EventSink = { append: () => undefined };
  private metrics: TransferMetrics | undefined;
  private readonly clock: Clock;
  private readonly tracer: Tracer | undefined;

  /** The engine's KV registration (kv-registration.ts): the registered KV, once accepted. */
  private readonly kvs: KvRegistry;
  /** The side channel: handshakes from peers (src/peer/side-channel.ts). */
  private readonly channel: SideChannelServer;
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

  constructor(options: SidecarOptions) {
    const idProblem = engineIdProblem(options.engineId, "--engine-id");
    if (idProblem !== undefined) throw new KvxferError("ERR_INVALID_ARGUMENT", idProblem);
    this.engineId = options.engineId;
    this.role = options.role;
    this.mode = options.mode;
    // A random non-zero epoch: a restarted sidecar is a new peer.
    this.epoch = randomBytes(8).readBigUInt64BE() | 1n;
    this.log = options.logger.child({ component: "sidecar", engineId: options.engineId });
    this.engine = new EngineOutbox(this.log, this.errors);
    this.clock = options.clock ?? systemClock;
    this.tracer = options.tracer;
    this.opts = resolveOptions(options);
    if (options.peerCredentials !== undefined)
      checkCredentials(options.peerCredentials, options.engineId);
    this.kvs = new KvRegistry({
      engineId: this.engineId,
      epoch: this.epoch,
      opts: this.opts,
      log: this.log,
      noteError: (text) => this.noteError(text),
      answer: (msg) => this.engine.answer(msg),
      sideChannel: () => this.sideChannel,
      wire: (agent, rank) => {
        agent.on("notifications", (batch) => this.onNotifications(rank, batch));
        agent.on("endpointFailed", (ep, code) => this.peers.endpointFailed(ep, code));
        agent.on("notificationDropped", (peer, bytes) =>
          this.noteError(
            `peer message from '${peer.slice(0, 200)}' refused: ERR_TOO_LARGE (${bytes} bytes)`,
          ),
        );
      },
      registered: () => this.life.on("REGISTERED"),
    });
    this.peers = new PeerTable(this.peerHost(), this.opts);
    const ctx = this.sideContext();
    this.prefill = new PrefillSide(ctx);
    this.decode = new DecodeSide(ctx, (address) => this.peers.resolve(address));
    this.channel = new SideChannelServer(
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
    this.engine.connect(engineSend);
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
    this.sideChannel = await this.channel.bind(this.opts.listen);
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
    return this.kvs.kv !== undefined;
  }

  /**
   * Whether the registered engine removed its KV: every file of the accepted registration is
   * gone from disk or replaced (the simulated engine and the vLLM connector remove theirs when
   * they end). A segment shows nothing here: false.
   */
  engineFilesGone(): boolean {
    return this.kvs.filesGone();
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
    await this.channel.close();
    this.peers.close();
    this.kvs.close();
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
    this.engine.replyingTo(reply);
    try {
      if (msg.msg.case === "register") {
        this.kvs.register(msg.msg.value, conn);
        return;
      }
      if (msg.msg.case === "allocate") {
        this.kvs.allocate(msg.msg.value, conn);
        return;
      }
      // One place checks engine messages' fields; a problem costs only the message.
      const problem = checkEngineMessage(msg, this.kvs.kv?.layout);
      if (problem !== undefined) {
        this.engine.refuse(problem.transferId, problem.code, problem.message);
        return;
      }
      if (this.life.draining && (msg.msg.case === "prefillDone" || msg.msg.case === "expectKv")) {
        // Blocks of a refused PrefillDone go straight back: no one will read them.
        if (msg.msg.case === "prefillDone") {
          this.engine.send({
            case: "releaseBlocks",
            value: {
              transferId: msg.msg.value.transferId,
              blockIds: msg.msg.value.blockIds,
              reason: ReleaseReason.FAILED,
            },
          });
        }
        if (msg.msg.case === "expectKv") this.decode.tellSourceDraining(msg.msg.value);
        this.engine.refuse(
          msg.msg.value.transferId,
          "ERR_DRAINING",
          "the sidecar is draining (SIGTERM): no new transfers",
        );
        return;
      }
      switch (msg.msg.case) {
        case "prefillDone":
          if (this.role === "decode")
            return this.engine.refuse(
              msg.msg.value.transferId,
              "ERR_WRONG_ROLE",
              "PrefillDone sent to a decode sidecar",
            );
          this.prefill.prefillDone(msg.msg.value, receivedUs);
          break;
        case "expectKv":
          if (this.role === "prefill")
            return this.engine.refuse(
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
          this.engine.refuse("", "ERR_MALFORMED", "engine message carries no body");
      }
    } catch (err) {
      const e = KvxferError.from(err);
      this.noteError(`engine message: ${e.code} ${e.message}`);
      this.log.error({ err }, "engine message failed");
    } finally {
      this.engine.replyingTo(undefined);
    }
  }

  /** Keeps the last errors for GetStatus (bounded). */
  noteError(text: string): void {
    this.errors.note(text);
  }

  /** The engine link connection `id` ended: what it allocated and did not register is freed. */
  engineConnectionEnded(id: string): void {
    this.kvs.connectionEnded(id);
  }

  // --- the parts' contexts -----------------------------------------------------------

  /** What PrefillSide and DecodeSide may do: the narrow context (context.ts). */
  private sideContext(): SideContext {
    return {
      clock: this.clock,
      settings: this.opts,
      log: this.log,
      kv: () => this.kvs.kv,
      engine: this.engine,
      peers: this.peers,
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

  /** What the peer table needs of this sidecar. */
  private peerHost(): PeerTableHost {
    return {
      engineId: this.engineId,
      epoch: this.epoch,
      role: this.role,
      clock: this.clock,
      log: this.log,
      sideChannel: () => this.sideChannel,
      kv: () => this.kvs.kv,
      notAccepting: () =>
        this.kvs.kv === undefined
          ? { code: "ERR_NOT_READY", message: "the engine has not registered its KV cache" }
          : this.life.draining
            ? { code: "ERR_DRAINING", message: "the sidecar is draining" }
            : undefined,
      authenticated: () => this.channel.authenticated,
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
      return this.engine.refuse(transferId, "ERR_UNKNOWN_TRANSFER", `no transfer '${transferId}'`);
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
    const broken = this.kvs.newlyBroken();
    if (broken !== undefined) {
      this.noteError(`ERR_REGION_CHANGED: ${broken}`);
      this.log.error({ problem: broken }, "a KV file shrank under the sidecar");
      this.prefill.failHeld("ERR_REGION_CHANGED");
    }
    this.prefill.expire(now);
    this.decode.expire(now);
    if (this.metrics !== undefined) {
      this.metrics.setQueueDepth("prefill_live", this.prefill.live());
      this.metrics.setQueueDepth("decode_live", this.decode.live());
      this.metrics.setQueueDepth(
        "agents_inflight",
        (this.kvs.kv?.agents ?? []).reduce((n, a) => n + a.inflight, 0),
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
    const l = this.kvs.kv?.layout;
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
      lastErrors: this.errors.list(),
      ucx: this.ucxStatus(),
    };
  }

  /**
   * The UCX the agents run on: what the first registered agent's context opened, or before any
   * registration what a context with this sidecar's transport list opens.
   */
  ucxStatus(): { version: string; transports: string[]; memoryTypes: string[] } {
    const agent = this.kvs.kv?.agents[0];
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
