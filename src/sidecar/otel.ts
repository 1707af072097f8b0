/**
 * A finished transfer's trace as OpenTelemetry spans, for whoever collects the operator's traces:
 * one span per transfer and side ("kvxfer.transfer", from its first hop to its last), each hop an
 * event at its time, and the data phase (first operation handed to UCX -> last flushed) as a
 * child span ("kvxfer.data"). Only `@opentelemetry/api` here: the sidecar exports nothing unless
 * it is given a tracer (`--otlp-endpoint`, wired in src/cli/otel.ts).
 */
import { SpanStatusCode, context, trace, type Tracer } from "@opentelemetry/api";

import { dataPhase, monoUs } from "./trace.js";
import { isTerminal } from "./lifecycle.js";
import type { TransferInfo } from "./view.js";

/** Spans for one transfer on one side (`t` as ListTransfers shows it, once it has ended). */
export function exportTransferSpans(tracer: Tracer, engineId: string, t: TransferInfo): void {
  if (t.trace.length === 0) return;
  // Hops are this host's monotonic µs; OpenTelemetry takes wall-clock ms.
  const offsetMs = Date.now() - monoUs() / 1000;
  const at = (us: number): number => us / 1000 + offsetMs;
  const times = t.trace.map((h) => h.us);
  const span = tracer.startSpan("kvxfer.transfer", {
    startTime: at(Math.min(...times)),
    attributes: {
      "kvxfer.engine_id": engineId,
      "kvxfer.transfer_id": t.transferId,
      "kvxfer.side": t.side,
      "kvxfer.mode": t.mode,
      "kvxfer.state": t.state,
      "kvxfer.peer": t.peer,
      "kvxfer.bytes": t.bytes,
      "kvxfer.descriptors": t.descriptors,
    },
  });
  for (const h of t.trace) span.addEvent(h.hop, at(h.us));
  const data = dataPhase(t.trace);
  if (data !== undefined) {
    tracer
      .startSpan(
        "kvxfer.data",
        { startTime: at(data.startUs), attributes: { "kvxfer.bytes": t.bytes } },
        trace.setSpan(context.active(), span),
      )
      .end(at(data.endUs));
  }
  if (isTerminal(t.state) && t.state !== "KV_READY" && t.state !== "RELEASED")
    span.setStatus({ code: SpanStatusCode.ERROR, message: `${t.state}: ${t.reason}` });
  span.end(at(Math.max(...times)));
}
