// An authenticated insider on P's side, in process (issue 31, cases 2 and 3): a peer that knows
// only a transfer's id, and a peer that floods P with registrations. Token binding: before
// PrefillDone nothing a registrant says ends the transfer; after it, only the token's holder
// counts. Per-peer bounds: a flooder fills its own share of P's table, checked in O(1).
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { ReleaseReason } from "../../src/gen/kvxfer/v1/engine_pb.js";
import { HandshakeRequestSchema, PushRegSchema } from "../../src/gen/kvxfer/v1/peer_pb.js";
import { newMacKey } from "../../src/peer/messages.js";
import { MessageBudget, type PeerState } from "../../src/peer/peer-state.js";
import { PER_PEER_SHARE, PrefillSide } from "../../src/sidecar/prefill.js";
import { FakeWorld, PeerTableWorld, SETTINGS, peerMetadata, prefillDone, settle } from "./fakes.js";

const pushReg = (transferId: string, token: string, leaseMs = SETTINGS.regLeaseMs) =>
  create(PushRegSchema, {
    transferId,
    blockIds: [4, 5],
    numTokens: 20,
    prefixTokens: 0,
    leaseMs,
    token,
  });

function setup(settings = {}) {
  const w = new FakeWorld({ maxTransfers: 64, ...settings });
  const p = new PrefillSide(w.ctx);
  const state = (id: string) => p.infoOf(id)?.state;
  return { w, p, state, d: w.peer("real-d"), thief: w.peer("thief") };
}

