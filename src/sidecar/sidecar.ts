/**
 * The sidecar, a thin facade: it builds the parts and wires them (the KV registry, the peer
 * table, PrefillSide and DecodeSide, the engine and peer dispatch, the sweep, the event outbox)
 * and answers for them to the composition root (start, drain, close) and the API (SidecarView).
 * Every transfer reaches exactly one terminal state per side, within a bound, as one event
 * (lifecycle.ts, docs/protocol.md). Reading order: src/sidecar/README.md.
 */
import { randomBytes } from "node:crypto";
import type { Logger } from "pino";

import type { EngineToSidecar } from "../gen/kvxfer/v1/engine_pb.js";
import { KvxferError } from "../errors.js";
import { describeUcx, ucxInfo } from "../native/index.js";
import { engineIdProblem } from "../engine/validate.js";
import { PeerTable, type PeerTableHost } from "../peer/peer-table.js";
import { SideChannelServer, checkCredentials } from "../peer/side-channel.js";
import { systemClock, type Clock } from "./clock.js";
import type { SideContext } from "./context.js";
import { DecodeSide } from "./decode.js";
import { EngineDispatch } from "./engine-dispatch.js";
import { EngineOutbox, LastErrors, type EngineSender } from "./engine-port.js";
import { EventOutbox, type EventSink } from "./event-port.js";
import { KvRegistry, type EngineConnection } from "./kv-registration.js";
import type { TransferMetrics } from "./metrics.js";
import {
  checkPeerExposure,
  resolveOptions,
  type ResolvedOptions,
  type SidecarOptions,
} from "./options.js";
import { PeerDispatch } from "./peer-dispatch.js";
import { PrefillSide } from "./prefill.js";
import { SidecarLifecycle } from "./sidecar-lifecycle.js";
import { filterTransfers, sidecarStatus, ucxStatus } from "./status-view.js";
import { Sweeper } from "./sweep.js";
import type {
  SidecarRole,
  SidecarStatus,
  SidecarView,
  TransferFilter,
  TransferInfo,
  TransferMode,
  TransferSide,
} from "./view.js";

export type { EngineSender } from "./engine-port.js";
export type { EventSink } from "./event-port.js";
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
  /** Terminal and peer events, to the event log (event-port.ts). */
  private readonly events: EventOutbox;
  private metrics: TransferMetrics | undefined;
  private readonly clock: Clock;

  /** The engine's KV registration (kv-registration.ts): the registered KV, once accepted. */
  private readonly kvs: KvRegistry;
  /** The side channel: handshakes from peers (src/peer/side-channel.ts). */
  private readonly channel: SideChannelServer;
  private sideChannel = "";

  private readonly peers: PeerTable;
  private readonly prefill: PrefillSide;
  private readonly decode: DecodeSide;
  /** The engine's messages and the peers' notifications, each to the part that owns it. */
  private readonly engineIn: EngineDispatch;
  private readonly peerIn: PeerDispatch;

  /** The sweep and the heartbeats (sweep.ts). */
  private readonly clockwork: Sweeper;
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
    this.events = new EventOutbox(this.clock, this.engineId, this.log, options.tracer, (side, id) =>
      (side === "prefill" ? this.prefill : this.decode).infoOf(id),
    );
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
        agent.on("notifications", (batch) => this.peerIn.receive(rank, batch));
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
    const parts = { role: this.role, prefill: this.prefill, decode: this.decode };
    this.engineIn = new EngineDispatch({
      ...parts,
      mode: this.mode,
      log: this.log,
      engine: this.engine,
      kvs: this.kvs,
      life: this.life,
      noteError: (text) => this.noteError(text),
    });
    this.peerIn = new PeerDispatch({
      ...parts,
      clock: this.clock,
      peers: this.peers,
      messagesPerSec: this.opts.peerMessagesPerSec,
    });
    this.clockwork = new Sweeper({
      ...parts,
      clock: this.clock,
      log: this.log,
      kvs: this.kvs,
      peers: this.peers,
      peerIn: this.peerIn,
      messagesPerSec: this.opts.peerMessagesPerSec,
      metrics: () => this.metrics,
      noteError: (text) => this.noteError(text),
    });
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
    this.events.sink = events;
    this.metrics = metrics;
    checkPeerExposure(this.opts, this.log);
    this.sideChannel = await this.channel.bind(this.opts.listen);
    this.clockwork.start(this.opts.sweepMs, this.opts.heartbeatMs);
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
    this.clockwork.stop();
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
   * Handles one message from the engine (engine-dispatch.ts); never throws. `reply` reaches the
   * connection that sent it: refusals and the answer to a registration go there.
   */
  onEngineMessage(msg: EngineToSidecar, reply?: EngineSender, conn?: EngineConnection): void {
    this.engineIn.receive(msg, reply, conn);
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
        this.events.emit(kind, transferId, peer, side, reason, bytes, mode),
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
      emit: (kind, peer, reason) => this.events.emit(kind, "", peer, "", reason, 0, ""),
      noteError: (text) => this.noteError(text),
      peerDown: (peer, why) => {
        this.decode.peerDown(peer, why);
        this.prefill.peerDown(peer);
      },
      busyWith: (peer) => this.decode.readingFrom(peer) || this.prefill.writingTo(peer),
      liveWith: (peer) => this.decode.liveWith(peer) || this.prefill.liveWith(peer),
    };
  }

  // --- SidecarView -------------------------------------------------------------------

  status(): SidecarStatus {
    return sidecarStatus({
      engineId: this.engineId,
      epoch: this.epoch,
      role: this.role,
      mode: this.mode,
      startedMs: this.startedMs,
      draining: this.life.draining,
      kv: this.kvs.kv,
      peers: this.peers.list(),
      transfers: [...this.prefill.list(), ...this.decode.list()],
      bytesMoved: this.bytesMoved,
      transfersMoved: this.transfersMoved,
      leaseTableSize: this.prefill.leased(),
      lastErrors: this.errors.list(),
      ucx: this.ucxStatus(),
    });
  }

  /** The UCX the agents run on (status-view.ts). */
  ucxStatus(): { version: string; transports: string[]; memoryTypes: string[] } {
    return ucxStatus(this.kvs.kv, this.opts.transports);
  }

  traced(transferId: string, side: TransferSide | "", hop: string): void {
    if (side !== "decode") this.prefill.mark(transferId, hop);
    if (side !== "prefill") this.decode.mark(transferId, hop);
  }

  transfers(filter: TransferFilter = {}): TransferInfo[] {
    return filterTransfers([...this.prefill.list(), ...this.decode.list()], filter);
  }
}
