/**
 * `kvxfer demo`: starts sidecars and simulated engines as separate
 * processes, runs a workload through a simulated router, and summarises it.
 * Tests and benchmarks drive the same code (`runDemo`).
 */
import { randomBytes } from "node:crypto";
import { performance } from "node:perf_hooks";
import { parseArgs } from "node:util";

import { SidecarClient, type ResumableWatch } from "../src/api/client.js";
import {
  KV_REGION_SCHEMES,
  kvHeadsPerRank,
  kvPerLayer,
  type KvLayout,
  type KvRegionScheme,
} from "../src/plan/index.js";
import { dataPhase } from "../src/sidecar/trace.js";
import type { SidecarEvent, TransferMode } from "../src/sidecar/view.js";
import { SimEngineProcess, type SimEngineOptions } from "./engine-client.js";
import { SIM_MODELS, type SimModel } from "./engine.js";
import { SidecarProcess, type SidecarReady } from "./sidecar-process.js";

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

/**
 * kvxfer's data phase per transfer, from the sidecars' traces: on the moving side (P for a push,
 * D for a pull), the first operation handed to the addon -> the last one flushed.
 */
async function readDataPhase(
  nodes: readonly Node[],
  bytesOf: ReadonlyMap<string, number>,
): Promise<DemoSummary["dataPhase"]> {
  const times: number[] = [];
  let bytes = 0;
  for (const n of nodes) {
    if (n.ready.grpc === undefined) continue;
    const client = new SidecarClient(n.ready.grpc);
    try {
      await client.connect(5_000);
      const { transfers } = await client.listTransfers({ limit: 10_000 });
      for (const t of transfers) {
        const moving = t.mode === "push" ? "prefill" : "decode";
        const b = bytesOf.get(t.transferId);
        if (t.side !== moving || b === undefined || b === 0) continue;
        const data = dataPhase(t.trace);
        if (data === undefined) continue;
        times.push((data.endUs - data.startUs) / 1000);
        bytes += b;
      }
    } catch {
      // A sidecar that cannot be read leaves its transfers out of the figure.
    } finally {
      client.close();
    }
  }
  if (times.length === 0) return undefined;
  const total = times.reduce((a, x) => a + x, 0);
  times.sort((a, b) => a - b);
  return {
    transfers: times.length,
    bytes,
    p50Ms: percentile(times, 50),
    gbps: total > 0 ? bytes / (total * 1e6) : 0,
  };
}

function percentile(sorted: number[], p: number): number {
  if (sorted.length === 0) return 0;
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!;
}

/** Bytes D receives for `tokens` tokens over all its ranks. */
function dBytesPerToken(layout: KvLayout): number {
  return (
    layout.numLayers *
    kvPerLayer(layout) *
    kvHeadsPerRank(layout) *
    layout.tpSize *
    layout.headDim *
    layout.dtypeBytes
  );
}

/** One engine and its sidecar, both running. */
export interface Node {
  engineId: string;
  role: "prefill" | "decode";
  sidecar: SidecarProcess;
  ready: SidecarReady;
  engine: SimEngineProcess;
}

export type NodeShape = Pick<
  DemoOptions,
  | "pTp"
  | "dTp"
  | "pBlock"
  | "dBlock"
  | "layout"
  | "pScheme"
  | "dScheme"
  | "model"
  | "layers"
  | "kvHeads"
  | "kvMemory"
  | "checkAfterMs"
  | "headDim"
  | "mode"
  | "transport"
  | "hosts"
  | "sidecarArgs"
  | "peerAuth"
  | "requestTimeoutMs"
>;

/**
 * Starts one sidecar and its simulated engine. Both processes are added to
 * `track` as soon as they exist, so the caller can stop them whatever fails.
 */
