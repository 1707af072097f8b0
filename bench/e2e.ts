// The control plane's overhead, by request size: KV moved through full sidecars (a prefill and a
// decode sidecar and their simulated engines, each its own process, driven by the demo's router)
// next to the native addon alone moving the very same plans (same layouts, same block ids, hence
// the same descriptors) in the same run, as a ratio.
//
// Sidecar path, per request: from P's engine answering "prefill done" to the router hearing
// KV_READY from D's sidecar over gRPC WatchEvents, timed in the router with performance.now()
// (sub-millisecond). It is the most accurate figure here: the sidecars' own timings from
// ListTransfers (P's prefillDoneMs to D's readyMs, and the data phase dataStartedMs..dataDoneMs)
// are wall-clock milliseconds, printed next to it as a cross-check.
//
// Reference: after the sidecars have stopped, native Agents in two processes (this one and a
// child), one per rank, over the same kind of memory as the engines' KV (shared-memory files of
// the engines' region sizes, or with --kv-memory segment memory UCX allocates), every page
// faulted in (the sidecars run with --prefault true to match), move each measured request's
// plan the way the sidecar does. Push: every rank pair's WRITEs and its notification as one
// operation, timed until the decode side has the notification. Pull: every region pair's READ.
// Planning is not in the reference (it is in the sidecar path; `kvxfer bench plan` times it).
//
// Run: `node dist/bench/e2e.js [--json] [--quick] [--modes push,pull] [--tokens 128,512,2048,8192]
//   [--layers 4] [--rounds 8] [--reps 3] [--kv-memory file|segment]`.
import { closeSync, ftruncateSync, openSync, unlinkSync } from "node:fs";
import { performance } from "node:perf_hooks";
import { pathToFileURL } from "node:url";

import { SidecarClient } from "../src/api/index.js";
import {
  Agent,
  type Endpoint,
  type Region,
  type RemoteRegion,
  type WritePart,
  monoUs,
  ucxVersion,
} from "../src/native/index.js";
import {
  type KvLayout,
  type TransferPlan,
  descriptorsForSide,
  planTransfer,
} from "../src/plan/index.js";
import type { TransferInfo } from "../src/sidecar/index.js";
import { DEFAULT_DEMO, type DemoRequestRecord } from "../sim/demo-types.js";
import { runDemo } from "../sim/demo.js";
import {
  BenchArgs,
  type Stats,
  MIN_P99_SAMPLES,
  fmt,
  fmtP99,
  machineLine,
  markdownTable,
  stats,
  table,
  runSuiteMain,
} from "./report.js";
import { PeerProcess } from "./native/peer-client.js";
import { lineChart, shortBytes, type ChartSeries } from "./svg.js";

export type E2eMode = "push" | "pull";

export interface E2eBenchOptions {
  /** Prompt lengths (tokens); default 128, 512, 2048, 8192. */
  promptTokens?: number[];
  /** Layers of the llama3-8b-shaped model (8 KV heads x 128, bfloat16); default 4. */
  layers?: number;
  /** Peers authenticate (mutual TLS, sealed notifications); default true. */
  peerAuth?: boolean;
  /** Measured requests per prompt length; default 8. */
  rounds?: number;
  /** Requests per prompt length first, not measured (handshake, first touch); default 1. */
  warmupRounds?: number;
  modes?: E2eMode[];
  /** Times the reference moves each measured plan; default 3. */
  refReps?: number;
  /**
   * Simulated prefill compute per request (ms), and so what the sidecars sit idle for before each
   * transfer; the reference idles as long before each of its moves. Default 20.
   */
  computeMs?: number;
  pTp?: number;
  dTp?: number;
  pBlock?: number;
  dBlock?: number;
  /** Extra flags for both sidecars (e.g. ["--spin-us", "200"]); default none. */
  sidecarArgs?: string[];
  /**
   * Where the engines' KV lives: "file" (shared-memory files the engines create, registered
   * memory: the default) or "segment" (segments the sidecars allocate through UCX). The
   * reference uses the same kind: files, or memory UCX allocates.
   */
  kvMemory?: "file" | "segment";
  log?: (line: string) => void;
}

