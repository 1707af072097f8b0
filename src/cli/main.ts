#!/usr/bin/env node
/**
 * The `kvxfer` command.
 *   kvxfer demo [--size BYTES] [--transport shm|tcp] [--json]
 *   kvxfer bench native [--sizes 4k,...] [--memory ucx,host] [--json]
 *   kvxfer bench plan [--json]
 */
import { parseArgs } from "node:util";

import { runNativeDemo } from "./native-demo.js";

const USAGE = `usage:
  kvxfer demo [--size BYTES] [--json]
      two processes, two UCX agents: writes and reads a region both ways over
      shared memory and checks every byte
  kvxfer bench native [--sizes 4k,32k,...] [--memory ucx,host] [--json]
      kvxfer vs ucx_perftest bandwidth and message rate
  kvxfer bench plan [--json]
      time to build transfer plans at production scale`;

async function main(argv: string[]): Promise<number> {
  const [command, ...rest] = argv;
  switch (command) {
    case "demo": {
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
      if (suite === "plan") {
        const mod = await import("../../bench/plan.js");
        mod.main(args);
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
    process.exitCode = code;
  },
  (err: unknown) => {
    console.error(`kvxfer: ${err instanceof Error ? err.message : String(err)}`);
    process.exitCode = 1;
  },
);
