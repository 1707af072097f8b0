// The cheap attacks of issue 48 ("round 4") against real authenticated sidecars (processes from
// dist/, simulated engines, UCX over shared memory, mutual TLS side channels): each runs while
// legitimate transfers, handshakes, probes or watches go on, and the test counts them (verified
// and failed), times the recovery once the attacker stops, and reads the attacked sidecar's RSS
// and CPU before, during and after. The attacker is this test process: raw TCP, HTTP and HTTP/2
// from many loopback addresses (Linux routes all 127/8 to lo), and authenticated insiders with
// the cluster's certificates (rogue-peer.ts). Each prints one line with its figures (the
// closing note of issue 48 and docs/security.md quote them). `npm run build` first.
import { readFileSync } from "node:fs";
import * as net from "node:net";
import * as tls from "node:tls";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { SidecarClient } from "../../../src/api/client.js";
import { sharedPki } from "../../../sim/pki.js";
import { RawGrpc, type RawCall } from "../../api/raw-grpc.js";
import { RoguePeer, credentials } from "./rogue-peer.js";
import { KvNode, type Pair, goodTransfer, rssKiB, sleep, startPair } from "./fixtures.js";
import { until } from "../../until.js";

const MiB = (kib: number) => Math.round(kib / 1024);

/** CPU time (user + system) of `pid`, in ms (clock ticks of 10 ms). */
function cpuMs(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
  const f = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
  return (Number(f[11]) + Number(f[12])) * 10;
}

/** RSS (MiB) and CPU (% of one core) of `pid` over `ms`. */
async function usage(pid: number, ms = 1000): Promise<{ rss: number; cpu: number }> {
  const c0 = cpuMs(pid);
  const t0 = Date.now();
  await sleep(ms);
  const cpu = Math.round(((cpuMs(pid) - c0) / (Date.now() - t0)) * 100);
  return { rss: MiB(rssKiB(pid)), cpu };
}

const fmt = (u: { rss: number; cpu: number }) => `${u.rss} MiB ${u.cpu}%`;

/**
 * Keeps `perAddress` connections open from each of `addresses`, each reopened (after `open`
 * sets it up) as soon as the server closes it, until stopped. Counts the connections opened.
 */
class Reconnector {
  opened = 0;
  private stopped = false;
  private readonly loops: Promise<void>[] = [];
  private readonly live = new Set<net.Socket>();

  constructor(
    addresses: string[],
    perAddress: number,
    connect: (from: string) => net.Socket,
    /** Bounds each connection's life (a connection the server keeps is closed and reopened). */
    maxLifeMs = 30_000,
  ) {
    for (const from of addresses)
      for (let i = 0; i < perAddress; i++)
        this.loops.push(
          (async () => {
            while (!this.stopped && this.opened < 200_000) {
              this.opened++;
              const s = connect(from);
              this.live.add(s);
              s.on("error", () => undefined);
              await Promise.race([new Promise((r) => s.once("close", r)), sleep(maxLifeMs)]);
              s.destroy();
              this.live.delete(s);
              // A refused connection comes back at once: do not spin.
              if (!this.stopped) await sleep(5);
            }
          })(),
        );
  }

  async stop(): Promise<void> {
    this.stopped = true;
    for (const s of this.live) s.destroy();
    await Promise.all(this.loops);
  }
}

const addresses = (prefix: string, n: number) =>
  Array.from({ length: n }, (_, k) => `${prefix}.${k + 1}`);

