/**
 * The sidecar's small HTTP endpoints (Prometheus metrics, the router bootstrap): GET only, one
 * handler per path, anything else 404 naming what is served. Bodies are built per request;
 * nothing is read from the request but its method and path.
 */
import * as http from "node:http";
import type { AddressInfo, Socket } from "node:net";

import { ConnectionSlots, type SlotLimits } from "../peer/connection-slots.js";

/**
 * An HTTP endpoint's connections (metrics, bootstrap, the readiness probe): opening until their
 * first request arrives, established (kept alive) after it, each pool with its own room. Nobody
 * is refused at accept: past the room, the oldest connection of the largest address group is
 * displaced (a scraper's idle kept-alive connections go before a probe that comes from another
 * address is kept waiting), and one address keeps at most 8 kept-alive connections (its own
 * oldest goes). No deadline per connection (it could cut a router's request on a kept-alive
 * connection): Node's own timers close what holds a slot without a request (HttpLimits).
 */
export const HTTP_SLOTS: SlotLimits = {
  opening: 64,
  established: 64,
  perGroup: 8,
  establishMs: 10_000,
  deadlineMs: 0,
};

/** How long a request may take to arrive whole, and an idle kept-alive connection to stay. */
export interface HttpLimits {
  readonly slots: SlotLimits;
  /** Headers and body must have arrived this long after the connection's request began. */
  readonly requestMs: number;
  /** An idle kept-alive connection is closed after this long. */
  readonly idleMs: number;
}

export const HTTP_LIMITS: HttpLimits = { slots: HTTP_SLOTS, requestMs: 10_000, idleMs: 5_000 };

export interface HttpServer {
  readonly port: number;
  /** "host:port" as bound (IPv6 hosts in brackets). */
  readonly address: string;
  /** Connections open now (each holds one of its slots). */
  connections(): number;
  close(): Promise<void>;
}

export interface GetRoute {
  readonly contentType: string;
  body(): string | Promise<string>;
  /** The response's status (default 200). */
  status?(): number;
}

/** "host:port" (IPv6 hosts in brackets) → host without brackets and port 0..65535; else undefined. */
export function splitHostPort(address: string): { host: string; port: number } | undefined {
  const colon = address.lastIndexOf(":");
  const port = Number(address.slice(colon + 1));
  if (colon < 0 || !Number.isInteger(port) || port < 0 || port > 65535) return undefined;
  return { host: address.slice(0, colon).replace(/^\[|\]$/g, ""), port };
}

/** Serves `routes` (path → body) on `address` ("host:port"; port 0 picks one). */
export async function serveGets(
  what: string,
  address: string,
  routes: Readonly<Record<string, GetRoute>>,
  limits: HttpLimits = HTTP_LIMITS,
): Promise<HttpServer> {
  const parsed = splitHostPort(address);
  if (parsed === undefined) throw new Error(`bad ${what} address '${address}' (want host:port)`);
  const { host, port } = parsed;
  const served = Object.keys(routes)
    .map((p) => `GET ${p}`)
    .join(", ");
  const server = http.createServer(
    {
      // A connection that sends nothing, or trickles, is closed once its request is overdue;
      // Node checks every connectionsCheckingInterval.
      headersTimeout: limits.requestMs,
      requestTimeout: limits.requestMs,
      keepAliveTimeout: limits.idleMs,
      connectionsCheckingInterval: Math.min(1000, limits.requestMs),
    },
    (req, res) => {
      const path = (req.url ?? "").split("?")[0] ?? "";
      const route = req.method === "GET" && Object.hasOwn(routes, path) ? routes[path] : undefined;
      if (route === undefined) {
        res.writeHead(404, { "content-type": "text/plain" }).end(`not found: try ${served}\n`);
        return;
      }
      const fail = (err: unknown) => {
        if (!res.headersSent) res.writeHead(500, { "content-type": "text/plain" });
        res.end(String(err));
      };
      try {
        const status = route.status?.() ?? 200;
        void Promise.resolve(route.body()).then(
          (body) => res.writeHead(status, { "content-type": route.contentType }).end(body),
          fail,
        );
      } catch (err) {
        fail(err);
      }
    },
  );
  // Every connection takes an opening slot at accept (before any byte is read), an established
  // one with its first request.
  const slots = new ConnectionSlots(limits.slots);
  server.on("connection", (socket: Socket) => slots.admit(socket));
  server.on("request", (req: http.IncomingMessage) => {
    if (!slots.establish(req.socket)) req.socket.destroy();
  });
  // A connection silent this long is closed (a trickling one, by headersTimeout above).
  server.setTimeout(limits.requestMs);
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, host, () => {
      server.off("error", reject);
      resolve();
    });
  });
  const bound = (server.address() as AddressInfo).port;
  return {
    port: bound,
    connections: () => slots.inFlight,
    address: `${host.includes(":") ? `[${host}]` : host}:${bound}`,
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
}