export interface E2eRow {
  mode: E2eMode;
  tokens: number;
  /** Requests of this size that failed (left out of the figures); `failures`: the run's first few. */
  failed: number;
  failures: string[];
  /** KV bytes per request (the plan's). */
  bytes: number;
  /** Descriptors per request after coalescing (mean over the measured requests). */
  descriptors: number;
  /** Router: P's prefill answer -> KV_READY over gRPC (performance.now, ms). */
  sidecarMs: Stats;
  /** Sidecars' own: P's prefillDoneMs -> D's readyMs (ListTransfers, whole ms). */
  sidecarOwnMs: Stats;
  /** Sidecars' own data phase on the side that moves (push: P's writes and XferDone; pull: D's reads). */
  dataMs: Stats;
  /**
   * The native addon alone, the same plans, each move after the same idle time as the sidecars'
   * (the simulated prefill): the reference the ratio is to.
   */
  nativeMs: Stats;
  /** The same moves back to back (each right after the last): code and data still in cache. */
  nativeHotMs: Stats;
  /**
   * The gRPC hop alone, the same for every size of a mode: one KV_READY event from a grpc-js
   * server in another process to the router's client, after the same idle time (`grpcHopMs`).
   */
  grpcHopMs: Stats;
  /** sidecarMs.p50 / (nativeMs.p50 + grpcHopMs.p50): the data move plus the hop no push avoids. */
  ratioWithGrpc: number;
  /** sidecarMs.p50 / nativeMs.p50. */
  ratio: number;
  ratioP99: number;
  sidecarGBps: number;
  nativeGBps: number;
  /** Where the time goes: each hop of both sidecars' traces, µs after P's engine.prefillDone. */
  hops: HopStats[];
}

export interface HopStats {
  /** "P <hop>" or "D <hop>" (the sidecars' traces), or "router heard KV_READY". */
  hop: string;
  /** µs after P's sidecar received PrefillDone. */
  p50Us: number;
  p99Us: number;
  /** Measured requests whose trace has this hop. */
  n: number;
}

export interface E2eBenchResult {
  bench: "e2e";
  machine: string;
  ucx: string;
  shape: string;
  rows: E2eRow[];
}

