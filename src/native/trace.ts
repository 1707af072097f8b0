/**
 * An operation's steps as JavaScript sees them: the OpTrace a write, read or notification
 * resolves with, in microseconds of the clock monoUs() reads.
 */
import { performance } from "node:perf_hooks";

import { KvxferError } from "../errors.js";
import type { OpTrace } from "./types.js";

/**
 * performance.now() reads CLOCK_MONOTONIC too, from another origin: the offset between them, from
 * the tightest of a few bracketed samples (a single pair read while the thread was preempted put
 * monoUs() 12 µs behind the native clock on a loaded machine).
 */
const MONO_OFFSET_US = ((): number => {
  let best = Infinity;
  let offset = 0;
  for (let i = 0; i < 50; i++) {
    const t1 = Number(process.hrtime.bigint()) / 1000;
    const p = performance.now() * 1000;
    const t2 = Number(process.hrtime.bigint()) / 1000;
    if (t2 - t1 < best) {
      best = t2 - t1;
      offset = (t1 + t2) / 2 - p;
    }
  }
  return offset;
})();

/**
 * Microseconds of CLOCK_MONOTONIC, the clock of OpTrace and Notification timestamps: comparable
 * between processes of one host (not between hosts).
 */
export function monoUs(): number {
  return Math.round(performance.now() * 1000 + MONO_OFFSET_US);
}

/**
 * Awaits a native promise; a rejection becomes a KvxferError. Its stack reaches the caller through
 * V8's async stack traces ("at async ..." for each awaiting function), which cost nothing until an
 * error is made: capturing a stack at every call was 4-8% of a sidecar's JavaScript thread.
 */
export async function settle(promise: Promise<Float64Array>): Promise<OpTrace> {
  try {
    return toTrace(await promise);
  } catch (err) {
    throw KvxferError.from(err);
  }
}

/**
 * An operation's steps as the addon reports them: a Float64Array in OpTrace's order (one
 * allocation per completion in native code, where an object cost a property set per step).
 */
function toTrace(t: Float64Array): OpTrace {
  return {
    submittedUs: t[0]!,
    startedUs: t[1]!,
    firstPostUs: t[2]!,
    postedUs: t[3]!,
    flushedUs: t[4]!,
    notifiedUs: t[5]!,
    completedUs: t[6]!,
    deliveredUs: t[7]!,
  };
}
