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
  /** No write for it may start after this (renewed by its D's heartbeats). */
  deadline: number;
  /**
   * Before PrefillDone: how its decode engine withdrew it (Abort, Failed, its lease, going
   * down). It counts only at PrefillDone, and only if its token is the transfer's: before the
   * token is known, nothing a registrant says ends the transfer.
   */
  withdrawn?: { kind: "ABORTED" | "FAILED" | "EXPIRED"; reason: string };
}

/** P's side of one transfer. */
export interface PrefillTransfer {
  readonly id: string;
  readonly state: PrefillState;
  blocks: number[] | undefined;
  numTokens: number;
  /** The registration P writes for: chosen at PrefillDone by the token, or one after it. */
  reg: PushRegistration | undefined;
  /**
   * Before PrefillDone, every registration (at most MAX_PENDING_REGISTRATIONS, one per decode
   * engine), withdrawn ones included: the token picks one at PrefillDone.
   */
  pending: PushRegistration[];
  /** The decode engine whose PushReg created this entry, until PrefillDone (its share, O(1)). */
  namedBy: PeerState | undefined;
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

/** Registrations kept before PrefillDone for one transfer, at most (one per decode engine). */
const MAX_PENDING_REGISTRATIONS = 5;

/** Entries one decode engine may create by PushReg before PrefillDone: this share of maxTransfers. */
export const PER_PEER_SHARE = 8;

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
  /** The sidecar is stopping: no new registration is kept (drain()). */
  private draining = false;

  constructor(ctx: SideContext) {
    super(ctx, "prefill", PREFILL_INITIAL, PREFILL_NEXT);
  }

