// The attack matrix of docs/security.md, peer side, against a real authenticated sidecar pair
// (processes from dist/, simulated engines, UCX over shared memory, mutual TLS side channels):
// each case is played by a peer this test runs itself (test/sidecar/multiprocess/rogue-peer.ts) and asserts the
// refusal, that the transfer it aimed at still completes byte-exact, that the attacker's own
// buffers were never written, and that no block stays held. `npm run build` first.
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { agentName } from "../../../src/peer/messages.js";
import type { PeerCredentials } from "../../../src/peer/side-channel.js";
import { Pki, sharedPki } from "../../../sim/pki.js";
import { SidecarProcess } from "../../../sim/sidecar-process.js";
import { RoguePeer, credentials } from "./rogue-peer.js";
import { KvNode, type Pair, goodTransfer, startPair } from "./fixtures.js";
import { until } from "../../until.js";

const WAIT = 10_000;

async function errorsSince(node: KvNode, since: string): Promise<string[]> {
  return (await node.client.getStatus()).lastErrors.filter(
    (e) => e.slice(0, since.length) >= since,
  );
}

async function waitError(node: KvNode, since: string, re: RegExp): Promise<string> {
  let errs: string[] = [];
  await until(
    async () => (errs = await errorsSince(node, since)).some((e) => re.test(e)),
    WAIT,
    () => `${node.role}'s lastErrors matching ${re}: ${JSON.stringify(errs)}`,
    50,
  );
  return errs.find((e) => re.test(e))!;
}

