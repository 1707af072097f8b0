/**
 * Where the sidecar listens, as an operator reads it: a failed listen as one line naming the
 * flag and what to do (`ListenError`), the side channel's advertised address for --bootstrap,
 * and the warning for an endpoint open beyond loopback without TLS.
 */
import type { Logger } from "pino";

import { splitHostPort } from "../api/http.js";
import { KvxferError } from "../errors.js";
import { isLoopback } from "../peer/side-channel.js";
import type { Sidecar } from "../sidecar/sidecar.js";

/** Why a listen failed, as an operator acts on it (by the errno in the error or its message). */
const LISTEN_CAUSES: [RegExp, string][] = [
  [
    /EADDRINUSE/,
    "the port is taken by another process (EADDRINUSE); choose another or stop that process",
  ],
  [
    /EACCES/,
    "not allowed to listen there (EACCES; ports below 1024 need privileges); choose a port above 1023",
  ],
  [
    /EADDRNOTAVAIL/,
    "the host is not an address of this machine (EADDRNOTAVAIL); use one of its addresses, 127.0.0.1 or 0.0.0.0",
  ],
];

/**
 * A listen of `--flag` that failed: one line naming the flag, the address and what to do.
 * Its `cause` is the raw error (logged at debug level).
 */
export class ListenError extends KvxferError {
  constructor(
    readonly flag: string,
    readonly address: string,
    cause: unknown,
  ) {
    const raw = cause instanceof Error ? cause.message : String(cause);
    const code = (cause as { code?: unknown } | undefined)?.code;
    const text = `${typeof code === "string" ? code : ""} ${raw}`;
    const why = LISTEN_CAUSES.find(([re]) => re.test(text))?.[1] ?? `cannot listen: ${raw}`;
    super("ERR_LISTEN", `--${flag} ${address}: ${why}`, { cause });
  }
}

/** Runs `start`; a failure to listen becomes a ListenError naming `--flag` and `address`. */
export async function listening<T>(
  flag: string,
  address: string,
  start: () => Promise<T>,
): Promise<T> {
  try {
    return await start();
  } catch (err) {
    const code = (err as { code?: unknown } | undefined)?.code;
    const msg = err instanceof Error ? err.message : "";
    // Node's listen errors carry `code`; grpc-js folds them into "No address added ... errors: [...]".
    if (
      (typeof code === "string" && /^E(ADDRINUSE|ACCES|ADDRNOTAVAIL)$/.test(code)) ||
      msg.startsWith("No address added")
    )
      throw new ListenError(flag, address, err);
    throw err;
  }
}

/**
 * The side channel as a router or peer must dial it: `--advertise`, else the bound address, which
 * must then name a host (a wildcard bind would send D to 0.0.0.0).
 */
export function advertisedSideChannel(advertise: string, bound: string): string {
  if (advertise !== "") {
    const at = splitHostPort(advertise);
    if (at === undefined || at.port < 1 || isWildcard(at.host))
      throw new KvxferError(
        "ERR_CONFIG",
        `--advertise must be the host:port peers dial, got '${advertise}'`,
      );
    return advertise;
  }
  if (isWildcard(splitHostPort(bound)?.host ?? ""))
    throw new KvxferError(
      "ERR_CONFIG",
      `--bootstrap would tell routers and D to dial ${bound} (the side channel listens on every address): give --advertise HOST:PORT`,
    );
  return bound;
}

function isWildcard(host: string): boolean {
  return host === "" || host === "0.0.0.0" || host === "::";
}

/**
 * An endpoint listening beyond loopback without TLS: anyone who reaches it reads transfer ids,
 * peers and events (gRPC) or metrics. Warned at start-up (a log line and GetStatus lastErrors);
 * the gRPC API takes --tls-cert, the HTTP endpoints no TLS (keep them on a private network).
 */
export function warnOpenEndpoints(
  logger: Logger,
  sidecar: Sidecar,
  endpoints: readonly (readonly [flag: string, address: string, tls: boolean])[],
): void {
  for (const [flag, address, tls] of endpoints) {
    if (address === "" || tls) continue;
    const host = address.slice(0, address.lastIndexOf(":")).replace(/^\[|\]$/g, "");
    if (isLoopback(host)) continue;
    const text =
      `${flag} ${address} listens beyond loopback without TLS: anyone who reaches it can read ` +
      (flag === "--grpc"
        ? "transfer ids, peers and events (give --tls-cert, --tls-key and --tls-ca)"
        : "it (keep the port on a private network)");
    logger.warn({ flag, address }, text);
    sidecar.noteError(`WARNING: ${text}`);
  }
}
