// Event delivery: latency from EventLog.append (D's sidecar marks a transfer
// ready) to a gRPC watcher having the event, p50/p99, with 1 and 64 watchers;
// and events per second one server delivers. Server and watchers share this
// process and its one event loop, over loopback, so the figures include the
// watchers' own decoding. Next to them, measured in the same run: a unary
// grpc.health.v1 Check round trip on the same server, the floor for any
// request-answer notification over gRPC here.
// Run: `node dist/bench/events.js [--json] [--watchers 1,64] [--events N] [--burst N]`.
import { pathToFileURL } from "node:url";
import { performance } from "node:perf_hooks";
import { SidecarClient, startApiServer } from "../src/api/index.js";
import { EventLog, type SidecarStatus, type SidecarView } from "../src/sidecar/index.js";

export interface EventsBenchOptions {
  /** Watcher counts to run; default [1, 64]. */
  readonly watchers?: readonly number[];
  /** Paced events for latency (one per ~1 ms); default 2 000. */
  readonly latencyEvents?: number;
  /** Events appended at once for throughput; default 50 000. */
  readonly burstEvents?: number;
}

export interface Percentiles {
  readonly p50Us: number;
  readonly p99Us: number;
  readonly maxUs: number;
  readonly samples: number;
}

export interface EventsBenchResult {
  readonly watchers: number;
  /** append -> one watcher has it, over every (event, watcher) pair. */
  readonly latency: Percentiles;
  /** append -> the last of the watchers has it, per event. */
  readonly allWatchers: Percentiles;
  /** A burst of events appended back to back: events per second every watcher received. */
  readonly eventsPerSec: number;
  /** The same times the number of watchers: messages per second the server sent. */
  readonly deliveriesPerSec: number;
  /** Reference: unary health Check round trip on the same server, same run. */
  readonly unaryRtt: Percentiles;
}

