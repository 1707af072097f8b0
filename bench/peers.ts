// kvxfer next to NIXL and Mooncake's transfer engine, in the same run: for each system two
// processes on this machine, registered host memory, the same transport family where the peer
// offers it, and the same work, driven through one JSON-lines protocol:
//   kvxfer:   bench/peers/kvxfer-peer.ts over the native addon (Debian's UCX);
//   NIXL:     bench/peers/harness.py nixl, `nixl_agent` with its UCX backend (the UCX its wheel bundles);
//   Mooncake: bench/peers/harness.py mooncake, `mooncake.engine.TransferEngine`, P2P handshake.
// Transports: `shm` (one network namespace, UCX_TLS=shm,self) and `tcp` (two network namespaces
// joined by veth, made and removed here). Work: WRITE/READ bandwidth with one descriptor per
// request; a KV-shaped WRITE (planTransfer's descriptors for a llama3-8b-shaped request, one
// transfer, one notification) timed from post to the receiver seeing the notification, also
// through full kvxfer sidecars (bench/e2e.ts, push); descriptor posting cost; notification
// round trips. A peer that is missing or cannot run is a row saying so, with the error.
//
// Run: `node dist/bench/peers.js [--json] [--quick] [--install] [--systems kvxfer,nixl,mooncake]
//   [--transports shm,tcp] [--sizes 4k,...] [--tokens 128,2048,8192] [--descs 1000,18880,...]`.
import { execFileSync, spawnSync } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

import { kvLayout, planTransfer, type KvLayout } from "../src/plan/index.js";
import { prng } from "../sim/prng.js";
import { JsonLinesChild } from "../sim/json-lines-child.js";
import { runE2eBench } from "./e2e.js";
import { canCreateNetns, createNetnsPair, type NetnsPair } from "./native/netns.js";
import {
  BenchArgs,
  fmt,
  machineLine,
  markdownTable,
  packageRoot,
  runSuiteMain,
  stats,
  table,
  writeChart,
  type Stats,
} from "./report.js";
import { lineChart, shortBytes, type ChartSeries } from "./svg.js";

export type PeerSystem = "kvxfer" | "nixl" | "mooncake";
export type PeerTransport = "shm" | "tcp";

/** One configuration of one system: kvxfer runs twice (sleeping progress thread, and busy-poll). */
export interface Variant {
  /** Column name: kvxfer, kvxfer-busy, nixl, mooncake. */
  label: string;
  system: PeerSystem;
  busyPoll?: boolean;
  /** kvxfer: who progresses the worker ("caller": the JavaScript thread polls, as NIXL's does). */
  progress?: "thread" | "caller";
  /**
   * kvxfer: bandwidth reposts prepared transfers (Agent.prepare) as the agent's `prepared` events
   * return them, as NIXL's harness reposts prepared handles (default: transferMany's promises).
   */
  prepared?: boolean;
  /** kvxfer: the event loop watches the worker too (Agent loopWake). */
  loopWake?: boolean;
  /** kvxfer: another build of the addon (KVXFER_ADDON). */
  addon?: string;
  /** NIXL's UCX error-handling mode; default "none" (as kvxfer); "peer" is NIXL's own default. */
  errorMode?: "none" | "peer";
  /** Only on these transports (default: all). */
  transports?: readonly PeerTransport[];
  /** Work it runs (the busy-poll variant runs only the latency-bound parts). */
  work: readonly Work[];
}

export type Work = "bw" | "kv" | "desc" | "ping";

export interface PeersBenchOptions {
  systems?: PeerSystem[];
  transports?: PeerTransport[];
  sizes?: number[];
  kvTokens?: number[];
  /** Measured KV requests per size (after one warm-up). */
  kvRounds?: number;
  descCounts?: number[];
  /** Measurements per descriptor count (median reported). */
  descReps?: number;
  pingReps?: number;
  /** Bytes moved per bandwidth measurement (iterations bounded to 32..100k). */
  targetBytes?: number;
  /** Requests in flight in the bandwidth loops. */
  window?: number;
  /** Also move the KV shapes through full kvxfer sidecars (bench/e2e.ts, push, shm). */
  sidecars?: boolean;
  /** Python for the NIXL and Mooncake harness; default <root>/.venv/bin/python, else python3. */
  python?: string;
  /** pip-install bench/peers/requirements.txt into the project venv first. */
  install?: boolean;
  json: boolean;
  log?: (line: string) => void;
}

export type Cell<T> = T | { error: string };

export interface BwFigure {
  gbps: number;
  msgRate: number;
  /** The initiator process's CPU (all threads) per request, in microseconds: little moved by other load. */
  cpuUsPerReq: number;
  /** The target process's CPU (all threads) per request over the same loop, in microseconds. */
  targetCpuUsPerReq?: number;
}
export interface KvFigure {
  /** Post -> the receiver has the notification (ms). */
  ms: Stats;
  /** How long the post call itself took (ms). */
  postMs: Stats;
}
export interface DescFigure {
  /** Turning offsets into the API's descriptor form, not counted as posting (ms). */
  buildMs: number;
  /** NIXL: get_xfer_descs + initialize_xfer; 0 elsewhere. */
  prepMs: number;
  /** The transfer call alone: NIXL transfer(), kvxfer write(), Mooncake batch submit. */
  transferCallMs: number;
  /** prepMs + transferCallMs: from the descriptor array to control back. */
  postMs: number;
  /** From the same start until the initiator sees completion. */
  completeMs: number;
}
export interface PingFigure {
  /** Round trips per second, one in flight. */
  rate: number;
  /** kvxfer: the initiator's turns in which its event loop progressed the worker itself. */
  loopTurns?: number;
}

export interface SystemStatus {
  label: string;
  system: PeerSystem;
  transport: PeerTransport;
  status: "ok" | "not installed" | "not offered" | "failed";
  error?: string;
  /** What the peer reported at init: version, UCX, settings. */
  info?: Record<string, unknown>;
}