export async function startNode(
  o: NodeShape,
  role: "prefill" | "decode",
  engineId: string,
  track: {
    sidecars: SidecarProcess[];
    engines: SimEngineProcess[];
    blocks: number;
    listen?: string;
    extraArgs?: string[];
  },
): Promise<Node> {
  const host = o.hosts?.[role];
  const socket = `ipc:///tmp/kvxfer-demo-${engineId}.sock`;
  const args = [
    "--engine-id",
    engineId,
    "--role",
    role,
    "--engine-socket",
    socket,
    "--listen",
    track.listen ?? `${host?.listenHost ?? "127.0.0.1"}:0`,
    "--mode",
    o.mode,
    "--transfer-timeout-ms",
    String(o.requestTimeoutMs),
    ...(o.transport === "tcp"
      ? ["--transports", "tcp,self", "--error-mode", "peer"]
      : o.transport === "default"
        ? host !== undefined
          ? ["--error-mode", "peer"]
          : []
        : ["--transports", "shm,self"]),
    ...(host?.netDevice !== undefined ? ["--net-devices", host.netDevice] : []),
    // On one host, TCP stays on loopback: UCX would otherwise also offer every other interface.
    ...(o.transport === "tcp" && host === undefined ? ["--net-devices", "lo"] : []),
    ...(o.sidecarArgs ?? []),
    ...(track.extraArgs ?? []),
    ...(o.peerAuth === false ? ["--insecure-peers", "true"] : []),
  ];
  const sidecar = new SidecarProcess(args, {
    ...(host?.prefix !== undefined ? { prefix: host.prefix } : {}),
    ...(o.peerAuth === false ? { pki: false as const } : {}),
  });
  track.sidecars.push(sidecar);
  const ready = await sidecar.ready;
  const engineOpts: SimEngineOptions = {
    engineId,
    role,
    socket,
    tp: role === "prefill" ? o.pTp : o.dTp,
    model: o.model,
    block: role === "prefill" ? o.pBlock : o.dBlock,
    blocks: track.blocks,
    layout: o.layout,
    ...((role === "prefill" ? o.pScheme : o.dScheme) !== undefined
      ? { scheme: role === "prefill" ? o.pScheme : o.dScheme }
      : {}),
    ...(o.layers !== undefined ? { layers: o.layers } : {}),
    ...(o.kvHeads !== undefined ? { kvHeads: o.kvHeads } : {}),
    ...(o.kvMemory !== undefined ? { kvMemory: o.kvMemory } : {}),
    ...(role === "decode" && o.checkAfterMs !== undefined ? { checkAfterMs: o.checkAfterMs } : {}),
    ...(o.headDim !== undefined ? { headDim: o.headDim } : {}),
  };
  const engine = await SimEngineProcess.start(
    engineOpts,
    host?.prefix !== undefined ? { prefix: host.prefix } : {},
  );
  track.engines.push(engine);
  return { engineId, role, sidecar, ready, engine };
}

/** UCX over TCP alone loads no SysV memory domain, so the sidecars could not allocate segments. */
const TCP_NO_SEGMENTS =
  "--kv-memory segment needs --transport shm: UCX over TCP alone allocates no SysV shared-memory segment for an engine to attach";

