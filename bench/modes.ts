// Push vs pull vs auto, with sequential and concurrent router dispatch, over a sweep of prompt
// lengths with simulated prefill compute, shaped like the vLLM push PR's table (#35264: rows by
// prompt length, TTFT of pull and push, and the ratio). Each (mode, dispatch) runs the demo's
// sidecars, simulated engines and router as processes; every byte is verified on D.
//
//   KV ready after prefill: P's engine answered prefill-done -> the router heard KV_READY from D's
//     sidecar over gRPC (performance.now in the router).
//   simulated TTFT: the router dispatched the request -> KV_READY heard, plus a fixed first decode
//     step (default 10 ms). Prefill compute is simulated at 0.05 ms per prompt token (a sleep in
//     P's engine) and is followed by P's engine writing the KV pattern, as the demo always does.
//
// The reference is pull with sequential dispatch (vLLM's default), in the same run; every other
// cell carries its ratio to it (below 1: faster). Pull needs P's block ids before D is told, so it
// has no concurrent dispatch; auto pulls when dispatch is sequential and pushes when concurrent.
//
// Run: `node dist/bench/modes.js [--json] [--quick] [--tokens 256,1024,...] [--requests N]
//   [--ms-per-token 0.05] [--decode-step-ms 10] [--concurrency 1] [--layers 4]`.
import { pathToFileURL } from "node:url";

import { DEFAULT_DEMO, type DemoRequestRecord } from "../sim/demo-types.js";
import { runDemo } from "../sim/demo.js";
import type { TransferMode } from "../src/sidecar/index.js";
import {
  BenchArgs,
  type Stats,
  fmt,
  fmtP99,
  machineLine,
  markdownTable,
  stats,
  table,
  writeResult,
  runSuiteMain,
} from "./report.js";
import { lineChart } from "./svg.js";

export type Dispatch = "sequential" | "concurrent";

export interface ModesCombo {
  mode: TransferMode;
  dispatch: Dispatch;
}

/** Pull-sequential first: it is the reference. */
export const MODES_COMBOS: readonly ModesCombo[] = [
  { mode: "pull", dispatch: "sequential" },
  { mode: "push", dispatch: "sequential" },
  { mode: "push", dispatch: "concurrent" },
  { mode: "auto", dispatch: "sequential" },
  { mode: "auto", dispatch: "concurrent" },
];

export interface ModesBenchOptions {
  /** Prompt lengths; default 256, 1024, 2048, 4096, 8192. */
  promptTokens?: number[];
  /** Simulated prefill compute per prompt token; default 0.05 ms. */
  computeMsPerToken?: number;
  /** Fixed simulated first decode step added to TTFT; default 10 ms. */
  decodeStepMs?: number;
  /** Measured requests per prompt length and combination; default 12. */
  requests?: number;
  /** Unmeasured requests per prompt length first (handshake, first touch); default 1. */
  warmupRounds?: number;
  /** Requests in flight; default 1. */
  concurrency?: number;
  /** Layers of the llama3-8b-shaped model; default 4. */
  layers?: number;
  pTp?: number;
  dTp?: number;
  pBlock?: number;
  dBlock?: number;
  combos?: readonly ModesCombo[];
  /**
   * Passes over the combinations, alternately forward and backward, each a fresh set of
   * processes with its own warm-up, the measured requests split between them: drift over the
   * run (caches, the router's JIT) then favours none. Default 2.
   */
  passes?: number;
  log?: (line: string) => void;
}

export interface ModesCell {
  mode: TransferMode;
  dispatch: Dispatch;
  tokens: number;
  computeMs: number;
  /** How the measured transfers moved (auto decides per transfer). */
  byMode: Record<string, number>;
  kvReadyMs: Stats;
  ttftMs: Stats;
  /** Ratios to pull-sequential at the same prompt length (p50 to p50, p99 to p99). */
  ttftRatioP50: number;
  ttftRatioP99: number;
  kvReadyRatioP50: number;
  kvReadyRatioP99: number;
}

export interface ModesBenchResult {
  bench: "modes";
  machine: string;
  shape: string;
  computeMsPerToken: number;
  decodeStepMs: number;
  concurrency: number;
  cells: ModesCell[];
  /** The first failures of each run, if any (failed requests are left out of the cells). */
  failures: string[];
}

export const comboName = (c: ModesCombo): string =>
  `${c.mode}-${c.dispatch === "sequential" ? "seq" : "conc"}`;

