/**
 * The per-request path (issue 30): many transfers in one call (transferMany, one hand-off to the
 * progress thread), and the caller-progress mode, where the JavaScript thread posts each
 * operation inside its own call and progresses the worker itself (agent.progress()).
 */
import { describe, expect, it } from "vitest";

import { Agent, type OpTrace } from "../../src/native/index.js";
import { pattern, traceSteps, useAgents } from "./agents.js";

const SIZE = 1 << 20;
const agent = useAgents();

/**
 * Two agents and what most cases move: `a`'s SIZE bytes of pattern `seed` (src) and a buffer to
 * read back into (back), `b`'s SIZE zero bytes (dst), and a's endpoint to b with dst imported.
 */
function rig(name: string, seed: number, aOpts: ConstructorParameters<typeof Agent>[0] = {}) {
  const a = agent({ name: `${name}-a`, ...aOpts });
  const b = agent({ name: `${name}-b` });
  const srcBuf = pattern(SIZE, seed);
  const dstBuf = new Uint8Array(SIZE);
  const backBuf = new Uint8Array(SIZE);
  const src = a.registerMemory(srcBuf);
  const back = a.registerMemory(backBuf);
  const dst = b.registerMemory(dstBuf);
  const ep = a.connect(b.address);
  const remote = ep.importRemote(dst.remoteKey());
  return { a, srcBuf, dstBuf, backBuf, src, back, ep, remote };
}

/** Calls agent.progress() until `done()` holds; fails after `ms`. Every turn is bounded. */
async function pump(a: Agent, done: () => boolean, ms = 10_000): Promise<number> {
  const end = Date.now() + ms;
  let turns = 0;
  while (!done()) {
    if (Date.now() > end) throw new Error(`not done after ${turns} progress() calls in ${ms} ms`);
    a.progress();
    turns++;
    // Let settled promises run their handlers.
    await Promise.resolve();
    if (turns % 1000 === 0) await new Promise((r) => setImmediate(r));
  }
  return turns;
}

describe("transferMany: many operations, one call", () => {
  it("moves 64 writes and reads of one call byte for byte, each settling on its own", async () => {
    const { a, srcBuf, dstBuf, backBuf, src, back, ep, remote } = rig("many", 1);
    const chunk = SIZE / 64;
    const writes = Array.from({ length: 64 }, (_, i) => ({
      kind: "write" as const,
      endpoint: ep,
      local: src,
      remote,
      // Reversed order: entry i lands in slot 63 - i.
      descriptors: new Float64Array([i * chunk, (63 - i) * chunk, chunk]),
    }));
    const traces: OpTrace[] = await Promise.all(a.transferMany(writes));
    expect(traces).toHaveLength(64);
    // One hand-off: every entry reached the progress thread in the same command.
    expect(new Set(traces.map((t) => t.submittedUs)).size).toBe(1);
    // Each its own trace (a delivery batch's traces share one buffer, a view each), every step in
    // order.
    for (const t of traces) {
      const steps = traceSteps(t, false);
      expect(steps[0]).toBeGreaterThan(0);
      for (let s = 1; s < steps.length; s++) expect(steps[s]).toBeGreaterThanOrEqual(steps[s - 1]!);
    }
    for (let i = 0; i < 64; i++) {
      const want = srcBuf.subarray(i * chunk, (i + 1) * chunk);
      const got = dstBuf.subarray((63 - i) * chunk, (64 - i) * chunk);
      expect(Buffer.compare(got, want), `slot ${63 - i}`).toBe(0);
    }
    // Two small writes, inline, settled in one delivery batch: each keeps its own trace (the one
    // with a notification has a notify step, the other none).
    const [withNote, without] = await Promise.all(
      a.transferMany([
        { ...writes[0]!, notification: Buffer.from("n") },
        { ...writes[1]!, descriptors: new Float64Array([0, 0, 64]) },
      ]),
    );
    expect(withNote!.notifiedUs).toBeGreaterThan(0);
    expect(without!.notifiedUs).toBe(0);
    const reads = Array.from({ length: 64 }, (_, i) => ({
      kind: "read" as const,
      endpoint: ep,
      local: back,
      remote,
      descriptors: new Float64Array([i * chunk, i * chunk, chunk]),
    }));
    await Promise.all(a.transferMany(reads));
    expect(Buffer.compare(backBuf, dstBuf)).toBe(0);
    expect(await Promise.all(a.transferMany([]))).toEqual([]);
  });

  it("a bad entry refuses the whole call by name, before anything is posted", () => {
    const a = agent({ name: "many-bad-a" });
    const b = agent({ name: "many-bad-b" });
    const src = a.registerMemory(pattern(8192, 2));
    const dstBuf = new Uint8Array(8192);
    const dst = b.registerMemory(dstBuf);
    const ep = a.connect(b.address);
    const remote = ep.importRemote(dst.remoteKey());
    const good = { kind: "write" as const, endpoint: ep, local: src, remote };
    const entries = [
      { ...good, descriptors: new Float64Array([0, 0, 4096]) },
      { ...good, descriptors: new Float64Array([0, 4096, 8192]) }, // past the remote region
    ];
    expect(() => a.transferMany(entries)).toThrow(
      expect.objectContaining({
        code: "ERR_OUT_OF_BOUNDS",
        message: expect.stringMatching(/^transferMany entry 1: /),
      }),
    );
    expect(() =>
      a.transferMany([{ ...good, kind: "copy" as "write", descriptors: new Float64Array(3) }]),
    ).toThrow(expect.objectContaining({ code: "ERR_INVALID_ARGUMENT" }));
    expect(() =>
      a.transferMany([
        {
          ...good,
          kind: "read",
          descriptors: new Float64Array([0, 0, 16]),
          notification: Buffer.from("x"),
        },
      ]),
    ).toThrow(expect.objectContaining({ message: expect.stringMatching(/only a write carries/) }));
    expect(a.inflight).toBe(0);
    expect(dstBuf.every((x) => x === 0)).toBe(true);
  });
});