export async function runDemo(o: DemoOptions): Promise<DemoSummary> {
  if (o.transport === "tcp" && o.kvMemory === "segment") throw new Error(TCP_NO_SEGMENTS);
  const log = o.log ?? ((): void => {});
  const tag = `${process.pid}-${Date.now().toString(36)}`;
  const maxTokens = Math.max(...o.promptTokens);
  const blocksFor = (block: number): number =>
    o.blocks ?? Math.max(64, 2 * o.concurrency * Math.ceil(maxTokens / block) + 8);
  const nodes: Node[] = [];
  const sidecars: SidecarProcess[] = [];
  const engines: SimEngineProcess[] = [];
  const t0 = Date.now();
  const clients: SidecarClient[] = [];
  const watches: ResumableWatch[] = [];
  // The router learns "KV ready" from D's sidecars over gRPC (WatchEvents), one event per transfer.
  const terminal = new Map<string, SidecarEvent>();
  const waiting = new Map<string, (ev: SidecarEvent) => void>();
  const onTerminal = (ev: SidecarEvent): void => {
    if (ev.side !== "decode" || terminal.has(ev.transferId)) return;
    terminal.set(ev.transferId, ev);
    waiting.get(ev.transferId)?.(ev);
  };
  // One abort listener for every wait (not one per transfer in flight: past 10, Node warns of a
  // leak); each wait leaves `stoppers` when it ends.
  const stoppers = new Set<() => void>();
  const onAbort = (): void => {
    for (const stop of [...stoppers]) stop();
  };
  o.signal?.addEventListener("abort", onAbort, { once: true });
  const awaitTerminal = (transferId: string, timeoutMs: number): Promise<SidecarEvent> => {
    const seen = terminal.get(transferId);
    if (seen !== undefined) return Promise.resolve(seen);
    // Stopped already (Ctrl-C): the abort event has fired and would not fire again.
    if (o.signal?.aborted === true) return Promise.reject(new Error(`${transferId}: interrupted`));
    return new Promise((resolve, reject) => {
      const stop = (): void => {
        clearTimeout(timer);
        waiting.delete(transferId);
        stoppers.delete(stop);
        reject(new Error(`${transferId}: interrupted`));
      };
      const timer = setTimeout(() => {
        waiting.delete(transferId);
        stoppers.delete(stop);
        reject(
          new Error(`no terminal event for ${transferId} from D's sidecar within ${timeoutMs} ms`),
        );
      }, timeoutMs);
      // Ctrl-C reaches the sidecars too: nobody will answer, so stop waiting.
      stoppers.add(stop);
      waiting.set(transferId, (ev) => {
        clearTimeout(timer);
        waiting.delete(transferId);
        stoppers.delete(stop);
        resolve(ev);
      });
    });
  };
  try {
    const start = (role: "prefill" | "decode", i: number): Promise<Node> =>
      startNode(o, role, `${role === "prefill" ? "p" : "d"}${i}-${tag}`, {
        sidecars,
        engines,
        blocks: blocksFor(role === "prefill" ? o.pBlock : o.dBlock),
      });
    const ps = await Promise.all(Array.from({ length: o.prefill }, (_, i) => start("prefill", i)));
    const ds = await Promise.all(Array.from({ length: o.decode }, (_, i) => start("decode", i)));
    nodes.push(...ps, ...ds);
    const summaries = (): SidecarSummary[] =>
      nodes.map((n) => ({
        engineId: n.engineId,
        role: n.role,
        epoch: n.ready.epoch,
        sideChannel: n.ready.sideChannel,
        engineSocket: n.ready.engineSocket,
        ...(n.ready.grpc !== undefined ? { grpc: n.ready.grpc } : {}),
        ...(n.ready.metrics !== undefined ? { metrics: n.ready.metrics } : {}),
        ...(n.sidecar.child.pid !== undefined ? { pid: n.sidecar.child.pid } : {}),
      }));
    // Sidecars in other network namespaces serve gRPC on their own loopback, out of
    // the router's reach: there the router hears readiness from the engines alone.
    for (const d of o.hosts === undefined ? ds : []) {
      if (d.ready.grpc === undefined) continue;
      const client = new SidecarClient(d.ready.grpc);
      clients.push(client);
      watches.push(
        client.watchResumable({ kinds: ["KV_READY", "FAILED", "EXPIRED", "ABORTED"] }, onTerminal),
      );
    }
    const dLayout = ds[0]!.engine.ready!.layout;
    log(
      `started ${o.prefill} prefill (TP ${o.pTp}, block ${o.pBlock}) and ${o.decode} decode (TP ${o.dTp}, block ${o.dBlock}) engines with sidecars; ` +
        `${dLayout.numLayers} layers, ${dLayout.mla ? "MLA" : `${dLayout.totalKvHeads} KV heads`} x ${dLayout.headDim}, ${o.layout.toUpperCase()}, ${o.transport}, ` +
        `KV in ${o.kvMemory === "segment" ? "segments the sidecars allocate" : "files the engines create"}`,
    );
    for (const n of nodes) {
      log(
        `  ${n.role.padEnd(7)} ${n.engineId}: side channel ${n.ready.sideChannel}, gRPC ${n.ready.grpc ?? "-"}`,
      );
    }
    const firstD = ds[0]?.ready.grpc;
    if (firstD !== undefined) {
      log(
        `watch it live from another shell: node dist/src/cli/main.js watch ${firstD}   (or: status ${firstD})`,
      );
    }

    const latencies: number[] = [];
    const failures: string[] = [];
    let done = 0;
    let mismatches = 0;
    let checkedBytes = 0;
    const checkMs: number[] = [];
    /** Bytes moved by each verified transfer (for the data phase's GB/s). */
    const perTransferBytes = new Map<string, number>();
    const computeMsAll: number[] = [];
    let bytes = 0;
    const byMode: Record<string, number> = {};
    const perToken = dBytesPerToken(dLayout);
    const records: DemoRequestRecord[] = [];

    let prefixTokensSaved = 0;
    let prefixBytes = 0;
    let cut = 0;
    const stopped = (): boolean => o.signal?.aborted === true;
    /** The router gives up a request on one engine (its blocks come back; failures ignored). */
    const abortOn = async (n: Node, transferId: string): Promise<void> => {
      await n.engine.call("abort", { transferId }, o.requestTimeoutMs).catch(() => undefined);
    };
    const one = async (r: number): Promise<void> => {
      const p = ps[r % ps.length]!;
      const d = ds[r % ds.length]!;
      const transferId = `req-${r}-${tag}`;
      // The router binds the transfer to the D it picks: only a sidecar presenting this token gets it.
      const token = randomBytes(16).toString("hex");
      const tokens = o.promptTokens[r % o.promptTokens.length]!;
      const prefix = Math.min(o.prefixTokens, tokens - 1);
      const computeMs = o.computeMs + Math.round((o.computeMsPerToken ?? 0) * tokens);
      const rec: DemoRequestRecord = {
        transferId,
        tokens,
        computeMs,
        dispatchedMs: performance.now(),
        prefilledMs: 0,
        readyMs: 0,
        mode: "",
        ok: false,
        srcBlockIds: [],
        dstBlockIds: [],
      };
      let prefilledAt = 0;
      try {
        if (o.dispatch === "sequential" || (o.dispatch === "alternating" && r % 2 === 0)) {
          const { blockIds } = await p.engine.prefill(
            transferId,
            tokens,
            computeMs,
            o.requestTimeoutMs,
            token,
          );
          prefilledAt = Date.now();
          rec.prefilledMs = performance.now();
          rec.srcBlockIds = [...blockIds];
          const expected = await d.engine
            .expect(
              {
                transferId,
                tokens,
                prefixTokens: prefix,
                source: p.ready.sideChannel,
                sourceBlockIds: blockIds,
                token,
              },
              o.requestTimeoutMs,
            )
            .catch(async (err: unknown) => {
              await abortOn(p, transferId); // P's blocks back now, not at expiry
              throw err;
            });
          rec.dstBlockIds = [...expected.blockIds];
        } else {
          const pre = p.engine
            .prefill(transferId, tokens, computeMs, o.requestTimeoutMs, token)
            .then(({ blockIds }) => {
              prefilledAt = Date.now();
              rec.prefilledMs = performance.now();
              rec.srcBlockIds = [...blockIds];
            });
          const [prefilled, expected] = await Promise.allSettled([
            pre,
            d.engine.expect(
              { transferId, tokens, prefixTokens: prefix, source: p.ready.sideChannel, token },
              o.requestTimeoutMs,
            ),
          ]);
          // As a router does: when one side refused, the side that did take the request is
          // aborted, so that its blocks come back now instead of when the transfer expires.
          if (prefilled.status === "rejected") {
            if (expected.status === "fulfilled") await abortOn(d, transferId);
            throw prefilled.reason;
          }
          if (expected.status === "rejected") {
            await abortOn(p, transferId);
            throw expected.reason;
          }
          rec.dstBlockIds = [...expected.value.blockIds];
        }
        const ready: Pick<SidecarEvent, "kind" | "mode"> =
          watches.length > 0
            ? await awaitTerminal(transferId, o.requestTimeoutMs)
            : { kind: "KV_READY", mode: "" };
        const readyAt = Date.now();
        rec.readyMs = performance.now();
        // One waiter for either outcome: a losing waiter would linger until its timeout.
        const ev = await d.engine.waitEvent(
          (e) => e.event === "verified" || e.event === "failed",
          o.requestTimeoutMs,
          transferId,
        );
        if (ready.kind !== "KV_READY" && ev.event === "verified") {
          failures.push(
            `${transferId}: the engine verified KV its sidecar reported as ${ready.kind}`,
          );
        }
        if (ready.kind === "KV_READY" && ready.mode !== "") {
          byMode[ready.mode] = (byMode[ready.mode] ?? 0) + 1;
          rec.mode = ready.mode;
        }
        rec.ok = ready.kind === "KV_READY" && ev.event === "verified" && ev.ok === true;
        if (ev.event === "verified") {
          latencies.push(readyAt - prefilledAt);
          checkedBytes += Number(ev.checkedBytes ?? 0);
          if (typeof ev.checkMs === "number") checkMs.push(ev.checkMs);
          computeMsAll.push(computeMs);
          if (ev.ok === true) perTransferBytes.set(transferId, (tokens - prefix) * perToken);
          bytes += (tokens - prefix) * perToken;
          prefixTokensSaved += prefix;
          prefixBytes += prefix * perToken;
          if (ev.ok !== true) {
            mismatches += Number(ev.mismatches ?? 1);
            failures.push(`${transferId}: ${String(ev.first ?? "mismatch")}`);
          }
        } else if (stopped()) {
          cut++; // Ctrl-C reached the processes too: not a failure of the transfer
        } else {
          failures.push(`${transferId}: ${String(ev.reason)} ${String(ev.message ?? "")}`);
        }
      } catch (err) {
        if (stopped()) cut++;
        else failures.push(`${transferId}: ${(err as Error).message.slice(0, 300)}`);
      }
      if (o.recordRequests === true) records.push(rec);
      done++;
      o.progress?.(done, o.requests);
    };

    await o.onStarted?.(summaries());
    let next = 0;
    const until = o.durationMs !== undefined ? Date.now() + o.durationMs : Infinity;
    let requested = o.requests;
    const worker = async (): Promise<void> => {
      while (next < requested && o.signal?.aborted !== true) {
        if (Date.now() >= until)
          requested = next; // the duration is up: start nothing more
        else await one(next++);
      }
    };
    await Promise.all(Array.from({ length: Math.min(o.concurrency, o.requests) }, worker));
    const elapsedMs = Date.now() - t0;

    // Every block must be back with its engine: P's once released, D's once verified or released.
    let leakedBlocks = 0;
    // After Ctrl-C the engines may be gone already: there is nothing left to count.
    for (const n of o.signal?.aborted === true ? [] : nodes) {
      const deadline = Date.now() + 10_000;
      let free = 0;
      let total = 0;
      for (;;) {
        const s = await n.engine.stats();
        free = s.freeBlocks;
        total = s.totalBlocks;
        if (free === total || Date.now() > deadline) break;
        await new Promise((r) => setTimeout(r, 50));
      }
      leakedBlocks += (total - free) * (n.role === "prefill" ? o.pTp : o.dTp);
    }
    await o.beforeStop?.(summaries());
    const dataPhase =
      o.hosts === undefined && o.signal?.aborted !== true
        ? await readDataPhase(nodes, perTransferBytes)
        : undefined;
    latencies.sort((a, b) => a - b);
    const verified =
      failures.length === 0 &&
      mismatches === 0 &&
      leakedBlocks === 0 &&
      latencies.length === requested &&
      o.signal?.aborted !== true &&
      checkedBytes > 0;
    return {
      verified,
      transfers: next,
      requested,
      interrupted: stopped(),
      cut,
      failed: failures.length,
      mismatches,
      bytes,
      prefixTokens: prefixTokensSaved,
      prefixBytes,
      checkedBytes,
      mode: o.mode,
      byMode,
      dispatch: o.dispatch,
      kvMemory: o.kvMemory ?? "file",
      elapsedMs,
      gbps: bytes / (elapsedMs * 1e6),
      readyLatencyMs: {
        p50: percentile(latencies, 50),
        p99: percentile(latencies, 99),
        max: latencies[latencies.length - 1] ?? 0,
      },
      leakedBlocks,
      failures: failures.slice(0, 20),
      sidecars: summaries(),
      ...(dataPhase !== undefined ? { dataPhase } : {}),
      simulation: {
        computeMsP50: percentile(
          [...computeMsAll].sort((a, b) => a - b),
          50,
        ),
        checkMsP50: percentile(
          [...checkMs].sort((a, b) => a - b),
          50,
        ),
      },
      ...(o.recordRequests === true
        ? {
            requests: records,
            layouts: { prefill: ps[0]!.engine.ready!.layout, decode: dLayout },
          }
        : {}),
    };
  } finally {
    o.signal?.removeEventListener("abort", onAbort);
    for (const w of watches) w.cancel();
    for (const c of clients) c.close();
    await Promise.all(engines.map((e) => e.close().catch(() => undefined)));
    await Promise.all(sidecars.map((s) => s.close().catch(() => undefined)));
  }
}