export interface PeersBenchResult {
  bench: "peers";
  machine: string;
  /** Load average before and after the run. */
  load: { before: number[]; after: number[] };
  python: string;
  settings: string;
  systems: SystemStatus[];
  bw: {
    transport: PeerTransport;
    kind: "write" | "read";
    size: number;
    values: Record<string, Cell<BwFigure>>;
  }[];
  kv: {
    transport: PeerTransport;
    tokens: number;
    bytes: number;
    descriptors: number;
    values: Record<string, Cell<KvFigure>>;
  }[];
  desc: {
    transport: PeerTransport;
    count: number;
    size: number;
    values: Record<string, Cell<DescFigure>>;
  }[];
  ping: { transport: PeerTransport; bytes: number; values: Record<string, Cell<PingFigure>> }[];
}

export const DEFAULT_PEER_SIZES = [
  4 << 10,
  16 << 10,
  64 << 10,
  256 << 10,
  1 << 20,
  4 << 20,
  16 << 20,
  64 << 20,
];
const BUFFER_BYTES = 256 << 20;
const DESC_SIZE = 4096;
/** Descriptors 8 KiB apart: no two adjacent, so no system can merge them into fewer copies. */
const DESC_STRIDE = 8192;
const PING_BYTES = 32;

// --- the peer processes ---------------------------------------------------------------------

/** The project venv's python, else python3 on the PATH. */
export function defaultPython(): string {
  const venv = join(packageRoot(), ".venv", "bin", "python");
  return existsSync(venv) ? venv : "python3";
}

export const REQUIREMENTS = "bench/peers/requirements.txt";

/** The pip command --install runs (no dependency resolution: see requirements.txt). */
export function installCommand(python: string): string[] {
  return [python, "-m", "pip", "install", "--no-deps", "-r", join(packageRoot(), REQUIREMENTS)];
}

/** Creates <root>/.venv when missing, then installs the pinned peers into it. */
export function installPeers(log: (l: string) => void): string {
  const root = packageRoot();
  const venvPython = join(root, ".venv", "bin", "python");
  if (!existsSync(venvPython)) {
    log(`creating ${join(root, ".venv")} ...`);
    execFileSync("python3", ["-m", "venv", join(root, ".venv")], { stdio: "inherit" });
  }
  const cmd = installCommand(venvPython);
  log(`${cmd.join(" ")} ...`);
  // pip's cache stays out of the repository.
  const cache = process.env.PIP_CACHE_DIR ?? join(process.env.HOME ?? "/tmp", ".cache", "pip");
  const r = spawnSync(cmd[0]!, cmd.slice(1), {
    stdio: "inherit",
    env: { ...process.env, PIP_CACHE_DIR: cache },
    timeout: 20 * 60_000,
  });
  if (r.status !== 0) throw new Error(`pip install failed (exit ${r.status ?? r.signal})`);
  return venvPython;
}

/** Clock ticks per second of /proc/<pid>/stat's times (USER_HZ, 100 on Linux). */
const CLK_TCK = 100;

export class Side {
  private readonly proc: JsonLinesChild;

  constructor(argv: string[], env: NodeJS.ProcessEnv, name: string) {
    this.proc = new JsonLinesChild(argv, {
      name,
      env,
      makeError: (code, message) => Object.assign(new Error(message), { code }),
    });
  }

  /**
   * CPU seconds (user + system, every thread) this side's process has used so far, from
   * /proc/<pid>/stat (`ip netns exec` execs the command: the pid is the harness's own).
   */
  cpuSeconds(): number {
    const pid = this.proc.child.pid;
    if (pid === undefined) return NaN;
    try {
      const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
      // Fields after the command name (which may hold spaces): utime and stime are 14 and 15.
      const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
      return (Number(f[11]) + Number(f[12])) / CLK_TCK;
    } catch {
      return NaN;
    }
  }

  /** The first error line UCX printed, if any: the reason behind an opaque NIXL status. */
  ucxError(): string | undefined {
    return /UCX\s+ERROR\s+(.*)/.exec(this.proc.stderr)?.[1]?.trim();
  }

  call<T>(op: string, args: Record<string, unknown> = {}, timeoutMs = 60_000): Promise<T> {
    return this.proc.call<T>(op, { ...args, timeoutMs: timeoutMs - 1000 }, timeoutMs);
  }

  async close(): Promise<void> {
    if (this.proc.running) {
      await Promise.race([
        this.proc.call("exit", {}, 3000).catch(() => undefined),
        new Promise((r) => setTimeout(r, 3000)),
      ]);
    }
    await this.proc.stop(3000);
  }
}

export interface Placement {
  prefix: string[];
  env: NodeJS.ProcessEnv;
  init: Record<string, unknown>;
}

/** Where and how side i of a variant runs on a transport. */
export function placement(
  v: Variant,
  transport: PeerTransport,
  ns: NetnsPair | undefined,
  i: 0 | 1,
): Placement {
  const prefix = ns !== undefined ? ns.prefix(i) : [];
  const name = `${v.label}-${i === 0 ? "initiator" : "target"}`;
  if (v.system === "kvxfer") {
    const init: Record<string, unknown> = {
      name,
      transport,
      busyPoll: v.busyPoll === true,
      loopWake: v.loopWake === true,
      progress: v.progress ?? "thread",
      // A polling agent over TCP keeps progressing while idle, as NIXL's harness does there.
      idleProgress: transport === "tcp",
    };
    if (ns !== undefined) init.netDevice = ns.devices[i];
    return { prefix, env: v.addon !== undefined ? { KVXFER_ADDON: v.addon } : {}, init };
  }
  if (v.system === "nixl") {
    // Error-handling mode "none", as kvxfer uses: NIXL's default ("peer") cannot use UCX's
    // shared-memory transports at all (the bench records the error of that setting too).
    const env: NodeJS.ProcessEnv =
      transport === "shm"
        ? { UCX_TLS: "shm,self" }
        : { UCX_TLS: "tcp", UCX_NET_DEVICES: ns!.devices[i] };
    // No progress thread (faster here: on 2 cores it competes with the polling Python thread).
    // Over TCP a put or get completes only when the target's UCX progresses too, so there each
    // harness also progresses its agent between requests (get_new_notifs in a loop, as an engine
    // polling for notifications would).
    return {
      prefix,
      env,
      init: { name, errorMode: v.errorMode ?? "none", idleProgress: transport === "tcp" },
    };
  }
  // Mooncake: its RPC listener and TCP transport bound to this side's namespace address.
  const address = ns!.addresses[i];
  return {
    prefix,
    env: {
      MC_TCP_BIND_ADDRESS: address,
      // Its default per-peer queue refuses one batch of 18,880 slices ("TCP lane queue-full").
      MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER: "65535",
    },
    init: { name, bindAddress: address },
  };
}

