/**
 * `kvxfer bench peers --faults`: kvxfer's agent, NIXL's and Mooncake's, each as two processes in
 * two network namespaces (UCX over TCP for kvxfer and NIXL, Mooncake's own TCP transport), on
 * the fault harness's data link (bench/net/faults.ts), and what each does when the link between
 * them is capped, lossy, delayed or cut while transfers are in flight (issue 52).
 *
 * Every system runs the same cases in the same order: `count` READs of `size` bytes at once
 * (the initiator reads the target's buffer, as a decoder pulls), on the clean link; under a
 * bandwidth cap; with 1% loss each way; with 5 ms ± 1 ms each way (the NFQUEUE delay line; the
 * case says why when it cannot run); and cut both ways for `cutS` seconds while they stream
 * behind the cap, then a single READ after the heal (does the agent recover without a restart?).
 * Each case reports, per system, how many transfers were done, failed or still pending at the
 * deadline, when, and the first error. kvxfer's agent runs in error mode "peer" over TCP, as the
 * sidecar runs it; NIXL in its own default ("peer"); Mooncake as it comes. The sidecar's bounds
 * above the agent (peer timeout, leases, the watchdog) are measured by
 * test/sidecar/multiprocess/net-faults.test.ts; docs/operations.md puts both side by side.
 */
import { pathToFileURL } from "node:url";

import { FaultNet, faultSupport } from "./net/faults.js";
import type { NetnsPair } from "./native/netns.js";
import {
  cleanups,
  defaultPython,
  errText,
  hookSignals,
  installPeers,
  placement,
  pythonProblem,
  spawnSide,
  type PeerSystem,
  type Side,
  type Variant,
} from "./peers.js";
import { BenchArgs, machineLine, markdownTable, runSuiteMain } from "./report.js";

export interface PeerFaultsOptions {
  json: boolean;
  log?: (line: string) => void;
  systems?: PeerSystem[];
  python?: string;
  install?: boolean;
  /** Transfers in flight per case (default 16). */
  count?: number;
  /** Bytes per transfer (default 4 MiB). */
  size?: number;
  /** The cap's rate, Mbit/s (default 100). */
  capMbit?: number;
  /** How long the partition lasts, seconds (default 15). */
  cutS?: number;
}

export interface FlightOutcome {
  ok: boolean;
  ms: number;
  error?: string;
}

export interface FaultCell {
  done: number;
  failed: number;
  pending: number;
  /** When the last done transfer ended, ms after the posts. */
  lastDoneMs?: number;
  /** When the first failure was reported, ms after the posts. */
  firstFailMs?: number;
  firstError?: string;
  /** Partition only: one READ right after the heal. */
  after?: FlightOutcome;
  /** The case did not run for this system (set-up failed, or the machine cannot apply it). */
  error?: string;
}

export interface FaultRow {
  fault: string;
  /** Transfers in flight in this case. */
  count: number;
  values: Record<string, FaultCell>;
}

export interface PeerFaultsResult {
  bench: "peer-faults";
  machine: string;
  /** Bytes per transfer. */
  size: number;
  settings: string;
  systems: { label: string; status: string; error?: string; info?: Record<string, unknown> }[];
  rows: FaultRow[];
}

const VARIANTS: Record<PeerSystem, Variant> = {
  kvxfer: { label: "kvxfer", system: "kvxfer", work: [] },
  nixl: { label: "nixl", system: "nixl", errorMode: "peer", work: [] },
  mooncake: { label: "mooncake", system: "mooncake", work: [] },
};

const BUFFER_SLACK = 1 << 20;

/** The fault net's two hosts as the peers bench's namespace pair (0: initiator in D, 1: target in P). */
function asPair(net: FaultNet): NetnsPair {
  const h = [net.hosts.d, net.hosts.p] as const;
  return {
    names: [h[0].ns, h[1].ns],
    devices: [h[0].dev, h[1].dev],
    addresses: [h[0].address, h[1].address],
    prefix: (i) => h[i].prefix,
    destroy: () => net.destroy(),
  };
}

