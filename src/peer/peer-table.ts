/**
 * The peers: what a sidecar knows of each peer engine, cached by (engine id, epoch); a new epoch
 * replaces the entry. Handshakes both ways, the checks on every notification, sending, dropping.
 */
import { create } from "@bufbuild/protobuf";
import type { Logger } from "pino";

import {
  AgentMetadataSchema,
  HandshakeRequestSchema,
  HandshakeResponseSchema,
  RankMetadataSchema,
  Role,
  type AgentMetadata,
  type HandshakeRequest,
  type HandshakeResponse,
} from "../gen/kvxfer/v1/peer_pb.js";
import { KvxferError } from "../errors.js";
import type { Endpoint, ErrorMode, Notification } from "../native/index.js";
import {
  findGroupsIncompatibility,
  type KvGroup,
  type KvLayout,
  PlanError,
} from "../plan/index.js";
import {
  kvGroupsFromProto,
  kvGroupsToProto,
  kvLayoutFromProto,
  kvLayoutToProto,
} from "../plan/layout-proto.js";
import {
  MAC_KEY_BYTES,
  PeerMessageError,
  encodePeerMessage,
  engineIdProblem,
  newMacKey,
  openPeerMessage,
  parseAgentName,
  sealPeerMessage,
  type OpenedPeerMessage,
  type PeerBody,
} from "./messages.js";
import {
  MessageBudget,
  PeerState,
  type KvSource,
  type PeerInfo,
  type RegisteredKv,
} from "./peer-state.js";
import {
  handshake,
  refusal,
  type HandshakeResult,
  type PeerCredentials,
  type PeerIdentity,
  wasCut,
} from "./side-channel.js";

/** What the table reads the time with and sets its one-shot timers on (the sidecar's clock). */
export interface PeerClock {
  now(): number;
  /** Runs `fn` once after `ms` (never keeps the process alive). */
  after(ms: number, fn: () => void): void;
}

/** The role this sidecar announces in its handshakes. */
export type PeerRole = "prefill" | "decode" | "both";

/** Peers known at once at most; an idle peer is forgotten after the tombstone time. */
export const MAX_PEERS = 4096;
/**
 * With MAX_PEERS known, a new peer takes the place of an idle one (no live transfer, nothing in
 * flight): the first such among this many of the least recently handshaken, checked in order.
 */
export const PEER_EVICTION_SCAN = 64;

/** Peer events as the table emits them (the sidecar's event outbox). */
export interface PeerEventPort {
  peerEvent(kind: "PEER_UP" | "PEER_DOWN", peer: string, reason: string): void;
}

/** The registered KV, and whether peers may handshake with it now (the sidecar's KV registry). */
export interface KvGate extends KvSource {
  /** Why handshakes are refused now (not registered, draining), or undefined. */
  notAccepting(): { code: string; message: string } | undefined;
}

/** What the table tells the sides and asks them (both sides at once). */
export interface PeerSides {
  /** The sides fail what depended on a peer that is gone. */
  peerDown(peer: PeerState, why: string): void;
  /** A handshake we dialed reached `peer` (its epoch may be new). */
  peerUp(peer: PeerState): void;
  /** Any handshake we dialed reached `peer`, new or known: what is owed to it may go now. */
  peerReached(peer: PeerState): void;
  /** Reads from or writes to `peer` still in flight. */
  busyWith(peer: PeerState): boolean;
  /** Live transfers with `peer`. */
  liveWith(peer: PeerState): boolean;
}

/** The ports the peer table is built with: the sidecar's identity and the objects it reaches. */
export interface PeerTableHost {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly role: PeerRole;
  readonly clock: PeerClock;
  readonly log: Logger;
  /** The side channel: its bound address, and whether it authenticates peers (mutual TLS). */
  readonly channel: { readonly address: string; readonly authenticated: boolean };
  readonly kvs: KvGate;
  readonly events: PeerEventPort;
  /** Error lines for GetStatus. */
  readonly errors: { note(text: string): void };
  readonly sides: PeerSides;
}

