/**
 * P's side of every transfer: the table of P's transfers, their lifecycle (lifecycle.ts), and
 * every handler that moves one: the engine's PrefillDone and Abort, D's PushReg, ReadDone,
 * Abort and Failed, lease renewal by D's heartbeats, expiry, and D going down. P writes D's
 * blocks (push) or holds its own while D reads them (pull), and gives its blocks back to the
 * engine exactly once, in the one exit.
 */
import { ReleaseReason, type PrefillDone } from "../gen/kvxfer/v1/engine_pb.js";
import type { PushReg } from "../gen/kvxfer/v1/peer_pb.js";
import type { Notification, WritePart } from "../native/index.js";
import { KvxferError } from "../errors.js";

import { tokensEqual } from "../peer/messages.js";
import { planPaired, type TransferPlan } from "../plan/index.js";
import { BlockClaims } from "./claims.js";
import { transferError, type SideContext } from "./context.js";
import {
  PREFILL_INITIAL,
  PREFILL_NEXT,
  begin,
  isTerminal,
  transition,
  type PrefillState,
} from "./lifecycle.js";
import type { PeerState } from "./peers.js";
import { SideTable } from "./side-table.js";
import { newTimings, type Timings } from "./timings.js";
import { markPairSteps, TransferTrace } from "./trace.js";
import type { TerminalKind, TransferInfo } from "./view.js";

/** D's push registration: where P writes, under D's lease. */
export interface PushRegistration {
  peer: PeerState;
  token: string;
  dstBlocks: number[];
  numTokens: number;
  prefixTokens: number;
  leaseMs: number;
}

/** P's side of one transfer. */
export interface PrefillTransfer {
  readonly id: string;
  readonly state: PrefillState;
  blocks: number[] | undefined;
  numTokens: number;
  reg: PushRegistration | undefined;
  /** Registrations from other decode engines before PrefillDone named the token (at most 4). */
  otherRegs: PushRegistration[];
  /** PrefillDone.token: only a D presenting it may register, confirm, abort or fail the transfer. */
  token: string;
  /** Lease of held blocks (HELD), of a registration waiting for prefill (WAITING), or the tombstone's end. */
  deadline: number;
  /** No write for the registration may start after this (renewed by D's heartbeats). */
  regDeadline: number;
  /** Who the blocks went to (peer engine id), once known. */
  peer: string;
  mode: "push" | "pull" | "";
  /** ABORTING because D asked: D waits for an AbortAck once the writes settle. */
  abortAckOwed: boolean;
  bytes: number;
  descriptors: number;
  reason: string;
  t: Timings;
  trace: TransferTrace;
}

/** Registrations from decode engines other than the first, before PrefillDone, at most. */
const MAX_OTHER_REGISTRATIONS = 4;

/** Why a terminal state hands P's blocks back. */
function releaseReason(kind: TerminalKind | PrefillState): ReleaseReason {
  switch (kind) {
    case "RELEASED":
      return ReleaseReason.TRANSFERRED;
    case "ABORTED":
      return ReleaseReason.ABORTED;
    case "EXPIRED":
      return ReleaseReason.EXPIRED;
    default:
      return ReleaseReason.FAILED;
  }
}

export class PrefillSide extends SideTable<PrefillState, PrefillTransfer> {
  /** Only with exclusivePrefillBlocks: a transfer claims its whole block_ids from PrefillDone to its end. */
  private readonly claims = new BlockClaims();
  /**
   * Transfer ids the engine gave up on before this side heard of them (its Abort of an id it
   * never sent PrefillDone for: the request ended before prefill), each until its forget time.
   * D's PushReg for one is answered Failed at once, not after D's transfer timeout. Bounded by
   * maxTransfers (oldest forgotten first); holds no blocks and emits no event.
   */
  private readonly givenUp = new Map<string, number>();

  constructor(ctx: SideContext) {
    super(ctx, "prefill", PREFILL_INITIAL, PREFILL_NEXT);
  }

