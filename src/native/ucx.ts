/** The UCX this process runs on: its version, and the transports and memory types it offers. */
import { addon, call } from "./addon.js";
import type { UcxInfo } from "./types.js";

/** The UCX library version the addon runs on. */
export const ucxVersion: string = addon.ucxVersion;

const ucxInfoCache = new Map<string, UcxInfo>();

/**
 * The UCX version, transports and memory types of this process; `transports` (as UCX_TLS, e.g.
 * "tcp,self") narrows them as an agent's option would. A context is opened and closed to read
 * them, once per transport list; later calls return the same object.
 */
export function ucxInfo(transports = ""): UcxInfo {
  let info = ucxInfoCache.get(transports);
  if (info === undefined) {
    info = call(() => addon.ucxInfo(transports));
    ucxInfoCache.set(transports, info);
  }
  return info;
}

/** One line for logs and tables: "UCX 1.22.0 (self, tcp, sysv, posix, cma; host)". */
export function describeUcx(info: UcxInfo = ucxInfo()): string {
  const tls = [...new Set(info.transports.map((t) => t.split("/")[0]))];
  return `UCX ${info.version} (${tls.join(", ")}; memory: ${info.memoryTypes.join(", ")})`;
}

/**
 * Whether the workaround for UCX 1.22's software GET replies is in place (native/src/ucx_fix.cc:
 * without it, P's process could die when D's end of a READ over TCP failed with a reply queued):
 * "installed (N GET replies primed)", "not installed yet" before the first agent, or why not.
 */
export function ucxGetReplyFix(): string {
  return addon.ucxGetReplyFix();
}
