// The side channel's connection slots (issues 31 and 48), in process over loopback with a real
// SideChannelServer, plain and mutual TLS. Connections that send nothing, five bytes of a TLS
// header, or one byte at a time are closed at the hello deadline; a full pool displaces the
// oldest connection of the largest address group instead of refusing a newcomer; authenticated
// connections live in a pool of their own, a few per identity; and a handshake from another
// address is answered throughout, whatever number of addresses the attacker uses. The attacker
// uses 127.0.0.2 and up (Linux routes all 127/8 to lo). Deadlines are shortened for speed.
import * as net from "node:net";

import { create } from "@bufbuild/protobuf";
import { pino } from "pino";
import { afterAll, afterEach, describe, expect, it } from "vitest";

import {
  HandshakeRequestSchema,
  HandshakeResponseSchema,
} from "../../src/gen/kvxfer/v1/peer_pb.js";
import {
  SideChannelServer,
  handshake,
  type PeerCredentials,
  type SideChannelLimits,
} from "../../src/peer/side-channel.js";
import { Pki } from "../../sim/pki.js";
import { credentials } from "../sidecar/multiprocess/rogue-peer.js";

const servers: SideChannelServer[] = [];
const attackers: net.Socket[] = [];
afterEach(async () => {
  for (const s of attackers.splice(0)) s.destroy();
  await Promise.all(servers.splice(0).map((s) => s.close()));
});
const pki = new Pki("slots test CA");
afterAll(() => pki.close());

const refusedLog: string[] = [];
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function serve(creds: PeerCredentials | undefined, limits: Partial<SideChannelLimits>) {
  const s = new SideChannelServer(
    () => create(HandshakeResponseSchema, { errorCode: "", error: "" }),
    pino({ level: "silent" }),
    (code, message) => refusedLog.push(`${code}: ${message}`),
    creds,
    limits,
  );
  servers.push(s);
  const address = await s.bind("127.0.0.1:0");
  return { s, address, port: Number(address.split(":")[1]) };
}

interface Conn {
  socket: net.Socket;
  /** Milliseconds from connect to close. */
  closed: Promise<number>;
}

/** A connection from `from` that stays open until the server closes it; resolves once connected. */
function connect(port: number, from: string): Promise<Conn> {
  return new Promise((resolve, reject) => {
    const socket = net.connect({ host: "127.0.0.1", port, localAddress: from });
    attackers.push(socket);
    const t0 = Date.now();
    const closed = new Promise<number>((r) => socket.once("close", () => r(Date.now() - t0)));
    socket.on("error", () => undefined);
    socket.resume();
    socket.once("connect", () => resolve({ socket, closed }));
    socket.once("error", reject);
    socket.once("close", () => reject(new Error("closed before it connected")));
  });
}

/** True once `c` is closed, within `ms`. */
async function closedWithin(c: Conn, ms: number): Promise<boolean> {
  return Promise.race([c.closed.then(() => true), sleep(ms).then(() => false)]);
}

const req = () => create(HandshakeRequestSchema, {});