/** Sidecar (router-timed) vs the native addon alone, p50 by KV bytes per request, push and pull. */
export function e2eChart(r: E2eBenchResult): string {
  const colors: Record<E2eMode, string> = { push: "#1f77b4", pull: "#d62728" };
  const series: ChartSeries[] = [];
  for (const mode of ["push", "pull"] as const) {
    const rows = r.rows.filter((x) => x.mode === mode).sort((a, b) => a.bytes - b.bytes);
    if (rows.length === 0) continue;
    series.push(
      {
        name: `${mode}: sidecars`,
        points: rows.map((x) => [x.bytes, x.sidecarMs.p50] as const),
        color: colors[mode],
      },
      {
        name: `${mode}: native alone (ref)`,
        points: rows.map((x) => [x.bytes, x.nativeMs.p50] as const),
        color: colors[mode],
        dashed: true,
      },
    );
  }
  return lineChart({
    title: "Request latency p50 vs KV size: full sidecars vs the native addon alone",
    subtitle: `${r.shape.split(" (")[0]}, shm, one request in flight; ${r.machine.split(",").slice(0, 2).join(",")}`,
    xLabel: "KV bytes per request",
    yLabel: "p50 (ms)",
    logX: true,
    logY: true,
    xTicks: [...new Set(r.rows.map((x) => x.bytes))].sort((a, b) => a - b),
    xTickFormat: shortBytes,
    series,
  });
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

interface SidecarTimes {
  p?: TransferInfo;
  d?: TransferInfo;
}

/** Reads both sidecars' transfer tables (with their timings) before the demo stops them. */
async function readTimings(
  grpcAddresses: string[],
  into: Map<string, SidecarTimes>,
): Promise<void> {
  for (const address of grpcAddresses) {
    const client = new SidecarClient(address);
    try {
      await client.connect(5_000);
      const { transfers } = await client.listTransfers({ limit: 10_000 });
      for (const t of transfers) {
        const e = into.get(t.transferId) ?? {};
        if (t.side === "prefill") e.p = t;
        else e.d = t;
        into.set(t.transferId, e);
      }
    } finally {
      client.close();
    }
  }
}

/**
 * The reference: the same plans moved by the native addon alone, with the two sides in two
 * processes over the same kind of memory as the sidecars (shared-memory files of the engines'
 * sizes, registered host memory). The moving side (P for push, D for pull) is in this process;
 * the other side is a child process (bench/native/kv-side.ts) whose progress threads do their
 * part, as a sidecar's do. One agent per rank on each side.
 */
class NativePair {
  private readonly files: string[] = [];
  /** The moving side's agents and regions, by rank. */
  private readonly agents: Agent[] = [];
  private readonly regions: Region[][] = [];
  private peer: PeerProcess | undefined;
  /** `${srcRank}:${dstRank}` -> the moving agent's endpoint to the other side's rank. */
  private readonly eps = new Map<string, Endpoint>();
  private readonly remotes = new Map<string, RemoteRegion>();

  constructor(
    private readonly pLayout: KvLayout,
    private readonly dLayout: KvLayout,
    private readonly mode: E2eMode,
    private readonly memory: "file" | "segment" = "file",
  ) {}

  async open(): Promise<void> {
    const push = this.mode === "push";
    const [mine, theirs] = push ? [this.pLayout, this.dLayout] : [this.dLayout, this.pLayout];
    for (let r = 0; r < mine.tpSize; r++) {
      const ucx = this.memory === "segment";
      const a = new Agent({
        name: `e2e-ref-${push ? "p" : "d"}${r}`,
        transports: "shm,self",
      });
      this.agents.push(a);
      this.regions.push(
        mine.regionBytes.map((len, g) => {
          if (ucx) {
            const region = a.allocate(len);
            region.bytes().fill(push ? 0x5a : 0);
            return region;
          }
          const path = `/dev/shm/kvxfer-bench-e2e-${process.pid}-r${r}-g${g}.kv`;
          const fd = openSync(path, "w+");
          this.files.push(path);
          try {
            ftruncateSync(fd, len);
          } finally {
            closeSync(fd);
          }
          const region = a.mapFile(path, { length: len });
          // Touch every page first, as the engines' caches are in steady state.
          region.bytes().fill(push ? 0x5a : 0);
          return region;
        }),
      );
    }
    this.peer = new PeerProcess([], {}, "kv-side.js");
    const other = await this.peer.call<{ ranks: { address: string; keys: string[] }[] }>("init", {
      name: `e2e-ref-${push ? "d" : "p"}`,
      ranks: theirs.tpSize,
      regionBytes: theirs.regionBytes,
      transports: "shm,self",
      fill: push ? 0 : 0x5a,
      memory: this.memory === "segment" ? "ucx" : "file",
    });
    for (let s = 0; s < this.pLayout.tpSize; s++)
      for (let d = 0; d < this.dLayout.tpSize; d++) {
        const [me, them] = push ? [s, d] : [d, s];
        const a = this.agents[me]!;
        const remote = other.ranks[them]!;
        const ep = a.connect(Buffer.from(remote.address, "base64"));
        await this.peer.call("connect", { rank: them, address: a.address.toString("base64") });
        this.eps.set(`${s}:${d}`, ep);
        remote.keys.forEach((k, g) =>
          this.remotes.set(`${s}:${d}:${g}`, ep.importRemote(Buffer.from(k, "base64"))),
        );
        // Both ways used once before anything is measured (UCX connects lazily).
        await a.notify(ep, Buffer.from(`hello:${s}:${d}`));
        await this.peer.call("waitNote", { key: `hello:${s}:${d}` });
      }
  }

  /**
   * Moves one plan; returns milliseconds. Push: every pair's WRITEs and its notification as one
   * operation (writeParts), until D's process has the notification in JavaScript (its monoUs,
   * this host's clock); pull: every READ. `pullDescs`: the plan's triples swapped for D.
   */
  async move(plan: TransferPlan, id: string, pullDescs: Float64Array[][]): Promise<number> {
    const t0 = monoUs();
    const ends = await Promise.all(
      plan.pairs.map(async (pair, i) => {
        const key = `${pair.srcRank}:${pair.dstRank}`;
        const ep = this.eps.get(key)!;
        if (this.mode === "push") {
          const a = this.agents[pair.srcRank]!;
          const note = `${id}:${key}`;
          const parts: WritePart[] = pair.regionPairs
            .filter((rp) => rp.count > 0)
            .map((rp) => ({
              local: this.regions[pair.srcRank]![rp.srcRegion]!,
              remote: this.remotes.get(`${key}:${rp.dstRegion}`)!,
              descriptors: rp.descriptors,
            }));
          await a.writeParts(ep, parts, Buffer.from(note));
          const r = await this.peer!.call<{ deliveredUs: number }>("waitNote", { key: note });
          return r.deliveredUs;
        }
        const a = this.agents[pair.dstRank]!;
        const reads: Promise<unknown>[] = [];
        pair.regionPairs.forEach((rp, j) => {
          if (rp.count === 0) return;
          reads.push(
            a.read(
              ep,
              this.regions[pair.dstRank]![rp.dstRegion]!,
              this.remotes.get(`${key}:${rp.srcRegion}`)!,
              pullDescs[i]![j]!,
            ),
          );
        });
        await Promise.all(reads);
        return monoUs();
      }),
    );
    return (Math.max(...ends) - t0) / 1000;
  }

  async close(): Promise<void> {
    for (const a of this.agents) a.close();
    await this.peer?.close();
    for (const f of this.files) {
      try {
        unlinkSync(f);
      } catch {
        // already gone
      }
    }
  }
}

interface Measured {
  rec: DemoRequestRecord;
  plan: TransferPlan;
  own?: number;
  data?: number;
  /** Hop -> µs after P's engine.prefillDone (both sidecars share this host's monotonic clock). */
  hops?: Map<string, number>;
}

/** Both sides' traces on one time line, from P's receipt of PrefillDone to the router's KV_READY. */
function hopOffsets(t: SidecarTimes, routerReadyUs: number): Map<string, number> | undefined {
  const base = t.p?.trace.find((h) => h.hop === "engine.prefillDone")?.us;
  if (base === undefined || t.d === undefined) return undefined;
  const out = new Map<string, number>();
  for (const [side, info] of [
    ["P", t.p!],
    ["D", t.d],
  ] as const) {
    for (const h of info.trace) {
      const key = `${side} ${h.hop}`;
      if (!out.has(key)) out.set(key, h.us - base);
    }
  }
  out.set("router heard KV_READY", routerReadyUs - base);
  return out;
}

/** p50/p99 of each hop over the requests, in the order of their p50. */
function hopStats(ms: readonly Measured[]): HopStats[] {
  const all = new Map<string, number[]>();
  for (const m of ms)
    for (const [hop, us] of m.hops ?? []) {
      const list = all.get(hop) ?? [];
      list.push(us);
      all.set(hop, list);
    }
  return [...all]
    .map(([hop, us]) => {
      const st = stats(us);
      return { hop, p50Us: st.p50, p99Us: st.p99, n: st.n };
    })
    .sort((a, b) => a.p50Us - b.p50Us);
}

/**
 * The gRPC hop alone, measured as the sidecars pay it: a grpc-js server in its own process
 * (bench/native/grpc-side.ts: the sidecar's WatchEvents definition and event encoder, nothing
 * else) writes one KV_READY event after each idle gap of `gapMs`; this process, the router, reads
 * them with the router's client. Ms from the server's write to the router's onEvent, per event;
 * the stream's first events (connection set-up) are left out.
 */
async function grpcHopReference(samples: number, gapMs: number): Promise<number[]> {
  const warm = 2;
  const side = new PeerProcess([], {}, "grpc-side.js");
  let client: SidecarClient | undefined;
  try {
    const { port } = await side.call<{ port: number }>("listen", { count: samples + warm, gapMs });
    client = new SidecarClient(`127.0.0.1:${port}`);
    await client.connect(5_000);
    const heardUs = new Map<number, number>();
    const watch = client.watch({}, (ev) => heardUs.set(ev.seq, monoUs()));
    const boundMs = (samples + warm) * (gapMs + 100) + 10_000;
    let timer: NodeJS.Timeout | undefined;
    try {
      await Promise.race([
        watch.done,
        new Promise<never>((_, reject) => {
          timer = setTimeout(
            () => reject(new Error(`gRPC hop reference: ${heardUs.size} events in ${boundMs} ms`)),
            boundMs,
          );
        }),
      ]);
    } finally {
      clearTimeout(timer);
      watch.cancel();
    }
    const { writtenUs } = await side.call<{ writtenUs: Record<string, number> }>("written");
    const out: number[] = [];
    for (const [seq, heard] of heardUs) {
      const written = writtenUs[String(seq)];
      if (seq > warm && written !== undefined) out.push((heard - written) / 1000);
    }
    return out;
  } finally {
    client?.close();
    await side.close();
  }
}

async function runMode(
  mode: E2eMode,
  o: Required<Omit<E2eBenchOptions, "log" | "modes">>,
  log: (l: string) => void,
): Promise<E2eRow[]> {
  const sizes = o.promptTokens;
  const times = new Map<string, SidecarTimes>();
  log(`e2e ${mode}: sidecars and engines for ${sizes.join(", ")} tokens ...`);
  const summary = await runDemo({
    ...DEFAULT_DEMO,
    prefill: 1,
    decode: 1,
    pTp: o.pTp,
    dTp: o.dTp,
    pBlock: o.pBlock,
    dBlock: o.dBlock,
    layout: "hnd",
    model: "llama3-8b",
    layers: o.layers,
    mode,
    // Push: D registers while P computes, so P writes the moment prefill is done.
    // Pull: D needs P's block ids, so the router waits for prefill.
    dispatch: mode === "push" ? "concurrent" : "sequential",
    requests: sizes.length * (o.warmupRounds + o.rounds),
    promptTokens: sizes,
    prefixTokens: 0,
    computeMs: o.computeMs,
    concurrency: 1,
    recordRequests: true,
    peerAuth: o.peerAuth ?? true,
    // Every page of the KV faulted in at registration (and a peer's, where UCX maps it), as the
    // reference's memory is: a steady-state engine's cache, not first touches inside transfers.
    sidecarArgs: ["--prefault", "true", ...o.sidecarArgs],
    kvMemory: o.kvMemory,
    // D's engine checks every byte 5 ms after KvReady, not at once: at 128 MiB the check is
    // several ms of CPU on one of two cores, and it delayed the gRPC hop to the router that the
    // figure ends with (router's hop p50 1.5 ms checking at once, 0.5-0.7 ms 3 ms later).
    checkAfterMs: 5,
    beforeStop: async (sidecars) => {
      await readTimings(
        sidecars.flatMap((s) => (s.grpc !== undefined ? [s.grpc] : [])),
        times,
      );
    },
  });
  // A failed request is reported and left out of the figures, not hidden.
  const failures = summary.failures;
  if (!summary.verified)
    log(`e2e ${mode}: ${summary.failed} request(s) failed, first: ${failures[0] ?? "?"}`);
  const layouts = summary.layouts!;
  const order = new Map(summary.requests!.map((r) => [r.transferId, r]));
  // Requests are numbered in dispatch order and cycle through the sizes; the first rounds warm up.
  const measured: Measured[] = [...order.values()]
    .filter(
      (rec) =>
        rec.ok && Number(/^req-(\d+)-/.exec(rec.transferId)?.[1]) >= sizes.length * o.warmupRounds,
    )
    .map((rec) => {
      const t = times.get(rec.transferId);
      const plan = planTransfer(layouts.prefill, layouts.decode, {
        numTokens: rec.tokens,
        prefixTokens: 0,
        srcBlockIds: rec.srcBlockIds,
        dstBlockIds: rec.dstBlockIds,
      });
      const m: Measured = { rec, plan };
      if (t?.p !== undefined && t.d !== undefined && t.d.timings.readyMs > 0) {
        m.own = t.d.timings.readyMs - t.p.timings.prefillDoneMs;
        const side = mode === "push" ? t.p : t.d;
        m.data = side.timings.dataDoneMs - side.timings.dataStartedMs;
        // The router's clock (performance.now, this process) on the monotonic time line.
        const routerReadyUs = monoUs() - (performance.now() - rec.readyMs) * 1000;
        const hops = hopOffsets(t, routerReadyUs);
        if (hops !== undefined) m.hops = hops;
      }
      return m;
    });

  // The reference, with every sidecar and engine stopped.
  log(`e2e ${mode}: the native addon alone, the same ${measured.length} plans x ${o.refReps} ...`);
  const native = new NativePair(layouts.prefill, layouts.decode, mode, o.kvMemory);
  const nativeMs = new Map<Measured, number[]>();
  const nativeHotMs = new Map<Measured, number[]>();
  try {
    await native.open();
    let n = 0;
    for (const m of measured) {
      const pull = m.plan.pairs.map((p) =>
        p.regionPairs.map((rp) => descriptorsForSide(rp.descriptors, "dst")),
      );
      await native.move(m.plan, `w${n++}`, pull); // warm-up
      // As the sidecars do: each move after the prefill's idle time. On this VM code and data
      // not touched for a few ms fall out of the caches (an HMAC of 120 bytes: 3 us right after
      // the last, 45 us after 20 ms spent in other code), so a reference moving back to back
      // would be measured hot and the sidecars cold.
      const samples: number[] = [];
      for (let i = 0; i < o.refReps; i++) {
        await sleep(o.computeMs);
        samples.push(await native.move(m.plan, `m${n++}`, pull));
      }
      nativeMs.set(m, samples);
      const hot: number[] = [];
      for (let i = 0; i < o.refReps; i++) hot.push(await native.move(m.plan, `h${n++}`, pull));
      nativeHotMs.set(m, hot);
    }
  } finally {
    await native.close();
  }
  log(`e2e ${mode}: the gRPC hop alone, ${measured.length} events ...`);
  const grpcHop = stats(await grpcHopReference(Math.max(measured.length, 20), o.computeMs));

  return sizes.map((tokens) => {
    const ms = measured.filter((m) => m.rec.tokens === tokens);
    const failed = summary.requests!.filter((r) => !r.ok && r.tokens === tokens).length;
    const bytes = ms[0]?.plan.bytes ?? 0;
    const sidecar = stats(ms.map((m) => m.rec.readyMs - m.rec.prefilledMs));
    const ref = stats(ms.flatMap((m) => nativeMs.get(m) ?? []));
    return {
      mode,
      tokens,
      failed,
      failures: failures.slice(0, 3),
      bytes,
      descriptors: ms.reduce((a, m) => a + m.plan.descriptorCount, 0) / Math.max(1, ms.length),
      sidecarMs: sidecar,
      sidecarOwnMs: stats(ms.flatMap((m) => (m.own !== undefined ? [m.own] : []))),
      dataMs: stats(ms.flatMap((m) => (m.data !== undefined ? [m.data] : []))),
      nativeMs: ref,
      nativeHotMs: stats(ms.flatMap((m) => nativeHotMs.get(m) ?? [])),
      grpcHopMs: grpcHop,
      ratio: sidecar.p50 / ref.p50,
      ratioWithGrpc: sidecar.p50 / (ref.p50 + grpcHop.p50),
      ratioP99: sidecar.p99 / ref.p99,
      sidecarGBps: bytes / (sidecar.p50 * 1e6),
      nativeGBps: bytes / (ref.p50 * 1e6),
      hops: hopStats(ms),
    };
  });
}

export async function runE2eBench(opts: E2eBenchOptions = {}): Promise<E2eBenchResult> {
  const o = {
    promptTokens: opts.promptTokens ?? [128, 512, 2048, 8192],
    layers: opts.layers ?? 4,
    rounds: opts.rounds ?? 8,
    warmupRounds: opts.warmupRounds ?? 1,
    refReps: opts.refReps ?? 3,
    computeMs: opts.computeMs ?? 20,
    pTp: opts.pTp ?? 1,
    dTp: opts.dTp ?? 1,
    peerAuth: opts.peerAuth ?? true,
    pBlock: opts.pBlock ?? 16,
    dBlock: opts.dBlock ?? 16,
    sidecarArgs: opts.sidecarArgs ?? [],
    kvMemory: opts.kvMemory ?? "file",
  };
  const log = opts.log ?? ((): void => {});
  const rows: E2eRow[] = [];
  for (const mode of opts.modes ?? (["push", "pull"] as E2eMode[])) {
    const modeRows = await runMode(mode, o, log);
    rows.push(...modeRows);
    for (const r of modeRows)
      log(
        `  ${r.mode} ${r.tokens} tokens: sidecars p50 ${fmt(r.sidecarMs.p50)} ms, native ` +
          `${fmt(r.nativeMs.p50)} ms (x${fmt(r.ratio)}), ${r.sidecarMs.n} requests`,
      );
  }
  return {
    bench: "e2e",
    machine: machineLine(),
    ucx: ucxVersion,
    shape:
      `llama3-8b shape with ${o.layers} layers (8 KV heads x 128, bfloat16, HND, a region per layer), ` +
      `P TP ${o.pTp} block ${o.pBlock} -> D TP ${o.dTp} block ${o.dBlock}, shm; ` +
      `${o.rounds} measured requests per size after ${o.warmupRounds} warm-up, one in flight; reference x${o.refReps}; ` +
      `peers ${o.peerAuth ? "authenticated (mutual TLS)" : "NOT authenticated"}; ` +
      `KV in ${o.kvMemory === "segment" ? "segments the sidecars allocate (UCX), reference in memory UCX allocates" : "the engines' shared-memory files, reference in such files"}`,
    rows,
  };
}

const HEAD = [
  "mode",
  "tokens",
  "ok/failed",
  "MiB",
  "descs",
  "sidecar p50 ms",
  "p99 ms",
  "own p50 ms",
  "data p50 ms",
  "native p50 ms (ref)",
  "p99 ms",
  "native hot p50",
  "ratio p50",
  "ratio p99",
  "gRPC hop p50 ms",
  "ratio to native+gRPC",
  "sidecar GB/s",
  "native GB/s",
];

function cells(r: E2eRow): string[] {
  return [
    r.mode,
    String(r.tokens),
    `${r.sidecarMs.n}/${r.failed}`,
    fmt(r.bytes / 2 ** 20, 1),
    fmt(r.descriptors, 0),
    fmt(r.sidecarMs.p50),
    fmtP99(r.sidecarMs),
    fmt(r.sidecarOwnMs.p50, 0),
    fmt(r.dataMs.p50, 0),
    fmt(r.nativeMs.p50),
    fmtP99(r.nativeMs),
    fmt(r.nativeHotMs?.p50),
    fmt(r.ratio),
    r.sidecarMs.n < MIN_P99_SAMPLES || r.nativeMs.n < MIN_P99_SAMPLES ? "-" : fmt(r.ratioP99),
    fmt(r.grpcHopMs?.p50),
    fmt(r.ratioWithGrpc),
    fmt(r.sidecarGBps),
    fmt(r.nativeGBps),
  ];
}

export function formatE2eRows(rows: readonly E2eRow[]): string {
  return table(HEAD, rows.map(cells));
}

/** Where the time goes: one table per row, each hop's p50/p99 after PrefillDone and its step. */
export function formatE2eHops(rows: readonly E2eRow[]): string {
  const out: string[] = [];
  for (const r of rows) {
    if (r.hops.length === 0) continue;
    out.push(
      `\nwhere the time goes: ${r.mode} ${r.tokens} tokens (${fmt(r.bytes / 2 ** 20, 1)} MiB), ` +
        `µs after P's sidecar received PrefillDone; native reference p50 ${fmt(r.nativeMs.p50 * 1000, 0)} µs, ` +
        `gRPC hop alone p50 ${fmt((r.grpcHopMs?.p50 ?? NaN) * 1000, 0)} µs`,
    );
    let prev = 0;
    out.push(
      table(
        ["hop", "p50 µs", "step µs", "p99 µs", "n"],
        r.hops.map((h) => {
          const step = h.p50Us - prev;
          prev = h.p50Us;
          return [h.hop, fmt(h.p50Us, 0), fmt(step, 0), fmt(h.p99Us, 0), String(h.n)];
        }),
      ),
    );
  }
  return out.join("\n");
}

/** One line: how far the sidecars are from the native addon, smallest and largest request. */
export function e2eConclusion(rows: readonly E2eRow[]): string {
  const parts: string[] = [];
  for (const mode of ["push", "pull"] as const) {
    const m = rows.filter((r) => r.mode === mode).sort((a, b) => a.bytes - b.bytes);
    if (m.length === 0) continue;
    const lo = m[0]!;
    const hi = m[m.length - 1]!;
    parts.push(
      `${mode}: ${fmt(lo.ratio, 1)}x the native time at ${fmt(lo.bytes / 2 ** 20, 0)} MiB` +
        (hi !== lo ? `, ${fmt(hi.ratio, 1)}x at ${fmt(hi.bytes / 2 ** 20, 0)} MiB` : ""),
    );
  }
  return `conclusion: the full sidecars take ${parts.join("; ")} (p50); the gap is the control plane's fixed cost, so it shrinks as requests grow`;
}

export function formatE2eMarkdown(rows: readonly E2eRow[]): string {
  return markdownTable(HEAD, rows.map(cells));
}

export const E2E_NOTES = [
  "  sidecar: P's engine answered prefill-done -> the router heard KV_READY from D's sidecar over gRPC (performance.now)",
  "  own: the sidecars' ListTransfers timings, P prefillDoneMs -> D readyMs (whole ms); data: dataStartedMs -> dataDoneMs on the moving side",
  "  native (reference): the same plans (same layouts and block ids) moved by the native addon alone over shm, the two sides in two",
  "    processes and the sidecars' memory kind (shared-memory files, or memory UCX allocates with --kv-memory segment); push = each rank pair's WRITEs and notification as one",
  "    operation until D's process has the notification, pull = READs; no planning",
  "  gRPC hop: one KV_READY event alone, a grpc-js server in another process (the sidecar's WatchEvents definition and encoder)",
  "    -> this process's router client, after the same idle time; the one hop the native reference does not make",
  "  ratio = sidecar / native (p50 and p99); ratio to native+gRPC = sidecar p50 / (native p50 + gRPC hop p50); GB/s = bytes / p50",
  `  p99 only from ${MIN_P99_SAMPLES} samples or more ("-" below; ok/failed counts the samples)`,
].join("\n");

const USAGE =
  "usage: kvxfer bench e2e [--json] [--quick] [--modes push,pull] [--tokens 128,512,2048,8192] [--layers N] [--rounds N] [--reps N] [--compute-ms N] [--peer-auth on|off] [--spin-us N] [--kv-memory file|segment]";

export function parseE2eArgs(argv: readonly string[]): E2eBenchOptions & { json: boolean } {
  const a = new BenchArgs(argv, USAGE);
  const json = a.has("--json");
  const quick = a.has("--quick");
  const o: E2eBenchOptions & { json: boolean } = { json };
  if (quick) {
    o.promptTokens = [128, 2048, 8192];
    o.rounds = 3;
    o.refReps = 2;
  }
  const modes = a.list("--modes");
  if (modes !== undefined) {
    for (const m of modes)
      if (m !== "push" && m !== "pull") throw new Error(`--modes takes push,pull, got '${m}'`);
    o.modes = modes as E2eMode[];
  }
  const tokens = a.ints("--tokens");
  if (tokens !== undefined) o.promptTokens = tokens;
  const layers = a.number("--layers", 1);
  if (layers !== undefined) o.layers = layers;
  const rounds = a.number("--rounds", 1);
  if (rounds !== undefined) o.rounds = rounds;
  const reps = a.number("--reps", 1);
  if (reps !== undefined) o.refReps = reps;
  const compute = a.number("--compute-ms", 0);
  if (compute !== undefined) o.computeMs = compute;
  const spin = a.number("--spin-us", 0);
  if (spin !== undefined) o.sidecarArgs = ["--spin-us", String(spin)];
  const memory = a.string("--kv-memory");
  if (memory !== undefined) {
    if (memory !== "file" && memory !== "segment")
      throw new Error(`--kv-memory takes file or segment, got '${memory}'`);
    o.kvMemory = memory;
  }
  const auth = a.string("--peer-auth");
  if (auth !== undefined) {
    if (auth !== "on" && auth !== "off")
      throw new Error(`--peer-auth takes on or off, got '${auth}'`);
    o.peerAuth = auth === "on";
  }
  a.done();
  return o;
}

export function main(argv: string[] = process.argv.slice(2)): Promise<E2eBenchResult> {
  return runSuiteMain("e2e", parseE2eArgs(argv), runE2eBench, (result) => [
    `\nkvxfer e2e: full sidecars vs the native addon alone, same plans; ${result.machine}, UCX ${result.ucx}`,
    `  ${result.shape}`,
    formatE2eRows(result.rows),
    E2E_NOTES,
    formatE2eHops(result.rows),
    e2eConclusion(result.rows),
  ]);
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href)
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