/** The compiled kvxfer peer (dist/), whether this module runs compiled or from source (vitest). */
function kvxferPeerScript(): string {
  const path = join(packageRoot(), "dist", "bench", "peers", "kvxfer-peer.js");
  if (!existsSync(path)) throw new Error(`${path} not found: run 'npm run build' first`);
  return path;
}

/** Why `python` cannot run the harness at all (missing interpreter), or undefined. */
export function pythonProblem(python: string): string | undefined {
  const r = spawnSync(python, ["-c", "import sys; print(sys.version_info[0])"], {
    encoding: "utf8",
    timeout: 30_000,
  });
  if (r.error !== undefined) return `no Python at '${python}' (${r.error.message})`;
  if (r.status !== 0)
    return `'${python}' does not run (exit ${String(r.status)}): ${r.stderr.slice(-300)}`;
  return undefined;
}

export function spawnSide(v: Variant, p: Placement, python: string, i: number): Side {
  const argv =
    v.system === "kvxfer"
      ? [...p.prefix, process.execPath, kvxferPeerScript()]
      : [...p.prefix, python, join(packageRoot(), "bench", "peers", "harness.py"), v.system];
  return new Side(argv, p.env, `${v.label} side ${i}`);
}

export function errText(err: unknown): string {
  const e = err as { code?: string; message?: string };
  const msg = (e.message ?? String(err)).split("\n")[0]!.slice(0, 300);
  return e.code !== undefined ? `${e.code}: ${msg}` : msg;
}

// --- the work -------------------------------------------------------------------------------

/** The e2e shape: llama3-8b (8 KV heads x 128, bfloat16) cut to 4 layers, block 16, HND, a region per layer. */
export function kvShapeLayout(maxTokens: number): KvLayout {
  return kvLayout(
    {
      numLayers: 4,
      mla: false,
      totalKvHeads: 8,
      headDim: 128,
      dtype: "bfloat16",
      dtypeBytes: 2,
      blockSize: 16,
      numBlocks: Math.ceil(maxTokens / 16) + 64,
      order: "HND",
      tpSize: 1,
      tpRank: 0,
    },
    "region-per-layer",
  );
}

/**
 * The KV request as one descriptor list over one buffer per side holding the layout's regions
 * back to back: planTransfer's triples with each region's start added. Block ids are a seeded
 * shuffle, as an engine's allocator hands them out, so blocks rarely coalesce.
 */
export function kvDescriptors(layout: KvLayout, tokens: number, seed: number): Float64Array {
  const rand = prng(seed);
  const ids = (): number[] => {
    const all = Array.from({ length: layout.numBlocks }, (_, i) => i);
    for (let i = all.length - 1; i > 0; i--) {
      const j = Math.floor(rand() * (i + 1));
      [all[i], all[j]] = [all[j]!, all[i]!];
    }
    return all.slice(0, Math.ceil(tokens / layout.blockSize));
  };
  const plan = planTransfer(layout, layout, {
    numTokens: tokens,
    prefixTokens: 0,
    srcBlockIds: ids(),
    dstBlockIds: ids(),
  });
  const starts = layout.regionBytes.map((_, g) =>
    layout.regionBytes.slice(0, g).reduce((a, b) => a + b, 0),
  );
  const out = new Float64Array(plan.descriptorCount * 3);
  let k = 0;
  for (const pair of plan.pairs)
    for (const rp of pair.regionPairs)
      for (let i = 0; i < rp.descriptors.length; i += 3) {
        out[k++] = rp.descriptors[i]! + starts[rp.srcRegion]!;
        out[k++] = rp.descriptors[i + 1]! + starts[rp.dstRegion]!;
        out[k++] = rp.descriptors[i + 2]!;
      }
  return out;
}

function b64(d: Float64Array): string {
  return Buffer.from(d.buffer, d.byteOffset, d.byteLength).toString("base64");
}

interface KvReply {
  tPostNs: number;
  tReturnNs: number;
  tDoneNs: number;
}