describe("issue 48: cheap attacks (multi-process, authenticated)", () => {
  let pair: Pair;
  let p: KvNode;
  let d: KvNode;
  const rogues: RoguePeer[] = [];
  const extra: KvNode[] = [];

  const rogue = async (id: string): Promise<RoguePeer> => {
    const r = new RoguePeer(id, 0x48_0000n + BigInt(rogues.length), p.engine.ready!.layout);
    rogues.push(r);
    const res = await r.handshake(p.sideChannel, { creds: credentials(sharedPki(), id) });
    expect(res.errorCode).toBe("");
    return r;
  };

  /** `n` legitimate handshakes of an engine P has not seen (a new peer), one after another. */
  const handshakes = async (n: number) => {
    const probe = new RoguePeer("newcomer", 0x48_ffffn, p.engine.ready!.layout);
    rogues.push(probe);
    const creds = credentials(sharedPki(), "newcomer");
    let ok = 0;
    const failed: string[] = [];
    for (let i = 0; i < n; i++) {
      try {
        const res = await probe.handshake(p.sideChannel, { creds, timeoutMs: 5000 });
        if (res.errorCode === "") ok++;
        else failed.push(res.errorCode);
      } catch (err) {
        failed.push((err as { code?: string }).code ?? String(err));
      }
    }
    return { ok, failed };
  };

  beforeAll(async () => {
    // A 5 s lease: what insiders withdrew is remembered that long (for a late PrefillDone).
    pair = await startPair({
      mode: "auto",
      pArgs: ["--metrics", "127.0.0.1:0", "--lease-ms", "5000"],
      dArgs: ["--metrics", "127.0.0.1:0"],
    });
    p = pair.p;
    d = pair.d;
    await goodTransfer(p, d, "warm-up");
  }, 60_000);

  afterAll(async () => {
    for (const r of rogues) r.close();
    await Promise.all(extra.map((n) => n.close()));
    await pair?.close();
  });

  it("1: 152 silent connections from 19 addresses, each reopened when closed: new peers' handshakes and a fresh D's transfers all succeed; nothing is held past 2 s", async () => {
    const pid = p.sidecarPid;
    const port = Number(p.sideChannel.split(":").at(-1));
    const before = await usage(pid, 500);
    const attack = new Reconnector(addresses("127.0.2", 19), 8, (from) =>
      net.connect({ host: "127.0.0.1", port, localAddress: from }),
    );
    const t0 = Date.now();
    let fresh: KvNode | undefined;
    try {
      await sleep(2500); // the attacker has its connections open and reopens them
      const hs = await handshakes(20);
      fresh = await KvNode.start({ role: "decode", mode: "auto" });
      extra.push(fresh);
      let verified = 0;
      const failed: string[] = [];
      for (const [k, pull] of [false, true, false, true].entries()) {
        try {
          await goodTransfer(p, fresh, `fresh-48-1-${k}`, { pull });
          verified++;
        } catch (err) {
          failed.push(String(err));
        }
      }
      const during = await usage(pid, 1000);
      const opened = attack.opened;
      const attackMs = Date.now() - t0;
      await attack.stop();
      const tStop = Date.now();
      const again = await handshakes(1);
      const recoveredMs = Date.now() - tStop;
      await sleep(2500); // every connection the attacker left is closed by P's deadline
      const after = await usage(pid, 500);
      console.log(
        `48.1: ${opened} attacker connections in ${attackMs} ms from 19 addresses; new-peer handshakes ${hs.ok}/20 ` +
          `(failed ${hs.failed.length}); fresh D's transfers ${verified}/4 verified, ${failed.length} failed; ` +
          `next handshake ${recoveredMs} ms after the attack; P ${fmt(before)} / ${fmt(during)} / ${fmt(after)} (RSS, CPU before / during / after)`,
      );
      expect(hs.failed).toEqual([]);
      expect(failed).toEqual([]);
      expect(again.ok).toBe(1);
      expect(
        opened,
        "P closed the silent connections and the attacker reopened them",
      ).toBeGreaterThan(152 * 2);
    } finally {
      await attack.stop();
    }
  }, 90_000);

  it("1: 64 insider connections that finish TLS and then idle (8 identities x 8), reopened: a new peer's handshakes succeed, every one", async () => {
    const pid = p.sidecarPid;
    const port = Number(p.sideChannel.split(":").at(-1));
    const ids = Array.from({ length: 8 }, (_, k) => `idler-${k}`);
    const creds = ids.map((id) => credentials(sharedPki(), id));
    const before = await usage(pid, 500);
    let k = 0;
    const attack = new Reconnector(addresses("127.0.3", 8), 8, (from) => {
      const c = creds[k++ % creds.length]!;
      const sock = net.connect({ host: "127.0.0.1", port, localAddress: from });
      const t = tls.connect({ socket: sock, ...c, checkServerIdentity: () => undefined });
      t.on("error", () => undefined);
      t.resume();
      t.once("close", () => sock.destroy());
      return sock;
    });
    try {
      await sleep(1500);
      const t0 = Date.now();
      const hs = await handshakes(20);
      await goodTransfer(p, d, "insiders-idle-during", { pull: true });
      const during = await usage(pid, 1000);
      const opened = attack.opened;
      await attack.stop();
      const tStop = Date.now();
      const again = await handshakes(1);
      const recoveredMs = Date.now() - tStop;
      const after = await usage(pid, 500);
      console.log(
        `48.1 (insiders): ${opened} TLS connections idling after the handshake (8 identities); new-peer handshakes ${hs.ok}/20 in ${Date.now() - t0} ms ` +
          `(failed ${hs.failed.length}); a transfer verified; next handshake ${recoveredMs} ms after; P ${fmt(before)} / ${fmt(during)} / ${fmt(after)}`,
      );
      expect(hs.failed).toEqual([]);
      expect(again.ok).toBe(1);
    } finally {
      await attack.stop();
    }
  }, 90_000);

  it("2: 8 addresses x 8 kept-alive connections scraping /metrics (and 64 silent ones): GET /ready from another address is answered every time; gRPC health too, past 8 addresses x 32 connections each holding a watch", async () => {
    const pid = p.sidecarPid;
    const mport = Number(p.ready.metrics!.split(":").at(-1));
    const before = await usage(pid, 500);
    // Scrapers: one request every 300 ms on each kept-alive connection (never idle long enough).
    const scrapers = new Reconnector(addresses("127.0.4", 8), 8, (from) => {
      const s = net.connect({ host: "127.0.0.1", port: mport, localAddress: from });
      s.resume();
      const tick = setInterval(
        () => s.write("GET /metrics HTTP/1.1\r\nHost: p\r\nConnection: keep-alive\r\n\r\n"),
        300,
      );
      s.once("connect", () => s.write("GET /metrics HTTP/1.1\r\nHost: p\r\n\r\n"));
      s.once("close", () => clearInterval(tick));
      return s;
    });
    const silent = new Reconnector(addresses("127.0.5", 8), 8, (from) =>
      net.connect({ host: "127.0.0.1", port: mport, localAddress: from }),
    );
    // gRPC: 8 addresses x 32 connections, each with a WatchEvents stream open.
    const gport = Number(p.ready.grpc!.split(":").at(-1));
    const grpcAttack: RawGrpc[] = [];
    const watches: RawCall[] = [];
    try {
      await sleep(1000);
      for (const from of addresses("127.0.6", 8))
        for (let i = 0; i < 32; i++) {
          const c = await RawGrpc.connect(gport, from).catch(() => undefined);
          if (c === undefined) continue;
          grpcAttack.push(c);
          watches.push(c.watch());
        }
      let ready = 0;
      const readyFailed: string[] = [];
      for (let i = 0; i < 30; i++) {
        try {
          const res = await fetch(`http://127.0.0.1:${mport}/ready`, {
            signal: AbortSignal.timeout(1000),
            headers: { connection: "close" },
          });
          if (res.status === 200 && (await res.text()) === "SERVING\n") ready++;
          else readyFailed.push(String(res.status));
        } catch (err) {
          readyFailed.push(String(err));
        }
      }
      let health = 0;
      const healthFailed: string[] = [];
      for (let i = 0; i < 10; i++) {
        const c = new SidecarClient(p.ready.grpc!, { timeoutMs: 2000 });
        try {
          if ((await c.health()) === "SERVING") health++;
        } catch (err) {
          healthFailed.push(String(err));
        } finally {
          c.close();
        }
      }
      const during = await usage(pid, 1000);
      const attackers = scrapers.opened + silent.opened + grpcAttack.length;
      await scrapers.stop();
      await silent.stop();
      for (const c of grpcAttack) c.close();
      const tStop = Date.now();
      const res = await fetch(`http://127.0.0.1:${mport}/ready`);
      const recoveredMs = Date.now() - tStop;
      const after = await usage(pid, 500);
      console.log(
        `48.2: ${attackers} attacker connections (64 scraping, 64 silent, 256 gRPC with watches); GET /ready ${ready}/30 ` +
          `(failed ${readyFailed.length}); gRPC health ${health}/10 (failed ${healthFailed.length}); ` +
          `next probe ${recoveredMs} ms after; P ${fmt(before)} / ${fmt(during)} / ${fmt(after)}`,
      );
      expect(readyFailed).toEqual([]);
      expect(healthFailed).toEqual([]);
      expect(res.status).toBe(200);
    } finally {
      await scrapers.stop();
      await silent.stop();
      for (const c of grpcAttack) c.close();
    }
  }, 90_000);

  it("3: eight colluding insiders, each within its share, send 8 x 8,192 PushRegs for random ids (and heartbeats): every legitimate transfer verifies; their registrations go within seconds of their silence", async () => {
    const pid = p.sidecarPid;
    const colluders = await Promise.all(
      Array.from({ length: 8 }, (_, k) => rogue(`colluder-${k}`)),
    );
    const before = await usage(pid, 500);
    const t0 = Date.now();
    let stop = false;
    let sent = 0;
    let pastHalf!: () => void;
    const half = new Promise<void>((r) => (pastHalf = r));
    const floods = colluders.map(async (r, k) => {
      const ids: string[] = [];
      for (let i = 0; i < 8192 && !stop;) {
        const batch: Promise<void>[] = [];
        for (let j = 0; j < 256; j++, i++) {
          const transferId = `col-${k}-${i}-${Math.random().toString(36).slice(2)}`;
          ids.push(transferId);
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
        await Promise.allSettled(batch);
        sent += 256;
        if (sent >= 32_768) pastHalf();
        await sleep(2);
      }
      // Then heartbeats renew what they registered, until the test stops them.
      while (!stop) {
        for (let i = 0; i < ids.length && !stop; i += 1000)
          await r
            .send(r.seal({ case: "heartbeat", value: { transferIds: ids.slice(i, i + 1000) } }))
            .catch(() => undefined);
        await sleep(500);
      }
    });
    try {
      await half;
      let verified = 0;
      const failed: string[] = [];
      let peak = 0;
      for (let k = 0; k < 8; k++) {
        try {
          await goodTransfer(p, d, `colluded-${k}`, { pull: k % 2 === 1 });
          verified++;
        } catch (err) {
          failed.push(String(err));
        }
        peak = Math.max(peak, MiB(rssKiB(pid)));
      }
      const during = await usage(pid, 1000);
      const st = await p.client.getStatus();
      const waiting = st.transfersByState["prefill:WAITING"] ?? 0;
      stop = true;
      await Promise.all(floods);
      const floodMs = Date.now() - t0;
      for (const r of colluders) {
        r.close();
        rogues.splice(rogues.indexOf(r), 1);
      }
      const tSilent = Date.now();
      await until(
        async () => ((await p.client.getStatus()).transfersByState["prefill:WAITING"] ?? 0) === 0,
        20_000,
        "the colluders' registrations gone after they went silent",
        200,
      );
      const goneMs = Date.now() - tSilent;
      await goodTransfer(p, d, "after-colluders");
      const after = await usage(pid, 500);
      console.log(
        `48.3: ${sent} PushRegs from 8 insiders in ${floodMs} ms; legitimate transfers ${verified}/8 verified during it, ` +
          `${failed.length} failed; P kept ${waiting} of theirs (pool 8,192); their registrations gone ${goneMs} ms after they went silent; ` +
          `P ${fmt(before)} / ${fmt(during)} (peak ${peak} MiB) / ${fmt(after)}`,
      );
      expect(failed).toEqual([]);
      expect(waiting).toBeLessThanOrEqual(8192);
    } finally {
      stop = true;
      await Promise.all(floods);
    }
  }, 120_000);

  it("3: twelve insiders register first for a transfer id they know; the real D's push is kept, not refused ERR_DUPLICATE, and verifies", async () => {
    const ids = Array.from({ length: 12 }, (_, k) => `first-${k}`);
    const insiders = await Promise.all(ids.map((id) => rogue(id)));
    const id = "known-id-48";
    const t0 = Date.now();
    for (const r of insiders)
      await r.send(
        r.seal({
          case: "pushReg",
          value: {
            transferId: id,
            blockIds: [0, 1, 2],
            numTokens: 40,
            prefixTokens: 0,
            leaseMs: 30_000,
            token: "guess",
          },
        }),
      );
    await until(
      async () => {
        const { transfers } = await p.client.listTransfers({ peer: "first-0" });
        return transfers.some((x) => x.transferId === id);
      },
      5000,
      "the insiders' registrations",
    );
    await goodTransfer(p, d, id);
    for (const r of insiders) expect(r.untouched()).toBe(true);
    await until(
      () => insiders.every((r) => r.received.some((m) => m.body.case === "failed")),
      5000,
      "each insider told its registration was refused",
    );
    const codes = new Set(
      insiders.flatMap((r) =>
        r.received
          .filter((m) => m.body.case === "failed")
          .map((m) => (m.body.value as { code: string }).code),
      ),
    );
    console.log(
      `48.3 (pending slots): 12 insiders registered first; the real push verified (1/1) ${Date.now() - t0} ms after; insiders told ${[...codes].join(", ")}`,
    );
    expect([...codes]).toEqual(["ERR_BAD_TRANSFER_TOKEN"]);
    for (const r of insiders) {
      r.close();
      rogues.splice(rogues.indexOf(r), 1);
    }
  }, 60_000);

  it("4: 4 addresses x 250 WatchEvents and 4,096 AwaitTransfer calls from one address on D: the router's watch and await are served; D's memory stays bounded", async () => {
    const pid = d.sidecarPid;
    const gport = Number(d.ready.grpc!.split(":").at(-1));
    const before = await usage(pid, 500);
    const conns: RawGrpc[] = [];
    const calls: RawCall[] = [];
    try {
      for (const from of addresses("127.0.7", 4))
        for (let c = 0; c < 2; c++) {
          const conn = await RawGrpc.connect(gport, from);
          conns.push(conn);
          for (let i = 0; i < 125; i++) calls.push(conn.watch());
        }
      await Promise.all(calls.map((c) => Promise.race([c.firstMessage, c.status])));
      const awaits: RawCall[] = [];
      for (let c = 0; c < 32; c++) {
        const conn = await RawGrpc.connect(gport, "127.0.8.1");
        conns.push(conn);
        for (let i = 0; i < 128; i++) awaits.push(conn.await(`never-${c}-${i}`));
      }
      // D answers the calls past the client's share RESOURCE_EXHAUSTED as it reads them: wait
      // (bounded) until it has answered as many as the share requires, however loaded it is.
      let refusedAwaits = 0;
      for (const a of awaits) void a.status.then((s) => (refusedAwaits += s === 8 ? 1 : 0));
      await until(
        () => refusedAwaits >= 4096 - 2048,
        20_000,
        () => `D refusing the awaits past the share (${refusedAwaits} so far)`,
      );
      await sleep(200);
      const during = await usage(pid, 1000);
      // The router: a watch that sees a real transfer's KV_READY, and an await for it.
      const router = new SidecarClient(d.ready.grpc!, { timeoutMs: 5000 });
      const seen: string[] = [];
      const w = router.watch({}, (ev) => seen.push(`${ev.kind}:${ev.transferId}`));
      try {
        await until(() => w.epoch !== undefined, 5000, "the router's watch open");
        const awaited = router.awaitTransfer("routed-48-4", 20_000);
        await goodTransfer(p, d, "routed-48-4");
        expect((await awaited).kind).toBe("KV_READY");
        await until(() => seen.includes("KV_READY:routed-48-4"), 5000, "the router's watch saw it");
      } finally {
        w.cancel();
        router.close();
      }
      const dislodged = (
        await Promise.all(
          calls.slice(0, 10).map((c) => Promise.race([c.status, sleep(50).then(() => -2)])),
        )
      ).filter((s) => s === 8).length;
      for (const c of conns) c.close();
      const after = await usage(pid, 1000);
      console.log(
        `48.4: 1,000 attacker watches (4 addresses), 4,096 awaits from one address (${refusedAwaits} refused at its share); ` +
          `the router's watch and await served (1/1 each); ${dislodged}/10 of the oldest attacker watches displaced; ` +
          `D ${fmt(before)} / ${fmt(during)} / ${fmt(after)}`,
      );
      expect(refusedAwaits).toBeGreaterThanOrEqual(4096 - 2048);
      expect(during.rss - before.rss).toBeLessThan(150);
    } finally {
      for (const c of conns) c.close();
    }
  }, 90_000);

  it("4: an insider's bad-MAC flood is charged to its budget before any MAC is checked: legitimate transfers verify, P's CPU stays bounded", async () => {
    const pid = p.sidecarPid;
    const r = await rogue("forger");
    const before = await usage(pid, 500);
    let stop = false;
    let sent = 0;
    const bad = new Uint8Array(32).fill(7);
    const flood = (async () => {
      while (!stop && sent < 2_000_000) {
        const batch: Promise<void>[] = [];
        for (let i = 0; i < 500; i++, sent++)
          batch.push(
            r.send(r.seal({ case: "heartbeat", value: { transferIds: [] } }, { key: bad })),
          );
        await Promise.allSettled(batch);
        await sleep(1);
      }
    })();
    const t0 = Date.now();
    try {
      await sleep(500);
      const during = await usage(pid, 2000);
      let verified = 0;
      for (const pull of [false, true, false]) {
        await goodTransfer(p, d, `forged-flood-${verified}`, { pull });
        verified++;
      }
      stop = true;
      await flood;
      const rate = Math.round((sent / (Date.now() - t0)) * 1000);
      const st = await p.client.getStatus();
      const after = await usage(pid, 500);
      console.log(
        `48.4 (MAC): ${sent} bad-MAC notifications (${rate}/s); legitimate transfers ${verified}/3 verified; ` +
          `P ${fmt(before)} / ${fmt(during)} / ${fmt(after)}`,
      );
      expect(st.lastErrors.some((e) => /from 'forger' dropped: over/.test(e))).toBe(true);
      expect(
        st.lastErrors.some((e) => /claiming 'forger' refused: ERR_UNAUTHENTICATED/.test(e)),
      ).toBe(true);
    } finally {
      stop = true;
      await flood;
      r.close();
      rogues.splice(rogues.indexOf(r), 1);
    }
  }, 60_000);

  it("5: an id with a homoglyph, a no-break space or a combining mark is refused by name; ListTransfers cannot show two different 'req-42'", async () => {
    const since = p.engine.events.length;
    for (const id of ["r\u0435q-42", "req\u00a042", "re\u0301q-42", "req 42"])
      await p.engine.prefill(id, 40, 0, 5000).catch(() => undefined);
    for (const id of ["r\u0435q-42", "req\u00a042", "re\u0301q-42", "req 42"]) {
      const refused = await p.refusal(id, since);
      expect(refused.code).toBe("ERR_BAD_TRANSFER_ID");
    }
    await goodTransfer(p, d, "req-42");
    const listed = (await p.client.listTransfers()).transfers.filter((t) =>
      /q.?42|req/.test(t.transferId),
    );
    expect(listed.map((t) => t.transferId)).toEqual(["req-42"]);
  }, 30_000);
});
