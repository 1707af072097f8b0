/**
 * P's side of every transfer: the table of P's transfers and the interpreter of P's machine
 * (prefill-machine.ts). Each handler turns what happened (the engine's PrefillDone and Abort,
 * D's PushReg, ReadDone, Abort and Failed, D's heartbeats, the writes settling, the clock, D
 * going down, the sidecar stopping) into one event; the table says where that moves the
 * transfer and which effects run; `run` runs them. P writes D's blocks (push) or holds its own
 * while D reads them (pull), and gives its blocks back to the engine exactly once, in the one
 * exit.
 */
import { ReleaseReason, type LayersSaved, type PrefillDone } from "../gen/kvxfer/v1/engine_pb.js";
import type { PushReg } from "../gen/kvxfer/v1/peer_pb.js";
import { KvxferError } from "../errors.js";
import type { PeerState } from "../peer/peer-state.js";
import { BlockClaims } from "./claims.js";
import type { SideContext } from "./context.js";
import { isTerminal, OUTCOME, transition } from "./lifecycle.js";
import {
  PREFILL_FAILS_AS,
  PREFILL_INITIAL,
  PREFILL_LEASED,
  PREFILL_NEXT,
  PREFILL_WRITING,
  prefillStep,
  type PrefillEffect,
  type PrefillEvent,
  type PrefillState,
} from "./prefill-machine.js";
import { FairPool } from "../peer/fair-pool.js";
import {
  DISPLACED,
  checkRegistration,
  endedRefusal,
  keepAside,
  newRegistration,
  poolRefusal,
  readTokenRefusal,
  refuseNewEntry,
  takenRefusal,
  unconfirmedCap,
  type Refusal,
} from "./prefill-registrations.js";
import {
  layersPending,
  mayActOn,
  newPrefillTransfer,
  pendingOf,
  rearm,
  releaseReason,
  settleRegistrations,
  prefillInfo,
  wakeLayers,
  type Arrival,
  type EventData,
  type PrefillTransfer,
  type PushRegistration,
} from "./prefill-transfer.js";
import { planPush, postWrites } from "./prefill-writes.js";
import { SideTable } from "./side-table.js";
import type { TerminalKind, TransferInfo } from "./view.js";
import { allBlockIds, blockLists } from "../plan/index.js";

