/**
 * `kvxfer demo` as a command: its flags into `DemoOptions`, the run, and the
 * summary printed as tables or JSON.
 */
import { parseArgs } from "node:util";

import { KV_REGION_SCHEMES } from "../src/plan/index.js";
import { SIM_MODELS, type SimModel } from "./engine-input.js";
import { runDemo } from "./demo.js";
import { DEFAULT_DEMO, type DemoOptions, type DemoSummary } from "./demo-types.js";
import { TCP_NO_SEGMENTS } from "./demo-node.js";

const DEMO_USAGE = `usage: kvxfer demo [--prefill N] [--decode N] [--p-tp N] [--d-tp N] [--p-block N] [--d-block N]
  [--layout hnd|nhd] [--p-scheme NAME] [--d-scheme NAME] [--model ${Object.keys(SIM_MODELS).join("|")}] [--layers N] [--kv-heads N] [--head-dim N]
  [--mode push|pull|auto] [--dispatch sequential|concurrent|alternating] [--requests N] [--prompt-tokens N[,N...]]
  [--prefix-tokens N] [--compute-ms N] [--concurrency N] [--blocks N] [--transport shm|tcp|default] [--kv-memory segment|file]
  [--peer-auth on|off] [--json]`;

function int(name: string, v: string | undefined, min = 1): number | undefined {
  if (v === undefined) return undefined;
  const n = Number(v);
  if (!Number.isSafeInteger(n) || n < min)
    throw new Error(`--${name} must be an integer >= ${min}, got '${v}'`);
  return n;
}

function choice<T extends string>(
  name: string,
  v: string | undefined,
  allowed: readonly T[],
): T | undefined {
  if (v === undefined) return undefined;
  if (!(allowed as readonly string[]).includes(v))
    throw new Error(`--${name} must be one of ${allowed.join(", ")}, got '${v}'`);
  return v as T;
}

/**
 * Parses `kvxfer demo` flags. `notes`: settings the demo changed on its own (to be printed:
 * nothing is switched silently).
 */
export function parseDemoArgs(argv: string[]): {
  options: DemoOptions;
  json: boolean;
  notes: string[];
} {
  const notes: string[] = [];
  const s = { type: "string" } as const;
  const { values } = parseArgs({
    args: argv,
    strict: true,
    options: {
      prefill: s,
      decode: s,
      "p-tp": s,
      "d-tp": s,
      "p-block": s,
      "d-block": s,
      layout: s,
      "p-scheme": s,
      "d-scheme": s,
      model: s,
      layers: s,
      "kv-heads": s,
      "head-dim": s,
      mode: s,
      dispatch: s,
      requests: s,
      "prompt-tokens": s,
      "prefix-tokens": s,
      "compute-ms": s,
      concurrency: s,
      blocks: s,
      transport: s,
      "kv-memory": s,
      "peer-auth": s,
      json: { type: "boolean" },
    },
  });
  const o: DemoOptions = { ...DEFAULT_DEMO };
  const set = <K extends keyof DemoOptions>(k: K, v: DemoOptions[K] | undefined): void => {
    if (v !== undefined) o[k] = v;
  };
  set("prefill", int("prefill", values.prefill));
  set("decode", int("decode", values.decode));
  set("pTp", int("p-tp", values["p-tp"]));
  set("dTp", int("d-tp", values["d-tp"]));
  set("pBlock", int("p-block", values["p-block"]));
  set("dBlock", int("d-block", values["d-block"]));
  set("layout", choice("layout", values.layout, ["hnd", "nhd"] as const));
  set("pScheme", choice("p-scheme", values["p-scheme"], KV_REGION_SCHEMES));
  set("dScheme", choice("d-scheme", values["d-scheme"], KV_REGION_SCHEMES));
  const model = choice("model", values.model, Object.keys(SIM_MODELS) as SimModel[]);
  if (model !== undefined) {
    o.model = model;
    // A named model runs at its full size unless --layers says otherwise.
    delete o.layers;
  }
  set("layers", int("layers", values.layers));
  set("kvHeads", int("kv-heads", values["kv-heads"]));
  set("headDim", int("head-dim", values["head-dim"]));
  set("mode", choice("mode", values.mode, ["push", "pull", "auto"] as const));
  set(
    "dispatch",
    choice("dispatch", values.dispatch, ["sequential", "concurrent", "alternating"] as const),
  );
  set("requests", int("requests", values.requests));
  if (values["prompt-tokens"] !== undefined) {
    o.promptTokens = values["prompt-tokens"].split(",").map((x) => int("prompt-tokens", x)!);
  }
  set("prefixTokens", int("prefix-tokens", values["prefix-tokens"], 0));
  set("computeMs", int("compute-ms", values["compute-ms"], 0));
  set("concurrency", int("concurrency", values.concurrency));
  set("blocks", int("blocks", values.blocks));
  set("transport", choice("transport", values.transport, ["shm", "tcp", "default"] as const));
  set("kvMemory", choice("kv-memory", values["kv-memory"], ["segment", "file"] as const));
  if (o.transport === "tcp" && o.kvMemory === "segment") {
    if (values["kv-memory"] !== undefined) throw new Error(TCP_NO_SEGMENTS);
    o.kvMemory = "file";
    notes.push(
      "note: --transport tcp: the engines' KV in files (UCX over TCP alone cannot allocate shared segments; give --kv-memory file to silence this)",
    );
  }
  const auth = choice("peer-auth", values["peer-auth"], ["on", "off"] as const);
  if (auth !== undefined) o.peerAuth = auth === "on";
  // A TP size the model's KV heads cannot be split over is refused here, in the user's terms,
  // before any process starts.
  const shape = SIM_MODELS[o.model];
  const heads = o.kvHeads ?? shape.totalKvHeads;
  for (const [flag, tp] of [
    ["p-tp", o.pTp],
    ["d-tp", o.dTp],
  ] as const) {
    if (!shape.mla && heads % tp !== 0 && tp % heads !== 0)
      throw new Error(
        `--${flag} ${tp}: TP ${tp} does not divide the ${heads} KV heads of ${o.model} (nor is it a multiple of them)`,
      );
  }
  // Pull needs P's block ids before D asks: the router waits for prefill.
  if (o.mode === "pull" && values.dispatch === undefined && o.dispatch !== "sequential") {
    o.dispatch = "sequential";
    notes.push(
      "note: --mode pull: dispatch set to sequential (D must know P's block ids before it reads them; give --dispatch to choose)",
    );
  }
  if (o.mode === "pull" && o.dispatch === "concurrent")
    throw new Error("--mode pull needs --dispatch sequential (D must know P's block ids)");
  return { options: o, json: values.json === true, notes };
}

