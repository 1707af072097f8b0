/**
 * The simulator's `kvxfer` subcommands, `sim-engine` and `demo`, declared with
 * the product's command-line contract (src/cli/contract.ts). The product's CLI
 * loads them from this package (src/cli/optional.ts) when one is asked for.
 */
import {
  choice,
  type CommandSpec,
  FLAG,
  LOG_LEVELS,
  NON_NEG_INT,
  PEER_AUTH,
  POS_INT,
  STR,
} from "../src/cli/contract.js";
import { KV_REGION_SCHEMES } from "../src/plan/index.js";
import { parseDemoArgs, runDemoCommand } from "./demo-command.js";
import { parseSimEngineArgs, SIM_MODELS } from "./engine-input.js";
import { runSimEngine } from "./engine-process.js";

export const commands: readonly CommandSpec[] = [
  {
    path: ["sim-engine"],
    summary: "a simulated engine next to a sidecar (see docs/engine-link.md)",
    options: [
      {
        name: "engine-id",
        kind: STR,
        arg: "ID",
        help: "the engine id, as the sidecar's (required)",
        required: true,
      },
      {
        name: "role",
        kind: choice("prefill", "decode", "both"),
        help: "what the engine does (required)",
        required: true,
      },
      {
        name: "socket",
        kind: STR,
        arg: "ENDPOINT",
        help: "the sidecar's engine link",
        def: "ipc:///tmp/kvxfer-<engine-id>.sock",
      },
      { name: "tp", kind: POS_INT, help: "tensor-parallel ranks", def: "1" },
      {
        name: "model",
        kind: choice(...Object.keys(SIM_MODELS)),
        help: "model shape",
        def: "llama3-8b",
      },
      { name: "layers", kind: POS_INT, help: "override the model's layers" },
      { name: "kv-heads", kind: POS_INT, help: "override the model's KV heads" },
      { name: "head-dim", kind: POS_INT, help: "override the model's head dimension" },
      { name: "block", kind: POS_INT, help: "tokens per block", def: "16" },
      { name: "blocks", kind: POS_INT, help: "blocks per rank", def: "128" },
      {
        name: "layout",
        kind: { t: "choice", of: ["hnd", "nhd"], ci: true },
        help: "order inside a block",
        def: "hnd",
      },
      {
        name: "scheme",
        kind: choice(...KV_REGION_SCHEMES),
        help: "KV regions",
        def: "region-per-layer",
      },
      { name: "shm-dir", kind: STR, arg: "DIR", help: "where the KV files go", def: "/dev/shm" },
      {
        name: "kv-memory",
        kind: choice("file", "segment"),
        help: "KV in files this engine creates under --shm-dir, or in shared-memory segments the sidecar allocates (AllocateKv)",
        def: "file",
      },
      { name: "seed", kind: NON_NEG_INT, help: "block allocation order", def: "random" },
      {
        name: "register-timeout-ms",
        kind: POS_INT,
        help: "how long to wait for Registered",
        def: "10000",
      },
      {
        name: "sidecar-lost-ms",
        kind: POS_INT,
        help: "sidecar unreachable this long: fail every transfer in flight",
        def: "10000",
      },
      {
        name: "check-after-ms",
        kind: NON_NEG_INT,
        help: "decode: check the KV this long after KvReady, not at once",
        def: "0",
      },
      {
        name: "log-level",
        kind: choice(...LOG_LEVELS),
        help: "pino level for stderr logs",
        def: "warn",
      },
    ],
    epilog: "control: JSON lines on stdin; replies and events on stdout (docs/engine-link.md).",
    valueStyle: "eq",
    check: (argv) => {
      try {
        parseSimEngineArgs(argv);
      } catch (e) {
        // What drives a sim-engine reads its stdout: the refusal as a JSON line too.
        process.stdout.write(
          JSON.stringify({ event: "error", code: "ERR_USAGE", message: (e as Error).message }) +
            "\n",
        );
        throw e;
      }
    },
    run: (argv) => runSimEngine(argv),
  },
  {
    path: ["demo"],
    summary: "sidecars and simulated engines as processes, a workload, every byte verified",
    options: [
      { name: "prefill", kind: POS_INT, help: "prefill engines" },
      { name: "decode", kind: POS_INT, help: "decode engines" },
      { name: "p-tp", kind: POS_INT, help: "prefill tensor-parallel ranks" },
      { name: "d-tp", kind: POS_INT, help: "decode tensor-parallel ranks" },
      { name: "p-block", kind: POS_INT, help: "prefill tokens per block" },
      { name: "d-block", kind: POS_INT, help: "decode tokens per block" },
      { name: "layout", kind: choice("hnd", "nhd"), help: "order inside a block" },
      { name: "p-scheme", kind: choice(...KV_REGION_SCHEMES), help: "prefill KV regions" },
      { name: "d-scheme", kind: choice(...KV_REGION_SCHEMES), help: "decode KV regions" },
      { name: "model", kind: choice(...Object.keys(SIM_MODELS)), help: "model shape" },
      { name: "layers", kind: POS_INT, help: "override the model's layers" },
      { name: "kv-heads", kind: POS_INT, help: "override the model's KV heads" },
      { name: "head-dim", kind: POS_INT, help: "override the model's head dimension" },
      { name: "mode", kind: choice("push", "pull", "auto"), help: "transfer mode" },
      {
        name: "dispatch",
        kind: choice("sequential", "concurrent"),
        help: "how the router sends P and D requests",
      },
      { name: "requests", kind: POS_INT, help: "requests in the workload" },
      { name: "prompt-tokens", kind: { t: "ints" }, help: "prompt lengths, cycled" },
      { name: "prefix-tokens", kind: NON_NEG_INT, help: "shared prefix (prefix caching)" },
      { name: "compute-ms", kind: NON_NEG_INT, help: "simulated prefill compute per request" },
      { name: "concurrency", kind: POS_INT, help: "requests in flight" },
      { name: "blocks", kind: POS_INT, help: "blocks per rank" },
      { name: "transport", kind: choice("shm", "tcp"), help: "UCX transport" },
      {
        name: "kv-memory",
        kind: choice("segment", "file"),
        help: "the engines' KV in shared-memory segments their sidecars allocate, or in files the engines create",
        def: "segment; file with --transport tcp",
      },
      PEER_AUTH,
      { name: "json", kind: FLAG, help: "the summary as JSON" },
    ],
    valueStyle: "eq",
    check: (argv) => {
      parseDemoArgs(argv);
    },
    run: (argv) => runDemoCommand(argv),
  },
];
