/**
 * D's side of every transfer: the table of D's transfers, their lifecycle (lifecycle.ts), and
 * every handler that moves one: the engine's ExpectKv and Abort, P's XferDone, ReadAck,
 * AbortAck and Failed, the watchdog, and P going down. D registers its blocks with P (push) or
 * reads P's (pull), tells its engine KvReady or KvFailed, and gives the blocks back only when
 * no write into them can still land.
 */
import { FailureReason, ReleaseReason, type ExpectKv } from "../gen/kvxfer/v1/engine_pb.js";
import type { XferDone } from "../gen/kvxfer/v1/peer_pb.js";
import type { Notification, OpTrace } from "../native/index.js";
import { KvxferError } from "../errors.js";

import {
  descriptorsForSide,
  planPaired,
  type LayoutPairing,
  type TransferPlan,
} from "../plan/index.js";
import { BlockClaims } from "./claims.js";
import { transferError, type SideContext } from "./context.js";
import {
  DECODE_INITIAL,
  DECODE_NEXT,
  isTerminal,
  transition,
  type DecodeState,
} from "./lifecycle.js";
import type { PeerState } from "./peers.js";
import { SideTable } from "./side-table.js";
import { newTimings, type Timings } from "./timings.js";
import { markPairSteps, stepName, TransferTrace } from "./trace.js";
import type { TerminalKind, TransferInfo } from "./view.js";

/** How a failing transfer ends once it is safe (decided when the failure began). */
interface Outcome {
  kind: DecodeState & TerminalKind;
  reason: FailureReason;
  code: string;
  release: ReleaseReason;
}

/** D's side of one transfer. */
export interface DecodeTransfer {
  readonly id: string;
  readonly state: DecodeState;
  source: string;
  peer: PeerState | undefined;
  dstBlocks: number[];
  /** The blocks this transfer writes, claimed until its end (see `claims`). */
  written: number[];
  srcBlocks: number[] | undefined;
  numTokens: number;
  prefixTokens: number;
  /** ExpectKv.token, presented to P. */
  token: string;
  mode: "push" | "pull";
  expectedPairs: Set<string>;
  donePairs: Set<string>;
  /** Watchdog, or (DRAINING) when the blocks may be released. */
  deadline: number;
  /** Last time D renewed P's registration (push), for the abort drain bound. */
  lastRenewMs: number;
  /** Set with KvFailed: how the transfer ends once DRAINING is over. */
  outcome: Outcome | undefined;
  readsInFlight: number;
  /** Push: P's time from PrefillDone to posting its last pair's writes (from the XferDones). */
  sincePrefillDoneMs: number;
  /** Pull: when P first answered that it does not know the transfer (0: it has not). */
  unknownSinceMs: number;
  bytes: number;
  descriptors: number;
  reason: string;
  t: Timings;
  trace: TransferTrace;
}

/** Pull: how long D keeps asking P about a transfer P says it does not know. */
export const UNKNOWN_GIVE_UP_MS = 5000;

/** How D reaches P: its metadata from the cache or by a handshake. */
export type PeerResolver = (sideChannel: string) => Promise<PeerState>;

export class DecodeSide extends SideTable<DecodeState, DecodeTransfer> {
  /**
   * A transfer claims the blocks it writes: `block_ids` entries floor(prefix_tokens / block) ..
   * ceil(num_tokens / block) - 1 (the prefix blocks before them are only read by the engine,
   * and vLLM's prefix cache legitimately shares them between requests; ids past the tokens are
   * not written). Claimed from ExpectKv until the terminal state (KV_READY, or the ReleaseBlocks
   * after a failure: a failing transfer still holds them, as a write may still land).
   */
  private readonly claims = new BlockClaims();

  constructor(
    ctx: SideContext,
    private readonly resolvePeer: PeerResolver,
  ) {
    super(ctx, "decode", DECODE_INITIAL, DECODE_NEXT);
  }

