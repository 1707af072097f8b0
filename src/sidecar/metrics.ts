/** What the sidecar reports to its metrics (implemented by src/api/metrics.ts). */
export interface TransferMetrics {
  /** A transfer's KV is ready on D: its mode, prefill-done-to-ready latency, bytes and descriptors. */
  transferReady(mode: string, latencyMs: number, bytes: number, descriptors: number): void;
  /** A transfer failed on D with `code`. */
  transferFailed(code: string): void;
  /** A gauge of live work by name (prefill_live, decode_live, agents_inflight). */
  setQueueDepth(name: string, depth: number): void;
}