  protected enter(t: PrefillTransfer, to: PrefillState): void {
    const now = this.ctx.clock.now();
    switch (to) {
      case "WAITING":
        break; // its deadline is its registrations' (rearm)
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
    this.unname(t);
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
      pending: [],
      namedBy: undefined,
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
      // was already emitted; a second PrefillDone is a duplicate (blocks are now set). The
      // token is recorded here too: D's ReadDone then hears "not held", not a token refusal.
      existing.blocks = [...m.blockIds];
      existing.token = m.token;
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
    // A KV file that shrank: nothing may read these blocks (a pull's reads would fault).
    const shrunk = ctx.kv()?.shrunk?.();
    t.blocks = [...m.blockIds];
    if (s.exclusivePrefillBlocks) this.claims.claim(t.blocks, t.id);
    t.numTokens = m.numTokens;
    t.token = m.token;
    t.t.prefillDoneMs = ctx.clock.now();
    t.trace.mark("engine.prefillDone", receivedUs);
    const reg = this.settleRegistrations(t);
    if (shrunk !== undefined) {
      if (reg !== undefined && reg.withdrawn === undefined)
        ctx.toPeer(reg.peer, {
          case: "failed",
          value: { transferId: t.id, code: "ERR_REGION_CHANGED", message: shrunk },
        });
      if (existing === undefined) this.track(t, "HELD", "PrefillDone");
      ctx.noteError(`PrefillDone for '${t.id}': ${shrunk}`);
      this.end(t, "FAILED", "ERR_REGION_CHANGED");
      return;
    }
    if (existing === undefined) {
      this.track(t, "HELD", "PrefillDone");
    } else if (reg?.withdrawn !== undefined) {
      // The registration the token names was withdrawn before prefill finished: it counts now.
      this.end(t, reg.withdrawn.kind, reg.withdrawn.reason);
      return;
    } else if (reg === undefined) {
      transition(this.lc, t, "HELD", "PrefillDone, no registration");
    }
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
    // HELD or WAITING: a registration chosen at PrefillDone is written at once (MOVING), so
    // only those kept aside before it can be waiting here.
    for (const r of t.pending.filter((x) => !x.withdrawn))
      this.ctx.toPeer(r.peer, {
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
        existing.state === "EXPIRED"
          ? "ERR_LEASE_EXPIRED"
          : existing.reason === "ERR_REGION_CHANGED"
            ? "ERR_REGION_CHANGED" // P's KV broke: D should hear why, not only that it ended
            : "ERR_ENDED",
        `transfer ended on P as ${existing.state}`,
      );
    }
    const mine = existing?.pending.find((r) => r.peer === peer);
    if (existing?.reg?.peer === peer || (mine !== undefined && mine.withdrawn === undefined))
      return; // the same engine's registration again: idempotent
    if (existing === undefined && this.givenUp.has(m.transferId))
      return fail("ERR_ABORTED", "the prefill engine gave up on this request before its prefill");
    if (m.numTokens === 0 || m.prefixTokens > m.numTokens)
      return fail("ERR_BAD_TOKENS", "bad token counts in PushReg");
    if (this.draining && existing?.blocks === undefined)
      // Its PrefillDone would be refused: D frees its blocks now, not at its watchdog.
      return fail("ERR_DRAINING", "the prefill sidecar is stopping");
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
      deadline: now + leaseMs,
    };
    if (existing !== undefined && existing.blocks === undefined) {
      // Before PrefillDone nobody knows whose token is right: keep it until then.
      if (mine !== undefined) {
        // Its own withdrawn registration, made again: it replaces it.
        existing.pending[existing.pending.indexOf(mine)] = reg;
      } else {
        if (existing.pending.length >= MAX_PENDING_REGISTRATIONS) {
          // A withdrawn registration gives its place up; live ones keep theirs.
          const gone = existing.pending.findIndex((r) => r.withdrawn !== undefined);
          if (gone < 0) {
            ctx.noteError(
              `PushReg for '${m.transferId}' from '${peer.engineId}' refused: ERR_DUPLICATE ` +
                `(${MAX_PENDING_REGISTRATIONS} decode engines registered)`,
            );
            return fail("ERR_DUPLICATE", "another decode engine registered for this transfer");
          }
          existing.pending.splice(gone, 1);
        }
        existing.pending.push(reg);
      }
      existing.trace.mark("peer.pushReg kept aside", receivedUs);
      this.rearm(existing);
      return;
    }
    if (existing !== undefined) {
      // Prefill done and the token matches.
      if (existing.reg !== undefined) {
        ctx.noteError(
          `PushReg for '${m.transferId}' from '${peer.engineId}' refused: ERR_DUPLICATE ` +
            `(registered by '${existing.reg.peer.engineId}')`,
        );
        return fail("ERR_DUPLICATE", "another decode engine registered for this transfer");
      }
      existing.reg = reg;
      existing.regDeadline = reg.deadline;
      existing.peer = peer.engineId;
      existing.mode = "push";
      existing.t.registeredMs = now;
      existing.trace.mark("peer.pushReg", receivedUs);
      void this.push(existing); // HELD: prefill is done
      return;
    }
    // A new entry named by this peer: bounded by its share, then by the table (both O(1)).
    const share = this.perPeerCap();
    if (peer.named >= share) {
      ctx.noteError(
        `PushReg for '${m.transferId}' from '${peer.engineId}' refused: ERR_OVERLOADED ` +
          `(${share} registrations waiting for prefill from this engine)`,
      );
      return fail("ERR_OVERLOADED", `${share} registrations of yours wait for prefill on P`);
    }
    if (this.atCapacity()) {
      return fail("ERR_OVERLOADED", `${ctx.settings.maxTransfers} transfers live on P`);
    }
    const t = this.fresh(m.transferId);
    t.pending = [reg];
    t.namedBy = peer;
    peer.named++;
    t.peer = peer.engineId;
    t.mode = "push";
    t.t.registeredMs = now;
    t.trace.mark("peer.pushReg", receivedUs);
    this.track(t, "WAITING", "PushReg before PrefillDone");
    this.rearm(t);
  }

  /** Entries one decode engine may create before PrefillDone. */
  private perPeerCap(): number {
    const s = this.ctx.settings;
    return s.maxPerPeer ?? Math.max(1, Math.floor(s.maxTransfers / PER_PEER_SHARE));
  }

  /** The entry no longer counts against the peer whose PushReg created it. */
  private unname(t: PrefillTransfer): void {
    if (t.namedBy === undefined) return;
    t.namedBy.named--;
    t.namedBy = undefined;
  }

  /**
   * A WAITING entry's deadline: its first live registration's, or (all withdrawn) the time its
   * withdrawals are remembered for a late PrefillDone. At most MAX_PENDING_REGISTRATIONS.
   */
  private rearm(t: PrefillTransfer): void {
    let next = Infinity;
    for (const r of t.pending) if (r.withdrawn === undefined) next = Math.min(next, r.deadline);
    t.deadline = next === Infinity ? this.ctx.clock.now() + this.ctx.settings.leaseMs : next;
    const first = t.pending.find((r) => r.withdrawn === undefined) ?? t.pending[0];
    t.peer = first?.peer.engineId ?? "";
  }

