/**
 * Every `kvxfer` subcommand, declared once: its flags and their kinds, what it
 * is for, how it runs. `contract.ts` turns these into the parser, each
 * command's `--help` and the main usage.
 */
import { KV_REGION_SCHEMES } from "../plan/layout.js";
import { EVENT_KINDS } from "../sidecar/event-log.js";
import { runSidecar, SIDECAR_SETTINGS, type SettingName } from "./sidecar.js";
import { parseDemoArgs, runDemoCommand } from "../sim/demo.js";
import { parseSimEngineArgs, runSimEngine, SIM_MODELS } from "../sim/engine.js";
import { runAwait } from "./await.js";
import {
  BOOL_STR,
  choice,
  type CommandSpec,
  FLAG,
  type Kind,
  list,
  NON_NEG_INT,
  type OptSpec,
  POS_INT,
  STR,
} from "./contract.js";
import { runNativeDemo } from "./native-demo.js";
import { runStatus } from "./status.js";
import { runWatch } from "./watch.js";

const JSON_OPT: OptSpec = { name: "json", kind: FLAG, help: "one JSON document instead of tables" };
const QUICK: OptSpec = {
  name: "quick",
  kind: FLAG,
  help: "fewer sizes and samples (minutes, not hours)",
};
const PEER_AUTH: OptSpec = {
  name: "peer-auth",
  kind: choice("on", "off"),
  help: "side channel with mutual TLS (on) or without (off)",
};
const LOG_LEVELS = ["fatal", "error", "warn", "info", "debug", "trace", "silent"];

/**
 * The kind of each sidecar setting's value (all arrive as strings: flag, env or
 * config file). A setting not listed takes any string; the sidecar checks it.
 */
const SIDECAR_KINDS: Partial<Record<SettingName, Kind>> = {
  "engine-id": STR,
  role: choice("prefill", "decode", "both"),
  "engine-socket": STR,
  "engine-max-frame-bytes": POS_INT,
  listen: STR,
  "peer-cert": STR,
  "peer-key": STR,
  "peer-ca": STR,
  "insecure-peers": BOOL_STR,
  mode: choice("push", "pull", "auto"),
  transports: STR,
  "net-devices": STR,
  "error-mode": choice("none", "peer"),
  "busy-poll": BOOL_STR,
  "spin-us": STR, // "auto" or a non-negative integer: the sidecar checks it
  "lease-ms": POS_INT,
  "reg-lease-ms": POS_INT,
  "transfer-timeout-ms": POS_INT,
  "heartbeat-ms": POS_INT,
  "peer-timeout-ms": POS_INT,
  "abort-grace-ms": POS_INT,
  "max-transfers": POS_INT,
  "kv-dir": STR,
  "max-registration-bytes": { t: "bytes" },
  "max-kv-bytes": { t: "bytes" },
  prefault: BOOL_STR,
  "exclusive-prefill-blocks": BOOL_STR,
  "tombstone-ms": POS_INT,
  "event-log-capacity": POS_INT,
  grpc: STR,
  metrics: STR,
  "otlp-endpoint": STR,
  advertise: STR,
  bootstrap: STR,
  "notify-zmq": STR,
  "tls-cert": STR,
  "tls-key": STR,
  "tls-ca": STR,
  "drain-ms": POS_INT,
  "engine-lease-ms": NON_NEG_INT,
  "log-level": choice(...LOG_LEVELS),
  config: STR,
};

const SIDECAR_OPTIONS: OptSpec[] = (
  Object.entries(SIDECAR_SETTINGS) as [SettingName, { help: string; default: string }][]
).map(([name, s]) => ({
  name,
  kind: SIDECAR_KINDS[name] ?? STR,
  ...((SIDECAR_KINDS[name] ?? STR).t === "string"
    ? { arg: name === "engine-id" ? "ID" : "VALUE" }
    : {}),
  help: s.help,
  def: s.default,
  ...(name === "engine-id" ? { required: true } : {}),
}));

/** The client commands' TLS flags and --verbose. */
const CLIENT_OPTIONS: OptSpec[] = [
  {
    name: "ca",
    kind: STR,
    arg: "FILE",
    help: "trust this CA for the sidecar's certificate; turns TLS on",
  },
  { name: "cert", kind: STR, arg: "FILE", help: "client certificate, for mutual TLS (with --key)" },
  { name: "key", kind: STR, arg: "FILE", help: "client key, for mutual TLS (with --cert)" },
  {
    name: "server-name",
    kind: STR,
    arg: "NAME",
    help: "check the sidecar's certificate against this name instead of the address host",
  },
  { name: "verbose", kind: FLAG, help: "errors with their details and stack" },
];

