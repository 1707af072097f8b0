/**
 * kvxfer's side of the peer benchmark: the same JSON-lines protocol as
 * bench/peers/harness.py (NIXL and Mooncake), over the native addon, so that
 * bench/peers.ts runs the same work against all three systems.
 *
 * Times are CLOCK_MONOTONIC nanoseconds (`process.hrtime.bigint()`), the clock
 * Python's `time.monotonic_ns()` reads too.
 */

import { KvxferError } from "../../src/errors.js";
import {
  Agent,
  type Endpoint,
  type Notification,
  type PreparedTransfer,
  type Region,
  type RemoteRegion,
  describeUcx,
} from "../../src/native/index.js";
import { serveJsonLines } from "../native/serve.js";

interface Request {
  id: number;
  op: string;
  [key: string]: unknown;
}

const now = (): number => Number(process.hrtime.bigint());

let agent: Agent | undefined;
let region: Region | undefined;
let ep: Endpoint | undefined;
let remote: RemoteRegion | undefined;
/** Notifications not yet claimed, with their arrival times. */
let notes: { data: string; t: number }[] = [];
let onNote: (() => void) | undefined;

interface FlightOutcome {
  ok: boolean;
  ms: number;
  error?: string;
}

function need<T>(v: T | undefined, what: string): T {
  if (v === undefined) throw new KvxferError("ERR_INVALID_ARGUMENT", `peer: ${what} not set up`);
  return v;
}

function onNotifications(batch: Notification[]): void {
  const t = now();
  for (const n of batch) notes.push({ data: n.data.toString(), t });
  onNote?.();
}

/** Resolves once `done()` holds after a notification batch, or rejects at the deadline. */
function waitFor(done: () => boolean, timeoutMs: number, what: string): Promise<void> {
  if (done()) return Promise.resolve();
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      onNote = undefined;
      reject(new KvxferError("ERR_TIMEOUT", `${what}: not done within ${timeoutMs} ms`));
    }, timeoutMs);
    onNote = () => {
      if (!done()) return;
      clearTimeout(timer);
      onNote = undefined;
      resolve();
    };
  });
}

function descsFrom(s: unknown): Float64Array {
  const raw = Buffer.from(String(s), "base64");
  const copy = new Uint8Array(raw.length);
  copy.set(raw);
  return new Float64Array(copy.buffer, 0, Math.floor(copy.length / 8));
}

/**
 * Caller-progress agents (progress: "caller") move only while progress() is called. As NIXL's
 * harness does: the measuring loops below call it themselves; a request that awaits something
 * (a KV write, notifications) is pumped while it waits (progress() on every turn of the event
 * loop); and over TCP, where a put or get completes only when the target's UCX progresses too,
 * the idle target is pumped all the time (NIXL's idleProgress). Otherwise an idle polling agent
 * spins nothing.
 */
let pumping = false; // caller-progress agent
let alwaysPump = false;
let waiting = 0;
let pumpScheduled = false;
/** A measuring loop counts what progress() settles: the pump must not take it meanwhile. */
let pumpPaused = false;
function pumpTurn(): void {
  pumpScheduled = false;
  const a = agent;
  if (a === undefined || a.closed || pumpPaused || (!alwaysPump && waiting === 0)) return;
  a.progress();
  pumpScheduled = true;
  setImmediate(pumpTurn);
}
function wakePump(): void {
  if (pumping && !pumpScheduled) {
    pumpScheduled = true;
    setImmediate(pumpTurn);
  }
}
/** Runs `f`, progressing a caller-progress agent until it settles. */
async function pumped<T>(f: () => Promise<T>): Promise<T> {
  waiting++;
  wakePump();
  try {
    return await f();
  } finally {
    waiting--;
  }
}

/** What a bandwidth loop moves, and how many `size` slots (at most `window`) fit both regions. */
function bwSetup(
  size: number,
  window: number,
): { a: Agent; r: Region; e: Endpoint; rem: RemoteRegion; slots: number } {
  const a = need(agent, "agent");
  const r = need(region, "region");
  const e = need(ep, "endpoint");
  const rem = need(remote, "remote region");
  const slots = Math.max(1, Math.min(window, Math.floor(Math.min(r.length, rem.length) / size)));
  return { a, r, e, rem, slots };
}

/** One prepared transfer per bandwidth slot: slot i moves `size` bytes at offset i * size. */
function preparedSlots(
  kind: "write" | "read",
  size: number,
  window: number,
): { a: Agent; xfers: PreparedTransfer[] } {
  const { a, r, e, rem, slots } = bwSetup(size, window);
  const xfers = Array.from({ length: slots }, (_, i) =>
    a.prepare(kind, e, r, rem, new Float64Array([i * size, i * size, size])),
  );
  return { a, xfers };
}

