/**
 * P's side as one table: for each state and event, the next state and the effects. Pure data
 * and one pure function (`prefillStep`); `PrefillSide` (prefill.ts) is the interpreter that
 * feeds it events and runs the effects it names against the engine, the peer and the clock.
 *
 * The sub-states that used to hide in flags are states here: before the engine's PrefillDone
 * (AWAITING_PREFILL, once `blocks === undefined`), and an abort that owes D its AbortAck
 * (ABORTING_FOR_D, once `abortAckOwed`). What the outside sees is `PREFILL_PHASE` of each state.
 *
 * A pair missing from the table is an event the state ignores. docs/protocol.md's diagram of
 * P is generated from this table (scripts/state-diagrams.mjs; a test fails when they differ).
 */
import { nextStates, OUTCOME } from "./lifecycle.js";
import type { TerminalKind, TransferState } from "./view.js";

export const PREFILL_STATES = [
  "AWAITING_PREFILL",
  "HELD",
  "WRITING",
  "ABORTING",
  "ABORTING_FOR_D",
  "RELEASED",
  "FAILED",
  "EXPIRED",
  "ABORTED",
] as const;

/**
 * - AWAITING_PREFILL: D registered its blocks (push) before the engine's PrefillDone; each
 *   registration is kept aside until the token picks one;
 * - HELD: prefill done, blocks held under lease (for a registration, or for D's READ);
 * - WRITING: P's agents write into D's blocks;
 * - ABORTING: aborted (the engine, or D gone) while writes were in flight: ends once they settle;
 * - ABORTING_FOR_D: the same, aborted by D, which hears AbortAck once they settle;
 * - RELEASED: the KV went to D; FAILED, EXPIRED, ABORTED: blocks back without it.
 */
export type PrefillState = (typeof PREFILL_STATES)[number];

export const PREFILL_EVENTS = [
  // The engine.
  "PREFILL_DONE",
  "ENGINE_ABORT",
  // What ACCEPT_PREFILL finds: the KV broken, the token's registration withdrawn, none, one.
  "REGION_BROKEN",
  "REG_WITHDRAWN",
  "NO_REG",
  "REG_CHOSEN",
  // D's PushReg (CHECK_REG passed it: REG_OK).
  "PUSH_REG",
  "REG_OK",
  // The writes.
  "PLAN_FAILED",
  "WRITES_DONE",
  "WRITES_FAILED",
  // D's ReadDone (CHECK_READ_TOKEN passed it: READ_OK, or READ_EARLY while a layer-wise
  // transfer's layers are still being computed).
  "READ_DONE",
  "READ_OK",
  "READ_EARLY",
  // D withdraws its own registration kept aside before PrefillDone.
  "REG_ABORTED",
  "REG_FAILED",
  "REG_EXPIRED",
  "REG_PEER_DOWN",
  // D's Abort and Failed, with or without the transfer's token (and as the registered engine).
  "D_ABORT",
  "D_ABORT_FORGED",
  "D_FAILED",
  "D_FAILED_FORGED",
  "D_DOWN",
  // The sidecar, the KV, the clock.
  "STOPPING",
  "ABANDON",
  "KV_BROKEN",
  "HEARTBEAT",
  "DEADLINE",
] as const;

export type PrefillEvent = (typeof PREFILL_EVENTS)[number];

