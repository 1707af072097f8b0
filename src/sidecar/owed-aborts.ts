/**
 * What D owes a prefill peer it lost (issue 52): the transfers that were live with P when D
 * declared it down (silence, endpoint failure), whose end P never heard of, because D sends
 * nothing to a peer it dropped. Across a partition both sides see silence: D fails its
 * transfers, and P would keep a pull's blocks until its lease ran out (measured before this:
 * 231-266 of P's 320 blocks still held 15 s after a 15 s partition healed).
 *
 * So D keeps one Abort per such transfer, by P's side channel address, and dials P again every
 * `retryMs` until a handshake gets through (the link healed) or P's leases have surely run out
 * anyway (`ttlMs`: then there is nothing left to free). Through the new handshake, P at the same
 * epoch gets every Abort: a held pull's blocks go back to P's engine at once, and a push's
 * AbortAck (once P's abandoned writes for it have settled in UCX) ends its drain on D. A P with
 * a new epoch restarted: it holds nothing of the old one's, the notes go, and the handshake
 * ends the old process's drains (DecodeSide.peerUp).
 *
 * Bounded (invariant 5): at most `cap` notes, each gone by its deadline; the sweep visits all.
 */
import type { Logger } from "pino";

import type { PeerBody } from "../peer/messages.js";
import type { PeerState } from "../peer/peer-state.js";

const NONE: ReadonlySet<string> = new Set();

export interface OwedAbort {
  readonly transferId: string;
  readonly token: string;
  readonly reason: string;
}

/** The Abort D sends P for a transfer it gave up on (now, or owed since a partition). */
export function abortBody(a: OwedAbort): PeerBody {
  return { case: "abort", value: { transferId: a.transferId, reason: a.reason, token: a.token } };
}

interface OwedPeer {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly address: string;
  /** After this, P's leases have run out: nothing to free. */
  deadline: number;
  nextTry: number;
  dialing: boolean;
  readonly items: Map<string, OwedAbort>;
}

export interface OwedAbortsPorts {
  /** A handshake with the peer at `address` (bounded by the handshake timeout). */
  resolve(address: string): Promise<PeerState>;
  send(peer: PeerState, body: PeerBody): void;
  readonly log: Logger;
}

export class OwedAborts {
  private readonly byAddress = new Map<string, OwedPeer>();
  private count = 0;

  constructor(
    private readonly ports: OwedAbortsPorts,
    private readonly o: { ttlMs: number; retryMs: number; cap: number },
  ) {}

  /** Notes are kept for this many transfers now. */
  get size(): number {
    return this.count;
  }

  /** D dropped `peer` while `item` was live with it: P is told once it can be reached. */
  note(peer: PeerState, item: OwedAbort, now: number): void {
    const address = peer.dialedAddress;
    if (address === "" || this.count >= this.o.cap) return;
    let owed = this.byAddress.get(address);
    if (owed === undefined || owed.engineId !== peer.engineId || owed.epoch !== peer.epoch) {
      if (owed !== undefined) this.count -= owed.items.size;
      owed = {
        engineId: peer.engineId,
        epoch: peer.epoch,
        address,
        deadline: now + this.o.ttlMs,
        nextTry: now + this.o.retryMs,
        dialing: false,
        items: new Map(),
      };
      this.byAddress.set(address, owed);
    }
    if (!owed.items.has(item.transferId)) this.count++;
    owed.items.set(item.transferId, item);
    owed.deadline = now + this.o.ttlMs;
  }

  /** From the sweep: forget what is past its deadline, dial the peers whose retry is due. */
  tick(now: number): void {
    for (const owed of [...this.byAddress.values()]) {
      if (now >= owed.deadline) {
        this.forget(owed);
        continue;
      }
      if (owed.dialing || now < owed.nextTry) continue;
      owed.dialing = true;
      this.ports.resolve(owed.address).then(
        (peer) => this.reached(owed, peer),
        () => {
          owed.dialing = false;
          owed.nextTry = now + this.o.retryMs;
        },
      );
    }
  }

  /**
   * A handshake D dialed (for whatever reason) reached `peer`: what D owes at its address goes
   * now, instead of when the owed aborts' own dial gets through (a dial that started during the
   * partition may wait out TCP's backed-off connection attempts well past the heal).
   */
  reachedThrough(peer: PeerState): ReadonlySet<string> {
    const owed = this.byAddress.get(peer.dialedAddress);
    return owed !== undefined ? this.reached(owed, peer) : NONE;
  }

  /** Sends what is owed to `peer`; the ids of the transfers told. */
  private reached(owed: OwedPeer, peer: PeerState): ReadonlySet<string> {
    owed.dialing = false;
    if (this.byAddress.get(owed.address) !== owed) return NONE; // replaced or forgotten meanwhile
    this.forget(owed);
    if (peer.engineId !== owed.engineId || peer.epoch !== owed.epoch) {
      this.ports.log.info(
        { peer: peer.engineId, transfers: owed.items.size },
        "a lost prefill peer came back at a new epoch: it holds nothing of ours",
      );
      return NONE;
    }
    this.ports.log.info(
      { peer: peer.engineId, transfers: owed.items.size },
      "a lost prefill peer is reachable again: telling it what we gave up on",
    );
    for (const a of owed.items.values()) this.ports.send(peer, abortBody(a));
    return new Set(owed.items.keys());
  }

  private forget(owed: OwedPeer): void {
    if (this.byAddress.get(owed.address) !== owed) return;
    this.byAddress.delete(owed.address);
    this.count -= owed.items.size;
  }
}