/** A bandwidth loop's figures: `iters` requests of `size` bytes since `t0` (ns) and `c0`. */
function bwResult(
  iters: number,
  size: number,
  t0: number,
  c0: NodeJS.CpuUsage,
): Record<string, number> {
  const seconds = (now() - t0) / 1e9;
  const cpu = process.cpuUsage(c0);
  return {
    seconds,
    n: iters,
    gbps: (iters * size) / seconds / 1e9,
    msgRate: iters / seconds,
    // The initiator's CPU (every thread), a figure other load on the machine barely moves.
    cpuMs: (cpu.user + cpu.system) / 1e3,
  };
}

/**
 * Caller-progress bandwidth, as NIXL's harness runs it: one prepared transfer per slot (checked
 * once, Agent.prepare), posted, then progress() in a loop; each transfer found done is posted
 * again at once, on the same thread, with no promise.
 */
async function bandwidthPolling(
  kind: "write" | "read",
  size: number,
  iters: number,
  window: number,
  timeoutMs: number,
  maxMs: number,
): Promise<unknown> {
  const { a, xfers } = preparedSlots(kind, size, window);
  let started = 0;
  let done = 0;
  const c0 = process.cpuUsage();
  const t0 = now();
  pumpPaused = true;
  try {
    for (const x of xfers) {
      if (started >= iters) break;
      x.post();
      started++;
    }
    const busy = new Set(xfers.slice(0, started));
    let turns = 0;
    while (done < iters) {
      if (a.progress() > 0) {
        for (const x of busy) {
          if (x.state !== "done") continue; // a failure throws here
          done++;
          if (started < iters && now() - t0 > maxMs * 1e6) iters = started;
          if (started < iters) {
            x.post();
            started++;
          } else {
            busy.delete(x);
          }
        }
      }
      if (++turns % 65536 === 0) {
        if (now() - t0 > timeoutMs * 1e6)
          throw new KvxferError("ERR_TIMEOUT", `bw: ${done}/${iters} within ${timeoutMs} ms`);
        await new Promise((res) => setImmediate(res));
      }
    }
  } finally {
    pumpPaused = false;
    for (const x of xfers) x.close();
    wakePump();
  }
  return bwResult(iters, size, t0, c0);
}

/**
 * Prepared-transfer bandwidth with the progress thread, as NIXL's harness reposts prepared
 * handles: one prepared transfer per slot, posted; each one an Agent `prepared` event returns
 * done is posted again at once, with no promise (one event per delivered batch).
 */
async function bandwidthPrepared(
  kind: "write" | "read",
  size: number,
  iters: number,
  window: number,
  timeoutMs: number,
  maxMs: number,
): Promise<unknown> {
  const { a, xfers } = preparedSlots(kind, size, window);
  let started = 0;
  let done = 0;
  const c0 = process.cpuUsage();
  const t0 = now();
  let onDone: ((batch: PreparedTransfer[], failed: PreparedTransfer[]) => void) | undefined;
  let batches = 0; // events: one wake-up each
  const inline0 = a.inlinePosts;
  try {
    await new Promise<void>((resolve, reject) => {
      const timer = setTimeout(
        () => reject(new KvxferError("ERR_TIMEOUT", `bw: ${done}/${iters} within ${timeoutMs} ms`)),
        timeoutMs,
      );
      onDone = (batch, failed): void => {
        batches++;
        try {
          // A failure's state throws it.
          for (const x of failed) if (x.state !== "done") throw new Error("bw: a post was lost");
          for (const x of batch) {
            done++;
            // Time is up: post nothing more, count what was done.
            if (started < iters && now() - t0 > maxMs * 1e6) iters = started;
            if (started < iters) {
              x.post();
              started++;
            }
          }
        } catch (err) {
          clearTimeout(timer);
          reject(err as Error);
          return;
        }
        if (done === iters) {
          clearTimeout(timer);
          resolve();
        }
      };
      a.on("prepared", onDone);
      for (const x of xfers) {
        if (started >= iters) break;
        x.post();
        started++;
      }
    });
  } finally {
    if (onDone !== undefined) a.off("prepared", onDone);
    for (const x of xfers) x.close();
  }
  return { ...bwResult(iters, size, t0, c0), batches, inlinePosts: a.inlinePosts - inline0 };
}

/**
 * `iters` requests of one descriptor of `size` bytes, `window` in flight. The requests that
 * completion batches free are posted again together, with one transferMany() call (one hand-off
 * to the progress thread), not one call each.
 */
