/**
 * A sidecar started from its settings, on every channel: the Sidecar itself (side channel, UCX
 * agents), the engine link, the gRPC API, and when asked for the metrics and bootstrap HTTP
 * servers, the ZeroMQ KV_READY notifier and OTLP tracing. What it returns drains and closes them,
 * and says when the registered engine is gone (--engine-lease-ms). The process around it (signals,
 * the ready line, exit codes) is `sidecar.ts`'s.
 */
import type { Logger } from "pino";

import { startApiServer, type ApiServer } from "../api/server.js";
import { startBootstrapServer } from "../api/bootstrap.js";
import type { HttpServer } from "../api/http.js";
import { SidecarMetrics, startMetricsServer, type MetricsServer } from "../api/metrics.js";
import { ZmqNotifier } from "../api/zmq-notify.js";
import { EngineLinkServer, defaultEngineEndpoint } from "../engine/link.js";
import { KvxferError } from "../errors.js";
import { EventLog } from "../sidecar/event-log.js";
import { Sidecar } from "../sidecar/sidecar.js";
import { advertisedSideChannel, listening, warnOpenEndpoints } from "./listen.js";
import { startOtlpTracing } from "./otel.js";
import { grpcServerTls } from "./pki.js";
import { nonNegativeInt, positiveInt, sidecarOptions } from "./sidecar-options.js";
import type { SettingName } from "./sidecar-settings.js";

/** How often a sidecar with --engine-lease-ms looks whether its absent engine is gone. */
const ENGINE_WATCH_MS = 200;

export interface RunningSidecar {
  sidecar: Sidecar;
  link: EngineLinkServer;
  events: EventLog;
  api: ApiServer;
  metrics: MetricsServer | undefined;
  /** `--bootstrap`'s server, when asked for. */
  bootstrap: HttpServer | undefined;
  /** NOT_SERVING, refuse new transfers, wait (bounded) for in-flight ones to end. */
  drain(deadlineMs: number): Promise<number>;
  /**
   * Settles (with why) once the registered engine is provably gone (`--engine-lease-ms` > 0):
   * its transfers were ended and its peers told; the caller stops the sidecar. Never settles
   * otherwise.
   */
  readonly engineGone: Promise<string>;
  close(): Promise<void>;
  /** The part `close()` is closing now ("" when not closing, or closed). */
  readonly closing: string;
}

