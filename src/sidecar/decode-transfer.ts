/**
 * D's entries: one transfer as D's side holds it, what comes with an event for the effects that
 * need it, and how a failure ends.
 */
import { FailureReason, ReleaseReason } from "../gen/kvxfer/v1/engine_pb.js";
import type { XferDone } from "../gen/kvxfer/v1/peer_pb.js";
import type { Notification } from "../native/index.js";
import type { KvxferError } from "../errors.js";
import type { PeerState } from "../peer/peer-state.js";
import type { BlockList, GroupsPairing, TransferPlan } from "../plan/index.js";
import { DECODE_PHASE, type DecodeState } from "./decode-machine.js";
import type { Timings } from "./timings.js";
import type { TransferTrace } from "./trace.js";
import type { TerminalKind, TransferInfo } from "./view.js";

/** Why a transfer fails, as the engine and the event log hear it. */
export interface Failure {
  reason: FailureReason;
  code: string;
  message: string;
  release: ReleaseReason;
}

/** How a failing transfer ends once it is safe (decided when the failure began). */
export interface Outcome {
  kind: DecodeState & TerminalKind;
  reason: FailureReason;
  code: string;
  release: ReleaseReason;
}

/** Timestamps of the notification that carried a peer message (trace). */
export type Arrival = Pick<Notification, "receivedUs" | "deliveredUs">;

/** What comes with an event, for the effects that need it. */
export interface EventData {
  failure?: Failure;
  /** PEER_FOUND_*: the peer the handshake found; its rank pairs with us. */
  peer?: PeerState;
  pairing?: GroupsPairing;
  /** PLANNED: the reads to post. */
  plan?: TransferPlan;
  /** READS_FAILED: the first read's error. */
  error?: KvxferError;
  /** XFER_DONE: the message and the agent pair it came over. */
  xfer?: { m: XferDone; fromRank: number; toRank: number };
  arrival?: Arrival | undefined;
  /** HEARTBEAT: when it is sent. */
  now?: number;
}

/** D's side of one transfer. */
export interface DecodeTransfer {
  readonly id: string;
  readonly state: DecodeState;
  source: string;
  peer: PeerState | undefined;
  /** Every block of D's lists (all groups): what D's engine holds for the transfer. */
  dstBlocks: number[];
  /** D's block lists, one per group. */
  dstLists: BlockList[];
  /** The blocks this transfer writes, claimed until its end (see `claims`). */
  written: number[];
  /** P's block lists (pull), one per group. */
  srcLists: BlockList[] | undefined;
  numTokens: number;
  prefixTokens: number;
  /** ExpectKv.token, presented to P. */
  token: string;
  mode: "push" | "pull";
  expectedPairs: Set<string>;
  donePairs: Set<string>;
  /** Watchdog, or (PUSH_DRAINING) when the blocks may be released. */
  deadline: number;
  /** Last time D renewed P's registration (push), for the abort drain bound. */
  lastRenewMs: number;
  /** Set with KvFailed: how the transfer ends once a drain is over. */
  outcome: Outcome | undefined;
  /** Push: P's time from PrefillDone to posting its last pair's writes (from the XferDones). */
  sincePrefillDoneMs: number;
  /** Pull: when P first answered that it does not know the transfer (0: it has not). */
  unknownSinceMs: number;
  bytes: number;
  descriptors: number;
  reason: string;
  t: Timings;
  trace: TransferTrace;
}

/** Pull: how long D keeps asking P about a transfer P says it does not know. */
export const UNKNOWN_GIVE_UP_MS = 5000;

/** A failure that gives the blocks back as FAILED. */
export function failed(reason: FailureReason, code: string, message: string): Failure {
  return { reason, code, message, release: ReleaseReason.FAILED };
}

/** How the status view shows one of D's transfers. */
export function decodeInfo(t: DecodeTransfer): TransferInfo {
  return {
    transferId: t.id,
    side: "decode",
    mode: t.mode,
    state: DECODE_PHASE[t.state],
    peer: t.peer?.engineId ?? "",
    bytes: t.bytes,
    descriptors: t.descriptors,
    reason: t.reason,
    timings: { ...t.t },
    trace: t.trace.hops,
  };
}
