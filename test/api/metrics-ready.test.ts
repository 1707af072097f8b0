/**
 * GET /ready on the metrics port: gRPC health's answer in plain HTTP, for the kubelet's probe when
 * the gRPC API speaks TLS (the Helm chart's default).
 */
import { describe, expect, it } from "vitest";

import { MetricsRegistry, startMetricsServer } from "../../src/api/metrics.js";

async function get(address: string, path: string): Promise<{ status: number; body: string }> {
  const r = await fetch(`http://${address}${path}`);
  return { status: r.status, body: await r.text() };
}

describe("GET /ready on the metrics port", () => {
  it("answers 503 NOT_SERVING, then 200 SERVING, as readiness changes", async () => {
    let ready = false;
    const server = await startMetricsServer({
      registry: new MetricsRegistry(),
      ready: () => ready,
    });
    try {
      const address = `127.0.0.1:${server.port}`;
      expect(await get(address, "/ready")).toEqual({ status: 503, body: "NOT_SERVING\n" });
      ready = true;
      expect(await get(address, "/ready")).toEqual({ status: 200, body: "SERVING\n" });
      expect((await get(address, "/metrics")).status).toBe(200);
    } finally {
      await server.close();
    }
  });

  it("is not served without a readiness source", async () => {
    const server = await startMetricsServer({ registry: new MetricsRegistry() });
    try {
      const address = `127.0.0.1:${server.port}`;
      expect((await get(address, "/ready")).status).toBe(404);
    } finally {
      await server.close();
    }
  });
});