export const DEMO_USAGE = `usage: kvxfer demo [--prefill N] [--decode N] [--p-tp N] [--d-tp N] [--p-block N] [--d-block N]
  [--layout hnd|nhd] [--p-scheme NAME] [--d-scheme NAME] [--model ${Object.keys(SIM_MODELS).join("|")}] [--layers N] [--kv-heads N] [--head-dim N]
  [--mode push|pull|auto] [--dispatch sequential|concurrent|alternating] [--requests N] [--prompt-tokens N[,N...]]
  [--prefix-tokens N] [--compute-ms N] [--concurrency N] [--blocks N] [--transport shm|tcp|default] [--kv-memory segment|file]
  [--peer-auth on|off] [--json]`;

function int(name: string, v: string | undefined, min = 1): number | undefined {
  if (v === undefined) return undefined;
  const n = Number(v);
  if (!Number.isSafeInteger(n) || n < min)
    throw new Error(`--${name} must be an integer >= ${min}, got '${v}'`);
  return n;
}

function choice<T extends string>(
  name: string,
  v: string | undefined,
  allowed: readonly T[],
): T | undefined {
  if (v === undefined) return undefined;
  if (!(allowed as readonly string[]).includes(v))
    throw new Error(`--${name} must be one of ${allowed.join(", ")}, got '${v}'`);
  return v as T;
}

