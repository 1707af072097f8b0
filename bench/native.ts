// Native transfer bandwidth and message rate between two processes on shared
// memory, next to `ucx_perftest` (ucp_put_bw, and ucp_get: UCX 1.13's name for
// the get bandwidth test) on the same transport and sizes, in the same run.
// Two kinds of memory, each against the ucx_perftest run that uses the same kind:
//   ucx:  memory allocated by UCX (Agent.allocate; ucx_perftest's default), which
//         the shared-memory transports copy with loads and stores;
//   host: memory allocated by the application and registered (a Buffer, or an
//         engine's shared-memory KV file), which on one host goes through CMA,
//         one system call per operation; ucx_perftest with UCX_ALLOC_PRIO=heap.
// Run: `node dist/bench/native.js [--json] [--sizes 4k,32k,...] [--memory ucx,host] [--transports shm,self]`.
import { spawn } from "node:child_process";
import { pathToFileURL } from "node:url";

import { PeerProcess } from "./native/peer-client.js";
import { writeJsonResult } from "./report.js";
import { ucxTool } from "./ucx-tools.js";

export type BenchMemory = "ucx" | "host";

export interface NativeBenchOptions {
  sizes?: number[];
  memories?: BenchMemory[];
  transports?: string;
  /** Bytes moved per measurement (bounded by the iteration limits). */
  targetBytes?: number;
  /** Descriptors per kvxfer transfer. */
  batch?: number;
  /** kvxfer transfers in flight. */
  window?: number;
  log?: (line: string) => void;
}

export interface NativeBenchRow {
  memory: BenchMemory;
  size: number;
  iters: number;
  kvxferWriteGBps: number;
  perftestPutGBps: number;
  writeRatio: number;
  kvxferWriteMsgRate: number;
  perftestPutMsgRate: number;
  writeRateRatio: number;
  kvxferReadGBps: number;
  perftestGetGBps: number;
  readRatio: number;
  kvxferReadMsgRate: number;
  perftestGetMsgRate: number;
  readRateRatio: number;
}

export const DEFAULT_SIZES = [4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20];

interface PerftestResult {
  gbps: number;
  msgRate: number;
}

let nextPort = 13500 + (process.pid % 1000);

/** Runs one ucx_perftest server/client pair and parses its final line. */
async function perftest(
  test: string,
  size: number,
  iters: number,
  transports: string,
  memory: BenchMemory,
): Promise<PerftestResult> {
  const port = nextPort++;
  const tool = ucxTool("ucx_perftest", { ...process.env, UCX_TLS: transports });
  const env = tool.env;
  if (memory === "host") env.UCX_ALLOC_PRIO = "heap";
  const warmup = String(Math.max(10, Math.floor(iters / 10)));
  const server = spawn(tool.command, ["-p", String(port)], { env, stdio: "ignore" });
  const serverExit = new Promise<void>((resolve) => server.on("exit", () => resolve()));
  try {
    await new Promise((r) => setTimeout(r, 300));
    const out = await new Promise<string>((resolve, reject) => {
      const client = spawn(
        tool.command,
        [
          "127.0.0.1",
          "-p",
          String(port),
          "-t",
          test,
          "-s",
          String(size),
          "-n",
          String(iters),
          "-w",
          warmup,
        ],
        { env, stdio: ["ignore", "pipe", "pipe"] },
      );
      let text = "";
      client.stdout.on("data", (d: Buffer) => (text += d.toString()));
      client.stderr.on("data", (d: Buffer) => (text += d.toString()));
      const timer = setTimeout(() => client.kill("SIGKILL"), 120_000);
      client.on("error", reject);
      client.on("exit", (code) => {
        clearTimeout(timer);
        if (code === 0) resolve(text);
        else
          reject(new Error(`ucx_perftest ${test} -s ${size} exited ${code}: ${text.slice(-500)}`));
      });
    });
    // Final: iters, overhead 50%/avg/overall (usec), bandwidth avg/overall (MiB/s), msg rate avg/overall
    const line = out.split("\n").find((l) => l.trim().startsWith("Final:"));
    if (line === undefined)
      throw new Error(`no 'Final:' line from ucx_perftest ${test}: ${out.slice(-500)}`);
    const cols = line.trim().split(/\s+/).slice(1).map(Number);
    return { gbps: (cols[5]! * 1024 * 1024) / 1e9, msgRate: cols[7]! };
  } finally {
    server.kill("SIGKILL");
    await serverExit;
  }
}

interface BwResult {
  gbps: number;
  msgRate: number;
}