describe("an insider that knows only the transfer's id", () => {
  it("pull: its PushReg, Abort, Failed and a short lease before PrefillDone never end the transfer; the real D's read is released", () => {
    const { w, p, state, d, thief } = setup();
    p.pushReg(thief, pushReg("t1", "guess", 100));
    p.peerAbort(thief, "t1", "guess");
    expect(w.toPeer.filter((m) => m.peer === "thief").map((m) => m.body.case)).toEqual([
      "abortAck", // its own registration withdrawn: nothing was written for it
    ]);
    p.pushReg(thief, pushReg("t1", "guess", 100)); // again, and this time its lease runs out
    p.peerFailed(thief, "t1", "ERR_X", "guess"); // withdrawn again
    p.pushReg(thief, pushReg("t1", "guess", 100));
    w.clock.advance(100);
    p.expire(w.clock.now());
    expect(state("t1")).toBe("WAITING");
    expect(w.eventsOf("t1")).toEqual([]);
    // Prefill finishes with the real token: the withdrawals were not the token holder's.
    p.prefillDone(prefillDone("t1", "real"));
    expect(state("t1")).toBe("HELD");
    expect(w.engineSaid("t1")).toEqual([]);
    // After PrefillDone the thief's Abort and Failed are refused by name.
    p.peerAbort(thief, "t1", "guess");
    expect(p.peerFailed(thief, "t1", "ERR_X", "guess")).toBe(true);
    p.readDone(thief, "t1", 1, "guess");
    expect(state("t1")).toBe("HELD");
    expect(w.errors.filter((e) => e.includes("from 'thief' refused"))).toEqual([
      "Abort for 't1' from 'thief' refused: ERR_BAD_TRANSFER_TOKEN",
      "Failed for 't1' from 'thief' refused: ERR_BAD_TRANSFER_TOKEN",
      "ReadDone for 't1' from 'thief' refused: ERR_BAD_TRANSFER_TOKEN",
    ]);
    // The real D reads and presents the token: released as transferred, one event.
    p.readDone(d, "t1", 4096, "real");
    expect(state("t1")).toBe("RELEASED");
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.TRANSFERRED}`]);
    expect(w.eventsOf("t1")).toEqual(["RELEASED"]);
  });

  it("push: the thief registers first, then aborts and fails; the real D's registration is written", async () => {
    const { w, p, state, d, thief } = setup();
    w.agent.autoLand = true;
    p.pushReg(thief, pushReg("t1", "guess"));
    p.pushReg(d, pushReg("t1", "real"));
    p.peerFailed(thief, "t1", "ERR_X", "guess");
    p.peerAbort(thief, "t1", "guess");
    p.peerDown(thief);
    expect(state("t1")).toBe("WAITING");
    expect([...p.livePeers()].map((x) => x.engineId)).toEqual(["real-d"]);
    p.prefillDone(prefillDone("t1", "real"));
    await settle();
    expect(state("t1")).toBe("RELEASED");
    expect(p.infoOf("t1")!.peer).toBe("real-d");
    expect(w.sealed.map((b) => b.case)).toEqual(["xferDone"]);
    expect(w.eventsOf("t1")).toEqual(["RELEASED"]);
  });

  it("push: the real D's own withdrawal before PrefillDone counts at PrefillDone (blocks back at once)", () => {
    const { w, p, state, d, thief } = setup();
    p.pushReg(thief, pushReg("t1", "guess"));
    p.pushReg(d, pushReg("t1", "real"));
    p.peerAbort(d, "t1", "real");
    expect(w.toPeer.filter((m) => m.peer === "real-d").map((m) => m.body.case)).toEqual([
      "abortAck",
    ]);
    p.prefillDone(prefillDone("t1", "real"));
    expect(state("t1")).toBe("ABORTED");
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.ABORTED}`]);
    // The thief's live registration is refused by the token.
    expect(w.toPeer.filter((m) => m.peer === "thief").map((m) => m.body.value)).toMatchObject([
      { code: "ERR_BAD_TRANSFER_TOKEN" },
    ]);
  });

  it("the late-PrefillDone path records the token: the real D's ReadDone hears 'not held', not a token refusal", () => {
    const { w, p, d } = setup();
    p.pushReg(d, pushReg("t1", "real"));
    p.abort("t1"); // P's own engine: trusted
    p.prefillDone(prefillDone("t1", "real"));
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.ABORTED}`]);
    p.readDone(d, "t1", 1, "real");
    expect(w.toPeer.at(-1)!.body).toMatchObject({ case: "readAck", value: { held: false } });
    expect(w.errors.filter((e) => e.includes("ERR_BAD_TRANSFER_TOKEN"))).toEqual([]);
  });

  it("issue 48: five insiders (or any number) register first for a known id; the real D's push is kept, not refused ERR_DUPLICATE, and written", async () => {
    const { w, p, state, d } = setup();
    w.agent.autoLand = true;
    const insiders = Array.from({ length: 12 }, (_, k) => w.peer(`insider-${k}`));
    for (const x of insiders) p.pushReg(x, pushReg("t1", `guess-${x.engineId}`));
    p.pushReg(d, pushReg("t1", "real"));
    expect(w.peerSaid("t1")).toEqual([]);
    expect(p.livePeers().size).toBe(13);
    // One withdraws and registers again: it takes its own place back, nothing more.
    p.peerAbort(insiders[0]!, "t1", "");
    p.pushReg(insiders[0]!, pushReg("t1", "again"));
    expect(p.registrationsOf(insiders[0]!)).toBe(1);
    p.prefillDone(prefillDone("t1", "real"));
    await settle();
    expect(state("t1")).toBe("RELEASED");
    expect(p.infoOf("t1")!.peer).toBe("real-d");
    const codes = new Set(
      w.toPeer
        .filter((m) => m.peer.startsWith("insider-") && m.body.case === "failed")
        .map((m) => (m.body.value as { code: string }).code),
    );
    expect([...codes]).toEqual(["ERR_BAD_TRANSFER_TOKEN"]);
    expect(p.unconfirmedCount()).toBe(0);
  });
});

describe("a flooding insider", () => {
  it("PushRegs for random ids fill only the flooder's share; PrefillDone and other peers go on", async () => {
    const { w, p, state, d, thief } = setup({ maxTransfers: 64, maxPerPeer: undefined });
    const share = 64 / PER_PEER_SHARE;
    for (let i = 0; i < 1000; i++) p.pushReg(thief, pushReg(`flood-${i}`, "x"));
    expect(p.live()).toBe(share);
    expect(p.registrationsOf(thief)).toBe(share);
    const refusedCodes = new Set(
      w.toPeer
        .filter((m) => m.peer === "thief")
        .map((m) => (m.body.value as { code: string }).code),
    );
    expect([...refusedCodes]).toEqual(["ERR_OVERLOADED"]);
    expect(w.errors.at(-1)).toContain(`(${share} registrations waiting for prefill`);
    // The engine's transfers and another D's registrations go on.
    w.agent.autoLand = true;
    p.pushReg(d, pushReg("legit-push", "tok"));
    p.prefillDone(prefillDone("legit-push", "tok"));
    p.prefillDone(prefillDone("legit-pull", "tok2", [8, 9]));
    await settle();
    p.readDone(d, "legit-pull", 10, "tok2");
    expect([state("legit-push"), state("legit-pull")]).toEqual(["RELEASED", "RELEASED"]);
    // The flooder's entries go when their leases run out; its share comes back.
    w.clock.advance(SETTINGS.regLeaseMs);
    p.expire(w.clock.now());
    w.clock.advance(SETTINGS.leaseMs);
    p.expire(w.clock.now());
    expect(p.registrationsOf(thief)).toBe(0);
    expect(p.live()).toBe(0);
    // A PrefillDone for a flooded id takes the entry over: no longer the flooder's share.
    p.pushReg(thief, pushReg("taken", "x"));
    p.prefillDone(prefillDone("taken", "other", [10, 11]));
    expect(p.registrationsOf(thief)).toBe(0);
    expect(state("taken")).toBe("HELD");
  });

  it("every cap is O(1): 40,000 PushRegs refused or displacing against a full pool of 8,192 take well under a second", () => {
    const { w, p, thief } = setup({
      maxTransfers: 65_536,
      maxPerPeer: undefined,
      maxUnconfirmed: undefined,
    });
    const pool = 65_536 / PER_PEER_SHARE;
    // Eight engines fill the pool of registrations before prefill (the thief is one of them).
    const fillers = [thief, ...Array.from({ length: 7 }, (_, k) => w.peer(`filler-${k}`))];
    for (const [k, x] of fillers.entries())
      for (let i = 0; i < pool / 8; i++) p.pushReg(x, pushReg(`f${k}-${i}`, "x"));
    expect(p.unconfirmedCount()).toBe(pool);
    const latecomer = w.peer("latecomer");
    const t0 = performance.now();
    for (let i = 0; i < 20_000; i++) p.pushReg(thief, pushReg(`more${i}`, "x")); // refused
    for (let i = 0; i < 20_000; i++) p.pushReg(latecomer, pushReg(`late${i}`, "x")); // displaces
    const ms = performance.now() - t0;
    // A scan of the table per message (the cap check before issue 31) takes many seconds here.
    expect(ms).toBeLessThan(1000);
    expect(p.unconfirmedCount()).toBe(pool);
    // Nine engines now share it about evenly; nobody holds more than its fair part plus one.
    for (const x of [...fillers, latecomer])
      expect(p.registrationsOf(x)).toBeLessThanOrEqual(Math.ceil(pool / 9) + 1);
    expect(w.toPeer.at(-1)!.body).toMatchObject({ value: { code: "ERR_OVERLOADED" } });
  });

  it("a peer's notifications past its budget go unprocessed, counted once per read; the budget refills", () => {
    const b = new MessageBudget();
    let ok = 0;
    for (let i = 0; i < 500; i++) if (b.take(0, 100)) ok++;
    expect(ok).toBe(200); // the burst: two seconds' worth
    expect(b.dropped()).toBe(300);
    expect(b.dropped()).toBe(0);
    expect(b.take(5, 100)).toBe(false); // 5 ms: half a message back
    expect(b.take(20, 100)).toBe(true); // 20 ms: two messages back
    expect(b.take(10_000, 100)).toBe(true);
    // A costly message (a heartbeat naming many ids) takes its cost, or nothing.
    const c = new MessageBudget();
    expect(c.take(0, 100, 150)).toBe(true); // of a 200 burst
    expect(c.take(0, 100, 60)).toBe(false);
    expect(c.take(0, 100, 50)).toBe(true);
  });
});

describe("after PrefillDone, the registered D only", () => {
  it("renews a moving push's registration and gets its heartbeat; another D's renewal changes nothing", async () => {
    const { w, p, d, thief } = setup();
    p.pushReg(d, pushReg("t1", "tok", 1000));
    p.prefillDone(prefillDone("t1", "tok"));
    expect(p.infoOf("t1")!.state).toBe("MOVING");
    expect([...p.livePeers()].map((x) => x.engineId)).toEqual(["real-d"]);
    w.clock.advance(900);
    p.renewLeases(thief, ["t1"]);
    p.renewLeases(d, ["t1"]);
    w.clock.advance(900); // past the first lease, within the renewed one
    w.agent.landAll();
    await settle();
    expect(p.infoOf("t1")!.state).toBe("RELEASED");
    p.peerDown(d); // nothing left of it to end
    expect(p.infoOf("t1")!.state).toBe("RELEASED");
  });
});

describe("the peer table's bookkeeping for issue 31", () => {
  it("overBudget names each peer with messages dropped since the last call; close() closes every peer", () => {
    const world = new PeerTableWorld();
    for (const id of ["d0", "d1"])
      world.table.onHandshake(
        create(HandshakeRequestSchema, { metadata: peerMetadata(id, 7n), macKey: newMacKey() }),
        undefined,
      );
    const [d0] = (world.table as unknown as { peers: Map<string, PeerState> }).peers.values();
    for (let i = 0; i < 5; i++) d0!.budget.take(0, 1);
    expect(world.table.overBudget()).toEqual([["d0", 3]]);
    expect(world.table.overBudget()).toEqual([]);
    world.table.close();
    expect(d0!.endpointList()).toEqual([]);
  });
});

describe("the same token on a withdrawn and a live registration", () => {
  it("the live one is served (a decode sidecar that restarted and registered again)", async () => {
    const { w, p, state } = setup();
    w.agent.autoLand = true;
    const before = w.peer("d-restarting");
    p.pushReg(before, pushReg("t1", "tok"));
    p.peerDown(before); // killed: its registration withdrawn
    const after = w.peer("d-restarted");
    p.pushReg(after, pushReg("t1", "tok"));
    p.prefillDone(prefillDone("t1", "tok"));
    await settle();
    expect(state("t1")).toBe("RELEASED");
    expect(p.infoOf("t1")!.peer).toBe("d-restarted");
  });
});

describe("issue 48: registrations no engine has named live apart, shared fairly", () => {
  it("eight colluding insiders, each within its share, fill only the pool of registrations before prefill: every real PrefillDone is served; a real D's registration takes the largest insider's oldest place, and that insider is told", async () => {
    // maxTransfers 512: the pool (and each engine's share) is 64.
    const { w, p, state, d } = setup({
      maxTransfers: 512,
      maxPerPeer: undefined,
      maxUnconfirmed: undefined,
    });
    w.agent.autoLand = true;
    const insiders = Array.from({ length: 8 }, (_, k) => w.peer(`colluder-${k}`));
    for (const [k, x] of insiders.entries())
      for (let i = 0; i < 64; i++) p.pushReg(x, pushReg(`c${k}-${i}`, "x"));
    expect(p.unconfirmedCount()).toBe(64);
    for (const x of insiders) expect(p.registrationsOf(x)).toBe(8);
    // The table is apart: 512 real prefills are all taken.
    for (let i = 0; i < 512; i++) p.prefillDone(prefillDone(`real-${i}`, "t", [i % 32]));
    expect(w.refused).toEqual([]);
    p.prefillDone(prefillDone("one-too-many", "t", [1]));
    expect(w.refused).toEqual([{ transferId: "one-too-many", code: "ERR_OVERLOADED" }]);
    // A real push registered before its prefill: it displaces the first largest group's oldest.
    const oldest = "c0-56"; // colluder-0's oldest still kept (each newcomer displaced the largest)
    expect(state(oldest)).toBe("WAITING");
    p.pushReg(d, pushReg("real-push", "tok"));
    expect(state("real-push")).toBe("WAITING");
    expect(state(oldest)).toBeUndefined(); // its entry had no other registration: gone
    expect(w.peerSaid(oldest)).toEqual(["failed:ERR_OVERLOADED"]);
    expect(
      (w.toPeer.filter((m) => m.peer === "colluder-0").at(-1)!.body.value as { message: string })
        .message,
    ).toMatch(/^registration displaced/);
    expect(p.unconfirmedCount()).toBe(64);
    // The sweep notes the displacements once.
    expect(p.takeDisplaced()).toBeGreaterThan(0);
    expect(p.takeDisplaced()).toBe(0);
    p.abort("real-0"); // room for the real prefill
    p.prefillDone(prefillDone("real-push", "tok"));
    await settle();
    expect(state("real-push")).toBe("RELEASED");
  });

  it("a registration before PrefillDone lives the short lease unless renewed; once P's engine names the id, D's renewals extend it by the lease D asked for", async () => {
    const { w, p, state, d } = setup({ unconfirmedLeaseMs: 300 });
    p.pushReg(d, pushReg("t1", "tok", 10_000));
    p.pushReg(d, pushReg("t2", "tok", 10_000));
    w.clock.advance(299);
    p.renewLeases(d, ["t1"]);
    p.expire(w.clock.now()); // early for t1 (renewed): its deadline is made again
    expect([state("t1"), state("t2")]).toEqual(["WAITING", "WAITING"]);
    w.clock.advance(1);
    p.expire(w.clock.now());
    expect(w.peerSaid("t2")).toEqual(["failed:ERR_TIMEOUT"]);
    expect(state("t1")).toBe("WAITING");
    // Named by P's engine: the registration is written to; a renewal now extends by 10 s.
    p.prefillDone(prefillDone("t1", "tok"));
    expect(state("t1")).toBe("MOVING");
    w.clock.advance(200);
    p.renewLeases(d, ["t1"]);
    w.clock.advance(5000); // past the short lease, within D's
    w.agent.landAll();
    await settle();
    expect(state("t1")).toBe("RELEASED");
  });

  it("a displaced registration leaves the others of its transfer waiting; the last one's entry goes, unless it is the entry the newcomer joins; a withdrawn one goes without a word", () => {
    const { w, p, state } = setup({ maxUnconfirmed: 3 });
    const [a, b, c] = [w.peer("a"), w.peer("b"), w.peer("c")];
    p.pushReg(a, pushReg("x", "1"));
    p.pushReg(a, pushReg("y", "1"));
    p.pushReg(b, pushReg("x", "2")); // joins a's entry: the pool is full (3)
    // c's registration displaces a's oldest (x): b's registration for x remains.
    p.pushReg(c, pushReg("z", "3"));
    expect(state("x")).toBe("WAITING");
    expect(p.infoOf("x")!.peer).toBe("b");
    expect(w.peerSaid("x")).toEqual(["failed:ERR_OVERLOADED"]);
    // b withdraws x; then a's registration for x (a holds 1, as many as b and c): refused.
    p.peerAbort(b, "x", "");
    p.pushReg(a, pushReg("x", "1"));
    expect(w.peerSaid("x").at(-1)).toBe("failed:ERR_OVERLOADED");
    // Groups of one each now, in the order they came to one: b, a, c. A fourth engine joins y:
    // b's withdrawn registration goes without a word, and x (nothing left) with it.
    const e = w.peer("e");
    const toB = w.toPeer.filter((m) => m.peer === "b").length;
    p.pushReg(e, pushReg("y", "4"));
    expect(w.toPeer.filter((m) => m.peer === "b").length).toBe(toB);
    expect(state("x")).toBeUndefined();
    expect(state("y")).toBe("WAITING");
    // A fifth: a's registration for y goes (a is told); y waits on with e's.
    const f = w.peer("f");
    p.pushReg(f, pushReg("v", "5"));
    expect(w.peerSaid("y")).toEqual(["failed:ERR_OVERLOADED"]);
    expect(state("y")).toBe("WAITING");
    expect(p.infoOf("y")!.peer).toBe("e");
    // A sixth joins z, whose only registration (c's) is the one to go: z stays, now g's.
    const g = w.peer("g");
    p.pushReg(g, pushReg("z", "6"));
    expect(w.peerSaid("z")).toEqual(["failed:ERR_OVERLOADED"]);
    expect(state("z")).toBe("WAITING");
    expect(p.livePeers()).toEqual(new Set([e, f, g]));
    // The engine gives up on y: its registrations leave the pool with it.
    p.abort("y");
    expect(w.peerSaid("y").at(-1)).toBe("failed:ERR_ABORTED");
    expect(p.unconfirmedCount()).toBe(2);
  });

  it("a registration whose decode engine is silent for two heartbeats expires without a word to it (a crowd of dead insiders costs P no sends that cannot complete); a live one is told", () => {
    const { w, p, d, thief } = setup({ unconfirmedLeaseMs: 3000, heartbeatMs: 1000 });
    p.pushReg(thief, pushReg("gone", "x", 10_000));
    p.pushReg(d, pushReg("alive", "y", 10_000));
    w.silent(thief);
    w.clock.advance(3000);
    p.expire(w.clock.now());
    expect(w.toPeer.filter((m) => m.peer === "thief")).toEqual([]);
    expect(w.peerSaid("alive")).toEqual(["failed:ERR_TIMEOUT"]);
  });

  it("an engine's Abort before PrefillDone tells the live registrations, not a withdrawn one", () => {
    const { w, p, d, thief } = setup();
    p.pushReg(thief, pushReg("t1", "x"));
    p.peerAbort(thief, "t1", "");
    p.pushReg(d, pushReg("t1", "real"));
    p.abort("t1");
    expect(w.toPeer.filter((m) => m.peer === "thief").map((m) => m.body.case)).toEqual([
      "abortAck",
    ]);
    expect(w.peerSaid("t1").at(-1)).toBe("failed:ERR_ABORTED");
    expect(p.unconfirmedCount()).toBe(0);
  });
});
