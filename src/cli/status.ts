/**
 * kvxfer status <addr> [--json] [TLS flags]: what a sidecar is doing, as a table;
 * with --trace ID, the hops of one transfer on that sidecar.
 */
import {
  type CliIo,
  UsageError,
  formatBytes,
  formatDuration,
  openClientCommand,
  output,
  table,
  toJson,
} from "./grpc-client.js";
import type { SidecarClient, SidecarStatusReply } from "../api/client.js";
import type { TransferInfo } from "../sidecar/view.js";

export function formatStatus(s: SidecarStatusReply, health: string, nowMs = Date.now()): string[] {
  const lines = [
    ...table(
      ["SIDECAR", "EPOCH", "ROLE", "MODE", "TP", "UP", "HEALTH"],
      [
        [
          s.engineId,
          `0x${s.epoch.toString(16)}`,
          s.role,
          s.mode,
          String(s.tpSize),
          formatDuration(s.uptimeMs),
          s.draining ? `${health} (draining)` : health,
        ],
      ],
    ),
    `layout: ${s.layoutSummary || "(not registered yet)"}`,
    `ucx: ${s.ucx.version || "unknown"} (transports: ${s.ucx.transports.join(", ") || "none"}; memory: ${s.ucx.memoryTypes.join(", ") || "none"})`,
    `moved: ${s.transfersMoved} transfers, ${formatBytes(s.bytesMoved)}; lease table: ${s.leaseTableSize}`,
    `events: ${s.lastSeq === 0 ? "none yet" : `seq ${s.firstSeq}..${s.lastSeq} retained`}; ${s.watchers} watcher${s.watchers === 1 ? "" : "s"}`,
    "",
  ];
  if (s.peers.length === 0) lines.push("peers: none");
  else
    lines.push(
      ...table(
        ["PEER", "EPOCH", "STATE", "LAST SEEN", "SIDE CHANNEL"],
        s.peers.map((p) => [
          p.engineId,
          `0x${p.epoch.toString(16)}`,
          p.state,
          p.lastSeenMs > 0 ? `${formatDuration(Math.max(0, nowMs - p.lastSeenMs))} ago` : "-",
          p.sideChannel,
        ]),
      ),
    );
  lines.push("");
  const states = Object.entries(s.transfersByState).filter(([, n]) => n > 0);
  if (states.length === 0) lines.push("transfers: none");
  else
    lines.push(
      ...table(
        ["STATE", "TRANSFERS"],
        states.map(([k, n]) => [k, String(n)]),
      ),
    );
  if (s.lastErrors.length > 0) {
    lines.push("", "recent errors (newest last):");
    for (const e of s.lastErrors) lines.push(`  ${e}`);
  }
  return lines;
}

export async function runStatus(argv: string[], io: CliIo = {}): Promise<number> {
  const { out, err } = output(io);
  const cmd = openClientCommand("status", argv, err, {
    options: {
      json: { type: "boolean", default: false },
      timeout: { type: "string" },
      trace: { type: "string" },
    },
    positionals: 1,
    check: (values) => {
      if (values.timeout === undefined) return undefined;
      const timeoutMs = Number(values.timeout);
      if (!Number.isFinite(timeoutMs) || timeoutMs <= 0)
        throw new UsageError(`--timeout must be a number > 0, got '${values.timeout}'`);
      return timeoutMs;
    },
    clientTimeoutMs: (timeoutMs) => timeoutMs,
  });
  if (cmd === undefined) return 2;
  const { client, values } = cmd;
  if (values.trace !== undefined)
    return showTrace(client, String(values.trace), values.json === true, out, err, (e) =>
      cmd.explain(e),
    );
  try {
    const [status, health] = await Promise.all([
      client.getStatus(),
      client.health().catch(() => "UNKNOWN"),
    ]);
    if (values.json) out(toJson({ ...status, health }));
    else for (const l of formatStatus(status, health)) out(l);
    return 0;
  } catch (e) {
    err(`kvxfer status: ${cmd.explain(e)}`);
    return 1;
  } finally {
    client.close();
  }
}

/** One transfer's trace on this sidecar: each hop, µs after its first, and the step before it. */
export function formatTrace(t: TransferInfo): string[] {
  const lines = [`${t.side} ${t.transferId}: ${t.state}${t.mode !== "" ? ` (${t.mode})` : ""}`];
  if (t.trace.length === 0) return [...lines, "  no hops recorded"];
  const first = t.trace[0]!.us;
  const rows = t.trace.map((h, i) => {
    const step = i === 0 ? 0 : h.us - t.trace[i - 1]!.us;
    return [h.hop, String(h.us - first), String(step)];
  });
  const width = Math.max(3, ...rows.map((r) => r[0]!.length));
  lines.push(`  ${"hop".padEnd(width)}  ${"µs".padStart(9)}  ${"step µs".padStart(9)}`);
  for (const [hop, at, step] of rows)
    lines.push(`  ${hop!.padEnd(width)}  ${at!.padStart(9)}  ${step!.padStart(9)}`);
  return lines;
}

async function showTrace(
  client: SidecarClient,
  transferId: string,
  json: boolean,
  out: (l: string) => void,
  err: (l: string) => void,
  explain: (e: unknown) => string,
): Promise<number> {
  try {
    const { transfers } = await client.listTransfers({ limit: 10_000 });
    const mine = transfers.filter((t) => t.transferId === transferId);
    if (mine.length === 0) {
      err(
        `kvxfer status: no transfer '${transferId}' on this sidecar (ended transfers are kept only while their tombstones last)`,
      );
      return 1;
    }
    if (json) out(toJson(mine.map((t) => ({ side: t.side, state: t.state, trace: t.trace }))));
    else for (const t of mine) for (const l of formatTrace(t)) out(l);
    return 0;
  } catch (e) {
    err(`kvxfer status: ${explain(e)}`);
    return 1;
  } finally {
    client.close();
  }
}