/**
 * Parses `kvxfer demo` flags. `notes`: settings the demo changed on its own (to be printed:
 * nothing is switched silently).
 */
export function parseDemoArgs(argv: string[]): {
  options: DemoOptions;
  json: boolean;
  notes: string[];
} {
  const notes: string[] = [];
  const s = { type: "string" } as const;
  const { values } = parseArgs({
    args: argv,
    strict: true,
    options: {
      prefill: s,
      decode: s,
      "p-tp": s,
      "d-tp": s,
      "p-block": s,
      "d-block": s,
      layout: s,
      "p-scheme": s,
      "d-scheme": s,
      model: s,
      layers: s,
      "kv-heads": s,
      "head-dim": s,
      mode: s,
      dispatch: s,
      requests: s,
      "prompt-tokens": s,
      "prefix-tokens": s,
      "compute-ms": s,
      concurrency: s,
      blocks: s,
      transport: s,
      "kv-memory": s,
      "peer-auth": s,
      json: { type: "boolean" },
    },
  });
  const o: DemoOptions = { ...DEFAULT_DEMO };
  const set = <K extends keyof DemoOptions>(k: K, v: DemoOptions[K] | undefined): void => {
    if (v !== undefined) o[k] = v;
  };
  set("prefill", int("prefill", values.prefill));
  set("decode", int("decode", values.decode));
  set("pTp", int("p-tp", values["p-tp"]));
  set("dTp", int("d-tp", values["d-tp"]));
  set("pBlock", int("p-block", values["p-block"]));
  set("dBlock", int("d-block", values["d-block"]));
  set("layout", choice("layout", values.layout, ["hnd", "nhd"] as const));
  set("pScheme", choice("p-scheme", values["p-scheme"], KV_REGION_SCHEMES));
  set("dScheme", choice("d-scheme", values["d-scheme"], KV_REGION_SCHEMES));
  const model = choice("model", values.model, Object.keys(SIM_MODELS) as SimModel[]);
  if (model !== undefined) {
    o.model = model;
    // A named model runs at its full size unless --layers says otherwise.
    delete o.layers;
  }
  set("layers", int("layers", values.layers));
  set("kvHeads", int("kv-heads", values["kv-heads"]));
  set("headDim", int("head-dim", values["head-dim"]));
  set("mode", choice("mode", values.mode, ["push", "pull", "auto"] as const));
  set(
    "dispatch",
    choice("dispatch", values.dispatch, ["sequential", "concurrent", "alternating"] as const),
  );
  set("requests", int("requests", values.requests));
  if (values["prompt-tokens"] !== undefined) {
    o.promptTokens = values["prompt-tokens"].split(",").map((x) => int("prompt-tokens", x)!);
  }
  set("prefixTokens", int("prefix-tokens", values["prefix-tokens"], 0));
  set("computeMs", int("compute-ms", values["compute-ms"], 0));
  set("concurrency", int("concurrency", values.concurrency));
  set("blocks", int("blocks", values.blocks));
  set("transport", choice("transport", values.transport, ["shm", "tcp", "default"] as const));
  set("kvMemory", choice("kv-memory", values["kv-memory"], ["segment", "file"] as const));
  if (o.transport === "tcp" && o.kvMemory === "segment") {
    if (values["kv-memory"] !== undefined) throw new Error(TCP_NO_SEGMENTS);
    o.kvMemory = "file";
    notes.push(
      "note: --transport tcp: the engines' KV in files (UCX over TCP alone cannot allocate shared segments; give --kv-memory file to silence this)",
    );
  }
  const auth = choice("peer-auth", values["peer-auth"], ["on", "off"] as const);
  if (auth !== undefined) o.peerAuth = auth === "on";
  // A TP size the model's KV heads cannot be split over is refused here, in the user's terms,
  // before any process starts.
  const shape = SIM_MODELS[o.model];
  const heads = o.kvHeads ?? shape.totalKvHeads;
  for (const [flag, tp] of [
    ["p-tp", o.pTp],
    ["d-tp", o.dTp],
  ] as const) {
    if (!shape.mla && heads % tp !== 0 && tp % heads !== 0)
      throw new Error(
        `--${flag} ${tp}: TP ${tp} does not divide the ${heads} KV heads of ${o.model} (nor is it a multiple of them)`,
      );
  }
  // Pull needs P's block ids before D asks: the router waits for prefill.
  if (o.mode === "pull" && values.dispatch === undefined && o.dispatch !== "sequential") {
    o.dispatch = "sequential";
    notes.push(
      "note: --mode pull: dispatch set to sequential (D must know P's block ids before it reads them; give --dispatch to choose)",
    );
  }
  if (o.mode === "pull" && o.dispatch === "concurrent")
    throw new Error("--mode pull needs --dispatch sequential (D must know P's block ids)");
  return { options: o, json: values.json === true, notes };
}

