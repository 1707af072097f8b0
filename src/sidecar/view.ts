/**
 * What a sidecar shows the outside (gRPC, metrics, CLI): its identity, its
 * peers, its transfers and its event log. The sidecar implements
 * `SidecarView`; `src/api/` only reads through it.
 */

import type { PeerInfo } from "../peer/peer-state.js";
import type { TraceHop } from "./trace.js";

export type { PeerInfo };

export type SidecarRole = "prefill" | "decode" | "both";
export type TransferMode = "push" | "pull" | "auto";
/** Which side of a transfer this sidecar is on. */
export type TransferSide = "prefill" | "decode";

/** Terminal states; each transfer reaches exactly one per side, as one event. */
export type TerminalKind = "KV_READY" | "FAILED" | "EXPIRED" | "ABORTED" | "RELEASED";
export type EventKind = TerminalKind | "PEER_UP" | "PEER_DOWN";

export interface SidecarEvent {
  /** Assigned by the event log: 1, 2, 3, ... without gaps. */
  readonly seq: number;
  readonly kind: EventKind;
  /** Wall-clock milliseconds since the epoch. */
  readonly timeMs: number;
  /** Empty for peer events. */
  readonly transferId: string;
  /** The peer engine id (transfer events: the other side). */
  readonly peer: string;
  /** Empty for peer events. */
  readonly side: TransferSide | "";
  /** Why (failure code, release reason); empty when there is nothing to say. */
  readonly reason: string;
  readonly bytes: number;
  /** The mode the transfer used ("push" or "pull"); empty for peer events. */
  readonly mode: string;
}

/** Non-terminal and terminal states of a transfer, as listed (each side's machine: lifecycle.ts). */
export type TransferState =
  | "WAITING" // known, waiting for the other half (registration, prefill, block ids)
  | "HELD" // P: prefill done, blocks held under lease
  | "MOVING" // data in flight
  | "ABORTING" // P: aborted while writes were in flight; ends once they settle
  | "CONFIRMING" // D: reads done, waiting for P's confirmation (pull)
  | "DRAINING" // D: failed (engine told); blocks held until no write can land
  | TerminalKind;

export interface TransferTimings {
  /** Wall-clock ms; 0 when that step has not happened. */
  readonly registeredMs: number;
  readonly prefillDoneMs: number;
  readonly dataStartedMs: number;
  readonly dataDoneMs: number;
  readonly readyMs: number;
  readonly endedMs: number;
}

export interface TransferInfo {
  readonly transferId: string;
  readonly side: TransferSide;
  readonly mode: TransferMode | "";
  readonly state: TransferState;
  readonly peer: string;
  readonly bytes: number;
  readonly descriptors: number;
  readonly reason: string;
  readonly timings: TransferTimings;
  /** The critical path's hops on this side, in order (monoUs; see trace.ts). */
  readonly trace: readonly TraceHop[];
}

export interface SidecarStatus {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly role: SidecarRole;
  readonly mode: TransferMode;
  readonly tpSize: number;
  /** e.g. "32 layers, 8 KV heads x 128, bfloat16, block 16, HND" */
  readonly layoutSummary: string;
  readonly startedMs: number;
  readonly draining: boolean;
  readonly peers: readonly PeerInfo[];
  readonly transfersByState: Readonly<Record<string, number>>;
  readonly bytesMoved: number;
  readonly transfersMoved: number;
  readonly leaseTableSize: number;
  /** The most recent errors, newest last (bounded). */
  readonly lastErrors: readonly string[];
  /** The UCX the agents run on: version, transport resources ("cma/memory"), memory types. */
  readonly ucx: UcxStatus;
}

export interface UcxStatus {
  readonly version: string;
  readonly transports: readonly string[];
  readonly memoryTypes: readonly string[];
}

export interface TransferFilter {
  readonly states?: readonly TransferState[];
  readonly peer?: string;
}

export interface SidecarView {
  status(): SidecarStatus;
  /** Live and recently ended transfers (ended ones while their tombstones last). */
  transfers(filter?: TransferFilter): TransferInfo[];
  /** Adds a hop to a transfer's trace (e.g. its event written to a watcher); unknown ids: nothing. */
  traced?(transferId: string, side: TransferSide | "", hop: string): void;
}
