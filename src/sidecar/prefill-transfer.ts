/**
 * P's side of one transfer as data: the entry, D's registrations kept before PrefillDone, and
 * the pure rules on them (whose registration counts, who may end the transfer, when a waiting
 * entry is due). PrefillSide (prefill.ts) runs P's machine over these entries.
 */
import { ReleaseReason, type PrefillDone } from "../gen/kvxfer/v1/engine_pb.js";
import type { PushReg } from "../gen/kvxfer/v1/peer_pb.js";
import type { KvxferError } from "../errors.js";
import type { BlockList } from "../plan/index.js";
import type { Notification } from "../native/index.js";
import { tokensEqual } from "../peer/messages.js";
import type { SideContext } from "./context.js";
import { sameProcess, type PeerState } from "../peer/peer-state.js";
import { PREFILL_PHASE, type PrefillState } from "./prefill-machine.js";
import { newTimings, type Timings } from "./timings.js";
import { TransferTrace } from "./trace.js";
import type { TerminalKind, TransferInfo } from "./view.js";

/** D's push registration: where P writes, under D's lease. */
export interface PushRegistration {
  readonly transferId: string;
  peer: PeerState;
  token: string;
  /** D's block lists, one per group. */
  dstLists: BlockList[];
  numTokens: number;
  prefixTokens: number;
  /** Its lease now: short before PrefillDone (an id P's engine has not named), D's after. */
  leaseMs: number;
  /** The lease D asked for (clamped): it holds once P's engine names the id. */
  requestedLeaseMs: number;
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
  /** Every block PrefillDone named (all groups), once it arrived: what P's engine holds for it. */
  blocks: number[] | undefined;
  /** The same blocks as PrefillDone's lists, one per group. */
  lists: BlockList[] | undefined;
  /**
   * Layer-wise push (PrefillDone.layer_wise): the layers saved so far; undefined when every
   * layer was saved by PrefillDone (the engine's usual PrefillDone, after its forward).
   */
  layers: LayerProgress | undefined;
  numTokens: number;
  /** The registration P writes for: chosen at PrefillDone by the token, or one after it. */
  reg: PushRegistration | undefined;
  /** Where the AbortAck goes once the writes settle: the handshake D's Abort came through. */
  abortFrom?: PeerState;
  /**
   * Before PrefillDone, every registration (one per decode engine, in the order they came),
   * withdrawn ones included: the token picks one at PrefillDone. Not capped per transfer: each
   * counts in P's pool of registrations no engine has named (PrefillSide), so insiders who
   * register first for a known id take no place the real decode engine needs.
   */
  pending: Map<PeerState, PushRegistration>;
  /** PrefillDone.token: only a D presenting it may register, confirm, abort or fail the transfer. */
  token: string;
  /** Lease of held blocks (HELD), of a registration waiting for prefill (AWAITING_PREFILL), or the tombstone's end. */
  deadline: number;
  /** No write for the registration may start after this (renewed by D's heartbeats). */
  regDeadline: number;
  /** Who the blocks went to (peer engine id), once known. */
  peer: string;
  mode: "push" | "pull" | "";
  /** How the transfer ends when the withdrawn registration its token names counts (REG_WITHDRAWN). */
  outcome: { kind: PrefillState & TerminalKind; reason: string } | undefined;
  bytes: number;
  descriptors: number;
  reason: string;
  t: Timings;
  trace: TransferTrace;
}

/**
 * A layer-wise transfer's progress: layers `0 .. saved - 1` of the registered layout hold their
 * final KV (LayersSaved), of `total`; `waiters` are the writes waiting for more (woken by each
 * LayersSaved and when the transfer stops writing).
 */
export interface LayerProgress {
  saved: number;
  readonly total: number;
  waiters: (() => void)[];
}

/** Whether some layer of `t`'s KV is still being computed (a read must not count yet). */
export function layersPending(t: PrefillTransfer): boolean {
  return t.layers !== undefined && t.layers.saved < t.layers.total;
}

/** Wakes every write waiting for `t`'s layers (more saved, or it stopped writing). */
export function wakeLayers(t: PrefillTransfer): void {
  const l = t.layers;
  if (l === undefined || l.waiters.length === 0) return;
  const waiting = l.waiters;
  l.waiters = [];
  for (const w of waiting) w();
}

/** What comes with an event, for the effects that need it. */
export interface EventData {
  /** The peer the message came from. */
  peer?: PeerState;
  /** Why the transfer ends (the event's reason; a row may name its own). */
  reason?: string;
  /** PREFILL_DONE: the engine's message and when it arrived. */
  prefill?: PrefillDone;
  receivedUs?: number | undefined;
  /** PUSH_REG / REG_OK: D's message and the registration made of it. */
  pushReg?: PushReg;
  reg?: PushRegistration | undefined;
  /** ACCEPT_PREFILL: the KV file shrank (why). */
  shrunk?: string | undefined;
  /** READ_DONE: D's message. */
  read?: { bytes: number; token: string; arrival: Arrival | undefined };
  /** WRITES_FAILED / PLAN_FAILED: the error D hears. */
  error?: KvxferError;
  /** WRITES_DONE: the bytes moved. */
  bytes?: number;
  /** REG_*: the registration withdrawn. */
  withdrawn?: PushRegistration;
  now?: number;
}

