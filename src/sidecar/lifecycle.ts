/**
 * The one writer of a transfer's state, for both sides: the one terminal set, and `begin` and
 * `transition`, which move a transfer only where its side's table can take it (each side's
 * table of (state, event) -> next state and effects is in decode-machine.ts and
 * prefill-machine.ts; `nextStates` derives from it where each state may go).
 *
 * Outside this module a transfer's state is read-only (`Tracked.state` is readonly; a test fails
 * on any `.state =` elsewhere). `transition` refuses a move its side's table does not allow (an
 * internal error and a log line, never a silent write), logs `from -> to`, runs the side's entry
 * effects (timing stamps, the state's deadline) and, on a terminal state, the side's one exit
 * (blocks back to the engine, the one event): invariant 3 of the design, by construction.
 *
 * docs/protocol.md's diagrams are generated from the tables.
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

/** A row's target that means "the terminal state decided when the failure began" (a drain's end). */
export const OUTCOME = "OUTCOME";

type Table<S extends string, E extends string> = Readonly<
  Record<S, Readonly<Partial<Record<E, { readonly to?: S | typeof OUTCOME }>>>>
>;

/**
 * Each state's possible next states from a table: every row's target, where OUTCOME stands for
 * the outcome (`failsAs`) of each event that leads into the state.
 */
export function nextStates<S extends string, E extends string>(
  states: readonly S[],
  table: Table<S, E>,
  failsAs: Readonly<Partial<Record<E, S>>>,
): Record<S, S[]> {
  const out = {} as Record<S, S[]>;
  for (const s of states) {
    const next = new Set<S>();
    for (const row of Object.values(table[s]) as { to?: S | typeof OUTCOME }[]) {
      if (row.to === undefined) continue;
      if (row.to !== OUTCOME) next.add(row.to);
      else for (const k of outcomesInto(states, table, failsAs, s)) next.add(k);
    }
    out[s] = states.filter((x) => next.has(x));
  }
  return out;
}

/**
 * The outcomes a transfer in `state` can carry: those of the failing events that lead there or
 * are taken there.
 */
function outcomesInto<S extends string, E extends string>(
  states: readonly S[],
  table: Table<S, E>,
  failsAs: Readonly<Partial<Record<E, S>>>,
  state: S,
): S[] {
  const kinds: S[] = [];
  for (const s of states)
    for (const [event, row] of Object.entries(table[s]) as [E, { to?: S | typeof OUTCOME }][]) {
      const k = failsAs[event];
      // Into the state, or (a withdrawal recorded for later) taken in it without a move.
      const into = row.to === state || (row.to === undefined && s === state);
      if (into && k !== undefined && !kinds.includes(k)) kinds.push(k);
    }
  return kinds;
}
