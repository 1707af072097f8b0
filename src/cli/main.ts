#!/usr/bin/env node
/**
 * The `kvxfer` command: sidecar, status, watch, await (declared in
 * commands.ts), and, from packages the product does not depend on, sim-engine,
 * demo, native-demo and bench (optional.ts). The contract (--help, --version,
 * usage errors, exit codes) is in contract.ts.
 */
import { KvxferError } from "../errors.js";
import { COMMANDS } from "./commands.js";
import { runCli } from "./contract.js";
import { optionalCommands } from "./optional.js";

const argv = process.argv.slice(2);
optionalCommands(argv)
  .then((optional) => runCli([...COMMANDS, ...optional], argv))
  .then(
    (code) => {
      // Sidecars and engines may hold sockets and timers: their exit code is final.
      process.exit(code);
    },
    (err: unknown) => {
      // A KvxferError shows its code: ERR_CONFIG and the like are what an operator searches for.
      const code = err instanceof KvxferError ? `${err.code}: ` : "";
      const verbose = process.argv.includes("--verbose");
      console.error(
        `kvxfer: ${code}${err instanceof Error ? (verbose ? (err.stack ?? err.message) : err.message) : String(err)}`,
      );
      // A setting refused (flag, KVXFER_* variable or --config file) is a usage error.
      process.exit(err instanceof KvxferError && err.code === "ERR_CONFIG" ? 2 : 1);
    },
  );
