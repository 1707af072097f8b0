// D's side of the peer table (peers.ts resolve/dial) over a real side channel on loopback: the
// P side is another PeerTable behind a real SideChannelServer, or a handler that answers what
// the test wants. What D installs, what it caches and for how long, one handshake for many
// callers, the key it keeps across a re-handshake, each refusal of a bad answer by name, and the
// rest of the table's bookkeeping (drop, abandon, expire, send) with the manual clock.
import * as net from "node:net";

import { create } from "@bufbuild/protobuf";
import { pino } from "pino";
import { afterAll, afterEach, describe, expect, it } from "vitest";

import {
  HandshakeResponseSchema,
  Role,
  type AgentMetadata,
  type HandshakeRequest,
  type HandshakeResponse,
} from "../../src/gen/kvxfer/v1/peer_pb.js";
import type { Notification } from "../../src/native/index.js";
import {
  agentName,
  encodePeerMessage,
  newMacKey,
  openPeerMessage,
  sealPeerMessage,
  type PeerBody,
} from "../../src/peer/messages.js";
import { SideChannelServer, refusal, type PeerCredentials } from "../../src/peer/side-channel.js";
import { kvLayoutToProto } from "../../src/plan/layout-proto.js";
import type { PeerState } from "../../src/peer/peer-state.js";
import { MAX_PEERS, PEER_EVICTION_SCAN } from "../../src/peer/peer-table.js";
import { Pki } from "../../sim/pki.js";
import { PeerTableWorld, SMALL, peerMetadata, smallTp } from "./fakes.js";
import { credentials } from "./multiprocess/rogue-peer.js";

const servers: SideChannelServer[] = [];
afterEach(async () => {
  await Promise.all(servers.splice(0).map((s) => s.close()));
});

/** A side channel on a free loopback port answering with `handler` (TLS with `creds`). */
async function serve(
  handler: (req: HandshakeRequest, identity: string | undefined) => HandshakeResponse,
  creds?: PeerCredentials,
): Promise<string> {
  const s = new SideChannelServer(handler, pino({ level: "silent" }), undefined, creds);
  servers.push(s);
  return s.bind("127.0.0.1:0");
}

/** `engineId` at `epoch` introduces itself to `w`'s table, as D does to P over the side channel. */
function introduce(
  w: PeerTableWorld,
  engineId: string,
  epoch: bigint,
  o: { key?: Uint8Array; identity?: string; metadata?: AgentMetadata } = {},
): HandshakeResponse {
  return w.table.onHandshake(
    {
      metadata: o.metadata ?? peerMetadata(engineId, epoch),
      macKey: o.key ?? new Uint8Array(32),
    } as HandshakeRequest,
    o.identity,
  );
}

/** P (a prefill peer table) behind a real side channel, and D (a decode one) dialling it. */
async function pair() {
  const p = new PeerTableWorld({ engineId: "p0", role: "prefill" });
  const d = new PeerTableWorld({ engineId: "d0", role: "decode" });
  const requests: HandshakeRequest[] = [];
  const address = await serve((req) => {
    requests.push(req);
    return p.table.onHandshake(req, undefined);
  });
  return { p, d, address, requests };
}

/** `from`'s last notification as its agent `sender` sends it, for `to` to verify. */
function lastNote(from: PeerTableWorld, sender: string): Notification {
  return {
    peer: agentName(sender, PeerTableWorld.EPOCH, 0),
    data: from.agent.notified.at(-1)!,
  } as Notification;
}

function peerOf(w: PeerTableWorld, engineId: string): PeerState {
  return (w.table as unknown as { peers: Map<string, PeerState> }).peers.get(engineId)!;
}

