// The peer table in process (peers.ts): what a handshake installs, and which notifications get
// through to the sides: a stale epoch, a forged sender, a bad MAC or a replay is refused (and so
// never reaches a transfer), a restarted peer drops the old one (its transfers fail), and the
// peer cap holds. Keys, seals and epochs are the real ones; agents are fakes.
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { HandshakeRequestSchema } from "../../src/gen/kvxfer/v1/peer_pb.js";
import type { Notification } from "../../src/native/index.js";
import {
  agentName,
  encodePeerMessage,
  newMacKey,
  sealPeerMessage,
  type PeerBody,
} from "../../src/peer/messages.js";
import { KvGroupKind } from "../../src/gen/kvxfer/v1/layout_pb.js";
import type { GroupsPairing, KvGroup } from "../../src/plan/index.js";
import { kvGroupsToProto } from "../../src/plan/layout-proto.js";
import type { PeerState } from "../../src/peer/peer-state.js";
import {
  ActiveSenders,
  MAX_PEERS,
  STRANGERS_PER_SEC,
  messageCost,
} from "../../src/peer/peer-table.js";
import { FakeWorld, PeerTableWorld, SMALL, peerMetadata, smallTp } from "./fakes.js";

const OUR_EPOCH = PeerTableWorld.EPOCH;

function setup() {
  const world = new PeerTableWorld();
  const { table, clock, downs, errors, events } = world;
  /**
   * D introduces itself at `epoch`, with a fresh key (a new session) or the one it holds (a
   * re-handshake of a peer it still holds); returns the key it seals with.
   */
  const handshake = (engineId: string, epoch: bigint, macKey = newMacKey()) => {
    const res = table.onHandshake(
      create(HandshakeRequestSchema, { metadata: peerMetadata(engineId, epoch), macKey }),
      undefined,
    );
    return { res, macKey };
  };
  /** A notification as it arrives at our agent. */
  const note = (
    key: Uint8Array,
    o: { sender: string; epoch: bigint; to?: bigint; seq: bigint; agent?: string },
  ): Notification => {
    const body: PeerBody = { case: "heartbeat", value: { transferIds: ["t1"] } };
    return {
      peer: o.agent ?? agentName(o.sender, o.epoch, 0),
      data: sealPeerMessage(
        key,
        encodePeerMessage(o.sender, o.epoch, o.to ?? OUR_EPOCH, body, o.seq),
      ),
    } as Notification;
  };
  return {
    table,
    clock,
    downs,
    errors,
    events,
    handshake,
    note,
    setLive: (v: boolean) => (world.live = v),
  };
}

