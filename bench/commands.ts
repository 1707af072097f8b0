/**
 * The benchmarks' `kvxfer` subcommands, `bench <suite>` and `native-demo`,
 * declared with the product's command-line contract (src/cli/contract.ts). The
 * product's CLI loads them from this package (src/cli/optional.ts) when one is
 * asked for; each suite's module is loaded only when that suite runs.
 */
import {
  choice,
  type CommandSpec,
  FLAG,
  JSON_OPT,
  list,
  NON_NEG_INT,
  type OptSpec,
  PEER_AUTH,
  POS_INT,
  STR,
} from "../src/cli/contract.js";

const QUICK: OptSpec = {
  name: "quick",
  kind: FLAG,
  help: "fewer sizes and samples (minutes, not hours)",
};

async function bench(suite: string, argv: string[]): Promise<number> {
  switch (suite) {
    case "native":
      await (await import("./native.js")).main(argv);
      return 0;
    case "events":
      await (await import("./events.js")).main(argv);
      return 0;
    case "plan":
      (await import("./plan.js")).main(argv);
      return 0;
    case "e2e":
      await (await import("./e2e.js")).main(argv);
      return 0;
    case "modes":
      await (await import("./modes.js")).main(argv);
      return 0;
    case "control":
      await (await import("./control.js")).main(argv);
      return 0;
    case "vllm":
      await (await import("./vllm.js")).main(argv);
      return 0;
    case "peers":
      await (await import("./peers.js")).main(argv);
      return 0;
    case "all":
      await (await import("./all.js")).main(argv);
      return 0;
    case "plot": {
      // Each plot drawn on stdout; each results file it could not use on stderr, with why.
      const { files, problems } = (await import("./all.js")).plots();
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

export const commands: readonly CommandSpec[] = [
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
      const summary = await (
        await import("./native/demo.js")
      ).runNativeDemo({
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
      (await import("./e2e.js")).parseE2eArgs(argv);
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
      (await import("./modes.js")).parseModesArgs(argv);
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
      (await import("./control.js")).parseControlArgs(argv);
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
        kind: list("nixl", "nixl-fixed", "nixl-push", "mooncake"),
        help: "vLLM's own connectors beside kvxfer (nixl: as shipped and with two CPU fixes; nixl-fixed: only the latter)",
      },
      { name: "install-peers", kind: FLAG, help: "install the pinned peers into .venv first" },
      {
        name: "faults",
        kind: FLAG,
        help: "each P/D system once more with P's side channel unreachable",
      },
      {
        name: "breakdown",
        kind: FLAG,
        help: "instead: where each kvxfer request's time goes, hop by hop (router, connectors, sidecars), medians and the slowest tenth (--modes pull or push, one)",
      },
      {
        name: "models",
        kind: FLAG,
        help: "instead: every model family (tiny random-weight models) through kvxfer and NixlConnector: bytes moved per request, TTFT, KV capacity, correctness",
      },
      {
        name: "families",
        kind: list(
          "qwen3",
          "mistral-sw",
          "gemma3",
          "qwen3-next",
          "deepseek-v2",
          "mixtral",
          "gpt-oss",
          "mamba2",
        ),
        help: "--models: the families",
        def: "all",
      },
      { name: "no-nixl", kind: FLAG, help: "--models: kvxfer and one engine only" },
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
      {
        name: "prefault",
        kind: list("false", "true"),
        help: "the sidecars' --prefault (one value; default true, as the Helm chart deploys them); --breakdown: the settings to compare",
        def: "true",
      },
      {
        name: "load",
        kind: { t: "int", min: 0 },
        arg: "N",
        help: "N CPU hog processes (unpinned Python busy loops) beside the engines for the whole run",
        def: "0",
      },
      {
        name: "load-nice",
        kind: { t: "int", min: -20 },
        arg: "K",
        help: "the hogs' niceness",
        def: "0",
      },
      {
        name: "pin-engines",
        kind: FLAG,
        help: "every process of each engine on its core (taskset), for every system alike (and in --breakdown); without it only vLLM's model threads are bound",
      },
      {
        name: "idle-wait-s",
        kind: { t: "number", min: 0 },
        help: "kvxfer's idle_wait_s (default: the connector's; 0: vLLM's own loop while a transfer waits; also in --breakdown)",
      },
      {
        name: "worker-rest-s",
        kind: { t: "number", min: 0 },
        help: "kvxfer's worker_rest_s (default: the connector's; 0: vLLM's worker spins a second after each step; also in --breakdown)",
      },
      {
        name: "engine-spin-s",
        kind: { t: "number", min: 0 },
        help: "kvxfer's engine_spin_s (default: the connector's; 0: vLLM's engine core spins a second on its workers' answers; also in --breakdown)",
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
      {
        name: "faults",
        kind: FLAG,
        help: "instead: each agent over TCP on a capped, lossy, delayed and cut link (bench/peer-faults.ts; root, tc, iptables)",
      },
    ],
    async (argv) => {
      if (argv.includes("--faults"))
        (await import("./peer-faults.js")).parsePeerFaultsArgs(
          argv.filter((a) => a !== "--faults"),
        );
      else (await import("./peers.js")).parsePeersArgs(argv);
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