  protected enter(t: PrefillTransfer, to: PrefillState): void {
    const now = this.ctx.clock.now();
    switch (to) {
      case "WAITING":
        t.deadline = t.regDeadline;
        break;
      case "HELD":
        t.deadline = now + this.ctx.settings.leaseMs;
        break;
      case "MOVING":
        t.t.dataStartedMs = now;
        break;
      case "ABORTING":
        break;
      default:
        t.t.endedMs = now;
        t.deadline = now + this.ctx.settings.tombstoneMs;
    }
  }

  protected exit(t: PrefillTransfer, kind: PrefillState & TerminalKind): void {
    if (t.blocks !== undefined) {
      if (this.ctx.settings.exclusivePrefillBlocks) this.claims.release(t.blocks, t.id);
      this.ctx.toEngine({
        case: "releaseBlocks",
        value: { transferId: t.id, blockIds: t.blocks, reason: releaseReason(kind) },
      });
      t.trace.mark("engine.releaseBlocks sent");
    }
    this.ctx.emit(kind, t.id, t.peer, "prefill", t.reason, t.bytes, t.mode);
    t.trace.mark("event.appended");
  }

  protected info(t: PrefillTransfer): TransferInfo {
    return {
      transferId: t.id,
      side: "prefill",
      mode: t.mode,
      state: t.state,
      peer: t.peer,
      bytes: t.bytes,
      descriptors: t.descriptors,
      reason: t.reason,
      timings: { ...t.t },
      trace: t.trace.hops,
    };
  }

  private end(t: PrefillTransfer, kind: PrefillState & TerminalKind, reason: string): void {
    if (isTerminal(t.state)) return;
    t.reason = reason;
    transition(this.lc, t, kind, reason);
  }

  private fresh(id: string): PrefillTransfer {
    return {
      id,
      state: "WAITING",
      blocks: undefined,
      numTokens: 0,
      reg: undefined,
      otherRegs: [],
      token: "",
      deadline: 0,
      regDeadline: 0,
      peer: "",
      mode: "",
      abortAckOwed: false,
      bytes: 0,
      descriptors: 0,
      reason: "",
      t: newTimings(),
      trace: new TransferTrace(),
    };
  }

  // --- the engine ----------------------------------------------------------------

  /** `receivedUs`: when the engine's message arrived (monoUs). */
  prefillDone(m: PrefillDone, receivedUs?: number): void {
    const { ctx } = this;
    const s = ctx.settings;
    if (s.exclusivePrefillBlocks) {
      // Refused without a ReleaseBlocks: another live transfer holds these blocks.
      const clash = this.claims.clash(m.blockIds, 0, m.transferId);
      if (clash !== undefined) return ctx.refuse(m.transferId, "ERR_BLOCKS_IN_USE", clash);
    }
    const existing = this.transfers.get(m.transferId);
    if (existing !== undefined && isTerminal(existing.state) && existing.blocks === undefined) {
      // The transfer ended before prefill did (D aborted, its registration ran out, D went
      // down): nobody will read these blocks, so they go straight back. Its one terminal event
      // was already emitted; a second PrefillDone is a duplicate (blocks are now set).
      existing.blocks = [...m.blockIds];
      ctx.toEngine({
        case: "releaseBlocks",
        value: {
          transferId: m.transferId,
          blockIds: existing.blocks,
          reason: releaseReason(existing.state), // never RELEASED: that needs blocks
        },
      });
      return;
    }
    if (existing !== undefined && (existing.blocks !== undefined || isTerminal(existing.state))) {
      return ctx.refuse(
        m.transferId,
        "ERR_DUPLICATE",
        `PrefillDone for transfer '${m.transferId}' already received`,
      );
    }
    if (existing === undefined && this.atCapacity()) {
      // The engine gets its blocks back at once: nobody will read them.
      ctx.toEngine({
        case: "releaseBlocks",
        value: {
          transferId: m.transferId,
          blockIds: [...m.blockIds],
          reason: ReleaseReason.FAILED,
        },
      });
      return ctx.refuse(m.transferId, "ERR_OVERLOADED", `${s.maxTransfers} transfers live`);
    }
    const t = existing ?? this.fresh(m.transferId);
    t.blocks = [...m.blockIds];
    if (s.exclusivePrefillBlocks) this.claims.claim(t.blocks, t.id);
    t.numTokens = m.numTokens;
    t.token = m.token;
    t.t.prefillDoneMs = ctx.clock.now();
    t.trace.mark("engine.prefillDone", receivedUs);
    this.transfers.set(t.id, t);
    const reg = this.settleRegistrations(t);
    if (existing === undefined) begin(this.lc, t, "HELD", "PrefillDone");
    else if (reg === undefined) transition(this.lc, t, "HELD", "PrefillDone, no registration");
    if (reg !== undefined) void this.push(t);
  }