describe("PeerTable", () => {
  it("a handshake installs the peer; its sealed notifications get through once, in any order", () => {
    const { table, handshake, note, errors, events } = setup();
    const { res, macKey } = handshake("d0", 7n);
    expect(res.errorCode).toBe("");
    expect(res.metadata?.engineId).toBe("p0");
    expect(events).toEqual(["PEER_UP d0"]);
    const v = table.verify(note(macKey, { sender: "d0", epoch: 7n, seq: 2n }));
    expect(v?.peer.engineId).toBe("d0");
    expect(v?.body.case).toBe("heartbeat");
    expect(table.verify(note(macKey, { sender: "d0", epoch: 7n, seq: 1n }))).toBeDefined();
    // The same sequence number again: a replay.
    expect(table.verify(note(macKey, { sender: "d0", epoch: 7n, seq: 2n }))).toBeUndefined();
    expect(errors.at(-1)).toContain("ERR_REPLAY");
  });

  it("a handshake pairs P's layout (ours) with D's for planning, before any transfer", () => {
    const { table, handshake, note } = setup();
    const { macKey } = handshake("d0", 7n);
    const peer = table.verify(note(macKey, { sender: "d0", epoch: 7n, seq: 1n }))!.peer;
    const made = (peer as unknown as { paired?: GroupsPairing }).paired;
    expect(made?.src[0]!.layout).toBe(SMALL); // our layout (the world's engine registered SMALL)
    expect(made?.dst).toBe(peer.groups);
    expect(peer.pairing(made!.src, peer.groups)).toBe(made);
  });

  it("a hybrid engine's metadata carries its groups; a peer's groups are checked, the bad field named", () => {
    const groups: KvGroup[] = [
      { kind: "full", layout: SMALL },
      { kind: "sliding", slidingWindow: 64, layout: SMALL },
    ];
    const world = new PeerTableWorld({ groups });
    const hs = (metadata: ReturnType<typeof peerMetadata>) =>
      world.table.onHandshake(
        create(HandshakeRequestSchema, { metadata, macKey: newMacKey() }),
        undefined,
      );
    // D's groups as they travel.
    const theirs = peerMetadata("d0", 7n);
    theirs.groups = kvGroupsToProto(groups);
    const ours = hs(theirs);
    expect(ours.errorCode).toBe("");
    expect(ours.metadata?.groups.map((g) => [g.kind, g.slidingWindow])).toEqual([
      [KvGroupKind.FULL, 0],
      [KvGroupKind.SLIDING, 64],
    ]);
    // A D of one full group cannot take a hybrid P's KV; a group of a kind nobody knows is
    // refused by its field.
    const single = hs(peerMetadata("d1", 7n));
    expect(single.errorCode).toBe("ERR_LAYOUT_INCOMPATIBLE");
    expect(single.error).toContain("groups");
    theirs.engineId = "d2";
    theirs.groups[1]!.kind = 9 as KvGroupKind;
    const bad = hs(theirs);
    expect(bad.errorCode).toBe("ERR_LAYOUT_INVALID");
    expect(bad.error).toContain("metadata.groups[1].kind");
    expect(world.events).toEqual(["PEER_UP d0"]);
  });

  it("a table given no notification budget admits every notification", () => {
    const { table, handshake, note } = setup();
    const { macKey } = handshake("d0", 7n);
    for (let i = 1; i <= 1000; i++) {
      const n = note(macKey, { sender: "d0", epoch: 7n, seq: BigInt(i) });
      expect(table.admit(n)).toBe(true);
      expect(table.verify(n)?.peer.engineId).toBe("d0");
    }
  });

  it("refuses what is stale or forged, whatever else it carries", () => {
    const { table, handshake, note, errors } = setup();
    const { macKey } = handshake("d0", 7n);
    const cases: [string, Notification, string][] = [
      [
        "names us at another epoch",
        note(macKey, { sender: "d0", epoch: 7n, to: OUR_EPOCH + 1n, seq: 1n }),
        "ERR_STALE_EPOCH",
      ],
      [
        "from another epoch of d0",
        note(macKey, { sender: "d0", epoch: 6n, seq: 2n }),
        "ERR_STALE_EPOCH",
      ],
      [
        "from an unknown engine",
        note(macKey, { sender: "x9", epoch: 7n, seq: 3n }),
        "ERR_STALE_EPOCH",
      ],
      [
        "from an agent not d0's",
        note(macKey, { sender: "d0", epoch: 7n, seq: 4n, agent: agentName("x9", 7n, 0) }),
        "ERR_STALE_EPOCH",
      ],
      [
        "sealed with another key",
        note(newMacKey(), { sender: "d0", epoch: 7n, seq: 5n }),
        "ERR_UNAUTHENTICATED",
      ],
      [
        "not a peer message at all",
        { peer: agentName("d0", 7n, 0), data: new Uint8Array([1, 2, 3]) } as Notification,
        "refused: ERR_",
      ],
    ];
    for (const [what, n, code] of cases) {
      const before = errors.length;
      expect(table.verify(n), what).toBeUndefined();
      expect(errors.length, what).toBe(before + 1);
      expect(errors.at(-1), what).toContain(code);
    }
    // None of them used up a sequence number: the real sender's next one gets through.
    expect(table.verify(note(macKey, { sender: "d0", epoch: 7n, seq: 1n }))).toBeDefined();
  });

  it("a restarted peer (new epoch) replaces the old one: the sides fail what it had, its old notifications are refused", () => {
    const { table, handshake, note, downs, events } = setup();
    const old = handshake("d0", 7n);
    handshake("d0", 8n);
    expect(downs).toEqual([{ peer: "d0", epoch: 7n, why: "peer restarted (new epoch)" }]);
    expect(events).toEqual(["PEER_UP d0", "PEER_DOWN d0", "PEER_UP d0"]);
    expect(table.verify(note(old.macKey, { sender: "d0", epoch: 7n, seq: 9n }))).toBeUndefined();
    expect(table.list().map((p) => [p.engineId, p.epoch, p.state])).toEqual([
      ["d0", 8n, "connected"],
    ]);
  });

  it("a peer silent past the peer timeout with live transfers is dropped; an idle one is forgotten later", () => {
    const { table, handshake, clock, downs, setLive } = setup();
    handshake("d0", 7n);
    handshake("d1", 7n);
    clock.advance(4999);
    table.expire(clock.now());
    expect(downs).toEqual([]);
    clock.advance(1);
    setLive(true);
    table.expire(clock.now());
    expect(downs.map((d) => d.peer).sort()).toEqual(["d0", "d1"]);
    expect(downs[0]!.why).toMatch(/^silent for 5000 ms$/);
    // Idle peers are not dropped; they are forgotten after the tombstone time.
    handshake("d2", 7n);
    setLive(false);
    clock.advance(5000);
    table.expire(clock.now());
    expect(table.list().map((p) => p.engineId)).toEqual(["d2"]);
    clock.advance(60_000);
    table.expire(clock.now());
    expect(table.list()).toEqual([]);
    expect(downs).toHaveLength(2);
  });

  it(`the peer cap: the ${MAX_PEERS + 1}th engine's handshake is refused ERR_OVERLOADED while every known peer is busy`, () => {
    const { table, handshake } = setup();
    for (let i = 0; i < MAX_PEERS; i++) expect(handshake(`d${i}`, 7n).res.errorCode).toBe("");
    const { res } = handshake("one-too-many", 7n);
    expect(res.errorCode).toBe("ERR_OVERLOADED");
    expect(table.list()).toHaveLength(MAX_PEERS);
    // A known peer re-handshaking at its epoch is not a new one.
    expect(handshake("d0", 7n).res.errorCode).toBe("");
  });

  it(`the peer cap: a new engine takes the place of the least recently handshaken idle peer (issue 48: more identities cannot lock a new peer out)`, () => {
    const world = new PeerTableWorld();
    const { table } = world;
    // Each D keeps its key when it handshakes again (the same session).
    const keys = new Map<string, Uint8Array>();
    const hs = (engineId: string) =>
      table.onHandshake(
        create(HandshakeRequestSchema, {
          metadata: peerMetadata(engineId, 7n),
          macKey: keys.get(engineId) ?? keys.set(engineId, newMacKey()).get(engineId)!,
        }),
        undefined,
      );
    for (let i = 0; i < MAX_PEERS; i++) expect(hs(`d${i}`).errorCode).toBe("");
    world.live = false;
    // d0 handshakes again: it is now the most recent; d1 is the least recent idle one.
    expect(hs("d0").errorCode).toBe("");
    expect(hs("newcomer").errorCode).toBe("");
    const ids = new Set(table.list().map((p) => p.engineId));
    expect(ids.size).toBe(MAX_PEERS);
    expect(ids.has("newcomer")).toBe(true);
    expect(ids.has("d0")).toBe(true);
    expect(ids.has("d1")).toBe(false);
    expect(world.events.filter((e) => e.startsWith("PEER_DOWN"))).toEqual([]); // forgotten, not failed
    // Reads or writes in flight keep a peer too.
    world.busy = true;
    expect(hs("another").errorCode).toBe("ERR_OVERLOADED");
  });

  it("a re-handshake with the key D holds keeps the session; a new key at the same epoch is a new session: the old one is dropped (its endpoints are stale), a new one made", () => {
    const { table, handshake, note, events } = setup();
    const { macKey } = handshake("d0", 7n);
    const first = table.verify(note(macKey, { sender: "d0", epoch: 7n, seq: 1n }))!.peer;
    // D still holds us (re-dialed after two quiet heartbeat periods): same key, same state.
    expect(handshake("d0", 7n, macKey).res.errorCode).toBe("");
    expect(table.verify(note(macKey, { sender: "d0", epoch: 7n, seq: 2n }))!.peer).toBe(first);
    expect(events).toEqual(["PEER_UP d0"]);
    // D dropped us (a partition) and dials again with a new key: our endpoints to it are stale.
    const fresh = handshake("d0", 7n).macKey;
    expect(events).toEqual(["PEER_UP d0", "PEER_DOWN d0", "PEER_UP d0"]);
    expect(first.state).toBe("failed");
    const second = table.verify(note(fresh, { sender: "d0", epoch: 7n, seq: 1n }))!.peer;
    expect(second).not.toBe(first);
    expect(second.state).toBe("connected");
  });

  it("issue 48: the sender's budget is charged before the MAC: past it, forged notifications cost a parse and a lookup, and are counted, not checked", () => {
    const world = new PeerTableWorld({ peerMessagesPerSec: 100 });
    const { table, errors, clock } = world;
    const macKey = newMacKey();
    expect(
      table.onHandshake(
        create(HandshakeRequestSchema, { metadata: peerMetadata("d0", 7n), macKey }),
        undefined,
      ).errorCode,
    ).toBe("");
    const forged = (seq: bigint): Notification =>
      ({
        peer: agentName("d0", 7n, 0),
        data: sealPeerMessage(
          newMacKey(), // not d0's key
          encodePeerMessage(
            "d0",
            7n,
            OUR_EPOCH,
            { case: "heartbeat", value: { transferIds: [] } },
            seq,
          ),
        ),
      }) as Notification;
    // admit() first (as the dispatch does), verify() only for what it admits.
    const check = (n: Notification) => (table.admit(n) ? table.verify(n) : undefined);
    for (let i = 1; i <= 5000; i++) expect(check(forged(BigInt(i)))).toBeUndefined();
    // The burst (two seconds' worth) was checked and refused (the first by name at once, the
    // others counted for the sweep's report); the rest only counted against the budget.
    expect(errors.filter((e) => e.includes("bad MAC"))).toHaveLength(1);
    expect(table.badMacReport()).toEqual([["d0", 199]]);
    expect(table.badMacReport()).toEqual([]);
    expect(table.overBudget()).toEqual([["d0", 4800]]);
    // The budget refills: d0's own notifications count again (a big one costs more).
    clock.advance(1000);
    const real = (seq: bigint, ids: string[]): Notification =>
      ({
        peer: agentName("d0", 7n, 0),
        data: sealPeerMessage(
          macKey,
          encodePeerMessage(
            "d0",
            7n,
            OUR_EPOCH,
            { case: "heartbeat", value: { transferIds: ids } },
            seq,
          ),
        ),
      }) as Notification;
    expect(check(real(9001n, ["t1"]))?.peer.engineId).toBe("d0");
    // A sender that is no peer shares a small allowance with every other such.
    const stranger = (i: number) =>
      ({ peer: agentName("nobody", 1n, 0), data: new Uint8Array(10 + i) }) as Notification;
    let strangers = 0;
    for (let i = 0; i < 1000; i++) if (table.admit(stranger(i))) strangers++;
    expect(strangers).toBe(2 * STRANGERS_PER_SEC);
    expect(table.admit({ peer: "garbage", data: new Uint8Array(1) } as Notification)).toBe(false);
    expect(table.overBudget()).toEqual([["", 801]]);
    expect(messageCost(100)).toBe(1);
    // The budget is every peer's together: a second sender halves each one's share.
    const s = new ActiveSenders();
    const [a, b] = [{ activeSecond: -1 }, { activeSecond: -1 }] as unknown as PeerState[];
    expect(s.note(a!, 1000)).toBe(1);
    expect(s.note(b!, 1500)).toBe(2);
    expect(s.note(a!, 2100)).toBe(2); // the second before still had two
    expect(s.note(a!, 3100)).toBe(1); // b silent for a whole second
    expect(s.note(b!, 9000)).toBe(1); // a gap: nobody before
    const c = new PeerTableWorld({ peerMessagesPerSec: 100 });
    const keys = ["e0", "e1"].map((id) => {
      const k = newMacKey();
      c.table.onHandshake(
        create(HandshakeRequestSchema, { metadata: peerMetadata(id, 7n), macKey: k }),
        undefined,
      );
      return k;
    });
    const from = (id: string, key: Uint8Array, seq: bigint): Notification =>
      ({
        peer: agentName(id, 7n, 0),
        data: sealPeerMessage(
          key,
          encodePeerMessage(
            id,
            7n,
            OUR_EPOCH,
            { case: "heartbeat", value: { transferIds: [] } },
            seq,
          ),
        ),
      }) as Notification;
    let passed = 0;
    for (let i = 1; i <= 300; i++) {
      if (c.table.admit(from("e0", keys[0]!, BigInt(i)))) passed++;
      if (c.table.admit(from("e1", keys[1]!, BigInt(i)))) passed++;
    }
    // Two peers, 100/s together (a burst of two seconds): about 200, not 400.
    expect(passed).toBeLessThanOrEqual(300);
    expect(passed).toBeGreaterThanOrEqual(150);
    expect(messageCost(4096 * 3)).toBe(4);
  });

  it("an endpoint failure drops the peer it leads to", () => {
    const { table, handshake, downs } = setup();
    handshake("d0", 7n);
    const peer = (table as unknown as { peers: Map<string, PeerState> }).peers.get("d0")!;
    const ep = peer.endpoint(0, 0);
    table.endpointFailed(ep, "UCS_ERR_ENDPOINT_TIMEOUT");
    expect(downs).toEqual([
      { peer: "d0", epoch: 7n, why: "endpoint failed: UCS_ERR_ENDPOINT_TIMEOUT" },
    ]);
    expect(table.list()).toEqual([]);
  });
});

