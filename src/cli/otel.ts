/**
 * `--otlp-endpoint URL`: the sidecar's transfers as OpenTelemetry spans, sent over OTLP/HTTP
 * (JSON) to a collector, batched (at most 2048 spans queued; more are dropped, never waited for).
 * The SDK lives here, in the composition root, and is loaded only when the flag is given (about
 * 20 MiB of a sidecar's memory otherwise); the sidecar sees only a Tracer (src/sidecar/otel.ts).
 */
import type { Tracer } from "@opentelemetry/api";

import { KvxferError } from "../errors.js";

export interface OtlpTracing {
  tracer: Tracer;
  /** Sends what is queued and stops (bounded by `timeoutMs`). */
  shutdown(timeoutMs: number): Promise<void>;
}

export async function startOtlpTracing(endpoint: string, engineId: string): Promise<OtlpTracing> {
  let url: URL;
  try {
    url = new URL(endpoint);
  } catch {
    throw new KvxferError(
      "ERR_CONFIG",
      `--otlp-endpoint must be a URL such as http://127.0.0.1:4318/v1/traces, got '${endpoint}'`,
    );
  }
  if (url.protocol !== "http:" && url.protocol !== "https:")
    throw new KvxferError(
      "ERR_CONFIG",
      `--otlp-endpoint must be http:// or https://, got '${endpoint}'`,
    );
  const [
    { OTLPTraceExporter },
    { resourceFromAttributes },
    { BasicTracerProvider, BatchSpanProcessor },
  ] = await Promise.all([
    import("@opentelemetry/exporter-trace-otlp-http"),
    import("@opentelemetry/resources"),
    import("@opentelemetry/sdk-trace-base"),
  ]);
  const provider = new BasicTracerProvider({
    resource: resourceFromAttributes({
      "service.name": "kvxfer-sidecar",
      "service.instance.id": engineId,
    }),
    spanProcessors: [
      new BatchSpanProcessor(new OTLPTraceExporter({ url: url.href }), {
        scheduledDelayMillis: 1000,
        maxQueueSize: 2048,
      }),
    ],
  });
  return {
    tracer: provider.getTracer("kvxfer"),
    shutdown: async (timeoutMs) => {
      await Promise.race([
        provider.shutdown().catch(() => undefined),
        new Promise((r) => setTimeout(r, timeoutMs).unref()),
      ]);
    },
  };
}