/** Starts a sidecar from settings; returns once it listens on every channel. */
export async function startSidecar(
  s: Record<SettingName, string>,
  logger: Logger,
): Promise<RunningSidecar> {
  const tracing =
    s["otlp-endpoint"] !== ""
      ? await startOtlpTracing(s["otlp-endpoint"], s["engine-id"])
      : undefined;
  const sidecar = new Sidecar({
    ...sidecarOptions(s, logger),
    ...(tracing !== undefined ? { tracer: tracing.tracer } : {}),
  });
  const events = new EventLog({
    capacity: positiveInt("event-log-capacity", s["event-log-capacity"]),
  });
  const metrics = new SidecarMetrics();
  metrics.watchEventLog(events);
  // Read at each scrape: transfers not yet ended, per side (ended ones stay listed for
  // --tombstone-ms in status, so a count of the listing overstates what is live).
  const liveGauge = metrics.registry.gauge(
    "kvxfer_live_transfers",
    "Transfers not yet in a terminal state, by side.",
    { labelNames: ["side"], maxSeries: 2 },
  );
  metrics.registry.onCollect(() => {
    const n = sidecar.liveBySide();
    liveGauge.set({ side: "prefill" }, n.prefill);
    liveGauge.set({ side: "decode" }, n.decode);
  });
  if (s.bootstrap !== "" && s.role === "decode")
    throw new KvxferError(
      "ERR_CONFIG",
      "--bootstrap serves a prefill engine's coordinates: --role prefill or both",
    );
  if (s["notify-zmq"] !== "" && s.role === "prefill")
    throw new KvxferError(
      "ERR_CONFIG",
      "--notify-zmq announces KV_READY, which only a decode side has: --role decode or both",
    );
  const notifier =
    s["notify-zmq"] !== "" ? new ZmqNotifier(s["notify-zmq"], metrics.registry) : undefined;
  notifier?.start(events);
  // Read (and the CA checked) before anything listens: a TLS mistake stops the start.
  const tls = grpcServerTls(s);
  let api: ApiServer | undefined;
  // Readiness follows the engine: SERVING only while a registered engine's connection is up.
  const engineReady = (): boolean => sidecar.acceptsHandshakes && link.ownerConnected;
  const link = new EngineLinkServer({
    endpoint:
      s["engine-socket"] !== "" ? s["engine-socket"] : defaultEngineEndpoint(s["engine-id"]),
    maxFrameBytes: positiveInt("engine-max-frame-bytes", s["engine-max-frame-bytes"]),
    onMessage: (msg, from) => {
      sidecar.onEngineMessage(msg, (m) => void link.send(from, m), {
        id: from.id,
        isOwner: link.isOwner(from),
        ownerConnected: link.ownerConnected,
        adopt: () => link.adopt(from),
      });
      // Readiness: SERVING once a registration was accepted (and not while draining).
      api?.setServing(engineReady());
    },
    onRefused: (code, message) => sidecar.noteError(`engine frame refused: ${code}: ${message}`),
    onConnectionEnded: (peer) => {
      sidecar.engineConnectionEnded(peer.id);
      // The link marks its owner away after telling us: look once it has.
      setImmediate(() => api?.setServing(engineReady()));
    },
    logger,
  });
  await link.start();
  let metricsServer: MetricsServer | undefined;
  let bootstrap: HttpServer | undefined;
  try {
    await listening("listen", s.listen, () =>
      sidecar.start((msg) => void link.sendToRegistered(msg), events, metrics),
    );
    api = await listening("grpc", s.grpc, () =>
      startApiServer({
        view: sidecar,
        events,
        address: s.grpc,
        logger,
        // Readiness: NOT_SERVING until the engine registers (an engine may have come first).
        serving: engineReady(),
        ...(tls !== undefined ? { tls } : {}),
      }),
    );
    api.setServing(engineReady());
    if (s.metrics !== "")
      metricsServer = await listening("metrics", s.metrics, () =>
        startMetricsServer({
          registry: metrics.registry,
          address: s.metrics,
          // The same answer as gRPC health's (SERVING while a registered engine is connected).
          ready: () => api?.serving === true,
        }),
      );
    if (s.bootstrap !== "")
      bootstrap = await listening("bootstrap", s.bootstrap, () =>
        startBootstrapServer({
          address: s.bootstrap,
          engineId: sidecar.engineId,
          sideChannel: advertisedSideChannel(s.advertise, sidecar.sideChannelAddress),
        }),
      );
    warnOpenEndpoints(logger, sidecar, [
      ["--grpc", s.grpc, tls !== undefined],
      ["--metrics", s.metrics, false],
      ["--bootstrap", s.bootstrap, false],
    ]);
  } catch (err) {
    await metricsServer?.close();
    await api?.close(0);
    await sidecar.close();
    await link.close();
    notifier?.close();
    await tracing?.shutdown(0);
    throw err;
  }
  const apiServer = api;
  let closed = false;
  let closing = "";
  const engineLeaseMs = nonNegativeInt("engine-lease-ms", s["engine-lease-ms"]);
  let goneWith: (why: string) => void = () => {};
  const engineGone = new Promise<string>((resolve) => (goneWith = resolve));
  let awaySince: number | undefined;
  const engineWatch =
    engineLeaseMs > 0
      ? setInterval(() => {
          if (!sidecar.registered || link.ownerConnected || sidecar.draining) {
            awaySince = undefined;
            return;
          }
          awaySince ??= Date.now();
          const why = sidecar.engineFilesGone()
            ? "its connection ended and its KV files were removed"
            : Date.now() - awaySince >= engineLeaseMs
              ? `its connection ended ${engineLeaseMs} ms ago (--engine-lease-ms) and it did not register again`
              : undefined;
          if (why === undefined) return;
          clearInterval(engineWatch);
          sidecar.abandonEngine(why);
          apiServer.setServing(false);
          goneWith(why);
        }, ENGINE_WATCH_MS)
      : undefined;
  engineWatch?.unref();
  return {
    engineGone,
    sidecar,
    link,
    events,
    api: apiServer,
    metrics: metricsServer,
    bootstrap,
    drain: async (deadlineMs) => {
      sidecar.beginDrain();
      apiServer.setServing(false);
      const end = Date.now() + deadlineMs;
      while (sidecar.liveTransfers() > 0 && Date.now() < end)
        await new Promise((r) => setTimeout(r, 50));
      const left = sidecar.liveTransfers();
      if (left > 0) {
        // Peers hear about every transfer this sidecar will not finish, before it closes.
        sidecar.abandonAll();
        await new Promise((r) => setTimeout(r, 100));
      }
      return left;
    },
    close: async () => {
      if (closed) return;
      closed = true;
      clearInterval(engineWatch);
      closing = "gRPC API";
      await apiServer.close(1000);
      closing = "metrics";
      await metricsServer?.close();
      closing = "bootstrap";
      await bootstrap?.close();
      closing = "sidecar (side channel, peers, UCX agents)";
      await sidecar.close();
      closing = "engine link";
      await link.close();
      notifier?.close();
      events.close();
      closing = "OpenTelemetry export";
      await tracing?.shutdown(2000);
      closing = "";
    },
    get closing() {
      return closing;
    },
  };
}
