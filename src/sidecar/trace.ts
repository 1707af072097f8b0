/**
 * A transfer's trace: every hop of its critical path on one side, in microseconds of the host's
 * CLOCK_MONOTONIC (monoUs(), the clock the native addon stamps its steps with), so P's and D's
 * hops on one host line up. Kept with the transfer (ListTransfers, `kvxfer status --trace`) and
 * turned into OpenTelemetry spans when a tracer is configured (otel.ts).
 */
import { monoUs, type OpTrace } from "../native/index.js";

export { monoUs };

export interface TraceHop {
  readonly hop: string;
  readonly us: number;
}

/** Hops kept per transfer and side: a bound on memory, whatever the plan's size. */
export const MAX_TRACE_HOPS = 64;

/**
 * Kept compactly, as ended transfers keep their trace while their tombstones last (thousands at
 * a time): names (shared strings) and times in an unboxed array; `hops` builds the objects when
 * the transfer is listed.
 */
export class TransferTrace {
  private readonly names: string[] = [];
  private readonly times: number[] = [];

  mark(hop: string, us: number = monoUs()): void {
    if (this.names.length >= MAX_TRACE_HOPS) return;
    this.names.push(hop);
    this.times.push(us);
  }

  get hops(): TraceHop[] {
    return this.names.map((hop, i) => ({ hop, us: this.times[i]! }));
  }
}

/** One string per pair step name (`pair 0>1 flushed`), not one per transfer. */
const stepNames = new Map<string, string>();
const MAX_STEP_NAMES = 4096;

export function stepName(pair: string, step: string): string {
  const key = `${pair}\u0000${step}`;
  let name = stepNames.get(key);
  if (name === undefined) {
    name = `pair ${pair} ${step}`;
    if (stepNames.size < MAX_STEP_NAMES) stepNames.set(key, name);
  }
  return name;
}

/**
 * The native steps of a rank pair's operations as hops named `pair S>D <step>`: of several
 * operations (a read per region pair), the first start and the last finish of each step.
 */
export function markPairSteps(trace: TransferTrace, pair: string, ops: readonly OpTrace[]): void {
  if (ops.length === 0) return;
  const first = (k: keyof OpTrace): number => {
    let v = 0;
    for (const o of ops) if (o[k] > 0 && (v === 0 || o[k] < v)) v = o[k];
    return v;
  };
  const last = (k: keyof OpTrace): number => {
    let v = 0;
    for (const o of ops) if (o[k] > v) v = o[k];
    return v;
  };
  const steps: [string, number][] = [
    ["submitted", first("submittedUs")],
    ["started", first("startedUs")],
    ["first post", first("firstPostUs")],
    ["posted", last("postedUs")],
    ["flushed", last("flushedUs")],
    ["notified", last("notifiedUs")],
    ["completed", last("completedUs")],
    ["delivered", last("deliveredUs")],
  ];
  for (const [step, us] of steps) if (us > 0) trace.mark(stepName(pair, step), us);
}

/**
 * The data phase in a side's hops: its first operation handed to the addon -> its last flushed
 * (µs, monoUs), or undefined when the side moved nothing itself.
 */
export function dataPhase(
  hops: readonly TraceHop[],
): { startUs: number; endUs: number } | undefined {
  let startUs = Infinity;
  let endUs = -Infinity;
  for (const h of hops) {
    if (/^pair \S+ submitted$/.test(h.hop)) startUs = Math.min(startUs, h.us);
    else if (/^pair \S+ flushed$/.test(h.hop)) endUs = Math.max(endUs, h.us);
  }
  return Number.isFinite(startUs) && Number.isFinite(endUs) && endUs >= startUs
    ? { startUs, endUs }
    : undefined;
}
