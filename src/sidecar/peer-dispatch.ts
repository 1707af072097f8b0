/**
 * The peers' notifications to this sidecar, each checked (PeerTable.verify), charged to its
 * sender's budget and handed to the side that owns it; and this sidecar's heartbeats to its
 * peers, one per peer with live transfers or used within the keepalive. A registered rank's
 * agent is wired here.
 */
import type { Agent, Notification } from "../native/index.js";
import type { PeerTable } from "../peer/peer-table.js";
import type { Clock } from "./clock.js";
import type { ErrorPort } from "./context.js";
import type { DecodeSide } from "./decode.js";
import type { PrefillSide } from "./prefill.js";
import type { SidecarRole } from "./view.js";

/** What the dispatch hands messages to. */
export interface PeerDispatchParts {
  readonly role: SidecarRole;
  readonly clock: Clock;
  readonly peers: PeerTable;
  readonly prefill: PrefillSide;
  readonly decode: DecodeSide;
  readonly errors: ErrorPort;
}

/** Notifications admitted and waiting to be processed, at most; past it they are dropped. */
export const MAX_QUEUED_NOTIFICATIONS = 65_536;
/**
 * The longest the dispatch processes notifications in one turn of the event loop (ms): past it
 * the rest wait for the next turn, so timers (heartbeats, deadlines) and sockets (handshakes,
 * gRPC, the engine link) are served between slices whatever arrives. Native batches come in
 * back to back under a flood; processed whole, they held the loop for seconds (measured: a
 * decode peer heard nothing from P for 4 s, and its handshake to P timed out).
 */
export const DISPATCH_SLICE_MS = 5;

export class PeerDispatch {
  /** Admitted notifications not processed yet (from `head`), with the rank they came to. */
  private queue: ({ rank: number; n: Notification } | undefined)[] = [];
  private head = 0;
  private scheduled = false;
  /** Dropped because the queue was full, since the last `takeBehind`. */
  private behind = 0;

  constructor(private readonly parts: PeerDispatchParts) {}

  /** Notifications dropped because MAX_QUEUED_NOTIFICATIONS were waiting, since the last call. */
  takeBehind(): number {
    const n = this.behind;
    this.behind = 0;
    return n;
  }

  /** A registered rank's agent: its notifications come here, its endpoint failures to the table. */
  wire(agent: Agent, rank: number): void {
    agent.on("notifications", (batch) => this.receive(rank, batch));
    agent.on("endpointFailed", (ep, code) => this.parts.peers.endpointFailed(ep, code));
    agent.on("notificationDropped", (peer, bytes) =>
      this.parts.errors.note(
        `peer message from '${peer.slice(0, 200)}' refused: ERR_TOO_LARGE (${bytes} bytes)`,
      ),
    );
  }

  /**
   * Peer notifications that arrived at our agent `rank`: each charged to its sender's share
   * before anything of it is parsed (PeerTable.admit), then processed in arrival order, in
   * slices of DISPATCH_SLICE_MS (at once when nothing waits).
   */
  receive(rank: number, batch: Notification[]): void {
    const { peers } = this.parts;
    for (const n of batch) {
      if (!peers.admit(n)) continue;
      if (this.queue.length - this.head >= MAX_QUEUED_NOTIFICATIONS) {
        this.behind++;
        continue;
      }
      this.queue.push({ rank, n });
    }
    if (!this.scheduled) this.drain();
  }

  private drain(): void {
    const end = performance.now() + DISPATCH_SLICE_MS;
    while (this.head < this.queue.length) {
      const item = this.queue[this.head]!;
      this.queue[this.head++] = undefined;
      this.handle(item.rank, item.n);
      if (this.head < this.queue.length && performance.now() >= end) {
        this.scheduled = true;
        setImmediate(() => {
          this.scheduled = false;
          this.drain();
        });
        return;
      }
    }
    this.queue = [];
    this.head = 0;
  }

  /** One notification: checked (PeerTable.verify), then handed to its side. */
  private handle(rank: number, n: Notification): void {
    const { role, peers, prefill, decode } = this.parts;
    const v = peers.verify(n);
    if (v === undefined) return;
    const { peer, body: b } = v;
    switch (b.case) {
      case "pushReg":
        if (role === "decode") {
          peers.send(peer, {
            case: "failed",
            value: {
              transferId: b.value.transferId,
              code: "ERR_WRONG_ROLE",
              message: "this sidecar does not prefill",
            },
          });
        } else {
          prefill.pushReg(peer, b.value, n.receivedUs);
        }
        break;
      case "xferDone":
        decode.xferDone(peer, v.fromRank, rank, b.value, n);
        break;
      case "readDone":
        prefill.readDone(peer, b.value.transferId, Number(b.value.bytes), b.value.token, n);
        break;
      case "readAck":
        decode.readAck(peer, b.value.transferId, b.value.held, b.value.unknown, n);
        break;
      case "heartbeat":
        prefill.renewLeases(peer, b.value.transferIds);
        break;
      case "abort":
        prefill.peerAbort(peer, b.value.transferId, b.value.token);
        break;
      case "abortAck":
        decode.abortAck(peer, b.value.transferId);
        break;
      case "failed":
        if (!decode.peerFailed(peer, b.value.transferId, b.value.code, b.value.message))
          prefill.peerFailed(peer, b.value.transferId, b.value.code, b.value.token);
        break;
    }
  }

  /**
   * One heartbeat per peer with live transfers, naming the ones whose lease it renews, and per
   * peer kept alive (PeerTable.keptAlive), naming none.
   */
  sendHeartbeats(): void {
    const { peers, prefill, decode } = this.parts;
    const now = this.parts.clock.now();
    const byPeer = decode.heartbeatIds(now);
    for (const peer of [...prefill.livePeers(), ...peers.keptAlive(now)])
      if (!byPeer.has(peer)) byPeer.set(peer, []);
    for (const [peer, ids] of byPeer)
      peers.send(peer, { case: "heartbeat", value: { transferIds: ids } });
  }
}
