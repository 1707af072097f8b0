/**
 * --otlp-endpoint: real sidecars send each transfer's trace as OpenTelemetry spans over OTLP/HTTP
 * (JSON) to a collector; here a plain HTTP server on loopback stands in for the collector and
 * decodes what arrives.
 */
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { DEFAULT_DEMO } from "../../../sim/demo-types.js";
import { runDemo } from "../../../sim/demo.js";

interface OtlpSpan {
  spanId: string;
  parentSpanId?: string;
  name: string;
  startTimeUnixNano: string;
  endTimeUnixNano: string;
  attributes: { key: string; value: { stringValue?: string; intValue?: string | number } }[];
  events?: { name: string; timeUnixNano: string }[];
  status?: { code?: number; message?: string };
}

let server: Server;
let url = "";
const bodies: unknown[] = [];

beforeAll(async () => {
  server = createServer((req, res) => {
    let body = "";
    req.on("data", (c: Buffer) => (body += c.toString()));
    req.on("end", () => {
      if (req.method === "POST" && req.url === "/v1/traces") bodies.push(JSON.parse(body));
      res.writeHead(200, { "content-type": "application/json" });
      res.end("{}");
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/v1/traces`;
});
afterAll(() => new Promise<void>((r) => server.close(() => r())));

function spans(): OtlpSpan[] {
  const out: OtlpSpan[] = [];
  for (const b of bodies as { resourceSpans: { scopeSpans: { spans: OtlpSpan[] }[] }[] }[])
    for (const rs of b.resourceSpans) for (const ss of rs.scopeSpans) out.push(...ss.spans);
  return out;
}

const attr = (s: OtlpSpan, key: string): string | undefined => {
  const v = s.attributes.find((a) => a.key === key)?.value;
  return v?.stringValue ?? (v?.intValue !== undefined ? String(v.intValue) : undefined);
};

describe("OpenTelemetry export", () => {
  it("one span per transfer and side, its hops as events, the data phase as a child", async () => {
    const summary = await runDemo({
      ...DEFAULT_DEMO,
      prefill: 1,
      decode: 1,
      pTp: 1,
      dTp: 1,
      layers: 2,
      requests: 3,
      promptTokens: [40, 200],
      computeMs: 5,
      concurrency: 1,
      mode: "push",
      requestTimeoutMs: 30_000,
      sidecarArgs: ["--otlp-endpoint", url],
    });
    expect(summary.verified).toBe(true);
    // The sidecars flush their batch when they stop (runDemo stops them before returning).
    const all = spans();
    const transfers = all.filter((s) => s.name === "kvxfer.transfer");
    const ids = [...new Set(transfers.map((s) => attr(s, "kvxfer.transfer_id")))].sort();
    expect(ids).toHaveLength(3);
    for (const id of ids) {
      const mine = transfers.filter((s) => attr(s, "kvxfer.transfer_id") === id);
      expect(mine.map((s) => attr(s, "kvxfer.side")).sort()).toEqual(["decode", "prefill"]);
      const p = mine.find((s) => attr(s, "kvxfer.side") === "prefill")!;
      const d = mine.find((s) => attr(s, "kvxfer.side") === "decode")!;
      expect(attr(p, "kvxfer.state")).toBe("RELEASED");
      expect(attr(d, "kvxfer.state")).toBe("KV_READY");
      expect(attr(p, "kvxfer.mode")).toBe("push");
      expect(Number(attr(p, "kvxfer.bytes"))).toBeGreaterThan(0);
      const names = (s: OtlpSpan): string[] => (s.events ?? []).map((e) => e.name);
      expect(names(p)).toEqual(
        expect.arrayContaining(["engine.prefillDone", "planned", "event.appended"]),
      );
      expect(names(d)).toEqual(
        expect.arrayContaining([
          "engine.expectKv",
          "pair 0>0 xferDone received",
          "engine.kvReady sent",
        ]),
      );
      // Every event lies within its span; the span ends no earlier than it starts.
      for (const s of [p, d]) {
        const start = BigInt(s.startTimeUnixNano);
        const end = BigInt(s.endTimeUnixNano);
        expect(end >= start).toBe(true);
        for (const e of s.events ?? []) {
          expect(BigInt(e.timeUnixNano) >= start && BigInt(e.timeUnixNano) <= end).toBe(true);
        }
      }
      // P's data phase is a child of P's span, inside it.
      const data = all.filter((s) => s.name === "kvxfer.data" && s.parentSpanId === p.spanId);
      expect(data).toHaveLength(1);
      expect(BigInt(data[0]!.startTimeUnixNano) >= BigInt(p.startTimeUnixNano)).toBe(true);
      expect(BigInt(data[0]!.endTimeUnixNano) <= BigInt(p.endTimeUnixNano)).toBe(true);
    }
  }, 120_000);
});
