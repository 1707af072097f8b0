/**
 * What `kvxfer status|watch|await` share: TLS flags, the client, output.
 */
import { readFileSync } from "node:fs";
import { parseArgs, type ParseArgsOptionsConfig } from "node:util";
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
  verbose: { type: "boolean", default: false },
} as const;

export const TLS_USAGE = `TLS: --ca FILE (trust this CA; turns TLS on) [--cert FILE --key FILE] (client certificate, for mTLS) [--server-name NAME]`;

/** Thrown for bad command lines; the commands print it with the usage and exit 2. */
export class UsageError extends Error {}

export function clientFrom(
  address: string | undefined,
  values: TlsValues,
  timeoutMs?: number,
): SidecarClient {
  if (address === undefined || address === "")
    throw new UsageError("missing the sidecar's gRPC address (host:port)");
  checkAddress(address);
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

/** The flags of a client command: its own and the TLS ones. */
type ClientValues<O extends ParseArgsOptionsConfig> = ReturnType<
  typeof parseArgs<{ args: string[]; allowPositionals: true; options: O & typeof TLS_OPTIONS }>
>["values"];

/** What a client command's preamble hands its body. */
export interface ClientCommand<O extends ParseArgsOptionsConfig, A> {
  readonly values: ClientValues<O>;
  /** The sidecar's gRPC address (the first positional). */
  readonly address: string;
  /** What the command's `check` made of its flags. */
  readonly args: A;
  readonly client: SidecarClient;
  /** True when the client speaks TLS (--ca or --cert). */
  readonly tls: boolean;
  /** A client error as one line, with grpc-js's details under --verbose. */
  explain(err: unknown): string;
}

/**
 * The preamble of `kvxfer status|watch|await`: parses `argv` (the command's
 * `options` and the TLS flags), refuses more than `positionals` positionals
 * (the address first), runs the command's `check` (which throws UsageError),
 * then makes the client. When any of that fails it prints
 * `kvxfer <name>: <why> (kvxfer <name> --help for usage)` and returns
 * undefined: the command exits 2.
 */
export function openClientCommand<O extends ParseArgsOptionsConfig, A>(
  name: string,
  argv: string[],
  err: (line: string) => void,
  spec: {
    readonly options: O;
    readonly positionals: number;
    check(values: ClientValues<O>, positionals: string[]): A;
    /** The client's own deadline for unary calls, from what `check` made. */
    clientTimeoutMs?(args: A): number | undefined;
  },
): ClientCommand<O, A> | undefined {
  try {
    const parsed = parseArgs({
      args: argv,
      allowPositionals: true,
      options: { ...spec.options, ...TLS_OPTIONS },
    });
    const values = parsed.values as ClientValues<O>;
    const positionals = parsed.positionals;
    if (positionals.length > spec.positionals)
      throw new UsageError(
        `unexpected arguments: ${positionals.slice(spec.positionals).join(" ")}`,
      );
    const args = spec.check(values, positionals);
    const flags = values as TlsValues;
    const client = clientFrom(positionals[0], flags, spec.clientTimeoutMs?.(args));
    const address = positionals[0]!;
    const tls = flags.ca !== undefined || flags.cert !== undefined;
    return {
      values,
      address,
      args,
      client,
      tls,
      explain: (e) => explainClientError(e, address, tls, flags.verbose),
    };
  } catch (e) {
    err(`kvxfer ${name}: ${describeError(e)} (kvxfer ${name} --help for usage)`);
    return undefined;
  }
}

/** The TLS flags as parsed. */
interface TlsValues {
  ca?: string;
  cert?: string;
  key?: string;
  "server-name"?: string;
  verbose?: boolean;
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

/**
 * The sidecar's gRPC address must name its port: `--grpc` defaults to
 * 127.0.0.1:0 (a free port, printed in the ready line), so there is no port
 * kvxfer could assume (grpc-js would silently try 443).
 */
export function checkAddress(address: string): void {
  if (/^(unix:|unix-abstract:|[a-z]+:\/\/)/.test(address)) return;
  const bracketed = /^\[[^\]]*\](:(\d*))?$/.exec(address);
  const port = bracketed !== null ? bracketed[2] : /^[^:]*:(\d*)$/.exec(address)?.[1];
  if (port === undefined || port === "")
    throw new UsageError(
      `'${address}' has no port: give host:port, the "grpc" address in the sidecar's ready line (kvxfer has no fixed gRPC port; --grpc defaults to a free one)`,
    );
  const n = Number(port);
  if (!Number.isInteger(n) || n < 1 || n > 65535)
    throw new UsageError(`'${address}': the port must be 1..65535`);
}

/**
 * A client error as one line that says what to do: nothing listening, TLS
 * expected or not, an untrusted certificate, no answer in time. `tls`: whether
 * this client used TLS. With `verbose`, grpc-js's own details and the stack follow.
 */
export function explainClientError(
  err: unknown,
  address: string,
  tls: boolean,
  verbose = false,
): string {
  const raw = describeError(err);
  const e = err as { code?: unknown };
  let msg: string;
  if (/ECONNREFUSED/.test(raw))
    msg = `nothing listening at ${address} (is the sidecar running? its ready line prints its gRPC address as "grpc")`;
  else if (/ENOTFOUND|EAI_AGAIN|Name resolution failed|DNS resolution failed/i.test(raw))
    msg = `cannot resolve the host of ${address}`;
  else if (/EHOSTUNREACH|ENETUNREACH/.test(raw)) msg = `${address} is unreachable (routing)`;
  else if (tls && /wrong version number|packet length too long|unknown protocol/i.test(raw))
    msg = `TLS expected by this client, but the sidecar at ${address} serves plain gRPC: drop --ca/--cert/--key`;
  else if (!tls && e.code === 14 && /Failed to connect|Connection dropped|ECONNRESET/i.test(raw))
    msg = `the sidecar at ${address} closed the connection: it likely expects TLS; pass --ca FILE (the CA that signed its --tls-cert)`;
  else if (
    tls &&
    /self[- ]signed|unable to (get|verify)|certificate (has expired|verify failed)|Hostname\/IP does not match|ERR_TLS_CERT/i.test(
      raw,
    )
  )
    msg = `TLS: the certificate of the sidecar at ${address} is not trusted (${oneLineOf(raw)}): check --ca FILE (and --server-name)`;
  else if (tls && /certificate required|alert handshake failure|bad certificate/i.test(raw))
    msg = `TLS: the sidecar at ${address} wants a client certificate it trusts (mutual TLS): pass --cert FILE --key FILE`;
  else if (e.code === 4) msg = `no answer from ${address} in time (${oneLineOf(raw)})`;
  else msg = `${address}: ${oneLineOf(raw)}`;
  if (verbose) {
    const stack = err instanceof Error && err.stack !== undefined ? `\n${err.stack}` : "";
    return `${msg}\n${raw}${stack}`;
  }
  return msg;
}

/** grpc-js details without their noise: the last error, one line. */
function oneLineOf(raw: string): string {
  const last =
    /Last error: (?:Error: )?(.*?)(?:\s*\(\d{4}-\d\d-\d\dT[^)]*\))?\.?\s*(?:Resolution note:.*)?$/s.exec(
      raw,
    );
  const text = last !== null ? last[1]! : raw;
  return text
    .replace(/^[0-9A-F]+:error:[0-9A-F]+:SSL routines:[^:]*:/, "")
    .replace(/:\.\.\/deps\/openssl.*$/s, "")
    .replace(/\s*\n\s*/g, " ")
    .trim();
}
