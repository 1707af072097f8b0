// The side channel's pre-authentication slots (issue 31, case 1), in process over loopback with
// a real SideChannelServer, plain and mutual TLS: connections that send nothing, five bytes of a
// TLS header, or one byte at a time take at most their source's share of the slots, and every
// connection is closed at its deadline whatever it sends. A handshake from another address is
// answered throughout. The attacker uses 127.0.0.2 and 127.0.0.3 (Linux routes all 127/8 to lo).
import * as net from "node:net";

import { create } from "@bufbuild/protobuf";
import { pino } from "pino";
import { afterAll, afterEach, describe, expect, it } from "vitest";

import {
  HandshakeRequestSchema,
  HandshakeResponseSchema,
} from "../../src/gen/kvxfer/v1/peer_pb.js";
import {
  MAX_HANDSHAKES_IN_FLIGHT,
  MAX_HANDSHAKES_PER_SOURCE,
  SideChannelServer,
  handshake,
  type PeerCredentials,
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

async function serve(creds: PeerCredentials | undefined, deadlineMs: number) {
  const s = new SideChannelServer(
    () => create(HandshakeResponseSchema, { errorCode: "", error: "" }),
    pino({ level: "silent" }),
    (code, message) => refusedLog.push(`${code}: ${message}`),
    creds,
    { deadlineMs },
  );
  servers.push(s);
  const address = await s.bind("127.0.0.1:0");
  return { s, address, port: Number(address.split(":")[1]) };
}

/** A connection from `from` that stays open until the server closes it; resolves once connected. */
function connect(
  port: number,
  from: string,
): Promise<{ socket: net.Socket; closed: Promise<number> }> {
  return new Promise((resolve, reject) => {
    const socket = net.connect({ host: "127.0.0.1", port, localAddress: from });
    attackers.push(socket);
    const t0 = Date.now();
    const closed = new Promise<number>((r) => socket.once("close", () => r(Date.now() - t0)));
    socket.on("error", () => undefined);
    socket.once("connect", () => resolve({ socket, closed }));
    socket.once("error", reject);
  });
}

const req = () => create(HandshakeRequestSchema, {});

for (const tlsOn of [false, true]) {
  describe(`side channel slots (${tlsOn ? "mutual TLS" : "plain TCP"})`, () => {
    it(`64 silent connections and a trickling one: the attacker holds its source's share, a handshake from elsewhere is answered, everything closes at the deadline`, async () => {
      const creds = tlsOn ? credentials(pki, "p0") : undefined;
      const deadlineMs = 1500;
      const { s, port, address } = await serve(creds, deadlineMs);
      const silent = [];
      for (let i = 0; i < MAX_HANDSHAKES_IN_FLIGHT; i++)
        silent.push(await connect(port, "127.0.0.2"));
      // Five bytes of a TLS record header, then one byte every 200 ms: not an idle connection.
      const trickle = await connect(port, "127.0.0.3");
      trickle.socket.write(Buffer.from([0x16, 0x03, 0x01, 0x02, 0x00]));
      const drip = setInterval(() => trickle.socket.write(Buffer.from([0])), 200);
      try {
        await new Promise((r) => setTimeout(r, 100));
        expect(s.inFlight).toBe(MAX_HANDSHAKES_PER_SOURCE + 1);
        // The attacker's connections past its share were closed at once.
        const early = await Promise.race([
          Promise.all(silent.slice(MAX_HANDSHAKES_PER_SOURCE).map((c) => c.closed)),
          new Promise<null>((r) => setTimeout(() => r(null), 1000)),
        ]);
        expect(early, "connections past the share closed at accept").not.toBeNull();
        expect(refusedLog.some((l) => l.includes(`from 127.0.0.2`))).toBe(true);
        // A legitimate handshake (from 127.0.0.1) during the attack is answered.
        const res = await handshake(
          address,
          req(),
          1000,
          tlsOn ? credentials(pki, "d0") : undefined,
        );
        expect(res.response.errorCode).toBe("");
        // Every attacker connection is closed at the deadline, the trickling one included.
        const held = await Promise.all(
          [...silent.slice(0, MAX_HANDSHAKES_PER_SOURCE), trickle].map((c) => c.closed),
        );
        for (const ms of held) {
          expect(ms).toBeGreaterThanOrEqual(deadlineMs - 100);
          expect(ms).toBeLessThan(deadlineMs + 1000);
        }
        // (The legitimate connection's own close may land a moment later; its deadline bounds it.)
        const end = Date.now() + deadlineMs;
        while (s.inFlight > 0 && Date.now() < end) await new Promise((r) => setTimeout(r, 20));
        expect(s.inFlight).toBe(0);
      } finally {
        clearInterval(drip);
      }
      // The slots are free again: the attacker's address gets its share back.
      const again = await connect(port, "127.0.0.2");
      await new Promise((r) => setTimeout(r, 50));
      expect(s.inFlight).toBe(1);
      again.socket.destroy();
    }, 20_000);
  });
}

it("the global cap: eight sources of eight fill the 64 slots; a ninth source is refused until one closes", async () => {
  const { s, port } = await serve(undefined, 60_000);
  for (let k = 0; k < MAX_HANDSHAKES_IN_FLIGHT / MAX_HANDSHAKES_PER_SOURCE; k++)
    for (let i = 0; i < MAX_HANDSHAKES_PER_SOURCE; i++) await connect(port, `127.0.1.${k + 1}`);
  await new Promise((r) => setTimeout(r, 100));
  expect(s.inFlight).toBe(MAX_HANDSHAKES_IN_FLIGHT);
  const ninth = await connect(port, "127.0.2.1");
  expect(await ninth.closed).toBeLessThan(1000);
  attackers[0]!.destroy();
  await new Promise((r) => setTimeout(r, 100));
  await connect(port, "127.0.2.1");
  await new Promise((r) => setTimeout(r, 100));
  expect(s.inFlight).toBe(MAX_HANDSHAKES_IN_FLIGHT);
}, 20_000);
