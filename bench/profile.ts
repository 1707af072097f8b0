// Where a sidecar's CPU goes, from V8 CPU profiles of the sidecar processes. Record them with
//   KVXFER_SIDECAR_NODE_ARGS="--cpu-prof --cpu-prof-dir=/tmp/prof" node dist/bench/control.js --quick
// (every sidecar the demo or a benchmark starts writes one .cpuprofile when it exits), then
//   node dist/bench/profile.js [--per N] [--top N] /tmp/prof/*.cpuprofile
// Prints the sampled busy time (idle left out), split into start-up (module loading and
// compilation), garbage collection and the rest; for kvxfer's own functions the inclusive time
// (each function once per sample, whatever its depth), and the hottest source lines by self time
// (a line that calls into native code, such as a ZeroMQ send or an addon call, carries that
// call's time). `--per N` also divides by N (e.g. the transfers the profiled run made).
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

interface CallFrame {
  functionName: string;
  url: string;
  lineNumber: number;
}
interface ProfileNode {
  id: number;
  callFrame: CallFrame;
  children?: number[];
  positionTicks?: { line: number; ticks: number }[];
}
export interface CpuProfile {
  nodes: ProfileNode[];
  samples: number[];
  timeDeltas: number[];
}

export interface ProfileSummary {
  /** Sampled µs that were not idle, over every profile. */
  busyUs: number;
  startupUs: number;
  gcUs: number;
  /** kvxfer function ("name file:line") → inclusive µs. */
  inclusive: Map<string, number>;
  /** "file:line" → self µs (from the line ticks, scaled to each node's self time). */
  lines: Map<string, number>;
}

const STARTUP = /node:internal\/(modules|bootstrap)|cjs-module-lexer/;

/** kvxfer's own files as "src/...", dependencies as "<package>/...", anything else undefined. */
function ownFile(url: string): string | undefined {
  const dep = url.lastIndexOf("/node_modules/");
  if (dep >= 0) return url.slice(dep + "/node_modules/".length);
  const at = url.indexOf("/dist/");
  return at >= 0 ? url.slice(at + "/dist/".length) : undefined;
}

export function summarize(profiles: readonly CpuProfile[]): ProfileSummary {
  const out: ProfileSummary = {
    busyUs: 0,
    startupUs: 0,
    gcUs: 0,
    inclusive: new Map(),
    lines: new Map(),
  };
  const add = (m: Map<string, number>, k: string, us: number): void => {
    m.set(k, (m.get(k) ?? 0) + us);
  };
  for (const p of profiles) {
    const byId = new Map(p.nodes.map((n) => [n.id, n]));
    const parent = new Map<number, number>();
    for (const n of p.nodes) for (const c of n.children ?? []) parent.set(c, n.id);
    const self = new Map<number, number>();
    p.samples.forEach((id, i) => self.set(id, (self.get(id) ?? 0) + (p.timeDeltas[i] ?? 0)));
    for (const [id, us] of self) {
      const node = byId.get(id)!;
      if (node.callFrame.functionName === "(idle)") continue;
      out.busyUs += us;
      if (node.callFrame.functionName === "(garbage collector)") out.gcUs += us;
      const seen = new Set<string>();
      let startup = false;
      for (let cur: number | undefined = id; cur !== undefined; cur = parent.get(cur)) {
        const cf = byId.get(cur)!.callFrame;
        if (STARTUP.test(cf.url)) startup = true;
        const file = ownFile(cf.url);
        if (file === undefined) continue;
        const key = `${cf.functionName || "(anonymous)"} ${file}:${cf.lineNumber + 1}`;
        if (!seen.has(key)) {
          seen.add(key);
          add(out.inclusive, key, us);
        }
      }
      if (startup) out.startupUs += us;
      const file = ownFile(node.callFrame.url);
      const ticks = node.positionTicks ?? [];
      const total = ticks.reduce((a, t) => a + t.ticks, 0);
      if (file !== undefined && total > 0)
        for (const t of ticks) add(out.lines, `${file}:${t.line}`, (us * t.ticks) / total);
    }
  }
  return out;
}

function top(m: Map<string, number>, n: number): [string, number][] {
  return [...m].sort((a, b) => b[1] - a[1]).slice(0, n);
}

export function report(s: ProfileSummary, opts: { per?: number; top?: number } = {}): string[] {
  const n = opts.top ?? 25;
  const ms = (us: number): string => (us / 1000).toFixed(0).padStart(7);
  const pct = (us: number): string => `${((100 * us) / s.busyUs).toFixed(1).padStart(5)}%`;
  const per = (us: number): string =>
    opts.per !== undefined ? `  ${(us / opts.per).toFixed(1).padStart(7)} µs/each` : "";
  const line = (label: string, us: number): string => `${pct(us)} ${ms(us)} ms${per(us)}  ${label}`;
  return [
    `busy (sampled, idle left out): ${ms(s.busyUs).trim()} ms${per(s.busyUs)}`,
    line("start-up (module loading, compilation)", s.startupUs),
    line("garbage collection", s.gcUs),
    "kvxfer functions, inclusive:",
    ...top(s.inclusive, n).map(([k, us]) => line(k, us)),
    "hottest lines, self:",
    ...top(s.lines, Math.ceil(n / 2)).map(([k, us]) => line(k, us)),
  ];
}

function main(argv: string[]): number {
  const files: string[] = [];
  const opts: { per?: number; top?: number } = {};
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!;
    if (a === "--per" || a === "--top") {
      const v = Number(argv[++i]);
      if (!Number.isInteger(v) || v < 1) {
        process.stderr.write(`profile: ${a} needs a positive integer, got '${argv[i]}'\n`);
        return 2;
      }
      opts[a === "--per" ? "per" : "top"] = v;
    } else files.push(a);
  }
  if (files.length === 0) {
    process.stderr.write(
      "usage: node dist/bench/profile.js [--per N] [--top N] FILE.cpuprofile...\n",
    );
    return 2;
  }
  const profiles = files.map((f) => JSON.parse(readFileSync(f, "utf8")) as CpuProfile);
  for (const l of report(summarize(profiles), opts)) process.stdout.write(l + "\n");
  return 0;
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? "").href)
  process.exitCode = main(process.argv.slice(2));
