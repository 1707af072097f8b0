/**
 * What a demo run is given (`DemoOptions`, with the defaults) and what it
 * gives back (`DemoSummary`), and the figures a summary is made of.
 */
import {
  kvHeadsPerRank,
  kvPerLayer,
  type KvLayout,
  type KvRegionScheme,
} from "../src/plan/index.js";
import type { TransferMode } from "../src/sidecar/index.js";
import type { SimModel } from "./engine-input.js";

/** Where one side's processes run: a command prefix (network namespace), its address, its NIC. */
export interface HostSpec {
  prefix: string[];
  listenHost: string;
  netDevice?: string;
}

export interface DemoOptions {
  prefill: number;
  decode: number;
  pTp: number;
  dTp: number;
  pBlock: number;
  dBlock: number;
  layout: "hnd" | "nhd";
  /** Where each side's engine places its KV (`KvRegionScheme`; default `region-per-layer`). */
  pScheme?: KvRegionScheme;
  dScheme?: KvRegionScheme;
  model: SimModel;
  layers?: number;
  kvHeads?: number;
  /**
   * Where the engines' KV lives: files they create (the engines' default), or shared-memory
   * segments their sidecars allocate (the demo's default: on one host UCX then copies into the
   * peer's mapped segment, instead of sending each piece as an active message that the receiving
   * sidecar copies; docs/benchmarks.md). Not with `transport: "tcp"`.
   */
  kvMemory?: "file" | "segment";
  /**
   * D's engine checks the KV this long after KvReady (default 0: at once), so that a benchmark
   * timing what follows KvReady does not time the check's CPU too.
   */
  checkAfterMs?: number;
  headDim?: number;
  mode: TransferMode;
  /**
   * sequential: P's prefill first, then D's ExpectKv with P's block ids (auto mode: pull);
   * concurrent: both at once (auto mode: push); alternating: even requests sequential, odd
   * concurrent (auto mode: pull and push in turn).
   */
  dispatch: "sequential" | "concurrent" | "alternating";
  requests: number;
  /** Stop starting requests after this long (ms); `requests` is then an upper bound. */
  durationMs?: number;
  promptTokens: number[];
  /** Tokens already cached on D for every request (only the rest moves). */
  prefixTokens: number;
  /**
   * shm: `--transports shm,self`; tcp: `--transports tcp,self` with peer error handling;
   * default: no `--transports` (UCX's own choice; peer error handling across hosts).
   */
  transport: "shm" | "tcp" | "default";
  /** Simulated prefill compute per request. */
  computeMs: number;
  /** Requests in flight at once. */
  concurrency: number;
  /** Blocks per rank; default: enough for `concurrency` requests of the longest prompt, twice. */
  blocks?: number;
  /** Where prefill and decode processes run (default: here, loopback). */
  hosts?: { prefill: HostSpec; decode: HostSpec };
  /** Extra sidecar flags. */
  sidecarArgs?: string[];
  /**
   * Peers authenticate with mutual TLS and certificates from a throwaway CA (default true);
   * false runs the sidecars without credentials (--insecure-peers), to measure what security costs.
   */
  peerAuth?: boolean;
  /** A bound for each request from dispatch to verification. */
  requestTimeoutMs: number;
  log?: (line: string) => void;
  progress?: (done: number, total: number) => void;
  /** Stops dispatching new requests (Ctrl-C); what is running finishes, then everything is stopped. */
  signal?: AbortSignal;
  /** Extra simulated prefill compute per prompt token (ms), on top of `computeMs` (rounded per request). */
  computeMsPerToken?: number;
  /** Keep per-request timings, block ids and both layouts in the summary (benchmarks). */
  recordRequests?: boolean;
  /** Called once every process is up, before the first request (benchmarks read process CPU here). */
  onStarted?: (sidecars: SidecarSummary[]) => void | Promise<void>;
  /** Called after the workload and the block check, before any process stops (e.g. to read ListTransfers). */
  beforeStop?: (sidecars: SidecarSummary[]) => void | Promise<void>;
}