function percentiles(samplesMs: number[]): Percentiles {
  const s = [...samplesMs].sort((a, b) => a - b);
  const at = (q: number) =>
    s.length === 0 ? NaN : s[Math.min(s.length - 1, Math.floor(q * s.length))]!;
  return {
    p50Us: Math.round(at(0.5) * 1000),
    p99Us: Math.round(at(0.99) * 1000),
    maxUs: Math.round((s[s.length - 1] ?? NaN) * 1000),
    samples: s.length,
  };
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** The least a SidecarView must answer; the bench only exercises events. */
const benchView: SidecarView = {
  status: (): SidecarStatus => ({
    engineId: "bench-decode",
    epoch: 1n,
    role: "decode",
    mode: "auto",
    tpSize: 1,
    layoutSummary: "",
    startedMs: Date.now(),
    draining: false,
    ucx: { version: "1.22.0", transports: ["cma/memory", "tcp/lo"], memoryTypes: ["host"] },
    peers: [],
    transfersByState: {},
    bytesMoved: 0,
    transfersMoved: 0,
    leaseTableSize: 0,
    lastErrors: [],
  }),
  transfers: () => [],
};

async function runOne(
  watchers: number,
  latencyEvents: number,
  burstEvents: number,
): Promise<EventsBenchResult> {
  const events = new EventLog({ capacity: Math.max(100_000, latencyEvents + burstEvents + 1000) });
  const server = await startApiServer({
    view: benchView,
    events,
    watchBufferLimit: burstEvents + 1,
  });
  const clients: SidecarClient[] = [];
  try {
    const appendedAt = new Map<number, number>();
    const perEvent = new Map<number, number>(); // seq -> watchers that have it
    const lastArrival = new Map<number, number>();
    const samples: number[] = [];
    const received = new Array<number>(watchers).fill(0);
    let measuring = true;
    const append = (id: string) =>
      events.append({
        kind: "KV_READY",
        timeMs: Date.now(),
        transferId: id,
        peer: "bench-prefill",
        side: "decode",
        reason: "",
        bytes: 1 << 20,
        mode: "push",
      });
    const watches = [];
    for (let w = 0; w < watchers; w++) {
      // One channel per watcher, as separate routers would have.
      const c = new SidecarClient(server.address);
      clients.push(c);
      await c.connect(5_000);
      watches.push(
        c.watch({ liveOnly: true }, (ev) => {
          received[w]!++;
          if (!measuring) return;
          const now = performance.now();
          const t0 = appendedAt.get(ev.seq);
          if (t0 === undefined) return;
          samples.push(now - t0);
          const n = (perEvent.get(ev.seq) ?? 0) + 1;
          perEvent.set(ev.seq, n);
          if (n === watchers) lastArrival.set(ev.seq, now - t0);
        }),
      );
    }
    const deadline = Date.now() + 10_000;
    while (server.watchers < watchers) {
      if (Date.now() > deadline) throw new Error("watchers did not open within 10 s");
      await sleep(5);
    }
    await sleep(50);

    // Warm-up, then paced events: one at a time, so each is measured unloaded.
    for (let i = 0; i < 200; i++) {
      append(`warm-${i}`);
      await sleep(1);
    }
    for (let i = 0; i < latencyEvents; i++) {
      const t0 = performance.now();
      const ev = append(`lat-${i}`);
      appendedAt.set(ev.seq, t0);
      await sleep(1);
    }
    const settle = Date.now() + 10_000;
    while (lastArrival.size < latencyEvents && Date.now() < settle) await sleep(5);
    measuring = false;

    // Unary reference on the same server and channel.
    const rtt: number[] = [];
    for (let i = 0; i < 500; i++) {
      const t0 = performance.now();
      await clients[0]!.health();
      rtt.push(performance.now() - t0);
    }

    // Throughput: a burst, appended in chunks of 1000 per turn of the event loop.
    const base = received.map((n) => n);
    const t0 = performance.now();
    for (let i = 0; i < burstEvents; i += 1000) {
      for (let j = i; j < Math.min(burstEvents, i + 1000); j++) append(`burst-${j}`);
      await new Promise((r) => setImmediate(r));
    }
    const burstDeadline = Date.now() + 120_000;
    while (received.some((n, w) => n - base[w]! < burstEvents)) {
      if (Date.now() > burstDeadline) throw new Error("burst not delivered within 120 s");
      await sleep(1);
    }
    const seconds = (performance.now() - t0) / 1000;
    for (const w of watches) w.cancel();
    return {
      watchers,
      latency: percentiles(samples),
      allWatchers: percentiles([...lastArrival.values()]),
      eventsPerSec: Math.round(burstEvents / seconds),
      deliveriesPerSec: Math.round((burstEvents * watchers) / seconds),
      unaryRtt: percentiles(rtt),
    };
  } finally {
    for (const c of clients) c.close();
    await server.close(1_000);
    events.close();
  }
}

export async function runEventsBench(opts: EventsBenchOptions = {}): Promise<EventsBenchResult[]> {
  const out: EventsBenchResult[] = [];
  for (const w of opts.watchers ?? [1, 64])
    out.push(await runOne(w, opts.latencyEvents ?? 2_000, opts.burstEvents ?? 50_000));
  return out;
}

export function formatEventsBench(results: readonly EventsBenchResult[]): string {
  const head = [
    "watchers",
    "p50 us",
    "p99 us",
    "all-have-it p50 us",
    "all-have-it p99 us",
    "events/s",
    "deliveries/s",
    "unary RTT p50 us (ref)",
    "unary RTT p99 us (ref)",
  ];
  const rows = results.map((r) => [
    String(r.watchers),
    String(r.latency.p50Us),
    String(r.latency.p99Us),
    String(r.allWatchers.p50Us),
    String(r.allWatchers.p99Us),
    r.eventsPerSec.toLocaleString("en-US"),
    r.deliveriesPerSec.toLocaleString("en-US"),
    String(r.unaryRtt.p50Us),
    String(r.unaryRtt.p99Us),
  ]);
  const widths = head.map((h, i) => Math.max(h.length, ...rows.map((row) => row[i]!.length)));
  const line = (cells: string[]) =>
    cells
      .map((cell, i) => (i === 0 ? cell.padEnd(widths[i]!) : cell.padStart(widths[i]!)))
      .join("  ");
  return [line(head), ...rows.map(line)].join("\n");
}

function parseArgs(argv: readonly string[]): EventsBenchOptions & { json: boolean } {
  let json = false;
  let watchers: number[] | undefined;
  let latencyEvents: number | undefined;
  let burstEvents: number | undefined;
  const positive = (flag: string, v: string | undefined): number => {
    const n = Number(v);
    if (!Number.isInteger(n) || n < 1)
      throw new Error(`${flag} needs a positive integer, got '${v}'`);
    return n;
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    if (a === "--json") json = true;
    else if (a === "--watchers")
      watchers = (argv[++i] ?? "").split(",").map((v) => positive("--watchers", v));
    else if (a === "--events") latencyEvents = positive("--events", argv[++i]);
    else if (a === "--burst") burstEvents = positive("--burst", argv[++i]);
    else
      throw new Error(`unknown argument ${a} (use --json, --watchers 1,64, --events N, --burst N)`);
  }
  return {
    json,
    ...(watchers !== undefined ? { watchers } : {}),
    ...(latencyEvents !== undefined ? { latencyEvents } : {}),
    ...(burstEvents !== undefined ? { burstEvents } : {}),
  };
}

export async function main(argv: string[] = process.argv.slice(2)): Promise<void> {
  const opts = parseArgs(argv);
  const results = await runEventsBench(opts);
  if (opts.json)
    process.stdout.write(
      JSON.stringify({ bench: "events", node: process.version, results }, null, 2) + "\n",
    );
  else {
    process.stdout.write(formatEventsBench(results) + "\n");
    process.stdout.write(
      "  latency: EventLog.append -> watcher's callback (p50/p99 over every event and watcher; all-have-it: the last watcher)\n" +
        "  events/s: a burst appended back to back, until every watcher had all of it\n" +
        "  server and watchers share one process and event loop, over loopback\n",
    );
  }
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href)
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
