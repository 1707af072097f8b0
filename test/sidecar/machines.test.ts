// Every (state, event) pair of each machine, against the answer written out here: the next
// state ("=" stays), then the effects in order ("then X": after the move), or no entry (the
// state ignores the event). The tables (decode-machine.ts, prefill-machine.ts,
// sidecar-lifecycle.ts) are what the sides run; a change to one must be made here too, on
// purpose. Then the rules every row must keep, whatever the table says.
import { describe, expect, it } from "vitest";

import {
  DECODE_EVENTS,
  DECODE_FAILS_AS,
  DECODE_NEXT,
  DECODE_PHASE,
  DECODE_STATES,
  DECODE_TABLE,
  decodeStep,
  type DecodeRow,
} from "../../src/sidecar/decode-machine.js";
import { isTerminal, OUTCOME } from "../../src/sidecar/lifecycle.js";
import {
  PREFILL_EVENTS,
  PREFILL_FAILS_AS,
  PREFILL_NEXT,
  PREFILL_PHASE,
  PREFILL_STATES,
  PREFILL_TABLE,
  prefillStep,
  type PrefillRow,
} from "../../src/sidecar/prefill-machine.js";
import {
  SIDECAR_EVENTS,
  SIDECAR_STATES,
  SidecarLifecycle,
  sidecarStep,
  type SidecarState,
} from "../../src/sidecar/sidecar-lifecycle.js";

/** A row as one line: target ("=" stays), effects, "then" effects, reason. */
function render(r: DecodeRow | PrefillRow | undefined): string | undefined {
  if (r === undefined) return undefined;
  const parts: string[] = [
    r.to ?? "=",
    ...(r.effects ?? []),
    ...(r.then ?? []).map((x) => `then ${x}`),
  ];
  if ("reason" in r && r.reason !== undefined) parts.push(`reason ${r.reason}`);
  return parts.join(" ");
}

const DECODE: Record<string, Record<string, string>> = {
  WAITING: {
    PEER_FOUND_PUSH: "= CONNECT_PUSH",
    PEER_FOUND_PULL: "= CONNECT_PULL",
    HANDSHAKE_FAILED: "FAILED KV_FAILED",
    REGION_CHANGED: "FAILED KV_FAILED",
    PUSH_READY: "PUSH_REGISTERED then SEND_PUSH_REG",
    PLANNED: "READING then START_READS",
    PLAN_FAILED: "FAILED KV_FAILED TELL_P_ABORT",
    ENGINE_ABORT: "ABORTED KV_FAILED",
    STOPPING: "ABORTED KV_FAILED",
    DEADLINE: "EXPIRED KV_FAILED",
  },
  PUSH_REGISTERED: {
    XFER_DONE: "= COUNT_PAIR",
    ALL_PAIRS_DONE: "KV_READY DATA_DONE",
    P_FAILED: "FAILED KV_FAILED",
    P_DOWN: "PUSH_DRAINING KV_FAILED then TELL_P_ABORT",
    ENGINE_ABORT: "PUSH_DRAINING KV_FAILED then TELL_P_ABORT",
    STOPPING: "PUSH_DRAINING KV_FAILED then TELL_P_ABORT",
    HEARTBEAT: "= RENEW_PUSH",
    DEADLINE: "PUSH_DRAINING KV_FAILED then TELL_P_ABORT",
  },
  READING: {
    READS_DONE: "CONFIRMING then ASK_HELD",
    READS_FAILED: "FAILED TELL_P_FAILED KV_FAILED TELL_P_ABORT",
    P_FAILED: "READS_DRAINING KV_FAILED",
    P_DOWN: "READS_DRAINING KV_FAILED",
    ENGINE_ABORT: "READS_DRAINING KV_FAILED TELL_P_ABORT",
    STOPPING: "READS_DRAINING KV_FAILED TELL_P_ABORT",
    HEARTBEAT: "= RENEW",
    DEADLINE: "READS_DRAINING KV_FAILED TELL_P_ABORT",
  },
  CONFIRMING: {
    READ_ACK_HELD: "KV_READY TRACE_ACK",
    READ_ACK_RELEASED: "FAILED TRACE_ACK KV_FAILED",
    READ_ACK_UNKNOWN: "= TRACE_ACK RETRY_OR_GIVE_UP",
    UNKNOWN_TOO_LONG: "FAILED KV_FAILED",
    ASK_AGAIN: "= ASK_HELD",
    P_FAILED: "FAILED KV_FAILED",
    P_DOWN: "FAILED KV_FAILED",
    ENGINE_ABORT: "ABORTED KV_FAILED TELL_P_ABORT",
    STOPPING: "ABORTED KV_FAILED TELL_P_ABORT",
    HEARTBEAT: "= RENEW",
    DEADLINE: "EXPIRED KV_FAILED TELL_P_ABORT",
  },
  PUSH_DRAINING: {
    ABORT_ACK: "OUTCOME",
    P_FAILED: "OUTCOME",
    DEADLINE: "OUTCOME",
  },
  READS_DRAINING: {
    READS_DONE: "OUTCOME",
    READS_FAILED: "OUTCOME",
    P_FAILED: "=",
  },
  KV_READY: {
    PEER_FOUND_PULL: "= LATE_ABORT",
    DEADLINE: "= FORGET",
  },
  FAILED: {
    PEER_FOUND_PULL: "= LATE_ABORT",
    DEADLINE: "= FORGET",
  },
  EXPIRED: {
    PEER_FOUND_PULL: "= LATE_ABORT",
    DEADLINE: "= FORGET",
  },
  ABORTED: {
    PEER_FOUND_PULL: "= LATE_ABORT",
    DEADLINE: "= FORGET",
  },
};