export interface PeerTableSettings {
  readonly errorMode: ErrorMode;
  readonly heartbeatMs: number;
  readonly handshakeTimeoutMs: number;
  readonly peerTimeoutMs: number;
  /**
   * Heartbeats go on this long after a peer's last transfer (0: only while transfers are live),
   * so that a transfer after a quiet spell finds the peer fresh and needs no new handshake.
   */
  readonly peerKeepaliveMs: number;
  readonly tombstoneMs: number;
  readonly abortGraceMs: number;
  readonly peerCredentials: PeerCredentials | undefined;
  /** Fault the pages of a peer's region that UCX maps into this process in at import. */
  readonly prefault?: boolean;
  /**
   * Notifications processed per second at most, every peer together, shared equally between
   * the peers that sent any in this second or the one before (one peer alone gets all of it;
   * burst: two seconds' worth; absent: no limit). More identities get no more of the sidecar's
   * work, only smaller shares each. Charged before the MAC is checked: past it a message costs
   * a parse and a lookup.
   */
  readonly peerMessagesPerSec?: number;
}

/**
 * How many peers sent notifications lately: those of the current second and of the one before,
 * whichever is more (O(1) per message: each peer remembers its last second).
 */
export class ActiveSenders {
  private second = -1;
  private current = 0;
  private previous = 0;

  /** `peer` sends at `nowMs`: the number of peers sending lately (at least 1). */
  note(peer: PeerState, nowMs: number): number {
    const s = Math.floor(nowMs / 1000);
    if (s !== this.second) {
      this.previous = s === this.second + 1 ? this.current : 0;
      this.current = 0;
      this.second = s;
    }
    if (peer.activeSecond !== s) {
      peer.activeSecond = s;
      this.current++;
    }
    return Math.max(1, this.current, this.previous);
  }
}

/** Notifications per second from agents that are no connected peer, all together. */
export const STRANGERS_PER_SEC = 100;

/** What a notification costs of its sender's budget: one, and one more per 4 KiB it carries. */
export function messageCost(bytes: number): number {
  return 1 + Math.floor(bytes / 4096);
}

/** A notification that passed every check, from `peer`'s agent `fromRank`. */
export interface VerifiedNotification {
  readonly peer: PeerState;
  readonly fromRank: number;
  readonly body: OpenedPeerMessage["body"];
}

function roleToProto(role: PeerRole): Role {
  return role === "prefill" ? Role.PREFILL : role === "decode" ? Role.DECODE : Role.BOTH;
}

/**
 * Every peer engine this sidecar knows: handshakes both ways (metadata checks, identity against
 * the certificate, keys), the cache by (engine id, epoch) and by side channel address, the
 * checks on every notification (epochs, agent name, MAC, replay), sending, dropping a peer
 * (which tells both sides) and forgetting silent ones.
 */
export class PeerTable {
  private readonly peers = new Map<string, PeerState>();
  /** Side channel address -> engine id, for the D side's cache. */
  private readonly byAddress = new Map<string, string>();
  private readonly handshakes = new Map<string, Promise<PeerState>>();
  private readonly senders = new ActiveSenders();
  /** Notifications from agents that are no connected peer, all together (admit). */
  private readonly strangers = new MessageBudget();
  private closed = false;

  constructor(
    private readonly host: PeerTableHost,
    private readonly settings: PeerTableSettings,
  ) {}

  close(): void {
    this.closed = true;
    for (const p of this.peers.values()) p.close();
    this.peers.clear();
  }

  private metadata(): AgentMetadata {
    const kv = this.host.kvs.kv!;
    return create(AgentMetadataSchema, {
      engineId: this.host.engineId,
      epoch: this.host.epoch,
      role: roleToProto(this.host.role),
      layout: kvLayoutToProto(kv.layout),
      // One full group travels as the layout alone, as before groups existed.
      groups:
        kv.groups.length === 1 && kv.groups[0]!.kind === "full" ? [] : kvGroupsToProto(kv.groups),
      sideChannel: this.host.channel.address,
      ranks: kv.agents.map((a, rank) =>
        create(RankMetadataSchema, {
          rank,
          workerAddress: a.address,
          remoteKeys: kv.regions[rank]!.map((r) => r.remoteKey()),
        }),
      ),
    });
  }

