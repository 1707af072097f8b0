// `kvxfer bench vllm`: a real vLLM P/D pair (CPU build, a random-weight model made here) through
// kvxfer sidecars, against one engine alone, in the same run. The measurement runs in Python
// (connectors/vllm/kvxfer_vllm_testing/bench.py, in the project's .venv); this prints its table with the
// ratio to the single engine and writes bench/results/vllm.json. Flags go to the Python side:
// [--lengths 32,256,1024] [--requests N] [--output-tokens N] [--modes pull,push]
// [--placements shared,host_buffer] [--kv-memory file,segment] [--quick] [--json].
import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

import { fmt, markdownTable, packageRoot, runSuiteMain, table } from "./report.js";

interface Dist {
  p50: number;
  p99: number;
  n: number;
}

interface VllmRow {
  placement: string;
  /** Where the shared KV lived: files, or segments the sidecars allocated (absent: files). */
  kv_memory?: "file" | "segment";
  tokens: number;
  mode: "one" | "pull" | "push";
  ttft_ms: Dist;
  e2e_ms: Dist;
  kv_bytes: number;
}

export interface VllmBenchResult {
  machine: string;
  vllm: string;
  model: {
    layers: number;
    kv_heads: number;
    head_dim: number;
    dtype: string;
    kv_bytes_per_token: number;
  };
  output_tokens: number;
  rows: VllmRow[];
}

interface VllmBenchOptions {
  json: boolean;
  args: string[];
  log?: (line: string) => void;
}

/** connectors/vllm first on PYTHONPATH: the testing package, and this checkout's connector. */
function pythonPath(root: string): string {
  const own = join(root, "connectors", "vllm");
  return process.env.PYTHONPATH ? `${own}:${process.env.PYTHONPATH}` : own;
}

function runPython(args: string[], log?: (line: string) => void): Promise<VllmBenchResult> {
  const root = packageRoot();
  const py = join(root, ".venv", "bin", "python");
  if (!existsSync(py)) {
    return Promise.reject(
      new Error(`${py} is missing: run 'npm run quickstart' (scripts/setup-python.sh) first`),
    );
  }
  return new Promise((resolve, reject) => {
    const child = spawn(py, ["-m", "kvxfer_vllm_testing.bench", ...args], {
      cwd: root,
      // The testing package is not installed (the wheel ships only the connector): it runs from the checkout.
      env: { ...process.env, PYTHONPATH: pythonPath(root) },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    let err = "";
    child.stdout.on("data", (b: Buffer) => (out += b.toString()));
    child.stderr.on("data", (b: Buffer) => {
      err += b.toString();
      for (const line of b.toString().split("\n"))
        if (/^\s*(starting|\S+ \d+ tokens)/.test(line)) log?.(line);
    });
    // The measurement owns engines and sidecars: a stopped parent stops it (it cleans up on SIGTERM).
    const stop = (): void => void child.kill("SIGTERM");
    process.once("SIGTERM", stop);
    process.once("SIGINT", stop);
    child.on("error", reject);
    child.on("exit", (code) => {
      process.off("SIGTERM", stop);
      process.off("SIGINT", stop);
      if (code !== 0)
        return reject(new Error(`kvxfer_vllm_testing.bench exited ${code}:\n${err.slice(-3000)}`));
      try {
        resolve(JSON.parse(out.trim().split("\n").pop() ?? "") as VllmBenchResult);
      } catch (e) {
        reject(
          new Error(
            `kvxfer_vllm_testing.bench printed no result: ${(e as Error).message}\n${err.slice(-2000)}`,
          ),
        );
      }
    });
  });
}

/** The table: each P/D figure next to the single engine's from the same run, and the ratio. */
export function formatVllm(r: VllmBenchResult, markdown = false): string {
  const head = [
    "placement",
    "prompt",
    "mode",
    "TTFT p50",
    "TTFT p99",
    "one engine p50",
    "ratio",
    "E2E p50",
    "E2E p99",
    "one engine p50",
    "ratio",
    "KV/request",
    "n",
  ];
  const rows: string[][] = [];
  for (const row of r.rows) {
    if (row.mode === "one") continue;
    const one = r.rows.find(
      (x) =>
        x.mode === "one" &&
        x.tokens === row.tokens &&
        x.placement === row.placement &&
        x.kv_memory === row.kv_memory,
    );
    rows.push([
      row.kv_memory === "segment" ? `${row.placement}, segments` : row.placement,
      String(row.tokens),
      row.mode,
      `${fmt(row.ttft_ms.p50, 0)} ms`,
      row.ttft_ms.n >= 20 ? `${fmt(row.ttft_ms.p99, 0)} ms` : "-",
      `${fmt(one?.ttft_ms.p50, 0)} ms`,
      fmt(one ? row.ttft_ms.p50 / one.ttft_ms.p50 : undefined, 2),
      `${fmt(row.e2e_ms.p50, 0)} ms`,
      row.e2e_ms.n >= 20 ? `${fmt(row.e2e_ms.p99, 0)} ms` : "-",
      `${fmt(one?.e2e_ms.p50, 0)} ms`,
      fmt(one ? row.e2e_ms.p50 / one.e2e_ms.p50 : undefined, 2),
      `${fmt(row.kv_bytes / 1024, 0)} KiB`,
      String(row.ttft_ms.n),
    ]);
  }
  return markdown ? markdownTable(head, rows) : table(head, rows);
}

export function parseVllmArgs(argv: string[]): VllmBenchOptions {
  const args = argv.filter((a) => a !== "--json");
  return { json: argv.includes("--json"), args };
}

export function main(argv: string[] = process.argv.slice(2)): Promise<VllmBenchResult> {
  return runSuiteMain(
    "vllm",
    parseVllmArgs(argv),
    (o) => runPython(o.args, o.log),
    (r) => [
      `\nkvxfer with vLLM: P/D pair through kvxfer vs one engine alone; ${r.machine}; vLLM ${r.vllm}`,
      `  model: ${r.model.layers} layers, ${r.model.kv_heads} KV heads x ${r.model.head_dim}, ${r.model.dtype} ` +
        `(${r.model.kv_bytes_per_token} B of KV per token); ${r.output_tokens} output tokens; p99 only from 20 samples up`,
      formatVllm(r),
      "  TTFT: client sends -> first streamed token (P/D: P's prefill request, then D's stream; push: both at once).",
    ],
  );
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href)
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
