/**
 * One peer engine at one epoch (`PeerState`: its metadata, the endpoints from our agents to its
 * agents, its regions imported on them, the keys and sequence numbers of its notifications) and
 * how many of its notifications are processed per second (`MessageBudget`).
 */
import type { Logger } from "pino";

import type { AgentMetadata } from "../gen/kvxfer/v1/peer_pb.js";
import type { Agent, Endpoint, ErrorMode, Region, RemoteRegion } from "../native/index.js";
import { pairGroups, type GroupsPairing, type KvGroup, type KvLayout } from "../plan/index.js";
import { ReplayWindow, newMacKey } from "./messages.js";

/** The engine's registered KV cache: its layout, one agent per rank, and each rank's regions. */
export interface RegisteredKv {
  /** Group 0's layout (the only one of most engines). */
  readonly layout: KvLayout;
  /** The engine's KV cache groups; every group's layout addresses the same regions. */
  readonly groups: readonly KvGroup[];
  readonly agents: readonly Agent[];
  readonly regions: readonly (readonly Region[])[];
  /**
   * Why a KV file no longer covers its region (it shrank after registration), or undefined:
   * checked before this sidecar hands its memory to UCX for a transfer (docs/security.md).
   */
  readonly shrunk?: () => string | undefined;
}

/** Where the registered KV is read (the sidecar's KV registry): undefined before registration. */
export interface KvSource {
  readonly kv: RegisteredKv | undefined;
}

export class PeerState {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly layout: KvLayout;
  /** Its engine's KV cache groups (group 0's layout is `layout`). */
  readonly groups: readonly KvGroup[];
  readonly sideChannel: string;
  private up = true;
  lastSeenMs: number;
  /**
   * Last time a transfer used it: a message other than a heartbeat from it, or (D) a transfer
   * resolved to it. Heartbeats go on for `peerKeepaliveMs` after it (PeerTable.keptAlive).
   */
  lastUsedMs: number;
  /** Side channel address we reached it at (D side), for revalidation. */
  dialedAddress = "";
  /** Key we MAC our notifications to this peer (this epoch) with; handed over in handshakes. */
  sendKey: Uint8Array = newMacKey();
  /** Key its notifications to us are MACed with (from its latest handshake). */
  private recvKey: Uint8Array = new Uint8Array(0);
  /** The key before that: notifications sealed before a re-handshake may still be in flight. */
  private prevRecvKey: Uint8Array = new Uint8Array(0);
  /** Its notifications processed per second, at most (Sidecar's peerMessagesPerSec). */
  readonly budget = new MessageBudget();
  /** Notifications claiming to be its whose MAC did not check, since the last report. */
  badMacs = 0;
  /** The last second (ms / 1000) it sent a notification in (PeerTable's count of senders). */
  activeSecond = -1;
  /** Sequence number of our last notification to it. */
  sendSeq = 0n;
  /** Sequence numbers of its notifications seen (replays are refused). */
  replay = new ReplayWindow();
  private readonly endpoints = new Map<string, Endpoint>();
  private readonly remotes = new Map<string, RemoteRegion>();
  private paired: GroupsPairing | undefined;

  constructor(
    readonly metadata: AgentMetadata,
    groups: readonly KvGroup[],
    private readonly agents: readonly Agent[],
    private readonly errorMode: ErrorMode,
    private readonly log: Logger,
    nowMs: number,
    /** Fault in the pages of a region UCX maps into this process (Endpoint.importRemote). */
    private readonly populate: boolean,
  ) {
    this.engineId = metadata.engineId;
    this.epoch = metadata.epoch;
    this.groups = groups;
    this.layout = groups[0]!.layout;
    this.sideChannel = metadata.sideChannel;
    this.lastSeenMs = nowMs;
    this.lastUsedMs = nowMs;
  }

  /**
   * P's groups paired with D's for planning (`pairGroups`; one of the two is this peer's): worked
   * out at the handshake, off any transfer's path, and kept while both sides' groups are the same
   * objects (an engine that registers again brings new ones, paired on first use).
   */
  pairing(src: readonly KvGroup[], dst: readonly KvGroup[]): GroupsPairing {
    const p = this.paired;
    if (p !== undefined && p.src === src && p.dst === dst) return p;
    return (this.paired = pairGroups(src, dst));
  }

  get state(): "connected" | "failed" {
    return this.up ? "connected" : "failed";
  }

  /** It restarted, went silent or its endpoint failed: nothing more is sent to it. */
  markFailed(): void {
    this.up = false;
  }

  /** Installs the key its notifications are sealed with; a new key starts a new stream. */
  setRecvKey(key: Uint8Array): void {
    if (Buffer.from(key).equals(Buffer.from(this.recvKey))) return;
    this.prevRecvKey = this.recvKey;
    this.recvKey = key;
    this.replay = new ReplayWindow();
  }

  /** True when the peer seals its notifications to us with `key` now (the same session). */
  sealsWith(key: Uint8Array): boolean {
    return Buffer.from(key).equals(Buffer.from(this.recvKey));
  }

