// The control plane's rate: transfers per second one sidecar pair (one prefill, one decode) sustains
// with small requests (a tiny model, 16 tokens: one block, a few KiB; no compute; 64 requests in
// flight), and the CPU the two sidecar processes spend per transfer (utime + stime from
// /proc/<pid>/stat over the measured interval). The simulated engines and the router share the
// machine's cores with the sidecars, so the machine's busy share over the interval is printed too,
// and a sidecar-bound ceiling: 1 / (CPU per transfer of the busier sidecar).
//
// Reference, in the same run: two native agents in two processes over shared memory doing the
// addon's notification round trip one at a time (a small WRITE with a notification, answered by
// an acknowledgement notification: bench/native/peer.ts "pingpong"), its rate and CPU per round
// trip. A sidecar transfer needs about one such round trip (push: PushReg, then WRITE + XferDone;
// pull: READ, then ReadDone and ReadAck), plus the engine link and the gRPC event.
//
// Run: `node dist/bench/control.js [--json] [--quick] [--requests N] [--concurrency N]
//   [--tokens N] [--reps N]`.
import { performance } from "node:perf_hooks";
import { pathToFileURL } from "node:url";

import { ucxVersion } from "../src/native/index.js";
import { DEFAULT_DEMO, type SidecarSummary } from "../sim/demo-types.js";
import { runDemo } from "../sim/demo.js";
import { PeerProcess } from "./native/peer-client.js";
import { type ModesCombo, comboName } from "./modes.js";
import {
  BenchArgs,
  type Stats,
  fmt,
  fmtP99,
  machineCpuSeconds,
  machineLine,
  markdownTable,
  processCpuSeconds,
  stats,
  table,
  runSuiteMain,
} from "./report.js";

export interface ControlBenchOptions {
  /** Requests measured per combination; default 3000. */
  requests?: number;
  /**
   * Requests before those, not measured (JIT compilation, first use of every path, the young
   * generation's growth), as the native reference warms up with its first 1000 round trips;
   * default 5000: measured in 1000-transfer windows, every process of the run (sidecars, engines,
   * router) reached its steady CPU per transfer only after 4000-6000 (docs/benchmarks.md).
   */
  warmup?: number;
  /** Requests in flight; default 64. */
  concurrency?: number;
  /** Prompt tokens per request; default 16 (one block). */
  tokens?: number;
  combos?: readonly ModesCombo[];
  /** Native round trips measured; default 20 000. */
  refReps?: number;
  /** Peers authenticate (mutual TLS, sealed notifications); default true. */
  peerAuth?: boolean;
  log?: (line: string) => void;
}

export interface ControlRow {
  mode: string;
  dispatch: string;
  /** Requests measured, after `warmup` that were not. */
  requests: number;
  warmup: number;
  /** Requests that became ready and were verified byte for byte (the rate counts these). */
  verified: number;
  /** The first few failures, if any. */
  failures: string[];
  bytesPerTransfer: number;
  seconds: number;
  transfersPerSec: number;
  /** CPU ms per transfer: prefill sidecar, decode sidecar, both. */
  pCpuMs: number;
  dCpuMs: number;
  sidecarCpuMs: number;
  /** This process (the simulated router, its gRPC watch and engine drivers), CPU ms per transfer. */
  routerCpuMs: number;
  /** The whole machine's busy share over the interval, 0..1 of all cores. */
  machineBusy: number;
  /** 1000 / max(pCpuMs, dCpuMs): what the busier sidecar could do with a core of its own. */
  sidecarBoundPerSec: number;
  /** P's prefill answer -> KV_READY heard, under this load. */
  kvReadyMs: Stats;
  /** The native round trips measured right after this row's workload, on the same machine state. */
  reference: ControlReference;
  /** transfersPerSec / the reference's round trips per second. */
  rateRatio: number;
  /** sidecarCpuMs / the reference's CPU ms per round trip. */
  cpuRatio: number;
}

export interface ControlReference {
  roundTrips: number;
  roundTripsPerSec: number;
  /** Both processes, CPU ms per round trip. */
  cpuMsPerRoundTrip: number;
}