function cellOf(outs: FlightOutcome[]): FaultCell {
  const done = outs.filter((o) => o.ok);
  const failed = outs.filter((o) => !o.ok && o.error !== "pending at the deadline");
  const cell: FaultCell = {
    done: done.length,
    failed: failed.length,
    pending: outs.length - done.length - failed.length,
  };
  if (done.length > 0) cell.lastDoneMs = Math.max(...done.map((o) => o.ms));
  if (failed.length > 0) {
    cell.firstFailMs = Math.min(...failed.map((o) => o.ms));
    cell.firstError = failed[0]!.error ?? "failed";
  }
  return cell;
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

interface FaultCase {
  name: string;
  /** Transfers in flight (default: the run's count). */
  count?: number;
  /** Why it cannot run on this machine, or undefined. */
  missing?: string | undefined;
  run(net: FaultNet, flight: (timeoutMs: number) => Promise<FlightOutcome[]>): Promise<FaultCell>;
}

function faultCases(
  o: Required<Omit<PeerFaultsOptions, "log" | "json" | "systems" | "install">>,
): FaultCase[] {
  const transferS = (o.count * o.size * 8) / (o.capMbit * 1e6);
  const capped = Math.ceil(4 * transferS * 1000) + 20_000;
  return [
    { name: "clean link", run: async (_n, flight) => cellOf(await flight(60_000)) },
    {
      name: `cap ${o.capMbit} Mbit/s`,
      run: async (net, flight) => {
        net.cap(o.capMbit);
        try {
          return cellOf(await flight(capped));
        } finally {
          net.uncap();
        }
      },
    },
    {
      name: "1% loss each way",
      run: async (net, flight) => {
        net.drop("p", 0.01);
        net.drop("d", 0.01);
        try {
          return cellOf(await flight(60_000));
        } finally {
          net.heal();
        }
      },
    },
    {
      name: "5 ms ± 1 ms each way",
      missing: faultSupport().delayMissing,
      run: async (net, flight) => {
        await net.delay("p", 5, 1);
        await net.delay("d", 5, 1);
        try {
          return cellOf(await flight(60_000));
        } finally {
          net.undelay();
        }
      },
    },
    {
      // Issue 52's soak: twice the transfers, on a link that loses and delays at once.
      name: `1% loss and 5 ms ± 1 ms each way, ${2 * o.count} in flight`,
      count: 2 * o.count,
      missing: faultSupport().delayMissing,
      run: async (net, flight) => {
        await net.delay("p", 5, 1);
        await net.delay("d", 5, 1);
        net.drop("p", 0.01);
        net.drop("d", 0.01);
        try {
          return cellOf(await flight(120_000));
        } finally {
          net.heal();
          net.undelay();
        }
      },
    },
    {
      name: `cut ${o.cutS} s both ways, ${o.capMbit} Mbit/s`,
      run: async (net, flight) => {
        net.cap(o.capMbit);
        const cutMs = o.cutS * 1000;
        const pending = flight(capped + cutMs + 60_000);
        try {
          await sleep(Math.min(1000, (transferS * 1000) / 4));
          net.partition();
          await sleep(cutMs);
        } finally {
          net.heal();
          net.uncap();
        }
        return cellOf(await pending);
      },
    },
  ];
}

async function runSystem(
  v: Variant,
  net: FaultNet,
  cases: FaultCase[],
  o: Required<Omit<PeerFaultsOptions, "log" | "json" | "systems" | "install">>,
  result: PeerFaultsResult,
  log: (l: string) => void,
): Promise<void> {
  const status: PeerFaultsResult["systems"][number] = { label: v.label, status: "ok" };
  result.systems.push(status);
  const fail = (why: string): void => {
    for (const r of result.rows)
      r.values[v.label] ??= { done: 0, failed: 0, pending: 0, error: why };
  };
  if (v.system !== "kvxfer") {
    const problem = pythonProblem(o.python);
    if (problem !== undefined) {
      status.status = "not installed";
      status.error = `${problem}; run: kvxfer bench peers --faults --install`;
      fail(status.status);
      return;
    }
  }
  const ns = asPair(net);
  const p0 = placement(v, "tcp", ns, 0);
  const p1 = placement(v, "tcp", ns, 1);
  const bufferBytes = Math.max(...cases.map((c) => c.count ?? o.count)) * o.size + BUFFER_SLACK;
  const sides: Side[] = [spawnSide(v, p0, o.python, 0), spawnSide(v, p1, o.python, 1)];
  const [a, b] = sides as [Side, Side];
  try {
    try {
      status.info = await a.call<Record<string, unknown>>("init", p0.init, 60_000);
      await b.call("init", p1.init, 60_000);
      const ia = await a.call<{ peerInfo: unknown }>("alloc", { size: bufferBytes });
      const ib = await b.call<{ peerInfo: unknown }>("alloc", { size: bufferBytes });
      await a.call("connect", { peerInfo: ib.peerInfo, errorMode: "peer" });
      await b.call("connect", { peerInfo: ia.peerInfo, errorMode: "peer" });
      // One READ first: connections made, memory touched, before any case.
      const warm = await a.call<{ transfers: FlightOutcome[] }>(
        "flight",
        { kind: "read", size: o.size, count: 1 },
        30_000,
      );
      if (!warm.transfers[0]!.ok) throw new Error(`warm-up READ: ${warm.transfers[0]!.error}`);
    } catch (err) {
      const code = (err as { code?: string }).code;
      status.status = code === "ERR_NOT_INSTALLED" ? "not installed" : "failed";
      status.error = errText(err);
      log(`  ${v.label}: ${status.status}: ${status.error}`);
      fail(status.status);
      return;
    }
    log(`  ${v.label}: ${String(status.info?.version)}, UCX ${String(status.info?.ucx)}`);
    const flight = async (timeoutMs: number, count = o.count): Promise<FlightOutcome[]> =>
      (
        await a.call<{ transfers: FlightOutcome[] }>(
          "flight",
          { kind: "read", size: o.size, count },
          timeoutMs + 5_000,
        )
      ).transfers;
    for (const c of cases) {
      const row = result.rows.find((r) => r.fault === c.name)!;
      if (c.missing !== undefined) {
        row.values[v.label] = { done: 0, failed: 0, pending: 0, error: `not run: ${c.missing}` };
        continue;
      }
      let cell: FaultCell;
      try {
        cell = await c.run(net, (t) => flight(t, c.count ?? o.count));
        if (c.name.startsWith("cut")) {
          const after = await flight(30_000, 1).catch((err: unknown): FlightOutcome[] => [
            { ok: false, ms: NaN, error: errText(err) },
          ]);
          cell.after = after[0]!;
        }
      } catch (err) {
        cell = { done: 0, failed: 0, pending: 0, error: errText(err) };
      }
      row.values[v.label] = cell;
      log(`    ${c.name}: ${describeCell(cell, c.count ?? o.count, o.size)}`);
    }
  } finally {
    await Promise.all(sides.map((s) => s.close()));
  }
}

export function describeCell(c: FaultCell, count: number, size: number): string {
  if (c.error !== undefined && c.done + c.failed + c.pending === 0) return c.error;
  const parts = [`${c.done}/${count} done`];
  if (c.lastDoneMs !== undefined)
    parts[0] +=
      `, last ${(c.lastDoneMs / 1000).toFixed(2)} s` +
      (c.done === count
        ? ` (${((count * size * 8) / (c.lastDoneMs * 1e3)).toFixed(0)} Mbit/s)`
        : "");
  if (c.failed > 0)
    parts.push(
      `${c.failed} failed from ${((c.firstFailMs ?? 0) / 1000).toFixed(2)} s (${(c.firstError ?? "").slice(0, 80)})`,
    );
  if (c.pending > 0) parts.push(`${c.pending} still pending at the deadline`);
  if (c.after !== undefined)
    parts.push(
      c.after.ok
        ? `after the heal: a READ in ${c.after.ms.toFixed(0)} ms`
        : `after the heal: a READ failed (${(c.after.error ?? "").slice(0, 60)})`,
    );
  return parts.join("; ");
}

export async function runPeerFaults(opts: PeerFaultsOptions): Promise<PeerFaultsResult> {
  const log = opts.log ?? ((): void => {});
  let python = opts.python ?? defaultPython();
  if (opts.install === true) python = installPeers(log);
  const o = {
    count: opts.count ?? 16,
    size: opts.size ?? 4 << 20,
    capMbit: opts.capMbit ?? 100,
    cutS: opts.cutS ?? 15,
    python,
  };
  const systems = opts.systems ?? ["kvxfer", "nixl", "mooncake"];
  const result: PeerFaultsResult = {
    bench: "peer-faults",
    machine: machineLine(),
    size: o.size,
    settings:
      `${o.count} READs of ${o.size >> 20} MiB at once per case (registered host memory, two processes in two ` +
      `network namespaces, one data veth: bench/net/faults.ts); cap: tbf at ${o.capMbit} Mbit/s; loss: iptables ` +
      `random drops; delay: the NFQUEUE delay line; cut: every packet dropped both ways for ${o.cutS} s, ` +
      `1 s into a capped flight, then one READ; kvxfer's agent and NIXL in UCX error mode peer, over TCP`,
    systems: [],
    rows: [],
  };
  const support = faultSupport();
  const cases = faultCases(o);
  for (const c of cases) result.rows.push({ fault: c.name, count: c.count ?? o.count, values: {} });
  if (support.missing !== undefined) {
    for (const s of systems) {
      result.systems.push({ label: s, status: "failed", error: support.missing });
      for (const r of result.rows)
        r.values[s] = { done: 0, failed: 0, pending: 0, error: support.missing };
    }
    return result;
  }
  hookSignals();
  const net = new FaultNet("pf", 78);
  const destroy = (): void => net.destroy();
  cleanups.add(destroy);
  try {
    for (const s of systems) {
      log(`${s} ...`);
      await runSystem(VARIANTS[s], net, cases, o, result, log);
      net.heal();
      net.uncap();
      net.undelay();
    }
  } finally {
    net.destroy();
    cleanups.delete(destroy);
  }
  return result;
}

export function formatPeerFaults(r: PeerFaultsResult): string {
  const labels = r.systems.map((s) => s.label);
  return markdownTable(
    ["fault", ...labels],
    r.rows.map((row) => [
      row.fault,
      ...labels.map((l) => (row.values[l] ? describeCell(row.values[l], row.count, r.size) : "—")),
    ]),
  );
}

const USAGE =
  "usage: kvxfer bench peers --faults [--systems kvxfer,nixl,mooncake] [--quick] [--install] [--python PATH] [--json]";

export function parsePeerFaultsArgs(argv: readonly string[]): PeerFaultsOptions {
  const a = new BenchArgs(argv, USAGE);
  const o: PeerFaultsOptions = { json: a.has("--json") };
  if (a.has("--quick")) {
    o.count = 8;
    o.size = 2 << 20;
    o.cutS = 8;
  }
  if (a.has("--install")) o.install = true;
  const python = a.string("--python");
  if (python !== undefined) o.python = python;
  const systems = a.list("--systems");
  if (systems !== undefined) {
    for (const s of systems)
      if (!["kvxfer", "nixl", "mooncake"].includes(s))
        throw new Error(`unknown system '${s}'\n${USAGE}`);
    o.systems = systems as PeerSystem[];
  }
  a.done();
  return o;
}

export function main(argv: string[] = process.argv.slice(2)): Promise<PeerFaultsResult> {
  return runSuiteMain("peer-faults", parsePeerFaultsArgs(argv), runPeerFaults, (r) => [
    `\nkvxfer's agent vs NIXL vs Mooncake on a link that misbehaves, same run; ${r.machine}`,
    `  ${r.settings}`,
    ...r.systems.map(
      (s) => `  ${s.label}: ${s.status}${s.error !== undefined ? `: ${s.error}` : ""}`,
    ),
    "",
    formatPeerFaults(r),
  ]);
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href)
  main().catch((err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
