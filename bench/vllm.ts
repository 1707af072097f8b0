// `kvxfer bench vllm`: real vLLM P/D deployments (CPU build, a random-weight model made here)
// through kvxfer, against one engine alone and, with --vs, vLLM's own NixlConnector,
// NixlPushConnector and MooncakeConnector, in the same run. The measurement runs in Python
// (connectors/vllm/kvxfer_vllm_testing/bench.py, in the project's .venv); this prints its table
// with each figure's ratio to kvxfer pull's, writes bench/results/vllm.json and the TTFT plot
// (vllm-ttft.svg/.png). Flags go to the Python side: [--vs nixl,nixl-push,mooncake]
// [--lengths 32,256,1024,4096] [--concurrency 1,8] [--requests N] [--rounds N]
// [--output-tokens N] [--modes pull,push] [--faults] [--quick] [--load N [--load-nice K]]
// [--prefault true|false] [--pin-engines] [--idle-wait-s S] [--worker-rest-s S] [--engine-spin-s S]
// [--link MBIT] (P's and D's agents on two network namespaces, KV over TCP, capped; 0: not capped)
// [--model kv8|kv64] [--kv-cache-mib N] [--modes pull,push,layerwise]; here: [--json] [--install-peers] (pip-installs
// the pinned peers, bench/peers/requirements.txt, into .venv first).
// `--models` runs kvxfer_vllm_testing.models_bench instead: every model family through kvxfer and
// NixlConnector ([--families ...] [--lengths 200,1000] [--requests 3] [--no-nixl]).
// `--breakdown` runs kvxfer_vllm_testing.breakdown instead: where each kvxfer request's time
// goes, hop by hop (router, both engines' connector, both sidecars' traces), per prompt length,
// medians and the slowest tenth ([--modes pull|push] [--lengths 32,256,1024,4096] [--requests N]
// [--kv-memory file|segment] [--prefault false,true] [--pin-engines] [--idle-wait-s S]
// [--worker-rest-s S] [--engine-spin-s S]).
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

import { installCommand } from "./peers.js";
import { fmt, markdownTable, packageRoot, runSuiteMain, table, writeChart } from "./report.js";
import { lineChart, type ChartSeries } from "./svg.js";

interface Dist {
  p50: number | null;
  p90: number | null;
  n: number;
  /** 95% intervals by order statistics; an end is null where the samples cannot bound it (absent before 2026-12-06). */
  p50_ci?: [number | null, number | null];
  p90_ci?: [number | null, number | null];
}

export interface VllmRow {
  system: string;
  label: string;
  tokens: number;
  concurrency: number;
  /** "ok", or why the row has no figures ("not installed: ...", "failed to start: ..."). */
  status: string;
  requests: number;
  ttft_ms: Dist;
  e2e_ms: Dist;
  /** P's HTTP answer to D's first token (P/D systems; absent in results from before it). */
  d_side_ms?: Dist;
  output_tokens_per_s: number | null;
  /** CPU seconds per request by process ("P engine", "D sidecar", ...) and their total. */
  cpu_s_per_request: Record<string, number> | null;
  /** Outputs token-identical to one engine's for the same prompt, of those compared. */
  correct: { identical: number; compared: number };
  /** D's prompt tokens per request whose KV moved, and those D computed (vLLM's own counter). */
  d_prompt_tokens_per_request?: { external_kv_transfer: number; local_compute: number } | null;
  /** kvxfer: the cell's transfers that failed, by "side state: reason" (the sidecars' record). */
  kv_failures?: Record<string, number> | null;
  /** --link: the data link's cap for this cell, Mbit/s (0: not capped). */
  link_mbit?: number;
  /** --link: MiB per request that crossed the data link (KV and control). */
  link_mib_per_request?: number | null;
  errors: string[];
  error_count: number;
}

