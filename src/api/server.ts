/**
 * The sidecar's gRPC server: kvxfer.v1.Sidecar (status, transfers, events)
 * and grpc.health.v1.Health. It reads the sidecar only through `SidecarView`
 * and the `EventLog`; status codes are listed in docs/api.md.
 */
import * as net from "node:net";
import * as grpc from "@grpc/grpc-js";
import { KvxferError } from "../errors.js";
import { ConnectionSlots } from "../peer/connection-slots.js";
import { callClient } from "./call-shares.js";
import { splitHostPort } from "./http.js";
import { asServiceDefinition, healthService, sidecarService } from "./service.js";
import { ApiState } from "./api-state.js";
import { HealthRpcs } from "./health-rpcs.js";
import type { ApiServer, ApiServerOptions, ApiTlsOptions } from "./server-options.js";
import { SidecarRpcs } from "./sidecar-rpcs.js";

export type { ApiServer, ApiServerOptions, ApiTlsOptions } from "./server-options.js";

function serverCredentials(tls: ApiTlsOptions | undefined): grpc.ServerCredentials {
  return tls === undefined
    ? grpc.ServerCredentials.createInsecure()
    : grpc.ServerCredentials.createSsl(
        tls.ca === undefined ? null : Buffer.from(tls.ca),
        [{ cert_chain: Buffer.from(tls.cert), private_key: Buffer.from(tls.key) }],
        tls.requireClientCert ?? tls.ca !== undefined,
      );
}

/** Stops `server` gracefully, cutting what is left after `graceMs`. */
function shutdown(server: grpc.Server, graceMs: number): Promise<void> {
  return new Promise<void>((resolve) => {
    const timer = setTimeout(() => {
      server.forceShutdown();
      resolve();
    }, graceMs);
    timer.unref();
    server.tryShutdown(() => {
      clearTimeout(timer);
      resolve();
    });
  });
}

export async function startApiServer(opts: ApiServerOptions): Promise<ApiServer> {
  const state = new ApiState(opts);
  const { log } = state;
  const sidecar = new SidecarRpcs(state);
  const health = new HealthRpcs(state);

  // Our own listener: every connection takes a slot before grpc-js sees it (grpc-js has no
  // connection cap of its own): an opening one at accept, an established one (under its
  // client's identity, or its address group) with its first call. Nobody is refused at accept;
  // past the room the oldest connection of the largest group is closed (connection-slots.ts).
  const perClient = opts.maxConnectionsPerClient ?? 32;
  const slots = new ConnectionSlots(
    {
      opening: opts.maxConnections ?? 256,
      established: opts.maxConnections ?? 256,
      perGroup: perClient,
      // No call within this long: not a gRPC client (its slot goes back).
      establishMs: opts.silentConnectionMs ?? 10_000,
      deadlineMs: 0,
    },
    (code, message) => log.warn({ code }, `gRPC: ${message}`),
  );
  /** Accepted connections by "address:port", as grpc-js names a call's peer. */
  const byPeer = new Map<string, net.Socket>();
  // Every handler reports its call here (ApiState.callSeen): the connection establishes itself
  // with its first call. (An interceptor would do the same, at the cost of one more layer on
  // every message of every call.)
  state.callSeen = (call) => {
    const socket = byPeer.get(call.getPeer());
    if (socket !== undefined && !slots.isEstablished(socket))
      slots.establish(socket, callClient(call).group);
  };

  const server = new grpc.Server({
    // Requests are small; anything large is a mistake or an attack.
    "grpc.max_receive_message_length": 1 << 20,
    "grpc.keepalive_time_ms": 30_000,
    "grpc.keepalive_timeout_ms": 10_000,
    "grpc.max_connection_idle_ms": opts.maxConnectionIdleMs ?? 60_000,
    // Streams one connection may hold open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS).
    "grpc.max_concurrent_streams": opts.maxStreamsPerConnection ?? 128,
  });
  server.addService(asServiceDefinition(sidecarService), sidecar.handlers());
  server.addService(asServiceDefinition(healthService), health.handlers());

  const address = opts.address ?? "127.0.0.1:0";
  const hp = splitHostPort(address);
  if (hp === undefined)
    throw new KvxferError(
      "ERR_INVALID_ARGUMENT",
      `gRPC address must be host:port, got '${address}'`,
    );
  const injector = server.createConnectionInjector(serverCredentials(opts.tls));
  // No Nagle: events are small and latency is what a router waits on.
  const tcp = net.createServer({ noDelay: true }, (socket) => {
    slots.admit(socket);
    if (socket.destroyed) return;
    const key = `${socket.remoteAddress}:${socket.remotePort}`;
    byPeer.set(key, socket);
    socket.once("close", () => {
      if (byPeer.get(key) === socket) byPeer.delete(key);
    });
    injector.injectConnection(socket);
  });
  await new Promise<void>((resolve, reject) => {
    tcp.once("error", reject);
    tcp.listen(hp.port, hp.host, () => {
      tcp.off("error", reject);
      resolve();
    });
  });
  const port = (tcp.address() as net.AddressInfo).port;
  const host = address.slice(0, address.lastIndexOf(":"));
  const bound = `${host}:${port}`;

  const ticker = setInterval(() => sidecar.sendProgress(), state.progressIntervalMs);
  ticker.unref();

  log.info({ address: bound, tls: opts.tls !== undefined }, "gRPC API listening");

  return {
    port,
    address: bound,
    get serving() {
      return state.serving;
    },
    get watchers() {
      return state.watches.size;
    },
    get awaiting() {
      return state.awaits.size;
    },
    get connections() {
      return slots.inFlight;
    },
    setServing: (next) => health.setServing(next),
    drain: () => health.setServing(false),
    async close(graceMs = 5_000) {
      if (state.closing) return;
      health.setServing(false);
      state.closing = true;
      clearInterval(ticker);
      sidecar.endAll();
      health.endAll();
      tcp.close();
      await shutdown(server, graceMs);
      injector.destroy();
      slots.destroyAll();
      log.info("gRPC API closed");
    },
  };
}