const ADDRESS = { name: "host:port", required: true };
const ADDRESS_EPILOG =
  'host:port is the sidecar\'s gRPC address, as its ready line prints it ("grpc"): ' +
  "--grpc defaults to 127.0.0.1:0 (a free port), so there is no fixed default port.";

async function bench(suite: string, argv: string[]): Promise<number> {
  switch (suite) {
    case "native":
      await (await import("../../bench/native.js")).main(argv);
      return 0;
    case "events":
      await (await import("../../bench/events.js")).main(argv);
      return 0;
    case "plan":
      (await import("../../bench/plan.js")).main(argv);
      return 0;
    case "e2e":
      await (await import("../../bench/e2e.js")).main(argv);
      return 0;
    case "modes":
      await (await import("../../bench/modes.js")).main(argv);
      return 0;
    case "control":
      await (await import("../../bench/control.js")).main(argv);
      return 0;
    case "vllm":
      await (await import("../../bench/vllm.js")).main(argv);
      return 0;
    case "peers":
      await (await import("../../bench/peers.js")).main(argv);
      return 0;
    case "all":
      await (await import("../../bench/all.js")).main(argv);
      return 0;
    case "plot": {
      // Each plot drawn on stdout; each results file it could not use on stderr, with why.
      const { files, problems } = (await import("../../bench/all.js")).plots();
      for (const file of files) console.log(file);
      for (const p of problems) console.error(`kvxfer bench plot: ${p}`);
      if (files.length === 0) console.error("kvxfer bench plot: no plot drawn");
      return files.length === 0 ? 1 : 0;
    }
  }
  throw new Error(`unknown bench suite '${suite}'`);
}

function benchSpec(
  suite: string,
  summary: string,
  options: OptSpec[],
  check?: (argv: string[]) => Promise<void>,
  epilog?: string,
): CommandSpec {
  return {
    path: ["bench", suite],
    summary,
    options,
    valueStyle: "space",
    ...(check !== undefined ? { check } : {}),
    ...(epilog !== undefined ? { epilog } : {}),
    run: (argv) => bench(suite, argv),
  };
}

