/**
 * The lifecycle of a transfer on each side, in one place: P's and D's states, the one terminal
 * set, the table of allowed next states per state, and the one function that moves a transfer.
 *
 * Outside this module a transfer's state is read-only (`Tracked.state` is readonly; a test fails
 * on any `.state =` elsewhere). `transition` refuses a move its side's table does not allow (an
 * internal error and a log line, never a silent write), logs `from -> to`, runs the side's entry
 * effects (timing stamps, the state's deadline) and, on a terminal state, the side's one exit
 * (blocks back to the engine, the one event): invariant 3 of the design, by construction.
 *
 * docs/protocol.md draws the same machines; these tables are what runs.
 */
import type { Logger } from "pino";

import type { TerminalKind, TransferSide } from "./view.js";

/** Terminal states; each transfer reaches exactly one per side, as one event. */
export const TERMINAL_KINDS: readonly TerminalKind[] = [
  "KV_READY",
  "FAILED",
  "EXPIRED",
  "ABORTED",
  "RELEASED",
];

const TERMINAL: ReadonlySet<string> = new Set(TERMINAL_KINDS);

export function isTerminal(state: string): state is TerminalKind {
  return TERMINAL.has(state);
}

/**
 * P's side:
 * - WAITING: D registered its blocks (push) before the engine's PrefillDone;
 * - HELD: prefill done, blocks held under lease (for a registration, or for D's READ);
 * - MOVING: P's agents write into D's blocks;
 * - ABORTING: an abort (engine, D, or D down) came while writes were in flight: it takes
 *   effect once they settle;
 * - RELEASED: the KV went to D; FAILED, EXPIRED, ABORTED: blocks back without it.
 */
export type PrefillState =
  "WAITING" | "HELD" | "MOVING" | "ABORTING" | "RELEASED" | "FAILED" | "EXPIRED" | "ABORTED";

/**
 * D's side:
 * - WAITING: ExpectKv received, P's metadata being fetched (handshake) or the plan built;
 * - MOVING: push registered with P (waiting for every pair's XferDone), or pull reads in flight;
 * - CONFIRMING: pull reads done, waiting for P's ReadAck (were the blocks held throughout?);
 * - DRAINING: the engine was told KvFailed; its blocks wait until no write can land in them
 *   (P's AbortAck or Failed, reads settled, or P's registration lease surely over);
 * - KV_READY: the engine has the KV; FAILED, EXPIRED, ABORTED: blocks back without it.
 */
export type DecodeState =
  "WAITING" | "MOVING" | "CONFIRMING" | "DRAINING" | "KV_READY" | "FAILED" | "EXPIRED" | "ABORTED";

/** Where a new transfer may start. */
export const PREFILL_INITIAL: readonly PrefillState[] = ["WAITING", "HELD"];
export const DECODE_INITIAL: readonly DecodeState[] = ["WAITING"];

/** P: what may follow each state. */
export const PREFILL_NEXT: Readonly<Record<PrefillState, readonly PrefillState[]>> = {
  // PrefillDone: no matching registration -> HELD, one -> MOVING; the lease, an abort, D's
  // Failed or D going down end it.
  WAITING: ["HELD", "MOVING", "EXPIRED", "ABORTED", "FAILED"],
  // A registration (push) -> MOVING; D's ReadDone while held (pull) -> RELEASED.
  HELD: ["MOVING", "RELEASED", "EXPIRED", "ABORTED", "FAILED"],
  // Writes settle: all done -> RELEASED, one failed -> FAILED; an abort waits for them.
  MOVING: ["ABORTING", "RELEASED", "FAILED"],
  // The writes settle: all done -> RELEASED (the KV is there), else ABORTED.
  ABORTING: ["RELEASED", "ABORTED"],
  RELEASED: [],
  FAILED: [],
  EXPIRED: [],
  ABORTED: [],
};

/** D: what may follow each state. */
export const DECODE_NEXT: Readonly<Record<DecodeState, readonly DecodeState[]>> = {
  // Handshake and plan done -> MOVING; a failure before anything reached P ends it at once;
  // an abort of a push registered in the meantime drains.
  WAITING: ["MOVING", "DRAINING", "FAILED", "ABORTED", "EXPIRED"],
  // Push: every XferDone -> KV_READY. Pull: reads done -> CONFIRMING. A failure ends it at once
  // when no write can land (P said Failed, reads settled), else drains.
  MOVING: ["CONFIRMING", "KV_READY", "DRAINING", "FAILED", "ABORTED", "EXPIRED"],
  // P's ReadAck: held -> KV_READY, released -> FAILED.
  CONFIRMING: ["KV_READY", "DRAINING", "FAILED", "ABORTED", "EXPIRED"],
  // Safe at last: the terminal state decided when the failure began.
  DRAINING: ["FAILED", "ABORTED", "EXPIRED"],
  KV_READY: [],
  FAILED: [],
  EXPIRED: [],
  ABORTED: [],
};

/** What the lifecycle needs of a transfer. */
export interface Tracked<S extends string> {
  readonly id: string;
  /** Written only by `begin` and `transition`. */
  readonly state: S;
}

/** One side's machine: its table and what entering a state does there. */
export interface Lifecycle<S extends string, T extends Tracked<S>> {
  readonly side: TransferSide;
  readonly initial: readonly S[];
  readonly next: Readonly<Record<S, readonly S[]>>;
  readonly log: Logger;
  /** Entry effects of `to` (timing stamps, the state's deadline), terminal states included. */
  enter(t: T, to: S): void;
  /** The one exit, once, on reaching a terminal state: blocks back, the one event. */
  exit(t: T, kind: S & TerminalKind): void;
  /** A move the table does not allow: reported as an internal error (never thrown). */
  refused(problem: string): void;
}

/** Starts `t` in `state` (one of the side's initial states) and runs its entry effects. */
export function begin<S extends string, T extends Tracked<S>>(
  lc: Lifecycle<S, T>,
  t: T,
  state: S,
  why: string,
): boolean {
  if (!lc.initial.includes(state)) {
    lc.refused(`${lc.side} transfer '${t.id}' cannot start in ${state} (${why})`);
    return false;
  }
  (t as { state: S }).state = state;
  lc.log.debug({ transferId: t.id, side: lc.side, to: state, why }, `-> ${state}`);
  lc.enter(t, state);
  return true;
}

/**
 * Moves `t` to `to` if its side's table allows it from where it is; returns whether it moved.
 * A refused move changes nothing and is reported (`Lifecycle.refused`, an error log line).
 */
export function transition<S extends string, T extends Tracked<S>>(
  lc: Lifecycle<S, T>,
  t: T,
  to: S,
  why: string,
): boolean {
  const from = t.state;
  if (!lc.next[from].includes(to)) {
    const problem = `${lc.side} transfer '${t.id}': ${from} -> ${to} is not allowed (${why})`;
    lc.log.error({ transferId: t.id, side: lc.side, from, to, why }, "illegal transition");
    lc.refused(problem);
    return false;
  }
  (t as { state: S }).state = to;
  lc.log.debug({ transferId: t.id, side: lc.side, from, to, why }, `${from} -> ${to}`);
  lc.enter(t, to);
  if (isTerminal(to)) lc.exit(t, to);
  return true;
}
