// Cheap attacks of issue 31 against a real authenticated sidecar pair (processes from dist/,
// simulated engines, UCX over shared memory, mutual TLS side channels): each runs while
// legitimate transfers go on, and the test counts them verified. The attacker is this test
// process: raw TCP connections from other loopback addresses (Linux routes 127/8 to lo), and an
// authenticated insider (test/sidecar/multiprocess/rogue-peer.ts). `npm run build` first.
import { statSync, truncateSync } from "node:fs";
import * as net from "node:net";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { HANDSHAKE_DEADLINE_MS, HELLO_DEADLINE_MS } from "../../../src/peer/side-channel.js";
import { SidecarClient } from "../../../src/api/client.js";
import { simKvFilePath } from "../../../sim/engine-input.js";
import { sharedPki } from "../../../sim/pki.js";
import { SidecarProcess } from "../../../sim/sidecar-process.js";
import { RoguePeer, credentials } from "./rogue-peer.js";
import { KvNode, type Pair, goodTransfer, rssKiB, sleep, startPair, uniqueId } from "./fixtures.js";
import { until } from "../../until.js";

const WAIT = 10_000;
const MiB = (kib: number) => Math.round(kib / 1024);

describe("cheap attacks (multi-process, authenticated)", () => {
  let pair: Pair;
  let p: KvNode;
  let d: KvNode;
  const rogues: RoguePeer[] = [];
  const extra: KvNode[] = [];

  const insider = async (id: string): Promise<RoguePeer> => {
    const r = new RoguePeer(id, 0x0a77_0000n + BigInt(rogues.length), p.engine.ready!.layout);
    rogues.push(r);
    const res = await r.handshake(p.sideChannel, { creds: credentials(sharedPki(), id) });
    expect(res.errorCode).toBe("");
    return r;
  };

  beforeAll(async () => {
    // A 5 s lease: a flooder's entries go within seconds of it leaving (the test waits for it).
    pair = await startPair({ mode: "auto", pArgs: ["--lease-ms", "5000"] });
    p = pair.p;
    d = pair.d;
    await goodTransfer(p, d, "warm-up");
  }, 60_000);

  afterAll(async () => {
    for (const r of rogues) r.close();
    await Promise.all(extra.map((n) => n.close()));
    await pair?.close();
  });

  it("1: 64 silent connections and a trickling one fill no slot a new peer needs; a fresh D handshakes and verifies; all close at the hello deadline", async () => {
    const port = Number(p.sideChannel.split(":").at(-1));
    const rssBefore = rssKiB(p.sidecar.child.pid!);
    const t0 = Date.now();
    const closedAt: Promise<number>[] = [];
    const sockets: net.Socket[] = [];
    const open = (from: string): net.Socket => {
      const s = net.connect({ host: "127.0.0.1", port, localAddress: from });
      s.on("error", () => undefined);
      closedAt.push(new Promise((r) => s.once("close", () => r(Date.now() - t0))));
      sockets.push(s);
      return s;
    };
    for (let i = 0; i < 64; i++) open("127.0.0.2");
    const trickle = open("127.0.0.3");
    trickle.write(Buffer.from([0x16, 0x03, 0x01, 0x02, 0x00])); // a TLS record header, then drips
    const drip = setInterval(() => trickle.write(Buffer.from([0])), 1000);
    try {
      // A decode engine P has never seen: its first transfer needs a fresh handshake.
      const fresh = await KvNode.start({ role: "decode", mode: "auto" });
      extra.push(fresh);
      await goodTransfer(p, fresh, "fresh-handshake-push");
      await goodTransfer(p, fresh, "fresh-handshake-pull", { pull: true });
      const during = Date.now() - t0;
      expect(during, "the legitimate transfers ran during the attack").toBeLessThan(
        HANDSHAKE_DEADLINE_MS,
      );
      const rssDuring = rssKiB(p.sidecar.child.pid!);
      // Every attacker connection is closed by P at the hello deadline (issue 48: no complete
      // ClientHello within 2 s), the trickling one included.
      const times = await Promise.all(closedAt);
      for (const ms of times) expect(ms).toBeLessThan(HELLO_DEADLINE_MS + 3000);
      const recovered = Date.now() - t0;
      await goodTransfer(p, d, "after-slots");
      const rssAfter = rssKiB(p.sidecar.child.pid!);
      console.log(
        `case 1: 2/2 legitimate transfers verified during the attack (by ${during} ms); ` +
          `attacker's connections closed by ${Math.max(...times)} ms (recovered at ${recovered} ms); ` +
          `P RSS ${MiB(rssBefore)} / ${MiB(rssDuring)} / ${MiB(rssAfter)} MiB`,
      );
    } finally {
      clearInterval(drip);
      for (const s of sockets) s.destroy();
    }
  }, 60_000);

  for (const pull of [false, true]) {
    it(`2: an insider knowing only the id (${pull ? "pull" : "push"}) registers first, then sends Failed and Abort: the transfer verifies`, async () => {
      const id = `known-id-${pull ? "pull" : "push"}`;
      const r = await insider(`insider-${pull ? "pull" : "push"}`);
      await r.send(
        r.seal({
          case: "pushReg",
          value: {
            transferId: id,
            blockIds: [0, 1, 2],
            numTokens: 40,
            prefixTokens: 0,
            leaseMs: 100, // and its lease runs out at once
            token: "guess",
          },
        }),
      );
      await p.waitTransfer(id, "prefill", (t) => t.state === "WAITING", "the insider's entry");
      await r.send(
        r.seal({
          case: "failed",
          value: { transferId: id, code: "ERR_X", message: "", token: "guess" },
        }),
      );
      await r.send(r.seal({ case: "abort", value: { transferId: id, reason: "x", token: "" } }));
      await sleep(300); // past its lease and a few sweeps
      expect(p.terminal(id)).toHaveLength(0);
      await goodTransfer(p, d, id, { pull });
      expect(p.terminal(id).map((e) => e.kind)).toEqual(["RELEASED"]);
      expect(r.untouched()).toBe(true);
      await p.allBlocksFree();
      await d.allBlocksFree();
    }, 60_000);
  }

  it("3: a flood of PushRegs for random ids (and heartbeats renewing them) fills only the flooder's share; legitimate transfers verify", async () => {
    const r = await insider("flooder");
    const rssBefore = rssKiB(p.sidecar.child.pid!);
    const live = new Set<string>(); // sent and not refused
    let seen = 0; // r.received read so far
    let stop = false;
    // The legitimate transfers start once the flooder is past its share (8,192), and run
    // while it goes on.
    let pastShare!: () => void;
    const floodedPastShare = new Promise<void>((r) => (pastShare = r));
    const flood = (async () => {
      let i = 0;
      while ((!stop || i < 12_000) && i < 30_000) {
        if (i >= 10_000) pastShare();
        const batch: Promise<void>[] = [];
        for (let k = 0; k < 500; k++, i++) {
          const transferId = `flood-${i}-${Math.random().toString(36).slice(2)}`;
          live.add(transferId);
          batch.push(
            r.send(
              r.seal({
                case: "pushReg",
                value: {
                  transferId,
                  blockIds: [0],
                  numTokens: 1,
                  prefixTokens: 0,
                  leaseMs: 600_000,
                  token: "",
                },
              }),
            ),
          );
        }
        // Renew every entry P has not refused: each then lives to the end (their 5 s lease once
        // cut the flooder's count just below its share when a slow machine let one lapse).
        for (; seen < r.received.length; seen++) {
          const m = r.received[seen]!;
          if (m.body.case === "failed") live.delete(m.body.value.transferId);
        }
        batch.push(r.send(r.seal({ case: "heartbeat", value: { transferIds: [...live] } })));
        await Promise.allSettled(batch);
        await sleep(5);
      }
      pastShare();
      return i;
    })();
    const t0 = Date.now();
    await floodedPastShare;
    let verified = 0;
    const failed: string[] = [];
    let rssDuring = 0;
    for (let k = 0; k < 6; k++) {
      try {
        await goodTransfer(p, d, `during-flood-${k}`, { pull: k % 2 === 1 });
        verified++;
      } catch (err) {
        failed.push(String(err));
      }
      rssDuring = Math.max(rssDuring, rssKiB(p.sidecar.child.pid!));
    }
    stop = true;
    const sent = await flood;
    const floodMs = Date.now() - t0;
    expect(failed).toEqual([]);
    const st = await p.client.getStatus();
    const waiting = st.transfersByState["prefill:WAITING"] ?? 0;
    expect(waiting, "the flooder holds its share (65536 / 8), no more").toBe(8192);
    expect(
      st.lastErrors.some((e) =>
        /from 'flooder' refused: ERR_OVERLOADED|from 'flooder' dropped/.test(e),
      ),
    ).toBe(true);
    const tRecover = Date.now();
    await goodTransfer(p, d, "after-flood");
    const rssAfter = rssKiB(p.sidecar.child.pid!);
    console.log(
      `case 3: ${sent} PushRegs in ${floodMs} ms; ${verified}/6 legitimate transfers verified during it, ` +
        `0 failed; P holds ${waiting} of the flooder's; next transfer ${Date.now() - tRecover} ms after; ` +
        `P RSS ${MiB(rssBefore)} / ${MiB(rssDuring)} / ${MiB(rssAfter)} MiB`,
    );
    // The flooder leaves: its entries are withdrawn with it, the table empties of them.
    r.close();
    rogues.splice(rogues.indexOf(r), 1);
    await until(
      async () => ((await p.client.getStatus()).transfersByState["prefill:WAITING"] ?? 0) === 0,
      30_000,
      "the flooder's entries gone after it went silent",
      500,
    );
  }, 120_000);
});

