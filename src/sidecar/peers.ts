/**
 * What a sidecar knows of each peer engine: its metadata for one epoch, the
 * endpoints from our agents to its agents, and its regions imported on them.
 * Cached by (engine id, epoch); a new epoch replaces the entry.
 */
import type { Logger } from "pino";

import type { AgentMetadata } from "../gen/kvxfer/v1/peer_pb.js";
import { type Agent, type Endpoint, type ErrorMode, type RemoteRegion } from "../native/index.js";
import { ReplayWindow, newMacKey } from "../peer/messages.js";
import type { KvLayout } from "../plan/index.js";

export class PeerState {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly layout: KvLayout;
  readonly sideChannel: string;
  state: "connected" | "failed" = "connected";
  lastSeenMs: number;
  /** Side channel address we reached it at (D side), for revalidation. */
  dialedAddress = "";
  /** Key we MAC our notifications to this peer (this epoch) with; handed over in handshakes. */
  sendKey: Uint8Array = newMacKey();
  /** Key its notifications to us are MACed with (from its latest handshake). */
  private recvKey: Uint8Array = new Uint8Array(0);
  /** The key before that: notifications sealed before a re-handshake may still be in flight. */
  private prevRecvKey: Uint8Array = new Uint8Array(0);
  /** Sequence number of our last notification to it. */
  sendSeq = 0n;
  /** Sequence numbers of its notifications seen (replays are refused). */
  replay = new ReplayWindow();
  private readonly endpoints = new Map<string, Endpoint>();
  private readonly remotes = new Map<string, RemoteRegion>();

  constructor(
    readonly metadata: AgentMetadata,
    layout: KvLayout,
    private readonly agents: readonly Agent[],
    private readonly errorMode: ErrorMode,
    private readonly log: Logger,
  ) {
    this.engineId = metadata.engineId;
    this.epoch = metadata.epoch;
    this.layout = layout;
    this.sideChannel = metadata.sideChannel;
    this.lastSeenMs = Date.now();
  }

  /** Installs the key its notifications are sealed with; a new key starts a new stream. */
  setRecvKey(key: Uint8Array): void {
    if (Buffer.from(key).equals(Buffer.from(this.recvKey))) return;
    this.prevRecvKey = this.recvKey;
    this.recvKey = key;
    this.replay = new ReplayWindow();
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

  /** The peer's region `region` of rank `peerRank`, imported on the endpoint from `localRank`. */
  remote(localRank: number, peerRank: number, region: number): RemoteRegion {
    const key = `${localRank}:${peerRank}:${region}`;
    let r = this.remotes.get(key);
    if (r === undefined) {
      const rank = this.metadata.ranks.find((x) => x.rank === peerRank);
      const keyBytes = rank?.remoteKeys[region];
      if (keyBytes === undefined)
        throw new Error(`peer ${this.engineId}: rank ${peerRank} has no region ${region}`);
      r = this.endpoint(localRank, peerRank).importRemote(keyBytes);
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
