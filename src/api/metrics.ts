/**
 * The sidecar's Prometheus metrics, on prom-client's registry and text exposition (format
 * 0.0.4). `SidecarMetrics` implements the sidecar's `TransferMetrics` (src/sidecar/metrics.ts);
 * the metric names are listed in docs/api.md.
 *
 * Label values can come from the network (failure reasons): each metric keeps at most
 * `maxSeries` label sets and folds the rest into `_other`, so a misbehaving peer cannot grow the
 * registry without bound. prom-client has no such cap; `Series` adds it in front of it.
 */
import * as prom from "prom-client";

import type { TransferMetrics } from "../sidecar/metrics.js";

import { serveGets, type HttpServer } from "./http.js";

type Labels = Readonly<Record<string, string>>;

const OVERFLOW = "_other";

/** The label sets one metric has seen, at most `maxSeries`; any further set reads as `_other`. */
class Series {
  private readonly seen = new Set<string>();

  constructor(
    private readonly labelNames: readonly string[],
    private readonly maxSeries: number,
  ) {}

  labels(given: Labels): Record<string, string> {
    const values = this.labelNames.map((n) => given[n] ?? "");
    const key = values.join("\u0000");
    if (!this.seen.has(key)) {
      if (this.seen.size >= this.maxSeries && this.labelNames.length > 0)
        return Object.fromEntries(this.labelNames.map((n) => [n, OVERFLOW]));
      this.seen.add(key);
    }
    return Object.fromEntries(this.labelNames.map((n, i) => [n, values[i]!]));
  }
}

export class Counter {
  constructor(
    readonly name: string,
    private readonly metric: prom.Counter,
    private readonly series: Series,
  ) {}
  inc(labels: Labels = {}, by = 1): void {
    if (!(by >= 0)) throw new RangeError(`counter ${this.name} can only go up (by ${by})`);
    this.metric.inc(this.series.labels(labels), by);
  }
}

export class Gauge {
  constructor(
    private readonly metric: prom.Gauge,
    private readonly series: Series,
  ) {}
  set(labels: Labels, v: number): void {
    this.metric.set(this.series.labels(labels), v);
  }
}

export class Histogram {
  constructor(
    private readonly metric: prom.Histogram,
    private readonly series: Series,
  ) {}
  observe(labels: Labels, v: number): void {
    this.metric.observe(this.series.labels(labels), v);
  }
}

export interface MetricOptions {
  readonly labelNames?: readonly string[];
  /** Distinct label sets kept; the rest are folded into "_other". Default 64. */
  readonly maxSeries?: number;
}

/** One sidecar's metrics (a prom-client `Registry` of its own, never the global one). */
export class MetricsRegistry {
  readonly registry = new prom.Registry();
  private readonly collectors: (() => void)[] = [];

  counter(name: string, help: string, opts: MetricOptions = {}): Counter {
    const { config, series } = this.prepare(name, help, opts);
    return new Counter(name, new prom.Counter(config), series);
  }
  gauge(name: string, help: string, opts: MetricOptions = {}): Gauge {
    const { config, series } = this.prepare(name, help, opts);
    return new Gauge(new prom.Gauge(config), series);
  }
  histogram(
    name: string,
    help: string,
    buckets: readonly number[],
    opts: MetricOptions = {},
  ): Histogram {
    for (let i = 1; i < buckets.length; i++)
      if (!(buckets[i]! > buckets[i - 1]!)) throw new Error(`buckets of ${name} must increase`);
    const { config, series } = this.prepare(name, help, opts);
    return new Histogram(new prom.Histogram({ ...config, buckets: [...buckets] }), series);
  }
  /** Runs before each exposition (for gauges read from elsewhere, e.g. the event log). */
  onCollect(fn: () => void): void {
    this.collectors.push(fn);
  }
  /** The whole registry in Prometheus text format. */
  expose(): Promise<string> {
    for (const c of this.collectors) c();
    return this.registry.metrics();
  }
  /** What every metric is made with: prom-client's config on this registry, and its label cap. */
  private prepare(name: string, help: string, opts: MetricOptions) {
    if (this.registry.getSingleMetric(name) !== undefined)
      throw new Error(`metric ${name} registered twice`);
    const labelNames = opts.labelNames ?? [];
    return {
      config: { name, help, labelNames, registers: [this.registry] },
      series: new Series(labelNames, opts.maxSeries ?? 64),
    };
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
      contentType: prom.Registry.PROMETHEUS_CONTENT_TYPE,
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