describe("a stopping sidecar tells its peers (multi-process)", () => {
  it("5: SIGTERM of P with 8 pushes registered and not prefilled: D hears ERR_DRAINING and frees every block within a second or two, not at the registration lease", async () => {
    const pair = await startPair({ mode: "push", pArgs: ["--drain-ms", "20000"] });
    try {
      const { p, d } = pair;
      await goodTransfer(p, d, "warm-up");
      const ids = Array.from({ length: 8 }, (_, k) => `drain-p-${k}`);
      for (const id of ids)
        await d.engine.expect({
          transferId: id,
          tokens: 40,
          source: p.sideChannel,
          token: `t-${id}`,
        });
      for (const id of ids)
        await p.waitTransfer(id, "prefill", (t) => t.state === "WAITING", `${id} registered on P`);
      const t0 = Date.now();
      p.sidecar.kill("SIGTERM");
      await d.allBlocksFree(5000);
      const freedMs = Date.now() - t0;
      for (const id of ids) {
        const ev = await d.waitEvent((e) => e.transferId === id && e.kind === "FAILED", 5000);
        expect(ev.reason).toBe("ERR_DRAINING");
      }
      console.log(`case 5 (P stops): D freed 8 transfers' blocks ${freedMs} ms after P's SIGTERM`);
      expect(freedMs).toBeLessThan(3000);
    } finally {
      await pair.close();
    }
  }, 60_000);

  it("5: SIGTERM of D while P holds a prefill for it: D's refusal (ERR_DRAINING) reaches P, which frees the blocks at once, not at its 30 s lease", async () => {
    const pair = await startPair({ mode: "auto", dArgs: ["--drain-ms", "20000"] });
    try {
      const { p, d } = pair;
      await goodTransfer(p, d, "warm-up");
      // A push P never prefills keeps D draining (alive) after its SIGTERM.
      await d.engine.expect({
        transferId: "keeps-d-busy",
        tokens: 40,
        source: p.sideChannel,
        token: "k",
      });
      await p.waitTransfer("keeps-d-busy", "prefill", (t) => t.state === "WAITING", "registered");
      d.sidecar.kill("SIGTERM");
      await until(async () => (await d.client.getStatus()).draining, 5000, "D draining");
      const ids = ["held-1", "held-2", "held-3"];
      const blocks: number[][] = [];
      for (const id of ids)
        blocks.push((await p.engine.prefill(id, 40, 0, WAIT, `t-${id}`)).blockIds);
      const t0 = Date.now();
      for (const [k, id] of ids.entries())
        await d.engine.expect({
          transferId: id,
          tokens: 40,
          source: p.sideChannel,
          sourceBlockIds: blocks[k]!,
          token: `t-${id}`,
        });
      for (const id of ids) {
        const released = await p.engineEvent(id, "released", 5000);
        expect(released.reason).toBe("FAILED");
      }
      const freedMs = Date.now() - t0;
      await p.allBlocksFree(5000);
      console.log(`case 5 (D stops): P freed 3 held transfers ${freedMs} ms after D refused them`);
      expect(freedMs).toBeLessThan(3000);
    } finally {
      await pair.close();
    }
  }, 60_000);
});

