/**
 * Long-lived calls a gRPC client can open (WatchEvents, AwaitTransfer, Health Watch), shared
 * between clients (issue 48). A client is its mutual TLS identity (the certificate's subject
 * CN) when it presented one, else its address group (IPv4 /32, IPv6 /64). Each client holds at
 * most `perClient` calls of a kind; when all `capacity` are taken, a client holding fewer than
 * the largest takes the place of the largest one's oldest call (which ends RESOURCE_EXHAUSTED),
 * and an authenticated client takes the place of an unauthenticated one first: authenticated
 * routers never wait on calls of clients that presented no certificate.
 */
import type { PeerCertificate } from "node:tls";

import { FairPool, addressGroup } from "../peer/fair-pool.js";
import { certificateIdentity } from "../peer/side-channel.js";

/** Who holds a call: its group, and whether it authenticated (mutual TLS). */
export interface CallClient {
  readonly group: string;
  readonly trusted: boolean;
  /** For messages: the identity or the address. */
  readonly name: string;
}

/** The client of a call, from what grpc-js knows of it. */
export function callClient(call: {
  getPeer(): string;
  getAuthContext(): { sslPeerCertificate?: PeerCertificate };
}): CallClient {
  const cert = call.getAuthContext().sslPeerCertificate;
  const cn = cert === undefined ? "" : certificateIdentity(cert);
  if (cn !== "") return { group: `id:${cn}`, trusted: true, name: `'${cn}'` };
  const address = clientOf(call.getPeer());
  return { group: `addr:${addressGroup(address)}`, trusted: false, name: address };
}

/** A call's client address from grpc-js's peer string ("1.2.3.4:5678", "ipv6:[::1]:5678"). */
export function clientOf(peer: string): string {
  const m = /^(?:ipv4:|ipv6:)?\[?(.*?)\]?:\d+$/.exec(peer);
  return (m?.[1] ?? peer).replace(/^::ffff:/, "");
}

export type Admission<M> = { readonly displaced?: M } | { readonly refused: string };

export class CallShares<M> {
  private readonly trusted: FairPool<M>;
  private readonly anon: FairPool<M>;

  constructor(
    /** What the calls are, for messages ("WatchEvents streams"). */
    private readonly what: string,
    readonly capacity: number,
    readonly perClient: number,
  ) {
    this.trusted = new FairPool(capacity);
    this.anon = new FairPool(capacity);
  }

  get size(): number {
    return this.trusted.size + this.anon.size;
  }

  /** Calls `client` holds now. */
  countOf(client: CallClient): number {
    return (client.trusted ? this.trusted : this.anon).count(client.group);
  }

  /**
   * Room for `m`, a call of `client`: admitted (possibly displacing another client's oldest
   * call, which the caller ends), or refused with why.
   */
  admit(m: M, client: CallClient): Admission<M> {
    const pool = client.trusted ? this.trusted : this.anon;
    const mine = pool.count(client.group);
    if (mine >= this.perClient)
      return {
        refused: `${mine} ${this.what} from ${client.name} already (most ${this.perClient} per client; the rest are kept for others)`,
      };
    let displaced: M | undefined;
    if (this.size >= this.capacity) {
      displaced =
        client.trusted && this.anon.size > 0
          ? this.anon.oldestOfLargest()
          : pool.victimFor(client.group, false);
      if (displaced === undefined)
        return {
          refused: `${this.size} ${this.what} already (most ${this.capacity}), and ${client.name} holds as many as any client`,
        };
      this.delete(displaced);
    }
    pool.add(m, client.group);
    return displaced === undefined ? {} : { displaced };
  }

  delete(m: M): boolean {
    return this.trusted.delete(m) || this.anon.delete(m);
  }
}
