// What a client that reaches the gRPC port or the metrics endpoint can make the sidecar hold
// (issue 31, case 6), in process over loopback: WatchEvents streams per client address (the
// rest kept for others), connections per client address and in all, and the metrics endpoint's
// connections. Two client addresses: 127.0.0.1 and ::1 (the server listens on "::"), or raw
// TCP from 127.0.0.2 (Linux routes 127/8 to lo).
import * as net from "node:net";

import * as grpc from "@grpc/grpc-js";
import { afterEach, describe, expect, it } from "vitest";

import { SidecarClient, type EventWatch } from "../../src/api/client.js";
import { HTTP_SLOTS, serveGets } from "../../src/api/http.js";
import { MetricsRegistry, startMetricsServer } from "../../src/api/metrics.js";
import { type ApiServer, startApiServer } from "../../src/api/server.js";
import { EventLog } from "../../src/sidecar/event-log.js";
import { FixtureSidecar } from "./fixtures.js";
import { RawGrpc, type RawCall } from "./raw-grpc.js";
import { until } from "../until.js";

const cleanup: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

async function api(opts: Partial<Parameters<typeof startApiServer>[0]> = {}): Promise<ApiServer> {
  const events = new EventLog({ capacity: 100 });
  const server = await startApiServer({
    view: new FixtureSidecar(events),
    events,
    address: "[::]:0",
    ...opts,
  });
  cleanup.push(
    () => events.close(),
    () => server.close(500),
  );
  return server;
}

async function apiWithView(opts: Partial<Parameters<typeof startApiServer>[0]> = {}) {
  const events = new EventLog({ capacity: 100 });
  const view = new FixtureSidecar(events);
  const server = await startApiServer({ view, events, address: "127.0.0.1:0", ...opts });
  cleanup.push(
    () => events.close(),
    () => server.close(500),
  );
  return { server, view };
}

async function raw(port: number, from: string): Promise<RawGrpc> {
  const c = await RawGrpc.connect(port, from);
  cleanup.push(() => c.close());
  return c;
}

function client(address: string): SidecarClient {
  const c = new SidecarClient(address, { timeoutMs: 5_000 });
  cleanup.push(() => c.close());
  return c;
}

/** A stream that is open (its first message came) or refused (its error). */
async function opened(w: EventWatch): Promise<"open" | grpc.status> {
  return Promise.race([
    until(() => w.epoch !== undefined, 5_000, "first message").then(() => "open" as const),
    w.done.then(
      () => "open" as const,
      (err: grpc.ServiceError) => err.code,
    ),
  ]);
}

/** Raw TCP connections from `from` that stay open until the server closes them. */
async function rawConnections(port: number, from: string, n: number) {
  const closed: Promise<void>[] = [];
  for (let i = 0; i < n; i++) {
    const s = net.connect({ host: "127.0.0.1", port, localAddress: from });
    s.on("error", () => undefined);
    s.resume(); // read (and drop) what the server sends, so that its close is seen
    cleanup.push(() => void s.destroy());
    closed.push(new Promise((r) => s.once("close", () => r())));
    await new Promise<void>((r) => s.once("connect", () => r()));
  }
  return closed;
}