for (const tlsOn of [false, true]) {
  describe(`side channel slots (${tlsOn ? "mutual TLS" : "plain TCP"})`, () => {
    const serverCreds = () => (tlsOn ? credentials(pki, "p0") : undefined);
    const clientCreds = () => (tlsOn ? credentials(pki, "d0") : undefined);

    it("silent, header-only and trickling connections close at the hello deadline; a handshake from elsewhere is answered meanwhile", async () => {
      const helloMs = 400;
      const { s, port, address } = await serve(serverCreds(), {
        helloMs,
        authMs: 1500,
        deadlineMs: 3000,
      });
      const silent: Conn[] = [];
      for (let i = 0; i < 40; i++) silent.push(await connect(port, `127.0.0.${2 + (i % 8)}`));
      // TLS: a record header announcing 512 bytes that never come; plain: 3 bytes of the length.
      const header = await connect(port, "127.0.0.10");
      header.socket.write(Buffer.from(tlsOn ? [0x16, 0x03, 0x01, 0x02, 0x00] : [0, 0, 0]));
      // One byte at a time: never a whole first record (plain: never a whole length).
      const trickle = await connect(port, "127.0.0.11");
      const drip = setInterval(
        () => trickle.socket.write(Buffer.from([tlsOn ? 0x16 : 0])),
        tlsOn ? 50 : 150,
      );
      try {
        await sleep(50);
        expect(s.inFlight).toBe(42);
        const res = await handshake(address, req(), 2000, clientCreds());
        expect(res.response.errorCode).toBe("");
        const times = await Promise.all([...silent, header, trickle].map((c) => c.closed));
        for (const ms of times) {
          expect(ms).toBeGreaterThanOrEqual(helloMs - 50);
          expect(ms).toBeLessThan(helloMs + 700);
        }
      } finally {
        clearInterval(drip);
      }
      const end = Date.now() + 2000;
      while (s.inFlight > 0 && Date.now() < end) await sleep(20);
      expect(s.inFlight).toBe(0);
    }, 20_000);

    it("a full pool displaces the oldest connection of the largest address group (its own oldest when the newcomer's group is the largest), never refusing at accept", async () => {
      const { s, port } = await serve(serverCreds(), {
        opening: 8,
        helloMs: 60_000,
        authMs: 60_000,
        deadlineMs: 60_000,
      });
      const a: Conn[] = [];
      for (let i = 0; i < 6; i++) a.push(await connect(port, "127.0.0.2"));
      const b1 = await connect(port, "127.0.0.3");
      const b2 = await connect(port, "127.0.0.3");
      await sleep(50);
      expect(s.inFlight).toBe(8);
      // A newcomer from a third address: the largest group's (127.0.0.2) oldest goes.
      const c1 = await connect(port, "127.0.0.4");
      expect(await closedWithin(a[0]!, 1000)).toBe(true);
      expect(await closedWithin(c1, 100)).toBe(false);
      // 127.0.0.2 is still the largest (5): its next one displaces its own oldest.
      await connect(port, "127.0.0.2");
      expect(await closedWithin(a[1]!, 1000)).toBe(true);
      expect(await closedWithin(b1, 100)).toBe(false);
      expect(await closedWithin(b2, 100)).toBe(false);
      await sleep(50);
      expect(s.inFlight).toBe(8);
      await sleep(1100); // the report comes at most once a second
      expect(
        refusedLog.some((l) => /ERR_OVERLOADED: side channel: \d+ connections? displaced/.test(l)),
      ).toBe(true);
    }, 20_000);

    it("an attacker on 19 addresses reconnecting as fast as the pool turns over: legitimate handshakes are answered, every one", async () => {
      const { port, address } = await serve(serverCreds(), {
        opening: 32,
        helloMs: 300,
        authMs: 1000,
        deadlineMs: 3000,
      });
      let stop = false;
      let opened = 0;
      const t0 = Date.now();
      // Each attacker address keeps 4 connections, reopening each as soon as it is closed.
      const loops = Array.from({ length: 19 * 4 }, async (_, k) => {
        while (!stop && opened < 5000) {
          opened++;
          const c = await connect(port, `127.0.1.${1 + (k % 19)}`).catch(() => undefined);
          if (c === undefined) continue;
          await Promise.race([c.closed, sleep(2000)]);
          c.socket.destroy();
        }
      });
      try {
        await sleep(200);
        let ok = 0;
        const failed: string[] = [];
        for (let i = 0; i < 10; i++) {
          try {
            const res = await handshake(address, req(), 2000, clientCreds());
            if (res.response.errorCode === "") ok++;
            else failed.push(res.response.errorCode);
          } catch (err) {
            failed.push(String(err));
          }
        }
        console.log(
          `attack: ${opened} attacker connections in ${Date.now() - t0} ms, ${ok}/10 handshakes`,
        );
        expect(failed).toEqual([]);
        expect(ok).toBe(10);
        expect(opened, "the attacker kept the pool full").toBeGreaterThan(76);
      } finally {
        stop = true;
        for (const s of attackers) s.destroy();
        await Promise.all(loops);
      }
    }, 30_000);
  });
}