export interface ControlBenchResult {
  bench: "control";
  machine: string;
  ucx: string;
  shape: string;
  /** The rows' references: the one of median rate (each row's ratios use its own). */
  reference: ControlReference;
  rows: ControlRow[];
}

/** The native notification round trip, one in flight, between two processes over shm. */
async function nativeRoundTrips(reps: number): Promise<ControlReference> {
  const p = new PeerProcess();
  const d = new PeerProcess();
  try {
    const ip = await p.call<{ address: string }>("init", { name: "ctl-p", transports: "shm,self" });
    const id = await d.call<{ address: string }>("init", { name: "ctl-d", transports: "shm,self" });
    await p.call("alloc", { size: 4096 });
    const kd = await d.call<{ key: string }>("alloc", { size: 4096 });
    await p.call("connect", { address: id.address });
    await p.call("import", { key: kd.key });
    // D answers every notification on its own endpoint back to P.
    await d.call("connect", { address: ip.address });
    await p.call("pingpong", { reps: Math.min(1000, reps), maxLen: 64, seed: 1 }, 60_000);
    const pids = [p.child.pid!, d.child.pid!];
    const cpu0 = pids.map(processCpuSeconds);
    const r = await p.call<{ reps: number; ms: number }>(
      "pingpong",
      { reps, maxLen: 64, seed: 2 },
      300_000,
    );
    const cpu = pids.map((pid, i) => processCpuSeconds(pid) - cpu0[i]!);
    return {
      roundTrips: r.reps,
      roundTripsPerSec: r.reps / (r.ms / 1000),
      cpuMsPerRoundTrip: ((cpu[0]! + cpu[1]!) * 1000) / r.reps,
    };
  } finally {
    await p.close();
    await d.close();
  }
}

interface CpuMark {
  t: number;
  p: number;
  d: number;
  router: number;
  machine: { busy: number; total: number };
}

function mark(sidecars: SidecarSummary[]): CpuMark {
  const pid = (role: string): number => {
    const s = sidecars.find((x) => x.role === role);
    if (s?.pid === undefined) throw new Error(`no pid for the ${role} sidecar`);
    return s.pid;
  };
  const u = process.cpuUsage();
  return {
    t: performance.now(),
    p: processCpuSeconds(pid("prefill")),
    d: processCpuSeconds(pid("decode")),
    router: (u.user + u.system) / 1e6,
    machine: machineCpuSeconds(),
  };
}

export const CONTROL_COMBOS: readonly ModesCombo[] = [
  { mode: "push", dispatch: "concurrent" },
  { mode: "pull", dispatch: "sequential" },
];

