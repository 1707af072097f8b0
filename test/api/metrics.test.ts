// Prometheus text exposition over HTTP.
import { afterEach, describe, expect, it } from "vitest";
import {
  MetricsRegistry,
  SidecarMetrics,
  startMetricsServer,
  type MetricsServer,
} from "../../src/api/metrics.js";
import { EventLog } from "../../src/sidecar/event-log.js";

let server: MetricsServer | undefined;
afterEach(async () => {
  await server?.close();
  server = undefined;
});

describe("metrics", () => {
  it("serves counters, gauges and cumulative histograms on GET /metrics", async () => {
    const m = new SidecarMetrics();
    const log = new EventLog({ capacity: 10 });
    m.watchEventLog(log);
    m.transferReady("push", 3, 1 << 20, 8);
    m.transferReady("push", 40, 2 << 20, 8);
    m.transferReady("pull", 2_000, 4096, 1);
    m.transferFailed("PEER_FAILED");
    m.transferFailed('we"ird\nreason\\');
    m.transferEnded("KV_READY", "decode");
    m.leaseExpired();
    m.setQueueDepth("pending_writes", 5);
    log.append({
      kind: "KV_READY",
      timeMs: 1,
      transferId: "a",
      peer: "p",
      side: "decode",
      reason: "",
      bytes: 1,
      mode: "push",
    });
    m.eventAppended("KV_READY");

    server = await startMetricsServer({ registry: m.registry, address: "127.0.0.1:0" });
    const res = await fetch(`http://${server.address}/metrics`, {
      signal: AbortSignal.timeout(5_000),
    });
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toMatch(/text\/plain; version=0.0.4/);
    const text = await res.text();
    expect(text).toContain("# TYPE kvxfer_transfer_latency_seconds histogram");
    expect(text).toContain('kvxfer_transfer_latency_seconds_bucket{le="0.005",mode="push"} 1');
    expect(text).toContain('kvxfer_transfer_latency_seconds_bucket{le="0.05",mode="push"} 2');
    expect(text).toContain('kvxfer_transfer_latency_seconds_bucket{le="+Inf",mode="push"} 2');
    expect(text).toContain('kvxfer_transfer_latency_seconds_count{mode="pull"} 1');
    expect(text).toContain('kvxfer_transfer_latency_seconds_sum{mode="push"} 0.043');
    expect(text).toContain(`kvxfer_transfer_bytes_total{mode="push"} ${3 << 20}`);
    expect(text).toContain('kvxfer_transfer_descriptors_total{mode="push"} 16');
    expect(text).toContain('kvxfer_transfer_failures_total{reason="PEER_FAILED"} 1');
    expect(text).toContain('kvxfer_transfer_failures_total{reason="we\\"ird\\nreason\\\\"} 1');
    expect(text).toContain("kvxfer_lease_expiries_total 1");
    expect(text).toContain('kvxfer_queue_depth{queue="pending_writes"} 5');
    expect(text).toContain("kvxfer_event_log_events 1");
    expect(text).toContain('kvxfer_events_total{kind="KV_READY"} 1');
    expect((await fetch(`http://${server.address}/other`)).status).toBe(404);
    log.close();
  });

  it("folds label sets beyond maxSeries into _other", async () => {
    const r = new MetricsRegistry();
    const c = r.counter("x_total", "x", { labelNames: ["reason"], maxSeries: 3 });
    for (let i = 0; i < 100; i++) c.inc({ reason: `r${i}` });
    const lines = (await r.expose()).split("\n").filter((l) => l.startsWith("x_total"));
    expect(lines).toEqual([
      'x_total{reason="r0"} 1',
      'x_total{reason="r1"} 1',
      'x_total{reason="r2"} 1',
      'x_total{reason="_other"} 97',
    ]);
  });
});