const PREFILL: Record<string, Record<string, string>> = {
  AWAITING_PREFILL: {
    PREFILL_DONE: "= ACCEPT_PREFILL",
    ENGINE_ABORT: "ABORTED TELL_PENDING_ABORTED reason aborted by the engine",
    REGION_BROKEN: "FAILED TELL_REG_REGION reason ERR_REGION_CHANGED",
    REG_WITHDRAWN: "OUTCOME",
    NO_REG: "HELD",
    REG_CHOSEN: "WRITING then START_WRITES",
    PUSH_REG: "= CHECK_REG",
    REG_OK: "= KEEP_ASIDE",
    READ_DONE: "= TRACE_READ_DONE CHECK_READ_TOKEN",
    READ_OK: "= ACK_NOT_HELD",
    READ_EARLY: "= ACK_NOT_HELD",
    REG_ABORTED: "= WITHDRAW ACK_ABORT",
    REG_FAILED: "= WITHDRAW",
    REG_EXPIRED: "= WITHDRAW",
    REG_PEER_DOWN: "= WITHDRAW",
    D_ABORT_FORGED: "= REFUSE_ABORT",
    D_FAILED_FORGED: "= REFUSE_FAILED",
    STOPPING: "FAILED TELL_PENDING_DRAINING reason ERR_DRAINING",
    HEARTBEAT: "= RENEW_PENDING",
    DEADLINE: "= EXPIRE_REGS",
  },
  HELD: {
    PREFILL_DONE: "= REFUSE_DUPLICATE",
    ENGINE_ABORT: "ABORTED TELL_PENDING_ABORTED reason aborted by the engine",
    REGION_BROKEN: "FAILED TELL_REG_REGION reason ERR_REGION_CHANGED",
    PUSH_REG: "= CHECK_REG",
    REG_OK: "WRITING TAKE_REG then START_WRITES",
    READ_DONE: "= TRACE_READ_DONE CHECK_READ_TOKEN",
    READ_OK: "RELEASED ACK_HELD reason transferred",
    READ_EARLY: "= ACK_NOT_HELD",
    D_ABORT: "ABORTED ACK_ABORT reason aborted by decode",
    D_ABORT_FORGED: "= REFUSE_ABORT",
    D_FAILED: "FAILED",
    D_FAILED_FORGED: "= REFUSE_FAILED",
    ABANDON: "FAILED reason ERR_DRAINING",
    KV_BROKEN: "FAILED",
    HEARTBEAT: "= RENEW_REG RENEW_HOLD",
    DEADLINE: "EXPIRED reason lease expired",
  },
  WRITING: {
    PREFILL_DONE: "= REFUSE_DUPLICATE",
    ENGINE_ABORT: "ABORTING",
    PUSH_REG: "= CHECK_REG",
    REG_OK: "= REFUSE_REG_TAKEN",
    PLAN_FAILED: "FAILED TELL_D_FAILED",
    WRITES_DONE: "RELEASED MOVED reason transferred",
    WRITES_FAILED: "FAILED TELL_D_FAILED",
    READ_DONE: "= TRACE_READ_DONE CHECK_READ_TOKEN",
    READ_OK: "= ACK_NOT_HELD",
    READ_EARLY: "= ACK_NOT_HELD",
    D_ABORT: "ABORTING_FOR_D",
    D_ABORT_FORGED: "= REFUSE_ABORT",
    D_DOWN: "ABORTING",
    HEARTBEAT: "= RENEW_REG",
  },
  ABORTING: {
    PREFILL_DONE: "= REFUSE_DUPLICATE",
    PUSH_REG: "= CHECK_REG",
    REG_OK: "= REFUSE_REG_TAKEN",
    WRITES_DONE: "RELEASED MOVED reason transferred",
    WRITES_FAILED: "ABORTED TELL_D_FAILED",
    READ_DONE: "= TRACE_READ_DONE CHECK_READ_TOKEN",
    READ_OK: "= ACK_NOT_HELD",
    READ_EARLY: "= ACK_NOT_HELD",
    D_ABORT: "ABORTING_FOR_D",
    D_ABORT_FORGED: "= REFUSE_ABORT",
    HEARTBEAT: "= RENEW_REG",
  },
  ABORTING_FOR_D: {
    PREFILL_DONE: "= REFUSE_DUPLICATE",
    PUSH_REG: "= CHECK_REG",
    REG_OK: "= REFUSE_REG_TAKEN",
    WRITES_DONE: "RELEASED ACK_ABORT MOVED reason transferred",
    WRITES_FAILED: "ABORTED ACK_ABORT reason ERR_ABORTED",
    READ_DONE: "= TRACE_READ_DONE CHECK_READ_TOKEN",
    READ_OK: "= ACK_NOT_HELD",
    READ_EARLY: "= ACK_NOT_HELD",
    D_ABORT: "=",
    D_ABORT_FORGED: "= REFUSE_ABORT",
    HEARTBEAT: "= RENEW_REG",
  },
  RELEASED: {
    PREFILL_DONE: "= LATE_PREFILL",
    PUSH_REG: "= REFUSE_ENDED",
    READ_DONE: "= TRACE_READ_DONE CHECK_READ_TOKEN",
    READ_OK: "= ACK_NOT_HELD",
    READ_EARLY: "= ACK_NOT_HELD",
    REG_ABORTED: "= ACK_ABORT",
    D_ABORT: "= ACK_ABORT",
    D_ABORT_FORGED: "= ACK_ABORT",
    DEADLINE: "= FORGET",
  },
  FAILED: {
    PREFILL_DONE: "= LATE_PREFILL",
    PUSH_REG: "= REFUSE_ENDED",
    READ_DONE: "= TRACE_READ_DONE CHECK_READ_TOKEN",
    READ_OK: "= ACK_NOT_HELD",
    READ_EARLY: "= ACK_NOT_HELD",
    REG_ABORTED: "= ACK_ABORT",
    D_ABORT: "= ACK_ABORT",
    D_ABORT_FORGED: "= ACK_ABORT",
    DEADLINE: "= FORGET",
  },
  EXPIRED: {
    PREFILL_DONE: "= LATE_PREFILL",
    PUSH_REG: "= REFUSE_ENDED",
    READ_DONE: "= TRACE_READ_DONE CHECK_READ_TOKEN",
    READ_OK: "= ACK_NOT_HELD",
    READ_EARLY: "= ACK_NOT_HELD",
    REG_ABORTED: "= ACK_ABORT",
    D_ABORT: "= ACK_ABORT",
    D_ABORT_FORGED: "= ACK_ABORT",
    DEADLINE: "= FORGET",
  },
  ABORTED: {
    PREFILL_DONE: "= LATE_PREFILL",
    PUSH_REG: "= REFUSE_ENDED",
    READ_DONE: "= TRACE_READ_DONE CHECK_READ_TOKEN",
    READ_OK: "= ACK_NOT_HELD",
    READ_EARLY: "= ACK_NOT_HELD",
    REG_ABORTED: "= ACK_ABORT",
    D_ABORT: "= ACK_ABORT",
    D_ABORT_FORGED: "= ACK_ABORT",
    DEADLINE: "= FORGET",
  },
};

