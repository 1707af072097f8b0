/**
 * kvxfer status <addr> [--json] [TLS flags]: what a sidecar is doing, as a table.
 */
import { parseArgs } from "node:util";
import {
  type CliIo,
  TLS_OPTIONS,
  UsageError,
  clientFrom,
  describeError,
  explainClientError,
  formatBytes,
  formatDuration,
  output,
  table,
  toJson,
} from "./grpc-client.js";
import type { SidecarStatusReply } from "../api/client.js";

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
  let values;
  let positionals;
  let client;
  try {
    ({ values, positionals } = parseArgs({
      args: argv,
      allowPositionals: true,
      options: {
        json: { type: "boolean", default: false },
        timeout: { type: "string" },
        ...TLS_OPTIONS,
      },
    }));
    if (positionals.length > 1)
      throw new UsageError(`unexpected arguments: ${positionals.slice(1).join(" ")}`);
    let timeoutMs: number | undefined;
    if (values.timeout !== undefined) {
      timeoutMs = Number(values.timeout);
      if (!Number.isFinite(timeoutMs) || timeoutMs <= 0)
        throw new UsageError(`--timeout must be a number > 0, got '${values.timeout}'`);
    }
    client = clientFrom(positionals[0], values, timeoutMs);
  } catch (e) {
    err(`kvxfer status: ${describeError(e)} (kvxfer status --help for usage)`);
    return 2;
  }
  const address = positionals[0]!;
  try {
    const [status, health] = await Promise.all([
      client.getStatus(),
      client.health().catch(() => "UNKNOWN"),
    ]);
    if (values.json) out(toJson({ ...status, health }));
    else for (const l of formatStatus(status, health)) out(l);
    return 0;
  } catch (e) {
    const tls = values.ca !== undefined || values.cert !== undefined;
    err(`kvxfer status: ${explainClientError(e, address, tls, values.verbose)}`);
    return 1;
  } finally {
    client.close();
  }
}
