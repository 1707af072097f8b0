/**
 * The sidecar, a thin facade: it builds the ports (the last errors, the tally, the engine and
 * event outboxes, its own lifecycle, the side channel) and hands them to the parts (the KV
 * registry, the sides and peer table in sides.ts, the engine and peer dispatch, the sweep), which
 * reach each other through those objects, never back through here; and it answers for them to
 * the composition root (start, drain, close) and the API (SidecarView).
 * Every transfer reaches exactly one terminal state per side, within a bound, as one event
 * (lifecycle.ts, docs/protocol.md). Reading order: src/sidecar/README.md.
 */
import { randomBytes } from "node:crypto";
import type { Logger } from "pino";

import type { EngineToSidecar } from "../gen/kvxfer/v1/engine_pb.js";
import { KvxferError } from "../errors.js";
import { describeUcx, ucxGetReplyFix, ucxInfo, type Agent } from "../native/index.js";
import { engineIdProblem } from "../engine/validate.js";
import { SideChannelServer, checkCredentials } from "../peer/side-channel.js";
import { systemClock } from "./clock.js";
import { EngineDispatch } from "./engine-dispatch.js";
import { EngineOutbox, LastErrors, type EngineSender } from "./engine-port.js";
import { EventOutbox, type EventSink } from "./event-port.js";
import { KvRegistry, type EngineConnection } from "./kv-registration.js";
import { Tally, type TransferMetrics } from "./metrics.js";
import {
  checkPeerExposure,
  resolveOptions,
  type ResolvedOptions,
  type SidecarOptions,
} from "./options.js";
import { PeerDispatch } from "./peer-dispatch.js";
import { SidecarLifecycle } from "./sidecar-lifecycle.js";
import { Sides } from "./sides.js";
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
  /** The last errors, kept for GetStatus. */
  private readonly errors = new LastErrors();
  /** The KV moved and the metrics, once started (metrics.ts). */
  private readonly tally = new Tally();
  /** The engine: messages to it, answers to the sender of the message being handled. */
  private readonly engine: EngineOutbox;
  /** Terminal and peer events, to the event log (event-port.ts). */
  private readonly events: EventOutbox;
  /** UNREGISTERED, SERVING, DRAINING, CLOSED (sidecar-lifecycle.ts). */
  private readonly life = new SidecarLifecycle();
  /** The side channel: handshakes from peers (src/peer/side-channel.ts). */
  private readonly channel: SideChannelServer;
  /** The engine's KV registration (kv-registration.ts): the registered KV, once accepted. */
  private readonly kvs: KvRegistry;
  /** PrefillSide, DecodeSide and the peer table between them (sides.ts). */
  private readonly sides: Sides;
  /** The engine's messages and the peers' notifications, each to the part that owns it. */
  private readonly engineIn: EngineDispatch;
  private readonly peerIn: PeerDispatch;
  /** The sweep and the heartbeats (sweep.ts). */
  private readonly clockwork: Sweeper;

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
    const clock = options.clock ?? systemClock;
    this.events = new EventOutbox(clock, this.engineId, this.log, options.tracer, (side, id) =>
      this.sides.infoOf(side, id),
    );
    this.opts = resolveOptions(options);
    if (options.peerCredentials !== undefined)
      checkCredentials(options.peerCredentials, options.engineId);
    this.channel = new SideChannelServer(
      (req, identity) => this.sides.peers.onHandshake(req, identity),
      this.log.child({ component: "side-channel" }),
      (code, message) => this.noteError(`handshake refused: ${code}: ${message}`),
      options.peerCredentials,
    );
    // The ports every part is built with: each reaches the others through these objects.
    const { engineId, epoch, role, mode, log, opts, errors, tally, engine, events, life, channel } =
      this;
    const ports = {
      engineId,
      epoch,
      role,
      mode,
      clock,
      log,
      opts,
      settings: opts,
      errors,
      tally,
      engine,
      events,
      life,
      channel,
      messagesPerSec: opts.peerMessagesPerSec,
    };
    // A registered rank's agent is wired to the peer dispatch (built below, with the sides).
    const agents = { wire: (agent: Agent, rank: number) => this.peerIn.wire(agent, rank) };
    this.kvs = new KvRegistry({ ...ports, agents });
    this.sides = new Sides({ ...ports, kvs: this.kvs }, opts);
    const { peers, prefill, decode } = this.sides;
    const parts = { ...ports, kvs: this.kvs, peers, prefill, decode };
    this.engineIn = new EngineDispatch(parts);
    this.peerIn = new PeerDispatch(parts);
    this.clockwork = new Sweeper({ ...parts, peerIn: this.peerIn });
  }

  /** Binds the side channel and starts the sweep and heartbeats. */
  async start(
    engineSend: EngineSender,
    events: EventSink,
    metrics?: TransferMetrics,
  ): Promise<string> {
    this.engine.connect(engineSend);
    this.events.sink = events;
    this.tally.metrics = metrics;
    checkPeerExposure(this.opts, this.log);
    const sideChannel = await this.channel.bind(this.opts.listen);
    this.clockwork.start(this.opts.sweepMs, this.opts.heartbeatMs);
    this.log.info(
      {
        sideChannel,
        epoch: String(this.epoch),
        role: this.role,
        mode: this.mode,
        ucx: describeUcx(ucxInfo(this.opts.transports)),
        ucxGetReplyFix: ucxGetReplyFix(),
      },
      "sidecar started",
    );
    return sideChannel;
  }

  get sideChannelAddress(): string {
    return this.channel.address;
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
    return { prefill: this.sides.prefill.live(), decode: this.sides.decode.live() };
  }

  /**
   * SIGTERM: new transfers are refused from now on, and what will not happen is told to the
   * peers at once (P: registrations waiting for a PrefillDone it will refuse).
   */
  beginDrain(): void {
    if (!this.life.on("DRAIN")) return;
    this.sides.prefill.drain();
  }

  /** The drain's deadline passed: the transfers left fail now, each peer told (before close). */
  abandonAll(): void {
    this.sides.abandon();
  }

  /** Draining: no new transfers or handshakes (beginDrain). */
  get draining(): boolean {
    return this.life.draining;
  }

  /** Live (non-terminal) transfers on both sides. */
  liveTransfers(): number {
    return this.sides.live();
  }

  async close(): Promise<void> {
    if (!this.life.on("CLOSE")) return;
    this.clockwork.stop();
    await this.channel.close();
    this.sides.peers.close();
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
      peers: this.sides.peers.list(),
      transfers: this.sides.list(),
      bytesMoved: this.tally.bytesMoved,
      transfersMoved: this.tally.transfersMoved,
      leaseTableSize: this.sides.prefill.leased(),
      lastErrors: this.errors.list(),
      ucx: this.ucxStatus(),
    });
  }

  /** The UCX the agents run on (status-view.ts). */
  ucxStatus(): { version: string; transports: string[]; memoryTypes: string[] } {
    return ucxStatus(this.kvs.kv, this.opts.transports);
  }

  traced(transferId: string, side: TransferSide | "", hop: string): void {
    this.sides.mark(transferId, side, hop);
  }

  transfers(filter: TransferFilter = {}): TransferInfo[] {
    return filterTransfers(this.sides.list(), filter);
  }
}
