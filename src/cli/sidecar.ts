/**
 * `kvxfer sidecar`: one sidecar process next to one engine. Settings come
 * from flags, then KVXFER_* environment variables, then a JSON config file
 * (--config), then defaults. Logs are JSON (pino) on stderr; stdout carries
 * one `{"event":"ready",...}` line once the sidecar is listening, for
 * whatever started it.
 *
 * This file is the process around the sidecar: the logger, signals, the ready line, the
 * stop (SIGTERM drains, SIGINT stops, an engine gone exits 75 for a restart) and exit codes.
 * The settings are `sidecar-settings.ts` (flags, help, defaults) and `sidecar-options.ts`
 * (checked); certificates `pki.ts`; where it listens `listen.ts`; the start of every part
 * `sidecar-start.ts`.
 */
import { format } from "node:util";
import * as grpc from "@grpc/grpc-js";
import { pino } from "pino";

import { stderrSink } from "../sidecar/log-sink.js";
import { ListenError } from "./listen.js";
import { positiveInt } from "./sidecar-options.js";
import { resolveSettings } from "./sidecar-settings.js";
import { startSidecar, type RunningSidecar } from "./sidecar-start.js";

/** How long closing may take after the drain (or SIGINT) before the process exits anyway. */
const CLOSE_DEADLINE_MS = 5000;
/** The exit code of a sidecar that stopped because its engine is gone (EX_TEMPFAIL): restart it. */
export const ENGINE_GONE_EXIT = 75;
/** How long a sidecar whose engine is gone waits for its peers to acknowledge the ends. */
const ENGINE_GONE_DRAIN_MS = 2000;

export async function runSidecar(argv: string[]): Promise<number> {
  const settings = resolveSettings(argv);
  const logger = pino({ level: settings["log-level"], base: { pid: process.pid } }, stderrSink());
  // Signals are caught from the start: one during start-up stops the sidecar once it is up
  // (start-up is bounded), so its engine socket is removed like on any other stop.
  let first = true;
  const signal = new Promise<string>((resolve) => {
    const on = (sig: string): void => {
      // A second signal leaves at once, whatever is still closing (the exit hook below
      // still removes the engine socket).
      if (!first) process.exit(1);
      first = false;
      resolve(sig);
    };
    process.on("SIGINT", () => on("SIGINT"));
    process.on("SIGTERM", () => on("SIGTERM"));
  });
  // grpc-js logs to stderr on its own ("E No address added ..."): its lines go through this
  // logger instead; a failed bind is reported once, below, as one line.
  grpc.setLogger({
    error: (m: unknown, ...p: unknown[]) => {
      const msg = format(m, ...p);
      if (msg.startsWith("No address added")) logger.debug({ component: "grpc-js" }, msg);
      else logger.error({ component: "grpc-js" }, msg);
    },
    info: (m: unknown, ...p: unknown[]) => logger.info({ component: "grpc-js" }, format(m, ...p)),
    debug: (m: unknown, ...p: unknown[]) => logger.debug({ component: "grpc-js" }, format(m, ...p)),
  });
  let running: RunningSidecar;
  try {
    running = await startSidecar(settings, logger);
  } catch (err) {
    // A port taken (or not allowed): one line naming the flag and the address, exit 1; the raw
    // error is in the log at debug level. Everything started was closed (engine socket and lock
    // removed) before the error got here.
    if (!(err instanceof ListenError)) throw err;
    logger.debug({ err: err.cause }, "listen failed");
    await new Promise((r) => setTimeout(r, 20));
    process.stderr.write(`kvxfer sidecar: ${err.message}\n`);
    return 1;
  }
  // Whatever ends the process from here (a second signal, the shutdown deadline, an uncaught
  // error), the engine socket and its lock go with it.
  process.once("exit", () => running.link.removeFiles());
  process.stdout.write(
    JSON.stringify({
      event: "ready",
      engineId: running.sidecar.engineId,
      epoch: String(running.sidecar.epoch),
      // What peers and routers dial (--advertise when given, e.g. the pod's IP), and the address
      // bound when it is another one (0.0.0.0:7600 in a pod).
      sideChannel:
        settings.advertise !== "" ? settings.advertise : running.sidecar.sideChannelAddress,
      ...(settings.advertise !== "" ? { listen: running.sidecar.sideChannelAddress } : {}),
      engineSocket: running.link.endpoint,
      grpc: running.api.address,
      ucx: running.sidecar.ucxStatus(),
      ...(running.metrics !== undefined ? { metrics: running.metrics.address } : {}),
      ...(running.bootstrap !== undefined ? { bootstrap: running.bootstrap.address } : {}),
    }) + "\n",
  );
  const sig = await Promise.race([signal, running.engineGone.then(() => "ENGINE_GONE")]);
  // Stopping is bounded too: the drain, then a few seconds to close everything.
  const drainMs = positiveInt("drain-ms", settings["drain-ms"]);
  setTimeout(() => {
    logger.error("shutdown took too long; exiting");
    process.exit(1);
  }, drainMs + 15_000).unref();
  // SIGTERM drains: health goes NOT_SERVING, new transfers are refused, and
  // in-flight ones get --drain-ms to end (each also has its own deadlines).
  if (sig === "ENGINE_GONE") {
    // Every transfer was ended and its peer told: wait (bounded) for the acknowledgements.
    const left = await running.drain(Math.min(drainMs, ENGINE_GONE_DRAIN_MS));
    logger.warn({ left, exitCode: ENGINE_GONE_EXIT }, "engine gone: stopping for a restart");
  } else if (sig === "SIGTERM") {
    logger.info({ drainMs, live: running.sidecar.liveTransfers() }, "draining");
    const left = await running.drain(drainMs);
    logger.info({ left }, left === 0 ? "drained" : "drain deadline passed");
  } else {
    logger.info({ signal: sig }, "stopping");
  }
  // Closing is bounded on its own: whoever started the sidecar may SIGKILL it soon after the
  // signal (which would leave the engine socket behind); past this the process exits (1) and
  // its exit hook still removes the socket and lock.
  let timer: NodeJS.Timeout | undefined;
  const closedInTime = await Promise.race([
    running.close().then(() => true),
    new Promise<false>((r) => (timer = setTimeout(() => r(false), CLOSE_DEADLINE_MS))),
  ]);
  clearTimeout(timer);
  if (!closedInTime)
    logger.error(
      { closing: running.closing, ms: CLOSE_DEADLINE_MS },
      "stopping took too long; exiting",
    );
  // Let the last log lines reach stderr (bounded: the sink never blocks).
  await new Promise((r) => setTimeout(r, 50));
  if (sig === "ENGINE_GONE") return ENGINE_GONE_EXIT;
  return closedInTime ? 0 : 1;
}
