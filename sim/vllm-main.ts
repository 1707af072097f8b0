#!/usr/bin/env node
/**
 * The simulated engine behind vLLM's command line (vllm-server.ts), as a process: the Helm
 * chart's engine container where no GPU runs vLLM (`kvxfer-engine` image,
 * `node dist/sim/vllm-main.js --model ... --kv-transfer-config ...`). SIGTERM drains (exit 0);
 * a failed start (no sidecar accepted the KV cache within register_timeout_s) exits 1, which
 * the kubelet restarts.
 */
import { pino } from "pino";

import { stderrSink } from "../src/sidecar/index.js";
import { parseSimVllmArgs, SIM_VLLM_USAGE } from "./vllm-args.js";
import { SimVllmServer } from "./vllm-server.js";

async function main(argv: readonly string[]): Promise<number> {
  if (argv.includes("--help") || argv.includes("-h")) {
    process.stdout.write(SIM_VLLM_USAGE + "\n");
    return 0;
  }
  let cfg;
  try {
    cfg = parseSimVllmArgs(argv);
  } catch (err) {
    // A flag parseArgs does not know (its own errors) or a value refused here (UsageError).
    process.stderr.write(`kvxfer sim-vllm: ${(err as Error).message}\n${SIM_VLLM_USAGE}\n`);
    return 2;
  }
  const log = pino(
    { name: "sim-vllm", level: cfg.logLevel, base: { engineId: cfg.engineId, pid: process.pid } },
    stderrSink(),
  );
  const server = new SimVllmServer(cfg, log);
  let signalled = false;
  const done = new Promise<number>((resolve) => {
    const onSignal = (sig: NodeJS.Signals): void => {
      if (signalled) return;
      signalled = true;
      log.info({ sig }, "stopping");
      void server.stop().then(() => resolve(0));
    };
    process.on("SIGTERM", onSignal);
    process.on("SIGINT", onSignal);
  });
  try {
    await server.start();
  } catch (err) {
    if (signalled) return done;
    const e = err as { code?: string; message: string };
    process.stderr.write(`kvxfer sim-vllm: ${e.code ?? "ERR_START"}: ${e.message}\n`);
    await server.stop(0);
    return 1;
  }
  return done;
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (err: unknown) => {
    process.stderr.write(`kvxfer sim-vllm: ${err instanceof Error ? err.message : String(err)}\n`);
    process.exit(1);
  },
);
