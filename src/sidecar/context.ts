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
import type { PeerState, RegisteredKv } from "../peer/peer-state.js";
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
  /** Terminal transfers are remembered this long. */
  readonly tombstoneMs: number;
  /** Live transfers per side at most. */
  readonly maxTransfers: number;
  /**
   * P: transfers one decode engine may create by PushReg before PrefillDone (default
   * maxTransfers / 8): a flooding peer fills its own share, never the table.
   */
  readonly maxPerPeer?: number;
  /** P refuses a PrefillDone listing a block a live transfer holds. */
  readonly exclusivePrefillBlocks: boolean;
}

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

export interface SideContext {
  readonly clock: Clock;
  readonly settings: LifecycleSettings;
  readonly log: Logger;
  /** The registered KV (undefined before the engine registers). */
  kv(): RegisteredKv | undefined;
  /** The engine. */
  readonly engine: EnginePort;
  /** The peers. */
  readonly peers: PeerPort;
  /** One terminal transfer event. */
  emit(
    kind: EventKind,
    transferId: string,
    peer: string,
    side: TransferSide,
    reason: string,
    bytes: number,
    mode: string,
  ): void;
  /** A transfer's KV arrived (counted in the status' bytes and transfers moved). */
  moved(bytes: number): void;
  /** Keeps an error line for GetStatus. */
  noteError(text: string): void;
  /** Where transfer metrics go (none before the sidecar starts, or in a test). */
  metrics(): TransferMetrics | undefined;
}

/** A failure to plan or move a transfer, as the KvxferError it is reported with. */
export function transferError(err: unknown): KvxferError {
  return err instanceof PlanError ? new KvxferError(err.code, err.message) : KvxferError.from(err);
}