describe("D's table, every (state, event) pair", () => {
  it("answers as written", () => {
    let pairs = 0;
    for (const s of DECODE_STATES)
      for (const e of DECODE_EVENTS) {
        pairs++;
        expect(render(decodeStep(s, e)), `${s} + ${e}`).toBe(DECODE[s]?.[e]);
      }
    expect(pairs).toBe(DECODE_STATES.length * DECODE_EVENTS.length);
    // No expectation names a state or event the machine lacks.
    expect(Object.keys(DECODE).sort()).toEqual([...DECODE_STATES].sort());
    for (const s of DECODE_STATES)
      for (const e of Object.keys(DECODE[s]!)) expect(DECODE_EVENTS).toContain(e);
  });

  it("keeps its rules", () => {
    for (const s of DECODE_STATES)
      for (const e of DECODE_EVENTS) {
        const r = DECODE_TABLE[s][e];
        if (r === undefined) continue;
        const where = `${s} + ${e}`;
        const effects = [...(r.effects ?? []), ...(r.then ?? [])];
        // A terminal state never moves; only a drain ends in the outcome it recorded.
        if (isTerminal(s)) expect(r.to, where).toBeUndefined();
        if (r.to === OUTCOME) expect(DECODE_PHASE[s], where).toBe("DRAINING");
        // The engine hears KvFailed exactly when a failure begins (a live state, not a drain,
        // into a failure or a drain), and how it ends is then known.
        const failing =
          r.to !== undefined &&
          r.to !== OUTCOME &&
          r.to !== "KV_READY" &&
          (isTerminal(r.to) || DECODE_PHASE[r.to] === "DRAINING");
        expect(effects.includes("KV_FAILED"), where).toBe(failing);
        if (failing) expect(DECODE_FAILS_AS[e], where).toBeDefined();
        // A failure that goes straight to its terminal state goes to the event's.
        if (failing && isTerminal(r.to!)) expect(r.to, where).toBe(DECODE_FAILS_AS[e]);
        // Abort to P only when a peer is known (never from WAITING's handshake failures).
        if (effects.includes("TELL_P_ABORT") && s === "WAITING") expect(e).toBe("PLAN_FAILED");
      }
  });

  it("every live state can end, every state is reachable, the phases are the listed ones", () => {
    const seen = new Set<string>(["WAITING"]);
    for (let grew = true; grew;) {
      grew = false;
      for (const s of [...seen])
        for (const n of DECODE_NEXT[s as keyof typeof DECODE_NEXT])
          if (!seen.has(n)) grew = seen.add(n) !== undefined;
    }
    expect([...seen].sort()).toEqual([...DECODE_STATES].sort());
    for (const s of DECODE_STATES) {
      if (isTerminal(s)) expect(DECODE_NEXT[s]).toEqual([]);
      else expect(DECODE_NEXT[s].some(isTerminal), s).toBe(true);
    }
    expect(DECODE_NEXT.PUSH_DRAINING).toEqual(["FAILED", "EXPIRED", "ABORTED"]);
    expect(DECODE_NEXT.READS_DRAINING).toEqual(["FAILED", "EXPIRED", "ABORTED"]);
    expect(new Set(Object.values(DECODE_PHASE))).toEqual(
      new Set([
        "WAITING",
        "MOVING",
        "CONFIRMING",
        "DRAINING",
        "KV_READY",
        "FAILED",
        "EXPIRED",
        "ABORTED",
      ]),
    );
  });
});