describe("D resolves P over the side channel", () => {
  it("installs P at its epoch and both sides accept each other's sealed notifications", async () => {
    const { p, d, address, requests } = await pair();
    const peer = await d.table.resolve(address);
    expect([peer.engineId, peer.epoch, peer.state, peer.dialedAddress]).toEqual([
      "p0",
      PeerTableWorld.EPOCH,
      "connected",
      address,
    ]);
    expect(requests).toHaveLength(1);
    expect(requests[0]!.expectedEpoch).toBe(0n);
    expect(requests[0]!.metadata?.engineId).toBe("d0");
    expect(d.events).toEqual(["PEER_UP p0"]);
    expect(p.events).toEqual(["PEER_UP d0"]);
    // The sides hear of a peer D dialed (its new epoch ends the old one's drains), not of one
    // that dialed P: a handshake to us could claim any engine without credentials.
    expect(d.ups).toEqual([{ peer: "p0", epoch: PeerTableWorld.EPOCH }]);
    expect(p.ups).toEqual([]);

    d.table.send(peer, { case: "heartbeat", value: { transferIds: ["t1"] } });
    const atP = p.table.verify(lastNote(d, "d0"));
    expect(atP?.peer.engineId).toBe("d0");
    expect(atP?.body).toEqual({
      case: "heartbeat",
      value: expect.objectContaining({ transferIds: ["t1"] }),
    });
    p.table.send(peerOf(p, "d0"), { case: "heartbeat", value: { transferIds: ["t2"] } });
    expect(d.table.verify(lastNote(p, "p0"))?.peer).toBe(peer);
    expect(p.errors).toEqual([]);
    expect(d.errors).toEqual([]);
  });

  it("uses the cached peer for less than two heartbeats since it was last heard; then handshakes again, keeping its key", async () => {
    const { p, d, address, requests } = await pair();
    const peer = await d.table.resolve(address);
    const key = peer.sendKey;
    d.clock.advance(1999); // heartbeatMs is 1000
    expect(await d.table.resolve(address)).toBe(peer);
    expect(requests).toHaveLength(1);
    d.clock.advance(1);
    const again = await d.table.resolve(address);
    expect(requests).toHaveLength(2);
    expect(requests[1]!.expectedEpoch).toBe(PeerTableWorld.EPOCH);
    expect(again).toBe(peer);
    expect(d.ups, "the same peer again: nothing new for the sides").toHaveLength(1);
    expect(again.sendKey).toBe(key);
    expect(Buffer.from(requests[1]!.macKey)).toEqual(Buffer.from(key));
    // A notification sealed before the re-handshake is still accepted by P.
    expect(p.table.verify(lastNoteSealed(d, peer))).toBeDefined();
  });

  it("a P dialed at a second address while D holds it at the first: a new key, so a new session on both sides (each drops its old state, whose endpoints the other has left)", async () => {
    const { p, d, address, requests } = await pair();
    const first = await d.table.resolve(address);
    const second = await serve((req) => {
      requests.push(req);
      return p.table.onHandshake(req, undefined);
    });
    const again = await d.table.resolve(second);
    expect(requests).toHaveLength(2);
    expect(Buffer.from(requests[1]!.macKey)).not.toEqual(Buffer.from(requests[0]!.macKey));
    expect(again).not.toBe(first);
    expect([first.state, again.state]).toEqual(["failed", "connected"]);
    expect(d.events).toEqual(["PEER_UP p0", "PEER_DOWN p0", "PEER_UP p0"]);
    expect(p.events).toEqual(["PEER_UP d0", "PEER_DOWN d0", "PEER_UP d0"]);
    // The new session's notifications get through both ways.
    d.table.send(again, { case: "heartbeat", value: { transferIds: ["t1"] } });
    expect(p.table.verify(lastNote(d, "d0"))?.peer.engineId).toBe("d0");
    p.table.send(peerOf(p, "d0"), { case: "heartbeat", value: { transferIds: ["t2"] } });
    expect(d.table.verify(lastNote(p, "p0"))?.peer).toBe(again);
  });

  it("heartbeats go on after the last transfer (the keepalive): a quiet peer is still fresh and needs no handshake", async () => {
    const { p, d, address, requests } = await pair();
    const peer = await d.table.resolve(address);
    const dAtP = peerOf(p, "d0");
    // Both sides keep the other alive at once (P: D handshook; D: it resolved P).
    expect(p.table.keptAlive(p.clock.now())).toEqual([dAtP]);
    expect(d.table.keptAlive(d.clock.now())).toEqual([peer]);
    // No transfer for 2.5 s, but P's heartbeat arrived in between: D uses its cached peer.
    p.clock.advance(1500);
    d.clock.advance(1500);
    p.table.send(dAtP, { case: "heartbeat", value: { transferIds: [] } });
    expect(d.table.verify(lastNote(p, "p0"))?.peer).toBe(peer);
    d.clock.advance(1000);
    expect(await d.table.resolve(address)).toBe(peer);
    expect(requests).toHaveLength(1);
    // A heartbeat is not a use: 30 s after D's last message P stops (peerKeepaliveMs is 30000).
    p.clock.advance(28_499);
    d.table.send(peer, { case: "heartbeat", value: { transferIds: [] } });
    expect(p.table.verify(lastNote(d, "d0"))?.peer).toBe(dAtP);
    expect(p.table.keptAlive(p.clock.now())).toEqual([dAtP]);
    p.clock.advance(1);
    expect(p.table.keptAlive(p.clock.now())).toEqual([]);
    // Any other message is: D's next transfer keeps it alive again.
    d.table.send(peer, { case: "readDone", value: { transferId: "t1", bytes: 1n, token: "k" } });
    expect(p.table.verify(lastNote(d, "d0"))?.peer).toBe(dAtP);
    expect(p.table.keptAlive(p.clock.now())).toEqual([dAtP]);
    // A peer silent past the peer timeout gets no more, used or not.
    p.clock.advance(5000);
    expect(p.table.keptAlive(p.clock.now())).toEqual([]);
    expect(p.errors).toEqual([]);
    expect(d.errors).toEqual([]);
  });

  it("one handshake serves every caller waiting for it; the next one dials again", async () => {
    const { d, address, requests } = await pair();
    const [a, b, c] = await Promise.all([
      d.table.resolve(address),
      d.table.resolve(address),
      d.table.resolve(address),
    ]);
    expect(requests).toHaveLength(1);
    expect(b).toBe(a);
    expect(c).toBe(a);
    d.table.drop(a, "test");
    const fresh = await d.table.resolve(address);
    expect(requests).toHaveLength(2);
    expect(fresh).not.toBe(a);
    // A peer that failed gets a new key: what was sealed for the old one is not valid for it.
    expect(Buffer.from(fresh.sendKey)).not.toEqual(Buffer.from(a.sendKey));
    expect(requests[1]!.expectedEpoch).toBe(0n);
  });

  it("a forgotten idle peer is dialled again; one still live is not forgotten", async () => {
    const { d, address, requests } = await pair();
    const peer = await d.table.resolve(address);
    d.live = false;
    d.clock.advance(60_001); // past peerTimeoutMs and tombstoneMs
    d.table.expire(d.clock.now());
    expect(d.table.list()).toEqual([]);
    expect(peer.state).toBe("connected"); // forgotten, not failed: no PEER_DOWN
    expect(d.events).toEqual(["PEER_UP p0"]);
    const again = await d.table.resolve(address);
    expect(requests).toHaveLength(2);
    expect(again).not.toBe(peer);
    expect(d.table.list().map((x) => [x.engineId, x.sideChannel, x.state])).toEqual([
      ["p0", "127.0.0.1:2", "connected"],
    ]);
  });

  it("a failed re-handshake leaves a peer heard from within the peer timeout in use; past it, the failure is the caller's", async () => {
    const { d, address, requests } = await pair();
    const peer = await d.table.resolve(address);
    await Promise.all(servers.splice(0).map((s) => s.close())); // P's side channel is gone
    d.clock.advance(3000); // stale for the cache (2 heartbeats), within the peer timeout (5 s)
    expect(await d.table.resolve(address)).toBe(peer);
    expect(requests).toHaveLength(1);
    d.clock.advance(2000); // now past the peer timeout
    await expect(d.table.resolve(address)).rejects.toMatchObject({ code: "ERR_UNREACHABLE" });
    // A peer dropped meanwhile is not used either.
    d.clock.advance(-5000);
    d.table.drop(peer, "test");
    await expect(d.table.resolve(address)).rejects.toMatchObject({ code: "ERR_UNREACHABLE" });
  });

  it("a handshake whose connection is cut before any answer is tried again within the timeout (a busy side channel displaces connections); a refused connection is not", async () => {
    const { d, address, requests } = await pair();
    const [host, port] = [address.split(":")[0]!, Number(address.split(":")[1])];
    // A front that cuts the first two connections at once and passes the next ones through.
    let seen = 0;
    const front = net.createServer((sock) => {
      if (++seen <= 2) return void sock.destroy();
      const up = net.connect({ host, port });
      sock.pipe(up).pipe(sock);
      up.on("error", () => sock.destroy());
      sock.on("error", () => up.destroy());
    });
    await new Promise<void>((r) => front.listen(0, "127.0.0.1", () => r()));
    const via = `127.0.0.1:${(front.address() as net.AddressInfo).port}`;
    try {
      const peer = await d.table.resolve(via);
      expect(peer.engineId).toBe("p0");
      expect(seen).toBe(3);
      expect(requests).toHaveLength(1);
    } finally {
      await new Promise<void>((r) => front.close(() => r()));
    }
    // Nobody listening: refused at once, not retried for the whole timeout.
    const gone = net.createServer();
    await new Promise<void>((r) => gone.listen(0, "127.0.0.1", () => r()));
    const nobody = `127.0.0.1:${(gone.address() as net.AddressInfo).port}`;
    await new Promise<void>((r) => gone.close(() => r()));
    const t0 = Date.now();
    await expect(d.table.resolve(nobody)).rejects.toMatchObject({ code: "ERR_UNREACHABLE" });
    expect(Date.now() - t0).toBeLessThan(500);
  });

  it("P being full refuses with its own code, and D installs nothing", async () => {
    const p = new PeerTableWorld({ engineId: "p0", notAccepting: true });
    const d = new PeerTableWorld({ engineId: "d0", role: "decode" });
    const address = await serve((req) => p.table.onHandshake(req, undefined));
    await expect(d.table.resolve(address)).rejects.toMatchObject({
      code: "ERR_NOT_READY",
      message: `handshake with ${address} refused: not yet`,
    });
    expect(d.table.list()).toEqual([]);
    expect(d.events).toEqual([]);
    expect(p.errors).toEqual(["handshake refused: ERR_NOT_READY: not yet"]);
  });

  it("a layout D cannot pair with is refused on D's side too", async () => {
    const d = new PeerTableWorld({ engineId: "d0", role: "decode" });
    const address = await serve(() =>
      create(HandshakeResponseSchema, {
        metadata: peerMetadata("p0", 3n, smallTp(1, 32)),
        macKey: new Uint8Array(32),
      }),
    );
    const err = await d.table.resolve(address).catch((e: unknown) => e);
    expect(err).toMatchObject({ code: "ERR_LAYOUT_INCOMPATIBLE" });
    expect((err as Error).message).toMatch(/^[A-Za-z_.]+: \S/);
    expect(d.table.list()).toEqual([]);
  });
});

