/**
 * What the e2e, modes and control suites share: percentiles, a plain text
 * table, process CPU from /proc, and where results go (bench/results/ under
 * the package root, whatever the working directory).
 */
import { existsSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { cpus, loadavg, totalmem } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Resvg } from "@resvg/resvg-js";

import { describeUcx, ucxInfo } from "../src/native/index.js";

export interface Stats {
  p50: number;
  p99: number;
  mean: number;
  min: number;
  max: number;
  n: number;
}

/** Nearest-rank percentiles (the value at rank ceil(p·n)); NaN when there are no samples. */
export function stats(samples: readonly number[]): Stats {
  const s = [...samples].sort((a, b) => a - b);
  const at = (p: number): number =>
    s.length === 0 ? NaN : s[Math.min(s.length - 1, Math.max(0, Math.ceil(p * s.length) - 1))]!;
  return {
    p50: at(0.5),
    p99: at(0.99),
    mean: s.length === 0 ? NaN : s.reduce((a, b) => a + b, 0) / s.length,
    min: s[0] ?? NaN,
    max: s[s.length - 1] ?? NaN,
    n: s.length,
  };
}

/** Fewer samples than this and a p99 is the maximum of a handful: it is not printed. */
export const MIN_P99_SAMPLES = 20;

/** A p99 cell: "-" below MIN_P99_SAMPLES samples (the JSON keeps the figure and its n). */
export function fmtP99(s: Stats, dp = 2): string {
  return s.n < MIN_P99_SAMPLES ? "-" : fmt(s.p99, dp);
}

/** Fixed decimals, or "-" for a missing figure. */
export function fmt(x: number | undefined, dp = 2): string {
  return x === undefined || !Number.isFinite(x) ? "-" : x.toFixed(dp);
}

/** A left-aligned first column, right-aligned numbers, two spaces between columns. */
export function table(head: readonly string[], rows: readonly (readonly string[])[]): string {
  const widths = head.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? "").length)));
  const line = (cells: readonly string[]): string =>
    cells
      .map((c, i) => (i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!)))
      .join("  ")
      .trimEnd();
  return [line(head), line(widths.map((w) => "-".repeat(w))), ...rows.map(line)].join("\n");
}

/** The same table as GitHub markdown (for docs/benchmarks.md). */
export function markdownTable(
  head: readonly string[],
  rows: readonly (readonly string[])[],
): string {
  const line = (cells: readonly string[]): string => `| ${cells.join(" | ")} |`;
  return [
    line(head),
    `|${head.map((_, i) => (i === 0 ? "---" : "---:")).join("|")}|`,
    ...rows.map(line),
  ].join("\n");
}

/** The package root: the nearest folder above this file with package.json and bench/. */
export function packageRoot(): string {
  let dir = dirname(fileURLToPath(import.meta.url));
  for (let i = 0; i < 6; i++) {
    if (existsSync(join(dir, "package.json")) && existsSync(join(dir, "bench"))) return dir;
    dir = dirname(dir);
  }
  throw new Error("cannot find the kvxfer package root");
}

export function resultsDir(): string {
  // KVXFER_BENCH_RESULTS: another directory (tests run a bench without touching bench/results).
  const env = process.env.KVXFER_BENCH_RESULTS;
  const dir = env !== undefined && env !== "" ? env : join(packageRoot(), "bench", "results");
  mkdirSync(dir, { recursive: true });
  return dir;
}

/** Writes `bench/results/<name>` and returns its path. */
export function writeResult(name: string, content: string | Uint8Array): string {
  const path = join(resultsDir(), name);
  writeFileSync(path, content);
  return path;
}

/** An SVG rendered as PNG (resvg, this machine's fonts; twice the SVG's size, for screens). */
export function svgToPng(svg: string): Buffer {
  return new Resvg(svg, {
    background: "#ffffff",
    fitTo: { mode: "zoom", value: 2 },
    font: {
      loadSystemFonts: true,
      defaultFontFamily: "DejaVu Sans",
      sansSerifFamily: "DejaVu Sans",
    },
  })
    .render()
    .asPng();
}

/** Writes `bench/results/<name>.svg` and the same chart as `<name>.png`; returns both paths. */
export function writeChart(name: string, svg: string): string[] {
  const base = name.replace(/\.svg$/, "");
  return [writeResult(`${base}.svg`, svg), writeResult(`${base}.png`, svgToPng(svg))];
}

export function writeJsonResult(suite: string, value: unknown): string {
  // Every result records the UCX it ran on: version, transports, memory types.
  const withUcx =
    typeof value === "object" && value !== null && !Array.isArray(value)
      ? { ...value, ucxInfo: ucxInfo() }
      : value;
  return writeResult(`${suite}.json`, JSON.stringify(withUcx, null, 2) + "\n");
}

