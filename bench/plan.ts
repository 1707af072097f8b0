// Time to build transfer plans at the scale users report. Run: `node dist/bench/plan.js [--json]
// [--runs N] [--case NAME]...`. Next to each time it prints two floors measured in the same run:
// writing the same number of uncoalesced triples into an already-used Float64Array (the least any
// planner emitting descriptors one by one must compute), and into a new one (adding the cost of
// touching fresh memory, which dominates at millions of descriptors).
import { pathToFileURL } from "node:url";
import {
  type KvBlockOrder,
  type KvLayout,
  type KvRegionScheme,
  type TransferPlan,
  kvLayout,
  planTransfer,
} from "../src/plan/index.js";

export interface PlanBenchOptions {
  /** Timed runs per case after warm-up (the median is reported); default 7. */
  readonly runs?: number;
  /** Untimed runs per case first, the first of them reported as `firstMs`; default 3. */
  readonly warmup?: number;
  /** Case names to run (default: all). */
  readonly cases?: readonly string[];
}

export interface PlanBenchResult {
  readonly case: string;
  readonly description: string;
  readonly rankPairs: number;
  readonly bytes: number;
  readonly rawDescriptors: number;
  readonly descriptors: number;
  /** Median milliseconds to build the plan. */
  readonly ms: number;
  readonly minMs: number;
  /** The first build of the case in this process (before warm-up; the first case pays for JIT). */
  readonly firstMs: number;
  /** Median milliseconds to write `rawDescriptors` triples into an already-used Float64Array. */
  readonly floorMs: number;
  /** The same into a newly allocated Float64Array (first touch of fresh memory included). */
  readonly freshFloorMs: number;
  /** Target from the issue, where there is one. */
  readonly targetMs?: number;
}

interface BenchCase {
  readonly name: string;
  readonly description: string;
  readonly src: KvLayout;
  readonly dst: KvLayout;
  readonly numTokens: number;
  readonly srcBlockIds: Int32Array;
  readonly dstBlockIds: Int32Array;
  readonly targetMs?: number;
}

interface Model {
  readonly numLayers: number;
  readonly mla: boolean;
  readonly totalKvHeads: number;
  readonly headDim: number;
}

function layout(
  model: Model,
  tpSize: number,
  blockSize: number,
  numBlocks: number,
  scheme: KvRegionScheme,
  order: KvBlockOrder = "HND",
): KvLayout {
  return kvLayout(
    {
      ...model,
      dtype: "bfloat16",
      dtypeBytes: 2,
      blockSize,
      numBlocks,
      order,
      tpSize,
      tpRank: 0,
    },
    scheme,
  );
}

/** Block ids `count` long out of `numBlocks`: a contiguous run, or a seeded shuffle of them all. */
function blockIds(count: number, numBlocks: number, shuffled: boolean, seed: number): Int32Array {
  if (!shuffled) return Int32Array.from({ length: count }, (_, i) => i);
  const all = Int32Array.from({ length: numBlocks }, (_, i) => i);
  let a = seed >>> 0;
  for (let i = all.length - 1; i > 0; i--) {
    a = (Math.imul(a, 1664525) + 1013904223) >>> 0;
    const j = a % (i + 1);
    const t = all[i]!;
    all[i] = all[j]!;
    all[j] = t;
  }
  return all.subarray(0, count);
}

// GLM-5-style MLA (78 layers, one 576-wide bf16 latent, block 64), sized so one rank pair has
// 78 x 1436 = 112 008 per-(layer, block) descriptors, the count vLLM #55434 reports per
// rank-transfer on GB200. The layer count is our assumption about that model; the descriptor
// count is what matters.
const glmMla: Model = { numLayers: 78, mla: true, totalKvHeads: 1, headDim: 576 };
const llama70b: Model = { numLayers: 80, mla: false, totalKvHeads: 8, headDim: 128 };
const llama8b: Model = { numLayers: 32, mla: false, totalKvHeads: 8, headDim: 128 };