export interface VllmBenchResult {
  machine: string;
  vllm: string;
  peers: Record<
    string,
    { installed: boolean; versions: Record<string, string | null>; how: string }
  >;
  model: {
    layers: number;
    kv_heads: number;
    head_dim: number;
    dtype: string;
    kv_bytes_per_token: number;
  };
  engine: Record<string, unknown>;
  /** The CPU hog beside the engines (--load; absent before 2026-12-06: none). */
  load?: { hogs: number; nice: number; what: string };
  /** --link: the transfer agents on two network namespaces, the link capped (absent before 2026-12-07: loopback). */
  link?: { mbits: number[]; what: string } | null;
  /** kvxfer's settings: the connector's placement, KV memory and idle wait, the sidecars' prefault. */
  kvxfer?: Record<string, unknown>;
  output_tokens: number;
  rounds: number;
  requests_per_round: number;
  rows: VllmRow[];
  /**
   * With --faults: each P/D system once with P's side channel unreachable, then (each on a fresh
   * deployment) P's engine killed after answering and D's engine killed mid-load.
   */
  fault_rows?: VllmFaultRow[];
}

export interface VllmFaultRow {
  system: string;
  label: string;
  fault: string;
  tokens: number;
  /** "answered" or "error: ..." */
  client: string;
  /** D's output equals one engine's (moved or recomputed: see d_prompt_tokens); null when it answered nothing. */
  identical: boolean | null;
  /** D's prompt tokens for the faulted request, by source (vLLM's counter): KV moved or computed. */
  d_prompt_tokens?: Record<string, number>;
  e2e_ms: number;
  /** Seconds until P's KV cache usage is back to an idle P's (P probed so it refreshes); null: not within 60 s. */
  p_kv_usage_zero_after_s?: number | null;
  next_request_identical: boolean | string;
}

interface VllmBenchOptions {
  json: boolean;
  installPeers: boolean;
  args: string[];
  log?: (line: string) => void;
}

/** connectors/vllm first on PYTHONPATH: the testing package, and this checkout's connector. */
function pythonPath(root: string): string {
  const own = join(root, "connectors", "vllm");
  return process.env.PYTHONPATH ? `${own}:${process.env.PYTHONPATH}` : own;
}

/** pip-installs the pinned peers into .venv (pip's output on stderr, so --json stays clean). */
function installPeers(py: string, log?: (line: string) => void): void {
  const cmd = installCommand(py);
  log?.(`${cmd.join(" ")} ...`);
  const cache = process.env.PIP_CACHE_DIR ?? join(process.env.HOME ?? "/tmp", ".cache", "pip");
  const r = spawnSync(cmd[0]!, cmd.slice(1), {
    stdio: ["ignore", 2, 2],
    env: { ...process.env, PIP_CACHE_DIR: cache },
    timeout: 20 * 60_000,
  });
  if (r.status !== 0) throw new Error(`pip install failed (exit ${r.status ?? r.signal})`);
}