describe("security: peers (multi-process, authenticated)", () => {
  let pair: Pair;
  let p: KvNode;
  let d: KvNode;
  let other: Pki;
  const rogues: RoguePeer[] = [];

  const rogue = (id: string, agentAs?: string): RoguePeer => {
    const r = new RoguePeer(
      id,
      0x5eed_0000n + BigInt(rogues.length),
      p.engine.ready!.layout,
      agentAs,
    );
    rogues.push(r);
    return r;
  };

  beforeAll(async () => {
    pair = await startPair({ mode: "auto" });
    p = pair.p;
    d = pair.d;
    other = new Pki("another cluster's CA");
    await goodTransfer(p, d, "warm-up");
  }, 60_000);

  afterAll(async () => {
    for (const r of rogues) r.close();
    other?.close();
    await pair?.close();
  });

  it("1: without credentials nobody gets metadata or remote keys", async () => {
    const since = new Date().toISOString();
    const r = rogue("no-creds");
    await expect(r.handshake(p.sideChannel, { timeoutMs: 3000 })).rejects.toMatchObject({
      code: expect.stringMatching(/ERR_UNREACHABLE|ERR_UNAUTHENTICATED/),
    });
    expect(r.peerEpoch).toBe(0n);
    await waitError(p, since, /ERR_UNAUTHENTICATED: TLS handshake failed/);
    const st = await p.client.getStatus();
    expect(st.peers.map((x) => x.engineId)).not.toContain("no-creds");
  }, 30_000);

  it("another cluster's credentials are refused both ways", async () => {
    const since = new Date().toISOString();
    // Its own CA: it does not trust P's certificate, P does not trust its.
    const foreign = credentials(other, "intruder");
    await expect(
      rogue("intruder").handshake(p.sideChannel, { creds: foreign }),
    ).rejects.toMatchObject({ code: "ERR_UNAUTHENTICATED" });
    // Trusting our CA, presenting a certificate from another: P refuses it.
    const mixed: PeerCredentials = { ...foreign, ca: credentials(sharedPki(), "x").ca };
    await expect(
      rogue("intruder-2").handshake(p.sideChannel, { creds: mixed }),
    ).rejects.toMatchObject({ code: expect.stringMatching(/ERR_UNAUTHENTICATED|ERR_UNREACHABLE/) });
    await waitError(p, since, /ERR_UNAUTHENTICATED: TLS handshake failed/);
    const st = await p.client.getStatus();
    expect(st.peers.map((x) => x.engineId)).not.toContain("intruder");
    expect(st.peers.map((x) => x.engineId)).not.toContain("intruder-2");
  }, 30_000);

  it("6: a handshake claiming an existing engine id is believed only with that engine's certificate", async () => {
    const sinceMs = Date.now();
    const dEpoch = BigInt(d.ready.epoch);
    const res = await rogue("impostor").handshake(p.sideChannel, {
      creds: credentials(sharedPki(), "impostor"),
      claim: { engineId: d.engineId, epoch: dEpoch + 1n },
    });
    expect(res.errorCode).toBe("ERR_UNAUTHENTICATED");
    expect(res.error).toContain("impostor");
    expect(res.metadata).toBeUndefined();
    // P still knows D at its epoch, and declared nothing down.
    const st = await p.client.getStatus();
    const known = st.peers.find((x) => x.engineId === d.engineId);
    expect(known?.epoch).toBe(dEpoch);
    expect(p.events.filter((e) => e.kind === "PEER_DOWN" && e.timeMs >= sinceMs)).toHaveLength(0);
    await goodTransfer(p, d, "after-impostor");
  }, 30_000);

  it("4: a forged XferDone (P's id, epoch and agent name, no key) does not make D report ready", async () => {
    const since = new Date().toISOString();
    const pEpoch = BigInt(p.ready.epoch);
    // An insider that learned P's epoch and names its agent after P's rank 0.
    const r = rogue("forger", agentName(p.engineId, pEpoch, 0));
    expect(
      (await r.handshake(d.sideChannel, { creds: credentials(sharedPki(), "forger") })).errorCode,
    ).toBe("");
    const id = "forged-done";
    const token = "tok-forged-done";
    // D waits for P's push (P has not prefilled yet).
    await d.engine.expect({ transferId: id, tokens: 40, source: p.sideChannel, token });
    const bytes = 40n * 1024n;
    await r.send(
      r.seal(
        { case: "xferDone", value: { transferId: id, srcRank: 0, dstRank: 0, bytes } },
        { as: { engineId: p.engineId, epoch: pEpoch } },
      ),
    );
    await waitError(d, since, /from 'p-.*' refused: ERR_UNAUTHENTICATED \(bad MAC\)/);
    // Under its own name (a valid MAC): not the peer the transfer names (nor the agent it sends
    // from), refused by name.
    await r.send(
      r.seal({ case: "xferDone", value: { transferId: id, srcRank: 0, dstRank: 0, bytes } }),
    );
    await waitError(d, since, /from 'forger'/);
    expect(d.terminal(id)).toHaveLength(0);
    expect(d.engine.events.some((e) => e.transferId === id && e.event === "verified")).toBe(false);
    // The real prefill arrives: ready once, byte-exact.
    await p.engine.prefill(id, 40, 0, WAIT, token);
    expect((await d.engineEvent(id, "verified", WAIT)).ok).toBe(true);
    expect((await p.engineEvent(id, "released", WAIT)).reason).toBe("TRANSFERRED");
    await until(() => d.terminal(id).length === 1, WAIT, "D's one terminal event");
    expect(d.terminal(id)[0]!.kind).toBe("KV_READY");
  }, 30_000);

  it("5: a PushReg from another decode engine cannot take a bound transfer, before or after PrefillDone", async () => {
    const since = new Date().toISOString();
    const r = rogue("thief");
    expect(
      (await r.handshake(p.sideChannel, { creds: credentials(sharedPki(), "thief") })).errorCode,
    ).toBe("");
    const reg = (transferId: string, token: string) =>
      r.seal({
        case: "pushReg",
        value: {
          transferId,
          blockIds: [0, 1, 2],
          numTokens: 40,
          prefixTokens: 0,
          leaseMs: 5000,
          token,
        },
      });

    // Before PrefillDone: the thief registers first (no token), the real D second.
    const early = "stolen-early";
    await r.send(reg(early, ""));
    await p.waitTransfer(
      early,
      "prefill",
      (t) => t.state === "WAITING" && t.peer === "thief",
      "the thief's registration first",
    );
    await d.engine.expect({
      transferId: early,
      tokens: 40,
      source: p.sideChannel,
      token: `tok-${early}`,
    });
    await p.waitTransfer(
      early,
      "prefill",
      (t) => t.trace.some((h) => h.hop === "peer.pushReg kept aside"),
      "the real D's registration kept aside",
    );
    await p.engine.prefill(early, 40, 0, WAIT, `tok-${early}`);
    expect((await d.engineEvent(early, "verified", WAIT)).ok).toBe(true);
    expect((await p.engineEvent(early, "released", WAIT)).reason).toBe("TRANSFERRED");
    await until(
      () => r.received.some((m) => m.body.case === "failed" && m.body.value.transferId === early),
      WAIT,
      "P's Failed to the thief",
    );
    const f = r.received.find(
      (m) => m.body.case === "failed" && m.body.value.transferId === early,
    )!;
    expect(f.body.case === "failed" && f.body.value.code).toBe("ERR_BAD_TRANSFER_TOKEN");

    // After PrefillDone: refused at once, with a guessed token too.
    const late = "stolen-late";
    await p.engine.prefill(late, 40, 0, WAIT, `tok-${late}`);
    await r.send(reg(late, "guess"));
    await waitError(
      p,
      since,
      /PushReg for 'stolen-late' from 'thief' refused: ERR_BAD_TRANSFER_TOKEN/,
    );
    await d.engine.expect({
      transferId: late,
      tokens: 40,
      source: p.sideChannel,
      token: `tok-${late}`,
    });
    expect((await d.engineEvent(late, "verified", WAIT)).ok).toBe(true);

    // ReadDone, Abort and Failed for a transfer P holds for someone else: refused, nothing ends.
    const held = "held-for-d";
    const { blockIds } = await p.engine.prefill(held, 40, 0, WAIT, `tok-${held}`);
    // The engine answers the router before P's sidecar has its PrefillDone; a ReadDone for a
    // transfer P does not know yet is answered "unknown", not refused.
    await p.waitTransfer(held, "prefill", (t) => t.state === "HELD", "HELD (P holds the blocks)");
    await r.send(r.seal({ case: "readDone", value: { transferId: held, bytes: 1n, token: "" } }));
    await r.send(
      r.seal({ case: "abort", value: { transferId: held, reason: "mine", token: "x" } }),
    );
    await r.send(
      r.seal({
        case: "failed",
        value: { transferId: held, code: "ERR_X", message: "", token: "" },
      }),
    );
    await waitError(
      p,
      since,
      /Failed for 'held-for-d' from 'thief' refused: ERR_BAD_TRANSFER_TOKEN/,
    );
    await waitError(p, since, /Abort for 'held-for-d' from 'thief' refused/);
    await waitError(p, since, /ReadDone for 'held-for-d' from 'thief' refused/);
    expect(p.terminal(held)).toHaveLength(0);
    await d.engine.expect({
      transferId: held,
      tokens: 40,
      source: p.sideChannel,
      sourceBlockIds: blockIds,
      token: `tok-${held}`,
    });
    expect((await d.engineEvent(held, "verified", WAIT)).ok).toBe(true);
    expect((await p.engineEvent(held, "released", WAIT)).reason).toBe("TRANSFERRED");
    await until(() => p.terminal(held).length > 0, WAIT, "P's terminal event");
    expect(p.terminal(held).map((e) => e.kind)).toEqual(["RELEASED"]);
    // The thief's memory was never written; nothing stays held.
    expect(r.untouched()).toBe(true);
    await p.allBlocksFree();
    await d.allBlocksFree();
  }, 60_000);

  it("a replayed notification from an authenticated peer is refused", async () => {
    const since = new Date().toISOString();
    const r = rogue("replayer");
    expect(
      (await r.handshake(p.sideChannel, { creds: credentials(sharedPki(), "replayer") })).errorCode,
    ).toBe("");
    const hb = r.seal({ case: "heartbeat", value: { transferIds: [] } });
    await r.send(hb);
    await r.send(hb);
    const e = await waitError(p, since, /from 'replayer' refused: ERR_REPLAY/);
    expect(e).toMatch(/sequence 1 seen/);
  }, 30_000);

  it("a side channel beyond loopback needs credentials, or --insecure-peers (which warns)", async () => {
    const bare = new SidecarProcess(["--engine-id", "open-1", "--listen", "0.0.0.0:0"], {
      pki: false,
    });
    await expect(bare.ready).rejects.toThrow(/--insecure-peers/);
    await bare.close(3000);
    const insecure = new SidecarProcess(
      ["--engine-id", "open-2", "--listen", "0.0.0.0:0", "--insecure-peers", "true"],
      { pki: false },
    );
    try {
      await insecure.ready;
      await until(() => insecure.stderrTail.includes("NOT authenticated"), WAIT, "the warning");
    } finally {
      await insecure.close(3000);
    }
  }, 30_000);

  it("credentials that cannot work are refused at start-up, naming the flag", async () => {
    const files = sharedPki().issue("someone-else");
    const cases: [string[], RegExp][] = [
      [
        ["--peer-cert", files.cert, "--peer-key", files.key, "--peer-ca", files.ca],
        /names 'someone-else'/,
      ],
      [["--peer-cert", files.cert], /go together/],
      [
        ["--peer-cert", files.cert, "--peer-key", files.key, "--peer-ca", "/etc/hostname"],
        /--peer-ca holds no PEM certificate/,
      ],
      [
        ["--peer-cert", files.cert, "--peer-key", files.key, "--peer-ca", other.caCert],
        /not signed by any certificate in --peer-ca/,
      ],
    ];
    for (const [flags, re] of cases) {
      const s = new SidecarProcess(["--engine-id", "cfg-check", ...flags]);
      await expect(s.ready).rejects.toThrow(re);
      await s.close(3000);
    }
  }, 60_000);
});