export async function runModesBench(opts: ModesBenchOptions = {}): Promise<ModesBenchResult> {
  const tokens = opts.promptTokens ?? [256, 1024, 2048, 4096, 8192];
  const perToken = opts.computeMsPerToken ?? 0.05;
  const decodeStepMs = opts.decodeStepMs ?? 10;
  const requests = opts.requests ?? 12;
  const warmup = opts.warmupRounds ?? 1;
  const concurrency = opts.concurrency ?? 1;
  const layers = opts.layers ?? 4;
  const pTp = opts.pTp ?? 1;
  const dTp = opts.dTp ?? 1;
  const pBlock = opts.pBlock ?? 16;
  const dBlock = opts.dBlock ?? 16;
  const log = opts.log ?? ((): void => {});
  const passes = Math.max(1, Math.min(opts.passes ?? 2, requests));
  const combos = opts.combos ?? MODES_COMBOS;

  const failures: string[] = [];
  const runCombo = async (combo: ModesCombo, perLength: number): Promise<DemoRequestRecord[]> => {
    const summary = await runDemo({
      ...DEFAULT_DEMO,
      prefill: 1,
      decode: 1,
      pTp,
      dTp,
      pBlock,
      dBlock,
      // Files, as in every earlier run of this benchmark (the demo itself now defaults to segments).
      kvMemory: "file",
      layout: "hnd",
      model: "llama3-8b",
      layers,
      mode: combo.mode,
      dispatch: combo.dispatch,
      requests: tokens.length * (warmup + perLength),
      promptTokens: tokens,
      prefixTokens: 0,
      computeMs: 0,
      computeMsPerToken: perToken,
      concurrency,
      recordRequests: true,
    });
    // A failed request is reported and left out of the figures, not hidden.
    if (!summary.verified)
      log(
        `  ${comboName(combo)}: ${summary.failed} request(s) failed, first: ${summary.failures[0] ?? "?"}`,
      );
    failures.push(...summary.failures.slice(0, 3));
    // Requests are numbered in dispatch order and cycle through the prompt lengths: the first
    // round of each length warms up.
    return summary.requests!.filter((r) => {
      const n = Number(/^req-(\d+)-/.exec(r.transferId)?.[1] ?? -1);
      return r.ok && n >= tokens.length * warmup;
    });
  };

  const records = new Map<string, DemoRequestRecord[]>();
  for (let pass = 0; pass < passes; pass++) {
    // The measured requests split between the passes (the last may take fewer).
    const perPass = Math.min(
      Math.ceil(requests / passes),
      requests - pass * Math.ceil(requests / passes),
    );
    if (perPass <= 0) break;
    for (const combo of pass % 2 === 0 ? combos : [...combos].reverse()) {
      log(
        `modes ${comboName(combo)} (pass ${pass + 1}/${passes}): ${tokens.length * (warmup + perPass)} requests ...`,
      );
      const recs = await runCombo(combo, perPass);
      records.set(comboName(combo), [...(records.get(comboName(combo)) ?? []), ...recs]);
    }
  }

  const cells: ModesCell[] = [];
  for (const combo of combos) {
    const recs = records.get(comboName(combo)) ?? [];
    for (const t of tokens) {
      const mine = recs.filter((r) => r.tokens === t);
      const byMode: Record<string, number> = {};
      for (const r of mine) byMode[r.mode] = (byMode[r.mode] ?? 0) + 1;
      cells.push({
        ...combo,
        tokens: t,
        computeMs: mine[0]?.computeMs ?? Math.round(perToken * t),
        byMode,
        kvReadyMs: stats(mine.map((r) => r.readyMs - r.prefilledMs)),
        ttftMs: stats(mine.map((r) => r.readyMs - r.dispatchedMs + decodeStepMs)),
        ttftRatioP50: NaN,
        ttftRatioP99: NaN,
        kvReadyRatioP50: NaN,
        kvReadyRatioP99: NaN,
      });
    }
  }
  for (const c of cells) {
    const ref = cells.find(
      (r) => r.mode === "pull" && r.dispatch === "sequential" && r.tokens === c.tokens,
    );
    if (ref === undefined) continue;
    c.ttftRatioP50 = c.ttftMs.p50 / ref.ttftMs.p50;
    c.ttftRatioP99 = c.ttftMs.p99 / ref.ttftMs.p99;
    c.kvReadyRatioP50 = c.kvReadyMs.p50 / ref.kvReadyMs.p50;
    c.kvReadyRatioP99 = c.kvReadyMs.p99 / ref.kvReadyMs.p99;
  }
  return {
    bench: "modes",
    machine: machineLine(),
    shape:
      `llama3-8b shape with ${layers} layers (8 KV heads x 128, bfloat16, HND), P TP ${pTp} block ${pBlock} -> ` +
      `D TP ${dTp} block ${dBlock}, shm; ${requests} measured requests per cell over ${passes} passes, each after ${warmup} warm-up, ` +
      `${concurrency} in flight; compute ${perToken} ms/token; TTFT adds a ${decodeStepMs} ms first decode step`,
    computeMsPerToken: perToken,
    decodeStepMs,
    concurrency,
    cells,
    failures,
  };
}

function combosOf(result: ModesBenchResult): ModesCombo[] {
  const seen = new Map<string, ModesCombo>();
  for (const c of result.cells) seen.set(comboName(c), { mode: c.mode, dispatch: c.dispatch });
  return [...seen.values()];
}