/** D's last sealed notification to `peer`, sent now. */
function lastNoteSealed(d: PeerTableWorld, peer: PeerState): Notification {
  d.table.send(peer, { case: "heartbeat", value: { transferIds: ["t9"] } });
  return lastNote(d, "d0");
}

describe("D refuses a bad handshake answer, naming what was wrong", () => {
  const good = () => peerMetadata("p0", 3n);
  const cases: [string, () => HandshakeResponse, string, string][] = [
    [
      "no metadata",
      () => create(HandshakeResponseSchema, { macKey: new Uint8Array(32) }),
      "ERR_MALFORMED",
      "handshake carries no metadata",
    ],
    [
      "a bad engine id",
      () => {
        const md = good();
        md.engineId = "p 0";
        return create(HandshakeResponseSchema, { metadata: md, macKey: new Uint8Array(32) });
      },
      "ERR_MALFORMED",
      "metadata.engine_id",
    ],
    [
      "epoch 0",
      () =>
        create(HandshakeResponseSchema, {
          metadata: peerMetadata("p0", 0n),
          macKey: new Uint8Array(32),
        }),
      "ERR_MALFORMED",
      "metadata.epoch is 0",
    ],
    [
      "no layout",
      () => {
        const md = good();
        md.layout = undefined;
        return create(HandshakeResponseSchema, { metadata: md, macKey: new Uint8Array(32) });
      },
      "ERR_MALFORMED",
      "metadata.layout is missing",
    ],
    [
      "an invalid layout",
      () => {
        const md = good();
        md.layout = kvLayoutToProto({ ...SMALL, blockSize: 0 });
        return create(HandshakeResponseSchema, { metadata: md, macKey: new Uint8Array(32) });
      },
      "ERR_LAYOUT_INVALID",
      "",
    ],
    [
      "fewer ranks than tp_size",
      () => {
        const md = good();
        md.ranks = [];
        return create(HandshakeResponseSchema, { metadata: md, macKey: new Uint8Array(32) });
      },
      "ERR_MALFORMED",
      "metadata has 0 ranks for tp_size 1",
    ],
    [
      "a rank numbered out of range",
      () => {
        const md = good();
        md.ranks[0]!.rank = 1;
        return create(HandshakeResponseSchema, { metadata: md, macKey: new Uint8Array(32) });
      },
      "ERR_MALFORMED",
      "metadata has no rank 0",
    ],
    [
      "a key missing for a region",
      () => {
        const md = good();
        md.ranks[0]!.remoteKeys.pop();
        return create(HandshakeResponseSchema, { metadata: md, macKey: new Uint8Array(32) });
      },
      "ERR_MALFORMED",
      `rank 0 has ${SMALL.regionBytes.length - 1} keys for ${SMALL.regionBytes.length} regions`,
    ],
    [
      "a short mac key",
      () => create(HandshakeResponseSchema, { metadata: good(), macKey: new Uint8Array(31) }),
      "ERR_MALFORMED",
      "has no mac_key",
    ],
    [
      "a refusal",
      () => refusal("ERR_DRAINING", "going away"),
      "ERR_DRAINING",
      "refused: going away",
    ],
  ];
  for (const [what, answer, code, text] of cases) {
    it(what, async () => {
      const d = new PeerTableWorld({ engineId: "d0", role: "decode" });
      const address = await serve(answer);
      const err = (await d.table.resolve(address).catch((e: unknown) => e)) as {
        code: string;
        message: string;
      };
      expect(err.code).toBe(code);
      expect(err.message).toContain(text);
      expect(d.table.list()).toEqual([]);
      expect(d.events).toEqual([]);
    });
  }
});

