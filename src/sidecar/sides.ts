/**
 * The two sides of a transfer and the peer table between them, built from the sidecar's ports:
 * each side reaches the peers through the table, and the table tells both sides at once when a
 * peer goes (PeerSides). What the facade asks of both sides together is answered here.
 */
import {
  PeerTable,
  type PeerSides,
  type PeerTableHost,
  type PeerTableSettings,
} from "../peer/peer-table.js";
import type { PeerState } from "../peer/peer-state.js";
import type { SideContext } from "./context.js";
import { DecodeSide } from "./decode.js";
import { PrefillSide } from "./prefill.js";
import type { TransferInfo, TransferSide } from "./view.js";

/** The ports both sides and the table are built with (the sidecar's, or a test's). */
export type SidesPorts = Omit<SideContext, "peers"> & Omit<PeerTableHost, "sides">;

export class Sides implements PeerSides {
  readonly peers: PeerTable;
  readonly prefill: PrefillSide;
  readonly decode: DecodeSide;

  constructor(ports: SidesPorts, settings: PeerTableSettings) {
    const peers = new PeerTable({ ...ports, sides: this }, settings);
    this.peers = peers;
    this.prefill = new PrefillSide({ ...ports, peers });
    this.decode = new DecodeSide({ ...ports, peers }, (address) => peers.resolve(address));
  }

  peerDown(peer: PeerState, why: string): void {
    this.decode.peerDown(peer, why);
    this.prefill.peerDown(peer);
  }

  peerUp(peer: PeerState): void {
    this.decode.peerUp(peer);
  }

  peerReached(peer: PeerState): void {
    this.decode.peerReached(peer);
  }

  busyWith(peer: PeerState): boolean {
    return this.decode.readingFrom(peer) || this.prefill.writingTo(peer);
  }

  liveWith(peer: PeerState): boolean {
    return this.decode.liveWith(peer) || this.prefill.liveWith(peer);
  }

  /** Live (non-terminal) transfers on both sides. */
  live(): number {
    return this.prefill.live() + this.decode.live();
  }

  /** Both sides' transfers, P's first. */
  list(): TransferInfo[] {
    return [...this.prefill.list(), ...this.decode.list()];
  }

  /** One transfer as the status view shows it. */
  infoOf(side: TransferSide, transferId: string): TransferInfo | undefined {
    return (side === "prefill" ? this.prefill : this.decode).infoOf(transferId);
  }

  /** A trace hop of `transferId` on `side` (""; both). */
  mark(transferId: string, side: TransferSide | "", hop: string): void {
    if (side !== "decode") this.prefill.mark(transferId, hop);
    if (side !== "prefill") this.decode.mark(transferId, hop);
  }

  /** The transfers left fail now, each peer told. */
  abandon(): void {
    this.prefill.abandon();
    this.decode.abandon();
  }
}