describe("caller progress: the JavaScript thread drives the worker", () => {
  it("settles nothing until progress() is called, then moves the bytes exactly", async () => {
    const { a, srcBuf, dstBuf, backBuf, src, back, ep, remote } = rig("caller", 3, {
      progress: "caller",
    });
    let settled = false;
    const p = a.write(ep, src, remote, new Float64Array([0, 0, SIZE])).then((t) => {
      settled = true;
      return t;
    });
    await new Promise((r) => setTimeout(r, 50));
    expect(settled).toBe(false);
    expect(a.inflight).toBe(1);
    await pump(a, () => settled);
    const trace = await p;
    expect(trace.flushedUs).toBeGreaterThanOrEqual(trace.postedUs);
    expect(Buffer.compare(dstBuf, srcBuf)).toBe(0);
    // A read back, and many small requests in flight at once.
    let done = 0;
    for (let i = 0; i < 256; i++) {
      const off = i * 4096;
      void a.read(ep, back, remote, new Float64Array([off, off, 4096])).then(() => done++);
    }
    await pump(a, () => done === 256);
    expect(Buffer.compare(backBuf, dstBuf)).toBe(0);
  });

  it("two polling agents exchange 500 notification round trips, each delivered inside progress()", async () => {
    const a = agent({ name: "ping", progress: "caller" });
    const b = agent({ name: "pong", progress: "caller" });
    const ab = a.connect(b.address);
    const ba = b.connect(a.address);
    let got = 0;
    let last = -1;
    let inProgress = false;
    b.on("notifications", (batch) => {
      for (const n of batch) void b.notify(ba, n.data);
    });
    a.on("notifications", (batch) => {
      // Notifications reach JavaScript only from inside progress().
      expect(inProgress).toBe(true);
      for (const n of batch) {
        const k = n.data.readUInt32LE(0);
        expect(k).toBe(last + 1);
        last = k;
        got++;
      }
    });
    const end = Date.now() + 20_000;
    for (let i = 0; i < 500; i++) {
      const msg = Buffer.alloc(32);
      msg.writeUInt32LE(i, 0);
      void a.notify(ab, msg);
      while (got <= i) {
        if (Date.now() > end) throw new Error(`round trip ${i} not back in time`);
        inProgress = true;
        a.progress();
        inProgress = false;
        b.progress();
        await Promise.resolve();
      }
    }
    expect(got).toBe(500);
  });

  it("close() with operations in flight rejects them ERR_CLOSED and returns within its bound", async () => {
    const a = new Agent({ name: "caller-close", transports: "shm,self", progress: "caller" });
    const b = agent({ name: "caller-close-b" });
    const src = a.registerMemory(pattern(SIZE, 4));
    const dst = b.registerMemory(new Uint8Array(SIZE));
    const ep = a.connect(b.address);
    const remote = ep.importRemote(dst.remoteKey());
    const ps = Array.from({ length: 8 }, () =>
      a.write(ep, src, remote, new Float64Array([0, 0, SIZE])).then(
        () => "done",
        (e: { code?: string }) => e.code,
      ),
    );
    const t0 = Date.now();
    a.close();
    expect(Date.now() - t0).toBeLessThan(11_000);
    const outcomes = await Promise.all(ps);
    // Posted inside write() itself: each either completed before the close or was cancelled.
    for (const o of outcomes) expect(["done", "ERR_CLOSED"]).toContain(o);
    expect(a.progress()).toBe(0);
  });
});

