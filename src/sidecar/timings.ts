/** When each step of a transfer happened, on one side. */

import type { TransferTimings } from "./view.js";

/** The status view's TransferTimings, written as the transfer goes (wall-clock ms; 0: not yet). */
export type Timings = { -readonly [K in keyof TransferTimings]: number };

export function newTimings(): Timings {
  return {
    registeredMs: 0,
    prefillDoneMs: 0,
    dataStartedMs: 0,
    dataDoneMs: 0,
    readyMs: 0,
    endedMs: 0,
  };
}