async function runVariant(
  v: Variant,
  transport: PeerTransport,
  ns: NetnsPair | undefined,
  o: Required<Omit<PeersBenchOptions, "log" | "json" | "systems" | "transports" | "install">>,
  result: PeersBenchResult,
  log: (l: string) => void,
): Promise<void> {
  const status: SystemStatus = { label: v.label, system: v.system, transport, status: "ok" };
  result.systems.push(status);
  if (v.system !== "kvxfer") {
    const problem = pythonProblem(o.python);
    if (problem !== undefined) {
      status.status = "not installed";
      status.error = `${problem}; run: kvxfer bench peers --install`;
      log(`  ${v.label} over ${transport}: ${status.status}: ${status.error}`);
      return;
    }
  }
  const p0 = placement(v, transport, ns, 0);
  const p1 = placement(v, transport, ns, 1);
  const a = spawnSide(v, p0, o.python, 0);
  const b = spawnSide(v, p1, o.python, 1);
  const cell = <T, R extends { transport: PeerTransport; values: Record<string, Cell<T>> }>(
    rows: R[],
    match: (r: R) => boolean,
    value: Cell<T>,
  ): void => {
    const row = rows.find((r) => r.transport === transport && match(r));
    if (row !== undefined) row.values[v.label] = value;
  };
  try {
    try {
      status.info = await a.call<Record<string, unknown>>("init", p0.init, 60_000);
      await b.call("init", p1.init, 60_000);
      const ia = await a.call<{ peerInfo: unknown }>("alloc", { size: BUFFER_BYTES });
      const ib = await b.call<{ peerInfo: unknown }>("alloc", { size: BUFFER_BYTES });
      await a.call("connect", { peerInfo: ib.peerInfo });
      await b.call("connect", { peerInfo: ia.peerInfo });
    } catch (err) {
      const code = (err as { code?: string }).code;
      status.status = code === "ERR_NOT_INSTALLED" ? "not installed" : "failed";
      const ucx = a.ucxError() ?? b.ucxError();
      status.error =
        code === "ERR_NOT_INSTALLED"
          ? `${errText(err)}; run: kvxfer bench peers --install (${installCommand(o.python).join(" ")})`
          : `${errText(err)}${ucx !== undefined ? `; UCX: ${ucx}` : ""}`;
      log(`  ${v.label} over ${transport}: ${status.status}: ${status.error}`);
      return;
    }
    log(
      `  ${v.label} over ${transport}: ${String(status.info?.version)}, UCX ${String(status.info?.ucx)}`,
    );

    let bwStuck: string | undefined;
    if (v.work.includes("bw"))
      for (const kind of ["write", "read"] as const)
        for (const size of o.sizes) {
          const iters = Math.min(100_000, Math.max(32, Math.floor(o.targetBytes / size)));
          let value: Cell<BwFigure>;
          // One point that timed out is enough: the rest would each wait as long.
          if (bwStuck !== undefined) {
            cell<BwFigure, PeersBenchResult["bw"][number]>(
              result.bw,
              (r) => r.kind === kind && r.size === size,
              { error: `skipped after: ${bwStuck}` },
            );
            continue;
          }
          try {
            // Each point also stops after 10 s (2 s warm-up): the slowest peer sets the run time.
            const args = { kind, size, window: o.window, prepared: v.prepared === true };
            await a.call(
              "bw",
              { ...args, iters: Math.max(8, Math.floor(iters / 10)), maxMs: 2000 },
              60_000,
            );
            const target0 = b.cpuSeconds();
            const got = await a.call<{ gbps: number; msgRate: number; cpuMs: number; n: number }>(
              "bw",
              { ...args, iters, maxMs: 10_000 },
              120_000,
            );
            const targetCpu = b.cpuSeconds() - target0;
            value = {
              gbps: got.gbps,
              msgRate: got.msgRate,
              cpuUsPerReq: (got.cpuMs * 1e3) / got.n,
              ...(Number.isFinite(targetCpu)
                ? { targetCpuUsPerReq: (targetCpu * 1e6) / got.n }
                : {}),
            };
          } catch (err) {
            value = { error: errText(err) };
            if (/TIMEOUT/.test(value.error)) bwStuck = value.error;
          }
          cell(result.bw, (r) => r.kind === kind && r.size === size, value);
          log(
            `    ${kind} ${shortBytes(size)}: ${"error" in value ? value.error : `${fmt(value.gbps)} GB/s`}`,
          );
        }

    if (v.work.includes("kv")) {
      const layout = kvShapeLayout(Math.max(...o.kvTokens));
      for (const tokens of o.kvTokens) {
        let value: Cell<KvFigure>;
        try {
          const descs = b64(kvDescriptors(layout, tokens, tokens));
          const lat: number[] = [];
          const post: number[] = [];
          for (let r = 0; r <= o.kvRounds; r++) {
            const tag = `kv-${tokens}-${r}`;
            // Both at once, so that a failure of either is handled (the other is bounded).
            const [got, sent] = await Promise.all([
              b.call<{ arrivals: Record<string, number> }>("wait_notes", { tags: [tag] }, 20_000),
              a.call<KvReply>("kv", { descs, tag }, 20_000),
            ]);
            if (r === 0) continue; // warm-up
            lat.push((got.arrivals[tag]! - sent.tPostNs) / 1e6);
            post.push((sent.tReturnNs - sent.tPostNs) / 1e6);
          }
          value = { ms: stats(lat), postMs: stats(post) };
        } catch (err) {
          value = { error: errText(err) };
        }
        cell(result.kv, (r) => r.tokens === tokens, value);
        log(
          `    kv ${tokens} tokens: ${"error" in value ? value.error : `p50 ${fmt(value.ms.p50)} ms`}`,
        );
      }
    }

    // Descriptor posting last: it is the part most likely to leave a peer unusable.
    if (v.work.includes("ping")) {
      let value: Cell<PingFigure> = { error: "not run" };
      try {
        // Warm-up, then the measured run; the target answers each notification with one.
        for (const reps of [Math.min(200, o.pingReps), o.pingReps]) {
          const [, got] = await Promise.all([
            b.call("pong", { reps }, 60_000),
            a.call<PingFigure>("ping", { reps, bytes: PING_BYTES }, 60_000),
          ]);
          value = {
            rate: got.rate,
            ...(got.loopTurns !== undefined ? { loopTurns: got.loopTurns } : {}),
          };
        }
      } catch (err) {
        value = { error: errText(err) };
      }
      cell(result.ping, () => true, value);
      log(
        `    notification round trips: ${"error" in value ? value.error : `${fmt(value.rate, 0)}/s`}`,
      );
    }
    if (v.work.includes("desc"))
      for (const count of o.descCounts) {
        let value: Cell<DescFigure>;
        try {
          const runs: DescFigure[] = [];
          const reps = count >= 1_000_000 ? Math.min(2, o.descReps) : o.descReps;
          for (let r = 0; r < reps; r++)
            runs.push(
              await a.call<DescFigure>(
                "descpost",
                { count, size: DESC_SIZE, stride: DESC_STRIDE },
                Math.max(60_000, count * 0.1),
              ),
            );
          const med = (f: (d: DescFigure) => number): number => stats(runs.map(f)).p50;
          value = {
            buildMs: med((d) => d.buildMs),
            prepMs: med((d) => d.prepMs),
            transferCallMs: med((d) => d.transferCallMs),
            postMs: med((d) => d.postMs),
            completeMs: med((d) => d.completeMs),
          };
        } catch (err) {
          value = { error: errText(err) };
        }
        cell(result.desc, (r) => r.count === count, value);
        log(
          `    ${count} descriptors: ${"error" in value ? value.error : `post ${fmt(value.postMs)} ms, complete ${fmt(value.completeMs)} ms`}`,
        );
      }
  } finally {
    await Promise.all([a.close(), b.close()]);
  }
}

