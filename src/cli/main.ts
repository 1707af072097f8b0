#!/usr/bin/env node
/**
 * The `kvxfer` command: sidecar, sim-engine, demo, native-demo, bench.
 */
import { parseArgs } from "node:util";

import { runNativeDemo } from "./native-demo.js";
import { DEMO_USAGE, runDemoCommand } from "../sim/demo.js";
import { runSidecar, SIDECAR_SETTINGS } from "../sidecar/main.js";
import { runSimEngine } from "../sim/engine.js";
import { AWAIT_USAGE, runAwait } from "./await.js";
import { STATUS_USAGE, runStatus } from "./status.js";
import { WATCH_USAGE, runWatch } from "./watch.js";

const sidecarHelp = Object.entries(SIDECAR_SETTINGS)
  .map(
    ([k, v]) =>
      `      --${k.padEnd(20)} ${v.help}${v.default !== "" ? ` (default ${v.default})` : ""}`,
  )
  .join("\n");

const USAGE = `usage:
  kvxfer sidecar --engine-id ID [flags]
      one sidecar next to one engine; every flag may also come from KVXFER_<FLAG>
      (e.g. KVXFER_ENGINE_ID) or a JSON --config file
${sidecarHelp}
  kvxfer sim-engine --engine-id ID --role prefill|decode --socket ENDPOINT [flags]
      a simulated engine (see docs/engine-link.md)
  ${DEMO_USAGE.replace("usage: ", "")}
      sidecars and simulated engines as processes, a workload, every byte verified
  ${STATUS_USAGE}
  ${WATCH_USAGE}
  ${AWAIT_USAGE}
  kvxfer native-demo [--size BYTES] [--json]
      two processes, two UCX agents: writes and reads a region both ways over
      shared memory and checks every byte
  kvxfer bench native [--sizes 4k,32k,...] [--memory ucx,host] [--json]
      kvxfer vs ucx_perftest bandwidth and message rate
  kvxfer bench plan [--json]
      time to build transfer plans at production scale
  kvxfer bench events [--json]
      KV_READY to gRPC watcher latency, 1 and 64 watchers
  kvxfer bench e2e [--quick] [--json] [--modes push,pull] [--tokens 128,512,2048,8192] [--peer-auth on|off]
      full sidecars vs the native addon alone on the same plans, by prompt length
  kvxfer bench modes [--quick] [--json] [--tokens ...] [--requests N] [--ms-per-token X]
      push vs pull vs auto, sequential and concurrent dispatch: TTFT and KV-ready p50/p99
  kvxfer bench control [--quick] [--json] [--requests N] [--concurrency N] [--peer-auth on|off]
      transfers/s and CPU per transfer of one sidecar pair vs native round trips
  kvxfer bench vllm [--quick] [--json] [--lengths 32,256,1024] [--requests N] [--modes pull,push]
      a real vLLM P/D pair (CPU build) through kvxfer vs one engine: TTFT, E2E, KV bytes per request
  kvxfer bench peers [--quick] [--json] [--install] [--systems kvxfer,nixl,mooncake] [--transports shm,tcp]
      kvxfer vs NIXL and Mooncake (from PyPI, in .venv): bandwidth, KV-shaped requests, descriptor posting, notifications
  kvxfer bench all [--quick]
      every suite in sequence, JSON and SVG plots in bench/results/
  kvxfer bench plot
      the SVG plots again from bench/results/*.json`;

async function main(argv: string[]): Promise<number> {
  const [command, ...rest] = argv;
  switch (command) {
    case "sidecar":
      return runSidecar(rest);
    case "sim-engine":
      return runSimEngine(rest);
    case "demo":
      return runDemoCommand(rest);
    case "status":
      return runStatus(rest);
    case "watch":
      return runWatch(rest);
    case "await":
      return runAwait(rest);
    case "native-demo": {
      const { values } = parseArgs({
        args: rest,
        options: {
          size: { type: "string", default: String(64 << 20) },
          json: { type: "boolean", default: false },
        },
      });
      const size = Number(values.size);
      if (!Number.isInteger(size) || size <= 0)
        throw new Error(`--size must be a positive integer, got '${values.size}'`);
      const summary = await runNativeDemo({
        size,
        log: values.json ? undefined : (l) => console.log(l),
      });
      if (values.json) console.log(JSON.stringify(summary));
      return summary.verified ? 0 : 1;
    }
    case "bench": {
      const [suite, ...args] = rest;
      if (suite === "native") {
        const mod = await import("../../bench/native.js");
        await mod.main(args);
        return 0;
      }
      if (suite === "events") {
        const mod = await import("../../bench/events.js");
        await mod.main(args);
        return 0;
      }
      if (suite === "plan") {
        const mod = await import("../../bench/plan.js");
        mod.main(args);
        return 0;
      }
      if (suite === "e2e") {
        const mod = await import("../../bench/e2e.js");
        await mod.main(args);
        return 0;
      }
      if (suite === "modes") {
        const mod = await import("../../bench/modes.js");
        await mod.main(args);
        return 0;
      }
      if (suite === "control") {
        const mod = await import("../../bench/control.js");
        await mod.main(args);
        return 0;
      }
      if (suite === "vllm") {
        const mod = await import("../../bench/vllm.js");
        await mod.main(args);
        return 0;
      }
      if (suite === "peers") {
        const mod = await import("../../bench/peers.js");
        await mod.main(args);
        return 0;
      }
      if (suite === "all") {
        const mod = await import("../../bench/all.js");
        await mod.main(args);
        return 0;
      }
      if (suite === "plot") {
        const mod = await import("../../bench/all.js");
        for (const file of mod.runPlots()) console.log(file);
        return 0;
      }
      console.error(`unknown bench suite '${suite ?? ""}'\n${USAGE}`);
      return 2;
    }
    case undefined:
    case "help":
    case "--help":
    case "-h":
      console.log(USAGE);
      return command === undefined ? 2 : 0;
    default:
      console.error(`unknown command '${command}'\n${USAGE}`);
      return 2;
  }
}

main(process.argv.slice(2)).then(
  (code) => {
    // Sidecars and engines may hold sockets and timers: their exit code is final.
    process.exit(code);
  },
  (err: unknown) => {
    console.error(`kvxfer: ${err instanceof Error ? err.message : String(err)}`);
    process.exit(1);
  },
);
