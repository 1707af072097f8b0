/**
 * Prometheus text exposition (format 0.0.4) with a registry small enough to
 * write by hand: counters, gauges and fixed-bucket histograms, with labels.
 * `SidecarMetrics` implements the sidecar's `TransferMetrics`
 * (src/sidecar/metrics.ts); the metric names are listed in docs/api.md.
 *
 * Label values can come from the network (failure reasons): each metric keeps
 * at most `maxSeries` label sets and folds the rest into `_other`, so a
 * misbehaving peer cannot grow the registry without bound.
 */
import type { TransferMetrics } from "../sidecar/metrics.js";

import { serveGets, type HttpServer } from "./http.js";

type Labels = Readonly<Record<string, string>>;

const OVERFLOW = "_other";

function escapeLabel(v: string): string {
  return v.replace(/\\/g, "\\\\").replace(/\n/g, "\\n").replace(/"/g, '\\"');
}

function escapeHelp(v: string): string {
  return v.replace(/\\/g, "\\\\").replace(/\n/g, "\\n");
}

function formatValue(v: number): string {
  if (Number.isNaN(v)) return "NaN";
  if (v === Infinity) return "+Inf";
  if (v === -Infinity) return "-Inf";
  return String(v);
}

abstract class Metric<S> {
  private readonly series = new Map<string, { labels: Labels; state: S }>();

  constructor(
    readonly name: string,
    readonly help: string,
    readonly labelNames: readonly string[],
    private readonly maxSeries: number,
  ) {
    if (!/^[a-zA-Z_:][a-zA-Z0-9_:]*$/.test(name)) throw new Error(`bad metric name '${name}'`);
  }

  abstract readonly type: "counter" | "gauge" | "histogram";
  protected abstract fresh(): S;
  protected abstract lines(name: string, labels: Labels, state: S): string[];

  protected get(labels: Labels): S {
    const values = this.labelNames.map((n) => labels[n] ?? "");
    let key = values.join("\u0000");
    let entry = this.series.get(key);
    if (entry === undefined) {
      if (this.series.size >= this.maxSeries && this.labelNames.length > 0) {
        const folded = Object.fromEntries(this.labelNames.map((n) => [n, OVERFLOW]));
        key = this.labelNames.map(() => OVERFLOW).join("\u0000");
        entry = this.series.get(key);
        if (entry === undefined)
          this.series.set(key, (entry = { labels: folded, state: this.fresh() }));
        return entry.state;
      }
      const clean = Object.fromEntries(this.labelNames.map((n, i) => [n, values[i]!]));
      this.series.set(key, (entry = { labels: clean, state: this.fresh() }));
    }
    return entry.state;
  }

  expose(): string {
    const out = [
      `# HELP ${this.name} ${escapeHelp(this.help)}`,
      `# TYPE ${this.name} ${this.type}`,
    ];
    for (const { labels, state } of this.series.values())
      out.push(...this.lines(this.name, labels, state));
    return out.join("\n");
  }
}

function labelText(labels: Labels, extra?: [string, string]): string {
  const parts = Object.entries(labels).map(([k, v]) => `${k}="${escapeLabel(v)}"`);
  if (extra !== undefined) parts.push(`${extra[0]}="${escapeLabel(extra[1])}"`);
  return parts.length === 0 ? "" : `{${parts.join(",")}}`;
}

export class Counter extends Metric<{ v: number }> {
  readonly type = "counter";
  protected fresh() {
    return { v: 0 };
  }
  inc(labels: Labels = {}, by = 1): void {
    if (!(by >= 0)) throw new RangeError(`counter ${this.name} can only go up (by ${by})`);
    this.get(labels).v += by;
  }
  value(labels: Labels = {}): number {
    return this.get(labels).v;
  }
  protected lines(name: string, labels: Labels, s: { v: number }) {
    return [`${name}${labelText(labels)} ${formatValue(s.v)}`];
  }
}

export class Gauge extends Metric<{ v: number }> {
  readonly type = "gauge";
  protected fresh() {
    return { v: 0 };
  }
  set(labels: Labels, v: number): void {
    this.get(labels).v = v;
  }
  value(labels: Labels = {}): number {
    return this.get(labels).v;
  }
  protected lines(name: string, labels: Labels, s: { v: number }) {
    return [`${name}${labelText(labels)} ${formatValue(s.v)}`];
  }
}

interface HistogramState {
  readonly counts: number[];
  sum: number;
  count: number;
}

export class Histogram extends Metric<HistogramState> {
  readonly type = "histogram";
  constructor(
    name: string,
    help: string,
    labelNames: readonly string[],
    maxSeries: number,
    /** Upper bounds, increasing; +Inf is implied. */
    readonly buckets: readonly number[],
  ) {
    super(name, help, labelNames, maxSeries);
    for (let i = 1; i < buckets.length; i++)
      if (!(buckets[i]! > buckets[i - 1]!)) throw new Error(`buckets of ${name} must increase`);
  }
  protected fresh(): HistogramState {
    return { counts: new Array<number>(this.buckets.length).fill(0), sum: 0, count: 0 };
  }
  observe(labels: Labels, v: number): void {
    const s = this.get(labels);
    // Counts are per bucket here and made cumulative when exposed.
    const i = this.buckets.findIndex((b) => v <= b);
    if (i >= 0) s.counts[i]!++;
    s.sum += v;
    s.count++;
  }
  snapshot(labels: Labels = {}): { count: number; sum: number } {
    const s = this.get(labels);
    return { count: s.count, sum: s.sum };
  }
  protected lines(name: string, labels: Labels, s: HistogramState) {
    const out: string[] = [];
    let cum = 0;
    this.buckets.forEach((b, i) => {
      cum += s.counts[i]!;
      out.push(`${name}_bucket${labelText(labels, ["le", formatValue(b)])} ${cum}`);
    });
    out.push(`${name}_bucket${labelText(labels, ["le", "+Inf"])} ${s.count}`);
    out.push(`${name}_sum${labelText(labels)} ${formatValue(s.sum)}`);
    out.push(`${name}_count${labelText(labels)} ${s.count}`);
    return out;
  }
}

export interface MetricOptions {
  readonly labelNames?: readonly string[];
  /** Distinct label sets kept; the rest are folded into "_other". Default 64. */
  readonly maxSeries?: number;
}

export class MetricsRegistry {
  private readonly metrics = new Map<string, { readonly name: string; expose(): string }>();
  private readonly collectors: (() => void)[] = [];

  counter(name: string, help: string, opts: MetricOptions = {}): Counter {
    return this.add(new Counter(name, help, opts.labelNames ?? [], opts.maxSeries ?? 64));
  }
  gauge(name: string, help: string, opts: MetricOptions = {}): Gauge {
    return this.add(new Gauge(name, help, opts.labelNames ?? [], opts.maxSeries ?? 64));
  }
  histogram(
    name: string,
    help: string,
    buckets: readonly number[],
    opts: MetricOptions = {},
  ): Histogram {
    return this.add(
      new Histogram(name, help, opts.labelNames ?? [], opts.maxSeries ?? 64, buckets),
    );
  }
  /** Runs before each exposition (for gauges read from elsewhere, e.g. the event log). */
  onCollect(fn: () => void): void {
    this.collectors.push(fn);
  }
  /** The whole registry in Prometheus text format. */
  expose(): string {
    for (const c of this.collectors) c();
    return [...this.metrics.values()].map((m) => m.expose()).join("\n") + "\n";
  }
  private add<M extends { readonly name: string; expose(): string }>(m: M): M {
    if (this.metrics.has(m.name)) throw new Error(`metric ${m.name} registered twice`);
    this.metrics.set(m.name, m);
    return m;
  }
}

/** Seconds: 1 ms .. 30 s, for "prefill done -> KV ready". */
export const LATENCY_BUCKETS_S = [
  0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
];
/** Bytes per transfer: 64 KiB .. 16 GiB, by 4x. */
export const SIZE_BUCKETS_BYTES = Array.from({ length: 10 }, (_, i) => 65536 * 4 ** i);

/**
 * What the sidecar reports. Construct one per sidecar, call the methods as
 * things happen, and serve `registry` with `startMetricsServer`. The sidecar
 * itself sees it only as `TransferMetrics`.
 */
export class SidecarMetrics implements TransferMetrics {
  readonly registry: MetricsRegistry;
  private readonly latency: Histogram;
  private readonly sizes: Histogram;
  private readonly ready: Counter;
  private readonly bytes: Counter;
  private readonly descriptors: Counter;
  private readonly failures: Counter;
  private readonly ended: Counter;
  private readonly leaseExpiries: Counter;
  private readonly queueDepth: Gauge;
  private readonly events: Counter;

  constructor(registry = new MetricsRegistry()) {
    this.registry = registry;
    const mode = { labelNames: ["mode"], maxSeries: 8 };
    this.latency = registry.histogram(
      "kvxfer_transfer_latency_seconds",
      "Prefill done to KV ready on the decode side, by transfer mode.",
      LATENCY_BUCKETS_S,
      mode,
    );
    this.sizes = registry.histogram(
      "kvxfer_transfer_size_bytes",
      "Bytes per completed transfer, by mode.",
      SIZE_BUCKETS_BYTES,
      mode,
    );
    this.ready = registry.counter(
      "kvxfer_transfers_ready_total",
      "Transfers whose KV is ready, by mode.",
      mode,
    );
    this.bytes = registry.counter("kvxfer_transfer_bytes_total", "KV bytes moved, by mode.", mode);
    this.descriptors = registry.counter(
      "kvxfer_transfer_descriptors_total",
      "Copy descriptors posted, by mode.",
      mode,
    );
    this.failures = registry.counter(
      "kvxfer_transfer_failures_total",
      "Transfers that failed, by reason.",
      { labelNames: ["reason"], maxSeries: 32 },
    );
    this.ended = registry.counter(
      "kvxfer_transfers_ended_total",
      "Transfers that reached a terminal state, by state and side.",
      { labelNames: ["state", "side"], maxSeries: 16 },
    );
    this.leaseExpiries = registry.counter(
      "kvxfer_lease_expiries_total",
      "Block leases on P that ran out before D confirmed.",
    );
    this.queueDepth = registry.gauge("kvxfer_queue_depth", "Entries waiting in each queue.", {
      labelNames: ["queue"],
      maxSeries: 32,
    });
    this.events = registry.counter(
      "kvxfer_events_total",
      "Events appended to the event log, by kind.",
      {
        labelNames: ["kind"],
        maxSeries: 16,
      },
    );
  }

  /** D: a transfer's KV is ready. `latencyMs` is prefill done -> ready. */
  transferReady(mode: string, latencyMs: number, bytes: number, descriptors: number): void {
    const labels = { mode };
    this.latency.observe(labels, latencyMs / 1000);
    this.sizes.observe(labels, bytes);
    this.ready.inc(labels);
    this.bytes.inc(labels, bytes);
    this.descriptors.inc(labels, descriptors);
  }

  /** Either side: a transfer failed (reason: a FailureReason name or an error code). */
  transferFailed(reason: string): void {
    this.failures.inc({ reason });
  }

  /** Either side: a transfer reached a terminal state (KV_READY, FAILED, EXPIRED, ABORTED, RELEASED). */
  transferEnded(state: string, side: string): void {
    this.ended.inc({ state, side });
  }

  /** P: a lease ran out and its blocks went back to the engine. */
  leaseExpired(): void {
    this.leaseExpiries.inc();
  }

  /** Depth of a named queue (e.g. "pending_writes", "waiting_registrations", "lease_table"). */
  setQueueDepth(name: string, n: number): void {
    this.queueDepth.set({ queue: name }, n);
  }

  /** Reports the event log's size and watcher count at each scrape, and counts its events by kind. */
  watchEventLog(log: {
    readonly size: number;
    readonly subscriberCount: number;
    readonly waiterTotal: number;
  }): void {
    const size = this.registry.gauge(
      "kvxfer_event_log_events",
      "Events retained in the event log.",
    );
    const watchers = this.registry.gauge(
      "kvxfer_event_watchers",
      "Open event subscriptions (WatchEvents streams).",
    );
    const waiters = this.registry.gauge("kvxfer_event_waiters", "AwaitTransfer calls waiting.");
    this.registry.onCollect(() => {
      size.set({}, log.size);
      watchers.set({}, log.subscriberCount);
      waiters.set({}, log.waiterTotal);
    });
  }

  /** Counts an appended event (call next to EventLog.append). */
  eventAppended(kind: string): void {
    this.events.inc({ kind });
  }
}

export type MetricsServer = HttpServer;

/**
 * Serves `GET /metrics` in Prometheus text format on `address` ("host:port", default
 * "127.0.0.1:0"), and with `ready`, `GET /ready`: 200 `SERVING` or 503 `NOT_SERVING`, the gRPC
 * health's answer in plain HTTP, for probes that cannot speak gRPC over TLS (the kubelet's).
 */
export function startMetricsServer(opts: {
  readonly registry: MetricsRegistry;
  readonly address?: string;
  readonly ready?: () => boolean;
}): Promise<MetricsServer> {
  const ready = opts.ready;
  return serveGets("metrics", opts.address ?? "127.0.0.1:0", {
    "/metrics": {
      contentType: "text/plain; version=0.0.4; charset=utf-8",
      body: () => opts.registry.expose(),
    },
    ...(ready !== undefined
      ? {
          "/ready": {
            contentType: "text/plain",
            status: () => (ready() ? 200 : 503),
            body: () => (ready() ? "SERVING\n" : "NOT_SERVING\n"),
          },
        }
      : {}),
  });
}
