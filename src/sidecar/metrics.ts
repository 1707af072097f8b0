/**
 * What the sidecar reports about its transfers, as it happens. The sidecar
 * needs only this interface (not src/api/); `SidecarMetrics`
 * (src/api/metrics.ts) implements it as Prometheus metrics, and the
 * composition root (src/cli/sidecar-start.ts) hands one to `Sidecar.start`. The
 * metric names are listed in docs/api.md.
 */
export interface TransferMetrics {
  /**
   * D: a transfer's KV is ready. `mode` is the mode it used ("push" or
   * "pull"); `latencyMs` is prefill done -> ready; `bytes` and `descriptors`
   * are what was moved.
   */
  transferReady(mode: string, latencyMs: number, bytes: number, descriptors: number): void;

  /** Either side: a transfer failed; `reason` is the error code (e.g. "ERR_TIMEOUT"). */
  transferFailed(reason: string): void;

  /**
   * The current depth of a named queue ("prefill_live", "decode_live",
   * "agents_inflight"); called at every sweep.
   */
  setQueueDepth(name: string, n: number): void;
}

/** What the sidecar tallies: the KV moved (for its status) and where metrics go, once started. */
export class Tally {
  /** Set by `Sidecar.start` (none before, or in a test). */
  metrics: TransferMetrics | undefined;
  bytesMoved = 0;
  transfersMoved = 0;

  moved(bytes: number): void {
    this.bytesMoved += bytes;
    this.transfersMoved++;
  }
}
