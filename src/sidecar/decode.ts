/**
 * D's side of every transfer: the table of D's transfers and the interpreter of D's machine
 * (decode-machine.ts). Each handler turns what happened (the engine's ExpectKv and Abort, the
 * handshake, P's XferDone, ReadAck, AbortAck and Failed, our reads settling, the clock, P going
 * down) into one event; the table says where that moves the transfer and which effects run;
 * `run` runs them against the engine, the peer and the clock. No handler decides a state.
 */
import { FailureReason, ReleaseReason, type ExpectKv } from "../gen/kvxfer/v1/engine_pb.js";
import type { XferDone } from "../gen/kvxfer/v1/peer_pb.js";
import { KvxferError } from "../errors.js";
import type { PeerBody } from "../peer/messages.js";
import { sameProcess, type PeerState } from "../peer/peer-state.js";
import {
  allBlockIds,
  blockLists,
  writtenBlocks,
  type GroupsPairing,
  type TransferPlan,
} from "../plan/index.js";
import { blockListToProto } from "../plan/layout-proto.js";
import { BlockClaims } from "./claims.js";
import type { SideContext } from "./context.js";
import {
  DECODE_FAILS_AS,
  DECODE_INITIAL,
  DECODE_NEXT,
  DECODE_READING,
  DECODE_WATCHED,
  decodeStep,
  type DecodeEffect,
  type DecodeEvent,
  type DecodeState,
} from "./decode-machine.js";
import { planPull, postReads } from "./decode-reads.js";
import {
  UNKNOWN_GIVE_UP_MS,
  failed,
  decodeInfo,
  type Arrival,
  type DecodeTransfer,
  type EventData,
} from "./decode-transfer.js";
import { isTerminal, OUTCOME, transition } from "./lifecycle.js";
import { LinkRates } from "./link-rates.js";
import { abortBody, OwedAborts } from "./owed-aborts.js";
import { settleBound } from "./settle.js";
import { SideTable } from "./side-table.js";
import { newTimings } from "./timings.js";
import { stepName, TransferTrace } from "./trace.js";
import type { TerminalKind, TransferInfo } from "./view.js";

