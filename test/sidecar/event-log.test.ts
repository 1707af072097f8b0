// EventLog: sequence numbers, retention, subscriptions (replay, live, filters,
// back-pressure, falling behind), waitFor, and bounded indexes.
import { describe, expect, it } from "vitest";
import { KvxferError } from "../../src/errors.js";
import { EventLog } from "../../src/sidecar/event-log.js";
import { logEvent } from "./fakes.js";
import type { EventKind, SidecarEvent, TransferSide } from "../../src/sidecar/view.js";

const ev = logEvent;

const flush = () => new Promise<void>((r) => setImmediate(r));

function codeOf(fn: () => unknown): string | undefined {
  try {
    fn();
  } catch (err) {
    return err instanceof KvxferError ? err.code : `not a KvxferError: ${String(err)}`;
  }
  return undefined;
}

describe("EventLog", () => {
  it("numbers events 1, 2, 3 and keeps the last `capacity`", () => {
    const log = new EventLog({ capacity: 5 });
    expect([log.firstSeq, log.lastSeq, log.size]).toEqual([1, 0, 0]);
    for (let i = 1; i <= 12; i++) expect(log.append(ev(`t${i}`)).seq).toBe(i);
    expect([log.firstSeq, log.lastSeq, log.size]).toEqual([8, 12, 5]);
    expect(log.since(9).map((e) => e.seq)).toEqual([10, 11, 12]);
    expect(log.since(0).map((e) => e.seq)).toEqual([8, 9, 10, 11, 12]);
    expect(log.since(7)).toHaveLength(5);
    expect(codeOf(() => log.since(6))).toBe("ERR_OUT_OF_RANGE");
    expect(codeOf(() => log.since(13))).toBe("ERR_OUT_OF_RANGE");
    expect(codeOf(() => log.since(-1))).toBe("ERR_INVALID_ARGUMENT");
    expect(Object.isFrozen(log.get(12))).toBe(true);
  });

  it("replays retained events, then live ones, each once, with filters", async () => {
    const log = new EventLog();
    log.append(ev("a"));
    log.append(ev("", "PEER_UP", ""));
    log.append(ev("b", "FAILED"));
    const all: number[] = [];
    const mine: number[] = [];
    let caughtUp = 0;
    const s1 = log.subscribe(
      1,
      {},
      { onEvent: (e) => all.push(e.seq), onEnd: () => {}, onCaughtUp: () => caughtUp++ },
    );
    const s2 = log.subscribe(
      0,
      { transferIds: ["b", "c"], kinds: ["FAILED", "KV_READY"] },
      { onEvent: (e) => mine.push(e.seq), onEnd: () => {} },
    );
    expect(all).toEqual([]); // never inside subscribe()
    await flush();
    expect(all).toEqual([2, 3]);
    expect(caughtUp).toBe(1);
    log.append(ev("c"));
    log.append(ev("d"));
    log.append(ev("c", "RELEASED", "prefill"));
    await flush();
    expect(all).toEqual([2, 3, 4, 5, 6]);
    expect(mine).toEqual([3, 4]);
    expect(s2.scannedSeq).toBe(6);
    expect(s2.deliveredSeq).toBe(4);
    s1.close();
    s2.close();
    expect(log.subscriberCount).toBe(0);
  });

  it("refuses unknown kinds and stale or future sequence numbers", () => {
    const log = new EventLog({ capacity: 3 });
    for (let i = 0; i < 10; i++) log.append(ev(`t${i}`));
    const h = { onEvent: () => {}, onEnd: () => {} };
    expect(codeOf(() => log.subscribe(0, { kinds: ["NOPE" as EventKind] }, h))).toBe(
      "ERR_INVALID_ARGUMENT",
    );
    expect(codeOf(() => log.subscribe(0, { transferIds: [""] }, h))).toBe("ERR_INVALID_ARGUMENT");
    expect(codeOf(() => log.subscribe(11, {}, h))).toBe("ERR_OUT_OF_RANGE");
    expect(codeOf(() => log.subscribe(2 ** 60, {}, h))).toBe("ERR_INVALID_ARGUMENT");
    try {
      log.subscribe(5, {}, h);
    } catch (err) {
      expect((err as Error).message).toMatch(/oldest retained seq is 8/);
    }
    expect(codeOf(() => log.subscribe(7, {}, h).close())).toBeUndefined();
  });

  it("starts live-only subscriptions at the head", async () => {
    const log = new EventLog();
    log.append(ev("old"));
    const got: string[] = [];
    log.subscribe(
      0,
      {},
      { onEvent: (e) => got.push(e.transferId), onEnd: () => {} },
      { liveOnly: true },
    );
    log.append(ev("new"));
    await flush();
    expect(got).toEqual(["new"]);
  });

  it("ends a subscriber that pushes back with more than bufferLimit events waiting; spares one that does not", async () => {
    const log = new EventLog({ capacity: 100_000 });
    let endedWith: KvxferError | undefined;
    let got = 0;
    const stuck = log.subscribe(
      0,
      {},
      {
        onEvent: () => {
          got++;
          if (got === 10) stuck.pause();
        },
        onEnd: (err) => (endedWith = err),
      },
      { bufferLimit: 100 },
    );
    let fast = 0;
    log.subscribe(0, {}, { onEvent: () => fast++, onEnd: () => {} }, { bufferLimit: 100 });
    for (let i = 0; i < 50; i++) log.append(ev(`t${i}`));
    await flush();
    expect(got).toBe(10);
    expect(stuck.buffered).toBe(40);
    stuck.resume();
    stuck.pause();
    for (let i = 0; i < 5_000; i++) log.append(ev(`u${i}`)); // one burst, far past the limit
    expect(endedWith?.code).toBe("ERR_FELL_BEHIND");
    await flush();
    expect(fast).toBe(5_050); // not pushing back: the whole burst at the next flush
    expect(log.subscriberBuffers()).toEqual([0]);
  });

  it("ends a subscriber whose next event was dropped (OUT_OF_RANGE)", async () => {
    const log = new EventLog({ capacity: 10 });
    let endedWith: KvxferError | undefined;
    const s = log.subscribe(
      0,
      {},
      { onEvent: () => s.pause(), onEnd: (err) => (endedWith = err) },
      { bufferLimit: 1_000 },
    );
    log.append(ev("a"));
    await flush();
    for (let i = 0; i < 20; i++) log.append(ev(`t${i}`));
    expect(endedWith?.code).toBe("ERR_OUT_OF_RANGE");
  });

  it("waitFor: before, during, deadline, abort, side, dropped", async () => {
    const log = new EventLog({ capacity: 4 });
    log.append(ev("before"));
    expect((await log.waitFor("before"))?.seq).toBe(1);

    const during = log.waitFor("during", { deadlineMs: Date.now() + 5_000 });
    expect(log.waiterTotal).toBe(1);
    log.append(ev("during", "ABORTED"));
    expect((await during)?.kind).toBe("ABORTED");

    const t0 = Date.now();
    expect(await log.waitFor("late", { deadlineMs: Date.now() + 50 })).toBeUndefined();
    expect(Date.now() - t0).toBeGreaterThanOrEqual(45);

    const ac = new AbortController();
    const aborted = log.waitFor("x", { signal: ac.signal });
    ac.abort();
    expect(await aborted).toBeUndefined();
    expect(log.waiterTotal).toBe(0);

    // role "both": P's RELEASED and D's KV_READY for one transfer.
    const decode = log.waitFor("both", { side: "decode", deadlineMs: Date.now() + 5_000 });
    log.append(ev("both", "RELEASED", "prefill"));
    log.append(ev("both", "KV_READY", "decode"));
    expect((await decode)?.kind).toBe("KV_READY");
    expect((await log.waitFor("both"))?.kind).toBe("RELEASED");

    for (let i = 0; i < 4; i++) log.append(ev(`fill${i}`));
    await expect(log.waitFor("before")).rejects.toMatchObject({ code: "ERR_NOT_FOUND" });
    expect(log.findTerminal("never")).toEqual({ found: "unknown" });
  });

  it("role both: when P's terminal event leaves the ring, D's is still found by side", () => {
    const log = new EventLog({ capacity: 3 });
    log.append(ev("both", "RELEASED", "prefill"));
    log.append(ev("both", "KV_READY", "decode"));
    expect(log.findTerminal("both")).toMatchObject({ event: { kind: "RELEASED", seq: 1 } });
    log.append(ev("fill"));
    log.append(ev("fill2"));
    expect(log.findTerminal("both", "decode")).toMatchObject({
      found: "retained",
      event: { kind: "KV_READY", seq: 2 },
    });
    expect(log.findTerminal("both", "prefill")).toEqual({ found: "dropped", seq: 1 });
    expect(log.findTerminal("both")).toEqual({ found: "dropped", seq: 1 });
    log.append(ev("fill3"));
    expect(log.findTerminal("both", "decode")).toEqual({ found: "dropped", seq: 2 });
  });

  it("refuses waiters beyond maxWaiters", async () => {
    const log = new EventLog({ maxWaiters: 2 });
    const ac = new AbortController();
    const a = log.waitFor("a", { signal: ac.signal });
    const b = log.waitFor("b", { signal: ac.signal });
    await expect(log.waitFor("c")).rejects.toMatchObject({ code: "ERR_TOO_MANY_WAITERS" });
    ac.abort();
    await Promise.all([a, b]);
  });

  it("keeps its indexes bounded by capacity over 200 000 transfers", () => {
    const log = new EventLog({ capacity: 1_000 });
    for (let i = 0; i < 200_000; i++) log.append(ev(`t${i}`, i % 2 ? "KV_READY" : "FAILED"));
    const internals = log as unknown as {
      terminal: Map<string, unknown>;
      dropped: Map<string, number>;
    };
    expect(internals.terminal.size).toBeLessThanOrEqual(1_000);
    expect(internals.dropped.size).toBeLessThanOrEqual(1_000);
    expect(log.findTerminal("t199999")).toMatchObject({ found: "retained" });
    expect(log.findTerminal("t198500")).toEqual({ found: "dropped", seq: 198_501 });
  });

  it("close() ends subscriptions and waiters", async () => {
    const log = new EventLog();
    let endedWith: KvxferError | undefined;
    log.subscribe(0, {}, { onEvent: () => {}, onEnd: (err) => (endedWith = err) });
    const w = log.waitFor("x");
    log.close();
    expect(endedWith?.code).toBe("ERR_CLOSED");
    expect(await w).toBeUndefined();
    expect(codeOf(() => log.append(ev("y")))).toBe("ERR_CLOSED");
  });
});