  protected enter(t: DecodeTransfer, to: DecodeState): void {
    const now = this.ctx.clock.now();
    const s = this.ctx.settings;
    switch (to) {
      case "WAITING":
        t.t.registeredMs = now;
        t.deadline = now + s.transferTimeoutMs;
        break;
      case "MOVING":
        if (t.mode === "pull") t.t.dataStartedMs = now;
        else t.lastRenewMs = now;
        break;
      case "CONFIRMING":
        break;
      case "DRAINING":
        // A push may still be written until P's registration lease (renewed by our
        // heartbeats) has run out; reads settle by themselves.
        if (t.mode === "push" && t.peer !== undefined)
          t.deadline = t.lastRenewMs + s.regLeaseMs + s.abortGraceMs;
        break;
      case "KV_READY":
        t.t.readyMs = now;
        t.t.endedMs = now;
        t.deadline = now + s.tombstoneMs;
        break;
      default:
        t.t.endedMs = now;
        t.deadline = now + s.tombstoneMs;
    }
  }

  protected exit(t: DecodeTransfer, kind: DecodeState & TerminalKind): void {
    const { ctx } = this;
    this.claims.release(t.written, t.id);
    const peer = t.peer?.engineId ?? "";
    if (kind === "KV_READY") {
      ctx.toEngine({ case: "kvReady", value: { transferId: t.id } });
      t.trace.mark("engine.kvReady sent");
      // Prefill done -> ready: for push P reports its side up to posting the writes (the data
      // time itself is not in it: the XferDone is sealed before the writes and travels with
      // them); for pull the router sent ExpectKv only once prefill was done, so registration
      // stands in for it.
      const latency = t.mode === "push" ? t.sincePrefillDoneMs : ctx.clock.now() - t.t.registeredMs;
      ctx.metrics()?.transferReady(t.mode, latency, t.bytes, t.descriptors);
      ctx.emit("KV_READY", t.id, peer, "decode", "", t.bytes, t.mode);
      t.trace.mark("event.appended");
      return;
    }
    const o = t.outcome!;
    ctx.toEngine({
      case: "releaseBlocks",
      value: { transferId: t.id, blockIds: t.dstBlocks, reason: o.release },
    });
    ctx.emit(kind, t.id, peer, "decode", o.code, t.bytes, t.mode);
    t.trace.mark("event.appended");
  }

  protected info(t: DecodeTransfer): TransferInfo {
    return {
      transferId: t.id,
      side: "decode",
      mode: t.mode,
      state: t.state,
      peer: t.peer?.engineId ?? "",
      bytes: t.bytes,
      descriptors: t.descriptors,
      reason: t.reason,
      timings: { ...t.t },
      trace: t.trace.hops,
    };
  }

  // --- the engine ----------------------------------------------------------------

  /** `receivedUs`: when the engine's message arrived (monoUs). */
  expectKv(m: ExpectKv, pullWanted: boolean, receivedUs?: number): void {
    const { ctx } = this;
    const existing = this.transfers.get(m.transferId);
    if (existing !== undefined) {
      return ctx.refuse(
        m.transferId,
        "ERR_DUPLICATE",
        `ExpectKv for transfer '${m.transferId}' already received`,
      );
    }
    if (this.atCapacity()) {
      return ctx.refuse(
        m.transferId,
        "ERR_OVERLOADED",
        `${ctx.settings.maxTransfers} transfers live`,
      );
    }
    // The blocks this transfer writes (see `claims`); the engine's checks guarantee the count.
    const bs = ctx.kv()!.layout.blockSize;
    const firstWritten = Math.floor(m.prefixTokens / bs);
    const written = m.blockIds.slice(firstWritten, Math.ceil(m.numTokens / bs));
    const clash = this.claims.clash(written, firstWritten, m.transferId);
    if (clash !== undefined) return ctx.refuse(m.transferId, "ERR_BLOCKS_IN_USE", clash);
    const hasSrc = m.hasSourceBlockIds;
    if (pullWanted && !hasSrc)
      return ctx.refuse(
        m.transferId,
        "ERR_NO_SOURCE_BLOCKS",
        "pull mode needs ExpectKv.source_block_ids",
      );
    const t: DecodeTransfer = {
      id: m.transferId,
      state: "WAITING",
      source: m.source,
      peer: undefined,
      dstBlocks: [...m.blockIds],
      written,
      srcBlocks: hasSrc ? [...m.sourceBlockIds] : undefined,
      numTokens: m.numTokens,
      prefixTokens: m.prefixTokens,
      token: m.token,
      mode: pullWanted ? "pull" : "push",
      expectedPairs: new Set(),
      donePairs: new Set(),
      deadline: 0,
      lastRenewMs: ctx.clock.now(),
      outcome: undefined,
      readsInFlight: 0,
      sincePrefillDoneMs: 0,
      unknownSinceMs: 0,
      bytes: 0,
      descriptors: 0,
      reason: "",
      t: newTimings(),
      trace: new TransferTrace(),
    };
    t.trace.mark("engine.expectKv", receivedUs);
    this.claims.claim(written, t.id);
    this.track(t, "WAITING", "ExpectKv");
    void this.start(t);
  }