/** The Abort that tells P of `t`'s end. */
function abortOf(t: DecodeTransfer): PeerBody {
  return abortBody({ transferId: t.id, reason: t.reason, token: t.token });
}

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
  /** Aborts for a prefill peer we dropped, sent once it can be reached again (owed-aborts.ts). */
  private readonly owed: OwedAborts;
  /** Each prefill peer's link as measured by the transfers that became ready (the watchdog's allowance). */
  private readonly rates = new LinkRates();

  constructor(
    ctx: SideContext,
    private readonly resolvePeer: PeerResolver,
  ) {
    super(ctx, "decode", DECODE_INITIAL, DECODE_NEXT);
    const s = ctx.settings;
    this.owed = new OwedAborts(
      { resolve: resolvePeer, send: (peer, body) => ctx.peers.send(peer, body), log: ctx.log },
      {
        // P's hold and its registration lease have surely run out by then, and P's writes
        // abandoned to us have settled (or their bound has passed).
        ttlMs: Math.max(s.leaseMs, s.regLeaseMs) + s.abortGraceMs + settleBound(s),
        retryMs: s.heartbeatMs ?? 1000,
        cap: s.maxTransfers,
      },
    );
  }

  protected enter(t: DecodeTransfer, to: DecodeState): void {
    const now = this.ctx.clock.now();
    const s = this.ctx.settings;
    switch (to) {
      case "WAITING":
        t.t.registeredMs = now;
        t.deadline = now + s.transferTimeoutMs;
        break;
      case "PUSH_REGISTERED":
        t.lastRenewMs = now;
        break;
      case "READING":
        t.t.dataStartedMs = now;
        break;
      case "CONFIRMING":
      case "READS_DRAINING":
        break;
      case "PUSH_DRAINING":
        // P may still write until its registration lease (renewed by our heartbeats) has run
        // out, and a write P abandoned then (we went silent to it) may still land until it has
        // settled in P's UCX: P's AbortAck says so sooner (abortAck).
        t.deadline = t.lastRenewMs + s.regLeaseMs + s.abortGraceMs + settleBound(s);
        break;
      case "KV_READY":
        t.t.readyMs = now;
        t.t.endedMs = now;
        t.deadline = now + s.tombstoneMs;
        // A pull's data starts with its reads; a push's somewhere after registration (P's
        // prefill first: its first XferDone comes at the end), so a push is counted from
        // registration and its link measures slower than it is, which only lengthens the
        // watchdog's allowance.
        this.rates.landed(t.source, {
          startMs:
            t.mode === "pull" && t.t.dataStartedMs > 0 ? t.t.dataStartedMs : t.t.registeredMs,
          readyMs: now,
          blocks: t.written.length,
        });
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
      ctx.engine.send({ case: "kvReady", value: { transferId: t.id, bytes: BigInt(t.bytes) } });
      t.trace.mark("engine.kvReady sent");
      // Prefill done -> ready: for push P reports its side up to posting the writes (the data
      // time itself is not in it: the XferDone is sealed before the writes and travels with
      // them); for pull the router sent ExpectKv only once prefill was done, so registration
      // stands in for it.
      const latency = t.mode === "push" ? t.sincePrefillDoneMs : ctx.clock.now() - t.t.registeredMs;
      ctx.tally.metrics?.transferReady(t.mode, latency, t.bytes, t.descriptors);
      ctx.events.emit("KV_READY", t.id, peer, "decode", "", t.bytes, t.mode);
      t.trace.mark("event.appended");
      return;
    }
    const o = t.outcome!;
    ctx.engine.send({
      case: "releaseBlocks",
      value: { transferId: t.id, blockIds: t.dstBlocks, reason: o.release },
    });
    ctx.events.emit(kind, t.id, peer, "decode", o.code, t.bytes, t.mode);
    t.trace.mark("event.appended");
  }

  protected info(t: DecodeTransfer): TransferInfo {
    return decodeInfo(t);
  }

  // --- the interpreter -------------------------------------------------------------

  /**
   * Feeds `event` to `t`'s machine: runs the row's effects, moves to its state, runs what
   * follows the move. Returns false when the state ignores the event (no row).
   */
  private on(t: DecodeTransfer, event: DecodeEvent, data: EventData = {}): boolean {
    const row = decodeStep(t.state, event);
    if (row === undefined) return false;
    for (const e of row.effects ?? []) this.run(t, e, event, data);
    if (row.to !== undefined) {
      const to = row.to === OUTCOME ? t.outcome!.kind : row.to;
      transition(this.lc, t, to, row.to === OUTCOME ? "no write can land any more" : event);
    }
    for (const e of row.then ?? []) this.run(t, e, event, data);
    return true;
  }

  /** One effect of a row, for `event` (and what came with it). */
  private run(t: DecodeTransfer, effect: DecodeEffect, event: DecodeEvent, d: EventData): void {
    const { ctx } = this;
    switch (effect) {
      case "CONNECT_PUSH":
      case "CONNECT_PULL":
        return this.connect(t, d.peer!, d.pairing!);
      case "LATE_ABORT":
        // Given up on while the handshake ran (abort, watchdog): P can let go.
        return ctx.peers.send(d.peer!, abortOf(t));
      case "SEND_PUSH_REG":
        // Marked as it is handed over: P can receive it (and stamp its own hop) before send()
        // returns, now that control messages have an endpoint of their own.
        t.trace.mark("peer.pushReg sent");
        ctx.peers.send(t.peer!, {
          case: "pushReg",
          value: {
            transferId: t.id,
            // One list from block 0 travels as block_ids alone, as before groups existed.
            ...(t.dstLists.length === 1 && t.dstLists[0]!.first === 0
              ? { blockIds: t.dstLists[0]!.ids as number[] }
              : { groups: t.dstLists.map(blockListToProto) }),
            numTokens: t.numTokens,
            prefixTokens: t.prefixTokens,
            leaseMs: ctx.settings.regLeaseMs,
            token: t.token,
          },
        });
        return;
      case "START_READS":
        void this.read(t, t.peer!, d.plan!);
        return;
      case "COUNT_PAIR":
        return this.countPair(t, d.xfer!, d.arrival);
      case "DATA_DONE":
        t.t.dataDoneMs = ctx.clock.now();
        ctx.tally.moved(t.bytes);
        return;
      case "TRACE_ACK":
        if (d.arrival !== undefined) {
          t.trace.mark("peer.readAck received", d.arrival.receivedUs);
          t.trace.mark("peer.readAck delivered", d.arrival.deliveredUs);
        }
        return;
      case "ASK_HELD":
        t.trace.mark("peer.readDone sent"); // before: P may answer before send() returns
        ctx.peers.send(t.peer!, {
          case: "readDone",
          value: { transferId: t.id, bytes: BigInt(t.bytes), token: t.token },
        });
        return;
      case "RETRY_OR_GIVE_UP":
        return this.retryOrGiveUp(t);
      case "KV_FAILED": {
        const f = d.failure!;
        t.outcome = {
          kind: DECODE_FAILS_AS[event]!,
          reason: f.reason,
          code: f.code,
          release: f.release,
        };
        t.reason = f.code;
        ctx.tally.metrics?.transferFailed(f.code);
        ctx.engine.send({
          case: "kvFailed",
          value: { transferId: t.id, reason: f.reason, message: f.message },
        });
        return;
      }
      case "TELL_P_FAILED":
        return ctx.peers.send(t.peer!, {
          case: "failed",
          value: {
            transferId: t.id,
            code: d.error!.code,
            message: d.error!.message,
            token: t.token,
          },
        });
      case "TELL_P_ABORT":
        return ctx.peers.send(t.peer!, abortOf(t));
      case "RENEW_PUSH":
        t.lastRenewMs = d.now!;
        return;
      case "RENEW":
        return;
      case "FORGET":
        return this.forget(t);
    }
  }

  // --- the engine ----------------------------------------------------------------

  /** `receivedUs`: when the engine's message arrived (monoUs). */
  expectKv(m: ExpectKv, pullWanted: boolean, receivedUs?: number): void {
    const { ctx } = this;
    const existing = this.transfers.get(m.transferId);
    if (existing !== undefined) {
      return ctx.engine.refuse(
        m.transferId,
        "ERR_DUPLICATE",
        `ExpectKv for transfer '${m.transferId}' already received`,
      );
    }
    if (this.atCapacity()) {
      return ctx.engine.refuse(
        m.transferId,
        "ERR_OVERLOADED",
        `${ctx.settings.maxTransfers} transfers live`,
      );
    }
    // The blocks this transfer writes (see `claims`); the engine's checks guarantee the count.
    const groups = ctx.kvs.kv!.groups;
    const dstLists = blockLists(m.groups, m.blockIds);
    const written = writtenBlocks(groups, dstLists, m.prefixTokens, m.numTokens);
    const firstWritten =
      groups.length === 1 ? Math.floor(m.prefixTokens / groups[0]!.layout.blockSize) : 0;
    const clash = this.claims.clash(written, firstWritten, m.transferId);
    if (clash !== undefined) return ctx.engine.refuse(m.transferId, "ERR_BLOCKS_IN_USE", clash);
    const hasSrc = m.hasSourceBlockIds;
    if (pullWanted && !hasSrc)
      return ctx.engine.refuse(
        m.transferId,
        "ERR_NO_SOURCE_BLOCKS",
        "pull mode needs ExpectKv.source_block_ids",
      );
    const t: DecodeTransfer = {
      id: m.transferId,
      state: "WAITING",
      source: m.source,
      peer: undefined,
      dstBlocks: allBlockIds(dstLists),
      dstLists,
      written,
      srcLists: hasSrc ? blockLists(m.sourceGroups, m.sourceBlockIds) : undefined,
      numTokens: m.numTokens,
      prefixTokens: m.prefixTokens,
      token: m.token,
      mode: pullWanted ? "pull" : "push",
      expectedPairs: new Set(),
      donePairs: new Set(),
      deadline: 0,
      lastRenewMs: ctx.clock.now(),
      outcome: undefined,
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
    void this.handshake(t);
  }

  /**
   * The sidecar stops with transfers left: each fails now (the engine recomputes) and P is told
   * (a pull's Abort lets it free its blocks; a push's Abort stops its writes and frees them).
   */
  abandon(): void {
    for (const t of this.transfers.values())
      this.on(t, "STOPPING", {
        failure: {
          reason: FailureReason.ABORTED,
          code: "ERR_DRAINING",
          message: "the decode sidecar is stopping",
          release: ReleaseReason.ABORTED,
        },
      });
  }

  /** The engine aborts: KvFailed at once, the blocks once no write can land. */
  abort(transferId: string): void {
    const t = this.transfers.get(transferId);
    if (t === undefined) return;
    this.on(t, "ENGINE_ABORT", {
      failure: {
        reason: FailureReason.ABORTED,
        code: "ERR_ABORTED",
        message: "aborted by the engine",
        release: ReleaseReason.ABORTED,
      },
    });
  }

  /**
   * D refuses an ExpectKv while draining: P may hold the blocks for it (prefill done, waiting for
   * our read or registration). Told now, with the transfer's token, P frees them at once instead
   * of at its lease.
   */
  tellSourceDraining(m: ExpectKv): void {
    if (m.source === "") return;
    this.resolvePeer(m.source)
      .then((peer) =>
        this.ctx.peers.send(peer, {
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
        this.ctx.log.debug(
          { err, transferId: m.transferId },
          "cannot tell P about a drain refusal",
        ),
      );
  }

  // --- P: the handshake, the plan, the reads ----------------------------------------

  private async handshake(t: DecodeTransfer): Promise<void> {
    let peer: PeerState;
    let pairing: GroupsPairing;
    try {
      peer = await this.resolvePeer(t.source);
      if (!isTerminal(t.state)) t.trace.mark("peer.resolved");
      // Made at the handshake (the same layouts): which P ranks hold this engine's heads.
      pairing = peer.pairing(peer.groups, this.ctx.kvs.kv!.groups);
    } catch (err) {
      const e = KvxferError.from(err);
      const reason =
        e.code === "ERR_LAYOUT_INCOMPATIBLE"
          ? FailureReason.INCOMPATIBLE
          : FailureReason.UNREACHABLE;
      this.on(t, "HANDSHAKE_FAILED", { failure: failed(reason, e.code, e.message) });
      return;
    }
    this.on(t, t.mode === "push" ? "PEER_FOUND_PUSH" : "PEER_FOUND_PULL", { peer, pairing });
  }

  /** CONNECT_*: the KV region still whole, the peer taken, (pull) the reads planned. */
  private connect(t: DecodeTransfer, peer: PeerState, pairing: GroupsPairing): void {
    const kv = this.ctx.kvs.kv!;
    // A KV file that shrank would fault (SIGBUS) when P's writes or our reads reach it.
    const shrunk = kv.shrunk?.();
    if (shrunk !== undefined) {
      this.on(t, "REGION_CHANGED", {
        failure: failed(FailureReason.BAD_REQUEST, "ERR_REGION_CHANGED", shrunk),
      });
      return;
    }
    t.peer = peer;
    for (const p of pairing.rankPairs) t.expectedPairs.add(`${p.srcRank}:${p.dstRank}`);
    if (t.mode === "push") {
      this.on(t, "PUSH_READY");
      return;
    }
    const plan = planPull(peer, kv.groups, t);
    if (plan instanceof KvxferError) {
      this.on(t, "PLAN_FAILED", {
        failure: failed(FailureReason.BAD_REQUEST, plan.code, plan.message),
      });
      return;
    }
    t.trace.mark("planned");
    this.on(t, "PLANNED", { plan });
  }

  /** START_READS: the reads posted (decode-reads.ts); READS_DONE or READS_FAILED. */
  private async read(t: DecodeTransfer, peer: PeerState, plan: TransferPlan): Promise<void> {
    const e = await postReads(this.ctx, t, peer, plan);
    if (e === undefined) {
      this.on(t, "READS_DONE");
      return;
    }
    this.on(t, "READS_FAILED", {
      error: e,
      failure: failed(FailureReason.TRANSFER_ERROR, e.code, e.message),
    });
  }

  // --- the prefill peer ------------------------------------------------------------

  readAck(peer: PeerState, transferId: string, held: boolean, unknown: boolean, n?: Arrival): void {
    const t = this.transfers.get(transferId);
    if (t === undefined || t.peer !== peer) return;
    if (unknown) {
      this.on(t, "READ_ACK_UNKNOWN", { arrival: n });
    } else if (held) {
      this.on(t, "READ_ACK_HELD", { arrival: n });
    } else {
      this.on(t, "READ_ACK_RELEASED", {
        arrival: n,
        failure: failed(
          FailureReason.LEASE_EXPIRED,
          "ERR_LEASE_EXPIRED",
          "P released the blocks before D's read was confirmed",
        ),
      });
    }
  }

  /**
   * P has not seen PrefillDone yet, so it cannot have released the blocks: ask again shortly.
   * P's engine sends PrefillDone within an engine step of answering the router; a transfer P
   * still does not know after UNKNOWN_GIVE_UP_MS was never P's (made-up params): it fails then,
   * not at the watchdog.
   */
  private retryOrGiveUp(t: DecodeTransfer): void {
    const now = this.ctx.clock.now();
    if (t.unknownSinceMs === 0) t.unknownSinceMs = now;
    else if (now - t.unknownSinceMs >= UNKNOWN_GIVE_UP_MS) {
      this.on(t, "UNKNOWN_TOO_LONG", {
        failure: failed(
          FailureReason.PEER_FAILED,
          "ERR_UNKNOWN_TRANSFER",
          `P has not known this transfer for ${UNKNOWN_GIVE_UP_MS} ms (no PrefillDone for it)`,
        ),
      });
      return;
    }
    this.ctx.clock.after(10, () => this.on(t, "ASK_AGAIN"));
  }

  /** One pair's data is in D's blocks (push); the last one makes the KV ready. */
  xferDone(peer: PeerState, fromRank: number, toRank: number, m: XferDone, n?: Arrival): void {
    const { ctx } = this;
    const t = this.transfers.get(m.transferId);
    if (t === undefined) {
      // Never expected here (or its tombstone is gone): a peer bug or a forgery, worth seeing.
      ctx.errors.note(
        `XferDone from '${peer.engineId}' for unknown transfer '${m.transferId}': ERR_UNKNOWN_TRANSFER`,
      );
      return;
    }
    if (t.peer !== undefined && t.peer !== peer) {
      // Another engine's agent names a transfer it was never part of: worth seeing.
      ctx.errors.note(
        `XferDone for '${m.transferId}' from '${peer.engineId}', not the engine it was registered with: ignored`,
      );
      return;
    }
    if (!this.on(t, "XFER_DONE", { xfer: { m, fromRank, toRank }, arrival: n }))
      ctx.log.debug({ transferId: m.transferId }, "XferDone for no moving push transfer: ignored");
  }

  /** COUNT_PAIR: one pair counts once; the last makes ALL_PAIRS_DONE. */
  private countPair(
    t: DecodeTransfer,
    x: { m: XferDone; fromRank: number; toRank: number },
    n: Arrival | undefined,
  ): void {
    const { ctx } = this;
    const { m } = x;
    // The notification must come from the agent pair it names (it follows that pair's data).
    if (m.srcRank !== x.fromRank || m.dstRank !== x.toRank) {
      ctx.errors.note(
        `XferDone for ${m.transferId} names ranks ${m.srcRank}->${m.dstRank} but came ${x.fromRank}->${x.toRank}`,
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
      this.on(t, "ALL_PAIRS_DONE");
    }
  }

  /** P says the transfer failed; returns false when D has no live transfer with `peer` by that id. */
  peerFailed(peer: PeerState, transferId: string, code: string, message: string): boolean {
    const t = this.transfers.get(transferId);
    if (t === undefined || t.peer !== peer || isTerminal(t.state)) return false;
    const reason =
      code === "ERR_LEASE_EXPIRED" ? FailureReason.LEASE_EXPIRED : FailureReason.PEER_FAILED;
    this.on(t, "P_FAILED", { failure: failed(reason, code, `prefill side: ${message}`) });
    return true;
  }

  /** P acknowledged our abort of a push: no write will land. */
  abortAck(peer: PeerState, transferId: string): void {
    const t = this.transfers.get(transferId);
    // From the same P process (engine and epoch), through the handshake the transfer was made
    // on or a later one (after a partition: our owed Abort went through a new one). P sends it
    // once none of its writes for the transfer is left in UCX: an abandoned write is not
    // cancelled and its bytes may land from the old TCP connection after the heal, so P waits
    // for its endpoints to settle first (prefill-writes.ts; measured before that wait: a
    // transfer right after an 8 s partition healed was verified wrong by D's engine once in ~8
    // runs while this took such an AbortAck).
    if (t?.peer !== undefined && sameProcess(t.peer, peer)) this.on(t, "ABORT_ACK");
  }

  /**
   * Any handshake D dialed reached `peer` (a known one too): whichever reached it first (a new
   * transfer's, often, while the owed aborts' own dial still waits out a connection attempt the
   * partition stalled) delivers what D owes it. And every push still draining for that same P
   * process (engine and epoch) whose Abort did not go with them asks again through it: P answers
   * an Abort for a transfer it no longer knows, or has ended, with AbortAck at once, and for one
   * whose writes it abandoned once they have settled. (A fresh clone's npm test once found four
   * push drains still held 40 s after an 8 s one-way cut healed, with P holding nothing.)
   * Each such drain now waits on `peer`: should P go silent or its endpoint fail before the
   * AbortAck comes, D drops it, owes the Abort again and dials P afresh (owed-aborts.ts), instead
   * of waiting out the settle bound for an answer lost with the old state.
   */
  peerReached(peer: PeerState): void {
    const sent = this.owed.reachedThrough(peer);
    for (const t of this.transfers.values()) {
      if (t.state !== "PUSH_DRAINING" || t.peer === undefined || !sameProcess(t.peer, peer))
        continue;
      t.peer = peer;
      if (!sent.has(t.id)) this.ctx.peers.send(peer, abortOf(t));
    }
  }

  /**
   * A handshake found `peer` at a new epoch: the P process our push drains wait for is gone
   * (its sidecar restarted), and with it every write it could still post. Their drains end.
   */
  peerUp(peer: PeerState): void {
    for (const t of this.transfers.values()) {
      if (
        t.state === "PUSH_DRAINING" &&
        t.peer?.engineId === peer.engineId &&
        t.peer.epoch !== peer.epoch
      )
        this.on(t, "ABORT_ACK");
    }
  }

  /**
   * P is gone: its transfers fail (a push's blocks wait for the registration lease). What was
   * live with it is owed to it as an Abort: P frees what it holds for us once it hears it.
   */
  peerDown(peer: PeerState, why: string): void {
    const now = this.ctx.clock.now();
    for (const t of this.transfers.values()) {
      if (t.peer !== peer) continue;
      if (!isTerminal(t.state))
        this.owed.note(
          peer,
          { transferId: t.id, token: t.token, reason: `peer down: ${why}` },
          now,
        );
      this.on(t, "P_DOWN", { failure: failed(FailureReason.PEER_FAILED, "ERR_PEER_DOWN", why) });
    }
  }

  // --- time ------------------------------------------------------------------------

  /** Transfers whose lease D renews with its heartbeat to each peer (push: stamps the renewal). */
  heartbeatIds(now: number): Map<PeerState, string[]> {
    const byPeer = new Map<PeerState, string[]>();
    for (const t of this.transfers.values()) {
      if (!this.on(t, "HEARTBEAT", { now })) continue;
      let ids = byPeer.get(t.peer!);
      if (ids === undefined) byPeer.set(t.peer!, (ids = []));
      ids.push(t.id);
    }
    return byPeer;
  }

  /**
   * The watchdog, the end of a push's drain by time, old tombstones, and what P is owed. The
   * watchdog gives a transfer `--transfer-timeout-ms` from ExpectKv, and on top the time its
   * link needs, at the rate measured from that peer's recent transfers, for the blocks of every
   * live transfer from that peer, its own included (they share the link: each may finish only
   * when all do), at most 9 timeouts more: a slow link that delivers is not taken for a stuck
   * transfer. A link never measured gets no allowance; a dead peer is failed by the peer
   * timeout, not here.
   */
  expire(now: number): void {
    this.owed.tick(now);
    const timeout = this.ctx.settings.transferTimeoutMs;
    // Per link, once per sweep and only once a watched deadline has passed.
    let allowances: Map<string, number> | undefined;
    for (const t of this.transfers.values()) {
      if (now < t.deadline) continue;
      let allowance = 0;
      if (DECODE_WATCHED.has(t.state)) {
        allowances ??= this.allowances(timeout);
        allowance = allowances.get(t.source) ?? 0;
        const until = t.t.registeredMs + timeout + allowance;
        if (now < until) {
          t.deadline = until;
          continue;
        }
      }
      this.on(t, "DEADLINE", {
        failure: {
          reason: FailureReason.TIMEOUT,
          code: "ERR_TIMEOUT",
          message:
            allowance > 0
              ? `no KV within ${timeout} ms and the ${allowance} ms its link's measured rate allowed`
              : `no KV within ${timeout} ms`,
          release: ReleaseReason.EXPIRED,
        },
      });
    }
  }

  /**
   * The watchdog's allowance per link (P's side channel): the blocks of the watched transfers
   * from it at its measured rate, at most 9 timeouts; a link never measured has none.
   */
  private allowances(timeout: number): Map<string, number> {
    const blocks = new Map<string, number>();
    for (const t of this.transfers.values())
      if (DECODE_WATCHED.has(t.state))
        blocks.set(t.source, (blocks.get(t.source) ?? 0) + t.written.length);
    const out = new Map<string, number>();
    for (const [source, n] of blocks) {
      const rate = this.rates.blocksPerMs(source);
      if (rate !== undefined) out.set(source, Math.min(9 * timeout, Math.ceil(n / rate)));
    }
    return out;
  }

  /** Reads from `peer` still in flight. */
  readingFrom(peer: PeerState): boolean {
    for (const t of this.transfers.values())
      if (t.peer === peer && DECODE_READING.has(t.state)) return true;
    return false;
  }

  liveWith(peer: PeerState): boolean {
    for (const t of this.transfers.values())
      if (t.peer === peer && !isTerminal(t.state)) return true;
    return false;
  }
}
