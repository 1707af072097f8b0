// The fault harness itself (issue 52), with plain TCP between the two namespaces: a cap is a
// cap, loss loses packets on the wire (TCP still delivers every byte), a one-way drop and a
// link down cut the link and healing restores it, netem is skipped by name where the kernel
// lacks it, and destroy leaves nothing behind. Needs root, tc and iptables.
import { execFileSync, spawn } from "node:child_process";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { FaultNet, faultSupport, type Side } from "../../bench/net/faults.js";

const support = faultSupport();

/** A TCP sink in `side`'s namespace: counts bytes per connection, prints the count at close. */
const SINK = `
const net = require("node:net");
const srv = net.createServer((s) => { let n = 0; s.on("data", (d) => (n += d.length));
  s.on("end", () => s.end(String(n))); s.on("error", () => {}); });
srv.listen(Number(process.argv[1]), "0.0.0.0", () => console.log("listening"));
`;

/** Sends `bytes` to host:port and reads the sink's count; prints {ms, got} or {error}. */
const SEND = `
const net = require("node:net");
const [host, port, bytes, timeoutMs] = process.argv.slice(1).map((x, i) => (i === 0 ? x : Number(x)));
const t0 = Date.now();
const s = net.connect({ host, port }, () => { s.end(Buffer.alloc(bytes, 7)); });
let reply = "";
s.on("data", (d) => (reply += d));
s.on("end", () => { console.log(JSON.stringify({ ms: Date.now() - t0, got: Number(reply) })); process.exit(0); });
s.on("error", (e) => { console.log(JSON.stringify({ error: e.code })); process.exit(0); });
setTimeout(() => { console.log(JSON.stringify({ error: "TIMEOUT" })); process.exit(0); }, timeoutMs);
`;

function nodeIn(
  net: FaultNet,
  side: Side,
  script: string,
  args: (string | number)[],
): ReturnType<typeof spawn> {
  const h = net.hosts[side];
  return spawn(
    h.prefix[0]!,
    [...h.prefix.slice(1), process.execPath, "-e", script, ...args.map(String)],
    {
      stdio: ["ignore", "pipe", "pipe"],
    },
  );
}

async function send(
  net: FaultNet,
  from: Side,
  to: { host: string; port: number },
  bytes: number,
  timeoutMs: number,
): Promise<{ ms?: number; got?: number; error?: string }> {
  const child = nodeIn(net, from, SEND, [to.host, to.port, bytes, timeoutMs]);
  let out = "";
  child.stdout!.on("data", (d: Buffer) => (out += d.toString()));
  const killer = setTimeout(() => child.kill("SIGKILL"), timeoutMs + 5_000);
  await new Promise((r) => child.on("exit", r));
  clearTimeout(killer);
  return JSON.parse(out.trim() || '{"error":"NO_OUTPUT"}') as {
    ms?: number;
    got?: number;
    error?: string;
  };
}