describe("P's table, every (state, event) pair", () => {
  it("answers as written", () => {
    let pairs = 0;
    for (const s of PREFILL_STATES)
      for (const e of PREFILL_EVENTS) {
        pairs++;
        expect(render(prefillStep(s, e)), `${s} + ${e}`).toBe(PREFILL[s]?.[e]);
      }
    expect(pairs).toBe(PREFILL_STATES.length * PREFILL_EVENTS.length);
    expect(Object.keys(PREFILL).sort()).toEqual([...PREFILL_STATES].sort());
    for (const s of PREFILL_STATES)
      for (const e of Object.keys(PREFILL[s]!)) expect(PREFILL_EVENTS).toContain(e);
  });

  it("keeps its rules", () => {
    for (const s of PREFILL_STATES)
      for (const e of PREFILL_EVENTS) {
        const r = PREFILL_TABLE[s][e];
        if (r === undefined) continue;
        const where = `${s} + ${e}`;
        const effects = [...(r.effects ?? []), ...(r.then ?? [])];
        if (isTerminal(s)) expect(r.to, where).toBeUndefined();
        // Only the registration the token picks at PrefillDone ends a transfer as recorded.
        if (r.to === OUTCOME) expect(where).toBe("AWAITING_PREFILL + REG_WITHDRAWN");
        // Writes start only on entering WRITING; D hears AbortAck only if it asked or aborts now.
        expect(effects.includes("START_WRITES"), where).toBe(r.to === "WRITING");
        if (r.to === "WRITING") expect(r.then, where).toEqual(["START_WRITES"]);
        // A withdrawal is recorded only before PrefillDone, and moves nothing.
        if (effects.includes("WITHDRAW")) {
          expect(s, where).toBe("AWAITING_PREFILL");
          expect(r.to, where).toBeUndefined();
          expect(PREFILL_FAILS_AS[e], where).toBeDefined();
        }
        // While writes are in flight nothing ends the transfer but the writes settling.
        if (PREFILL_PHASE[s] === "MOVING" || PREFILL_PHASE[s] === "ABORTING")
          if (r.to !== undefined && isTerminal(r.to))
            expect(["WRITES_DONE", "WRITES_FAILED", "PLAN_FAILED"], where).toContain(e);
      }
  });

  it("every live state can end, every state is reachable", () => {
    const seen = new Set<string>(["AWAITING_PREFILL", "HELD"]);
    for (let grew = true; grew;) {
      grew = false;
      for (const s of [...seen])
        for (const n of PREFILL_NEXT[s as keyof typeof PREFILL_NEXT])
          if (!seen.has(n)) grew = seen.add(n) !== undefined;
    }
    expect([...seen].sort()).toEqual([...PREFILL_STATES].sort());
    for (const s of PREFILL_STATES) {
      if (isTerminal(s)) expect(PREFILL_NEXT[s]).toEqual([]);
      else expect(PREFILL_NEXT[s].some(isTerminal), s).toBe(true);
    }
    expect(PREFILL_NEXT.AWAITING_PREFILL).toEqual([
      "HELD",
      "WRITING",
      "FAILED",
      "EXPIRED",
      "ABORTED",
    ]);
  });
});