/** Timestamps of the notification that carried a peer message (trace). */
export type Arrival = Pick<Notification, "receivedUs" | "deliveredUs">;

/** Registrations one decode engine may keep before PrefillDone: this share of maxTransfers. */
export const PER_PEER_SHARE = 8;

/** A new entry: nothing known yet. */
export function newPrefillTransfer(id: string): PrefillTransfer {
  return {
    id,
    state: "AWAITING_PREFILL",
    blocks: undefined,
    lists: undefined,
    layers: undefined,
    numTokens: 0,
    reg: undefined,
    pending: new Map(),
    token: "",
    deadline: 0,
    regDeadline: 0,
    peer: "",
    mode: "",
    outcome: undefined,
    bytes: 0,
    descriptors: 0,
    reason: "",
    t: newTimings(),
    trace: new TransferTrace(),
  };
}

/**
 * A WAITING entry's deadline: its first live registration's, or (all withdrawn) the time its
 * withdrawals are remembered for a late PrefillDone. One pass over its registrations: made when
 * one is withdrawn or at its deadline, not at each renewal (a renewal only moves a registration's
 * deadline later, so an entry's deadline may come early: EXPIRE_REGS then finds none due and
 * makes it again).
 */
export function rearm(t: PrefillTransfer, now: number, leaseMs: number): void {
  let next = Infinity;
  let first: PushRegistration | undefined;
  for (const r of t.pending.values()) {
    if (r.withdrawn !== undefined) continue;
    first ??= r;
    next = Math.min(next, r.deadline);
  }
  t.deadline = next === Infinity ? now + leaseMs : next;
  first ??= t.pending.values().next().value;
  t.peer = first?.peer.engineId ?? "";
}

/** `peer`'s live registration kept before PrefillDone, if any (O(1)). */
export function pendingOf(t: PrefillTransfer, peer: PeerState): PushRegistration | undefined {
  if (t.blocks !== undefined) return undefined;
  const r = t.pending.get(peer);
  return r?.withdrawn === undefined ? r : undefined;
}

/**
 * True when `peer` may end `t`: prefill is done (the token is known), it presents the token,
 * and it is the registered decode engine if one registered. Before PrefillDone nobody may.
 */
export function mayActOn(t: PrefillTransfer, peer: PeerState, token: string): boolean {
  if (t.blocks === undefined || !tokensEqual(t.token, token)) return false;
  return t.reg === undefined || sameProcess(t.reg.peer, peer);
}

/**
 * At PrefillDone: picks the registration whose token matches the transfer's (the first one
 * when the transfer has no token), refuses the others still live, and returns the one picked
 * (withdrawn or not).
 */
export function settleRegistrations(
  ctx: SideContext,
  t: PrefillTransfer,
): PushRegistration | undefined {
  const all = [...t.pending.values()];
  t.pending = new Map();
  // A live registration with the token first (the same D again after a restart, say), else a
  // withdrawn one: then the transfer ends as its D asked.
  const matches = all.filter((r) => tokensEqual(r.token, t.token));
  const chosen = matches.find((r) => r.withdrawn === undefined) ?? matches[0];
  for (const r of all) {
    if (r === chosen || r.withdrawn !== undefined) continue;
    const code =
      t.token === "" && chosen !== undefined ? "ERR_DUPLICATE" : "ERR_BAD_TRANSFER_TOKEN";
    ctx.errors.note(`PushReg for '${t.id}' from '${r.peer.engineId}' refused: ${code}`);
    ctx.peers.send(r.peer, {
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
  // P's engine named the id: D's next renewal extends it by the lease D asked for. Not its
  // deadline now: D counts P's lease from its own last renewal, and P never writes past that.
  chosen.leaseMs = chosen.requestedLeaseMs;
  t.reg = chosen;
  t.peer = chosen.peer.engineId;
  t.mode = "push";
  t.regDeadline = chosen.deadline;
  return chosen;
}

/** Why a terminal state hands P's blocks back. */
export function releaseReason(kind: TerminalKind): ReleaseReason {
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

/** How the status view shows one of P's transfers. */
export function prefillInfo(t: PrefillTransfer): TransferInfo {
  return {
    transferId: t.id,
    side: "prefill",
    mode: t.mode,
    state: PREFILL_PHASE[t.state],
    peer: t.peer,
    bytes: t.bytes,
    descriptors: t.descriptors,
    reason: t.reason,
    timings: { ...t.t },
    trace: t.trace.hops,
  };
}