export const DEFAULT_DEMO: DemoOptions = {
  prefill: 2,
  decode: 2,
  pTp: 2,
  dTp: 4,
  pBlock: 16,
  dBlock: 32,
  layout: "hnd",
  model: "llama3-8b",
  layers: 4,
  mode: "auto",
  dispatch: "concurrent",
  requests: 24,
  promptTokens: [128, 512, 1024],
  prefixTokens: 0,
  transport: "shm",
  kvMemory: "segment",
  computeMs: 20,
  concurrency: 2,
  requestTimeoutMs: 60_000,
};

export interface SidecarSummary {
  engineId: string;
  role: "prefill" | "decode";
  epoch: string;
  sideChannel: string;
  engineSocket: string;
  grpc?: string;
  metrics?: string;
  /** The sidecar's process id. */
  pid?: number;
}

/** One request as the router saw it (with `recordRequests`); times are performance.now() in ms. */
export interface DemoRequestRecord {
  transferId: string;
  tokens: number;
  computeMs: number;
  /** The router started the request (sent the prompt to P, and in concurrent dispatch to D). */
  dispatchedMs: number;
  /** P's engine answered: prefill done. */
  prefilledMs: number;
  /** The router heard KV_READY from D's sidecar (gRPC WatchEvents). */
  readyMs: number;
  /** How the transfer moved ("push" or "pull"); empty unless it became ready. */
  mode: string;
  /** Ready and verified byte for byte on D. */
  ok: boolean;
  srcBlockIds: number[];
  dstBlockIds: number[];
}

export interface DemoSummary {
  /** True only when every byte of every transfer was checked and matched, nothing failed, nothing leaked. */
  verified: boolean;
  /** Transfers dispatched: `requested` unless the run was stopped early (Ctrl-C). */
  transfers: number;
  /** Transfers asked for (--requests). */
  requested: number;
  /** Stopped early by the abort signal (Ctrl-C): transfers in flight were cut, not failed. */
  interrupted: boolean;
  /** In flight when the run was stopped: neither verified nor counted as failed. */
  cut: number;
  failed: number;
  mismatches: number;
  /** KV bytes that landed on D (checked byte for byte). */
  bytes: number;
  /** Tokens D already held (--prefix-tokens, prefix caching) and so did not move, over verified transfers. */
  prefixTokens: number;
  /** The bytes of those tokens on D: what prefix caching saved (checkedBytes = bytes + prefixBytes). */
  prefixBytes: number;
  checkedBytes: number;
  mode: TransferMode;
  /** How the transfers actually moved, from D's KV_READY events (auto picks per transfer). */
  byMode: Record<string, number>;
  dispatch: DemoOptions["dispatch"];
  /** Where the engines' KV lived. */
  kvMemory: "file" | "segment";
  elapsedMs: number;
  gbps: number;
  /** Prefill done (P answered the router) to the router hearing KV_READY from D's sidecar (gRPC). */
  readyLatencyMs: { p50: number; p99: number; max: number };
  /**
   * kvxfer's data phase, from the sidecars' traces of the transfers that became ready, on the
   * side that moves (push: P, pull: D): first write or read handed to the addon -> last flushed.
   * Absent when the router could not read the sidecars (other network namespaces).
   */
  dataPhase?: { transfers: number; bytes: number; p50Ms: number; gbps: number };
  /** What the simulation around kvxfer cost: prefill compute per request, D's byte check per transfer. */
  simulation?: { computeMsP50: number; checkMsP50: number };
  leakedBlocks: number;
  failures: string[];
  sidecars: SidecarSummary[];
  /** With `recordRequests`: every request, in completion order. */
  requests?: DemoRequestRecord[];
  /** With `recordRequests`: the layouts of P's and D's engines. */
  layouts?: { prefill: KvLayout; decode: KvLayout };
}

export function percentile(sorted: number[], p: number): number {
  if (sorted.length === 0) return 0;
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!;
}

/** Bytes D receives for `tokens` tokens over all its ranks. */
export function dBytesPerToken(layout: KvLayout): number {
  return (
    layout.numLayers *
    kvPerLayer(layout) *
    kvHeadsPerRank(layout) *
    layout.tpSize *
    layout.headDim *
    layout.dtypeBytes
  );
}