  /** A registration kept before PrefillDone is withdrawn; the transfer goes on. */
  private withdraw(
    t: PrefillTransfer,
    r: PushRegistration,
    kind: "ABORTED" | "FAILED" | "EXPIRED",
    reason: string,
  ): void {
    r.withdrawn = { kind, reason };
    t.trace.mark(`peer.pushReg withdrawn (${kind})`);
    this.rearm(t);
  }

  /** `peer`'s live registration kept before PrefillDone, if any. */
  private pendingOf(t: PrefillTransfer, peer: PeerState): PushRegistration | undefined {
    if (t.blocks !== undefined) return undefined;
    return t.pending.find((r) => r.peer === peer && r.withdrawn === undefined);
  }

  /**
   * At PrefillDone: picks the registration whose token matches the transfer's (the first one
   * when the transfer has no token), refuses the others still live, and returns the one picked
   * (withdrawn or not).
   */
  private settleRegistrations(t: PrefillTransfer): PushRegistration | undefined {
    const all = t.pending;
    t.pending = [];
    this.unname(t);
    // A live registration with the token first (the same D again after a restart, say), else a
    // withdrawn one: then the transfer ends as its D asked.
    const matches = all.filter((r) => tokensEqual(r.token, t.token));
    const chosen = matches.find((r) => r.withdrawn === undefined) ?? matches[0];
    for (const r of all) {
      if (r === chosen || r.withdrawn !== undefined) continue;
      const code =
        t.token === "" && chosen !== undefined ? "ERR_DUPLICATE" : "ERR_BAD_TRANSFER_TOKEN";
      this.ctx.noteError(`PushReg for '${t.id}' from '${r.peer.engineId}' refused: ${code}`);
      this.ctx.toPeer(r.peer, {
        case: "failed",
        value: { transferId: t.id, code, message: "not the decode engine this transfer names" },
      });
    }
    if (chosen === undefined || chosen.withdrawn !== undefined) {
      t.reg = undefined;
      t.peer = chosen?.peer.engineId ?? "";
      t.mode = chosen === undefined ? "" : "push";
      return chosen;
    }
    t.reg = chosen;
    t.peer = chosen.peer.engineId;
    t.mode = "push";
    t.regDeadline = chosen.deadline;
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
      // A KV file that shrank would fault (SIGBUS) when the writes read it.
      const shrunk = kv.shrunk?.();
      if (shrunk !== undefined) throw new KvxferError("ERR_REGION_CHANGED", shrunk);
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
      ctx.noteError(`push of '${t.id}' refused: ${e.code}: ${e.message}`);
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
    if (t.blocks === undefined) {
      // Before PrefillDone: the registrant withdraws its own registration, nothing more; it
      // counts at PrefillDone if its token is the transfer's. Nothing was written for it.
      const r = this.pendingOf(t, peer);
      if (r !== undefined) {
        this.withdraw(t, r, "ABORTED", "aborted by decode");
        ctx.toPeer(peer, { case: "abortAck", value: { transferId } });
        return;
      }
    }
    if (!this.mayActOn(t, peer, token)) {
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
    const r = this.pendingOf(t, peer);
    if (r !== undefined) {
      this.withdraw(t, r, "FAILED", code);
      return true;
    }
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
   * True when `peer` may end `t`: prefill is done (the token is known), it presents the token,
   * and it is the registered decode engine if one registered. Before PrefillDone nobody may.
   */
  private mayActOn(t: PrefillTransfer, peer: PeerState, token: string): boolean {
    if (t.blocks === undefined || !tokensEqual(t.token, token)) return false;
    return t.reg === undefined || t.reg.peer === peer;
  }

  /**
   * The sidecar starts stopping: every transfer still waiting for PrefillDone (which will be
   * refused) fails now, and each decode engine registered for it is told at once, so it frees
   * its blocks instead of waiting out our registration lease.
   */
  drain(): void {
    this.draining = true;
    for (const t of this.transfers.values()) {
      if (t.state !== "WAITING") continue;
      for (const r of t.pending.filter((x) => x.withdrawn === undefined))
        this.ctx.toPeer(r.peer, {
          case: "failed",
          value: {
            transferId: t.id,
            code: "ERR_DRAINING",
            message: "the prefill sidecar is stopping",
          },
        });
      this.end(t, "FAILED", "ERR_DRAINING");
    }
  }

  /**
   * The drain's deadline passed: what is not moving fails now, its decode engine told (a pull's
   * reader hears "not held" when it asks). Writes in flight settle or are abandoned at close.
   */
  abandon(): void {
    this.drain();
    // HELD: held for a pull (a registration is written at once): D hears "not held".
    for (const t of this.transfers.values())
      if (t.state === "HELD") this.end(t, "FAILED", "ERR_DRAINING");
  }

  /** The registered KV broke (a file shrank): what P holds for a pull fails, D's read unconfirmed. */
  failHeld(code: string): void {
    for (const t of this.transfers.values()) if (t.state === "HELD") this.end(t, "FAILED", code);
  }

  /** D's heartbeat renews the leases of the transfers it names. */
  renewLeases(peer: PeerState, ids: readonly string[]): void {
    const now = this.ctx.clock.now();
    for (const id of ids) {
      const t = this.transfers.get(id);
      if (t === undefined || isTerminal(t.state)) continue;
      if (t.blocks === undefined) {
        const r = this.pendingOf(t, peer);
        if (r === undefined) continue;
        r.deadline = now + r.leaseMs;
        this.rearm(t);
        continue;
      }
      if (t.reg !== undefined && t.reg.peer !== peer) continue;
      if (t.reg !== undefined) t.regDeadline = t.reg.deadline = now + t.reg.leaseMs;
      if (t.state === "HELD") t.deadline = now + this.ctx.settings.leaseMs;
    }
  }

  /** The decode engine `peer` is gone: what it registered for fails (writes in flight abort). */
  peerDown(peer: PeerState): void {
    for (const t of this.transfers.values()) {
      if (isTerminal(t.state)) continue;
      const r = this.pendingOf(t, peer);
      if (r !== undefined) {
        // Before PrefillDone its registration is withdrawn; the transfer is not its to end.
        this.withdraw(t, r, "FAILED", "ERR_PEER_DOWN");
        continue;
      }
      // After PrefillDone a registration is written at once: MOVING, or ABORTING already.
      if (t.reg?.peer === peer && t.state === "MOVING")
        transition(this.lc, t, "ABORTING", "decode peer down");
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
      if (!isTerminal(t.state) && (t.reg?.peer === peer || this.pendingOf(t, peer) !== undefined))
        return true;
    return false;
  }

  /** Peers with live registrations (each gets a heartbeat). */
  livePeers(): Set<PeerState> {
    const out = new Set<PeerState>();
    for (const t of this.transfers.values()) {
      if (isTerminal(t.state)) continue;
      if (t.reg !== undefined) out.add(t.reg.peer);
      else if (t.blocks === undefined)
        for (const r of t.pending) if (r.withdrawn === undefined) out.add(r.peer);
    }
    return out;
  }

  /** Ends what ran out of time and forgets old tombstones. */
  expire(now: number): void {
    for (const [id, until] of this.givenUp) if (now >= until) this.givenUp.delete(id);
    for (const t of this.transfers.values()) {
      if (now < t.deadline) continue;
      if (isTerminal(t.state)) {
        this.forget(t);
      } else if (t.state === "HELD") {
        this.end(t, "EXPIRED", "lease expired");
      } else if (t.state === "WAITING") {
        // Registrations nobody's prefill finished in time: each is over, the transfer is not
        // (its token is unknown yet). With none left, the entry goes once its withdrawals are
        // no longer worth remembering: P's engine never gave blocks for it, so no event.
        const live = t.pending.filter((r) => r.withdrawn === undefined);
        for (const r of live) {
          if (now < r.deadline) continue;
          this.ctx.toPeer(r.peer, {
            case: "failed",
            value: {
              transferId: t.id,
              code: "ERR_TIMEOUT",
              message: "no prefill before the registration lease ran out",
            },
          });
          this.withdraw(t, r, "EXPIRED", "registration lease expired");
        }
        if (live.length === 0) {
          this.unname(t);
          this.forget(t);
        }
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
