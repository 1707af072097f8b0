/**
 * D's side as one table: for each state and event, the next state and the effects. Pure data
 * and one pure function (`decodeStep`); `DecodeSide` (decode.ts) is the interpreter that feeds
 * it events and runs the effects it names against the engine, the peer and the clock.
 *
 * The sub-states that used to hide in flags are states here: a push registered with P
 * (PUSH_REGISTERED) and reads in flight (READING) were both "MOVING"; a drain that waits for P's
 * AbortAck or its registration lease (PUSH_DRAINING) and one that waits for its own reads
 * (READS_DRAINING) were both "DRAINING". "Can a write still land?" is the state: it can in
 * PUSH_REGISTERED, READING and both drains, and nowhere else. What the outside sees (status,
 * ListTransfers) is the coarser `DECODE_PHASE` of each state.
 *
 * A pair missing from the table is an event the state ignores. docs/protocol.md's diagram of
 * D is generated from this table (scripts/state-diagrams.mjs; a test fails when they differ).
 */
import { nextStates, OUTCOME } from "./lifecycle.js";
import type { TerminalKind, TransferState } from "./view.js";

export const DECODE_STATES = [
  "WAITING",
  "PUSH_REGISTERED",
  "READING",
  "CONFIRMING",
  "PUSH_DRAINING",
  "READS_DRAINING",
  "KV_READY",
  "FAILED",
  "EXPIRED",
  "ABORTED",
] as const;

/**
 * - WAITING: ExpectKv received; P's metadata being fetched (handshake), then the plan made;
 * - PUSH_REGISTERED: the push registration went to P; waiting for every pair's XferDone;
 * - READING: pull reads from P's blocks in flight;
 * - CONFIRMING: the reads are done; waiting for P's ReadAck (were the blocks held throughout?);
 * - PUSH_DRAINING: the engine heard KvFailed; P may still write until its AbortAck (sent once
 *   its writes settled in UCX, through any handshake with the same P process), its Failed, a
 *   handshake finding P at a new epoch, or its registration lease (renewed by our heartbeats),
 *   a grace and the settle bound have run out;
 * - READS_DRAINING: the engine heard KvFailed; our own reads are still in flight (abandoned ones
 *   until their endpoint has settled in UCX, at most the settle bound);
 * - KV_READY: the engine has the KV; FAILED, EXPIRED, ABORTED: blocks back without it.
 */
export type DecodeState = (typeof DECODE_STATES)[number];

export const DECODE_EVENTS = [
  // The handshake with P is over (one event per mode: a late one matters only to a pull).
  "PEER_FOUND_PUSH",
  "PEER_FOUND_PULL",
  "HANDSHAKE_FAILED",
  // What CONNECT_PUSH / CONNECT_PULL find.
  "REGION_CHANGED",
  "PUSH_READY",
  "PLANNED",
  "PLAN_FAILED",
  // Push: P's agents.
  "XFER_DONE",
  "ALL_PAIRS_DONE",
  // Pull: our reads, then P's answer.
  "READS_DONE",
  "READS_FAILED",
  "READ_ACK_HELD",
  "READ_ACK_RELEASED",
  "READ_ACK_UNKNOWN",
  "UNKNOWN_TOO_LONG",
  "ASK_AGAIN",
  // P's control messages and P going away.
  "ABORT_ACK",
  "P_FAILED",
  "P_DOWN",
  // The engine, the sidecar, the clock.
  "ENGINE_ABORT",
  "STOPPING",
  "HEARTBEAT",
  "DEADLINE",
] as const;

export type DecodeEvent = (typeof DECODE_EVENTS)[number];

/**
 * What the interpreter does for a row, in the row's order:
 * - CONNECT_PUSH / CONNECT_PULL: check the KV region, take the peer and its rank pairs, (pull)
 *   plan the reads; feeds REGION_CHANGED, PUSH_READY, PLANNED or PLAN_FAILED;
 * - LATE_ABORT: the handshake ended after the transfer did: tell P it may let go (pull);
 * - SEND_PUSH_REG: the registration to P; START_READS: post the reads (feeds READS_DONE or
 *   READS_FAILED when they settle);
 * - COUNT_PAIR: count one pair's XferDone (feeds ALL_PAIRS_DONE after the last);
 *   DATA_DONE: the KV is all there (counted as moved);
 * - TRACE_ACK: P's ReadAck in the trace; ASK_HELD: ReadDone to P (is the KV still held?);
 *   RETRY_OR_GIVE_UP: P does not know the transfer yet: ASK_AGAIN shortly, or UNKNOWN_TOO_LONG;
 * - KV_FAILED: the engine hears KvFailed now; how it ends is recorded (the event's outcome);
 * - TELL_P_FAILED: Failed to P (our reads failed); TELL_P_ABORT: Abort to P;
 * - RENEW: D's heartbeat renews P's hold (push: the renewal is stamped);
 * - FORGET: an old tombstone leaves the table.
 */
