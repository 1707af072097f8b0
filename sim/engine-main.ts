#!/usr/bin/env node
/** Runs a simulated engine directly: `node dist/sim/engine-main.js --engine-id ... --role ...`. */
import { runSimEngine } from "./engine-process.js";

runSimEngine(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (err: unknown) => {
    process.stderr.write(
      `kvxfer sim-engine: ${err instanceof Error ? err.message : String(err)}\n`,
    );
    process.exit(1);
  },
);