  /** Checks a peer's metadata and returns its groups; throws KvxferError naming the field. */
  private static checkMetadata(md: AgentMetadata | undefined): readonly KvGroup[] {
    if (md === undefined) throw new KvxferError("ERR_MALFORMED", "handshake carries no metadata");
    const idProblem = engineIdProblem(md.engineId, "metadata.engine_id");
    if (idProblem !== undefined) throw new KvxferError("ERR_MALFORMED", idProblem);
    if (md.epoch === 0n) throw new KvxferError("ERR_MALFORMED", "metadata.epoch is 0");
    if (md.layout === undefined)
      throw new KvxferError("ERR_MALFORMED", "metadata.layout is missing");
    let layout: KvLayout;
    let groups: readonly KvGroup[];
    try {
      layout = kvLayoutFromProto(md.layout);
      groups = kvGroupsFromProto(md.groups, layout);
    } catch (err) {
      const field = err instanceof PlanError ? `metadata.${err.field}: ` : "";
      throw new KvxferError("ERR_LAYOUT_INVALID", field + (err as Error).message);
    }
    if (md.ranks.length !== layout.tpSize)
      throw new KvxferError(
        "ERR_MALFORMED",
        `metadata has ${md.ranks.length} ranks for tp_size ${layout.tpSize}`,
      );
    for (let r = 0; r < layout.tpSize; r++) {
      const rk = md.ranks.find((x) => x.rank === r);
      if (rk === undefined) throw new KvxferError("ERR_MALFORMED", `metadata has no rank ${r}`);
      if (rk.remoteKeys.length !== layout.regionBytes.length)
        throw new KvxferError(
          "ERR_MALFORMED",
          `rank ${r} has ${rk.remoteKeys.length} keys for ${layout.regionBytes.length} regions`,
        );
    }
    return groups;
  }

  /** Prefill side: D introduces itself; we answer with our metadata. */
  onHandshake(req: HandshakeRequest, identity: PeerIdentity): HandshakeResponse {
    const res = this.answerHandshake(req, identity);
    if (res.errorCode !== "")
      this.host.errors.note(`handshake refused: ${res.errorCode}: ${res.error}`);
    return res;
  }

  private answerHandshake(req: HandshakeRequest, identity: PeerIdentity): HandshakeResponse {
    const notNow = this.host.kvs.notAccepting();
    if (notNow !== undefined) return refusal(notNow.code, notNow.message);
    let groups: readonly KvGroup[];
    try {
      groups = PeerTable.checkMetadata(req.metadata);
    } catch (err) {
      const e = KvxferError.from(err);
      return refusal(e.code, e.message);
    }
    const md = req.metadata!;
    // With credentials, a peer is who its certificate says, and nobody else.
    if (this.host.channel.authenticated && identity !== md.engineId) {
      return refusal(
        "ERR_UNAUTHENTICATED",
        `metadata claims engine '${md.engineId}' but the certificate names '${identity ?? ""}'`,
      );
    }
    if (req.macKey.length !== MAC_KEY_BYTES)
      return refusal("ERR_MALFORMED", `mac_key must be ${MAC_KEY_BYTES} bytes`);
    const mismatch = findGroupsIncompatibility(this.host.kvs.kv!.groups, groups);
    if (mismatch !== undefined)
      return refusal("ERR_LAYOUT_INCOMPATIBLE", `${mismatch.field}: ${mismatch.message}`);
    // A dialer that still holds us keeps its key; a new key is a new session: the dialer
    // dropped us (a partition, silence) and made new endpoints, so ours to it are stale and
    // would fail at its reset, taking the new session's answers with them (measured: a push's
    // AbortAck lost that way after a partition healed, D's blocks held 60 s past the heal).
    const held = this.peers.get(md.engineId);
    if (held?.state === "connected" && held.epoch === md.epoch && !held.sealsWith(req.macKey))
      this.drop(held, "a new session from the same process (its endpoints to us are new)");
    let peer: PeerState;
    try {
      peer = this.adopt(md, groups);
    } catch (err) {
      const e = KvxferError.from(err);
      return refusal(e.code, e.message);
    }
    peer.pairing(this.host.kvs.kv!.groups, peer.groups); // this side is P: it plans pushes to D
    peer.setRecvKey(req.macKey);
    return create(HandshakeResponseSchema, { metadata: this.metadata(), macKey: peer.sendKey });
  }

