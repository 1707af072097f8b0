/** When each step of a transfer happened, on one side. */

/** Wall-clock ms; 0 when that step has not happened (the status view's TransferTimings). */
export interface Timings {
  registeredMs: number;
  prefillDoneMs: number;
  dataStartedMs: number;
  dataDoneMs: number;
  readyMs: number;
  endedMs: number;
}

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