function buildCases(): BenchCase[] {
  const cases: BenchCase[] = [];
  const glmBlocks = 1436;
  for (const shuffled of [false, true]) {
    const n = glmBlocks * 64;
    cases.push({
      name: `glm-mla-112k-${shuffled ? "shuffled" : "contiguous"}`,
      description: `MLA 78 layers x 576, block 64, ${n} tokens, TP 1 -> 1, ${shuffled ? "shuffled" : "contiguous"} ids`,
      src: layout(glmMla, 1, 64, 4 * glmBlocks, "region-per-layer-kv"),
      dst: layout(glmMla, 1, 64, 4 * glmBlocks, "region-per-layer-kv"),
      numTokens: n,
      srcBlockIds: blockIds(glmBlocks, 4 * glmBlocks, shuffled, 1),
      dstBlockIds: blockIds(glmBlocks, 4 * glmBlocks, shuffled, 2),
      targetMs: 20,
    });
  }
  const tokens = 128 * 1024;
  const blocks = tokens / 16;
  for (const [tpP, tpD, scheme] of [
    [8, 4, "region-per-layer"],
    [4, 4, "region-per-layer"],
    [8, 8, "one-region-blocks-first"],
  ] as const) {
    for (const shuffled of [false, true]) {
      const tag = scheme === "region-per-layer" ? "" : "-cross-layer";
      cases.push({
        name: `llama70b-128k-tp${tpP}to${tpD}${tag}-${shuffled ? "shuffled" : "contiguous"}`,
        description: `Llama-3-70B 80 layers, 8 KV heads, block 16, ${tokens} tokens, HND ${scheme}, TP ${tpP} -> ${tpD}, ${shuffled ? "shuffled" : "contiguous"} ids`,
        src: layout(llama70b, tpP, 16, 2 * blocks, scheme),
        dst: layout(llama70b, tpD, 16, 2 * blocks, scheme),
        numTokens: tokens,
        srcBlockIds: blockIds(blocks, 2 * blocks, shuffled, 3),
        dstBlockIds: blockIds(blocks, 2 * blocks, shuffled, 4),
      });
    }
  }
  // vLLM's CPU backend: one buffer [layer][block][head][K rows][V rows] (head stride = 2 blocks of
  // rows), and the fused cells of its GPU backends ([block][token][head][K dims, V dims] per
  // layer); Llama-3-8B, block 32, 8192 tokens.
  const cpuTokens = 8192;
  const cpuBlocks = cpuTokens / 32;
  for (const [tag, scheme, order, shuffled] of [
    ["vllm-cpu", "one-region-kv-in-block", "HND", false],
    ["vllm-cpu", "one-region-kv-in-block", "HND", true],
    ["fused-cells", "region-per-layer-kv-in-cell", "NHD", false],
  ] as const) {
    const ids = shuffled ? "shuffled" : "contiguous";
    cases.push({
      name: `${tag}-llama8b-8k-${ids}`,
      description: `Llama-3-8B 32 layers, 8 KV heads, block 32, ${cpuTokens} tokens, ${order} ${scheme}, TP 1 -> 1, ${ids} ids`,
      src: layout(llama8b, 1, 32, 2 * cpuBlocks, scheme, order),
      dst: layout(llama8b, 1, 32, 2 * cpuBlocks, scheme, order),
      numTokens: cpuTokens,
      srcBlockIds: blockIds(cpuBlocks, 2 * cpuBlocks, shuffled, 5),
      dstBlockIds: blockIds(cpuBlocks, 2 * cpuBlocks, shuffled, 6),
    });
  }
  return cases;
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2;
}

/** Writes `count` triples into `out` (or a new array); returns milliseconds. */
function writeTriples(count: number, out?: Float64Array): number {
  const t0 = performance.now();
  const d = out ?? new Float64Array(3 * count);
  for (let i = 0, j = 0; i < count; i++, j += 3) {
    d[j] = i * 4096;
    d[j + 1] = i * 8192;
    d[j + 2] = 4096;
  }
  const ms = performance.now() - t0;
  if (d[3 * count - 1] === -1) throw new Error("unreachable"); // keeps the writes observable
  return ms;
}