export async function runControlBench(opts: ControlBenchOptions = {}): Promise<ControlBenchResult> {
  const requests = opts.requests ?? 3000;
  const warmup = opts.warmup ?? 5000;
  const concurrency = opts.concurrency ?? 64;
  const tokens = opts.tokens ?? 16;
  const refReps = opts.refReps ?? 20_000;
  const log = opts.log ?? ((): void => {});
  const rows: Omit<ControlRow, "rateRatio" | "cpuRatio">[] = [];
  const references: ControlReference[] = [];
  for (const combo of opts.combos ?? CONTROL_COMBOS) {
    log(
      `control ${comboName(combo)}: ${warmup} requests to warm up, then ${requests} measured, ${concurrency} in flight ...`,
    );
    let sidecars: SidecarSummary[] = [];
    let start: CpuMark | undefined;
    let end: CpuMark | undefined;
    const summary = await runDemo({
      ...DEFAULT_DEMO,
      prefill: 1,
      decode: 1,
      pTp: 1,
      dTp: 1,
      pBlock: 16,
      dBlock: 16,
      // Files, as in every earlier run of this benchmark (the demo itself now defaults to segments).
      kvMemory: "file",
      layout: "hnd",
      model: "llama3-8b",
      layers: 1,
      kvHeads: 1,
      headDim: 64,
      mode: combo.mode,
      dispatch: combo.dispatch,
      requests: warmup + requests,
      promptTokens: [tokens],
      prefixTokens: 0,
      computeMs: 0,
      concurrency,
      recordRequests: true,
      peerAuth: opts.peerAuth ?? true,
      onStarted: (s) => {
        sidecars = s;
        if (warmup === 0) start = mark(s);
      },
      // The measured interval starts when the warm-up's last request is done (in completion
      // order, the order summary.requests keeps) and ends when the last measured one is: not
      // after the demo's check that every block came back, which polls and sleeps.
      progress: (done) => {
        if (done === warmup && warmup > 0) start = mark(sidecars);
        if (done === warmup + requests) end = mark(sidecars);
      },
    });
    if (start === undefined || end === undefined)
      throw new Error(`${comboName(combo)}: the run ended before its workload`);
    // A failed transfer is reported, not hidden: the rate counts only the verified ones.
    if (!summary.verified)
      log(`  ${comboName(combo)}: ${summary.failed} failed, first: ${summary.failures[0] ?? ""}`);
    const measured = summary.requests!.slice(warmup);
    const ok = measured.filter((r) => r.ok).length;
    const seconds = (end.t - start.t) / 1000;
    const per = (sec: number): number => (sec * 1000) / Math.max(1, ok);
    const pCpuMs = per(end.p - start.p);
    const dCpuMs = per(end.d - start.d);
    const recs = measured.filter((r) => r.ok);
    // Each row gets a reference measured right after it: this machine's speed drifts between
    // runs (the reference alone ranged from 5310 to 9190 round trips/s over four runs in an hour).
    log(
      `control reference after ${comboName(combo)}: ${refReps} native notification round trips ...`,
    );
    const reference = await nativeRoundTrips(refReps);
    references.push(reference);
    rows.push({
      mode: combo.mode,
      dispatch: combo.dispatch,
      requests,
      warmup,
      verified: ok,
      failures: summary.failures.slice(0, 5),
      bytesPerTransfer: summary.bytes / Math.max(1, ok),
      seconds,
      transfersPerSec: ok / seconds,
      pCpuMs,
      dCpuMs,
      sidecarCpuMs: pCpuMs + dCpuMs,
      routerCpuMs: per(end.router - start.router),
      machineBusy:
        (end.machine.busy - start.machine.busy) / (end.machine.total - start.machine.total),
      sidecarBoundPerSec: 1000 / Math.max(pCpuMs, dCpuMs),
      kvReadyMs: stats(recs.map((r) => r.readyMs - r.prefilledMs)),
      reference,
    });
  }
  const reference = medianReference(references);
  return {
    bench: "control",
    machine: machineLine(),
    ucx: ucxVersion,
    shape:
      `1 prefill + 1 decode sidecar, TP 1, llama3-8b shape cut to 1 layer, 1 KV head x 64, ${tokens} tokens ` +
      `per request, no compute, ${concurrency} in flight, ${requests} requests measured after ${warmup} to warm up, shm, ` +
      `peers ${opts.peerAuth === false ? "NOT authenticated" : "authenticated (mutual TLS)"}`,
    reference,
    rows: rows.map((r) => ({
      ...r,
      rateRatio: r.transfersPerSec / r.reference.roundTripsPerSec,
      cpuRatio: r.sidecarCpuMs / r.reference.cpuMsPerRoundTrip,
    })),
  };
}

/** The reference of the median rate among `refs` (the summary's; each row keeps its own). */
function medianReference(refs: readonly ControlReference[]): ControlReference {
  if (refs.length === 0) throw new Error("bench control: no combination ran, so no reference");
  const sorted = [...refs].sort((a, b) => a.roundTripsPerSec - b.roundTripsPerSec);
  return sorted[Math.floor((sorted.length - 1) / 2)]!;
}

const HEAD = [
  "mode",
  "verified",
  "transfers/s",
  "P CPU ms/xfer",
  "D CPU ms/xfer",
  "sidecars ms/xfer",
  "router ms/xfer",
  "machine busy",
  "sidecar-bound /s",
  "ready p50 ms",
  "p99 ms",
  "native RT/s (ref)",
  "native ms/RT (ref)",
  "rate ratio",
  "CPU ratio",
];