/** One table per metric: rows prompt length; per combination "p50 / p99" and the p50 ratio to pull-seq. */
function tableParts(
  result: ModesBenchResult,
  metric: "ttftMs" | "kvReadyMs",
): { head: string[]; rows: string[][] } {
  const combos = combosOf(result);
  const head = ["tokens", "compute ms"];
  for (const c of combos) {
    const ref = c.mode === "pull" && c.dispatch === "sequential";
    head.push(`${comboName(c)}${ref ? " (ref)" : ""} p50 / p99`);
    if (!ref) head.push("x ref");
  }
  const tokens = [...new Set(result.cells.map((c) => c.tokens))];
  const rows = tokens.map((t) => {
    const row = [String(t), String(result.cells.find((c) => c.tokens === t)?.computeMs ?? "")];
    for (const combo of combos) {
      const c = result.cells.find(
        (x) => x.tokens === t && x.mode === combo.mode && x.dispatch === combo.dispatch,
      );
      const ref = combo.mode === "pull" && combo.dispatch === "sequential";
      row.push(c === undefined ? "-" : `${fmt(c[metric].p50, 1)} / ${fmtP99(c[metric], 1)}`);
      if (!ref) {
        const ratio = metric === "ttftMs" ? c?.ttftRatioP50 : c?.kvReadyRatioP50;
        row.push(ratio === undefined || !Number.isFinite(ratio) ? "-" : `${fmt(ratio)}x`);
      }
    }
    return row;
  });
  return { head, rows };
}

export function formatModesTables(result: ModesBenchResult, markdown = false): string {
  const render = markdown ? markdownTable : table;
  const ttft = tableParts(result, "ttftMs");
  const ready = tableParts(result, "kvReadyMs");
  return [
    "simulated TTFT, ms (dispatch -> KV_READY heard by the router, + first decode step)",
    render(ttft.head, ttft.rows),
    "",
    "KV ready after prefill, ms (P's prefill answer -> KV_READY heard by the router)",
    render(ready.head, ready.rows),
  ].join("\n");
}

/** TTFT (or KV-ready) p50 vs prompt length, one line per combination; pull-seq dashed. */
export function modesChart(result: ModesBenchResult, metric: "ttftMs" | "kvReadyMs"): string {
  return lineChart({
    title:
      metric === "ttftMs"
        ? "Simulated TTFT vs prompt length, by transfer mode (p50)"
        : "KV ready after prefill vs prompt length, by transfer mode (p50)",
    subtitle: `${result.shape.split(";")[0]}; ${result.machine.split(",").slice(0, 2).join(",")}`,
    xLabel: "prompt tokens",
    yLabel: metric === "ttftMs" ? "TTFT p50 (ms)" : "KV ready p50 (ms)",
    logX: true,
    xTicks: [...new Set(result.cells.map((c) => c.tokens))],
    series: combosOf(result).map((combo) => ({
      name: `${comboName(combo)}${combo.mode === "pull" && combo.dispatch === "sequential" ? " (ref)" : ""}`,
      dashed: combo.mode === "pull" && combo.dispatch === "sequential",
      points: result.cells
        .filter((c) => c.mode === combo.mode && c.dispatch === combo.dispatch)
        .map((c) => [c.tokens, c[metric].p50] as const),
    })),
  });
}

const USAGE =
  "usage: kvxfer bench modes [--json] [--quick] [--tokens 256,1024,...] [--requests N] [--ms-per-token X] [--decode-step-ms N] [--concurrency N] [--layers N]";

export function parseModesArgs(argv: readonly string[]): ModesBenchOptions & { json: boolean } {
  const a = new BenchArgs(argv, USAGE);
  const o: ModesBenchOptions & { json: boolean } = { json: a.has("--json") };
  if (a.has("--quick")) {
    o.promptTokens = [256, 2048, 8192];
    o.requests = 4;
  }
  const tokens = a.ints("--tokens");
  if (tokens !== undefined) o.promptTokens = tokens;
  const requests = a.number("--requests", 1);
  if (requests !== undefined) o.requests = requests;
  const perToken = a.number("--ms-per-token", 0);
  if (perToken !== undefined) o.computeMsPerToken = perToken;
  const step = a.number("--decode-step-ms", 0);
  if (step !== undefined) o.decodeStepMs = step;
  const conc = a.number("--concurrency", 1);
  if (conc !== undefined) o.concurrency = conc;
  const layers = a.number("--layers", 1);
  if (layers !== undefined) o.layers = layers;
  a.done();
  return o;
}

export function main(argv: string[] = process.argv.slice(2)): Promise<ModesBenchResult> {
  return runSuiteMain(
    "modes",
    parseModesArgs(argv),
    runModesBench,
    (result) => [
      `\nkvxfer modes: push vs pull vs auto; ${result.machine}`,
      `  ${result.shape}`,
      formatModesTables(result),
      "  x ref: p50 ratio to pull-seq at the same length (below 1: faster); pull has no concurrent dispatch (D needs P's block ids)",
      ...result.failures.map((f) => `  failed (left out): ${f}`),
    ],
    (result) => [
      writeResult("modes-ttft.svg", modesChart(result, "ttftMs")),
      writeResult("modes-kv-ready.svg", modesChart(result, "kvReadyMs")),
    ],
  );
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href)
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