export type DecodeEffect =
  | "CONNECT_PUSH"
  | "CONNECT_PULL"
  | "LATE_ABORT"
  | "SEND_PUSH_REG"
  | "START_READS"
  | "COUNT_PAIR"
  | "DATA_DONE"
  | "TRACE_ACK"
  | "ASK_HELD"
  | "RETRY_OR_GIVE_UP"
  | "KV_FAILED"
  | "TELL_P_FAILED"
  | "TELL_P_ABORT"
  | "RENEW"
  | "RENEW_PUSH"
  | "FORGET";

/**
 * One row: `effects` run first, then the move to `to` (if any; OUTCOME: the recorded outcome),
 * then `then` (what must follow the move: a message whose answer finds the new state).
 */
export interface DecodeRow {
  readonly to?: DecodeState | typeof OUTCOME;
  readonly effects?: readonly DecodeEffect[];
  readonly then?: readonly DecodeEffect[];
}

/** How each failing event ends a transfer (KV_FAILED records it for a drain's end). */
export const DECODE_FAILS_AS: Readonly<Partial<Record<DecodeEvent, DecodeState & TerminalKind>>> = {
  HANDSHAKE_FAILED: "FAILED",
  REGION_CHANGED: "FAILED",
  PLAN_FAILED: "FAILED",
  READS_FAILED: "FAILED",
  READ_ACK_RELEASED: "FAILED",
  UNKNOWN_TOO_LONG: "FAILED",
  P_FAILED: "FAILED",
  P_DOWN: "FAILED",
  ENGINE_ABORT: "ABORTED",
  STOPPING: "ABORTED",
  DEADLINE: "EXPIRED",
};

const FAIL: readonly DecodeEffect[] = ["KV_FAILED"];
const FAIL_ABORT: readonly DecodeEffect[] = ["KV_FAILED", "TELL_P_ABORT"];
/** A push's drain starts: the engine hears KvFailed, then P is told to stop. */
const PUSH_DRAIN: DecodeRow = { to: "PUSH_DRAINING", effects: FAIL, then: ["TELL_P_ABORT"] };
/** A terminal state: only a late handshake (pull), heartbeats' absence and the tombstone's end. */
const TOMBSTONE: Partial<Record<DecodeEvent, DecodeRow>> = {
  PEER_FOUND_PULL: { effects: ["LATE_ABORT"] },
  DEADLINE: { effects: ["FORGET"] },
};

export const DECODE_TABLE: Readonly<
  Record<DecodeState, Readonly<Partial<Record<DecodeEvent, DecodeRow>>>>