  /**
   * The sidecar stops with transfers left: each fails now (the engine recomputes) and P is told
   * (a pull's Abort lets it free its blocks; a push's Abort stops its writes and frees them).
   */
  abandon(): void {
    for (const t of this.transfers.values()) {
      if (isTerminal(t.state) || t.state === "DRAINING") continue;
      const safe = t.state === "WAITING" && (t.mode === "pull" || t.peer === undefined);
      this.fail(
        t,
        "ABORTED",
        FailureReason.ABORTED,
        "ERR_DRAINING",
        "the decode sidecar is stopping",
        ReleaseReason.ABORTED,
        safe,
      );
    }
  }

  /** The engine aborts: KvFailed at once, the blocks once no write can land. */
  abort(transferId: string): void {
    const t = this.transfers.get(transferId);
    if (t === undefined || isTerminal(t.state)) return;
    const safe = t.state === "WAITING" && (t.mode === "pull" || t.peer === undefined);
    this.fail(
      t,
      "ABORTED",
      FailureReason.ABORTED,
      "ERR_ABORTED",
      "aborted by the engine",
      ReleaseReason.ABORTED,
      safe,
    );
  }

  private async start(t: DecodeTransfer): Promise<void> {
    const { ctx } = this;
    let peer: PeerState;
    let pairing: LayoutPairing;
    try {
      peer = await this.resolvePeer(t.source);
      // Made at the handshake (the same layouts): which P ranks hold this engine's heads.
      pairing = peer.pairing(peer.layout, ctx.kv()!.layout);
    } catch (err) {
      const e = KvxferError.from(err);
      const reason =
        e.code === "ERR_LAYOUT_INCOMPATIBLE"
          ? FailureReason.INCOMPATIBLE
          : FailureReason.UNREACHABLE;
      // Nothing was registered with P: the blocks are safe at once.
      this.fail(t, "FAILED", reason, e.code, e.message, ReleaseReason.FAILED, true);
      return;
    }
    if (t.state !== "WAITING") {
      // Given up on while the handshake ran (abort, watchdog): a pull tells P it can let go.
      if (t.mode === "pull")
        ctx.toPeer(peer, {
          case: "abort",
          value: { transferId: t.id, reason: t.reason, token: t.token },
        });
      return;
    }
    // A KV file that shrank would fault (SIGBUS) when P's writes or our reads reach it.
    const shrunk = ctx.kv()!.shrunk?.();
    if (shrunk !== undefined) {
      this.fail(
        t,
        "FAILED",
        FailureReason.BAD_REQUEST,
        "ERR_REGION_CHANGED",
        shrunk,
        ReleaseReason.FAILED,
        true,
      );
      return;
    }
    t.peer = peer;
    for (const d of pairing.ranks) {
      for (const s of d.sources) t.expectedPairs.add(`${s.srcRank}:${d.dstRank}`);
    }
    if (t.mode === "push") {
      transition(this.lc, t, "MOVING", "push registered with P");
      ctx.toPeer(peer, {
        case: "pushReg",
        value: {
          transferId: t.id,
          blockIds: t.dstBlocks,
          numTokens: t.numTokens,
          prefixTokens: t.prefixTokens,
          leaseMs: ctx.settings.regLeaseMs,
          token: t.token,
        },
      });
      t.trace.mark("peer.pushReg sent");
    } else {
      await this.pull(t, peer);
    }
  }