describe("one peer's state", () => {
  it("accepts its current key and the one before (notifications sealed before a re-handshake), no older", () => {
    const w = new FakeWorld();
    const peer = w.peer("p0");
    const k = (b: number): Uint8Array => new Uint8Array(32).fill(b);
    const accepts = (key: Uint8Array): boolean =>
      peer.verifies((tried) => Buffer.from(tried).equals(Buffer.from(key)));
    expect(accepts(new Uint8Array(0)), "no key yet: nothing verifies").toBe(false);
    peer.setRecvKey(k(1));
    expect([accepts(k(1)), accepts(k(2))]).toEqual([true, false]);
    peer.setRecvKey(k(1)); // the same key again is no rotation
    peer.setRecvKey(k(2));
    expect([accepts(k(1)), accepts(k(2))]).toEqual([true, true]);
    peer.setRecvKey(k(3));
    expect([accepts(k(1)), accepts(k(2)), accepts(k(3))]).toEqual([false, true, true]);
  });

  it("pairs two layouts once, and again for another layout object (an engine registered again)", () => {
    const w = new FakeWorld();
    const peer = w.peer("p0");
    const own = w.ctx.kvs.kv!.groups;
    const first = peer.pairing(own, peer.groups);
    expect(peer.pairing(own, peer.groups)).toBe(first);
    const again = [...own];
    const second = peer.pairing(again, peer.groups);
    expect(second).not.toBe(first);
    expect(second.src).toBe(again);
    expect(second).toEqual({ ...first, src: again });
  });

  it("makes each rank pair's endpoint and remote region once, again only after a close; names a pair it lacks", () => {
    const w = new FakeWorld({}, smallTp(2));
    let connects = 0;
    const connect = w.agent.connect.bind(w.agent);
    w.agent.connect = () => {
      connects++;
      return connect();
    };
    const peer = w.peer("p0");
    const ep = peer.endpoint(0, 1);
    expect(peer.endpoint(0, 1)).toBe(ep);
    expect(connects).toBe(1);
    const r = peer.remote(0, 1, 0);
    expect(peer.remote(0, 1, 0)).toBe(r);
    expect(peer.remote(0, 1, 1)).not.toBe(r);
    expect(connects).toBe(1);
    (ep as { state: string }).state = "closed";
    expect(peer.endpoint(0, 1)).not.toBe(ep);
    expect(connects).toBe(2);
    expect(() => peer.endpoint(0, 2)).toThrow("peer p0: no rank pair 0 -> 2");
    expect(() => peer.endpoint(2, 0)).toThrow("peer p0: no rank pair 2 -> 0");
    expect(() => peer.remote(0, 1, 99)).toThrow("peer p0: rank 1 has no region 99");
  });

  it("makes the control endpoint (rank 0 to rank 0, apart from the data's) once, again only after a close; names a peer without rank 0", () => {
    const w = new FakeWorld({}, smallTp(2));
    const peer = w.peer("p0");
    const control = peer.controlEndpoint();
    expect(peer.controlEndpoint()).toBe(control);
    expect(peer.endpoint(0, 0)).not.toBe(control);
    expect(peer.owns(control)).toBe(true);
    (control as { state: string }).state = "closed";
    expect(peer.controlEndpoint()).not.toBe(control);
    peer.metadata.ranks = peer.metadata.ranks.filter((r) => r.rank !== 0);
    (peer.controlEndpoint() as { state: string }).state = "closed";
    expect(() => peer.controlEndpoint()).toThrow("peer p0: no rank 0 for control messages");
  });
});