describe("dropping a peer", () => {
  it("tells the sides once; an old peer dropped again after its replacement changes nothing", () => {
    const w = new PeerTableWorld();
    introduce(w, "d0", 7n);
    const old = peerOf(w, "d0");
    introduce(w, "d0", 8n);
    expect(w.downs).toHaveLength(1);
    w.table.drop(old, "again");
    expect(w.downs).toHaveLength(1);
    expect(w.events).toEqual(["PEER_UP d0", "PEER_DOWN d0", "PEER_UP d0"]);
    expect(w.table.list().map((p) => p.epoch)).toEqual([8n]);
    // The current one, dropped, goes.
    w.table.drop(peerOf(w, "d0"), "gone");
    expect(w.downs.map((x) => [x.epoch, x.why])).toEqual([
      [7n, "peer restarted (new epoch)"],
      [8n, "gone"],
    ]);
    expect(w.table.list()).toEqual([]);
  });

  it("a peer failed at the same epoch that handshakes again is replaced, not reused", () => {
    const w = new PeerTableWorld();
    introduce(w, "d0", 7n);
    const first = peerOf(w, "d0");
    first.markFailed();
    introduce(w, "d0", 7n);
    expect(peerOf(w, "d0")).not.toBe(first);
    expect(w.downs).toEqual([{ peer: "d0", epoch: 7n, why: "peer failed" }]);
  });

  it("gives up reads and writes still in flight to it after the abort grace, not before", () => {
    const w = new PeerTableWorld();
    introduce(w, "d0", 7n);
    const peer = peerOf(w, "d0");
    peer.endpoint(0, 0);
    w.busy = true;
    w.table.drop(peer, "silent");
    w.clock.advance(199); // abortGraceMs is 200
    expect(w.agent.abandoned).toBe(0);
    w.clock.advance(1);
    // The data endpoint and the control endpoint (made with the peer).
    expect(w.agent.abandoned).toBe(2);
  });

  it("abandons nothing when nothing is in flight, or when the table has closed meanwhile", () => {
    const idle = new PeerTableWorld();
    const closing = new PeerTableWorld();
    for (const w of [idle, closing]) {
      introduce(w, "d0", 7n);
      peerOf(w, "d0").endpoint(0, 0);
    }
    idle.busy = false;
    idle.table.drop(peerOf(idle, "d0"), "silent");
    closing.busy = true;
    closing.table.drop(peerOf(closing, "d0"), "silent");
    closing.table.close();
    idle.clock.advance(1000);
    closing.clock.advance(1000);
    expect([idle.agent.abandoned, closing.agent.abandoned]).toEqual([0, 0]);
  });

  it("an endpoint no peer owns drops nobody", () => {
    const w = new PeerTableWorld();
    introduce(w, "d0", 7n);
    peerOf(w, "d0").endpoint(0, 0);
    const stranger = w.agent.connect() as Parameters<typeof w.table.endpointFailed>[0];
    w.table.endpointFailed(stranger, "UCS_ERR_CONNECTION_RESET");
    expect(w.downs).toEqual([]);
    expect(w.table.list()).toHaveLength(1);
  });
});