  /** True when `verify` accepts one of its keys. */
  verifies(verify: (key: Uint8Array) => boolean): boolean {
    return (
      (this.recvKey.length > 0 && verify(this.recvKey)) ||
      (this.prevRecvKey.length > 0 && verify(this.prevRecvKey))
    );
  }

  /** The endpoint from our agent `localRank` to the peer's agent `peerRank`, made on first use. */
  endpoint(localRank: number, peerRank: number): Endpoint {
    const key = `${localRank}:${peerRank}`;
    let ep = this.endpoints.get(key);
    if (ep === undefined || ep.state === "closed") {
      const agent = this.agents[localRank];
      const rank = this.metadata.ranks.find((r) => r.rank === peerRank);
      if (agent === undefined || rank === undefined) {
        throw new Error(`peer ${this.engineId}: no rank pair ${localRank} -> ${peerRank}`);
      }
      ep = agent.connect(rank.workerAddress, { errorMode: this.errorMode });
      this.endpoints.set(key, ep);
    }
    return ep;
  }

  /**
   * The endpoint control messages travel on (heartbeats, PushReg, ReadDone, Abort, Failed): our
   * rank 0 agent to the peer's, apart from the one rank 0's data takes. Over TCP each endpoint is
   * its own connection, and UCX sends an endpoint's operations in order: on the data endpoint a
   * heartbeat waited behind every put posted before it (measured: at 50 Mbit/s with 16 x 2 MiB
   * in flight, D heard nothing from P for 2 s while P's bytes were landing, and failed all 16 as
   * silent). On its own connection it takes its share of the link beside the bulk.
   */
  controlEndpoint(): Endpoint {
    let ep = this.endpoints.get("control");
    if (ep === undefined || ep.state === "closed") {
      const agent = this.agents[0];
      const rank = this.metadata.ranks.find((r) => r.rank === 0);
      if (agent === undefined || rank === undefined)
        throw new Error(`peer ${this.engineId}: no rank 0 for control messages`);
      ep = agent.connect(rank.workerAddress, { errorMode: this.errorMode });
      this.endpoints.set("control", ep);
    }
    return ep;
  }

  /** The peer's region `region` of rank `peerRank`, imported on the endpoint from `localRank`. */
  remote(localRank: number, peerRank: number, region: number): RemoteRegion {
    const key = `${localRank}:${peerRank}:${region}`;
    let r = this.remotes.get(key);
    if (r === undefined) {
      const rank = this.metadata.ranks.find((x) => x.rank === peerRank);
      const keyBytes = rank?.remoteKeys[region];
      if (keyBytes === undefined)
        throw new Error(`peer ${this.engineId}: rank ${peerRank} has no region ${region}`);
      r = this.endpoint(localRank, peerRank).importRemote(keyBytes, { populate: this.populate });
      this.remotes.set(key, r);
    }
    return r;
  }

  /** True when `ep` is one of this peer's endpoints. */
  owns(ep: Endpoint): boolean {
    for (const e of this.endpoints.values()) if (e === ep) return true;
    return false;
  }

  /** Its endpoints now (they stay usable for `abandon` after `close`). */
  endpointList(): Endpoint[] {
    return [...this.endpoints.values()];
  }

  close(): void {
    for (const r of this.remotes.values()) r.close();
    for (const e of this.endpoints.values()) e.close();
    this.remotes.clear();
    this.endpoints.clear();
    this.log.debug({ peer: this.engineId, epoch: String(this.epoch) }, "peer state closed");
  }
}

/**
 * The same peer process: its engine and epoch. After a partition the two sides reach each other
 * through a new handshake (a new PeerState, authenticated like the first); what one process said
 * through either counts for its transfers.
 */
export function sameProcess(a: PeerState, b: PeerState): boolean {
  return a === b || (a.engineId === b.engineId && a.epoch === b.epoch);
}

/**
 * How many of one peer's notifications the sidecar processes per second: a token bucket of
 * `perSec` with a burst of two seconds' worth, checked in O(1). Past it, the peer's messages are
 * dropped unprocessed (its own transfers suffer, no one else's).
 */
export class MessageBudget {
  private tokens = -1;
  private at = 0;
  /** Messages dropped since the last time `dropped()` was read. */
  private droppedSince = 0;

  /**
   * Takes `cost` messages' worth at `nowMs` (a message naming many transfers costs more);
   * false when the budget is spent.
   */
  take(nowMs: number, perSec: number, cost = 1): boolean {
    const burst = 2 * perSec;
    if (this.tokens < 0) this.tokens = burst;
    else this.tokens = Math.min(burst, this.tokens + ((nowMs - this.at) * perSec) / 1000);
    this.at = nowMs;
    if (this.tokens >= cost) {
      this.tokens -= cost;
      return true;
    }
    this.droppedSince++;
    return false;
  }

  /** Dropped since the last call (for one error line per sweep, not one per message). */
  dropped(): number {
    const n = this.droppedSince;
    this.droppedSince = 0;
    return n;
  }
}

/** One peer as the status view shows it. */
export interface PeerInfo {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly state: "connected" | "failed";
  readonly lastSeenMs: number;
  readonly sideChannel: string;
}