function cells(r: ControlRow): string[] {
  const ref = r.reference;
  return [
    `${r.mode}-${r.dispatch === "sequential" ? "seq" : "conc"}`,
    `${r.verified}/${r.requests}`,
    fmt(r.transfersPerSec, 0),
    fmt(r.pCpuMs, 3),
    fmt(r.dCpuMs, 3),
    fmt(r.sidecarCpuMs, 3),
    fmt(r.routerCpuMs, 3),
    `${fmt(r.machineBusy * 100, 0)}%`,
    fmt(r.sidecarBoundPerSec, 0),
    fmt(r.kvReadyMs.p50, 1),
    fmtP99(r.kvReadyMs, 1),
    fmt(ref.roundTripsPerSec, 0),
    fmt(ref.cpuMsPerRoundTrip, 3),
    fmt(r.rateRatio, 3),
    fmt(r.cpuRatio, 1),
  ];
}

export function formatControl(result: ControlBenchResult, markdown = false): string {
  return (markdown ? markdownTable : table)(
    HEAD,
    result.rows.map((r) => cells(r)),
  );
}

export const CONTROL_NOTES = [
  "  CPU: utime + stime of each sidecar process over the measured interval / transfers; router: this process",
  "  machine busy: the share of all cores busy over the interval (engines, router and sidecars share them)",
  "  sidecar-bound: 1000 / the busier sidecar's CPU ms per transfer",
  "  ready: P's prefill answer -> KV_READY heard by the router, under this load",
  "  native (reference): small WRITE + notification, acknowledged by a notification, one in flight, two processes over shm; measured right after each row",
  "  rate ratio = transfers/s / native round trips/s; CPU ratio = sidecars' CPU per transfer / native CPU per round trip",
].join("\n");

/** One line: the sidecar pair's rate against the native round trip, per mode. */
export function controlConclusion(result: ControlBenchResult): string {
  const parts = result.rows.map(
    (r) =>
      `${r.mode} ${fmt(r.transfersPerSec, 0)}/s (${fmt(r.rateRatio, 2)}x the native round trips, ` +
      `${fmt(r.sidecarCpuMs, 2)} ms of sidecar CPU per transfer)`,
  );
  return `conclusion: one sidecar pair sustained ${parts.join("; ")}`;
}

const USAGE =
  "usage: kvxfer bench control [--json] [--quick] [--requests N] [--warmup N] [--concurrency N] [--tokens N] [--reps N] [--peer-auth on|off]";

export function parseControlArgs(argv: readonly string[]): ControlBenchOptions & { json: boolean } {
  const a = new BenchArgs(argv, USAGE);
  const o: ControlBenchOptions & { json: boolean } = { json: a.has("--json") };
  if (a.has("--quick")) {
    o.requests = 600;
    o.warmup = 200;
    o.refReps = 5000;
  }
  const requests = a.number("--requests", 1);
  if (requests !== undefined) o.requests = requests;
  const warmup = a.number("--warmup", 0);
  if (warmup !== undefined) o.warmup = warmup;
  const conc = a.number("--concurrency", 1);
  if (conc !== undefined) o.concurrency = conc;
  const tokens = a.number("--tokens", 1);
  if (tokens !== undefined) o.tokens = tokens;
  const reps = a.number("--reps", 1);
  if (reps !== undefined) o.refReps = reps;
  const auth = a.string("--peer-auth");
  if (auth !== undefined) {
    if (auth !== "on" && auth !== "off")
      throw new Error(`--peer-auth takes on or off, got '${auth}'`);
    o.peerAuth = auth === "on";
  }
  a.done();
  return o;
}

export function main(argv: string[] = process.argv.slice(2)): Promise<ControlBenchResult> {
  return runSuiteMain("control", parseControlArgs(argv), runControlBench, (result) => [
    `\nkvxfer control: one sidecar pair, small transfers; ${result.machine}, UCX ${result.ucx}`,
    `  ${result.shape}`,
    formatControl(result),
    CONTROL_NOTES,
    controlConclusion(result),
  ]);
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href)
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