async function bandwidth(
  kind: "write" | "read",
  size: number,
  iters: number,
  window: number,
  timeoutMs: number,
  maxMs: number,
): Promise<unknown> {
  const { a, r, e, rem, slots } = bwSetup(size, window);
  const lists = Array.from(
    { length: slots },
    (_, i) => new Float64Array([i * size, i * size, size]),
  );
  let started = 0;
  let done = 0;
  const c0 = process.cpuUsage();
  const t0 = now();
  await new Promise<void>((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new KvxferError("ERR_TIMEOUT", `bw: ${done}/${iters} within ${timeoutMs} ms`)),
      timeoutMs,
    );
    let queued: number[] = [];
    const flush = (): void => {
      const slotsNow = queued;
      queued = [];
      const entries = slotsNow.map((slot) => ({
        kind,
        endpoint: e,
        local: r,
        remote: rem,
        descriptors: lists[slot % slots]!,
      }));
      started += entries.length;
      a.transferMany(entries).forEach((p, i) => {
        p.then(() => {
          done++;
          // Time is up: post nothing more, count what was done.
          if (started < iters && now() - t0 > maxMs * 1e6) iters = started;
          if (done === iters) {
            clearTimeout(timer);
            resolve();
          } else if (started + queued.length < iters) launch(slotsNow[i]!);
        }, reject);
      });
    };
    const launch = (slot: number): void => {
      if (queued.length === 0) queueMicrotask(flush);
      queued.push(slot);
    };
    for (let i = 0; i < Math.min(window, iters); i++) launch(i);
  });
  return bwResult(iters, size, t0, c0);
}

/**
 * `count` transfers of `size` bytes at once (transfer i at offset i * size on both sides), each
 * its own READ or WRITE: when each ended and how, by the deadline (`bench peers --faults`). A
 * transfer still pending at the deadline is reported so, not waited for.
 */
async function flight(
  kind: "read" | "write",
  size: number,
  count: number,
  timeoutMs: number,
): Promise<{ transfers: FlightOutcome[] }> {
  const a = need(agent, "agent");
  const e = need(ep, "endpoint");
  const r = need(region, "region");
  const rr = need(remote, "remote region");
  if (count * size > r.length) throw new Error(`flight: ${count} x ${size} B exceeds the buffer`);
  const t0 = performance.now();
  const out: (FlightOutcome | undefined)[] = new Array(count).fill(undefined);
  const posts = Array.from({ length: count }, (_, i) => {
    const d = new Float64Array([i * size, i * size, size]);
    const op = kind === "read" ? a.read(e, r, rr, d) : a.write(e, r, rr, d);
    return op.then(
      () => (out[i] = { ok: true, ms: performance.now() - t0 }),
      (err: unknown) =>
        (out[i] = {
          ok: false,
          ms: performance.now() - t0,
          error: String((err as Error).message ?? err),
        }),
    );
  });
  await Promise.race([
    Promise.all(posts),
    new Promise((resolve) => setTimeout(resolve, timeoutMs).unref()),
  ]);
  return {
    transfers: out.map(
      (o) => o ?? { ok: false, ms: performance.now() - t0, error: "pending at the deadline" },
    ),
  };
}