describe.skipIf(support.missing !== undefined)(
  `network fault harness${support.missing !== undefined ? ` (skipped: ${support.missing})` : ""}`,
  () => {
    let net: FaultNet;
    const sinks: ReturnType<typeof spawn>[] = [];
    const PORT = 40_052;
    const dSink = (): { host: string; port: number } => ({ host: net.hosts.d.address, port: PORT });

    beforeAll(async () => {
      net = new FaultNet("h", 52);
      for (const side of ["p", "d"] as const) {
        const c = nodeIn(net, side, SINK, [PORT]);
        sinks.push(c);
        await new Promise<void>((resolve, reject) => {
          const t = setTimeout(() => reject(new Error(`sink in ${side} not up`)), 10_000);
          c.stdout!.once("data", () => {
            clearTimeout(t);
            resolve();
          });
        });
      }
    }, 30_000);

    afterAll(() => {
      for (const c of sinks) c.kill("SIGKILL");
      net?.destroy();
    });

    it("joins the hosts by a data link (one wire packet per skb) and a management link", async () => {
      const r = await send(net, "p", dSink(), 1 << 20, 5_000);
      expect(r.got).toBe(1 << 20);
      // From this namespace, over the management link, never impaired.
      const h = net.hosts.d;
      expect(h.mgmtAddress).toMatch(/^198\.19\./);
      expect(net.hosts.p.address).toMatch(/^198\.18\./);
    });

    it("a tbf cap of 20 Mbit/s holds a bulk TCP flow to about that rate", async () => {
      const clean = await send(net, "p", dSink(), 4 << 20, 10_000);
      net.cap(20);
      try {
        const capped = await send(net, "p", dSink(), 4 << 20, 20_000);
        expect(capped.got).toBe(4 << 20);
        const mbit = ((4 << 20) * 8) / (capped.ms! / 1000) / 1e6;
        console.log(
          `[harness] 4 MiB: clean ${clean.ms} ms, capped at 20 Mbit/s ${capped.ms} ms (${mbit.toFixed(1)} Mbit/s)`,
        );
        expect(mbit).toBeGreaterThan(10);
        expect(mbit).toBeLessThan(22);
        expect(capped.ms!).toBeGreaterThan(3 * clean.ms!);
      } finally {
        net.uncap();
      }
    }, 40_000);

    it("2% random loss one way drops wire packets; TCP still delivers every byte", async () => {
      net.drop("p", 0.02);
      try {
        const r = await send(net, "p", dSink(), 4 << 20, 20_000);
        expect(r.got).toBe(4 << 20);
        // ~3000 wire packets of 1448 bytes: ~60 dropped (none if GSO made them 64 KiB each).
        expect(net.dropped("d")).toBeGreaterThan(10);
      } finally {
        net.heal();
      }
      expect(net.faults()).toEqual([]);
    }, 30_000);

    it("a one-way drop (P -> D) cuts TCP both ways; heal restores it", async () => {
      net.drop("p");
      expect(net.faults()).toEqual(["drop:p"]);
      const cut = await send(net, "p", dSink(), 1024, 1_500);
      expect(cut.error).toBe("TIMEOUT");
      // D -> P: D's SYN arrives, P's SYN-ACK is lost.
      const back = await send(net, "d", { host: net.hosts.p.address, port: PORT }, 1024, 1_500);
      expect(back.error).toBe("TIMEOUT");
      net.heal();
      const ok = await send(net, "p", dSink(), 1024, 5_000);
      expect(ok.got).toBe(1024);
    }, 20_000);

    it("a link taken down cuts the link; up again restores it", async () => {
      net.link("d", false);
      const cut = await send(net, "p", dSink(), 1024, 1_500);
      expect(cut.error).toBeDefined();
      net.link("d", true);
      const ok = await send(net, "p", dSink(), 1024, 5_000);
      expect(ok.got).toBe(1024);
    }, 20_000);

    it.skipIf(support.delayMissing !== undefined)(
      `the NFQUEUE delay line: 20 ms each way is seen in a round trip, and gone once removed${support.delayMissing !== undefined ? ` (skipped: ${support.delayMissing})` : ""}`,
      async () => {
        const clean = await send(net, "p", dSink(), 1, 5_000);
        await net.delay("p", 20, 2);
        await net.delay("d", 20, 2);
        try {
          expect(net.faults()).toEqual(["delay:d", "delay:p"]);
          const slow = await send(net, "p", dSink(), 1, 5_000);
          // connect, then data and the reply: at least two round trips of 2 x (20 - 2) ms.
          expect(slow.ms! - clean.ms!).toBeGreaterThanOrEqual(65);
          // Bulk flows through the line too, every byte.
          const bulk = await send(net, "p", dSink(), 4 << 20, 20_000);
          expect(bulk.got).toBe(4 << 20);
          console.log(
            `[harness] delay line 20 ms each way: 1 byte in ${slow.ms} ms (clean ${clean.ms} ms), 4 MiB in ${bulk.ms} ms`,
          );
        } finally {
          net.undelay();
        }
        const after = await send(net, "p", dSink(), 1, 5_000);
        expect(after.ms!).toBeLessThan(clean.ms! + 60);
        expect(net.faults()).toEqual([]);
      },
      40_000,
    );

    it.skipIf(support.delayMissing !== undefined)(
      `the delay line keeps packets in order unless asked to reorder: 4 MiB through 2 ms +- 1 ms each way, D's TCP queues (almost) nothing out of order, then does with "reorder"${support.delayMissing !== undefined ? ` (skipped: ${support.delayMissing})` : ""}`,
      async () => {
        // TcpExtTCPOFOQueue: segments D's TCP had to queue because an earlier one had not come.
        const ofo = (): number => {
          const out = execFileSync(
            net.hosts.d.prefix[0]!,
            [...net.hosts.d.prefix.slice(1), "nstat", "-az", "TcpExtTCPOFOQueue"],
            { encoding: "utf8" },
          );
          return Number(/TcpExtTCPOFOQueue\s+(\d+)/.exec(out)?.[1] ?? NaN);
        };
        const through = async (reorder: boolean): Promise<number> => {
          await net.delay("p", 2, 1, reorder);
          await net.delay("d", 2, 1, reorder);
          try {
            const before = ofo();
            const bulk = await send(net, "p", dSink(), 4 << 20, 20_000);
            expect(bulk.got).toBe(4 << 20);
            return ofo() - before;
          } finally {
            net.undelay();
          }
        };
        const inOrder = await through(false);
        const reordered = await through(true);
        console.log(
          `[harness] 4 MiB through 2 ms +- 1 ms each way: ${inOrder} segments out of order, ${reordered} with "reorder"`,
        );
        // In order, a segment is queued out of order only behind one that was lost (the line
        // drops a packet now and then: 0-139 of ~2,900 segments over six runs here, 9 once in
        // CI); reordered, about every one is (2,595-2,640).
        expect(inOrder * 10).toBeLessThan(reordered);
        expect(reordered).toBeGreaterThan(290);
      },
      40_000,
    );

    it.skipIf(support.netemMissing !== undefined)(
      `netem: 20 ms delay each way is seen in a round trip${support.netemMissing !== undefined ? ` (skipped: ${support.netemMissing})` : ""}`,
      async () => {
        const clean = await send(net, "p", dSink(), 1, 5_000);
        net.netem({ delayMs: 20 }, "p");
        net.netem({ delayMs: 20 }, "d");
        try {
          const slow = await send(net, "p", dSink(), 1, 5_000);
          // connect, then data and the reply: at least two round trips of 40 ms.
          expect(slow.ms! - clean.ms!).toBeGreaterThanOrEqual(70);
        } finally {
          net.uncap();
        }
      },
    );

    it("destroy removes both namespaces, and a second destroy is harmless", () => {
      const n = new FaultNet("hz", 53);
      expect(n.exists()).toBe(true);
      n.destroy();
      expect(n.exists()).toBe(false);
      n.destroy();
    });
  },
);
