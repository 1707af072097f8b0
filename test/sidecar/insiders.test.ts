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

  it("withdrawn registrations give their places up; five live ones fill a transfer's list", () => {
    const { w, p } = setup();
    const peers = ["a", "b", "c", "d", "e", "f"].map((n) => w.peer(n));
    for (const x of peers.slice(0, 5)) p.pushReg(x, pushReg("t1", "x"));
    p.pushReg(peers[5]!, pushReg("t1", "x"));
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_DUPLICATE"]);
    p.peerAbort(peers[0]!, "t1", "x");
    p.pushReg(peers[5]!, pushReg("t1", "x"));
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_DUPLICATE", "abortAck"]);
    expect(p.livePeers().size).toBe(5);
  });
});

describe("a flooding insider", () => {
  it("PushRegs for random ids fill only the flooder's share; PrefillDone and other peers go on", async () => {
    const { w, p, state, d, thief } = setup({ maxTransfers: 64, maxPerPeer: undefined });
    const share = 64 / PER_PEER_SHARE;
    for (let i = 0; i < 1000; i++) p.pushReg(thief, pushReg(`flood-${i}`, "x"));
    expect(p.live()).toBe(share);
    expect(thief.named).toBe(share);
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
    expect(thief.named).toBe(0);
    expect(p.live()).toBe(0);
    // A PrefillDone for a flooded id takes the entry over: no longer the flooder's share.
    p.pushReg(thief, pushReg("taken", "x"));
    p.prefillDone(prefillDone("taken", "other", [10, 11]));
    expect(thief.named).toBe(0);
    expect(state("taken")).toBe("HELD");
  });

  it("every cap is O(1): 40,000 refused PushRegs against a full 65,536 table take well under a second", () => {
    const { w, p, thief } = setup({ maxTransfers: 65_536, maxPerPeer: undefined });
    const share = 65_536 / PER_PEER_SHARE;
    // Eight engines fill the table, one share each (the thief is one of them).
    const fillers = [thief, ...Array.from({ length: 7 }, (_, k) => w.peer(`filler-${k}`))];
    for (const [k, x] of fillers.entries())
      for (let i = 0; i < share; i++) p.pushReg(x, pushReg(`f${k}-${i}`, "x"));
    expect(p.live()).toBe(65_536);
    const latecomer = w.peer("latecomer");
    const t0 = performance.now();
    for (let i = 0; i < 20_000; i++) p.pushReg(thief, pushReg(`more${i}`, "x")); // its share
    for (let i = 0; i < 20_000; i++) p.pushReg(latecomer, pushReg(`late${i}`, "x")); // the table
    const ms = performance.now() - t0;
    // A scan of the table per message (the cap check before issue 31) takes many seconds here.
    expect(ms).toBeLessThan(1000);
    expect(p.live()).toBe(65_536);
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