/** Bytes in binary units, as `kvxfer status` prints them (MiB). */
function mib(bytes: number): string {
  return `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

export function formatDemoSummary(s: DemoSummary): string {
  const sent =
    s.transfers === s.requested
      ? `${s.transfers}`
      : `${s.transfers} sent of ${s.requested} requested`;
  const seconds = s.elapsedMs / 1000;
  const gibps = seconds > 0 ? s.bytes / 2 ** 30 / seconds : 0;
  const lines = [
    "",
    ...(s.interrupted
      ? [
          `interrupted: stopped after ${s.transfers} of ${s.requested} transfers` +
            (s.cut > 0 ? `; ${s.cut} in flight were cut (not counted as failed)` : ""),
        ]
      : []),
    `transfers: ${sent} (mode ${s.mode}: ${
      Object.entries(s.byMode)
        .map(([m, n]) => `${n} ${m}`)
        .join(", ") || "none ready"
    }; ${s.dispatch} dispatch), failed: ${s.failed}, mismatched: ${s.mismatches}, leaked blocks: ${s.leakedBlocks}`,
    `kvxfer: KV ready after prefill p50 ${s.readyLatencyMs.p50} ms, p99 ${s.readyLatencyMs.p99} ms (P's engine done -> the router heard KV_READY)`,
    ...(s.dataPhase !== undefined
      ? [
          `kvxfer data phase: p50 ${s.dataPhase.p50Ms.toFixed(2)} ms per transfer, ${s.dataPhase.gbps.toFixed(2)} GB/s ` +
            `(${mib(s.dataPhase.bytes)} over ${s.dataPhase.transfers} transfers: first write or read handed to UCX -> last flushed)`,
        ]
      : []),
    ...(s.prefixBytes > 0
      ? [
          `prefix caching: ${s.prefixTokens} tokens were already on D and did not move (${mib(s.prefixBytes)} saved); verified covers them too`,
        ]
      : []),
    ...(s.simulation !== undefined
      ? [
          `the simulation around it (not kvxfer): prefill compute p50 ${s.simulation.computeMsP50} ms per request, ` +
            `D's check of every byte p50 ${s.simulation.checkMsP50.toFixed(1)} ms per transfer`,
        ]
      : []),
    `wall clock: ${mib(s.bytes)} moved in ${seconds.toFixed(2)} s (${gibps.toFixed(2)} GiB/s, simulated compute and checking included)`,
    s.verified
      ? `verified: every byte of every transfer checked on D (${mib(s.checkedBytes)})`
      : s.interrupted
        ? `NOT verified: interrupted (${mib(s.checkedBytes)} checked on D before the stop)`
        : `NOT verified`,
    ...s.failures.map((f) => `  failure: ${f}`),
  ];
  return lines.join("\n");
}