// --- the run --------------------------------------------------------------------------------

export function variantsFor(systems: readonly PeerSystem[]): Variant[] {
  const all: Variant[] = [];
  if (systems.includes("kvxfer")) {
    all.push({ label: "kvxfer", system: "kvxfer", work: ["bw", "kv", "desc", "ping"] });
    // The same agent (progress thread, inline posts), bandwidth without a promise per request.
    all.push({ label: "kvxfer-prepared", system: "kvxfer", prepared: true, work: ["bw"] });
    // NIXL's and Mooncake's harnesses poll; kvxfer sleeps on the worker's fd by default.
    // The same agent with the event loop watching the worker too (loopWake).
    all.push({ label: "kvxfer-loop", system: "kvxfer", loopWake: true, work: ["kv", "ping"] });
    all.push({
      label: "kvxfer-busy",
      system: "kvxfer",
      busyPoll: true,
      work: ["kv", "ping"],
    });
  }
  if (systems.includes("kvxfer"))
    // The JavaScript thread progresses the worker itself (Agent progress "caller"), no thread.
    all.push({
      label: "kvxfer-poll",
      system: "kvxfer",
      progress: "caller",
      work: ["bw", "kv", "ping"],
    });
  if (systems.includes("nixl")) {
    all.push({ label: "nixl", system: "nixl", work: ["bw", "kv", "desc", "ping"] });
    // NIXL as it comes: its default error-handling mode, on shared memory. Set-up only.
    all.push({
      label: "nixl-default",
      system: "nixl",
      errorMode: "peer",
      transports: ["shm"],
      work: [],
    });
  }
  if (systems.includes("mooncake"))
    all.push({ label: "mooncake", system: "mooncake", work: ["bw", "kv", "desc", "ping"] });
  return all;
}

export const cleanups = new Set<() => void>();
let signalsHooked = false;

/** Namespaces go on every exit path: normal end, error, and SIGINT/SIGTERM/SIGHUP. */
export function hookSignals(): void {
  if (signalsHooked) return;
  signalsHooked = true;
  for (const sig of ["SIGINT", "SIGTERM", "SIGHUP"] as const)
    process.once(sig, () => {
      for (const c of cleanups) c();
      process.exit(130);
    });
  process.once("exit", () => {
    for (const c of cleanups) c();
  });
}