> = {
  WAITING: {
    PEER_FOUND_PUSH: { effects: ["CONNECT_PUSH"] },
    PEER_FOUND_PULL: { effects: ["CONNECT_PULL"] },
    // Nothing reached P yet: the blocks are safe at once.
    HANDSHAKE_FAILED: { to: "FAILED", effects: FAIL },
    REGION_CHANGED: { to: "FAILED", effects: FAIL },
    // The peer is known by then: a pull tells it to let go.
    PLAN_FAILED: { to: "FAILED", effects: FAIL_ABORT },
    PUSH_READY: { to: "PUSH_REGISTERED", then: ["SEND_PUSH_REG"] },
    PLANNED: { to: "READING", then: ["START_READS"] },
    ENGINE_ABORT: { to: "ABORTED", effects: FAIL },
    STOPPING: { to: "ABORTED", effects: FAIL },
    DEADLINE: { to: "EXPIRED", effects: FAIL },
  },
  PUSH_REGISTERED: {
    XFER_DONE: { effects: ["COUNT_PAIR"] },
    ALL_PAIRS_DONE: { to: "KV_READY", effects: ["DATA_DONE"] },
    // P sends Failed only once its writes are over.
    P_FAILED: { to: "FAILED", effects: FAIL },
    // A peer we merely stopped hearing may still have writes in flight.
    P_DOWN: PUSH_DRAIN,
    ENGINE_ABORT: PUSH_DRAIN,
    STOPPING: PUSH_DRAIN,
    DEADLINE: PUSH_DRAIN,
    HEARTBEAT: { effects: ["RENEW_PUSH"] },
  },
  READING: {
    READS_DONE: { to: "CONFIRMING", then: ["ASK_HELD"] },
    READS_FAILED: { to: "FAILED", effects: ["TELL_P_FAILED", ...FAIL_ABORT] },
    P_FAILED: { to: "READS_DRAINING", effects: FAIL },
    P_DOWN: { to: "READS_DRAINING", effects: FAIL },
    ENGINE_ABORT: { to: "READS_DRAINING", effects: FAIL_ABORT },
    STOPPING: { to: "READS_DRAINING", effects: FAIL_ABORT },
    DEADLINE: { to: "READS_DRAINING", effects: FAIL_ABORT },
    HEARTBEAT: { effects: ["RENEW"] },
  },
  CONFIRMING: {
    READ_ACK_HELD: { to: "KV_READY", effects: ["TRACE_ACK"] },
    READ_ACK_RELEASED: { to: "FAILED", effects: ["TRACE_ACK", ...FAIL] },
    READ_ACK_UNKNOWN: { effects: ["TRACE_ACK", "RETRY_OR_GIVE_UP"] },
    UNKNOWN_TOO_LONG: { to: "FAILED", effects: FAIL },
    ASK_AGAIN: { effects: ["ASK_HELD"] },
    // The reads are over: nothing can land.
    P_FAILED: { to: "FAILED", effects: FAIL },
    P_DOWN: { to: "FAILED", effects: FAIL },
    ENGINE_ABORT: { to: "ABORTED", effects: FAIL_ABORT },
    STOPPING: { to: "ABORTED", effects: FAIL_ABORT },
    DEADLINE: { to: "EXPIRED", effects: FAIL_ABORT },
    HEARTBEAT: { effects: ["RENEW"] },
  },
  PUSH_DRAINING: {
    ABORT_ACK: { to: OUTCOME },
    // P failed after our abort: its writes are over.
    P_FAILED: { to: OUTCOME },
    // P's registration lease has surely run out.
    DEADLINE: { to: OUTCOME },
  },
  READS_DRAINING: {
    READS_DONE: { to: OUTCOME },
    READS_FAILED: { to: OUTCOME },
    // Taken (P knew the transfer) but nothing changes: the reads settle by themselves.
    P_FAILED: {},
  },
  KV_READY: TOMBSTONE,
  FAILED: TOMBSTONE,
  EXPIRED: TOMBSTONE,
  ABORTED: TOMBSTONE,
};

/** D's answer to `event` in `state`: the row, or undefined (the state ignores the event). */
export function decodeStep(state: DecodeState, event: DecodeEvent): DecodeRow | undefined {
  return DECODE_TABLE[state][event];
}

/** What the outside sees of each state (status, ListTransfers, gRPC). */
export const DECODE_PHASE: Readonly<Record<DecodeState, TransferState>> = {
  WAITING: "WAITING",
  PUSH_REGISTERED: "MOVING",
  READING: "MOVING",
  CONFIRMING: "CONFIRMING",
  PUSH_DRAINING: "DRAINING",
  READS_DRAINING: "DRAINING",
  KV_READY: "KV_READY",
  FAILED: "FAILED",
  EXPIRED: "EXPIRED",
  ABORTED: "ABORTED",
};

/** Reads of ours may still be in flight (a peer is not forgotten while they are). */
export const DECODE_READING: ReadonlySet<DecodeState> = new Set(["READING", "READS_DRAINING"]);

/**
 * States whose deadline is the watchdog's, set when the transfer starts waiting and kept until
 * it drains or ends (decode.ts `enter`): the ones the watchdog's link allowance applies to.
 */
export const DECODE_WATCHED: ReadonlySet<DecodeState> = new Set([
  "WAITING",
  "PUSH_REGISTERED",
  "READING",
  "CONFIRMING",
]);
export const DECODE_INITIAL: readonly DecodeState[] = ["WAITING"];

/** The moves the table can make from each state (for lifecycle.ts's check and the diagrams). */
export const DECODE_NEXT: Readonly<Record<DecodeState, readonly DecodeState[]>> = nextStates(
  DECODE_STATES,
  DECODE_TABLE,
  DECODE_FAILS_AS,
);
