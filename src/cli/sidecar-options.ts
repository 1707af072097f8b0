/**
 * The sidecar's settings checked and converted: each refusal is an ERR_CONFIG naming its flag.
 * `sidecarOptions` turns the resolved settings into the Sidecar's options.
 */
import { statSync } from "node:fs";
import { totalmem } from "node:os";
import { resolve } from "node:path";
import type { Logger } from "pino";

import { KvxferError } from "../errors.js";
import type { SidecarOptions } from "../sidecar/sidecar.js";
import type { SidecarRole, TransferMode } from "../sidecar/view.js";
import { peerCredentials } from "./pki.js";
import type { SettingName } from "./sidecar-settings.js";

function oneOf<T extends string>(name: string, value: string, allowed: readonly T[]): T {
  if (!(allowed as readonly string[]).includes(value)) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--${name} must be one of ${allowed.join(", ")}, got '${value}'`,
    );
  }
  return value as T;
}

function spinUs(value: string): number | "auto" {
  if (value === "auto") return "auto";
  const n = Number(value);
  if (value.trim() === "" || !Number.isSafeInteger(n) || n < 0)
    throw new KvxferError(
      "ERR_CONFIG",
      `--spin-us must be auto or a non-negative integer (µs), got '${value}'`,
    );
  return n;
}

export function nonNegativeInt(name: string, value: string): number {
  const n = Number(value);
  if (!Number.isSafeInteger(n) || n < 0) {
    throw new KvxferError("ERR_CONFIG", `--${name} must be a non-negative integer, got '${value}'`);
  }
  return n;
}

export function positiveInt(name: string, value: string): number {
  const n = Number(value);
  if (!Number.isSafeInteger(n) || n <= 0)
    throw new KvxferError("ERR_CONFIG", `--${name} must be a positive integer, got '${value}'`);
  return n;
}

const SIZE_UNITS: Record<string, number> = {
  "": 1,
  k: 2 ** 10,
  m: 2 ** 20,
  g: 2 ** 30,
  t: 2 ** 40,
};

/** A byte count: digits with an optional binary suffix (K, M, G, T; "Gi", "GiB", "GB" alike); empty: `empty`. */
export function byteSize(name: string, value: string, empty: number): number {
  if (value.trim() === "") return empty;
  const m = /^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$/i.exec(value);
  const n = m === null ? NaN : Number(m[1]) * SIZE_UNITS[m[2]!.toLowerCase()]!;
  if (!Number.isSafeInteger(n) || n <= 0) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--${name} must be a positive byte count (e.g. 68719476736 or 64G), got '${value}'`,
    );
  }
  return n;
}

/** The KV directory, absolute; it must exist and be a directory. */
export function kvDirectory(value: string): string {
  if (value === "") throw new KvxferError("ERR_CONFIG", "--kv-dir must not be empty");
  const dir = resolve(value);
  let st;
  try {
    st = statSync(dir);
  } catch (err) {
    throw new KvxferError("ERR_CONFIG", `--kv-dir '${dir}': ${(err as Error).message}`);
  }
  if (!st.isDirectory())
    throw new KvxferError("ERR_CONFIG", `--kv-dir '${dir}' is not a directory`);
  return dir;
}

export function sidecarOptions(s: Record<SettingName, string>, logger: Logger): SidecarOptions {
  if (s["engine-id"] === "") throw new KvxferError("ERR_CONFIG", "--engine-id is required");
  return {
    engineId: s["engine-id"],
    role: oneOf<SidecarRole>("role", s.role, ["prefill", "decode", "both"]),
    mode: oneOf<TransferMode>("mode", s.mode, ["push", "pull", "auto"]),
    listen: s.listen,
    transports: s.transports,
    netDevices: s["net-devices"] === "" ? [] : s["net-devices"].split(","),
    errorMode: oneOf("error-mode", s["error-mode"], ["none", "peer"] as const),
    busyPoll: oneOf("busy-poll", s["busy-poll"], ["true", "false"] as const) === "true",
    spinUs: spinUs(s["spin-us"]),
    leaseMs: positiveInt("lease-ms", s["lease-ms"]),
    regLeaseMs: positiveInt("reg-lease-ms", s["reg-lease-ms"]),
    transferTimeoutMs: positiveInt("transfer-timeout-ms", s["transfer-timeout-ms"]),
    heartbeatMs: positiveInt("heartbeat-ms", s["heartbeat-ms"]),
    peerTimeoutMs: positiveInt("peer-timeout-ms", s["peer-timeout-ms"]),
    peerKeepaliveMs: nonNegativeInt("peer-keepalive-ms", s["peer-keepalive-ms"]),
    abortGraceMs: positiveInt("abort-grace-ms", s["abort-grace-ms"]),
    settleBoundMs: positiveInt("settle-bound-ms", s["settle-bound-ms"]),
    maxTransfers: positiveInt("max-transfers", s["max-transfers"]),
    ...(s["max-per-peer"] === ""
      ? {}
      : { maxPerPeer: positiveInt("max-per-peer", s["max-per-peer"]) }),
    ...(s["max-unconfirmed"] === ""
      ? {}
      : { maxUnconfirmed: positiveInt("max-unconfirmed", s["max-unconfirmed"]) }),
    unconfirmedLeaseMs: positiveInt("unconfirmed-lease-ms", s["unconfirmed-lease-ms"]),
    peerMessagesPerSec: positiveInt("peer-messages-per-sec", s["peer-messages-per-sec"]),
    tombstoneMs: positiveInt("tombstone-ms", s["tombstone-ms"]),
    kvDir: kvDirectory(s["kv-dir"]),
    maxRegistrationBytes: byteSize(
      "max-registration-bytes",
      s["max-registration-bytes"],
      totalmem(),
    ),
    maxKvBytes: byteSize("max-kv-bytes", s["max-kv-bytes"], totalmem()),
    prefault: oneOf("prefault", s.prefault, ["true", "false"] as const) === "true",
    exclusivePrefillBlocks:
      oneOf("exclusive-prefill-blocks", s["exclusive-prefill-blocks"], [
        "true",
        "false",
      ] as const) === "true",
    ...peerCredentials(s),
    insecurePeers:
      oneOf("insecure-peers", s["insecure-peers"], ["true", "false"] as const) === "true",
    logger,
  };
}