export async function runPeersBench(opts: PeersBenchOptions): Promise<PeersBenchResult> {
  const log = opts.log ?? ((): void => {});
  const loadBefore = (await import("node:os")).loadavg();
  let python = opts.python ?? defaultPython();
  if (opts.install === true) python = installPeers(log);
  const o = {
    sizes: opts.sizes ?? DEFAULT_PEER_SIZES,
    kvTokens: opts.kvTokens ?? [128, 2048, 8192],
    kvRounds: opts.kvRounds ?? 20,
    descCounts: opts.descCounts ?? [1000, 18_880, 100_000, 1_000_000],
    descReps: opts.descReps ?? 3,
    pingReps: opts.pingReps ?? 2000,
    targetBytes: opts.targetBytes ?? 2 ** 30,
    window: opts.window ?? 8,
    sidecars: opts.sidecars ?? true,
    python,
  };
  const systems = opts.systems ?? ["kvxfer", "nixl", "mooncake"];
  const transports = opts.transports ?? ["shm", "tcp"];
  const variants = variantsFor(systems);
  const layout = kvShapeLayout(Math.max(...o.kvTokens));
  const result: PeersBenchResult = {
    bench: "peers",
    machine: machineLine(),
    load: { before: loadBefore, after: [] },
    python,
    settings:
      `registered host memory, ${BUFFER_BYTES >> 20} MiB per side; bandwidth: one descriptor per request, ` +
      `${o.window} requests in flight, ${shortBytes(o.targetBytes)} or 10 s per point after a 10% (at most 2 s) warm-up; ` +
      `KV: llama3-8b shape with 4 layers (8 KV heads x 128, bfloat16, HND, block 16, shuffled block ids), ` +
      `one WRITE + one notification, ${o.kvRounds} rounds after 1 warm-up; descriptors: ${DESC_SIZE} B, ` +
      `${DESC_STRIDE} B apart, one WRITE, median of ${o.descReps}; ping: ${PING_BYTES} B notifications, one in flight, ${o.pingReps} round trips`,
    systems: [],
    bw: [],
    kv: [],
    desc: [],
    ping: [],
  };
  for (const transport of transports) {
    for (const kind of ["write", "read"] as const)
      for (const size of o.sizes) result.bw.push({ transport, kind, size, values: {} });
    for (const tokens of o.kvTokens) {
      const d = kvDescriptors(layout, tokens, tokens);
      let bytes = 0;
      for (let i = 2; i < d.length; i += 3) bytes += d[i]!;
      result.kv.push({ transport, tokens, bytes, descriptors: d.length / 3, values: {} });
    }
    for (const count of o.descCounts)
      result.desc.push({ transport, count, size: DESC_SIZE, values: {} });
    result.ping.push({ transport, bytes: PING_BYTES, values: {} });
  }

  hookSignals();
  for (const transport of transports) {
    log(`peers over ${transport} ...`);
    let ns: NetnsPair | undefined;
    if (transport === "tcp") {
      if (!canCreateNetns()) {
        for (const v of variants)
          result.systems.push({
            label: v.label,
            system: v.system,
            transport,
            status: "failed",
            error: "network namespaces need root and iproute2",
          });
        continue;
      }
      ns = createNetnsPair("peers", ["198.18.77.1", "198.18.77.2"]);
      const destroy = ns.destroy;
      cleanups.add(destroy);
    }
    try {
      for (const v of variants) {
        if (v.transports !== undefined && !v.transports.includes(transport)) continue;
        if (v.system === "mooncake" && transport === "shm") {
          result.systems.push({
            label: v.label,
            system: v.system,
            transport,
            status: "not offered",
            error:
              "mooncake-transfer-engine-non-cuda moves host memory between processes over tcp or rdma only (no shared-memory transport); see the tcp rows",
          });
          continue;
        }
        await runVariant(v, transport, ns, o, result, log);
      }
    } finally {
      if (ns !== undefined) {
        ns.destroy();
        cleanups.delete(ns.destroy);
      }
    }
  }

  if (o.sidecars && systems.includes("kvxfer") && transports.includes("shm")) {
    log("kvxfer sidecars (bench e2e, push, shm) on the same KV shapes ...");
    try {
      const e2e = await runE2eBench({
        modes: ["push"],
        promptTokens: o.kvTokens,
        rounds: Math.max(3, Math.floor(o.kvRounds / 2)),
        refReps: 1,
        layers: 4,
        log,
      });
      for (const r of e2e.rows) {
        const row = result.kv.find((k) => k.transport === "shm" && k.tokens === r.tokens);
        if (row !== undefined)
          row.values["kvxfer-sidecars"] =
            r.sidecarMs.n > 0
              ? { ms: r.sidecarMs, postMs: stats([]) }
              : { error: r.failures[0] ?? "no request completed" };
      }
    } catch (err) {
      for (const row of result.kv.filter((k) => k.transport === "shm"))
        row.values["kvxfer-sidecars"] = { error: errText(err) };
    }
  }
  result.load.after = (await import("node:os")).loadavg();
  return result;
}

// --- the report -----------------------------------------------------------------------------

const PEERS = ["nixl", "mooncake"] as const;
const NAMES: Record<string, string> = {
  kvxfer: "kvxfer",
  "kvxfer-busy": "kvxfer busy-poll",
  "kvxfer-loop": "kvxfer loopWake",
  "kvxfer-sidecars": "kvxfer sidecars",
  "kvxfer-poll": "kvxfer polling",
  "kvxfer-prepared": "kvxfer prepared",
  nixl: "NIXL",
  "nixl-default": "NIXL (its default error mode, peer)",
  mooncake: "Mooncake",
};

function num<T>(c: Cell<T> | undefined, f: (v: T) => number): number | undefined {
  if (c === undefined || (typeof c === "object" && c !== null && "error" in c)) return undefined;
  return f(c as T);
}

function shown<T>(c: Cell<T> | undefined, f: (v: T) => number, dp: number): string {
  if (c !== undefined && typeof c === "object" && c !== null && "error" in c) return "err";
  return fmt(num(c, f), dp);
}

/** Columns: each kvxfer variant, then per peer its figure and kvxfer's (first variant) ratio to it. */
function compare<T>(
  values: Record<string, Cell<T>>,
  ours: readonly string[],
  f: (v: T) => number,
  dp: number,
): string[] {
  const cells = ours.map((l) => shown(values[l], f, dp));
  for (const p of PEERS) {
    const theirs = num(values[p], f);
    cells.push(shown(values[p], f, dp));
    for (const l of ours) {
      const mine = num(values[l], f);
      cells.push(mine !== undefined && theirs !== undefined ? fmt(mine / theirs) : "-");
    }
  }
  return cells;
}

function compareHead(ours: readonly string[], unit: string): string[] {
  const head = ours.map((l) => `${NAMES[l]} ${unit}`);
  for (const p of PEERS) {
    head.push(`${NAMES[p]} ${unit}`);
    for (const l of ours) head.push(ours.length > 1 ? `${NAMES[l]}/${NAMES[p]}` : `x`);
  }
  return head;
}

export interface PeersTables {
  title: string;
  head: string[];
  rows: string[][];
}