  /** Installs a peer's metadata; a new epoch replaces the old peer and fails what it had. */
  private adopt(md: AgentMetadata, groups: readonly KvGroup[]): PeerState {
    const old = this.peers.get(md.engineId);
    if (old !== undefined && old.epoch === md.epoch && old.state === "connected") {
      old.lastSeenMs = this.host.clock.now();
      old.lastUsedMs = old.lastSeenMs; // it handshakes to transfer
      // The least recently handshaken first (an eviction looks there).
      this.peers.delete(md.engineId);
      this.peers.set(md.engineId, old);
      return old;
    }
    if (old !== undefined)
      this.drop(old, old.epoch === md.epoch ? "peer failed" : "peer restarted (new epoch)");
    if (this.peers.size >= MAX_PEERS && !this.evictIdle()) {
      throw new KvxferError(
        "ERR_OVERLOADED",
        `${MAX_PEERS} peers known, none idle among the ${PEER_EVICTION_SCAN} least recent; refusing another`,
      );
    }
    const peer = new PeerState(
      md,
      groups,
      this.host.kvs.kv!.agents,
      this.settings.errorMode,
      this.host.log,
      this.host.clock.now(),
      this.settings.prefault === true,
    );
    // The control endpoint first, on both sides: UCX pairs the n-th endpoint one worker makes
    // to another with the n-th the other makes back (over TCP the pair shares one connection).
    // Made later, P's control endpoint was paired with D's data endpoint, and in pull P's
    // heartbeats queued behind the bytes of D's reads again (measured: 16 x 2 MiB at 50 Mbit/s,
    // all failed as silent).
    peer.controlEndpoint();
    this.peers.set(md.engineId, peer);
    this.host.events.peerEvent("PEER_UP", md.engineId, `epoch ${md.epoch}`);
    return peer;
  }

  /**
   * Forgets the first idle peer (no live transfer, no read or write in flight) among the
   * PEER_EVICTION_SCAN least recently handshaken; false when none of them is idle.
   */
  private evictIdle(): boolean {
    let n = 0;
    for (const peer of this.peers.values()) {
      if (n++ >= PEER_EVICTION_SCAN) break;
      if (this.host.sides.liveWith(peer) || this.host.sides.busyWith(peer)) continue;
      this.forget(peer);
      this.host.log.info({ peer: peer.engineId }, "idle peer forgotten to make room");
      return true;
    }
    return false;
  }

  private forget(peer: PeerState): void {
    this.peers.delete(peer.engineId);
    if (this.byAddress.get(peer.dialedAddress) === peer.engineId)
      this.byAddress.delete(peer.dialedAddress);
    peer.close();
  }

  /**
   * Decode side: the peer at `address`, from the cache while it is fresh, else by handshake.
   * A handshake that fails while the cached peer is still connected and was heard from within
   * the peer timeout leaves the cached one in use: the authenticated channel stays up while
   * the peer is known, and a side channel an attacker keeps busy costs no transfer.
   */
  resolve(address: string): Promise<PeerState> {
    const known = this.byAddress.get(address);
    const cached = known === undefined ? undefined : this.peers.get(known);
    if (
      cached !== undefined &&
      cached.state === "connected" &&
      this.host.clock.now() - cached.lastSeenMs < 2 * this.settings.heartbeatMs
    ) {
      cached.lastUsedMs = this.host.clock.now();
      return Promise.resolve(cached);
    }
    let pending = this.handshakes.get(address);
    if (pending === undefined) {
      // Heard from within the peer timeout when the handshake began (a handshake can take as
      // long as the timeout itself, P's heartbeats delayed behind a flood meanwhile).
      const heard = cached?.lastSeenMs ?? -Infinity;
      const fresh = this.host.clock.now() - heard < this.settings.peerTimeoutMs;
      pending = this.dial(address, cached)
        .catch((err: unknown) => {
          if (
            cached !== undefined &&
            cached.state === "connected" &&
            this.peers.get(cached.engineId) === cached &&
            fresh
          ) {
            this.host.log.warn(
              { err, peer: cached.engineId, address },
              "handshake failed; the known peer is still heard from and stays in use",
            );
            cached.lastUsedMs = this.host.clock.now();
            return cached;
          }
          throw err;
        })
        .finally(() => this.handshakes.delete(address));
      this.handshakes.set(address, pending);
    }
    return pending;
  }

