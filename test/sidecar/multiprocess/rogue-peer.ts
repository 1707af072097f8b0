// A peer this test process plays itself: its own UCX agent and buffers, a handshake with a real
// sidecar (with or without credentials, claiming whatever it likes), and notifications it seals,
// forges and replays at will. Used by the bad-input and security tests.
import { readFileSync } from "node:fs";

import { create } from "@bufbuild/protobuf";

import {
  AgentMetadataSchema,
  HandshakeRequestSchema,
  RankMetadataSchema,
  Role,
  type HandshakeResponse,
} from "../../../src/gen/kvxfer/v1/peer_pb.js";
import { Agent, type Endpoint, type Region } from "../../../src/native/index.js";
import {
  agentName,
  encodePeerMessage,
  newMacKey,
  openPeerMessage,
  sealPeerMessage,
  type ParsedPeerMessage,
  type PeerBody,
} from "../../../src/peer/messages.js";
import { handshake, type PeerCredentials } from "../../../src/peer/side-channel.js";
import type { KvLayout } from "../../../src/plan/index.js";
import { kvLayoutToProto } from "../../../src/plan/layout-proto.js";
import type { Pki } from "../../../sim/pki.js";

/** The credentials `pki` issues for `engineId`, read into memory. */
export function credentials(pki: Pki, engineId: string): PeerCredentials {
  const f = pki.issue(engineId);
  return { cert: readFileSync(f.cert), key: readFileSync(f.key), ca: readFileSync(f.ca) };
}

export class RoguePeer {
  readonly agent: Agent;
  readonly regions: Region[] = [];
  /** Notifications it received, opened and checked against the key the sidecar gave it. */
  readonly received: ParsedPeerMessage[] = [];
  /** Notifications whose MAC did not check (should never happen from a real sidecar). */
  badMacs = 0;
  readonly macKey = newMacKey();
  seq = 0n;
  private peerKey: Uint8Array = new Uint8Array(0);
  private ep: Endpoint | undefined;
  peerEpoch = 0n;

  /** `agentAs`: the name its agent gives itself (default its own identity, rank 0). */
  constructor(
    readonly engineId: string,
    readonly epoch: bigint,
    readonly layout: KvLayout,
    agentAs = agentName(engineId, epoch, 0),
  ) {
    this.agent = new Agent({ name: agentAs, transports: "shm,self" });
    this.agent.on("notifications", (batch) => {
      for (const n of batch) {
        try {
          const m = openPeerMessage(n.data);
          if (m.verify(this.peerKey)) this.received.push(m);
          else this.badMacs++;
        } catch {
          // not ours to judge here
        }
      }
    });
    for (const bytes of layout.regionBytes)
      this.regions.push(this.agent.registerMemory(Buffer.alloc(bytes)));
  }

  /**
   * Handshakes with the sidecar at `address`, claiming `claim` (default its own identity);
   * on success keeps the sidecar's key and connects to its rank 0 agent.
   */
  async handshake(
    address: string,
    o: { creds?: PeerCredentials; claim?: { engineId: string; epoch: bigint }; timeoutMs?: number },
  ): Promise<HandshakeResponse> {
    const claim = o.claim ?? { engineId: this.engineId, epoch: this.epoch };
    const { response } = await handshake(
      address,
      create(HandshakeRequestSchema, {
        metadata: create(AgentMetadataSchema, {
          engineId: claim.engineId,
          epoch: claim.epoch,
          role: Role.DECODE,
          layout: kvLayoutToProto(this.layout),
          ranks: [
            create(RankMetadataSchema, {
              rank: 0,
              workerAddress: this.agent.address,
              remoteKeys: this.regions.map((r) => r.remoteKey()),
            }),
          ],
        }),
        macKey: this.macKey,
      }),
      o.timeoutMs ?? 10_000,
      o.creds,
    );
    if (response.errorCode === "") {
      this.peerKey = response.macKey;
      this.peerEpoch = response.metadata!.epoch;
      this.ep = this.agent.connect(response.metadata!.ranks[0]!.workerAddress);
    }
    return response;
  }

  /**
   * A sealed notification: from `as` (default itself), numbered `seq` (default the next one),
   * sealed with `key` (default its own).
   */
  seal(
    body: PeerBody,
    o: {
      as?: { engineId: string; epoch: bigint };
      receiverEpoch?: bigint;
      seq?: bigint;
      key?: Uint8Array;
    } = {},
  ): Uint8Array {
    const as = o.as ?? { engineId: this.engineId, epoch: this.epoch };
    const seq = o.seq ?? ++this.seq;
    return sealPeerMessage(
      o.key ?? this.macKey,
      encodePeerMessage(as.engineId, as.epoch, o.receiverEpoch ?? this.peerEpoch, body, seq),
    );
  }

  send(bytes: Uint8Array): Promise<void> {
    if (this.ep === undefined) throw new Error("no handshake yet");
    return this.agent.notify(this.ep, bytes).then(() => undefined);
  }

  /** True when no byte of its buffers was ever written. */
  untouched(): boolean {
    return this.regions.every((r) => r.bytes().every((b) => b === 0));
  }

  close(): void {
    this.agent.close();
  }
}
