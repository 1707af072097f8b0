// `kvxfer bench all`: every suite in sequence (native, plan, events, e2e, modes, control, peers), each
// printing its table with its reference, each writing bench/results/<suite>.json; then the plots.
// `kvxfer bench plot`: the plots alone, from the JSON files already there (each also as .png
// next to it, rendered with resvg):
//   bench/results/native-bandwidth.svg  kvxfer WRITE/READ vs ucx_perftest put/get by message size
//                                       (memory allocated by UCX: ucx_perftest's default);
//   bench/results/e2e-latency.svg       sidecar vs native p50 by request size, push and pull;
//   bench/results/modes-ttft.svg        simulated TTFT p50 vs prompt length by mode and dispatch;
//   bench/results/modes-kv-ready.svg    KV ready after prefill p50, the same way;
//   bench/results/peers-bandwidth-<transport>.svg  kvxfer, NIXL and Mooncake bandwidth by request size.
// `kvxfer bench native` writes bench/results/native.json too (the bandwidth plot's input).
// A results file missing, garbled or of another shape is named with why; `bench plot` exits 1
// when it drew nothing.
import { join } from "node:path";
import { pathToFileURL } from "node:url";

import {
  type ControlBenchResult,
  formatControl,
  CONTROL_NOTES,
  runControlBench,
} from "./control.js";
import { type E2eBenchResult, E2E_NOTES, e2eChart, formatE2eRows, runE2eBench } from "./e2e.js";
import { formatEventsBench, runEventsBench } from "./events.js";
import { type ModesBenchResult, formatModesTables, modesChart, runModesBench } from "./modes.js";
import { formatNativeTable, runNativeBench, type NativeBenchRow } from "./native.js";
import { formatPlanBench, runPlanBench } from "./plan.js";
import {
  type PeersBenchResult,
  PEERS_NOTES,
  formatPeers,
  parsePeersArgs,
  runPeersBench,
  statusLines,
  writePeersCharts,
} from "./peers.js";
import { machineLine, readJsonResult, resultsDir, writeChart, writeJsonResult } from "./report.js";
import { lineChart, shortBytes } from "./svg.js";

interface NativeResults {
  bench: "native";
  transports?: string;
  rows: NativeBenchRow[];
}

/** Bandwidth vs message size: kvxfer WRITE and READ next to ucx_perftest put and get (dashed). */
export function bandwidthChart(native: NativeResults, memory: "ucx" | "host" = "ucx"): string {
  const rows = native.rows.filter((r) => r.memory === memory);
  const pts = (f: (r: NativeBenchRow) => number): [number, number][] =>
    rows.map((r) => [r.size, f(r)]);
  return lineChart({
    title: "Bandwidth vs message size: kvxfer native vs ucx_perftest",
    subtitle: `two processes, UCX_TLS=${native.transports ?? "shm,self"}, ${memory === "ucx" ? "memory allocated by UCX" : "registered host memory"}; ${machineLine().split(",").slice(0, 2).join(",")}`,
    xLabel: "message size (bytes)",
    yLabel: "GB/s",
    logX: true,
    xTickFormat: shortBytes,
    series: [
      { name: "kvxfer WRITE", points: pts((r) => r.kvxferWriteGBps), color: "#1f77b4" },
      {
        name: "ucx_perftest put (ref)",
        points: pts((r) => r.perftestPutGBps),
        color: "#1f77b4",
        dashed: true,
      },
      { name: "kvxfer READ", points: pts((r) => r.kvxferReadGBps), color: "#d62728" },
      {
        name: "ucx_perftest get (ref)",
        points: pts((r) => r.perftestGetGBps),
        color: "#d62728",
        dashed: true,
      },
    ],
  });
}

/** What `plots()` drew, and each results file it could not draw from (path and reason). */
export interface PlotsOutcome {
  files: string[];
  problems: string[];
}

/**
 * Draws every plot whose results exist. A results file that is missing, does not parse, or
 * does not hold what its plot needs is a problem naming the file and why; the other plots are
 * still drawn.
 */