  /**
   * One handshake answer from `address`, trying again while the handshake timeout lasts when the
   * connection was cut before any answer (a side channel under attack displaces connections:
   * a new one may well get through). A refusal, or a failed TLS handshake, is final.
   */
  private async answer(address: string, req: HandshakeRequest): Promise<HandshakeResult> {
    const { handshakeTimeoutMs } = this.settings;
    const creds = this.settings.peerCredentials;
    const started = Date.now();
    for (let attempt = 0; ; attempt++) {
      const left = handshakeTimeoutMs - (Date.now() - started);
      try {
        return await handshake(address, req, Math.max(1, left), creds);
      } catch (err) {
        const waitMs = Math.min(25 << attempt, 400);
        if (!wasCut(err) || Date.now() - started + waitMs >= handshakeTimeoutMs) throw err;
        await new Promise((r) => setTimeout(r, waitMs));
      }
    }
  }

  private async dial(address: string, cached: PeerState | undefined): Promise<PeerState> {
    // Re-handshaking a peer we know keeps our key: notifications in flight stay valid.
    const macKey = cached?.state === "connected" ? cached.sendKey : newMacKey();
    const req = create(HandshakeRequestSchema, {
      metadata: this.metadata(),
      expectedEpoch: cached?.epoch ?? 0n,
      macKey,
    });
    const creds = this.settings.peerCredentials;
    const { response: res, peer: identity } = await this.answer(address, req);
    if (res.errorCode !== "")
      throw new KvxferError(res.errorCode, `handshake with ${address} refused: ${res.error}`);
    const groups = PeerTable.checkMetadata(res.metadata);
    if (creds !== undefined && identity !== res.metadata!.engineId) {
      throw new KvxferError(
        "ERR_UNAUTHENTICATED",
        `${address} claims engine '${res.metadata!.engineId}' but its certificate names '${identity ?? ""}'`,
      );
    }
    if (res.macKey.length !== MAC_KEY_BYTES)
      throw new KvxferError("ERR_MALFORMED", `handshake answer from ${address} has no mac_key`);
    const mismatch = findGroupsIncompatibility(groups, this.host.kvs.kv!.groups);
    if (mismatch !== undefined)
      throw new KvxferError("ERR_LAYOUT_INCOMPATIBLE", `${mismatch.field}: ${mismatch.message}`);
    // A new key (we held no live state for this address) is a new session on both sides: P
    // drops what it held for us, so a live state of ours for the same process is stale too.
    const held = this.peers.get(res.metadata!.engineId);
    if (
      held !== undefined &&
      held !== cached &&
      held.state === "connected" &&
      held.epoch === res.metadata!.epoch &&
      !Buffer.from(held.sendKey).equals(Buffer.from(macKey))
    )
      this.drop(held, "a new session with the same process (dialed at another address)");
    const peer = this.adopt(res.metadata!, groups);
    peer.pairing(peer.groups, this.host.kvs.kv!.groups); // this side is D: it plans reads from P
    peer.sendKey = macKey;
    peer.setRecvKey(res.macKey);
    peer.dialedAddress = address;
    this.byAddress.set(address, peer.engineId);
    // Only a peer we dialed, at the address we were given for it, ends what its old epoch left
    // draining (a handshake to us could claim any engine without peer credentials), and gets
    // what D owes it; keyed and addressed by now, so that the sides may send to it at once.
    if (peer !== cached) this.host.sides.peerUp(peer);
    this.host.sides.peerReached(peer);
    return peer;
  }