describe("sending to a peer", () => {
  function connected() {
    const w = new PeerTableWorld();
    introduce(w, "d0", 7n);
    return { w, peer: peerOf(w, "d0") };
  }
  const hb: PeerBody = { case: "heartbeat", value: { transferIds: ["t"] } };

  it("numbers each notification, names both epochs and seals it with the peer's key", () => {
    const { w, peer } = connected();
    w.table.send(peer, hb);
    w.table.send(peer, hb);
    const opened = w.agent.notified.map((n) => openPeerMessage(n));
    expect(opened.map((m) => [m.seq, m.senderEngineId, m.senderEpoch, m.receiverEpoch])).toEqual([
      [1n, "p0", PeerTableWorld.EPOCH, 7n],
      [2n, "p0", PeerTableWorld.EPOCH, 7n],
    ]);
    expect(opened.every((m) => m.verify(peer.sendKey))).toBe(true);
    expect(opened[0]!.verify(new Uint8Array(32))).toBe(false);
  });

  it("sends nothing to a failed peer, or once the agents are gone", () => {
    const { w, peer } = connected();
    w.registered = false;
    w.table.send(peer, hb);
    w.registered = true;
    peer.markFailed();
    w.table.send(peer, hb);
    expect(w.agent.notified).toEqual([]);
    expect(peer.sendSeq).toBe(0n);
  });

  it("a notification that fails, by rejecting or by throwing, is logged and costs nothing else", async () => {
    const { w, peer } = connected();
    w.agent.notifyFails = "reject";
    w.table.send(peer, hb);
    w.agent.notifyFails = "throw";
    expect(() => w.table.send(peer, hb)).not.toThrow();
    await new Promise((r) => setImmediate(r));
    expect(peer.state).toBe("connected");
    expect(w.downs).toEqual([]);
  });
});