describe("a KV file that shrinks under its sidecar (multi-process)", () => {
  /** Every KV file of `node`'s engine, cut to 0 bytes (`truncate -s 0`). */
  const truncateAll = (node: KvNode): string[] => {
    const L = node.engine.ready!.layout;
    const paths: string[] = [];
    for (let r = 0; r < L.tpSize; r++)
      for (let g = 0; g < L.regionBytes.length; g++) {
        const path = simKvFilePath("/dev/shm", node.engineId, node.engine.child.pid!, r, g);
        truncateSync(path, 0);
        paths.push(path);
      }
    return paths;
  };

  for (const [who, mode] of [
    ["P", "push"],
    ["D", "push"],
    ["D", "pull"],
    // D reads P's blocks without asking P first: P finds the shrunk file at its next sweep
    // (100 ms), gives it its size back and fails what it holds. Read sooner, and P's sidecar
    // dies of SIGBUS serving the read (measured before the sweep did this): the test waits.
    ["P", "pull"],
  ] as const) {
    it(`4: ${who}'s file cut to 0 bytes after registration (${mode}): that transfer fails, never ready, both sidecars live`, async () => {
      const pair = await startPair({ mode: "auto" });
      try {
        const { p, d } = pair;
        await goodTransfer(p, d, "before");
        const id = `shrunk-${who}-${mode}`;
        const token = `t-${id}`;
        // P prefills first (its engine writes the KV into its file), then the file shrinks.
        const { blockIds } = await p.engine.prefill(id, 40, 0, WAIT, token);
        await p.waitTransfer(id, "prefill", (t) => t.state === "HELD", "held");
        const cut = truncateAll(who === "P" ? p : d);
        if (who === "P" && mode === "pull") {
          await sleep(500);
          const L = p.engine.ready!.layout;
          expect(statSync(cut[0]!).size, "P gave the file its size back").toBe(L.regionBytes[0]);
        }
        await d.engine.expect({
          transferId: id,
          tokens: 40,
          source: p.sideChannel,
          token,
          ...(mode === "pull" ? { sourceBlockIds: blockIds } : {}),
        });
        const failed = await d.waitEvent(
          (e) => e.transferId === id && (e.kind === "FAILED" || e.kind === "KV_READY"),
          WAIT,
        );
        expect(failed.kind).toBe("FAILED");
        // P's pull: P failed the held transfer, so D's read is not confirmed (never ready).
        expect(failed.reason).toMatch(
          who === "P" && mode === "pull" ? /ERR_LEASE_EXPIRED/ : /ERR_REGION_CHANGED/,
        );
        if (who === "P")
          await until(
            async () => (await p.client.getStatus()).lastErrors.some((e) => e.includes("shrank")),
            WAIT,
            "P names the shrunk file",
          );
        // Both processes are alive and answer.
        expect(p.sidecar.child.exitCode).toBeNull();
        expect(d.sidecar.child.exitCode).toBeNull();
        expect(p.sidecar.child.signalCode).toBeNull();
        expect(d.sidecar.child.signalCode).toBeNull();
        await p.client.getStatus();
        await d.client.getStatus();
      } finally {
        await pair.close();
      }
    }, 60_000);
  }
});