export { PER_PEER_SHARE, type PrefillTransfer, type PushRegistration } from "./prefill-transfer.js";

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
  /**
   * Every registration kept before PrefillDone (ids P's engine has not named), by decode
   * engine: bounded apart from the table (a real PrefillDone never finds room taken by them),
   * and shared fairly: when full, a newcomer takes the place of the oldest registration of the
   * engine holding the most, which is told (DISPLACED). More identities do not fill it against
   * a real decode engine: it is displaced only once every engine holds as few as it does.
   */
  private readonly unconfirmed: FairPool<PushRegistration>;
  /** Entries waiting for PrefillDone (AWAITING_PREFILL): not counted against the table's cap. */
  private readonly awaiting = new Set<PrefillTransfer>();
  /** Registrations displaced since the sweep last asked (takeDisplaced). */
  private displaced = 0;

  constructor(ctx: SideContext) {
    super(ctx, "prefill", PREFILL_INITIAL, PREFILL_NEXT);
    this.unconfirmed = new FairPool(unconfirmedCap(ctx.settings));
  }

  /** Registrations `peer` keeps before PrefillDone (tests, status). */
  registrationsOf(peer: PeerState): number {
    return this.unconfirmed.count(peer.engineId);
  }

  /** Registrations kept before PrefillDone, all decode engines together. */
  unconfirmedCount(): number {
    return this.unconfirmed.size;
  }

  /**
   * Room for `reg` in the unconfirmed pool: past its engine's share, or in a full pool where its
   * engine holds as many as any, refused; otherwise taken, displacing the oldest registration
   * of the engine holding the most when full.
   */
  private admit(reg: PushRegistration, into?: PrefillTransfer): Refusal | undefined {
    const pool = this.unconfirmed;
    const id = reg.peer.engineId;
    const victim = pool.full ? pool.victimFor(id, false) : undefined;
    const no = poolRefusal(
      reg.peer,
      reg.transferId,
      pool.count(id),
      pool.full && victim === undefined,
      this.ctx.settings,
    );
    if (no !== undefined) return no;
    if (victim !== undefined) this.displace(victim, into);
    pool.add(reg, id);
    return undefined;
  }

  /**
   * `reg` gives its place up: its engine is told; an entry left with none goes (unless it is
   * `into`, the entry the newcomer joins).
   */
  private displace(reg: PushRegistration, into: PrefillTransfer | undefined): void {
    // Every registration in the pool is one its waiting entry keeps (they leave both together).
    this.unconfirmed.delete(reg);
    const t = this.transfers.get(reg.transferId)!;
    t.pending.delete(reg.peer);
    if (t.pending.size === 0 && t !== into) {
      this.awaiting.delete(t);
      this.forget(t);
    } else this.rearm(t);
    if (reg.withdrawn === undefined)
      this.failTo(reg.peer, reg.transferId, DISPLACED.code, DISPLACED.message);
    this.displaced++;
  }

  takeDisplaced(): number {
    const n = this.displaced;
    this.displaced = 0;
    return n;
  }

  /** `t` no longer waits for PrefillDone: its registrations leave the unconfirmed pool. */
  private confirmOrEnd(t: PrefillTransfer): void {
    if (!this.awaiting.delete(t)) return;
    for (const r of t.pending.values()) this.unconfirmed.delete(r);
  }

  protected enter(t: PrefillTransfer, to: PrefillState): void {
    const now = this.ctx.clock.now();
    switch (to) {
      case "AWAITING_PREFILL":
        break; // its deadline is its registrations' (rearm)
      case "HELD":
        t.deadline = now + this.ctx.settings.leaseMs;
        break;
      case "WRITING":
        t.t.dataStartedMs = now;
        break;
      case "ABORTING":
      case "ABORTING_FOR_D":
        wakeLayers(t); // writes waiting for layers stop waiting
        break;
      default:
        t.t.endedMs = now;
        t.deadline = now + this.ctx.settings.tombstoneMs;
    }
  }

  protected exit(t: PrefillTransfer, kind: PrefillState & TerminalKind): void {
    this.confirmOrEnd(t);
    wakeLayers(t);
    if (t.blocks !== undefined) {
      if (this.ctx.settings.exclusivePrefillBlocks) this.claims.release(t.blocks, t.id);
      this.ctx.engine.send({
        case: "releaseBlocks",
        value: { transferId: t.id, blockIds: t.blocks, reason: releaseReason(kind) },
      });
      t.trace.mark("engine.releaseBlocks sent");
    }
    this.ctx.events.emit(kind, t.id, t.peer, "prefill", t.reason, t.bytes, t.mode);
    t.trace.mark("event.appended");
  }

  protected info(t: PrefillTransfer): TransferInfo {
    return prefillInfo(t);
  }

  // --- the interpreter -------------------------------------------------------------

  /**
   * Feeds `event` to `t`'s machine: runs the row's effects, moves to its state (a terminal one
   * with the row's reason, else the event's), runs what follows the move. Returns false when
   * the state ignores the event (no row).
   */
  private on(t: PrefillTransfer, event: PrefillEvent, data: EventData = {}): boolean {
    const row = prefillStep(t.state, event);
    if (row === undefined) return false;
    for (const e of row.effects ?? []) this.run(t, e, event, data);
    if (row.to !== undefined) {
      const to = row.to === OUTCOME ? t.outcome!.kind : row.to;
      const reason = row.to === OUTCOME ? t.outcome!.reason : (row.reason ?? data.reason ?? event);
      if (isTerminal(to)) t.reason = reason;
      transition(this.lc, t, to, reason);
    }
    for (const e of row.then ?? []) this.run(t, e, event, data);
    return true;
  }

  /** One effect of a row, for `event` (and what came with it). */
  private run(t: PrefillTransfer, effect: PrefillEffect, event: PrefillEvent, d: EventData): void {
    const { ctx } = this;
    switch (effect) {
      case "ACCEPT_PREFILL":
        return this.acceptPrefill(t, d.prefill!, d.receivedUs, d.shrunk);
      case "LATE_PREFILL":
        return this.latePrefill(t, d.prefill!);
      case "REFUSE_DUPLICATE":
        return ctx.engine.refuse(
          t.id,
          "ERR_DUPLICATE",
          `PrefillDone for transfer '${t.id}' already received`,
        );
      case "TELL_REG_REGION":
        if (d.reg !== undefined && d.reg.withdrawn === undefined)
          ctx.peers.send(d.reg.peer, {
            case: "failed",
            value: { transferId: t.id, code: "ERR_REGION_CHANGED", message: d.shrunk! },
          });
        if (d.shrunk !== undefined) ctx.errors.note(`PrefillDone for '${t.id}': ${d.shrunk}`);
        return;
      case "TELL_PENDING_ABORTED":
        return this.tellPending(t, "ERR_ABORTED", "aborted by the prefill engine");
      case "TELL_PENDING_DRAINING":
        return this.tellPending(t, "ERR_DRAINING", "the prefill sidecar is stopping");
      case "CHECK_REG":
        return this.checkReg(t, d.peer!, d.pushReg!, d.receivedUs);
      case "REFUSE_ENDED":
        return this.refuse(d.peer!, t.id, endedRefusal(t));
      case "KEEP_ASIDE": {
        const reg = d.reg!;
        const mine = t.pending.get(reg.peer);
        if (mine === undefined) {
          const no = this.admit(reg, t);
          if (no !== undefined) return this.refuse(reg.peer, t.id, no);
        } else {
          // Its own withdrawn registration, made again: it takes that one's place.
          this.unconfirmed.delete(mine);
          this.unconfirmed.add(reg, reg.peer.engineId);
        }
        keepAside(t, reg);
        t.trace.mark("peer.pushReg kept aside", d.receivedUs);
        return;
      }
      case "TAKE_REG": {
        const reg = d.reg!;
        t.reg = reg;
        t.regDeadline = reg.deadline;
        t.peer = reg.peer.engineId;
        t.mode = "push";
        t.t.registeredMs = ctx.clock.now();
        t.trace.mark("peer.pushReg", d.receivedUs);
        return;
      }
      case "REFUSE_REG_TAKEN":
        return this.refuse(d.peer!, t.id, takenRefusal(t, d.peer!));
      case "START_WRITES":
        return this.write(t);
      case "TELL_D_FAILED":
        return this.failTo(t.reg!.peer, t.id, d.error!.code, d.error!.message);
      case "ACK_ABORT":
        // To the handshake the Abort came through (D's Abort is the only way into the states
        // that owe an AbortAck; after a partition it is not the one the registration came by).
        return ctx.peers.send(d.peer ?? t.abortFrom!, {
          case: "abortAck",
          value: { transferId: t.id },
        });
      case "MOVED":
        ctx.tally.moved(d.bytes!);
        return;
      case "TRACE_READ_DONE":
        if (d.read!.arrival !== undefined) {
          t.trace.mark("peer.readDone received", d.read!.arrival.receivedUs);
          t.trace.mark("peer.readDone delivered", d.read!.arrival.deliveredUs);
        }
        return;
      case "CHECK_READ_TOKEN": {
        const no = readTokenRefusal(t, d.peer!, d.read!.token);
        if (no !== undefined) return this.refuse(d.peer!, t.id, no);
        // Layer-wise: a read before every layer was saved read KV still being computed.
        this.on(t, layersPending(t) ? "READ_EARLY" : "READ_OK", d);
        return;
      }
      case "ACK_HELD":
      case "ACK_NOT_HELD": {
        // D reports ready only if P says the blocks were still held when it read them.
        const held = effect === "ACK_HELD";
        t.trace.mark("peer.readAck sent"); // before: D may receive it before send() returns
        ctx.peers.send(d.peer!, {
          case: "readAck",
          value: { transferId: t.id, held, unknown: false },
        });
        if (held) {
          t.peer = d.peer!.engineId;
          t.mode = "pull";
          t.bytes = d.read!.bytes;
          ctx.tally.moved(t.bytes);
        }
        return;
      }
      case "WITHDRAW": {
        const kind = PREFILL_FAILS_AS[event] as "ABORTED" | "FAILED" | "EXPIRED";
        const r = d.withdrawn!;
        r.withdrawn = { kind, reason: d.reason! };
        t.trace.mark(`peer.pushReg withdrawn (${kind})`);
        this.rearm(t);
        return;
      }
      case "REFUSE_ABORT":
        return ctx.errors.note(
          `Abort for '${t.id}' from '${d.peer!.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
        );
      case "REFUSE_FAILED":
        return ctx.errors.note(
          `Failed for '${t.id}' from '${d.peer!.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
        );
      case "RENEW_REG":
        if (t.reg !== undefined) t.regDeadline = t.reg.deadline = d.now! + t.reg.leaseMs;
        return;
      case "RENEW_HOLD":
        t.deadline = d.now! + ctx.settings.leaseMs;
        return;
      case "RENEW_PENDING": {
        // Later only: the entry's deadline may now come early, and is made again then.
        const r = pendingOf(t, d.peer!)!;
        r.deadline = d.now! + r.leaseMs;
        return;
      }
      case "EXPIRE_REGS":
        return this.expireRegs(t, d.now!);
      case "FORGET":
        return this.forget(t);
    }
  }

  private failTo(peer: PeerState, transferId: string, code: string, message: string): void {
    this.ctx.peers.send(peer, { case: "failed", value: { transferId, code, message } });
  }

  /** Notes the refusal's line (if it has one), then tells `peer`. */
  private refuse(peer: PeerState, transferId: string, r: Refusal): void {
    if (r.note !== undefined) this.ctx.errors.note(r.note);
    this.failTo(peer, transferId, r.code, r.message);
  }

  /** Every registration kept aside, not withdrawn, hears Failed. */
  private tellPending(t: PrefillTransfer, code: string, message: string): void {
    for (const r of t.pending.values())
      if (r.withdrawn === undefined) this.failTo(r.peer, t.id, code, message);
  }

  // --- the engine ----------------------------------------------------------------

  /** `receivedUs`: when the engine's message arrived (monoUs). */
  prefillDone(m: PrefillDone, receivedUs?: number): void {
    const { ctx } = this;
    const s = ctx.settings;
    if (s.exclusivePrefillBlocks) {
      // Refused without a ReleaseBlocks: another live transfer holds these blocks.
      const clash = this.claims.clash(
        allBlockIds(blockLists(m.groups, m.blockIds)),
        0,
        m.transferId,
      );
      if (clash !== undefined) return ctx.engine.refuse(m.transferId, "ERR_BLOCKS_IN_USE", clash);
    }
    const existing = this.transfers.get(m.transferId);
    // A KV file that shrank: nothing may read these blocks (a pull's reads would fault).
    if (existing !== undefined) {
      const shrunk = existing.state === "AWAITING_PREFILL" ? ctx.kvs.kv?.shrunk?.() : undefined;
      this.on(existing, "PREFILL_DONE", { prefill: m, receivedUs, shrunk });
      return;
    }
    // Entries waiting for PrefillDone are not counted: they never take a real transfer's room.
    if (this.live() - this.awaiting.size >= s.maxTransfers) {
      // The engine gets its blocks back at once: nobody will read them.
      ctx.engine.send({
        case: "releaseBlocks",
        value: {
          transferId: m.transferId,
          blockIds: allBlockIds(blockLists(m.groups, m.blockIds)),
          reason: ReleaseReason.FAILED,
        },
      });
      return ctx.engine.refuse(m.transferId, "ERR_OVERLOADED", `${s.maxTransfers} transfers live`);
    }
    const t = newPrefillTransfer(m.transferId);
    const shrunk = ctx.kvs.kv?.shrunk?.();
    this.takePrefill(t, m, receivedUs);
    this.track(t, "HELD", "PrefillDone");
    if (shrunk !== undefined) this.on(t, "REGION_BROKEN", { shrunk });
  }

  /** PrefillDone's blocks, token and timings on `t`. */
  private takePrefill(t: PrefillTransfer, m: PrefillDone, receivedUs: number | undefined): void {
    t.lists = blockLists(m.groups, m.blockIds);
    t.blocks = allBlockIds(t.lists);
    if (this.ctx.settings.exclusivePrefillBlocks) this.claims.claim(t.blocks, t.id);
    t.numTokens = m.numTokens;
    t.token = m.token;
    if (m.layerWise)
      t.layers = { saved: 0, total: this.ctx.kvs.kv!.groups[0]!.layout.numLayers, waiters: [] };
    t.t.prefillDoneMs = this.ctx.clock.now();
    t.trace.mark("engine.prefillDone", receivedUs);
  }

  /** ACCEPT_PREFILL: prefill done for a transfer D registered for; the token picks the registration. */
  private acceptPrefill(
    t: PrefillTransfer,
    m: PrefillDone,
    receivedUs: number | undefined,
    shrunk: string | undefined,
  ): void {
    this.takePrefill(t, m, receivedUs);
    this.confirmOrEnd(t);
    const reg = settleRegistrations(this.ctx, t);
    if (shrunk !== undefined) this.on(t, "REGION_BROKEN", { reg, shrunk });
    else if (reg?.withdrawn !== undefined) {
      t.outcome = reg.withdrawn;
      this.on(t, "REG_WITHDRAWN");
    } else if (reg === undefined) this.on(t, "NO_REG", { reason: "PrefillDone, no registration" });
    else this.on(t, "REG_CHOSEN", { reason: "registration and prefill both here" });
  }

  /**
   * LATE_PREFILL: the transfer ended before prefill did (D aborted, its registration ran out, D
   * went down): nobody will read these blocks, so they go straight back. Its one terminal event
   * was already emitted; a second PrefillDone is a duplicate (blocks are now set). The token is
   * recorded here too: D's ReadDone then hears "not held", not a token refusal.
   */
  private latePrefill(t: PrefillTransfer, m: PrefillDone): void {
    if (t.blocks !== undefined) {
      this.ctx.engine.refuse(
        t.id,
        "ERR_DUPLICATE",
        `PrefillDone for transfer '${t.id}' already received`,
      );
      return;
    }
    t.lists = blockLists(m.groups, m.blockIds);
    t.blocks = allBlockIds(t.lists);
    t.token = m.token;
    this.ctx.engine.send({
      case: "releaseBlocks",
      value: {
        transferId: t.id,
        blockIds: t.blocks,
        reason: releaseReason(t.state as TerminalKind), // never RELEASED: that needs blocks
      },
    });
  }

  /**
   * The engine saved the first `m.layers` layers of each named layer-wise transfer: writes
   * waiting for them go on. An id that is not a live layer-wise transfer is refused (the others
   * still count); one that ended meanwhile (D aborted during the forward) is nothing to do.
   */
  layersSaved(m: LayersSaved, receivedUs?: number): void {
    for (const id of m.transferIds) {
      const t = this.transfers.get(id);
      if (t !== undefined && isTerminal(t.state)) continue;
      if (t?.layers === undefined) {
        this.ctx.engine.refuse(
          id,
          "ERR_BAD_LAYERS",
          t === undefined
            ? `LayersSaved for '${id}': no such transfer (a layer-wise PrefillDone comes first)`
            : `LayersSaved for '${id}': its PrefillDone was not layer-wise`,
        );
        continue;
      }
      if (m.layers <= t.layers.saved) continue;
      t.layers.saved = m.layers;
      if (m.layers === t.layers.total) t.trace.mark("engine.layersSaved all", receivedUs);
      wakeLayers(t);
    }
  }

  /** The engine aborts: at once, or (writes in flight) once they settle. */
  abort(transferId: string): void {
    const t = this.transfers.get(transferId);
    if (t !== undefined) this.on(t, "ENGINE_ABORT", { reason: "aborted by the engine" });
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
    const existing = this.transfers.get(m.transferId);
    if (existing !== undefined) {
      this.on(existing, "PUSH_REG", { peer, pushReg: m, receivedUs });
      return;
    }
    const no = refuseNewEntry(m, {
      givenUp: this.givenUp.has(m.transferId),
      draining: this.draining,
    });
    if (no !== undefined) return this.refuse(peer, m.transferId, no);
    const reg = newRegistration(peer, m, ctx.clock.now(), ctx.settings);
    const full = this.admit(reg);
    if (full !== undefined) return this.refuse(peer, m.transferId, full);
    const t = newPrefillTransfer(m.transferId);
    t.pending.set(peer, reg);
    this.awaiting.add(t);
    t.peer = peer.engineId;
    t.mode = "push";
    t.t.registeredMs = ctx.clock.now();
    t.trace.mark("peer.pushReg", receivedUs);
    this.track(t, "AWAITING_PREFILL", "PushReg before PrefillDone");
    this.rearm(t);
  }

  /** CHECK_REG: D's PushReg for a live transfer, checked; REG_OK if it may stand. */
  private checkReg(
    t: PrefillTransfer,
    peer: PeerState,
    m: PushReg,
    receivedUs: number | undefined,
  ): void {
    const no = checkRegistration(t, peer, m, this.draining);
    if (no === "again") return; // the same engine's registration again: idempotent
    if (no !== undefined) return this.refuse(peer, t.id, no);
    // Before PrefillDone the id is not named yet: the short lease.
    const unconfirmed = t.blocks === undefined ? this.ctx.settings : undefined;
    const reg = newRegistration(peer, m, this.ctx.clock.now(), unconfirmed);
    this.on(t, "REG_OK", { peer, reg, receivedUs });
  }

  private rearm(t: PrefillTransfer): void {
    rearm(t, this.ctx.clock.now(), this.ctx.settings.leaseMs);
  }

  /** START_WRITES: the writes (prefill-writes.ts), then the event their end makes. */
  private write(t: PrefillTransfer): void {
    const plan = planPush(this.ctx, t);
    if (plan instanceof KvxferError) {
      this.on(t, "PLAN_FAILED", { error: plan, reason: plan.code });
      return;
    }
    void postWrites(this.ctx, t, plan).then((r) =>
      r.event === "WRITES_DONE"
        ? this.on(t, r.event, { bytes: r.bytes })
        : this.on(t, r.event, { error: r.error, reason: r.error.code }),
    );
  }

  /** D read P's blocks (pull): they were held throughout, or D must not use what it read. */
  readDone(peer: PeerState, transferId: string, bytes: number, token: string, n?: Arrival): void {
    const t = this.transfers.get(transferId);
    if (t === undefined) {
      // The router may have told D about the blocks before P's sidecar processed the
      // engine's PrefillDone: then P has no record at all, and D asks again.
      this.ctx.peers.send(peer, {
        case: "readAck",
        value: { transferId, held: false, unknown: true },
      });
      return;
    }
    this.on(t, "READ_DONE", { peer, read: { bytes, token, arrival: n } });
  }

  peerAbort(peer: PeerState, transferId: string, token: string): void {
    const t = this.transfers.get(transferId);
    if (t === undefined) {
      this.ctx.peers.send(peer, { case: "abortAck", value: { transferId } });
      return;
    }
    // Before PrefillDone: the registrant withdraws its own registration, nothing more; it
    // counts at PrefillDone if its token is the transfer's. Nothing was written for it.
    const r = pendingOf(t, peer);
    if (r !== undefined) {
      this.on(t, "REG_ABORTED", { peer, withdrawn: r, reason: "aborted by decode" });
      return;
    }
    if (!mayActOn(t, peer, token)) {
      this.on(t, "D_ABORT_FORGED", { peer });
      return;
    }
    t.abortFrom = peer;
    this.on(t, "D_ABORT", { peer });
  }

  /** D says the transfer failed on its side; returns false when P has no such live transfer. */
  peerFailed(peer: PeerState, transferId: string, code: string, token: string): boolean {
    const t = this.transfers.get(transferId);
    if (t === undefined) return false;
    const r = pendingOf(t, peer);
    if (r !== undefined) return this.on(t, "REG_FAILED", { peer, withdrawn: r, reason: code });
    const event = mayActOn(t, peer, token) ? "D_FAILED" : "D_FAILED_FORGED";
    return this.on(t, event, { peer, reason: code });
  }

  /**
   * The sidecar starts stopping: every transfer still waiting for PrefillDone (which will be
   * refused) fails now, and each decode engine registered for it is told at once, so it frees
   * its blocks instead of waiting out our registration lease.
   */
  drain(): void {
    this.draining = true;
    for (const t of this.transfers.values()) this.on(t, "STOPPING");
  }

  /**
   * The drain's deadline passed: what is not moving fails now, its decode engine told (a pull's
   * reader hears "not held" when it asks). Writes in flight settle or are abandoned at close.
   */
  abandon(): void {
    this.drain();
    // HELD: held for a pull (a registration is written at once): D hears "not held".
    for (const t of this.transfers.values()) this.on(t, "ABANDON");
  }

  /** The registered KV broke (a file shrank): what P holds for a pull fails, D's read unconfirmed. */
  failHeld(code: string): void {
    for (const t of this.transfers.values()) this.on(t, "KV_BROKEN", { reason: code });
  }

  /** D's heartbeat renews the leases of the transfers it names. */
  renewLeases(peer: PeerState, ids: readonly string[]): void {
    const now = this.ctx.clock.now();
    for (const id of ids) {
      const t = this.transfers.get(id);
      if (t === undefined) continue;
      // Before PrefillDone only its own registration; after, only the registered engine's.
      const entitled =
        t.blocks === undefined
          ? pendingOf(t, peer) !== undefined
          : t.reg === undefined || t.reg.peer === peer;
      if (entitled) this.on(t, "HEARTBEAT", { peer, now });
    }
  }

  /** The decode engine `peer` is gone: what it registered for fails (writes in flight abort). */
  peerDown(peer: PeerState): void {
    for (const t of this.transfers.values()) {
      const r = pendingOf(t, peer);
      if (r !== undefined) {
        // Before PrefillDone its registration is withdrawn; the transfer is not its to end.
        this.on(t, "REG_PEER_DOWN", { peer, withdrawn: r, reason: "ERR_PEER_DOWN" });
        continue;
      }
      // After PrefillDone a registration is written at once: WRITING, or ABORTING already.
      if (t.reg?.peer === peer) this.on(t, "D_DOWN", { reason: "decode peer down" });
    }
  }

  /** Writes to `peer` still in flight. */
  writingTo(peer: PeerState): boolean {
    for (const t of this.transfers.values())
      if (t.reg?.peer === peer && PREFILL_WRITING.has(t.state)) return true;
    return false;
  }

  /** Live transfers registered by `peer`. */
  liveWith(peer: PeerState): boolean {
    for (const t of this.transfers.values())
      if (!isTerminal(t.state) && (t.reg?.peer === peer || pendingOf(t, peer) !== undefined))
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
        for (const r of t.pending.values()) if (r.withdrawn === undefined) out.add(r.peer);
    }
    return out;
  }

  /** Ends what ran out of time and forgets old tombstones. */
  expire(now: number): void {
    for (const [id, until] of this.givenUp) if (now >= until) this.givenUp.delete(id);
    // WRITING and ABORTING end when their writes settle; each write is bounded by the endpoint.
    for (const t of this.transfers.values()) if (now >= t.deadline) this.on(t, "DEADLINE", { now });
  }

  /**
   * EXPIRE_REGS: registrations nobody's prefill finished in time: each is over, the transfer is
   * not (its token is unknown yet). With none left, the entry goes once its withdrawals are no
   * longer worth remembering: P's engine never gave blocks for it, so no event.
   */
  private expireRegs(t: PrefillTransfer, now: number): void {
    const live = [...t.pending.values()].filter((r) => r.withdrawn === undefined);
    for (const r of live) {
      if (now < r.deadline) continue;
      // A decode engine heard from lately is told; one silent for two heartbeats is gone (or
      // cut off): nothing is sent to it (the peer table drops it; it registers again if it
      // comes back). Sends to a dead peer never complete (measured over shared memory:
      // thousands of them kept P's progress thread at 50-90% of a core for 30 s and more).
      if (now - r.peer.lastSeenMs < 2 * (this.ctx.settings.heartbeatMs ?? 1000))
        this.failTo(
          r.peer,
          t.id,
          "ERR_TIMEOUT",
          "no prefill before the registration lease ran out",
        );
      this.on(t, "REG_EXPIRED", { withdrawn: r, reason: "registration lease expired" });
    }
    if (live.length === 0) {
      this.confirmOrEnd(t);
      this.forget(t);
    } else this.rearm(t); // renewals moved deadlines later (RENEW_PENDING)
  }

  /** Transfers whose blocks P holds under a lease (HELD, or AWAITING_PREFILL). */
  leased(): number {
    let n = 0;
    for (const t of this.transfers.values()) if (PREFILL_LEASED.has(t.state)) n++;
    return n;
  }
}