describe("the peer table's words and edges", () => {
  it("each side's metadata names its role; PEER_UP names the epoch", async () => {
    const { p, d, address, requests } = await pair();
    const peer = await d.table.resolve(address);
    expect(requests[0]!.metadata?.role).toBe(Role.DECODE);
    expect(peer.metadata.role).toBe(Role.PREFILL);
    expect(p.reasons).toEqual([`PEER_UP d0: epoch ${PeerTableWorld.EPOCH}`]);
    const both = new PeerTableWorld({ engineId: "b0", role: "both" });
    const addr2 = await serve((req) => both.table.onHandshake(req, undefined));
    expect((await d.table.resolve(addr2)).metadata.role).toBe(Role.BOTH);
  });

  it("refusals of a handshake say what was wrong", () => {
    const w = new PeerTableWorld({ authenticated: true });
    const say = (res: HandshakeResponse) => `${res.errorCode}: ${res.error}`;
    expect(say(introduce(w, "d0", 7n, { identity: "d9" }))).toBe(
      "ERR_UNAUTHENTICATED: metadata claims engine 'd0' but the certificate names 'd9'",
    );
    expect(say(introduce(w, "d0", 7n))).toBe(
      "ERR_UNAUTHENTICATED: metadata claims engine 'd0' but the certificate names ''",
    );
    expect(say(introduce(w, "d0", 7n, { key: new Uint8Array(8), identity: "d0" }))).toBe(
      "ERR_MALFORMED: mac_key must be 32 bytes",
    );
    expect(
      say(
        introduce(w, "d0", 7n, {
          metadata: peerMetadata("d0", 7n, smallTp(1, 32)),
          identity: "d0",
        }),
      ),
    ).toMatch(/^ERR_LAYOUT_INCOMPATIBLE: [a-zA-Z_.]+: .+/);
  });

  it("the peer cap's refusal names the cap", () => {
    const w = new PeerTableWorld();
    for (let i = 0; i < MAX_PEERS; i++) introduce(w, `d${i}`, 7n);
    const res = introduce(w, "more", 7n);
    expect(`${res.errorCode}: ${res.error}`).toBe(
      `ERR_OVERLOADED: ${MAX_PEERS} peers known, none idle among the ${PEER_EVICTION_SCAN} least recent; refusing another`,
    );
  });

  it("a re-handshake with the same key keeps the replay window: a message seen before is still a replay", () => {
    const w = new PeerTableWorld();
    const key = newMacKey();
    introduce(w, "d0", 7n, { key });
    const note = (seq: bigint): Notification =>
      ({
        peer: agentName("d0", 7n, 0),
        data: sealPeerMessage(
          key,
          encodePeerMessage("d0", 7n, PeerTableWorld.EPOCH, { case: "heartbeat", value: {} }, seq),
        ),
      }) as Notification;
    expect(w.table.verify(note(1n))).toBeDefined();
    introduce(w, "d0", 7n, { key });
    expect(w.table.verify(note(1n))).toBeUndefined();
    expect(w.errors.at(-1)).toBe("peer message from 'd0' refused: ERR_REPLAY (sequence 1 seen)");
  });

  it("a message from an agent of another epoch of the sender is stale; a garbage sender name is cut short", () => {
    const w = new PeerTableWorld();
    const key = newMacKey();
    introduce(w, "d0", 7n, { key });
    const data = sealPeerMessage(
      key,
      encodePeerMessage("d0", 7n, PeerTableWorld.EPOCH, { case: "heartbeat", value: {} }, 1n),
    );
    expect(w.table.verify({ peer: agentName("d0", 6n, 0), data } as Notification)).toBeUndefined();
    expect(w.errors.at(-1)).toBe("peer message from 'd0' (epoch 7) refused: ERR_STALE_EPOCH");
    const long = "x".repeat(1000);
    expect(
      w.table.verify({ peer: long, data: new Uint8Array([1, 2, 3]) } as Notification),
    ).toBeUndefined();
    expect(w.errors.at(-1)).toBe(`peer message from '${"x".repeat(200)}' refused: ERR_MALFORMED`);
    // The right agent still gets through.
    expect(w.table.verify({ peer: agentName("d0", 7n, 0), data } as Notification)).toBeDefined();
  });

  it("endpoints go to the named rank's worker with the table's error mode; remotes import that rank's key; dropping closes them", () => {
    const w = new PeerTableWorld({ layout: smallTp(2) });
    const md = peerMetadata("d0", 7n, smallTp(2));
    md.ranks[1]!.remoteKeys = md.ranks[1]!.remoteKeys.map((_, i) => new Uint8Array([7, i]));
    introduce(w, "d0", 7n, { metadata: md });
    const peer = peerOf(w, "d0");
    peer.remote(0, 1, 1);
    expect(w.agent.connects).toEqual([
      // The control endpoint, made with the peer, to rank 0; then rank 1's data endpoint.
      { address: new Uint8Array([9, 0]), options: { errorMode: "none" } },
      { address: new Uint8Array([9, 1]), options: { errorMode: "none" } },
    ]);
    expect(w.agent.imported).toEqual([new Uint8Array([7, 1])]);
    w.table.drop(peer, "gone");
    expect(w.agent.closed).toBe(3); // the remote and both endpoints
  });

  it("an idle peer is forgotten only past the tombstone time, and its address with it", async () => {
    const { d, address } = await pair();
    await d.table.resolve(address);
    d.live = false;
    const byAddress = (d.table as unknown as { byAddress: Map<string, string> }).byAddress;
    expect(byAddress.size).toBe(1);
    d.clock.advance(60_000); // tombstoneMs
    d.table.expire(d.clock.now());
    expect(d.table.list()).toHaveLength(1);
    d.clock.advance(1);
    d.table.expire(d.clock.now());
    expect(d.table.list()).toEqual([]);
    expect(byAddress.size, "no entry left behind (invariant 5)").toBe(0);
  });
});