async function handle(req: Request): Promise<unknown> {
  const timeoutMs = Number(req.timeoutMs ?? 30_000);
  switch (req.op) {
    case "init": {
      const transport = String(req.transport ?? "shm");
      const opts: ConstructorParameters<typeof Agent>[0] = {
        name: String(req.name ?? `peer-${process.pid}`),
        transports: transport === "tcp" ? "tcp" : "shm,self",
        busyPoll: req.busyPoll === true,
      };
      if (typeof req.netDevice === "string") opts.netDevices = req.netDevice;
      if (typeof req.spinUs === "number") opts.spinUs = req.spinUs;
      if (req.progress === "caller") opts.progress = "caller";
      if (req.inlinePost === false) opts.inlinePost = false;
      if (typeof req.loopWake === "boolean") opts.loopWake = req.loopWake;
      agent = new Agent(opts);
      agent.on("notifications", onNotifications);
      if (opts.progress === "caller") {
        pumping = true;
        alwaysPump = req.idleProgress === true;
        wakePump();
      }
      return {
        system: "kvxfer",
        version: `kvxfer ${process.env.npm_package_version ?? "0.1.0"} (native addon)`,
        ucx: `${describeUcx()}${process.env.KVXFER_ADDON !== undefined ? ` (addon ${process.env.KVXFER_ADDON})` : ""}`,
        busyPoll: opts.busyPoll,
        progress: opts.progress ?? "thread",
        inlinePost: opts.inlinePost ?? true,
        loopWake: opts.loopWake ?? false,
        spinUs: opts.spinUs ?? 0,
      };
    }
    case "alloc": {
      const a = need(agent, "agent");
      // Registered host memory: a Buffer the application owns (zero-filled, so every page is touched).
      region = a.registerMemory(Buffer.alloc(Number(req.size)));
      return {
        peerInfo: {
          address: a.address.toString("base64"),
          key: region.remoteKey().toString("base64"),
          size: region.length,
        },
      };
    }
    case "connect": {
      const info = req.peerInfo as { address: string; key: string };
      ep = need(agent, "agent").connect(
        Buffer.from(info.address, "base64"),
        req.errorMode === "peer" ? { errorMode: "peer" } : {},
      );
      remote = ep.importRemote(Buffer.from(info.key, "base64"));
      return { remote: ep.id };
    }
    case "flight":
      return flight(
        req.kind === "read" ? "read" : "write",
        Number(req.size),
        Number(req.count),
        timeoutMs,
      );
    case "bw":
      return (pumping ? bandwidthPolling : req.prepared === true ? bandwidthPrepared : bandwidth)(
        req.kind === "read" ? "read" : "write",
        Number(req.size),
        Number(req.iters),
        Number(req.window),
        Number(req.timeoutMs ?? 120_000),
        Number(req.maxMs ?? 1e9),
      );
    case "kv": {
      const a = need(agent, "agent");
      const d = descsFrom(req.descs);
      const tPost = now();
      const p = a.write(
        need(ep, "endpoint"),
        need(region, "region"),
        need(remote, "remote region"),
        d,
        Buffer.from(String(req.tag)),
      );
      const tReturn = now();
      await pumped(() => p);
      return { tPostNs: tPost, tReturnNs: tReturn, tDoneNs: now() };
    }
    case "descpost": {
      const a = need(agent, "agent");
      const r = need(region, "region");
      const rem = need(remote, "remote region");
      const count = Number(req.count);
      const size = Number(req.size);
      const stride = Number(req.stride);
      const slots = Math.floor(Math.min(r.length, rem.length) / stride);
      const t0 = now();
      const d = new Float64Array(count * 3);
      for (let i = 0; i < count; i++) {
        const off = (i % slots) * stride;
        d[3 * i] = off;
        d[3 * i + 1] = off;
        d[3 * i + 2] = size;
      }
      const t1 = now();
      const p = a.write(need(ep, "endpoint"), r, rem, d);
      const t2 = now();
      await pumped(() => p);
      const t3 = now();
      return {
        buildMs: (t1 - t0) / 1e6,
        prepMs: 0,
        transferCallMs: (t2 - t1) / 1e6,
        postMs: (t2 - t1) / 1e6,
        completeMs: (t3 - t1) / 1e6,
      };
    }
    case "wait_notes": {
      const tags = new Set((req.tags as unknown[]).map(String));
      const seen: Record<string, number> = {};
      await pumped(() =>
        waitFor(
          () => {
            notes = notes.filter((n) => {
              if (!tags.has(n.data)) return true;
              seen[n.data] = n.t;
              return false;
            });
            return Object.keys(seen).length === tags.size;
          },
          timeoutMs,
          "notifications",
        ),
      );
      return { arrivals: seen };
    }
    case "ping": {
      // Round trips of a small notification, one in flight.
      const a = need(agent, "agent");
      const e = need(ep, "endpoint");
      const reps = Number(req.reps);
      const payload = Buffer.alloc(Number(req.bytes), "p");
      const t0 = now();
      if (pumping) {
        // Caller progress: send, then progress() until the answer is in, all on this thread.
        for (let i = 0; i < reps; i++) {
          void a.notify(e, payload);
          let turns = 0;
          while (notes.length === 0) {
            a.progress();
            if (++turns % 65536 === 0 && now() - t0 > timeoutMs * 1e6)
              throw new KvxferError("ERR_TIMEOUT", `ping ${i}: no answer within ${timeoutMs} ms`);
          }
          notes.shift();
        }
        const seconds = (now() - t0) / 1e9;
        return { seconds, n: reps, rate: reps / seconds };
      }
      for (let i = 0; i < reps; i++) {
        const answered = waitFor(
          () => {
            if (notes.length === 0) return false;
            notes.shift();
            return true;
          },
          timeoutMs,
          "ping",
        );
        await a.notify(e, payload);
        await answered;
      }
      const seconds = (now() - t0) / 1e9;
      return { seconds, n: reps, rate: reps / seconds, loopTurns: a.loopTurns };
    }
    case "pong": {
      const a = need(agent, "agent");
      const e = need(ep, "endpoint");
      const reps = Number(req.reps);
      let answered = 0;
      await pumped(() =>
        waitFor(
          () => {
            for (const n of notes.splice(0)) {
              void a.notify(e, Buffer.from(n.data));
              answered++;
            }
            return answered >= reps;
          },
          timeoutMs,
          "pong",
        ),
      );
      return { n: answered };
    }
    case "exit":
      agent?.close();
      setImmediate(() => process.exit(0));
      return {};
    default:
      throw new KvxferError("ERR_INVALID_ARGUMENT", `peer: unknown op '${req.op}'`);
  }
}

serveJsonLines<Request>(handle, () => agent?.close());
