/**
 * What both ends of the engine link share: the frame cap, the ZeroMQ socket settings, the
 * message types and the small helpers each end's socket code uses.
 */

import type { EngineToSidecar, SidecarToEngine } from "../gen/kvxfer/v1/engine_pb.js";
import { KvxferError } from "../errors.js";

/** Default cap on one received frame. A registration of 8 ranks x 160 files is ~100 KiB. */
export const DEFAULT_MAX_FRAME_BYTES = 16 << 20;

/**
 * ZeroMQ drops the connection of a peer sending a frame above this multiple of the cap, so a
 * runaway engine cannot make the sidecar buffer gigabytes; frames between the cap and this are
 * still received and answered with ERR_TOO_LARGE.
 */
export const HARD_CAP_FACTOR = 4;

/** Outgoing messages queued per peer before a send fails (instead of blocking the sidecar). */
export const SEND_HIGH_WATER_MARK = 100_000;

/** How long a closing socket keeps trying to deliver what was already queued. */
export const LINGER_MS = 200;

/** The default engine link endpoint of an engine. */
export function defaultEngineEndpoint(engineId: string): string {
  return `ipc:///tmp/kvxfer-${engineId}.sock`;
}

/** One connected engine, as the ROUTER sees it. */
export interface EnginePeer {
  /** The ZeroMQ routing id, hex: stable for the life of one connection. */
  readonly id: string;
  readonly routingId: Buffer;
}

export type EngineMessageHandler = (msg: EngineToSidecar, from: EnginePeer) => void;
export type SidecarMessageHandler = (msg: SidecarToEngine) => void;

export function checkCap(n: number): number {
  if (!Number.isSafeInteger(n) || n < 64) {
    throw new KvxferError(
      "ERR_INVALID_ARGUMENT",
      `maxFrameBytes must be an integer >= 64, got ${n}`,
    );
  }
  return n;
}

export function errCode(err: unknown): string {
  const c = (err as { code?: unknown } | null)?.code;
  return typeof c === "string" ? c : "";
}

/** Resolves after `ms`, or when `p` settles, whichever is first; never rejects. */
export async function within(p: Promise<unknown>, ms: number): Promise<void> {
  let timer: NodeJS.Timeout | undefined;
  await Promise.race([
    p.catch(() => undefined),
    new Promise<void>((resolve) => {
      timer = setTimeout(resolve, ms);
    }),
  ]);
  clearTimeout(timer);
}