describe("D's side of an authenticated handshake", () => {
  const pki = new Pki("peer-dial test CA");
  afterAll(() => pki.close());
  const creds = (id: string): PeerCredentials => credentials(pki, id);
  /** P's table answering behind a TLS side channel whose certificate names `certId`. */
  async function tlsP(certId: string) {
    const p = new PeerTableWorld({ engineId: "p0", authenticated: true });
    const address = await serve(
      (req, identity) => p.table.onHandshake(req, identity),
      creds(certId),
    );
    return { p, address };
  }

  it("a P whose certificate names the engine its metadata claims is installed", async () => {
    const { p, address } = await tlsP("p0");
    const d = new PeerTableWorld({ engineId: "d0", role: "decode", peerCredentials: creds("d0") });
    expect((await d.table.resolve(address)).engineId).toBe("p0");
    expect(p.events).toEqual(["PEER_UP d0"]);
  });

  it("a P claiming an engine its certificate does not name is refused ERR_UNAUTHENTICATED", async () => {
    const { address } = await tlsP("p-evil");
    const d = new PeerTableWorld({ engineId: "d0", role: "decode", peerCredentials: creds("d0") });
    const err = (await d.table.resolve(address).catch((e: unknown) => e)) as {
      code: string;
      message: string;
    };
    expect(err.code).toBe("ERR_UNAUTHENTICATED");
    expect(err.message).toBe(`${address} claims engine 'p0' but its certificate names 'p-evil'`);
    expect(d.table.list()).toEqual([]);
  });
});