/**
 * What the interpreter does for a row, in the row's order:
 * - ACCEPT_PREFILL: the blocks, token and timings taken, the registrations settled (feeds
 *   REGION_BROKEN, REG_WITHDRAWN, NO_REG or REG_CHOSEN); LATE_PREFILL: blocks of a transfer that
 *   ended before prefill go straight back (a second PrefillDone is refused ERR_DUPLICATE);
 *   REFUSE_DUPLICATE: PrefillDone again;
 * - TELL_REG_REGION: the chosen registration hears ERR_REGION_CHANGED;
 * - TELL_PENDING_ABORTED / TELL_PENDING_DRAINING: every registration kept aside hears Failed;
 * - CHECK_REG: D's PushReg checked (feeds REG_OK); REFUSE_ENDED: PushReg after the end;
 *   KEEP_ASIDE: kept until PrefillDone; TAKE_REG: the registration written to; REFUSE_REG_TAKEN;
 * - START_WRITES: plan and post (feeds PLAN_FAILED, WRITES_DONE or WRITES_FAILED);
 *   TELL_D_FAILED: Failed to D; ACK_ABORT: AbortAck to D; MOVED: the bytes counted;
 * - TRACE_READ_DONE, CHECK_READ_TOKEN (feeds READ_OK); ACK_HELD (ReadAck held, the read
 *   counted) / ACK_NOT_HELD;
 * - WITHDRAW: D's registration kept aside is withdrawn (the event says how);
 *   REFUSE_ABORT / REFUSE_FAILED: no token, or not the registered engine;
 * - RENEW_REG: the registration's lease; RENEW_HOLD: the held blocks' lease; RENEW_PENDING:
 *   a registration kept aside; EXPIRE_REGS: registrations kept aside whose lease ran out;
 * - FORGET: an old tombstone leaves the table.
 */
export type PrefillEffect =
  | "ACCEPT_PREFILL"
  | "LATE_PREFILL"
  | "REFUSE_DUPLICATE"
  | "TELL_REG_REGION"
  | "TELL_PENDING_ABORTED"
  | "TELL_PENDING_DRAINING"
  | "CHECK_REG"
  | "REFUSE_ENDED"
  | "KEEP_ASIDE"
  | "TAKE_REG"
  | "REFUSE_REG_TAKEN"
  | "START_WRITES"
  | "TELL_D_FAILED"
  | "ACK_ABORT"
  | "MOVED"
  | "TRACE_READ_DONE"
  | "CHECK_READ_TOKEN"
  | "ACK_HELD"
  | "ACK_NOT_HELD"
  | "WITHDRAW"
  | "REFUSE_ABORT"
  | "REFUSE_FAILED"
  | "RENEW_REG"
  | "RENEW_HOLD"
  | "RENEW_PENDING"
  | "EXPIRE_REGS"
  | "FORGET";

/**
 * One row: `effects` run first, then the move to `to` (if any; OUTCOME: the recorded outcome)
 * with `reason` (else the event's), then `then` (what must follow the move).
 */
export interface PrefillRow {
  readonly to?: PrefillState | typeof OUTCOME;
  readonly reason?: string;
  readonly effects?: readonly PrefillEffect[];
  readonly then?: readonly PrefillEffect[];
}

/** How a registration's withdrawal ends the transfer, if its token turns out to be the one. */
export const PREFILL_FAILS_AS: Readonly<
  Partial<Record<PrefillEvent, PrefillState & TerminalKind>>
> = {
  REG_ABORTED: "ABORTED",
  REG_FAILED: "FAILED",
  REG_EXPIRED: "EXPIRED",
  REG_PEER_DOWN: "FAILED",
};

/** Writes in flight: the writes settle, or D's Abort / the engine's changes how they end. */
const WRITES: Partial<Record<PrefillEvent, PrefillRow>> = {
  PUSH_REG: { effects: ["CHECK_REG"] },
  REG_OK: { effects: ["REFUSE_REG_TAKEN"] },
  PREFILL_DONE: { effects: ["REFUSE_DUPLICATE"] },
  READ_DONE: { effects: ["TRACE_READ_DONE", "CHECK_READ_TOKEN"] },
  READ_OK: { effects: ["ACK_NOT_HELD"] },
  READ_EARLY: { effects: ["ACK_NOT_HELD"] },
  HEARTBEAT: { effects: ["RENEW_REG"] },
};