export function peersTables(r: PeersBenchResult): PeersTables[] {
  const out: PeersTables[] = [];
  const transports = [...new Set(r.bw.map((b) => b.transport))];
  for (const t of transports) {
    const poll = r.systems.some((x) => x.label === "kvxfer-poll" && x.status === "ok");
    const prepared = r.systems.some((x) => x.label === "kvxfer-prepared" && x.status === "ok");
    const loop = r.systems.some((x) => x.label === "kvxfer-loop" && x.status === "ok");
    const ours = [
      "kvxfer",
      ...(prepared ? ["kvxfer-prepared"] : []),
      ...(poll ? ["kvxfer-poll"] : []),
    ];
    for (const kind of ["write", "read"] as const) {
      const rows = r.bw.filter((b) => b.transport === t && b.kind === kind);
      out.push({
        title: `${t}: ${kind.toUpperCase()} bandwidth, GB/s (ratio = kvxfer / peer; above 1: kvxfer faster)`,
        head: ["size", ...compareHead(ours, "GB/s")],
        rows: rows.map((b) => [shortBytes(b.size), ...compare(b.values, ours, (v) => v.gbps, 2)]),
      });
      const small = rows.filter((b) => b.size <= 64 << 10);
      out.push({
        title: `${t}: ${kind.toUpperCase()} message rate, thousand requests/s (one descriptor each)`,
        head: ["size", ...compareHead(ours, "kreq/s")],
        rows: small.map((b) => [
          shortBytes(b.size),
          ...compare(b.values, ours, (v) => v.msgRate / 1e3, 1),
        ]),
      });
      out.push({
        title: `${t}: ${kind.toUpperCase()} initiator CPU per request, microseconds, all threads (ratio = kvxfer / peer; below 1: kvxfer cheaper)`,
        head: ["size", ...compareHead(ours, "CPU us")],
        rows: small.map((b) => [
          shortBytes(b.size),
          ...compare(b.values, ours, (v) => v.cpuUsPerReq, 1),
        ]),
      });
      out.push({
        title: `${t}: ${kind.toUpperCase()} target CPU per request, microseconds, all threads of the target process (ratio = kvxfer / peer; 0: the target did nothing)`,
        head: ["size", ...compareHead(ours, "CPU us")],
        rows: rows.map((b) => [
          shortBytes(b.size),
          ...compare(b.values, ours, (v) => v.targetCpuUsPerReq ?? NaN, 1),
        ]),
      });
    }
    const kvOurs = [
      "kvxfer",
      ...(loop ? ["kvxfer-loop"] : []),
      "kvxfer-busy",
      ...(poll ? ["kvxfer-poll"] : []),
      ...(t === "shm" ? ["kvxfer-sidecars"] : []),
    ];
    for (const q of ["p50", "p99"] as const)
      out.push({
        title: `${t}: KV-shaped WRITE, post -> receiver has the notification, ${q} ms (ratio = kvxfer / peer; below 1: kvxfer faster)`,
        head: ["tokens", "MiB", "descs", ...compareHead(kvOurs, "ms")],
        rows: r.kv
          .filter((k) => k.transport === t)
          .map((k) => [
            String(k.tokens),
            fmt(k.bytes / 2 ** 20, 0),
            String(k.descriptors),
            ...compare(k.values, kvOurs, (v) => v.ms[q], 2),
          ]),
      });
    out.push({
      title: `${t}: posting N descriptors of 4 KiB in one WRITE, ms (post = from the descriptor array to control back; ratio = kvxfer / peer)`,
      head: [
        "descs",
        "kvxfer post",
        "NIXL prep",
        "NIXL transfer()",
        "NIXL post",
        "x",
        "Mooncake post",
        "x",
        "kvxfer complete",
        "NIXL complete",
        "x",
        "Mooncake complete",
        "x",
      ],
      rows: r.desc
        .filter((d) => d.transport === t)
        .map((d) => {
          const k = d.values.kvxfer;
          const n = d.values.nixl;
          const m = d.values.mooncake;
          const ratio = (a: number | undefined, b: number | undefined): string =>
            a !== undefined && b !== undefined ? fmt(a / b) : "-";
          return [
            String(d.count),
            shown(k, (v) => v.postMs, 2),
            shown(n, (v) => v.prepMs, 2),
            shown(n, (v) => v.transferCallMs, 2),
            shown(n, (v) => v.postMs, 2),
            ratio(
              num(k, (v) => v.postMs),
              num(n, (v) => v.postMs),
            ),
            shown(m, (v) => v.postMs, 2),
            ratio(
              num(k, (v) => v.postMs),
              num(m, (v) => v.postMs),
            ),
            shown(k, (v) => v.completeMs, 2),
            shown(n, (v) => v.completeMs, 2),
            ratio(
              num(k, (v) => v.completeMs),
              num(n, (v) => v.completeMs),
            ),
            shown(m, (v) => v.completeMs, 2),
            ratio(
              num(k, (v) => v.completeMs),
              num(m, (v) => v.completeMs),
            ),
          ];
        }),
    });
    const pingOurs = [
      "kvxfer",
      ...(loop ? ["kvxfer-loop"] : []),
      "kvxfer-busy",
      ...(poll ? ["kvxfer-poll"] : []),
    ];
    out.push({
      title: `${t}: notification round trips per second, ${PING_BYTES}-byte payload, one in flight (ratio = kvxfer / peer)`,
      head: ["", ...compareHead(pingOurs, "/s")],
      rows: r.ping
        .filter((p) => p.transport === t)
        .map((p) => ["round trips", ...compare(p.values, pingOurs, (v) => v.rate, 0)]),
    });
  }
  return out;
}

export function statusLines(r: PeersBenchResult): string[] {
  return r.systems.map((s) => {
    const info = s.info !== undefined ? `${String(s.info.version)}; UCX ${String(s.info.ucx)}` : "";
    return `  ${s.transport} ${NAMES[s.label] ?? s.label}: ${s.status}${s.error !== undefined ? ` (${s.error})` : ""}${info !== "" ? ` - ${info}` : ""}`;
  });
}

export function formatPeers(r: PeersBenchResult, markdown = false): string {
  return peersTables(r)
    .map((t) =>
      markdown
        ? `**${t.title}**\n\n${markdownTable(t.head, t.rows)}`
        : `${t.title}\n${table(t.head, t.rows)}`,
    )
    .join("\n\n");
}

const COLORS: Record<string, string> = {
  kvxfer: "#1f77b4",
  "kvxfer-poll": "#9467bd",
  "kvxfer-prepared": "#17becf",
  nixl: "#2ca02c",
  mooncake: "#ff7f0e",
};

