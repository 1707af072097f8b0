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

export class PeerDispatch {
  constructor(private readonly parts: PeerDispatchParts) {}

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

  /** Peer notifications that arrived at our agent `rank`: checked, then handed to their side. */
  receive(rank: number, batch: Notification[]): void {
    const { role, peers, prefill, decode } = this.parts;
    for (const n of batch) {
      // Checked, and charged to its sender's budget before its MAC (PeerTable.verify): a
      // heartbeat costs by its size (each id it names is a lookup).
      const v = peers.verify(n);
      if (v === undefined) continue;
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