describe("the sidecar's own lifecycle, every (state, event) pair", () => {
  const EXPECT: Record<SidecarState, Partial<Record<string, SidecarState>>> = {
    UNREGISTERED: { REGISTERED: "SERVING", DRAIN: "DRAINING", CLOSE: "CLOSED" },
    SERVING: { DRAIN: "DRAINING", CLOSE: "CLOSED" },
    DRAINING: { CLOSE: "CLOSED" },
    CLOSED: {},
  };
  /** Events that bring a new lifecycle to each state. */
  const ROUTE: Record<SidecarState, readonly ("REGISTERED" | "DRAIN" | "CLOSE")[]> = {
    UNREGISTERED: [],
    SERVING: ["REGISTERED"],
    DRAINING: ["REGISTERED", "DRAIN"],
    CLOSED: ["CLOSE"],
  };

  it("answers as written, and the one writer moves as it answers", () => {
    let pairs = 0;
    for (const s of SIDECAR_STATES)
      for (const e of SIDECAR_EVENTS) {
        pairs++;
        expect(sidecarStep(s, e), `${s} + ${e}`).toBe(EXPECT[s][e]);
        const life = new SidecarLifecycle();
        for (const step of ROUTE[s]) life.on(step);
        expect(life.state).toBe(s);
        expect(life.on(e), `${s} + ${e}`).toBe(EXPECT[s][e] !== undefined);
        const now = EXPECT[s][e] ?? s;
        expect(life.state).toBe(now);
        expect([life.serving, life.draining, life.closed]).toEqual([
          now === "SERVING",
          now === "DRAINING",
          now === "CLOSED",
        ]);
      }
    expect(pairs).toBe(12);
  });
});