  /** A peer is gone (restart, silence, endpoint failure): fail what depended on it. */
  drop(peer: PeerState, why: string): void {
    if (peer.state === "failed" && this.peers.get(peer.engineId) !== peer) return;
    peer.markFailed();
    this.host.events.peerEvent("PEER_DOWN", peer.engineId, why);
    this.host.log.warn({ peer: peer.engineId, epoch: String(peer.epoch), why }, "peer down");
    this.host.sides.peerDown(peer, why);
    if (this.peers.get(peer.engineId) === peer) this.peers.delete(peer.engineId);
    const endpoints = peer.endpointList();
    // Endpoints close once their operations settle; the native layer defers the close.
    peer.close();
    // Reads from a dead peer may never settle (UCX without peer error mode, measured here over
    // shared memory: a READ from a SIGKILLed sidecar hung forever and D's blocks stayed held).
    // Writes to one neither (measured: P's pushes to a SIGKILLed D stayed MOVING, and P's engine
    // kept their blocks for good). A grace later, whatever is still in flight to it is given up:
    // the reads and writes reject and the transfer fails. Its blocks go back only once the
    // endpoint's flush says UCX holds none of them any more (or the settle bound passed): an
    // abandoned operation is not cancelled, and over TCP its bytes may still land when a
    // partition heals (settle.ts).
    if (this.host.sides.busyWith(peer)) {
      const graceMs = this.settings.abortGraceMs;
      this.host.clock.after(graceMs, () => {
        if (this.closed) return;
        this.host.log.warn(
          { peer: peer.engineId, graceMs },
          "abandoning reads and writes to a dead peer",
        );
        for (const ep of endpoints) ep.abandon();
      });
    }
  }

  /** One of our endpoints failed: the peer it leads to is down. */
  endpointFailed(ep: Endpoint, code: string): void {
    for (const peer of this.peers.values()) {
      if (peer.owns(ep)) {
        this.drop(peer, `endpoint failed: ${code}`);
        return;
      }
    }
  }

  /** One notification to `peer`: numbered, and sealed with our key for it. */
  seal(peer: PeerState, body: PeerBody): Uint8Array {
    peer.sendSeq += 1n;
    return sealPeerMessage(
      peer.sendKey,
      encodePeerMessage(this.host.engineId, this.host.epoch, peer.epoch, body, peer.sendSeq),
    );
  }

  /** Control messages go from our rank 0 agent to the peer's rank 0 agent, on their own endpoint. */
  send(peer: PeerState, body: PeerBody): void {
    if (peer.state !== "connected") return;
    // Closed (the agents are gone): transfers ending during the stop notify no one.
    const agent = this.host.kvs.kv?.agents[0];
    if (agent === undefined) return;
    const log = this.host.log;
    try {
      agent.notify(peer.controlEndpoint(), this.seal(peer, body)).catch((err: unknown) => {
        log.warn({ err, peer: peer.engineId, msg: body.case }, "peer notification failed");
      });
    } catch (err) {
      log.warn({ err, peer: peer.engineId, msg: body.case }, "peer notification failed");
    }
  }

  /**
   * The first check of a notification, before anything of it is parsed (O(1)): the sender its
   * agent name claims is charged its size against its share of the sidecar's work (`admit`
   * false: over it, dropped unprocessed and counted). A sender that is no connected peer shares
   * a small allowance with every other such (its messages are refused anyway; a few are kept
   * for the error lines). What it costs a forger: this, not a parse or a MAC.
   */
  admit(n: Notification): boolean {
    const rate = this.settings.peerMessagesPerSec;
    if (rate === undefined) return true;
    const now = this.host.clock.now();
    const cost = messageCost(n.data.length);
    // The engine id the agent name claims (`<engineId>#<epoch>#<rank>`; engine ids hold no '#').
    const hash = n.peer.indexOf("#");
    const peer = hash < 0 ? undefined : this.peers.get(n.peer.slice(0, hash));
    if (peer === undefined || peer.state !== "connected")
      return this.strangers.take(now, STRANGERS_PER_SEC, cost);
    return peer.budget.take(now, rate / this.senders.note(peer, now), cost);
  }

