/**
 * The narrow context each side of a transfer is built with: a clock, the engine, the peers, the
 * registered KV and where events, metrics and errors go. The sidecar provides the real one; a
 * test provides fakes (a manual clock, recording senders, fake agents) and drives a side in
 * milliseconds, without processes.
 */
import type { MessageInitShape } from "@bufbuild/protobuf";
import type { Logger } from "pino";

import type { SidecarToEngineSchema } from "../gen/kvxfer/v1/engine_pb.js";
import { KvxferError } from "../errors.js";
import type { PeerBody } from "../peer/messages.js";
import { PlanError } from "../plan/index.js";
import type { Clock } from "./clock.js";
import type { TransferMetrics } from "./metrics.js";
import type { KvSource, PeerState } from "../peer/peer-state.js";
import type { EventKind, TransferSide } from "./view.js";

/** A message to the engine (the body of SidecarToEngine). */
export type EngineMessage = NonNullable<MessageInitShape<typeof SidecarToEngineSchema>["msg"]>;

/** The lifecycle settings both sides read (sidecar options, resolved). */
export interface LifecycleSettings {
  /** P holds finished blocks this long without a heartbeat from D. */
  readonly leaseMs: number;
  /** A push registration on P lives this long without renewal. */
  readonly regLeaseMs: number;
  /** D gives up on a transfer after this long. */
  readonly transferTimeoutMs: number;
  /** Extra wait on D, after P's registration lease, before an unacknowledged abort's blocks go. */
  readonly abortGraceMs: number;
  /**
   * Most time a side waits for an abandoned endpoint to settle (UCX holds none of its reads or
   * writes) before the blocks they touched go back anyway (default DEFAULT_SETTLE_BOUND_MS).
   */
  readonly settleBoundMs?: number;
  /** Terminal transfers are remembered this long. */
  readonly tombstoneMs: number;
  /** Live transfers per side at most. */
  readonly maxTransfers: number;
  /**
   * P: registrations one decode engine may keep by PushReg before PrefillDone (default
   * maxTransfers / 8).
   */
  readonly maxPerPeer?: number;
  /**
   * P: registrations kept before PrefillDone, every decode engine together (default
   * maxTransfers / 8). Apart from the table: a real PrefillDone never finds its room taken by
   * entries no engine asked for. When full, a newcomer takes the place of the oldest
   * registration of the engine holding the most (that engine is told).
   */
  readonly maxUnconfirmed?: number;
  /** P: the lease of a registration before P's engine names its id (default 5 000 ms). */
  readonly unconfirmedLeaseMs?: number;
  /** Heartbeat period between peers (default 1 000 ms): a peer unheard of for two is silent. */
  readonly heartbeatMs?: number;
  /** P refuses a PrefillDone listing a block a live transfer holds. */
  readonly exclusivePrefillBlocks: boolean;
}

/**
 * Linux retransmits unacknowledged TCP data for about 924.6 s (tcp_retries2 = 15) before it
 * fails the connection: past that, no byte of an abandoned operation can still land.
 */
export const DEFAULT_SETTLE_BOUND_MS = 960_000;

/** The engine, as a side reaches it (engine-port.ts). */
export interface EnginePort {
  /** To the registered engine. */
  send(msg: EngineMessage): void;
  /** Refuses the engine message being handled (`Refused`, to its sender). */
  refuse(transferId: string, code: string, message: string): void;
}

/** The peers, as a side reaches them (PeerTable in peers.ts). */
export interface PeerPort {
  /** A control notification to `peer` (rank 0 to rank 0), numbered and sealed. */
  send(peer: PeerState, body: PeerBody): void;
  /** The sealed bytes of one notification to `peer` (for a notification on a given endpoint). */
  seal(peer: PeerState, body: PeerBody): Uint8Array;
}

/** Where a side's terminal transfer events go (event-port.ts). */
export interface EventPort {
  emit(
    kind: EventKind,
    transferId: string,
    peer: string,
    side: TransferSide,
    reason: string,
    bytes: number,
    mode: string,
  ): void;
}

/** Where error lines for GetStatus go (LastErrors, engine-port.ts). */
export interface ErrorPort {
  note(text: string): void;
}

/** What a side tallies (Tally, metrics.ts). */
export interface TallyPort {
  /** Where transfer metrics go (none before the sidecar starts, or in a test). */
  readonly metrics: TransferMetrics | undefined;
  /** A transfer's KV arrived (counted in the status' bytes and transfers moved). */
  moved(bytes: number): void;
}

/** The ports a side is built with, each an object the sidecar (or a test) owns. */
export interface SideContext {
  readonly clock: Clock;
  readonly settings: LifecycleSettings;
  readonly log: Logger;
  /** The registered KV (its `kv` is undefined before the engine registers). */
  readonly kvs: KvSource;
  /** The engine. */
  readonly engine: EnginePort;
  /** The peers. */
  readonly peers: PeerPort;
  /** Terminal transfer events. */
  readonly events: EventPort;
  /** Error lines for GetStatus. */
  readonly errors: ErrorPort;
  /** Bytes moved and the transfer metrics. */
  readonly tally: TallyPort;
}

/** A failure to plan or move a transfer, as the KvxferError it is reported with. */
export function transferError(err: unknown): KvxferError {
  return err instanceof PlanError ? new KvxferError(err.code, err.message) : KvxferError.from(err);
}
