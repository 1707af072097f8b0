/**
 * The simulated engine behind vLLM's command line (vllm-main.ts): the flags `vllm serve` takes
 * that a deployment sets (the Helm chart's engine container: `--model`, `--port`,
 * `--block-size`, `--tensor-parallel-size`, `--kv-transfer-config` naming kvxfer's connector),
 * read the way vLLM and kvxfer's connector read them, plus `--sim-*` flags for the simulation.
 * Anything else is refused by name: a flag this engine would silently ignore could hide a
 * deployment that differs from what it tests.
 */
import { parseArgs } from "node:util";

import { defaultEngineEndpoint, engineIdProblem } from "../src/engine/link.js";
import { UsageError, intFlag } from "./engine-input.js";

export interface SimVllmConfig {
  /** What `--model` named (reported by /v1/models; nothing is loaded). */
  readonly model: string;
  readonly servedModelName: string;
  readonly host: string;
  readonly port: number;
  readonly blockSize: number;
  readonly tp: number;
  /** KV blocks per rank (`--num-gpu-blocks-override`). */
  readonly numBlocks: number;
  readonly maxModelLen: number;
  readonly layers: number;
  readonly kvHeads: number;
  readonly headDim: number;
  /** From `--kv-transfer-config`. */
  readonly engineId: string;
  readonly socket: string;
  readonly shmDir: string;
  /** P's side channel as D must dial it (kv_connector_extra_config.advertise), or "". */
  readonly advertise: string;
  readonly registerTimeoutMs: number;
  readonly sidecarLostMs: number;
  /** Simulated compute: prefill per prompt token (µs), decode per output token (ms). */
  readonly prefillUsPerToken: number;
  readonly decodeMsPerToken: number;
  /** D: longest wait for the sidecar's KvReady or KvFailed before computing locally. */
  readonly kvWaitMs: number;
  /** After SIGTERM: keep answering this long (health already 503) while requests still come. */
  readonly drainMs: number;
  readonly logLevel: string;
}

export const SIM_VLLM_USAGE = `usage: node dist/sim/vllm-main.js --model NAME --kv-transfer-config JSON [options]
The simulated engine with vLLM's command line and HTTP API (/health, /v1/models, /v1/completions,
/metrics), moving its KV through the kvxfer sidecar beside it as kvxfer's vLLM connector does.
vLLM flags:
  --model NAME                  reported by /v1/models (nothing is loaded)
  --served-model-name NAME      (default: --model)
  --host HOST --port N          HTTP address (default 0.0.0.0:8000)
  --block-size N                tokens per KV block (default 16)
  --tensor-parallel-size N      KV ranks (default 1)
  --num-gpu-blocks-override N   KV blocks per rank (default 256)
  --max-model-len N             longest prompt + output (default 4096)
  --kv-transfer-config JSON     {"kv_connector": "KvxferConnector", "engine_id": ID,
                                 "kv_connector_extra_config": {"engine_socket", "shm_dir",
                                 "advertise", "register_timeout_s", "sidecar_lost_timeout_s"}}
Simulation:
  --sim-layers N --sim-kv-heads N --sim-head-dim N   KV shape (default 4 layers, 8 heads x 128)
  --sim-prefill-us-per-token N  prefill compute per prompt token (default 20)
  --sim-decode-ms-per-token N   decode compute per output token (default 2)
  --sim-kv-wait-ms N            D: compute locally after this long without KvReady (default 90000)
  --sim-drain-ms N              after SIGTERM, keep serving this long (default 3000)
  --sim-log-level LEVEL         pino level for stderr (default info)`;

const CONNECTOR = "KvxferConnector";

function obj(v: unknown, what: string): Record<string, unknown> {
  if (typeof v !== "object" || v === null || Array.isArray(v))
    throw new UsageError(`${what} must be a JSON object`);
  return v as Record<string, unknown>;
}

function optString(o: Record<string, unknown>, key: string, what: string): string | undefined {
  const v = o[key];
  if (v === undefined || v === null) return undefined;
  if (typeof v !== "string") throw new UsageError(`${what}.${key} must be a string`);
  return v;
}

function optSeconds(o: Record<string, unknown>, key: string, what: string): number | undefined {
  const v = o[key];
  if (v === undefined || v === null) return undefined;
  if (typeof v !== "number" || !Number.isFinite(v) || v <= 0)
    throw new UsageError(`${what}.${key} must be a positive number of seconds`);
  return Math.round(v * 1000);
}