  /**
   * Opens one notification and checks it: a known peer at the epoch we hold, naming us at ours,
   * from an agent of that peer, sealed with its key, not seen before. Undefined (and an error
   * noted) when any check fails.
   */
  verify(n: Notification): VerifiedNotification | undefined {
    const { host } = this;
    let m: OpenedPeerMessage;
    try {
      m = openPeerMessage(n.data);
    } catch (err) {
      const code = err instanceof PeerMessageError ? err.code : "ERR_MALFORMED";
      host.errors.note(`peer message from '${n.peer.slice(0, 200)}' refused: ${code}`);
      return undefined;
    }
    const from = parseAgentName(n.peer);
    const peer = this.peers.get(m.senderEngineId);
    // Stale or forged: the sender must be a known peer at the epoch we hold, and name us at ours.
    if (
      peer === undefined ||
      peer.state !== "connected" ||
      m.senderEpoch !== peer.epoch ||
      m.receiverEpoch !== host.epoch ||
      from === undefined ||
      from.engineId !== m.senderEngineId ||
      from.epoch !== m.senderEpoch
    ) {
      host.errors.note(
        `peer message from '${m.senderEngineId}' (epoch ${m.senderEpoch}) refused: ERR_STALE_EPOCH`,
      );
      host.log.debug(
        { sender: m.senderEngineId, msg: m.body.case },
        "stale or unknown peer message refused",
      );
      return undefined;
    }
    // It must be sealed with the key that engine gave us in its handshake, and new. The first
    // refusal is noted at once, the rest counted and reported by the sweep (badMacReport): a
    // forger pays for its messages, not for our error lines.
    if (!peer.verifies(m.verify)) {
      if (peer.badMacs++ === 0)
        host.errors.note(
          `peer message from '${m.senderEngineId}' refused: ERR_UNAUTHENTICATED (bad MAC)`,
        );
      return undefined;
    }
    if (!peer.replay.accept(m.seq)) {
      host.errors.note(
        `peer message from '${m.senderEngineId}' refused: ERR_REPLAY (sequence ${m.seq} seen)`,
      );
      return undefined;
    }
    peer.lastSeenMs = host.clock.now();
    if (m.body.case !== "heartbeat") peer.lastUsedMs = peer.lastSeenMs;
    return { peer, fromRank: from.rank, body: m.body };
  }

  /**
   * Connected peers used by a transfer within the keepalive and heard from within the peer
   * timeout: each gets a heartbeat even with no transfer live. Its heartbeats keep this side
   * fresh in the peer's table (`resolve` re-dials a peer unheard of for two heartbeat periods,
   * a TLS handshake per transfer otherwise); a peer gone silent gets none past the timeout.
   */
  keptAlive(now: number): PeerState[] {
    const { peerKeepaliveMs, peerTimeoutMs } = this.settings;
    const out: PeerState[] = [];
    for (const p of this.peers.values())
      if (
        p.state === "connected" &&
        now - p.lastUsedMs < peerKeepaliveMs &&
        now - p.lastSeenMs < peerTimeoutMs
      )
        out.push(p);
    return out;
  }

  /** Drops peers silent too long while transfers are live; forgets idle ones after the tombstone. */
  expire(now: number): void {
    for (const peer of [...this.peers.values()]) {
      if (peer.state !== "connected" || now - peer.lastSeenMs < this.settings.peerTimeoutMs)
        continue;
      if (this.host.sides.liveWith(peer)) {
        this.drop(peer, `silent for ${now - peer.lastSeenMs} ms`);
      } else if (now - peer.lastSeenMs > this.settings.tombstoneMs) {
        // Idle and unheard of for long: forget it (a new transfer handshakes again).
        this.forget(peer);
      }
    }
  }

  /**
   * Peers whose messages were dropped over budget since the last call, with how many ("" for
   * senders that are no connected peer).
   */
  overBudget(): [string, number][] {
    const out: [string, number][] = [];
    const strangers = this.strangers.dropped();
    if (strangers > 0) out.push(["", strangers]);
    for (const p of this.peers.values()) {
      const n = p.budget.dropped();
      if (n > 0) out.push([p.engineId, n]);
    }
    return out;
  }

  /** Peers with more than one bad-MAC notification since the last call: how many more. */
  badMacReport(): [string, number][] {
    const out: [string, number][] = [];
    for (const p of this.peers.values()) {
      if (p.badMacs > 1) out.push([p.engineId, p.badMacs - 1]);
      p.badMacs = 0;
    }
    return out;
  }

  list(): PeerInfo[] {
    return [...this.peers.values()].map((p) => ({
      engineId: p.engineId,
      epoch: p.epoch,
      state: p.state,
      lastSeenMs: p.lastSeenMs,
      sideChannel: p.sideChannel,
    }));
  }
}