describe("prepared transfers: checked once, posted again and again", () => {
  it("a prepared WRITE and READ posted 2000 times each move the bytes exactly, with caller progress", async () => {
    const { a, srcBuf, dstBuf, backBuf, src, back, ep, remote } = rig("prep", 7, {
      progress: "caller",
    });
    const chunk = SIZE / 8;
    const writes = Array.from({ length: 8 }, (_, i) =>
      a.prepare("write", ep, src, remote, new Float64Array([i * chunk, i * chunk, chunk])),
    );
    expect(writes.map((w) => w.state)).toEqual(Array(8).fill("idle"));
    let posts = 0;
    for (const w of writes) {
      w.post();
      posts++;
    }
    expect(() => writes[0]!.post()).toThrow(expect.objectContaining({ code: "ERR_BUSY" }));
    const end = Date.now() + 20_000;
    while (posts < 2000 || writes.some((w) => w.state === "pending")) {
      if (Date.now() > end) throw new Error(`prepared writes stuck after ${posts} posts`);
      a.progress();
      for (const w of writes) if (w.state === "done" && posts < 2000) (w.post(), posts++);
    }
    expect(Buffer.compare(dstBuf, srcBuf)).toBe(0);
    const read = a.prepare("read", ep, back, remote, new Float64Array([0, 0, SIZE]));
    for (let i = 0; i < 2000; i++) {
      backBuf.fill(0, 0, 16);
      read.post();
      while (read.state === "pending") a.progress();
      expect(read.state).toBe("done");
    }
    expect(Buffer.compare(backBuf, srcBuf)).toBe(0);
  });

  it("with the progress thread, a prepared WRITE completes on its own", async () => {
    const a = agent({ name: "prep-t-a" });
    const b = agent({ name: "prep-t-b" });
    const srcBuf = pattern(65536, 8);
    const dstBuf = new Uint8Array(65536);
    const ep = a.connect(b.address);
    const w = a.prepare(
      "write",
      ep,
      a.registerMemory(srcBuf),
      ep.importRemote(b.registerMemory(dstBuf).remoteKey()),
      new Float64Array([0, 0, 65536]),
    );
    for (let i = 0; i < 100; i++) {
      w.post();
      await pump(a, () => w.state !== "pending");
      expect(w.state).toBe("done");
    }
    expect(Buffer.compare(dstBuf, srcBuf)).toBe(0);
  });

  it("with the progress thread, 'prepared' events return every post, and reposting from them moves the bytes exactly", async () => {
    const { a, srcBuf, dstBuf, backBuf, src, back, ep, remote } = rig("prep-ev", 9);
    const slots = 8;
    const chunk = SIZE / slots;
    const writes = Array.from({ length: slots }, (_, i) =>
      a.prepare("write", ep, src, remote, new Float64Array([i * chunk, i * chunk, chunk])),
    );
    const reads = Array.from({ length: slots }, (_, i) =>
      a.prepare("read", ep, back, remote, new Float64Array([i * chunk, i * chunk, chunk])),
    );
    // Driven by the events alone: each transfer a batch returns done is posted again at once.
    const run = (xfers: typeof writes, posts: number): Promise<number[]> =>
      new Promise((resolve, reject) => {
        const returned = xfers.map(() => 0);
        let posted = 0;
        let back = 0;
        const timer = setTimeout(() => reject(new Error(`${back}/${posts} returned`)), 20_000);
        const onDone = (done: typeof writes, failed: typeof writes): void => {
          if (failed.length > 0) reject(new Error(`${failed.length} posts failed`));
          for (const x of done) {
            expect(x.state).toBe("done");
            returned[xfers.indexOf(x)]!++;
            back++;
            if (posted < posts) (x.post(), posted++);
          }
          if (back === posts) {
            clearTimeout(timer);
            a.off("prepared", onDone);
            resolve(returned);
          }
        };
        a.on("prepared", onDone);
        for (const x of xfers) (x.post(), posted++);
      });
    const writesBack = await run(writes, 1000);
    // Every post came back once, each slot's as often as it was posted.
    expect(writesBack.reduce((s, n) => s + n, 0)).toBe(1000);
    expect(Math.min(...writesBack)).toBeGreaterThan(0);
    expect(Buffer.compare(dstBuf, srcBuf)).toBe(0);
    await run(reads, 1000);
    expect(Buffer.compare(backBuf, srcBuf)).toBe(0);
    expect(a.listenerCount("prepared")).toBe(0);
  });

  it("'prepared' events come only while someone listens (caller progress: inside progress())", () => {
    const { a, src, ep, remote } = rig("prep-watch", 10, { progress: "caller" });
    const w = a.prepare("write", ep, src, remote, new Float64Array([0, 0, 4096]));
    const batches: number[] = [];
    const onDone = (done: unknown[]): number => batches.push(done.length);
    const postAndWait = (): void => {
      w.post();
      const end = Date.now() + 10_000;
      while (w.state === "pending") {
        if (Date.now() > end) throw new Error("prepared write stuck");
        a.progress();
      }
    };
    postAndWait();
    expect(batches).toEqual([]);
    a.on("prepared", onDone);
    postAndWait();
    postAndWait();
    expect(batches).toEqual([1, 1]);
    a.off("prepared", onDone);
    postAndWait();
    expect(batches).toEqual([1, 1]);
  });

  it("is checked at prepare (a bad descriptor refused, nothing posted); its handles stay open until it closes", () => {
    const a = agent({ name: "prep-bad-a", progress: "caller" });
    const b = agent({ name: "prep-bad-b" });
    const src = a.registerMemory(new Uint8Array(4096));
    const ep = a.connect(b.address);
    const remote = ep.importRemote(b.registerMemory(new Uint8Array(4096)).remoteKey());
    expect(() => a.prepare("write", ep, src, remote, new Float64Array([0, 1, 4096]))).toThrow(
      expect.objectContaining({ code: "ERR_OUT_OF_BOUNDS" }),
    );
    expect(() =>
      a.prepare("copy" as "write", ep, src, remote, new Float64Array([0, 0, 8])),
    ).toThrow(expect.objectContaining({ code: "ERR_INVALID_ARGUMENT" }));
    const w = a.prepare("write", ep, src, remote, new Float64Array([0, 0, 4096]));
    src.close(); // held by the prepared transfer: released when it closes
    expect(src.closed).toBe(true);
    w.close();
    w.close();
    expect(() => w.post()).toThrow(expect.objectContaining({ code: "ERR_CLOSED" }));
  });

  it("a prepared transfer in flight when its agent closes is lost, not left to crash", () => {
    const a = new Agent({ name: "prep-close", transports: "shm,self", progress: "caller" });
    const b = agent({ name: "prep-close-b" });
    const ep = a.connect(b.address);
    const w = a.prepare(
      "write",
      ep,
      a.registerMemory(new Uint8Array(SIZE)),
      ep.importRemote(b.registerMemory(new Uint8Array(SIZE)).remoteKey()),
      new Float64Array([0, 0, SIZE]),
    );
    w.post();
    a.close();
    expect(() => w.post()).toThrow(expect.objectContaining({ code: "ERR_CLOSED" }));
  });
});