/** Runs the plan benchmark and returns one result per case. */
export function runPlanBench(opts: PlanBenchOptions = {}): PlanBenchResult[] {
  const runs = Math.max(1, opts.runs ?? 7);
  const warmup = Math.max(1, opts.warmup ?? 3);
  const results: PlanBenchResult[] = [];
  for (const c of buildCases()) {
    if (opts.cases && !opts.cases.includes(c.name)) continue;
    const req = { numTokens: c.numTokens, srcBlockIds: c.srcBlockIds, dstBlockIds: c.dstBlockIds };
    let t0 = performance.now();
    let plan: TransferPlan = planTransfer(c.src, c.dst, req);
    const firstMs = performance.now() - t0;
    for (let i = 1; i < warmup; i++) plan = planTransfer(c.src, c.dst, req);
    const times: number[] = [];
    for (let i = 0; i < runs; i++) {
      t0 = performance.now();
      plan = planTransfer(c.src, c.dst, req);
      times.push(performance.now() - t0);
    }
    const raw = plan.rawDescriptorCount;
    const warm = new Float64Array(3 * raw);
    const warmFloors: number[] = [];
    const freshFloors: number[] = [];
    for (let i = 0; i < warmup + runs; i++) {
      const w = writeTriples(raw, warm);
      const f = writeTriples(raw);
      if (i >= warmup) {
        warmFloors.push(w);
        freshFloors.push(f);
      }
    }
    const result: PlanBenchResult = {
      case: c.name,
      description: c.description,
      rankPairs: plan.pairs.length,
      bytes: plan.bytes,
      rawDescriptors: plan.rawDescriptorCount,
      descriptors: plan.descriptorCount,
      ms: median(times),
      minMs: Math.min(...times),
      firstMs,
      floorMs: median(warmFloors),
      freshFloorMs: median(freshFloors),
      ...(c.targetMs !== undefined ? { targetMs: c.targetMs } : {}),
    };
    results.push(result);
  }
  return results;
}

/** The results as a plain-text table. */
export function formatPlanBench(results: readonly PlanBenchResult[]): string {
  const head = [
    "case",
    "pairs",
    "GiB",
    "descriptors raw",
    "coalesced",
    "ms (median)",
    "ms (min)",
    "first ms",
    "floor ms",
    "fresh floor ms",
    "target ms",
  ];
  const rows = results.map((r) => [
    r.case,
    String(r.rankPairs),
    (r.bytes / 2 ** 30).toFixed(2),
    r.rawDescriptors.toLocaleString("en-US"),
    r.descriptors.toLocaleString("en-US"),
    r.ms.toFixed(2),
    r.minMs.toFixed(2),
    r.firstMs.toFixed(2),
    r.floorMs.toFixed(2),
    r.freshFloorMs.toFixed(2),
    r.targetMs === undefined ? "" : `< ${r.targetMs}`,
  ]);
  const widths = head.map((h, i) => Math.max(h.length, ...rows.map((row) => row[i]!.length)));
  const line = (cells: string[]) =>
    cells
      .map((cell, i) => (i === 0 ? cell.padEnd(widths[i]!) : cell.padStart(widths[i]!)))
      .join("  ");
  return [line(head), ...rows.map(line)].join("\n");
}

function parseArgs(argv: readonly string[]): PlanBenchOptions & { json: boolean } {
  let json = false;
  let runs: number | undefined;
  const cases: string[] = [];
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    if (a === "--json") json = true;
    else if (a === "--runs") runs = Number(argv[++i]);
    else if (a === "--case") cases.push(argv[++i] ?? "");
    else throw new Error(`unknown argument ${a} (use --json, --runs N, --case NAME)`);
  }
  return {
    json,
    ...(runs !== undefined ? { runs } : {}),
    ...(cases.length ? { cases } : {}),
  };
}

export function main(argv: string[] = process.argv.slice(2)): void {
  const opts = parseArgs(argv);
  const results = runPlanBench(opts);
  if (opts.json) {
    process.stdout.write(
      JSON.stringify({ bench: "plan", node: process.version, results }, null, 2) + "\n",
    );
  } else {
    process.stdout.write(formatPlanBench(results) + "\n");
    for (const r of results) process.stdout.write(`  ${r.case}: ${r.description}\n`);
  }
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) main();