function runPython(o: VllmBenchOptions): Promise<VllmBenchResult> {
  const root = packageRoot();
  const py = join(root, ".venv", "bin", "python");
  if (!existsSync(py)) {
    return Promise.reject(
      new Error(`${py} is missing: run 'npm run quickstart' (scripts/setup-python.sh) first`),
    );
  }
  if (o.installPeers) installPeers(py, o.log);
  return new Promise((resolve, reject) => {
    const child = spawn(py, ["-m", "kvxfer_vllm_testing.bench", ...o.args], {
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
        if (/^\s*(round |\d+ tokens|failed|fault)/.test(line)) o.log?.(line);
    });
    // The measurement owns engines and sidecars: a stopped parent stops it (it cleans up on SIGTERM).
    const unhook = stopWithParent(child);
    child.on("error", reject);
    child.on("exit", (code) => {
      unhook();
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

function ms(x: number | null | undefined): string {
  return x === null || x === undefined ? "-" : `${fmt(x, 0)}`;
}

/** "380-450": a 95% interval; "?" for an end the samples cannot bound. */
function interval(ci: [number | null, number | null] | undefined): string {
  if (!ci) return "-";
  const end = (x: number | null): string => (x === null ? "?" : ms(x));
  return `${end(ci[0])}-${end(ci[1])}`;
}

/** What the run's figures depend on besides the code: pinning, the CPU hog, kvxfer's own settings. */
export function settingsLine(r: VllmBenchResult): string {
  const kx = r.kvxfer ?? {};
  return [
    `engines: ${String(r.engine.pinned ?? "?")} pinned`,
    `load: ${r.load?.what ?? "none"}`,
    // Named only when run across a link (--link) or with a model's figures (every run since).
    ...(r.link ? [`link: ${r.link.what}`] : []),
    ...(r.model
      ? [
          `model: ${r.model.layers} layers, ${r.model.kv_bytes_per_token / 1024} KiB of KV per token`,
        ]
      : []),
    `kvxfer: prefault ${String(kx.prefault ?? "true")}, placement ${String(kx.placement ?? "?")}, ` +
      `KV memory ${String(kx.kv_memory ?? "?")}, idle wait ${kx.idle_wait_s === undefined ? "the connector's default" : `${String(kx.idle_wait_s)} s`}` +
      // Named only when set (--worker-rest-s): absent, the connector's default ran (or, before
      // 2026-12-07, vLLM's one-second spin).
      (kx.worker_rest_s === undefined ? "" : `, worker rest ${String(kx.worker_rest_s)} s`) +
      (kx.engine_spin_s === undefined ? "" : `, engine spin ${String(kx.engine_spin_s)} s`),
  ].join("; ");
}

/** One line per (prompt, in flight, system); ratios are to kvxfer pull's figure from the same run. */
export function formatVllm(r: VllmBenchResult, markdown = false): string {
  const head = [
    "prompt",
    "in flight",
    "system",
    "TTFT p50 / p90 ms",
    "vs kvxfer pull",
    "95% intervals",
    "D side p50 / p90 ms",
    "E2E p50 / p90 ms",
    "out tok/s",
    "CPU s/req",
    "identical",
    "D: moved / computed",
    "n",
  ];
  const rows: string[][] = [];
  for (const row of r.rows) {
    const ref = r.rows.find(
      (x) =>
        x.system === "kvxfer-pull" &&
        x.tokens === row.tokens &&
        x.concurrency === row.concurrency &&
        x.link_mbit === row.link_mbit,
    );
    const ok = row.status === "ok";
    const ratio =
      ok && ref?.ttft_ms.p50 && row.ttft_ms.p50 !== null
        ? row.ttft_ms.p50 / ref.ttft_ms.p50
        : undefined;
    rows.push([
      String(row.tokens),
      String(row.concurrency),
      row.label,
      ok ? `${ms(row.ttft_ms.p50)} / ${ms(row.ttft_ms.p90)}` : row.status,
      ok ? fmt(ratio, 2) : "-",
      ok && row.ttft_ms.p50_ci
        ? `${interval(row.ttft_ms.p50_ci)} / ${interval(row.ttft_ms.p90_ci)}`
        : "-",
      ok && row.d_side_ms?.n ? `${ms(row.d_side_ms.p50)} / ${ms(row.d_side_ms.p90)}` : "-",
      ok ? `${ms(row.e2e_ms.p50)} / ${ms(row.e2e_ms.p90)}` : "-",
      ok ? fmt(row.output_tokens_per_s ?? undefined, 0) : "-",
      ok ? fmt(row.cpu_s_per_request?.total, 2) : "-",
      row.system === "one"
        ? "(reference)"
        : ok
          ? `${row.correct.identical}/${row.correct.compared}` +
            (row.error_count ? `, ${row.error_count} failed` : "")
          : "-",
      row.d_prompt_tokens_per_request
        ? `${fmt(row.d_prompt_tokens_per_request.external_kv_transfer, 0)} / ` +
          fmt(row.d_prompt_tokens_per_request.local_compute, 0)
        : "-",
      String(row.ttft_ms.n),
    ]);
  }
  return markdown ? markdownTable(head, rows) : table(head, rows);
}

/** One line per kvxfer transfer failure kind in a cell: why D computed what it did not receive. */
export function formatKvFailures(rows: readonly VllmRow[]): string[] {
  return rows.flatMap((row) =>
    Object.entries(row.kv_failures ?? {}).map(
      ([why, n]) =>
        `  ${row.label}, ${row.tokens} tokens, ${row.concurrency} in flight: ${n} x ${why}`,
    ),
  );
}

/** "moved N, computed M": where D's prompt tokens came from (vLLM's counter). */
function promptSource(t: Record<string, number> | undefined): string {
  if (!t) return "-";
  const moved = t.external_kv_transfer ?? 0;
  const computed = t.local_compute ?? 0;
  return `moved ${fmt(moved, 0)}, computed ${fmt(computed, 0)}`;
}

/** The fault rows: what the client saw, whether D's output is right and where its prompt came from, P's blocks, the next request. */
export function formatVllmFaults(rows: readonly VllmFaultRow[], markdown = false): string {
  const head = [
    "system",
    "fault",
    "client sees",
    "output",
    "D's prompt",
    "E2E ms",
    "P's blocks back after",
    "next request",
  ];
  const body = rows.map((f) => [
    f.label,
    f.fault,
    f.client,
    f.identical === null ? "-" : f.identical ? "one engine's" : "DIFFERENT",
    promptSource(f.d_prompt_tokens),
    fmt(f.e2e_ms, 0),
    f.p_kv_usage_zero_after_s === undefined
      ? "-"
      : f.p_kv_usage_zero_after_s === null
        ? "not within 60 s"
        : `${fmt(f.p_kv_usage_zero_after_s, 1)} s`,
    typeof f.next_request_identical === "string"
      ? f.next_request_identical
      : f.next_request_identical
        ? "correct"
        : "DIFFERENT",
  ]);
  return markdown ? markdownTable(head, body) : table(head, body);
}

/**
 * TTFT p50 by prompt length, one line per system (and link, with several: each row's label
 * names it), at the lowest concurrency measured.
 */
export function ttftChart(r: VllmBenchResult): string {
  const conc = Math.min(...r.rows.map((x) => x.concurrency));
  const labels = [...new Set(r.rows.map((x) => x.label))];
  const series: ChartSeries[] = labels.map((label) => {
    const rows = r.rows.filter(
      (x) => x.label === label && x.concurrency === conc && x.status === "ok",
    );
    return {
      name: label,
      dashed: rows[0]?.system === "one",
      points: rows.map((x) => [x.tokens, x.ttft_ms.p50 ?? Number.NaN] as const),
    };
  });
  return lineChart({
    title: `TTFT p50 by prompt length, ${conc} in flight`,
    subtitle: `vLLM ${r.vllm}; ${r.machine}`,
    xLabel: "prompt tokens",
    yLabel: "TTFT p50 (ms)",
    logX: true,
    logY: true,
    series,
  });
}

export function parseVllmArgs(argv: string[]): VllmBenchOptions {
  const args = argv.filter((a) => a !== "--json" && a !== "--install-peers");
  return { json: argv.includes("--json"), installPeers: argv.includes("--install-peers"), args };
}

/** SIGTERM to `child` when this process is told to stop (SIGTERM, SIGINT); the result undoes it. */
function stopWithParent(child: ChildProcess): () => void {
  const stop = (): void => void child.kill("SIGTERM");
  process.once("SIGTERM", stop);
  process.once("SIGINT", stop);
  return () => {
    process.off("SIGTERM", stop);
    process.off("SIGINT", stop);
  };
}

/**
 * `--breakdown` and `--models`: a module of kvxfer_vllm_testing that prints its table on stderr
 * and its JSON on stdout (breakdown.py, models_bench.py).
 */
function runModule(module: string, args: string[]): Promise<void> {
  const py = join(packageRoot(), ".venv", "bin", "python");
  return new Promise((resolve, reject) => {
    const child = spawn(py, ["-m", `kvxfer_vllm_testing.${module}`, ...args], {
      cwd: packageRoot(),
      env: { ...process.env, PYTHONPATH: pythonPath(packageRoot()) },
      stdio: ["ignore", "inherit", "inherit"],
    });
    const unhook = stopWithParent(child);
    child.on("error", reject);
    child.on("exit", (code) => {
      unhook();
      if (code === 0) resolve();
      else reject(new Error(`kvxfer_vllm_testing.${module} exited ${code}`));
    });
  });
}

export function main(argv: string[] = process.argv.slice(2)): Promise<VllmBenchResult | void> {
  if (argv.includes("--breakdown"))
    return runModule("breakdown", ["--table", ...argv.filter((a) => a !== "--breakdown")]);
  if (argv.includes("--models"))
    return runModule(
      "models_bench",
      argv.filter((a) => a !== "--models"),
    );
  return runSuiteMain(
    "vllm",
    parseVllmArgs(argv),
    (o) => runPython(o),
    (r) => [
      `\nkvxfer with vLLM beside vLLM's own connectors; ${r.machine}; vLLM ${r.vllm}`,
      `  model: ${r.model.layers} layers, ${r.model.kv_heads} KV heads x ${r.model.head_dim}, ${r.model.dtype} ` +
        `(${r.model.kv_bytes_per_token} B of KV per token); ${r.output_tokens} output tokens; ` +
        `${r.rounds} round(s) of ${r.requests_per_round} requests per cell`,
      "  peers: " +
        Object.entries(r.peers)
          .map(
            ([k, v]) =>
              `${k} ${Object.entries(v.versions)
                .map(([d, ver]) => `${d} ${ver ?? "missing"}`)
                .join(", ")}`,
          )
          .join("; "),
      `  settings: ${settingsLine(r)}`,
      formatVllm(r),
      "  95% intervals: of TTFT p50 / p90, by order statistics ('?': too few samples to bound that end).",
      "  TTFT: client sends -> first streamed token (pull: P's request, then D's stream; push and Mooncake: both at once).",
      "  D side: P's HTTP answer -> D's first token, per request (in a push D was asked at the start; negative if D answered first).",
      "  identical: outputs token-identical to one engine's for the same prompt.",
      "  D: moved / computed: D's prompt tokens per request whose KV came from P, and those D computed (vLLM's counter).",
      ...(r.rows.some((x) => x.kv_failures)
        ? ["  kvxfer transfers that failed (the sidecars' record):", ...formatKvFailures(r.rows)]
        : []),
      ...(r.fault_rows?.length ? ["", formatVllmFaults(r.fault_rows)] : []),
    ],
    (r) => {
      const cap = r.link?.mbits.find((m) => m > 0);
      // With a capped link: its chart (every system over it, the uncapped kvxfer and NIXL pull beside).
      return cap === undefined
        ? writeChart("vllm-ttft.svg", ttftChart(r))
        : writeChart("vllm-link-ttft.svg", linkChart(r, cap));
    },
  );
}

/** A label short enough for the chart's legend. */
function shortLabel(row: VllmRow): string {
  if (row.system === "one") return "one engine";
  return row.label
    .replace("NixlConnector, 2 fixes", "NIXL pull*")
    .replace("NixlPushConnector, 2 fixes", "NIXL push*")
    .replace("kvxfer push, layer-wise", "kvxfer layer-wise")
    .replace(/, (\d+) Mbit\/s$/, (_, m: string) => `, ${Number(m) / 1000} Gb/s`)
    .replace(", uncapped", ", no cap");
}

/**
 * TTFT p50 by prompt length over the `mbit` link, every system (one engine once), with kvxfer's
 * pushes and NixlConnector on the uncapped link beside them (--link with 0 among the caps).
 */
export function linkChart(r: VllmBenchResult, mbit: number): string {
  const rows = r.rows
    .filter(
      (x) =>
        x.link_mbit === mbit ||
        (x.link_mbit === 0 && ["kvxfer-push", "kvxfer-layerwise", "nixl-fixed"].includes(x.system)),
    )
    .map((x) => ({ ...x, label: shortLabel(x) }));
  return ttftChart({ ...r, rows }).replace(
    /TTFT p50 by prompt length, (\d+) in flight/,
    `TTFT p50 by prompt length, $1 in flight, P and D over a ${mbit / 1000} Gbit/s link`,
  );
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href)
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