export function plots(): PlotsOutcome {
  const files: string[] = [];
  const problems: string[] = [];
  const from = <T>(suite: string, draw: (result: T) => string[], missing: string): void => {
    const path = join(resultsDir(), `${suite}.json`);
    let result: T | undefined;
    try {
      result = readJsonResult<T>(suite);
    } catch (err) {
      problems.push(`${path}: cannot read it: ${(err as Error).message}`);
      return;
    }
    if (result === undefined) {
      problems.push(`${path}: not there: ${missing}`);
      return;
    }
    try {
      files.push(...draw(result));
    } catch (err) {
      problems.push(
        `${path}: not a \`kvxfer bench ${suite}\` result (${(err as Error).message}); run it again`,
      );
    }
  };
  from<NativeResults>(
    "native",
    (native) => {
      if (!Array.isArray(native.rows)) throw new Error("no 'rows' list");
      if (!native.rows.some((r) => r.memory === "ucx"))
        throw new Error("no rows with memory 'ucx'");
      return [...writeChart("native-bandwidth.svg", bandwidthChart(native, "ucx"))];
    },
    "run `kvxfer bench native` first (its 'ucx' rows are plotted)",
  );
  from<E2eBenchResult>(
    "e2e",
    (e2e) => {
      if (!Array.isArray(e2e.rows)) throw new Error("no 'rows' list");
      if (e2e.rows.length === 0) throw new Error("no rows");
      return writeChart("e2e-latency.svg", e2eChart(e2e));
    },
    "run `kvxfer bench e2e` first",
  );
  from<ModesBenchResult>(
    "modes",
    (modes) => {
      if (!Array.isArray(modes.cells)) throw new Error("no 'cells' list");
      return [
        ...writeChart("modes-ttft.svg", modesChart(modes, "ttftMs")),
        ...writeChart("modes-kv-ready.svg", modesChart(modes, "kvReadyMs")),
      ];
    },
    "run `kvxfer bench modes` first",
  );
  from<PeersBenchResult>(
    "peers",
    (peers) => {
      if (!Array.isArray(peers.bw)) throw new Error("no 'bw' list");
      return writePeersCharts(peers);
    },
    "run `kvxfer bench peers` first",
  );
  return { files, problems };
}

/** Draws every plot whose results exist (problems go to `log`); returns the files written. */
export function runPlots(log: (line: string) => void = console.log): string[] {
  const { files, problems } = plots();
  for (const p of problems) log(p);
  return files;
}

export async function main(argv: string[] = process.argv.slice(2)): Promise<void> {
  const quick = argv.includes("--quick");
  const extra = argv.filter((a) => a !== "--quick");
  if (extra.length > 0) throw new Error(`unknown argument ${extra[0]!} (bench all takes --quick)`);
  const log = (l: string): void => console.log(l);
  const section = (name: string): void => console.log(`\n=== ${name} === ${machineLine()}`);

  section("native: kvxfer vs ucx_perftest");
  const nativeOpts = quick
    ? {
        sizes: [4 << 10, 64 << 10, 1 << 20, 16 << 20],
        memories: ["ucx" as const],
        targetBytes: 2 ** 30,
      }
    : {};
  console.log(formatNativeTable([]));
  const nativeRows = await runNativeBench({ ...nativeOpts, log });
  writeJsonResult("native", { bench: "native", transports: "shm,self", rows: nativeRows });

  section("plan: planner scaling");
  const plan = runPlanBench(quick ? { runs: 3 } : {});
  console.log(formatPlanBench(plan));
  writeJsonResult("plan", { bench: "plan", node: process.version, results: plan });

  section("events: KV_READY -> gRPC watcher");
  const events = await runEventsBench(quick ? { latencyEvents: 500, burstEvents: 10_000 } : {});
  console.log(formatEventsBench(events));
  writeJsonResult("events", { bench: "events", node: process.version, results: events });

  section("e2e: full sidecars vs the native addon alone");
  const e2e: E2eBenchResult = await runE2eBench(
    quick ? { promptTokens: [128, 2048, 8192], rounds: 3, refReps: 2, log } : { log },
  );
  console.log(`  ${e2e.shape}`);
  console.log(formatE2eRows(e2e.rows));
  console.log(E2E_NOTES);
  writeJsonResult("e2e", e2e);

  section("modes: push vs pull vs auto");
  const modes: ModesBenchResult = await runModesBench(
    quick ? { promptTokens: [256, 2048, 8192], requests: 4, log } : { log },
  );
  console.log(`  ${modes.shape}`);
  console.log(formatModesTables(modes));
  writeJsonResult("modes", modes);

  section("control: one sidecar pair, small transfers");
  const control: ControlBenchResult = await runControlBench(
    quick ? { requests: 600, refReps: 5000, log } : { log },
  );
  console.log(`  ${control.shape}`);
  console.log(formatControl(control));
  console.log(CONTROL_NOTES);
  writeJsonResult("control", control);

  section("peers: kvxfer vs NIXL vs Mooncake (missing peers are reported, not skipped)");
  const peers = await runPeersBench({
    json: false,
    log,
    ...(quick ? parsePeersArgs(["--quick"]) : {}),
  });
  for (const line of statusLines(peers)) console.log(line);
  console.log(formatPeers(peers));
  console.log(PEERS_NOTES);
  writeJsonResult("peers", peers);

  section("plots");
  for (const f of runPlots(log)) console.log(`  ${f}`);
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href)
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
