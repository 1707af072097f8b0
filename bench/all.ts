// `kvxfer bench all`: every suite in sequence (native, plan, events, e2e, modes, control, peers), each
// printing its table with its reference, each writing bench/results/<suite>.json; then the plots.
// `kvxfer bench plot`: the plots alone, from the JSON files already there:
//   bench/results/native-bandwidth.svg  kvxfer WRITE/READ vs ucx_perftest put/get by message size
//                                       (memory allocated by UCX: ucx_perftest's default);
//   bench/results/modes-ttft.svg        simulated TTFT p50 vs prompt length by mode and dispatch;
//   bench/results/modes-kv-ready.svg    KV ready after prefill p50, the same way;
//   bench/results/peers-bandwidth-<transport>.svg  kvxfer, NIXL and Mooncake bandwidth by request size.
// `kvxfer bench native --json > bench/results/native.json` feeds the bandwidth plot too.
import { pathToFileURL } from "node:url";

import {
  type ControlBenchResult,
  formatControl,
  CONTROL_NOTES,
  runControlBench,
} from "./control.js";
import { type E2eBenchResult, E2E_NOTES, formatE2eRows, runE2eBench } from "./e2e.js";
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
import { machineLine, readJsonResult, writeJsonResult, writeResult } from "./report.js";
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

/** Draws every plot whose results exist; returns the files written. */
export function runPlots(log: (line: string) => void = console.log): string[] {
  const out: string[] = [];
  const native = readJsonResult<NativeResults>("native");
  if (native !== undefined && native.rows.some((r) => r.memory === "ucx"))
    out.push(writeResult("native-bandwidth.svg", bandwidthChart(native, "ucx")));
  else log("no bench/results/native.json with 'ucx' rows: run `kvxfer bench native` first");
  const modes = readJsonResult<ModesBenchResult>("modes");
  if (modes !== undefined) {
    out.push(writeResult("modes-ttft.svg", modesChart(modes, "ttftMs")));
    out.push(writeResult("modes-kv-ready.svg", modesChart(modes, "kvReadyMs")));
  } else log("no bench/results/modes.json: run `kvxfer bench modes` first");
  const peers = readJsonResult<PeersBenchResult>("peers");
  if (peers !== undefined) out.push(...writePeersCharts(peers));
  else log("no bench/results/peers.json: run `kvxfer bench peers` first");
  return out;
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
