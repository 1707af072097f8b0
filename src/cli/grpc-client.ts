/**
 * What `kvxfer status|watch|await` share: TLS flags, the client, output.
 */
import { readFileSync } from "node:fs";
import { type ClientTlsOptions, SidecarClient } from "../api/client.js";
import type { SidecarEvent } from "../sidecar/view.js";

/** Where a command writes and what stops it (tests pass their own). */
export interface CliIo {
  readonly out?: (line: string) => void;
  readonly err?: (line: string) => void;
  /** Stops a long-running command (watch); default: SIGINT/SIGTERM. */
  readonly signal?: AbortSignal;
}

export const TLS_OPTIONS = {
  ca: { type: "string" },
  cert: { type: "string" },
  key: { type: "string" },
  "server-name": { type: "string" },
} as const;

export const TLS_USAGE = `TLS: --ca FILE (trust this CA; turns TLS on) [--cert FILE --key FILE] (client certificate, for mTLS) [--server-name NAME]`;

/** Thrown for bad command lines; the commands print it with the usage and exit 2. */
export class UsageError extends Error {}

export function clientFrom(
  address: string | undefined,
  values: { ca?: string; cert?: string; key?: string; "server-name"?: string },
  timeoutMs?: number,
): SidecarClient {
  if (address === undefined || address === "")
    throw new UsageError("missing the sidecar's gRPC address (host:port)");
  if ((values.cert === undefined) !== (values.key === undefined))
    throw new UsageError("--cert and --key go together");
  let tls: ClientTlsOptions | undefined;
  if (values.ca !== undefined || values.cert !== undefined) {
    tls = {
      ...(values.ca !== undefined ? { ca: readFileSync(values.ca) } : {}),
      ...(values.cert !== undefined ? { cert: readFileSync(values.cert) } : {}),
      ...(values.key !== undefined ? { key: readFileSync(values.key) } : {}),
      ...(values["server-name"] !== undefined ? { serverName: values["server-name"] } : {}),
    };
  }
  return new SidecarClient(address, {
    ...(tls !== undefined ? { tls } : {}),
    ...(timeoutMs !== undefined ? { timeoutMs } : {}),
  });
}

export function output(io: CliIo): { out: (l: string) => void; err: (l: string) => void } {
  return {
    out: io.out ?? ((l) => process.stdout.write(l + "\n")),
    err: io.err ?? ((l) => process.stderr.write(l + "\n")),
  };
}

/** JSON with bigints as decimal strings. */
export function toJson(v: unknown): string {
  return JSON.stringify(v, (_k, x: unknown) => (typeof x === "bigint" ? x.toString() : x));
}

export function formatBytes(n: number): string {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return i === 0 ? `${n} B` : `${v.toFixed(v >= 100 ? 0 : 1)} ${units[i]}`;
}

export function formatDuration(ms: number): string {
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = Math.floor(ms / 1000);
  if (s < 60) return `${(ms / 1000).toFixed(1)} s`;
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  return h > 0 ? `${h}h${String(m).padStart(2, "0")}m` : `${m}m${String(s % 60).padStart(2, "0")}s`;
}

/** Rows as aligned columns (first column left-aligned, like the other kvxfer tables). */
export function table(head: readonly string[], rows: readonly (readonly string[])[]): string[] {
  const widths = head.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? "").length)));
  const line = (cells: readonly string[]) =>
    cells
      .map((c, i) => (i === cells.length - 1 ? c : c.padEnd(widths[i]!)))
      .join("  ")
      .trimEnd();
  return [line(head), ...rows.map(line)];
}

/** One event on one line: seq, time, kind, transfer, side, peer, mode, bytes, reason. */
export function formatEvent(ev: SidecarEvent): string {
  const parts = [String(ev.seq).padStart(7), new Date(ev.timeMs).toISOString(), ev.kind.padEnd(9)];
  if (ev.transferId !== "") parts.push(ev.transferId);
  if (ev.side !== "") parts.push(ev.side);
  parts.push(`peer=${ev.peer}`);
  if (ev.mode !== "") parts.push(ev.mode);
  if (ev.bytes > 0) parts.push(formatBytes(ev.bytes));
  if (ev.reason !== "") parts.push(`reason=${ev.reason}`);
  return parts.join("  ");
}

export function describeError(err: unknown): string {
  if (err instanceof Error) {
    const e = err as Error & { code?: unknown; details?: unknown };
    if (typeof e.code === "number" && typeof e.details === "string") return e.details || e.message;
    return e.message;
  }
  return String(err);
}

/** An AbortSignal fired by SIGINT/SIGTERM, unless the caller gave one. */
export function stopSignal(io: CliIo): { signal: AbortSignal; dispose(): void } {
  if (io.signal !== undefined) return { signal: io.signal, dispose: () => {} };
  const ac = new AbortController();
  const stop = () => ac.abort();
  process.once("SIGINT", stop);
  process.once("SIGTERM", stop);
  return {
    signal: ac.signal,
    dispose: () => {
      process.off("SIGINT", stop);
      process.off("SIGTERM", stop);
    },
  };
}