describe("gRPC: watchers and connections per client", () => {
  it("one client's WatchEvents streams stop at its share; another client's watch is served", async () => {
    const server = await api({ maxWatchers: 8, maxWatchersPerClient: 3 });
    const hog = client(`127.0.0.1:${server.port}`);
    const router = client(`[::1]:${server.port}`);
    const results = [];
    for (let i = 0; i < 5; i++) {
      const w = hog.watch({}, () => undefined);
      cleanup.push(() => w.cancel());
      results.push(await opened(w));
    }
    expect(results).toEqual([
      "open",
      "open",
      "open",
      ...Array(2).fill(grpc.status.RESOURCE_EXHAUSTED),
    ]);
    const mine = router.watch({}, () => undefined);
    cleanup.push(() => mine.cancel());
    expect(await opened(mine)).toBe("open");
    expect(server.watchers).toBe(4);
  });

  it("4 addresses x 250 WatchEvents streams fill the 1,000 (default caps): a router's watch opens, in the place of the largest client's oldest", async () => {
    const server = await api({ address: "127.0.0.1:0" });
    const calls: RawCall[] = [];
    // 250 streams per address over two connections (at most 128 streams on one).
    for (let a = 0; a < 4; a++)
      for (let c = 0; c < 2; c++) {
        const conn = await raw(server.port, `127.0.0.${2 + a}`);
        for (let i = 0; i < 125; i++) calls.push(conn.watch());
      }
    await Promise.all(calls.map((c) => c.firstMessage));
    expect(server.watchers).toBe(1000);
    // One more from an attacker address: refused (its client holds as many as any).
    const more = (await raw(server.port, "127.0.0.2")).watch();
    expect(await more.status).toBe(grpc.status.RESOURCE_EXHAUSTED);
    const mine = client(server.address).watch({}, () => undefined);
    cleanup.push(() => mine.cancel());
    expect(await opened(mine)).toBe("open");
    // The oldest stream of 127.0.0.2 (the first of the largest groups) made room.
    expect(await calls[0]!.status).toBe(grpc.status.RESOURCE_EXHAUSTED);
    expect(server.watchers).toBe(1000);
  }, 30_000);

  it("AwaitTransfer: a client waits on at most its share; when every slot is taken a router's call takes the largest client's oldest, and is answered", async () => {
    const fixture = await apiWithView({ maxAwaits: 40, maxAwaitsPerClient: 10 });
    const { server, view } = fixture;
    const conns: RawGrpc[] = [];
    for (let a = 0; a < 4; a++) conns.push(await raw(server.port, `127.0.0.${2 + a}`));
    // 12 from the first address: 10 wait, 2 refused at once.
    const first = Array.from({ length: 12 }, (_, i) => conns[0]!.await(`t-${i}`));
    const refusedAtOnce = await Promise.all(first.slice(10).map((c) => c.status));
    expect(refusedAtOnce).toEqual([8, 8]); // RESOURCE_EXHAUSTED
    const rest = conns
      .slice(1)
      .flatMap((c, a) => Array.from({ length: 10 }, (_, i) => c.await(`u-${a}-${i}`)));
    await until(() => server.awaiting === 40, 5000, "40 awaits waiting");
    view.start("router-transfer");
    const waiting = client(server.address).awaitTransfer("router-transfer", 5000);
    expect(await first[0]!.status).toBe(grpc.status.RESOURCE_EXHAUSTED);
    expect(server.awaiting).toBe(40);
    view.end("router-transfer", "KV_READY");
    expect((await waiting).kind).toBe("KV_READY");
    for (const c of rest) c.cancel();
  }, 20_000);

  it("one connection holds at most 128 streams at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS)", async () => {
    const server = await api({ address: "127.0.0.1:0" });
    const conn = await raw(server.port, "127.0.0.2");
    for (let i = 0; i < 200; i++) conn.await(`s-${i}`);
    await until(() => server.awaiting === 128, 5000, "128 awaits");
    await new Promise((r) => setTimeout(r, 300));
    expect(server.awaiting).toBe(128);
  }, 20_000);

  it("a connection that makes no call gives its slot back (10 s; 500 ms here); a watching client's connection stays", async () => {
    const server = await api({ address: "127.0.0.1:0", silentConnectionMs: 500 });
    const c = client(server.address);
    const w = c.watch({}, () => undefined);
    cleanup.push(() => w.cancel());
    expect(await opened(w)).toBe("open");
    const [silent] = await rawConnections(server.port, "127.0.0.2", 1);
    const t0 = Date.now();
    await silent;
    expect(Date.now() - t0).toBeLessThan(3000);
    // An HTTP/2 connection that never calls is closed too.
    const h2 = await raw(server.port, "127.0.0.3");
    await h2.closed;
    await new Promise((r) => setTimeout(r, 300));
    expect(server.watchers).toBe(1);
    expect(server.connections).toBe(1);
  });

  it("8 addresses x 32 connections, each with a call, fill the connections: a router's new connection and call take the largest group's oldest", async () => {
    const server = await api({ address: "127.0.0.1:0" });
    const conns: RawGrpc[] = [];
    for (let a = 0; a < 8; a++)
      for (let i = 0; i < 32; i++) {
        const c = await raw(server.port, `127.0.0.${2 + a}`);
        await c.watch().firstMessage;
        conns.push(c);
      }
    expect(server.connections).toBe(256);
    // Silent raw connections on top: they take opening slots, not these.
    await rawConnections(server.port, "127.0.1.1", 50);
    expect((await client(server.address).getStatus()).engineId).toBe("decode-0");
    await conns[0]!.closed;
  }, 60_000);

  it("one client's connections with calls stop at its share (its own oldest goes); another client's calls are answered", async () => {
    const server = await api({ address: "127.0.0.1:0", maxConnectionsPerClient: 4 });
    const conns: RawGrpc[] = [];
    for (let i = 0; i < 6; i++) {
      const c = await raw(server.port, "127.0.0.2");
      await c.watch().firstMessage;
      conns.push(c);
    }
    await conns[0]!.closed;
    await conns[1]!.closed;
    expect(server.connections).toBe(4);
    expect((await client(server.address).getStatus()).engineId).toBe("decode-0");
  });
});

describe("metrics endpoint: connections", () => {
  it("1,100 idle connections from one address hold at most the 64 opening slots; a scrape from another address is answered", async () => {
    const m = await startMetricsServer({ registry: new MetricsRegistry(), address: "127.0.0.1:0" });
    cleanup.push(() => m.close());
    const closed = await rawConnections(m.port, "127.0.0.2", 1100);
    await Promise.all(closed.slice(0, 1100 - 64));
    expect(m.connections()).toBe(64);
    const res = await fetch(`http://127.0.0.1:${m.port}/metrics`);
    expect(res.status).toBe(200);
  }, 60_000);

  it("a connection that sends nothing, or trickles a request, is closed once its request is overdue; a kept-alive one that served is closed when idle", async () => {
    const m = await serveGets(
      "test",
      "127.0.0.1:0",
      { "/x": { contentType: "text/plain", body: () => "x" } },
      { slots: HTTP_SLOTS, requestMs: 500, idleMs: 300 },
    );
    cleanup.push(() => m.close());
    const t0 = Date.now();
    const [silent] = await rawConnections(m.port, "127.0.0.2", 1);
    const sock = net.connect({ host: "127.0.0.1", port: m.port });
    await new Promise<void>((r) => sock.once("connect", () => r()));
    cleanup.push(() => void sock.destroy());
    const drip = setInterval(() => sock.write("X"), 100);
    cleanup.push(() => clearInterval(drip));
    const dripClosed = new Promise<void>((r) => sock.once("close", () => r()));
    sock.on("error", () => undefined);
    await silent;
    const silentMs = Date.now() - t0;
    await dripClosed;
    const trickleMs = Date.now() - t0;
    expect(silentMs).toBeLessThan(3000);
    expect(trickleMs).toBeLessThan(3000);
    // A served, kept-alive connection stays while busy and goes when idle.
    const res = await fetch(`http://127.0.0.1:${m.port}/x`);
    expect(await res.text()).toBe("x");
    await until(() => m.connections() === 0, 3000, "every connection closed");
  }, 20_000);
});