/** Bandwidth by request size for all three systems on one transport: WRITE solid, READ dashed. */
export function peersChart(r: PeersBenchResult, transport: PeerTransport): string {
  const series: ChartSeries[] = [];
  for (const label of ["kvxfer", "kvxfer-prepared", "kvxfer-poll", "nixl", "mooncake"])
    for (const kind of ["write", "read"] as const) {
      const points = r.bw
        .filter((b) => b.transport === transport && b.kind === kind)
        .flatMap((b): [number, number][] => {
          const g = num(b.values[label], (v) => v.gbps);
          return g !== undefined ? [[b.size, g]] : [];
        });
      if (points.length > 0)
        series.push({
          name: `${NAMES[label]} ${kind.toUpperCase()}`,
          points,
          color: COLORS[label]!,
          dashed: kind === "read",
        });
    }
  return lineChart({
    title: `Bandwidth by request size: kvxfer vs NIXL vs Mooncake (${transport})`,
    subtitle: `two processes, registered host memory, one descriptor per request; ${r.machine.split(", load")[0]!.split(",").slice(0, 2).join(",")}`,
    xLabel: "request size (bytes)",
    yLabel: "GB/s",
    logX: true,
    logY: true,
    xTickFormat: shortBytes,
    series,
  });
}

export function writePeersCharts(r: PeersBenchResult): string[] {
  const transports = [...new Set(r.bw.map((b) => b.transport))];
  return transports.flatMap((t) => writeChart(`peers-bandwidth-${t}.svg`, peersChart(r, t)));
}

export const PEERS_NOTES = [
  "  kvxfer: the native addon (pinned UCX 1.22), shm = UCX_TLS shm,self, tcp = tcp on the namespace's veth; bandwidth refills with transferMany;",
  "    kvxfer prepared: the same agent, bandwidth reposting prepared transfers as its 'prepared' events return them (no promise per request, as NIXL reposts prepared handles);",
  "    kvxfer loopWake: the same with loopWake (the event loop watches the worker too and delivers what a wake-up brought itself);",
  "    kvxfer busy-poll: the same with busyPoll; kvxfer polling: progress 'caller' (no thread; the JavaScript thread posts and polls, as NIXL's Python does)",
  "  NIXL: nixl_agent with its UCX backend (the UCX its wheel bundles), error-handling mode none, same UCX_TLS and device, no progress thread;",
  "    over tcp each NIXL process polls its agent between requests (a target's UCX must progress for a put or get to complete)",
  "    bandwidth reposts prepared handles (make_prepped_xfer); KV and descriptor lists go through get_xfer_descs + initialize_xfer + transfer",
  "  Mooncake: TransferEngine, P2P handshake, tcp bound to the namespace address; KV = batch_transfer_sync with a TransferNotify",
  "  kvxfer sidecars: bench e2e push (P's engine says prefill done -> the router hears KV_READY over gRPC), the same KV shapes",
].join("\n");

const USAGE =
  "usage: kvxfer bench peers [--json] [--quick] [--install] [--python PATH] [--systems kvxfer,nixl,mooncake] [--transports shm,tcp] [--sizes 4k,...] [--tokens 128,2048,8192] [--descs 1000,18880,100000,1000000] [--rounds N] [--no-sidecars]";

function parseSize(s: string): number {
  const m = /^(\d+)\s*([kmg]?)i?b?$/i.exec(s.trim());
  if (m === null) throw new Error(`bad size '${s}'\n${USAGE}`);
  return (
    Number(m[1]) *
    { "": 1, k: 1 << 10, m: 1 << 20, g: 1 << 30 }[m[2]!.toLowerCase() as "" | "k" | "m" | "g"]
  );
}

export function parsePeersArgs(argv: readonly string[]): PeersBenchOptions {
  const a = new BenchArgs(argv, USAGE);
  const o: PeersBenchOptions = { json: a.has("--json") };
  if (a.has("--quick")) {
    o.sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];
    o.kvRounds = 8;
    o.descCounts = [1000, 18_880, 100_000];
    o.descReps = 2;
    o.pingReps = 1000;
    o.targetBytes = 2 ** 28;
  }
  if (a.has("--install")) o.install = true;
  if (a.has("--no-sidecars")) o.sidecars = false;
  const python = a.string("--python");
  if (python !== undefined) o.python = python;
  const systems = a.list("--systems");
  if (systems !== undefined) {
    for (const s of systems)
      if (!["kvxfer", "nixl", "mooncake"].includes(s))
        throw new Error(`unknown system '${s}'\n${USAGE}`);
    o.systems = systems as PeerSystem[];
  }
  const transports = a.list("--transports");
  if (transports !== undefined) {
    for (const t of transports)
      if (t !== "shm" && t !== "tcp") throw new Error(`--transports takes shm,tcp, got '${t}'`);
    o.transports = transports as PeerTransport[];
  }
  const sizes = a.list("--sizes");
  if (sizes !== undefined) o.sizes = sizes.map(parseSize);
  const tokens = a.ints("--tokens");
  if (tokens !== undefined) o.kvTokens = tokens;
  const descs = a.ints("--descs");
  if (descs !== undefined) o.descCounts = descs;
  const rounds = a.number("--rounds", 1);
  if (rounds !== undefined) o.kvRounds = rounds;
  a.done();
  return o;
}

export async function main(argv: string[] = process.argv.slice(2)): Promise<unknown> {
  // The same agents on a link that misbehaves: bench/peer-faults.ts.
  if (argv.includes("--faults"))
    return (await import("./peer-faults.js")).main(argv.filter((a) => a !== "--faults"));
  return runSuiteMain(
    "peers",
    parsePeersArgs(argv),
    runPeersBench,
    (r) => [
      `\nkvxfer vs NIXL vs Mooncake, two processes each, same run; ${r.machine}`,
      `  load average before ${r.load.before.map((l) => l.toFixed(2)).join(" ")}, after ${r.load.after.map((l) => l.toFixed(2)).join(" ")}`,
      `  ${r.settings}`,
      ...statusLines(r),
      "",
      formatPeers(r),
      PEERS_NOTES,
    ],
    writePeersCharts,
  );
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href)
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
