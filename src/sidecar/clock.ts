/** Wall-clock milliseconds and one-shot timers; tests advance a manual one. */
export interface Clock {
  now(): number;
  /** Runs `fn` once after `ms` (never keeps the process alive). */
  after(ms: number, fn: () => void): void;
}

export const systemClock: Clock = {
  now: () => Date.now(),
  after: (ms, fn) => {
    setTimeout(fn, ms).unref();
  },
};