/**
 * The `main` of a suite: runs it (progress lines unless --json), writes
 * `bench/results/<suite>.json` and any extra files, then prints the JSON or
 * the suite's report followed by where the results went.
 */
export async function runSuiteMain<O extends { json: boolean; log?: (line: string) => void }, R>(
  suite: string,
  opts: O,
  run: (opts: O) => Promise<R>,
  report: (result: R) => string[],
  extraFiles: (result: R) => string[] = () => [],
): Promise<R> {
  if (!opts.json) opts.log = (l): void => console.log(l);
  const result = await run(opts);
  const files = [writeJsonResult(suite, result), ...extraFiles(result)];
  if (opts.json) {
    console.log(JSON.stringify(result, null, 2));
  } else {
    for (const line of report(result)) console.log(line);
    console.log(`  results: ${files.join(", ")}`);
  }
  return result;
}

/** `bench/results/<suite>.json` parsed, or undefined when there is none. */
export function readJsonResult<T>(suite: string): T | undefined {
  const path = join(resultsDir(), `${suite}.json`);
  if (!existsSync(path)) return undefined;
  return JSON.parse(readFileSync(path, "utf8")) as T;
}

/** Kernel clock ticks per second (USER_HZ); 100 on every Linux architecture Node runs on. */
const CLOCK_TICKS = 100;

/** CPU seconds (user + system) a process has used so far, from /proc/<pid>/stat. */
export function processCpuSeconds(pid: number): number {
  const text = readFileSync(`/proc/${pid}/stat`, "utf8");
  // The command name (field 2) may hold spaces: count fields after its closing parenthesis.
  const rest = text.slice(text.lastIndexOf(")") + 2).split(" ");
  // rest[0] is field 3 (state); utime and stime are fields 14 and 15.
  return (Number(rest[11]) + Number(rest[12])) / CLOCK_TICKS;
}

/** Busy and total CPU seconds of the whole machine so far, from /proc/stat. */
export function machineCpuSeconds(): { busy: number; total: number } {
  const line = readFileSync("/proc/stat", "utf8").split("\n")[0]!;
  const v = line.trim().split(/\s+/).slice(1).map(Number);
  const idle = (v[3] ?? 0) + (v[4] ?? 0); // idle + iowait
  const total = v.slice(0, 8).reduce((a, b) => a + b, 0); // guest time is already in user
  return { busy: (total - idle) / CLOCK_TICKS, total: total / CLOCK_TICKS };
}

/** Flag parsing shared by the suites: `--name value` pairs and boolean switches. */
export class BenchArgs {
  private readonly used = new Set<number>();
  constructor(
    private readonly argv: readonly string[],
    private readonly usage: string,
  ) {}

  has(flag: string): boolean {
    const i = this.argv.indexOf(flag);
    if (i >= 0) this.used.add(i);
    return i >= 0;
  }

  string(flag: string): string | undefined {
    const i = this.argv.indexOf(flag);
    if (i < 0) return undefined;
    const v = this.argv[i + 1];
    if (v === undefined || v.startsWith("--"))
      throw new Error(`${flag} needs a value\n${this.usage}`);
    this.used.add(i).add(i + 1);
    return v;
  }

  number(flag: string, min = 0): number | undefined {
    const v = this.string(flag);
    if (v === undefined) return undefined;
    const n = Number(v);
    if (!Number.isFinite(n) || n < min)
      throw new Error(`${flag} must be a number >= ${min}, got '${v}'`);
    return n;
  }

  ints(flag: string): number[] | undefined {
    const v = this.string(flag);
    if (v === undefined) return undefined;
    return v.split(",").map((x) => {
      const n = Number(x);
      if (!Number.isSafeInteger(n) || n < 1)
        throw new Error(`${flag} takes positive integers, got '${x}'`);
      return n;
    });
  }

  list(flag: string): string[] | undefined {
    return this.string(flag)?.split(",");
  }

  /** Throws on any argument no accessor asked about. */
  done(): void {
    const extra = this.argv.filter((_, i) => !this.used.has(i));
    if (extra.length > 0) throw new Error(`unknown argument ${extra[0]!}\n${this.usage}`);
  }
}

/** The machine line printed with every table. */
export function machineLine(): string {
  const cpu = cpus();
  return (
    `${new Date().toISOString().slice(0, 10)}, ${cpu.length} cores (${cpu[0]?.model.trim() ?? "?"}), ` +
    `${Math.round(totalmem() / 2 ** 30)} GiB, ${process.platform} ${process.arch}, node ${process.version}, ` +
    `${describeUcx()}, ` +
    // Other work on the machine skews every figure: the load when the table was made says how much.
    `load ${loadavg()
      .map((l) => l.toFixed(1))
      .join(" ")}`
  );
}