  /** The engine aborts: at once, or (writes in flight) once they settle. */
  abort(transferId: string): void {
    const t = this.transfers.get(transferId);
    if (t === undefined || isTerminal(t.state)) return;
    if (t.state === "MOVING") {
      transition(this.lc, t, "ABORTING", "aborted by the engine");
      return;
    }
    if (t.state === "ABORTING") return;
    if (t.reg !== undefined)
      this.ctx.toPeer(t.reg.peer, {
        case: "failed",
        value: { transferId, code: "ERR_ABORTED", message: "aborted by the prefill engine" },
      });
    this.end(t, "ABORTED", "aborted by the engine");
  }

  /** The engine's Abort of an id this side does not know (see `givenUp`). */
  giveUp(transferId: string): void {
    if (this.givenUp.size >= this.ctx.settings.maxTransfers) {
      const oldest = this.givenUp.keys().next().value;
      if (oldest !== undefined) this.givenUp.delete(oldest);
    }
    this.givenUp.delete(transferId);
    this.givenUp.set(transferId, this.ctx.clock.now() + this.ctx.settings.tombstoneMs);
  }

  // --- the decode peer -----------------------------------------------------------

  /** `receivedUs`: when our progress thread received D's notification (monoUs). */
  pushReg(peer: PeerState, m: PushReg, receivedUs?: number): void {
    const { ctx } = this;
    const now = ctx.clock.now();
    const existing = this.transfers.get(m.transferId);
    const fail = (code: string, message: string): void => {
      ctx.toPeer(peer, { case: "failed", value: { transferId: m.transferId, code, message } });
    };
    if (existing !== undefined && isTerminal(existing.state)) {
      // A late registration for blocks already released (lease expired, aborted): refused.
      return fail(
        existing.state === "EXPIRED" ? "ERR_LEASE_EXPIRED" : "ERR_ENDED",
        `transfer ended on P as ${existing.state}`,
      );
    }
    if (existing?.reg?.peer === peer || existing?.otherRegs.some((r) => r.peer === peer)) return; // the same engine's registration again: idempotent
    if (existing === undefined && this.givenUp.has(m.transferId))
      return fail("ERR_ABORTED", "the prefill engine gave up on this request before its prefill");
    if (m.numTokens === 0 || m.prefixTokens > m.numTokens)
      return fail("ERR_BAD_TOKENS", "bad token counts in PushReg");
    if (existing?.blocks !== undefined && !tokensEqual(existing.token, m.token)) {
      // The transfer names its decode engine by its token: anyone else is refused, and the
      // transfer goes on waiting for the right one.
      ctx.noteError(
        `PushReg for '${m.transferId}' from '${peer.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
      );
      return fail("ERR_BAD_TRANSFER_TOKEN", "the transfer's token does not match");
    }
    const leaseMs = Math.min(Math.max(m.leaseMs, 100), 10 * 60_000);
    const reg: PushRegistration = {
      peer,
      token: m.token,
      dstBlocks: [...m.blockIds],
      numTokens: m.numTokens,
      prefixTokens: m.prefixTokens,
      leaseMs,
    };
    if (existing?.reg !== undefined) {
      if (existing.blocks !== undefined || existing.otherRegs.length >= MAX_OTHER_REGISTRATIONS) {
        ctx.noteError(
          `PushReg for '${m.transferId}' from '${peer.engineId}' refused: ERR_DUPLICATE ` +
            `(registered by '${existing.reg.peer.engineId}')`,
        );
        return fail("ERR_DUPLICATE", "another decode engine registered for this transfer");
      }
      // Before PrefillDone nobody knows whose token is right: keep it until then.
      existing.otherRegs.push(reg);
      existing.trace.mark("peer.pushReg kept aside", receivedUs);
      return;
    }
    if (existing === undefined && this.atCapacity()) {
      return fail("ERR_OVERLOADED", `${ctx.settings.maxTransfers} transfers live on P`);
    }
    const t = existing ?? this.fresh(m.transferId);
    t.reg = reg;
    t.regDeadline = now + leaseMs;
    t.peer = peer.engineId;
    t.mode = "push";
    t.t.registeredMs = now;
    t.trace.mark("peer.pushReg", receivedUs);
    this.transfers.set(t.id, t);
    if (existing === undefined) begin(this.lc, t, "WAITING", "PushReg before PrefillDone");
    else void this.push(t); // HELD: prefill is done
  }

  /**
   * At PrefillDone: keeps the registration whose token matches the transfer's (the first one
   * when the transfer has no token), refuses the others, and returns the one kept.
   */
  private settleRegistrations(t: PrefillTransfer): PushRegistration | undefined {
    const all = t.reg === undefined ? t.otherRegs : [t.reg, ...t.otherRegs];
    t.otherRegs = [];
    const chosen = all.find((r) => tokensEqual(r.token, t.token));
    for (const r of all) {
      if (r === chosen) continue;
      const code =
        t.token === "" && chosen !== undefined ? "ERR_DUPLICATE" : "ERR_BAD_TRANSFER_TOKEN";
      this.ctx.noteError(`PushReg for '${t.id}' from '${r.peer.engineId}' refused: ${code}`);
      this.ctx.toPeer(r.peer, {
        case: "failed",
        value: { transferId: t.id, code, message: "not the decode engine this transfer names" },
      });
    }
    if (chosen === undefined) {
      t.reg = undefined;
      t.peer = "";
      t.mode = "";
      return undefined;
    }
    if (chosen !== t.reg) {
      t.reg = chosen;
      t.peer = chosen.peer.engineId;
      t.regDeadline = this.ctx.clock.now() + chosen.leaseMs;
    }
    return chosen;
  }

  /** P writes every rank pair's KV into D's blocks, each pair followed by its XferDone. */
  private async push(t: PrefillTransfer): Promise<void> {
    const { ctx } = this;
    const kv = ctx.kv()!;
    const reg = t.reg!;
    const peer = reg.peer;
    if (!transition(this.lc, t, "MOVING", "registration and prefill both here")) return;
    let plan: TransferPlan;
    try {
      if (reg.numTokens !== t.numTokens) {
        throw new KvxferError(
          "ERR_BAD_TOKENS",
          `D expects ${reg.numTokens} tokens, P prefilled ${t.numTokens}`,
        );
      }
      plan = planPaired(peer.pairing(kv.layout, peer.layout), {
        numTokens: t.numTokens,
        prefixTokens: reg.prefixTokens,
        srcBlockIds: t.blocks!,
        dstBlockIds: reg.dstBlocks,
      });
    } catch (err) {
      const e = transferError(err);
      ctx.toPeer(peer, {
        case: "failed",
        value: { transferId: t.id, code: e.code, message: e.message },
      });
      this.end(t, "FAILED", e.code);
      return;
    }
    t.trace.mark("planned");
    const plannedAt = performance.now();
    // A registration whose lease ran out must not be written to: D may have released the blocks.
    const results = await Promise.allSettled(
      plan.pairs.map(async (pair) => {
        const agent = kv.agents[pair.srcRank]!;
        const ep = peer.endpoint(pair.srcRank, pair.dstRank);
        const parts: WritePart[] = [];
        for (const rp of pair.regionPairs) {
          if (rp.count === 0) continue;
          parts.push({
            local: kv.regions[pair.srcRank]![rp.srcRegion]!,
            remote: peer.remote(pair.srcRank, pair.dstRank, rp.dstRegion),
            descriptors: rp.descriptors,
          });
        }
        if (ctx.clock.now() > t.regDeadline || t.state === "ABORTING" || peer.state !== "connected")
          throw new KvxferError(
            "ERR_ABORTED",
            "registration expired, aborted, or peer down before the write",
          );
        // One native operation for all of the pair's region pairs and its XferDone: one hand-off
        // to the progress thread and one flush, whatever the number of layers; the addon sends the
        // XferDone once every write is remotely complete, and not at all if one fails. So it is
        // sealed before the writes: its time since PrefillDone is to their posting.
        const xferDone = ctx.seal(peer, {
          case: "xferDone",
          value: {
            transferId: t.id,
            srcRank: pair.srcRank,
            dstRank: pair.dstRank,
            bytes: BigInt(pair.bytes),
            sincePrefillDoneMs: Math.max(0, ctx.clock.now() - t.t.prefillDoneMs),
          },
        });
        const written = await agent.writeParts(ep, parts, xferDone);
        markPairSteps(t.trace, `${pair.srcRank}>${pair.dstRank}`, [written]);
      }),
    );
    t.t.dataDoneMs = ctx.clock.now();
    t.bytes = plan.bytes;
    t.descriptors = plan.descriptorCount;
    ctx.log.debug(
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
    if (t.abortAckOwed) ctx.toPeer(peer, { case: "abortAck", value: { transferId: t.id } });
    if (failed !== undefined) {
      const e = KvxferError.from((failed as PromiseRejectedResult).reason);
      if (!t.abortAckOwed) {
        ctx.toPeer(peer, {
          case: "failed",
          value: { transferId: t.id, code: e.code, message: e.message },
        });
      }
      if (t.state !== "ABORTING") this.end(t, "FAILED", e.code);
      else this.end(t, "ABORTED", t.abortAckOwed ? "ERR_ABORTED" : e.code);
      return;
    }
    ctx.moved(plan.bytes);
    this.end(t, "RELEASED", "transferred");
  }

  /** D read P's blocks (pull): they were held throughout, or D must not use what it read. */
  readDone(
    peer: PeerState,
    transferId: string,
    bytes: number,
    token: string,
    n?: Pick<Notification, "receivedUs" | "deliveredUs">,
  ): void {
    const { ctx } = this;
    const t = this.transfers.get(transferId);
    if (t !== undefined && n !== undefined) {
      t.trace.mark("peer.readDone received", n.receivedUs);
      t.trace.mark("peer.readDone delivered", n.deliveredUs);
    }
    if (t !== undefined && t.blocks !== undefined && !tokensEqual(t.token, token)) {
      ctx.noteError(
        `ReadDone for '${transferId}' from '${peer.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
      );
      ctx.toPeer(peer, {
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
    ctx.toPeer(peer, { case: "readAck", value: { transferId, held, unknown: t === undefined } });
    t?.trace.mark("peer.readAck sent");
    if (held) {
      t.peer = peer.engineId;
      t.mode = "pull";
      t.bytes = bytes;
      ctx.moved(t.bytes);
      this.end(t, "RELEASED", "transferred");
    }
  }

  peerAbort(peer: PeerState, transferId: string, token: string): void {
    const { ctx } = this;
    const t = this.transfers.get(transferId);
    if (t === undefined || isTerminal(t.state)) {
      ctx.toPeer(peer, { case: "abortAck", value: { transferId } });
      return;
    }
    if (!this.mayActOn(t, peer, token)) {
      const other = t.otherRegs.findIndex((r) => r.peer === peer);
      if (other >= 0) {
        // A registration still waiting for PrefillDone withdrawn: nothing was written for it.
        t.otherRegs.splice(other, 1);
        ctx.toPeer(peer, { case: "abortAck", value: { transferId } });
        return;
      }
      ctx.noteError(
        `Abort for '${transferId}' from '${peer.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
      );
      return;
    }
    if (t.state === "MOVING" || t.state === "ABORTING") {
      // Acknowledged once the writes in flight have completed.
      t.abortAckOwed = true;
      if (t.state === "MOVING") transition(this.lc, t, "ABORTING", "aborted by decode");
      return;
    }
    ctx.toPeer(peer, { case: "abortAck", value: { transferId } });
    this.end(t, "ABORTED", "aborted by decode");
  }

  /** D says the transfer failed on its side; returns false when P has no such live transfer. */
  peerFailed(peer: PeerState, transferId: string, code: string, token: string): boolean {
    const t = this.transfers.get(transferId);
    if (t === undefined || isTerminal(t.state) || t.state === "MOVING" || t.state === "ABORTING")
      return false;
    if (!this.mayActOn(t, peer, token)) {
      this.ctx.noteError(
        `Failed for '${transferId}' from '${peer.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
      );
      return true;
    }
    this.end(t, "FAILED", code);
    return true;
  }

  /**
   * True when `peer` may act on `t`: it is the registered decode engine, or (no registration)
   * it presents the transfer's token.
   */
  private mayActOn(t: PrefillTransfer, peer: PeerState, token: string): boolean {
    if (t.reg !== undefined) return t.reg.peer === peer;
    return t.blocks === undefined || tokensEqual(t.token, token);
  }

  /** D's heartbeat renews the leases of the transfers it names. */
  renewLeases(peer: PeerState, ids: readonly string[]): void {
    const now = this.ctx.clock.now();
    for (const id of ids) {
      const t = this.transfers.get(id);
      if (t === undefined || isTerminal(t.state)) continue;
      if (t.reg !== undefined && t.reg.peer !== peer) continue;
      if (t.reg !== undefined) t.regDeadline = now + t.reg.leaseMs;
      if (t.state === "HELD") t.deadline = now + this.ctx.settings.leaseMs;
      else if (t.state === "WAITING" && t.reg !== undefined) t.deadline = t.regDeadline;
    }
  }

  /** The decode engine `peer` is gone: what it registered for fails (writes in flight abort). */
  peerDown(peer: PeerState): void {
    for (const t of this.transfers.values()) {
      if (isTerminal(t.state) || t.reg?.peer !== peer) continue;
      if (t.state === "MOVING") transition(this.lc, t, "ABORTING", "decode peer down");
      else if (t.state !== "ABORTING") this.end(t, "FAILED", "ERR_PEER_DOWN");
    }
  }

  /** Writes to `peer` still in flight. */
  writingTo(peer: PeerState): boolean {
    for (const t of this.transfers.values())
      if (t.reg?.peer === peer && (t.state === "MOVING" || t.state === "ABORTING")) return true;
    return false;
  }

  /** Live transfers registered by `peer`. */
  liveWith(peer: PeerState): boolean {
    for (const t of this.transfers.values())
      if (t.reg?.peer === peer && !isTerminal(t.state)) return true;
    return false;
  }

  /** Peers with live registrations (each gets a heartbeat). */
  livePeers(): Set<PeerState> {
    const out = new Set<PeerState>();
    for (const t of this.transfers.values())
      if (t.reg !== undefined && !isTerminal(t.state)) out.add(t.reg.peer);
    return out;
  }

  /** Ends what ran out of time and forgets old tombstones. */
  expire(now: number): void {
    for (const [id, until] of this.givenUp) if (now >= until) this.givenUp.delete(id);
    for (const t of this.transfers.values()) {
      if (now < t.deadline) continue;
      if (isTerminal(t.state)) {
        this.transfers.delete(t.id);
      } else if (t.state === "HELD") {
        this.end(t, "EXPIRED", "lease expired");
      } else if (t.state === "WAITING") {
        // A registration nobody's prefill finished in time.
        if (t.reg !== undefined)
          this.ctx.toPeer(t.reg.peer, {
            case: "failed",
            value: {
              transferId: t.id,
              code: "ERR_TIMEOUT",
              message: "no prefill before the registration lease ran out",
            },
          });
        this.end(t, "EXPIRED", "registration lease expired");
      }
      // MOVING and ABORTING end when their writes settle; each write is bounded by the endpoint.
    }
  }

  /** Transfers whose blocks P holds under a lease (HELD, or WAITING for prefill). */
  leased(): number {
    let n = 0;
    for (const t of this.transfers.values()) if (t.state === "HELD" || t.state === "WAITING") n++;
    return n;
  }
}