describe("side channel slots (mutual TLS only)", () => {
  it("a complete ClientHello that goes no further is closed at the TLS deadline; bytes that are no TLS at once", async () => {
    const { port } = await serve(credentials(pki, "p0"), {
      helloMs: 300,
      authMs: 900,
      deadlineMs: 5000,
    });
    // A real ClientHello, taken from a real client, then nothing.
    const hello = await new Promise<Buffer>((resolve) => {
      const grab = net.createServer((sock) =>
        sock.once("data", (d: Buffer) => {
          resolve(d);
          sock.destroy();
          grab.close();
        }),
      );
      grab.listen(0, "127.0.0.1", () => {
        const c = credentials(pki, "d0");
        const port = (grab.address() as net.AddressInfo).port;
        import("node:tls").then((tls) => {
          const t = tls.connect({
            host: "127.0.0.1",
            port,
            ...c,
            checkServerIdentity: () => undefined,
          });
          t.on("error", () => undefined);
        });
      });
    });
    expect(hello[0]).toBe(0x16);
    const stalled = await connect(port, "127.0.0.2");
    stalled.socket.write(hello);
    const notTls = await connect(port, "127.0.0.3");
    notTls.socket.write("GET / HTTP/1.1\r\n\r\n");
    expect(await notTls.closed).toBeLessThan(200);
    const ms = await stalled.closed;
    expect(ms).toBeGreaterThanOrEqual(850);
    expect(ms).toBeLessThan(1800);
    expect(
      refusedLog.some((l) =>
        l.includes("TLS handshake failed: the first record is not a TLS handshake from"),
      ),
    ).toBe(true);
  }, 20_000);

  it("authenticated connections that idle hold their own pool, a few per identity; another engine's handshake is answered; they close at the request deadline", async () => {
    const { s, port, address } = await serve(credentials(pki, "p0"), {
      helloMs: 1000,
      authMs: 2000,
      requestMs: 800,
      deadlineMs: 5000,
      perIdentity: 4,
      opening: 8,
    });
    const tls = await import("node:tls");
    const insider = credentials(pki, "insider");
    const idle: Promise<number>[] = [];
    const secured: Promise<void>[] = [];
    for (let i = 0; i < 20; i++) {
      const t0 = Date.now();
      const t = tls.connect({
        host: "127.0.0.1",
        port,
        ...insider,
        checkServerIdentity: () => undefined,
      });
      t.on("error", () => undefined);
      t.resume();
      secured.push(new Promise((r) => t.once("secureConnect", () => r())));
      idle.push(new Promise((r) => t.once("close", () => r(Date.now() - t0))));
    }
    await Promise.all(secured);
    await sleep(100);
    expect(s.slotCounts.authenticated).toBe(4);
    // 16 of them were displaced by the insider's own newer connections.
    const times = await Promise.all(idle);
    expect(times.filter((ms) => ms < 700).length).toBe(16);
    const res = await handshake(address, req(), 2000, credentials(pki, "d0"));
    expect(res.response.errorCode).toBe("");
    for (const ms of times.filter((ms) => ms >= 700)) expect(ms).toBeLessThan(2500);
  }, 20_000);

  it("the hard deadline holds whatever is sent: the whole exchange is bounded", async () => {
    const { port } = await serve(undefined, { helloMs: 200, authMs: 400, deadlineMs: 600 });
    const c = await connect(port, "127.0.0.2");
    // The length of a large request, then a byte at a time: the request never completes.
    const head = Buffer.alloc(4);
    head.writeUInt32BE(1000, 0);
    c.socket.write(head);
    const drip = setInterval(() => c.socket.write(Buffer.from([0])), 50);
    try {
      const ms = await c.closed;
      expect(ms).toBeGreaterThanOrEqual(380);
      expect(ms).toBeLessThan(900);
    } finally {
      clearInterval(drip);
    }
  }, 10_000);
});