export async function runNativeBench(opts: NativeBenchOptions = {}): Promise<NativeBenchRow[]> {
  const sizes = opts.sizes ?? DEFAULT_SIZES;
  const transports = opts.transports ?? "shm,self";
  const targetBytes = opts.targetBytes ?? 4 * 2 ** 30;
  const log = opts.log ?? ((): void => {});
  const rows: NativeBenchRow[] = [];
  for (const memory of opts.memories ?? (["ucx", "host"] as BenchMemory[])) {
    const p = new PeerProcess();
    const d = new PeerProcess();
    try {
      await p.call("init", { name: "bench-p", transports });
      const id = await d.call<{ address: string }>("init", {
        name: "bench-d",
        transports,
      });
      await p.call("connect", { address: id.address });
      for (const size of sizes) {
        const iters = Math.min(200_000, Math.max(64, Math.floor(targetBytes / size)));
        // One buffer of `size` on each side, reused by every message, as ucx_perftest does.
        await p.call("alloc", { size, seed: 1, memory });
        const kd = await d.call<{ key: string }>("alloc", { size, memory });
        await p.call("import", { key: kd.key });
        const batch = Math.min(opts.batch ?? 256, iters);
        const window = opts.window ?? 4;
        const bw = async (kind: "write" | "read"): Promise<BwResult> => {
          await p.call("bw", { kind, size, iters: Math.min(iters, batch * 4), batch, window }); // warm-up
          return p.call<BwResult>("bw", { kind, size, iters, batch, window }, 300_000);
        };
        const w = await bw("write");
        const put = await perftest("ucp_put_bw", size, iters, transports, memory);
        const r = await bw("read");
        // ucx_perftest's get on heap memory runs far slower than its put (about 1 ms
        // a message at 4 KiB here): cap its iterations so the run stays bounded.
        const getIters = memory === "host" ? Math.min(iters, 2000) : iters;
        const get = await perftest("ucp_get", size, getIters, transports, memory);
        const row: NativeBenchRow = {
          memory,
          size,
          iters,
          kvxferWriteGBps: w.gbps,
          perftestPutGBps: put.gbps,
          writeRatio: w.gbps / put.gbps,
          kvxferWriteMsgRate: w.msgRate,
          perftestPutMsgRate: put.msgRate,
          writeRateRatio: w.msgRate / put.msgRate,
          kvxferReadGBps: r.gbps,
          perftestGetGBps: get.gbps,
          readRatio: r.gbps / get.gbps,
          kvxferReadMsgRate: r.msgRate,
          perftestGetMsgRate: get.msgRate,
          readRateRatio: r.msgRate / get.msgRate,
        };
        rows.push(row);
        log(formatRow(row));
      }
    } finally {
      await p.close();
      await d.close();
    }
  }
  return rows;
}

function human(size: number): string {
  if (size >= 1 << 20) return `${size / (1 << 20)} MiB`;
  return `${size / 1024} KiB`;
}

const HEADER =
  "mem  size      | write GB/s  put GB/s  ratio | write Mmsg/s put Mmsg/s ratio | read GB/s  get GB/s  ratio | read Mmsg/s get Mmsg/s ratio";

function formatRow(r: NativeBenchRow): string {
  const f = (x: number, w = 8, dp = 2): string => x.toFixed(dp).padStart(w);
  return [
    `${r.memory.padEnd(4)} ${human(r.size).padEnd(9)}`,
    `${f(r.kvxferWriteGBps, 10)} ${f(r.perftestPutGBps, 9)} ${f(r.writeRatio, 6)}`,
    `${f(r.kvxferWriteMsgRate / 1e6, 12, 3)} ${f(r.perftestPutMsgRate / 1e6, 10, 3)} ${f(r.writeRateRatio, 5)}`,
    `${f(r.kvxferReadGBps, 9)} ${f(r.perftestGetGBps, 9)} ${f(r.readRatio, 6)}`,
    `${f(r.kvxferReadMsgRate / 1e6, 11, 3)} ${f(r.perftestGetMsgRate / 1e6, 10, 3)} ${f(r.readRateRatio, 5)}`,
  ].join(" | ");
}

export function formatNativeTable(rows: NativeBenchRow[]): string {
  return [HEADER, ...rows.map(formatRow)].join("\n");
}

function parseSize(s: string): number {
  const m = /^(\d+)\s*([kmg]?)i?b?$/i.exec(s.trim());
  if (m === null) throw new Error(`bad size '${s}'`);
  const mult = { "": 1, k: 1 << 10, m: 1 << 20, g: 1 << 30 }[
    m[2]!.toLowerCase() as "" | "k" | "m" | "g"
  ];
  return Number(m[1]) * mult;
}

export async function main(argv: string[]): Promise<void> {
  const json = argv.includes("--json");
  const opts: NativeBenchOptions = {};
  const sizesAt = argv.indexOf("--sizes");
  if (sizesAt >= 0) opts.sizes = argv[sizesAt + 1]!.split(",").map(parseSize);
  const memAt = argv.indexOf("--memory");
  if (memAt >= 0) opts.memories = argv[memAt + 1]!.split(",") as BenchMemory[];
  const tlsAt = argv.indexOf("--transports");
  if (tlsAt >= 0) opts.transports = argv[tlsAt + 1]!;
  if (!json) {
    console.log(
      `kvxfer native vs ucx_perftest, two processes, UCX_TLS=${opts.transports ?? "shm,self"}`,
    );
    console.log(HEADER);
    opts.log = (line): void => console.log(line);
  }
  const rows = await runNativeBench(opts);
  const result = { bench: "native", transports: opts.transports ?? "shm,self", rows };
  // bench/results/native.json (KVXFER_BENCH_RESULTS), where `kvxfer bench plot` reads it.
  const file = writeJsonResult("native", result);
  if (json) console.log(JSON.stringify(result, null, 2));
  else console.log(`  results: ${file}`);
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? "").href) {
  main(process.argv.slice(2)).catch((err: unknown) => {
    console.error(err);
    process.exit(1);
  });
}