const TOMBSTONE: Partial<Record<PrefillEvent, PrefillRow>> = {
  PREFILL_DONE: { effects: ["LATE_PREFILL"] },
  PUSH_REG: { effects: ["REFUSE_ENDED"] },
  READ_DONE: { effects: ["TRACE_READ_DONE", "CHECK_READ_TOKEN"] },
  READ_OK: { effects: ["ACK_NOT_HELD"] },
  READ_EARLY: { effects: ["ACK_NOT_HELD"] },
  REG_ABORTED: { effects: ["ACK_ABORT"] },
  D_ABORT: { effects: ["ACK_ABORT"] },
  D_ABORT_FORGED: { effects: ["ACK_ABORT"] },
  DEADLINE: { effects: ["FORGET"] },
};

export const PREFILL_TABLE: Readonly<
  Record<PrefillState, Readonly<Partial<Record<PrefillEvent, PrefillRow>>>>
> = {
  AWAITING_PREFILL: {
    PREFILL_DONE: { effects: ["ACCEPT_PREFILL"] },
    REGION_BROKEN: { to: "FAILED", reason: "ERR_REGION_CHANGED", effects: ["TELL_REG_REGION"] },
    // The registration the token names was withdrawn before prefill finished: it counts now.
    REG_WITHDRAWN: { to: OUTCOME },
    NO_REG: { to: "HELD" },
    REG_CHOSEN: { to: "WRITING", then: ["START_WRITES"] },
    ENGINE_ABORT: {
      to: "ABORTED",
      reason: "aborted by the engine",
      effects: ["TELL_PENDING_ABORTED"],
    },
    PUSH_REG: { effects: ["CHECK_REG"] },
    REG_OK: { effects: ["KEEP_ASIDE"] },
    READ_DONE: { effects: ["TRACE_READ_DONE", "CHECK_READ_TOKEN"] },
    READ_OK: { effects: ["ACK_NOT_HELD"] },
    READ_EARLY: { effects: ["ACK_NOT_HELD"] },
    // Before PrefillDone nothing a registrant says ends the transfer: its own is withdrawn.
    REG_ABORTED: { effects: ["WITHDRAW", "ACK_ABORT"] },
    REG_FAILED: { effects: ["WITHDRAW"] },
    REG_EXPIRED: { effects: ["WITHDRAW"] },
    REG_PEER_DOWN: { effects: ["WITHDRAW"] },
    D_ABORT_FORGED: { effects: ["REFUSE_ABORT"] },
    D_FAILED_FORGED: { effects: ["REFUSE_FAILED"] },
    STOPPING: { to: "FAILED", reason: "ERR_DRAINING", effects: ["TELL_PENDING_DRAINING"] },
    HEARTBEAT: { effects: ["RENEW_PENDING"] },
    DEADLINE: { effects: ["EXPIRE_REGS"] },
  },
  HELD: {
    // A new entry starts here; its KV may be broken already.
    REGION_BROKEN: { to: "FAILED", reason: "ERR_REGION_CHANGED", effects: ["TELL_REG_REGION"] },
    PREFILL_DONE: { effects: ["REFUSE_DUPLICATE"] },
    ENGINE_ABORT: {
      to: "ABORTED",
      reason: "aborted by the engine",
      effects: ["TELL_PENDING_ABORTED"],
    },
    PUSH_REG: { effects: ["CHECK_REG"] },
    REG_OK: { to: "WRITING", effects: ["TAKE_REG"], then: ["START_WRITES"] },
    READ_DONE: { effects: ["TRACE_READ_DONE", "CHECK_READ_TOKEN"] },
    // D read the blocks while they were held: the KV went to D.
    READ_OK: { to: "RELEASED", reason: "transferred", effects: ["ACK_HELD"] },
    // Layer-wise, before the last layer was saved: what D read is not the KV yet.
    READ_EARLY: { effects: ["ACK_NOT_HELD"] },
    D_ABORT: { to: "ABORTED", reason: "aborted by decode", effects: ["ACK_ABORT"] },
    D_ABORT_FORGED: { effects: ["REFUSE_ABORT"] },
    D_FAILED: { to: "FAILED" },
    D_FAILED_FORGED: { effects: ["REFUSE_FAILED"] },
    ABANDON: { to: "FAILED", reason: "ERR_DRAINING" },
    KV_BROKEN: { to: "FAILED" },
    HEARTBEAT: { effects: ["RENEW_REG", "RENEW_HOLD"] },
    DEADLINE: { to: "EXPIRED", reason: "lease expired" },
  },
  WRITING: {
    ...WRITES,
    ENGINE_ABORT: { to: "ABORTING" },
    PLAN_FAILED: { to: "FAILED", effects: ["TELL_D_FAILED"] },
    WRITES_DONE: { to: "RELEASED", reason: "transferred", effects: ["MOVED"] },
    WRITES_FAILED: { to: "FAILED", effects: ["TELL_D_FAILED"] },
    D_ABORT: { to: "ABORTING_FOR_D" },
    D_ABORT_FORGED: { effects: ["REFUSE_ABORT"] },
    D_DOWN: { to: "ABORTING" },
  },
  ABORTING: {
    ...WRITES,
    WRITES_DONE: { to: "RELEASED", reason: "transferred", effects: ["MOVED"] },
    WRITES_FAILED: { to: "ABORTED", effects: ["TELL_D_FAILED"] },
    D_ABORT: { to: "ABORTING_FOR_D" },
    D_ABORT_FORGED: { effects: ["REFUSE_ABORT"] },
  },
  ABORTING_FOR_D: {
    ...WRITES,
    WRITES_DONE: { to: "RELEASED", reason: "transferred", effects: ["ACK_ABORT", "MOVED"] },
    WRITES_FAILED: { to: "ABORTED", reason: "ERR_ABORTED", effects: ["ACK_ABORT"] },
    D_ABORT: {},
    D_ABORT_FORGED: { effects: ["REFUSE_ABORT"] },
  },
  RELEASED: TOMBSTONE,
  FAILED: TOMBSTONE,
  EXPIRED: TOMBSTONE,
  ABORTED: TOMBSTONE,
};