export async function runDemoCommand(argv: string[]): Promise<number> {
  if (argv.includes("--help") || argv.includes("-h")) {
    console.log(DEMO_USAGE);
    return 0;
  }
  const { options, json, notes } = parseDemoArgs(argv);
  // What the demo changed on its own is said first (on stderr with --json: stdout is the JSON).
  for (const n of notes) (json ? console.error : console.log)(n);
  if (!json) {
    options.log = (l): void => console.log(l);
    let shown = -1;
    options.progress = (done, total): void => {
      const pct = Math.floor((done / total) * 20);
      if (pct === shown && done !== total) return;
      shown = pct;
      process.stdout.write(
        `\r[${"#".repeat(pct)}${" ".repeat(20 - pct)}] ${done}/${total} transfers`,
      );
      if (done === total) process.stdout.write("\n");
    };
  }
  // Ctrl-C (or SIGTERM): no new requests, then every process is stopped and its
  // shared-memory files removed; a second signal leaves at once.
  const controller = new AbortController();
  options.signal = controller.signal;
  const onSignal = (sig: NodeJS.Signals): void => {
    if (controller.signal.aborted) process.exit(sig === "SIGINT" ? 130 : 143);
    console.error(`\n${sig}: stopping after the transfers in flight; cleaning up`);
    controller.abort();
  };
  process.on("SIGINT", onSignal);
  process.on("SIGTERM", onSignal);
  const summary = await runDemo(options);
  process.off("SIGINT", onSignal);
  process.off("SIGTERM", onSignal);
  if (json) console.log(JSON.stringify(summary));
  else console.log(formatDemoSummary(summary));
  return summary.verified ? 0 : 1;
}