  /** D reads every rank pair's KV from P's blocks, then asks P whether they were held throughout. */
  private async pull(t: DecodeTransfer, peer: PeerState): Promise<void> {
    const { ctx } = this;
    const kv = ctx.kv()!;
    let plan: TransferPlan;
    try {
      plan = planPaired(peer.pairing(peer.layout, kv.layout), {
        numTokens: t.numTokens,
        prefixTokens: t.prefixTokens,
        srcBlockIds: t.srcBlocks!,
        dstBlockIds: t.dstBlocks,
      });
    } catch (err) {
      const e = transferError(err);
      this.fail(
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
    t.trace.mark("planned");
    transition(this.lc, t, "MOVING", "pull planned");
    t.bytes = plan.bytes;
    t.descriptors = plan.descriptorCount;
    const reads: Promise<OpTrace>[] = [];
    const pairOf: string[] = [];
    try {
      for (const pair of plan.pairs) {
        const agent = kv.agents[pair.dstRank]!;
        const ep = peer.endpoint(pair.dstRank, pair.srcRank);
        for (const rp of pair.regionPairs) {
          if (rp.count === 0) continue;
          const remote = peer.remote(pair.dstRank, pair.srcRank, rp.srcRegion);
          pairOf.push(`${pair.srcRank}>${pair.dstRank}`);
          reads.push(
            agent.read(
              ep,
              kv.regions[pair.dstRank]![rp.dstRegion]!,
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
    t.t.dataDoneMs = ctx.clock.now();
    for (const name of new Set(pairOf)) {
      const ops: OpTrace[] = [];
      settled.forEach((r, i) => {
        if (r.status === "fulfilled" && pairOf[i] === name) ops.push(r.value);
      });
      markPairSteps(t.trace, name, ops);
    }
    if (t.state === "DRAINING") {
      // Aborted or timed out while reading: the reads are over, the blocks are safe now.
      this.settle(t);
      return;
    }
    if (t.state !== "MOVING") return;
    const bad = settled.find((s) => s.status === "rejected");
    if (bad !== undefined) {
      const e = KvxferError.from((bad as PromiseRejectedResult).reason);
      ctx.toPeer(peer, {
        case: "failed",
        value: { transferId: t.id, code: e.code, message: e.message, token: t.token },
      });
      this.fail(
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
    transition(this.lc, t, "CONFIRMING", "every READ done");
    this.askHeld(t, peer);
  }

  private askHeld(t: DecodeTransfer, peer: PeerState): void {
    this.ctx.toPeer(peer, {
      case: "readDone",
      value: { transferId: t.id, bytes: BigInt(t.bytes), token: t.token },
    });
    t.trace.mark("peer.readDone sent");
  }

  // --- the prefill peer ------------------------------------------------------------

  readAck(
    peer: PeerState,
    transferId: string,
    held: boolean,
    unknown: boolean,
    n?: Pick<Notification, "receivedUs" | "deliveredUs">,
  ): void {
    const t = this.transfers.get(transferId);
    if (t === undefined || t.peer !== peer || t.state !== "CONFIRMING" || t.mode !== "pull") return;
    if (n !== undefined) {
      t.trace.mark("peer.readAck received", n.receivedUs);
      t.trace.mark("peer.readAck delivered", n.deliveredUs);
    }
    if (unknown) {
      // P has not seen PrefillDone yet, so it cannot have released the blocks: ask again
      // shortly. P's engine sends PrefillDone within an engine step of answering the router;
      // a transfer P still does not know after UNKNOWN_GIVE_UP_MS was never P's (made-up
      // params): it fails then, not at the watchdog.
      const now = this.ctx.clock.now();
      if (t.unknownSinceMs === 0) t.unknownSinceMs = now;
      else if (now - t.unknownSinceMs >= UNKNOWN_GIVE_UP_MS) {
        this.fail(
          t,
          "FAILED",
          FailureReason.PEER_FAILED,
          "ERR_UNKNOWN_TRANSFER",
          `P has not known this transfer for ${UNKNOWN_GIVE_UP_MS} ms (no PrefillDone for it)`,
          ReleaseReason.FAILED,
          true,
        );
        return;
      }
      this.ctx.clock.after(10, () => {
        if (t.state === "CONFIRMING" && t.peer !== undefined) this.askHeld(t, t.peer);
      });
      return;
    }
    if (held) {
      transition(this.lc, t, "KV_READY", "P held the blocks throughout the reads");
    } else {
      this.fail(
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

  /** One pair's data is in D's blocks (push); the last one makes the KV ready. */
  xferDone(
    peer: PeerState,
    fromRank: number,
    toRank: number,
    m: XferDone,
    n?: Pick<Notification, "receivedUs" | "deliveredUs">,
  ): void {
    const { ctx } = this;
    const t = this.transfers.get(m.transferId);
    if (t === undefined) {
      // Never expected here (or its tombstone is gone): a peer bug or a forgery, worth seeing.
      ctx.noteError(
        `XferDone from '${peer.engineId}' for unknown transfer '${m.transferId}': ERR_UNKNOWN_TRANSFER`,
      );
      return;
    }
    if (t.peer !== undefined && t.peer !== peer) {
      // Another engine's agent names a transfer it was never part of: worth seeing.
      ctx.noteError(
        `XferDone for '${m.transferId}' from '${peer.engineId}', not the engine it was registered with: ignored`,
      );
      return;
    }
    if (t.peer === undefined || t.mode !== "push" || t.state !== "MOVING") {
      ctx.log.debug({ transferId: m.transferId }, "XferDone for no moving push transfer: ignored");
      return;
    }
    // The notification must come from the agent pair it names (it follows that pair's data).
    if (m.srcRank !== fromRank || m.dstRank !== toRank) {
      ctx.noteError(
        `XferDone for ${m.transferId} names ranks ${m.srcRank}->${m.dstRank} but came ${fromRank}->${toRank}`,
      );
      return;
    }
    const key = `${m.srcRank}:${m.dstRank}`;
    // A pair counts once: a repeated XferDone (a misbehaving P) adds no bytes and no latency.
    if (!t.expectedPairs.has(key) || t.donePairs.has(key)) return;
    if (t.t.dataStartedMs === 0) t.t.dataStartedMs = ctx.clock.now();
    if (n !== undefined) {
      t.trace.mark(stepName(`${m.srcRank}>${m.dstRank}`, "xferDone received"), n.receivedUs);
      t.trace.mark(stepName(`${m.srcRank}>${m.dstRank}`, "xferDone delivered"), n.deliveredUs);
    }
    t.donePairs.add(key);
    t.bytes += Number(m.bytes);
    t.sincePrefillDoneMs = Math.max(t.sincePrefillDoneMs, m.sincePrefillDoneMs);
    if (t.donePairs.size === t.expectedPairs.size) {
      t.t.dataDoneMs = ctx.clock.now();
      ctx.moved(t.bytes);
      transition(this.lc, t, "KV_READY", "every pair's XferDone");
    }
  }

  /** P says the transfer failed; returns false when D has no live transfer with `peer` by that id. */
  peerFailed(peer: PeerState, transferId: string, code: string, message: string): boolean {
    const t = this.transfers.get(transferId);
    if (t === undefined || t.peer !== peer || isTerminal(t.state)) return false;
    if (t.state === "DRAINING") {
      // P failed after our abort: its writes are over.
      if (t.mode === "push") this.settle(t);
      return true;
    }
    // P sends Failed only once its writes for the transfer are over.
    const safe = t.mode === "push" || t.readsInFlight === 0;
    const reason =
      code === "ERR_LEASE_EXPIRED" ? FailureReason.LEASE_EXPIRED : FailureReason.PEER_FAILED;
    this.fail(t, "FAILED", reason, code, `prefill side: ${message}`, ReleaseReason.FAILED, safe);
    return true;
  }

  /** P acknowledged our abort of a push: no write will land. */
  abortAck(peer: PeerState, transferId: string): void {
    const t = this.transfers.get(transferId);
    // Only a push waits for P's acknowledgement; a pull waits for its own reads to settle.
    if (t === undefined || t.peer !== peer || t.state !== "DRAINING" || t.mode !== "push") return;
    this.settle(t);
  }

  /** P is gone: its transfers fail (a push's blocks wait for the registration lease). */
  peerDown(peer: PeerState, why: string): void {
    for (const t of this.transfers.values()) {
      if (t.peer !== peer || isTerminal(t.state) || t.state === "DRAINING") continue;
      // A push may still have writes in flight from a peer we merely stopped hearing:
      // the blocks wait for the registration lease. Reads settle by themselves.
      this.fail(
        t,
        "FAILED",
        FailureReason.PEER_FAILED,
        "ERR_PEER_DOWN",
        why,
        ReleaseReason.FAILED,
        t.mode === "pull" && t.readsInFlight === 0,
      );
    }
  }

  // --- failure ---------------------------------------------------------------------

  /**
   * D's failure path. The engine hears KvFailed at once (it may recompute); its blocks come
   * back only when no write into them can still arrive: at once when `safe`, else (DRAINING)
   * on P's AbortAck, on reads settling, or when P's registration lease (plus a grace) has
   * surely run out.
   */
  private fail(
    t: DecodeTransfer,
    kind: DecodeState & TerminalKind,
    reason: FailureReason,
    code: string,
    message: string,
    release: ReleaseReason,
    safe: boolean,
  ): void {
    const { ctx } = this;
    if (isTerminal(t.state) || t.state === "DRAINING") return;
    t.outcome = { kind, reason, code, release };
    t.reason = code;
    ctx.metrics()?.transferFailed(code);
    ctx.toEngine({ case: "kvFailed", value: { transferId: t.id, reason, message } });
    // A pull that D gives up on (abort, watchdog): P need not hold its blocks to the lease.
    if (
      t.mode === "pull" &&
      t.peer !== undefined &&
      reason !== FailureReason.LEASE_EXPIRED &&
      reason !== FailureReason.PEER_FAILED
    ) {
      ctx.toPeer(t.peer, {
        case: "abort",
        value: { transferId: t.id, reason: code, token: t.token },
      });
    }
    if (safe) {
      transition(this.lc, t, kind, code);
      return;
    }
    transition(this.lc, t, "DRAINING", code);
    if (t.mode === "push" && t.peer !== undefined) {
      ctx.toPeer(t.peer, {
        case: "abort",
        value: { transferId: t.id, reason: code, token: t.token },
      });
    } else if (t.readsInFlight === 0) {
      this.settle(t);
    }
  }

  /** DRAINING is over: the transfer ends as decided when it began failing. */
  private settle(t: DecodeTransfer): void {
    if (t.state !== "DRAINING") return;
    transition(this.lc, t, t.outcome!.kind, "no write can land any more");
  }

  // --- time ------------------------------------------------------------------------

  /** Transfers whose lease D renews with its heartbeat to each peer (push: stamps the renewal). */
  heartbeatIds(now: number): Map<PeerState, string[]> {
    const byPeer = new Map<PeerState, string[]>();
    for (const t of this.transfers.values()) {
      if (t.peer === undefined || isTerminal(t.state) || t.state === "DRAINING") continue;
      let ids = byPeer.get(t.peer);
      if (ids === undefined) byPeer.set(t.peer, (ids = []));
      ids.push(t.id);
      if (t.mode === "push") t.lastRenewMs = now;
    }
    return byPeer;
  }

  /** The watchdog, the end of DRAINING by time, and old tombstones. */
  expire(now: number): void {
    for (const t of this.transfers.values()) {
      if (now < t.deadline) continue;
      if (isTerminal(t.state)) {
        this.forget(t);
      } else if (t.state === "DRAINING") {
        if (t.readsInFlight === 0) this.settle(t); // P's registration lease has run out
      } else {
        this.fail(
          t,
          "EXPIRED",
          FailureReason.TIMEOUT,
          "ERR_TIMEOUT",
          `no KV within ${this.ctx.settings.transferTimeoutMs} ms`,
          ReleaseReason.EXPIRED,
          t.state === "WAITING" && t.peer === undefined,
        );
      }
    }
  }

  /** Reads from `peer` still in flight. */
  readingFrom(peer: PeerState): boolean {
    for (const t of this.transfers.values())
      if (t.peer === peer && t.mode === "pull" && t.readsInFlight > 0) return true;
    return false;
  }

  liveWith(peer: PeerState): boolean {
    for (const t of this.transfers.values())
      if (t.peer === peer && !isTerminal(t.state)) return true;
    return false;
  }
}