/** P's answer to `event` in `state`: the row, or undefined (the state ignores the event). */
export function prefillStep(state: PrefillState, event: PrefillEvent): PrefillRow | undefined {
  return PREFILL_TABLE[state][event];
}

/** What the outside sees of each state (status, ListTransfers, gRPC). */
export const PREFILL_PHASE: Readonly<Record<PrefillState, TransferState>> = {
  AWAITING_PREFILL: "WAITING",
  HELD: "HELD",
  WRITING: "MOVING",
  ABORTING: "ABORTING",
  ABORTING_FOR_D: "ABORTING",
  RELEASED: "RELEASED",
  FAILED: "FAILED",
  EXPIRED: "EXPIRED",
  ABORTED: "ABORTED",
};

/** Writes to D may be in flight (a peer is not forgotten while they are). */
export const PREFILL_WRITING: ReadonlySet<PrefillState> = new Set([
  "WRITING",
  "ABORTING",
  "ABORTING_FOR_D",
]);

/** P holds blocks (or a registration) under a lease. */
export const PREFILL_LEASED: ReadonlySet<PrefillState> = new Set(["AWAITING_PREFILL", "HELD"]);

/** Where a new transfer starts: D's PushReg came first, or the engine's PrefillDone. */
export const PREFILL_INITIAL: readonly PrefillState[] = ["AWAITING_PREFILL", "HELD"];

/** The moves the table can make from each state (for the check and the diagrams). */
export const PREFILL_NEXT: Readonly<Record<PrefillState, readonly PrefillState[]>> = nextStates(
  PREFILL_STATES,
  PREFILL_TABLE,
  PREFILL_FAILS_AS,
);
