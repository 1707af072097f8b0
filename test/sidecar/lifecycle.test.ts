// Every pair of states of both sides' tables (lifecycle.ts): a legal move moves, runs the entry
// effects and, into a terminal state, the one exit exactly once; an illegal one changes nothing
// and is reported. In milliseconds, without processes.
import { pino } from "pino";
import { describe, expect, it } from "vitest";

import { DECODE_INITIAL, DECODE_NEXT } from "../../src/sidecar/decode-machine.js";
import { PREFILL_INITIAL, PREFILL_NEXT } from "../../src/sidecar/prefill-machine.js";
import {
  TERMINAL_KINDS,
  begin,
  isTerminal,
  transition,
  type Lifecycle,
  type Tracked,
} from "../../src/sidecar/lifecycle.js";

interface T extends Tracked<string> {
  entered: string[];
  exits: string[];
}

function machine(next: Readonly<Record<string, readonly string[]>>, initial: readonly string[]) {
  const refused: string[] = [];
  const lc: Lifecycle<string, T> = {
    side: "decode",
    initial,
    next,
    log: pino({ level: "silent" }),
    enter: (t, to) => t.entered.push(to),
    exit: (t, kind) => t.exits.push(kind),
    refused: (problem) => refused.push(problem),
  };
  return { lc, refused };
}

/** A transfer placed in `state` directly (as if it had got there by legal moves). */
function at(state: string): T {
  return { id: "t", state, entered: [], exits: [] };
}

const SIDES = [
  { name: "prefill", next: PREFILL_NEXT, initial: PREFILL_INITIAL },
  { name: "decode", next: DECODE_NEXT, initial: DECODE_INITIAL },
] as const;

describe("lifecycle tables", () => {
  for (const side of SIDES) {
    const states = Object.keys(side.next);

    it(`${side.name}: every legal and illegal pair`, () => {
      let legal = 0;
      let illegal = 0;
      for (const from of states) {
        for (const to of states) {
          const { lc, refused } = machine(side.next, side.initial);
          const t = at(from);
          const allowed = (side.next as Record<string, readonly string[]>)[from]!.includes(to);
          const moved = transition(lc, t, to, "test");
          expect(moved, `${from} -> ${to}`).toBe(allowed);
          if (allowed) {
            legal++;
            expect(t.state).toBe(to);
            expect(t.entered).toEqual([to]);
            expect(t.exits).toEqual(isTerminal(to) ? [to] : []);
            expect(refused).toEqual([]);
          } else {
            illegal++;
            expect(t.state, `${from} -> ${to} must not write`).toBe(from);
            expect(t.entered).toEqual([]);
            expect(t.exits).toEqual([]);
            expect(refused).toHaveLength(1);
            expect(refused[0]).toContain(`${from} -> ${to} is not allowed`);
          }
        }
      }
      expect(legal + illegal).toBe(states.length * states.length);
      expect(legal).toBeGreaterThan(0);
    });

    it(`${side.name}: terminal states have no way out; every live state reaches a terminal one`, () => {
      for (const s of states) {
        const next = (side.next as Record<string, readonly string[]>)[s]!;
        if (isTerminal(s)) expect(next, s).toEqual([]);
        else expect(next.some(isTerminal), `${s} must be able to end`).toBe(true);
      }
      // Every state is reachable from an initial one.
      const seen = new Set<string>(side.initial);
      for (let changed = true; changed;) {
        changed = false;
        for (const s of [...seen])
          for (const n of (side.next as Record<string, readonly string[]>)[s]!)
            if (!seen.has(n)) {
              seen.add(n);
              changed = true;
            }
      }
      expect([...seen].sort()).toEqual([...states].sort());
    });

    it(`${side.name}: a transfer starts only in an initial state`, () => {
      for (const s of states) {
        const { lc, refused } = machine(side.next, side.initial);
        const t = at("");
        const ok = begin(lc, t, s, "test");
        expect(ok, s).toBe(side.initial.includes(s as never));
        expect(t.state).toBe(ok ? s : "");
        expect(refused).toHaveLength(ok ? 0 : 1);
        if (!ok)
          expect(refused[0]).toBe(`${lc.side} transfer '${t.id}' cannot start in ${s} (test)`);
      }
    });
  }

  it("the one terminal set: each side ends in its own four of the five", () => {
    expect([...TERMINAL_KINDS].sort()).toEqual(
      ["ABORTED", "EXPIRED", "FAILED", "KV_READY", "RELEASED"].sort(),
    );
    const terminal = (next: object) => Object.keys(next).filter(isTerminal).sort();
    expect(terminal(PREFILL_NEXT)).toEqual(["ABORTED", "EXPIRED", "FAILED", "RELEASED"]);
    expect(terminal(DECODE_NEXT)).toEqual(["ABORTED", "EXPIRED", "FAILED", "KV_READY"]);
  });

  it("a second terminal move is refused: one exit, one event", () => {
    const { lc, refused } = machine(DECODE_NEXT, DECODE_INITIAL);
    const t = at("PUSH_DRAINING");
    expect(transition(lc, t, "ABORTED", "first")).toBe(true);
    expect(transition(lc, t, "FAILED", "second")).toBe(false);
    expect(t.exits).toEqual(["ABORTED"]);
    expect(refused).toHaveLength(1);
  });
});
