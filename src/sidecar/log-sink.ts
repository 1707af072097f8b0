/**
 * Where sidecars and simulated engines write their JSON logs: stderr, written
 * off the main thread, and dropped rather than ever blocking. pino's own
 * destination blocks the process in a sleep loop once stderr's reader is gone
 * (a parent that died): every write fails with EPIPE and its exit-time flush
 * retries forever. Measured here: orphaned sidecars stuck for half an hour.
 */
import { write } from "node:fs";

export interface LogSink {
  write(line: string): void;
}

/** At most this many log lines in flight; more are dropped (and counted). */
const MAX_PENDING = 10_000;

export function stderrSink(): LogSink & { readonly dropped: number } {
  let pending = 0;
  let broken = false;
  let dropped = 0;
  return {
    get dropped() {
      return dropped;
    },
    write(line: string): void {
      if (broken || pending >= MAX_PENDING) {
        dropped++;
        return;
      }
      pending++;
      write(2, line, (err) => {
        pending--;
        // EPIPE (the reader is gone) is final; anything else costs this line only.
        if (err !== null && (err as NodeJS.ErrnoException).code === "EPIPE") broken = true;
      });
    },
  };
}
