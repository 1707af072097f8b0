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

  it("1,000 streams from one client (the default caps): the router's own watch still opens", async () => {
    const server = await api();
    const hog = client(`127.0.0.1:${server.port}`);
    const watches = Array.from({ length: 1000 }, () => hog.watch({}, () => undefined));
    for (const w of watches) cleanup.push(() => w.cancel());
    await until(() => server.watchers >= 250, 10_000, "the hog's share");
    const refused = await Promise.all(watches.slice(-10).map(opened));
    expect(refused).toEqual(Array(10).fill(grpc.status.RESOURCE_EXHAUSTED));
    expect(server.watchers).toBe(250);
    const mine = client(`[::1]:${server.port}`).watch({}, () => undefined);
    cleanup.push(() => mine.cancel());
    expect(await opened(mine)).toBe("open");
  }, 30_000);

  it("a connection that sends no byte gives its slot back (10 s; 500 ms here); a watching client's connection stays", async () => {
    const server = await api({ address: "127.0.0.1:0", silentConnectionMs: 500 });
    const c = client(server.address);
    const w = c.watch({}, () => undefined);
    cleanup.push(() => w.cancel());
    expect(await opened(w)).toBe("open");
    const [silent] = await rawConnections(server.port, "127.0.0.2", 1);
    const t0 = Date.now();
    await silent;
    expect(Date.now() - t0).toBeLessThan(3000);
    await new Promise((r) => setTimeout(r, 1000));
    expect(server.watchers).toBe(1);
    expect(server.connections).toBe(1);
  });

  it("connections past a client's share are closed at accept; another client's calls are answered", async () => {
    const server = await api({ address: "127.0.0.1:0", maxConnectionsPerClient: 4 });
    const closed = await rawConnections(server.port, "127.0.0.2", 20);
    await Promise.all(closed.slice(4));
    expect(server.connections).toBe(4);
    expect((await client(server.address).getStatus()).engineId).toBe("decode-0");
  });
});

describe("metrics endpoint: connections", () => {
  it("1,100 idle connections from one address hold 8 slots; a scrape from another address is answered", async () => {
    const m = await startMetricsServer({ registry: new MetricsRegistry(), address: "127.0.0.1:0" });
    cleanup.push(() => m.close());
    const closed = await rawConnections(m.port, "127.0.0.2", 1100);
    await Promise.all(closed.slice(8));
    expect(m.connections()).toBe(8);
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
