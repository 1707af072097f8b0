/**
 * The status view of a sidecar (GetStatus, `kvxfer status`): its identity, its peers, its
 * transfers counted by side and state, the registered layout in words and the UCX it runs on;
 * and the transfer list, filtered.
 */
import { ucxInfo } from "../native/index.js";
import type { PeerInfo, RegisteredKv } from "../peer/peer-state.js";
import type { KvLayout } from "../plan/index.js";
import type {
  SidecarRole,
  SidecarStatus,
  TransferFilter,
  TransferInfo,
  TransferMode,
  UcxStatus,
} from "./view.js";

/** What the status is made of, read when it is asked for. */
export interface StatusParts {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly role: SidecarRole;
  readonly mode: TransferMode;
  readonly startedMs: number;
  readonly draining: boolean;
  readonly kv: RegisteredKv | undefined;
  readonly peers: readonly PeerInfo[];
  /** Both sides' transfers. */
  readonly transfers: readonly TransferInfo[];
  readonly bytesMoved: number;
  readonly transfersMoved: number;
  readonly leaseTableSize: number;
  readonly lastErrors: readonly string[];
  readonly ucx: UcxStatus;
}

export function sidecarStatus(p: StatusParts): SidecarStatus {
  const byState: Record<string, number> = {};
  for (const t of p.transfers) {
    const key = `${t.side}:${t.state}`;
    byState[key] = (byState[key] ?? 0) + 1;
  }
  const l = p.kv?.layout;
  return {
    engineId: p.engineId,
    epoch: p.epoch,
    role: p.role,
    mode: p.mode,
    tpSize: l?.tpSize ?? 0,
    layoutSummary: l === undefined ? "not registered" : layoutSummary(l),
    startedMs: p.startedMs,
    draining: p.draining,
    peers: p.peers,
    transfersByState: byState,
    bytesMoved: p.bytesMoved,
    transfersMoved: p.transfersMoved,
    leaseTableSize: p.leaseTableSize,
    lastErrors: p.lastErrors,
    ucx: p.ucx,
  };
}

/** e.g. "32 layers, 8 KV heads x 128, bfloat16, block 16, HND, 4096 blocks/rank" */
function layoutSummary(l: KvLayout): string {
  return `${l.numLayers} layers, ${l.mla ? "MLA latent" : `${l.totalKvHeads} KV heads`} x ${l.headDim}, ${l.dtype}, block ${l.blockSize}, ${l.order}, ${l.numBlocks} blocks/rank`;
}

/**
 * The UCX the agents run on: what the first registered agent's context opened, or before any
 * registration what a context with this sidecar's transport list opens.
 */
export function ucxStatus(
  kv: RegisteredKv | undefined,
  transports: string,
): { version: string; transports: string[]; memoryTypes: string[] } {
  const agent = kv?.agents[0];
  const base = ucxInfo(transports);
  if (agent === undefined || agent.closed) return base;
  return { version: base.version, transports: agent.transports, memoryTypes: agent.memoryTypes };
}

/** The transfers in `filter`'s states with its peer (none given: all). */
export function filterTransfers(all: TransferInfo[], filter: TransferFilter): TransferInfo[] {
  const want = filter.states === undefined ? undefined : new Set(filter.states);
  return all.filter(
    (info) =>
      (want === undefined || want.has(info.state)) &&
      (filter.peer === undefined || filter.peer === "" || info.peer === filter.peer),
  );
}