/** Bytes in binary units, as `kvxfer status` prints them (MiB). */
function mib(bytes: number): string {
  return `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

export function formatDemoSummary(s: DemoSummary): string {
  const sent =
    s.transfers === s.requested
      ? `${s.transfers}`
      : `${s.transfers} sent of ${s.requested} requested`;
  const seconds = s.elapsedMs / 1000;
  const gibps = seconds > 0 ? s.bytes / 2 ** 30 / seconds : 0;
  const lines = [
    "",
    ...(s.interrupted
      ? [
          `interrupted: stopped after ${s.transfers} of ${s.requested} transfers` +
            (s.cut > 0 ? `; ${s.cut} in flight were cut (not counted as failed)` : ""),
        ]
      : []),
    `transfers: ${sent} (mode ${s.mode}: ${
      Object.entries(s.byMode)
        .map(([m, n]) => `${n} ${m}`)
        .join(", ") || "none ready"
    }; ${s.dispatch} dispatch), failed: ${s.failed}, mismatched: ${s.mismatches}, leaked blocks: ${s.leakedBlocks}`,
    `kvxfer: KV ready after prefill p50 ${s.readyLatencyMs.p50} ms, p99 ${s.readyLatencyMs.p99} ms (P's engine done -> the router heard KV_READY)`,
    ...(s.dataPhase !== undefined
      ? [
          `kvxfer data phase: p50 ${s.dataPhase.p50Ms.toFixed(2)} ms per transfer, ${s.dataPhase.gbps.toFixed(2)} GB/s ` +
            `(${mib(s.dataPhase.bytes)} over ${s.dataPhase.transfers} transfers: first write or read handed to UCX -> last flushed)`,
        ]
      : []),
    ...(s.prefixBytes > 0
      ? [
          `prefix caching: ${s.prefixTokens} tokens were already on D and did not move (${mib(s.prefixBytes)} saved); verified covers them too`,
        ]
      : []),
    ...(s.simulation !== undefined
      ? [
          `the simulation around it (not kvxfer): prefill compute p50 ${s.simulation.computeMsP50} ms per request, ` +
            `D's check of every byte p50 ${s.simulation.checkMsP50.toFixed(1)} ms per transfer`,
        ]
      : []),
    `wall clock: ${mib(s.bytes)} moved in ${seconds.toFixed(2)} s (${gibps.toFixed(2)} GiB/s, simulated compute and checking included)`,
    s.verified
      ? `verified: every byte of every transfer checked on D (${mib(s.checkedBytes)})`
      : s.interrupted
        ? `NOT verified: interrupted (${mib(s.checkedBytes)} checked on D before the stop)`
        : `NOT verified`,
    ...s.failures.map((f) => `  failure: ${f}`),
  ];
  return lines.join("\n");
}

export async function runDemoCommand(argv: string[]): Promise<number> {
  if (argv.includes("--help") || argv.includes("-h")) {
    console.log(DEMO_USAGE);
    return 0;
  }
  const { options, json, notes } = parseDemoArgs(argv);
  // What the demo changed on its own is said first (on stderr with --json: stdout is the JSON).
  for (const n of notes) (json ? console.error : console.log)(n);
  if (!json) {
    options.log = (l): void => console.log(l);
    let shown = -1;
    options.progress = (done, total): void => {
      const pct = Math.floor((done / total) * 20);
      if (pct === shown && done !== total) return;
      shown = pct;
      process.stdout.write(
        `\r[${"#".repeat(pct)}${" ".repeat(20 - pct)}] ${done}/${total} transfers`,
      );
      if (done === total) process.stdout.write("\n");
    };
  }
  // Ctrl-C (or SIGTERM): no new requests, then every process is stopped and its
  // shared-memory files removed; a second signal leaves at once.
  const controller = new AbortController();
  options.signal = controller.signal;
  const onSignal = (sig: NodeJS.Signals): void => {
    if (controller.signal.aborted) process.exit(sig === "SIGINT" ? 130 : 143);
    console.error(`\n${sig}: stopping after the transfers in flight; cleaning up`);
    controller.abort();
  };
  process.on("SIGINT", onSignal);
  process.on("SIGTERM", onSignal);
  const summary = await runDemo(options);
  process.off("SIGINT", onSignal);
  process.off("SIGTERM", onSignal);
  if (json) console.log(JSON.stringify(summary));
  else console.log(formatDemoSummary(summary));
  return summary.verified ? 0 : 1;
}