export const COMMANDS: readonly CommandSpec[] = [
  {
    path: ["sidecar"],
    summary:
      "one sidecar next to one engine; every flag may also come from KVXFER_<FLAG> (e.g. KVXFER_ENGINE_ID) or a JSON --config file",
    options: SIDECAR_OPTIONS,
    epilog:
      "settings: flag > KVXFER_<FLAG> environment variable > --config file > default.\n" +
      'stdout: one {"event":"ready",...} line once listening (its "grpc" is the address for status/watch/await).',
    valueStyle: "eq",
    run: (argv) => runSidecar(argv),
  },
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
  {
    path: ["status"],
    args: [ADDRESS],
    summary: "the sidecar's identity, peers, transfers by state, bytes moved, event log, health",
    options: [
      JSON_OPT,
      {
        name: "timeout",
        kind: { t: "number", min: 0, above: true },
        arg: "MS",
        help: "per call",
        def: "10000",
      },
      {
        name: "trace",
        kind: STR,
        arg: "TRANSFER_ID",
        help: "instead: that transfer's hops on this sidecar (µs, this host's monotonic clock)",
      },
      ...CLIENT_OPTIONS,
    ],
    epilog: ADDRESS_EPILOG,
    valueStyle: "eq",
    run: (argv) => runStatus(argv),
  },
  {
    path: ["watch"],
    args: [ADDRESS],
    summary:
      "events as they happen, one per line; reconnects and resumes after the last seq it printed",
    options: [
      {
        name: "from",
        kind: NON_NEG_INT,
        arg: "SEQ",
        help: "start with event SEQ (0: every retained event); default: new events only",
      },
      { name: "transfer", kind: STR, arg: "ID", help: "only this transfer", multiple: true },
      {
        name: "kind",
        kind: choice(...EVENT_KINDS),
        help: "only this kind of event",
        multiple: true,
      },
      { name: "count", kind: POS_INT, help: "exit after N events" },
      {
        name: "retries",
        kind: NON_NEG_INT,
        help: "reconnect attempts in a row before giving up (exit 1)",
        def: "10",
      },
      JSON_OPT,
      ...CLIENT_OPTIONS,
    ],
    epilog: ADDRESS_EPILOG,
    valueStyle: "eq",
    run: (argv) => runWatch(argv),
  },
  {
    path: ["await"],
    args: [ADDRESS, { name: "transfer-id", required: true }],
    summary:
      "waits for one transfer's terminal event (exit 0 KV_READY or RELEASED, 1 FAILED, EXPIRED or ABORTED, 3 timed out, 4 other error)",
    options: [
      {
        name: "timeout",
        kind: { t: "number", min: 0, above: true },
        arg: "MS",
        help: "how long to wait",
        def: "30000",
      },
      { name: "side", kind: choice("prefill", "decode"), help: "which side's end to wait for" },
      JSON_OPT,
      ...CLIENT_OPTIONS,
    ],
    epilog:
      ADDRESS_EPILOG +
      "\nexit 0: KV_READY or RELEASED; 1: FAILED, EXPIRED or ABORTED; 2: usage; 3: timed out; 4: other error",
    valueStyle: "eq",
    run: (argv) => runAwait(argv),
  },
  {
    path: ["native-demo"],
    summary:
      "two processes, two UCX agents: writes and reads a region both ways over shared memory and checks every byte",
    options: [
      { name: "size", kind: POS_INT, arg: "BYTES", help: "region size", def: String(64 << 20) },
      { name: "json", kind: FLAG, help: "the summary as JSON" },
    ],
    valueStyle: "eq",
    run: async (argv) => {
      const json = argv.includes("--json");
      const sizeArg = argv.find((a) => a.startsWith("--size="));
      const size = sizeArg === undefined ? 64 << 20 : Number(sizeArg.slice("--size=".length));
      const summary = await runNativeDemo({
        size,
        log: json ? undefined : (l) => console.log(l),
      });
      if (json) console.log(JSON.stringify(summary));
      return summary.verified ? 0 : 1;
    },
  },
  benchSpec(
    "native",
    "kvxfer vs ucx_perftest bandwidth and message rate",
    [
      { name: "sizes", kind: { t: "sizes" }, help: "message sizes" },
      { name: "memory", kind: list("ucx", "host"), help: "memory kinds" },
      { name: "transports", kind: STR, arg: "UCX_TLS", help: "UCX transports", def: "shm,self" },
      JSON_OPT,
    ],
    undefined,
    "writes bench/results/native.json (or $KVXFER_BENCH_RESULTS/native.json), the input of `kvxfer bench plot`.",
  ),
  benchSpec("plan", "time to build transfer plans at production scale", [
    { name: "runs", kind: POS_INT, help: "runs per case" },
    { name: "case", kind: STR, arg: "NAME", help: "only this case", multiple: true },
    JSON_OPT,
  ]),
  benchSpec("events", "KV_READY to gRPC watcher latency, 1 and 64 watchers", [
    { name: "watchers", kind: { t: "ints" }, help: "watcher counts", def: "1,64" },
    { name: "events", kind: POS_INT, help: "events for the latency figures" },
    { name: "burst", kind: POS_INT, help: "events in the burst" },
    JSON_OPT,
  ]),
  benchSpec(
    "e2e",
    "full sidecars vs the native addon alone on the same plans, by prompt length",
    [
      QUICK,
      JSON_OPT,
      { name: "modes", kind: list("push", "pull"), help: "transfer modes" },
      { name: "tokens", kind: { t: "ints" }, help: "prompt lengths", def: "128,512,2048,8192" },
      { name: "layers", kind: POS_INT, help: "model layers" },
      { name: "rounds", kind: POS_INT, help: "rounds per length" },
      { name: "reps", kind: POS_INT, help: "native reference repetitions" },
      PEER_AUTH,
      {
        name: "spin-us",
        kind: NON_NEG_INT,
        help: "both sidecars' --spin-us (default: the sidecar's own default)",
      },
      {
        name: "kv-memory",
        kind: choice("file", "segment"),
        help: "the engines' KV in shared-memory files, or in segments the sidecars allocate (the reference uses the same kind)",
        def: "file",
      },
    ],
    async (argv) => {
      (await import("../../bench/e2e.js")).parseE2eArgs(argv);
    },
  ),
  benchSpec(
    "modes",
    "push vs pull vs auto, sequential and concurrent dispatch: TTFT and KV-ready p50/p99",
    [
      QUICK,
      JSON_OPT,
      { name: "tokens", kind: { t: "ints" }, help: "prompt lengths" },
      { name: "requests", kind: POS_INT, help: "requests per cell" },
      {
        name: "ms-per-token",
        kind: { t: "number", min: 0 },
        help: "simulated prefill compute per token",
      },
      { name: "decode-step-ms", kind: { t: "number", min: 0 }, help: "simulated decode step" },
      { name: "concurrency", kind: POS_INT, help: "requests in flight" },
      { name: "layers", kind: POS_INT, help: "model layers" },
    ],
    async (argv) => {
      (await import("../../bench/modes.js")).parseModesArgs(argv);
    },
  ),
  benchSpec(
    "control",
    "transfers/s and CPU per transfer of one sidecar pair vs native round trips",
    [
      QUICK,
      JSON_OPT,
      { name: "requests", kind: POS_INT, help: "transfers measured" },
      {
        name: "warmup",
        kind: NON_NEG_INT,
        help: "transfers first, not measured (the native reference warms up too)",
        def: "5000; 200 with --quick",
      },
      { name: "concurrency", kind: POS_INT, help: "transfers in flight" },
      { name: "tokens", kind: POS_INT, help: "tokens per transfer" },
      { name: "reps", kind: POS_INT, help: "native reference round trips" },
      PEER_AUTH,
    ],
    async (argv) => {
      (await import("../../bench/control.js")).parseControlArgs(argv);
    },
  ),
  benchSpec(
    "vllm",
    "real vLLM P/D deployments (CPU build) through kvxfer, beside one engine and vLLM's own NixlConnector, NixlPushConnector and MooncakeConnector: TTFT, E2E, tokens/s, CPU per request, outputs checked token by token",
    [
      QUICK,
      JSON_OPT,
      {
        name: "vs",
        kind: list("nixl", "nixl-push", "mooncake"),
        help: "vLLM's own connectors beside kvxfer (nixl: as shipped and with two CPU fixes)",
      },
      { name: "install-peers", kind: FLAG, help: "install the pinned peers into .venv first" },
      {
        name: "faults",
        kind: FLAG,
        help: "each P/D system once more with P's side channel unreachable",
      },
      { name: "lengths", kind: { t: "ints" }, help: "prompt lengths", def: "32,256,1024,4096" },
      { name: "concurrency", kind: { t: "ints" }, help: "requests in flight", def: "1,8" },
      { name: "requests", kind: POS_INT, help: "requests per cell and round", def: "8" },
      { name: "rounds", kind: POS_INT, help: "rounds over every deployment", def: "2" },
      { name: "output-tokens", kind: POS_INT, help: "tokens generated per request", def: "16" },
      {
        name: "modes",
        kind: list("pull", "push"),
        help: "kvxfer's transfer modes",
        def: "pull,push",
      },
      {
        name: "placement",
        kind: { t: "choice", of: ["shared", "host_buffer"] },
        help: "kvxfer's KV placement",
        def: "shared",
      },
      {
        name: "kv-memory",
        kind: { t: "choice", of: ["file", "segment"] },
        help: "where kvxfer's shared KV lives: files or segments the sidecars allocate",
        def: "file",
      },
    ],
  ),
  benchSpec(
    "peers",
    "kvxfer vs NIXL and Mooncake (from PyPI, in .venv): bandwidth, KV-shaped requests, descriptor posting, notifications",
    [
      QUICK,
      JSON_OPT,
      { name: "install", kind: FLAG, help: "install the peers into .venv first" },
      { name: "python", kind: STR, arg: "PATH", help: "the Python with the peers" },
      { name: "systems", kind: list("kvxfer", "nixl", "mooncake"), help: "systems to compare" },
      { name: "transports", kind: list("shm", "tcp"), help: "transports" },
      { name: "sizes", kind: { t: "sizes" }, help: "message sizes" },
      { name: "tokens", kind: { t: "ints" }, help: "KV-shaped request lengths" },
      { name: "descs", kind: { t: "ints" }, help: "descriptor counts" },
      { name: "rounds", kind: POS_INT, help: "rounds per KV-shaped request" },
      { name: "no-sidecars", kind: FLAG, help: "skip the kvxfer-with-sidecars rows" },
    ],
    async (argv) => {
      (await import("../../bench/peers.js")).parsePeersArgs(argv);
    },
  ),
  benchSpec("all", "every suite in sequence, JSON and plots (SVG, PNG) in bench/results/", [QUICK]),
  benchSpec(
    "plot",
    "the plots (SVG and PNG) again from bench/results/*.json",
    [],
    undefined,
    "reads native.json, e2e.json, modes.json and peers.json in bench/results/ (or $KVXFER_BENCH_RESULTS),\n" +
      "as `kvxfer bench native|e2e|modes|peers|all` write them; writes each plot as SVG and PNG next\n" +
      "to them, prints each file written, and names on\n" +
      "stderr each results file it could not use (missing, garbled, another shape) with why.\n" +
      "exit 1 when it drew no plot.",
  ),
];