/** Parses the command line; throws UsageError (code ERR_USAGE) naming the flag at fault. */
export function parseSimVllmArgs(argv: readonly string[]): SimVllmConfig {
  const { values, positionals } = parseArgs({
    args: [...argv],
    strict: true,
    allowPositionals: true,
    options: {
      model: { type: "string" },
      "served-model-name": { type: "string" },
      host: { type: "string" },
      port: { type: "string" },
      "block-size": { type: "string" },
      "tensor-parallel-size": { type: "string" },
      "num-gpu-blocks-override": { type: "string" },
      "max-model-len": { type: "string" },
      "kv-transfer-config": { type: "string" },
      "sim-layers": { type: "string" },
      "sim-kv-heads": { type: "string" },
      "sim-head-dim": { type: "string" },
      "sim-prefill-us-per-token": { type: "string" },
      "sim-decode-ms-per-token": { type: "string" },
      "sim-kv-wait-ms": { type: "string" },
      "sim-drain-ms": { type: "string" },
      "sim-log-level": { type: "string" },
    },
  });
  // `vllm serve MODEL` names the model positionally; so may this.
  if (positionals.length > 1 || (positionals.length === 1 && values.model !== undefined))
    throw new UsageError(`unexpected argument '${positionals.at(-1)}'`);
  const model = values.model ?? positionals[0];
  if (model === undefined || model === "") throw new UsageError("--model is required");
  const raw = values["kv-transfer-config"];
  if (raw === undefined) throw new UsageError("--kv-transfer-config is required");
  let parsed: unknown;
  try {
    parsed = JSON.parse(raw);
  } catch (err) {
    throw new UsageError(`--kv-transfer-config is not JSON: ${(err as Error).message}`);
  }
  const kv = obj(parsed, "--kv-transfer-config");
  if (kv["kv_connector"] !== CONNECTOR)
    throw new UsageError(
      `--kv-transfer-config.kv_connector must be ${CONNECTOR}, got ${JSON.stringify(kv["kv_connector"])}`,
    );
  const engineId = optString(kv, "engine_id", "--kv-transfer-config") ?? "";
  const idProblem = engineIdProblem(engineId, "--kv-transfer-config.engine_id");
  if (idProblem !== undefined) throw new UsageError(idProblem);
  const extra = obj(kv["kv_connector_extra_config"] ?? {}, "kv_connector_extra_config");
  const what = "kv_connector_extra_config";
  const port = intFlag(values.port, "port", 8000, 0);
  if (port > 65535) throw new UsageError(`--port must be at most 65535, got ${port}`);
  const advertise = optString(extra, "advertise", what) ?? "";
  if (advertise !== "" && !/^[^\s:]+:[1-9][0-9]{0,4}$/.test(advertise))
    throw new UsageError(`${what}.advertise must be host:port, got '${advertise}'`);
  return {
    model,
    servedModelName: values["served-model-name"] ?? model,
    host: values.host ?? "0.0.0.0",
    port,
    blockSize: intFlag(values["block-size"], "block-size", 16),
    tp: intFlag(values["tensor-parallel-size"], "tensor-parallel-size", 1),
    numBlocks: intFlag(values["num-gpu-blocks-override"], "num-gpu-blocks-override", 256),
    maxModelLen: intFlag(values["max-model-len"], "max-model-len", 4096),
    layers: intFlag(values["sim-layers"], "sim-layers", 4),
    kvHeads: intFlag(values["sim-kv-heads"], "sim-kv-heads", 8),
    headDim: intFlag(values["sim-head-dim"], "sim-head-dim", 128),
    engineId,
    socket: optString(extra, "engine_socket", what) ?? defaultEngineEndpoint(engineId),
    shmDir: optString(extra, "shm_dir", what) ?? "/dev/shm",
    advertise,
    registerTimeoutMs: optSeconds(extra, "register_timeout_s", what) ?? 60_000,
    sidecarLostMs: optSeconds(extra, "sidecar_lost_timeout_s", what) ?? 10_000,
    prefillUsPerToken: intFlag(
      values["sim-prefill-us-per-token"],
      "sim-prefill-us-per-token",
      20,
      0,
    ),
    decodeMsPerToken: intFlag(values["sim-decode-ms-per-token"], "sim-decode-ms-per-token", 2, 0),
    kvWaitMs: intFlag(values["sim-kv-wait-ms"], "sim-kv-wait-ms", 90_000),
    drainMs: intFlag(values["sim-drain-ms"], "sim-drain-ms", 3000, 0),
    logLevel: values["sim-log-level"] ?? "info",
  };
}