describe("endpoints beyond loopback (multi-process)", () => {
  it("6: a gRPC API or metrics endpoint on 0.0.0.0 without TLS is warned about at start-up (log and lastErrors)", async () => {
    const sc = new SidecarProcess([
      "--engine-id",
      uniqueId("open-api"),
      "--grpc",
      "0.0.0.0:0",
      "--metrics",
      "0.0.0.0:0",
    ]);
    try {
      const ready = await sc.ready;
      await until(
        () => sc.stderrTail.includes("--grpc 0.0.0.0:0 listens beyond loopback without TLS"),
        WAIT,
        "the gRPC warning",
      );
      // Logged right after the gRPC one, but it may reach this process in a later read of stderr.
      await until(
        () => sc.stderrTail.includes("--metrics 0.0.0.0:0 listens beyond loopback without TLS"),
        WAIT,
        "the metrics warning",
      );
      const c = new SidecarClient(`127.0.0.1:${ready.grpc!.split(":").at(-1)}`, {
        timeoutMs: 5000,
      });
      try {
        const st = await c.getStatus();
        expect(st.lastErrors.filter((e) => e.includes("WARNING: --"))).toHaveLength(2);
      } finally {
        c.close();
      }
    } finally {
      await sc.close(3000);
    }
  }, 30_000);
});
