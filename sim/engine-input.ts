/**
 * What a simulated engine is told, checked: its flags (`kvxfer sim-engine`, into
 * `SimEngineConfig`) and the router's control requests, one JSON object per line
 * (docs/engine-link.md); a bad one is a `ControlError` with its code.
 */
import { join } from "node:path";
import { parseArgs } from "node:util";

import { defaultEngineEndpoint, ENGINE_ID_RULE, engineIdProblem } from "../src/engine/link.js";
import {
  type KvLayout,
  type KvRegionScheme,
  KV_REGION_SCHEMES,
  kvLayout,
  validateKvLayout,
} from "../src/plan/index.js";

export type SimEngineRole = "prefill" | "decode" | "both";

export type SimModel = "llama3-8b" | "llama3-70b" | "deepseek-mla";

/** Model shapes the simulated engine knows by name (all bfloat16). */
export const SIM_MODELS: Readonly<
  Record<SimModel, { numLayers: number; mla: boolean; totalKvHeads: number; headDim: number }>
> = {
  "llama3-8b": { numLayers: 32, mla: false, totalKvHeads: 8, headDim: 128 },
  "llama3-70b": { numLayers: 80, mla: false, totalKvHeads: 8, headDim: 128 },
  "deepseek-mla": { numLayers: 61, mla: true, totalKvHeads: 1, headDim: 576 },
};

export const SCHEMES = KV_REGION_SCHEMES;

export interface SimEngineConfig {
  readonly engineId: string;
  readonly role: SimEngineRole;
  /** ZeroMQ endpoint of the sidecar's engine link. */
  readonly socket: string;
  readonly layout: KvLayout;
  readonly scheme: KvRegionScheme;
  readonly shmDir: string;
  /**
   * Where the KV lives: "file", files under shmDir the engine creates (the default); "segment",
   * SysV segments the sidecar allocates (AllocateKv) and the engine attaches.
   */
  readonly kvMemory: "file" | "segment";
  /** Seed of the block allocator's random order. */
  readonly seed: number;
  readonly registerTimeoutMs: number;
  /** Disconnected from the sidecar this long: fail every transfer in flight (it is gone). */
  readonly sidecarLostMs: number;
  /**
   * Decode: check the KV this long after KvReady instead of at once (0). A benchmark that times
   * the hops after KvReady sets it, so that the check's CPU does not compete with them.
   */
  readonly checkAfterMs: number;
  /** How long a request waits for free blocks before ERR_NO_BLOCKS (0: refused at once). */
  readonly blockWaitMs: number;
  readonly logLevel: string;
  /**
   * What names this process's KV files besides the engine id (default: the pid). An engine that
   * runs as PID 1 of its container has the same pid after every restart, and its predecessor's
   * files stay until the pod goes: the simulated engine behind vLLM's command line adds a random
   * part.
   */
  readonly fileTag?: string;
}

export const SIM_ENGINE_USAGE = `usage: kvxfer sim-engine --engine-id ID --role prefill|decode|both [options]
  --socket ENDPOINT       the sidecar's engine link (default ipc:///tmp/kvxfer-<engine-id>.sock)
  --tp N                  tensor-parallel ranks (default 1)
  --model NAME            llama3-8b | llama3-70b | deepseek-mla (default llama3-8b)
  --layers N --kv-heads N --head-dim N   override the model's shape
  --block N               tokens per block (default 16)
  --blocks N              blocks per rank (default 128)
  --layout hnd|nhd        order inside a block (default hnd)
  --scheme NAME           ${SCHEMES.join(" | ")} (default region-per-layer)
  --shm-dir DIR           where the KV files go (default /dev/shm)
  --kv-memory file|segment  KV in files this engine creates under --shm-dir (default), or in
                          shared-memory segments the sidecar allocates (AllocateKv)
  --seed N                block allocation order (default random)
  --register-timeout-ms N how long to wait for Registered (default 10000)
  --sidecar-lost-ms N     sidecar unreachable this long: fail every transfer in flight (default 10000)
  --check-after-ms N      decode: check the KV N ms after KvReady, not at once (default 0)
  --block-wait-ms N       a request that needs more blocks than are free waits this long for
                          releases, first come first served (default 10000; 0: refused at once)
  --log-level LEVEL       pino level for stderr logs (default warn)
Control: JSON lines on stdin; replies and events on stdout (docs/engine-link.md).`;

export class UsageError extends Error {
  readonly code = "ERR_USAGE";
}

export function intFlag(
  value: string | undefined,
  name: string,
  fallback: number,
  min = 1,
): number {
  if (value === undefined) return fallback;
  const n = Number(value);
  if (!Number.isSafeInteger(n) || n < min) {
    throw new UsageError(`--${name} must be an integer >= ${min}, got '${value}'`);
  }
  return n;
}

/** Parses `kvxfer sim-engine` flags. Throws an Error with code ERR_USAGE naming the flag. */
export function parseSimEngineArgs(argv: readonly string[]): SimEngineConfig {
  const { values } = parseArgs({
    args: [...argv],
    strict: true,
    allowPositionals: false,
    options: {
      "engine-id": { type: "string" },
      role: { type: "string" },
      socket: { type: "string" },
      tp: { type: "string" },
      model: { type: "string" },
      layers: { type: "string" },
      "kv-heads": { type: "string" },
      "head-dim": { type: "string" },
      block: { type: "string" },
      blocks: { type: "string" },
      layout: { type: "string" },
      scheme: { type: "string" },
      "shm-dir": { type: "string" },
      "kv-memory": { type: "string" },
      seed: { type: "string" },
      "register-timeout-ms": { type: "string" },
      "sidecar-lost-ms": { type: "string" },
      "check-after-ms": { type: "string" },
      "block-wait-ms": { type: "string" },
      "log-level": { type: "string" },
    },
  });
  const engineId = values["engine-id"];
  const idProblem = engineIdProblem(engineId ?? "", "--engine-id");
  if (engineId === undefined || idProblem !== undefined) {
    throw new UsageError(idProblem ?? `--engine-id must be ${ENGINE_ID_RULE}`);
  }
  const role = values.role;
  if (role !== "prefill" && role !== "decode" && role !== "both") {
    throw new UsageError(`--role must be prefill, decode or both, got '${role ?? ""}'`);
  }
  const modelName = values.model ?? "llama3-8b";
  if (!(modelName in SIM_MODELS)) {
    throw new UsageError(
      `--model must be one of ${Object.keys(SIM_MODELS).join(", ")}, got '${modelName}'`,
    );
  }
  const model = SIM_MODELS[modelName as SimModel];
  const order = (values.layout ?? "hnd").toUpperCase();
  if (order !== "HND" && order !== "NHD") {
    throw new UsageError(`--layout must be hnd or nhd, got '${values.layout ?? ""}'`);
  }
  const scheme = (values.scheme ?? "region-per-layer") as KvRegionScheme;
  if (!SCHEMES.includes(scheme)) {
    throw new UsageError(`--scheme must be one of ${SCHEMES.join(", ")}, got '${scheme}'`);
  }
  const totalKvHeads = intFlag(values["kv-heads"], "kv-heads", model.totalKvHeads);
  if (model.mla && totalKvHeads !== 1) {
    throw new UsageError(`--kv-heads must be 1 for an MLA model, got ${totalKvHeads}`);
  }
  const layout = kvLayout(
    {
      numLayers: intFlag(values.layers, "layers", model.numLayers),
      mla: model.mla,
      totalKvHeads,
      headDim: intFlag(values["head-dim"], "head-dim", model.headDim),
      dtype: "bfloat16",
      dtypeBytes: 2,
      blockSize: intFlag(values.block, "block", 16),
      numBlocks: intFlag(values.blocks, "blocks", 128),
      order,
      tpSize: intFlag(values.tp, "tp", 1),
      tpRank: 0,
    },
    scheme,
  );
  try {
    validateKvLayout(layout);
  } catch (err) {
    throw new UsageError(`the layout is not valid: ${(err as Error).message}`);
  }
  const kvMemory = values["kv-memory"] ?? "file";
  if (kvMemory !== "file" && kvMemory !== "segment") {
    throw new UsageError(`--kv-memory must be file or segment, got '${kvMemory}'`);
  }
  return {
    engineId,
    role,
    socket: values.socket ?? defaultEngineEndpoint(engineId),
    kvMemory,
    layout,
    scheme,
    shmDir: values["shm-dir"] ?? "/dev/shm",
    seed: intFlag(values.seed, "seed", Math.floor(Math.random() * 2 ** 31), 0),
    registerTimeoutMs: intFlag(values["register-timeout-ms"], "register-timeout-ms", 10_000),
    sidecarLostMs: intFlag(values["sidecar-lost-ms"], "sidecar-lost-ms", 10_000),
    checkAfterMs: intFlag(values["check-after-ms"], "check-after-ms", 0, 0),
    blockWaitMs: intFlag(values["block-wait-ms"], "block-wait-ms", 10_000, 0),
    logLevel: values["log-level"] ?? "warn",
  };
}

/** The shared-memory file of one (rank, region). */
export function simKvFilePath(
  shmDir: string,
  engineId: string,
  pid: number | string,
  rank: number,
  region: number,
): string {
  return join(shmDir, `kvxfer-${engineId}-${pid}-r${rank}-g${region}.kv`);
}

/** Errors of control requests; `code` goes into the reply. */
export class ControlError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

export interface ControlRequest {
  id?: unknown;
  op?: unknown;
  [key: string]: unknown;
}

export function str(req: ControlRequest, key: string): string {
  const v = req[key];
  if (typeof v !== "string" || v.length === 0) {
    throw new ControlError("ERR_BAD_REQUEST", `'${key}' must be a non-empty string`);
  }
  return v;
}

/** An optional string field ('' when absent). */
export function optStr(req: ControlRequest, key: string): string {
  const v = req[key];
  if (v === undefined) return "";
  if (typeof v !== "string") throw new ControlError("ERR_BAD_REQUEST", `'${key}' must be a string`);
  return v;
}

export function int(req: ControlRequest, key: string, min: number, fallback?: number): number {
  const v = req[key] ?? fallback;
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < min) {
    throw new ControlError("ERR_BAD_REQUEST", `'${key}' must be an integer >= ${min}`);
  }
  return v;
}

export function intList(req: ControlRequest, key: string): number[] | undefined {
  const v = req[key];
  if (v === undefined) return undefined;
  if (!Array.isArray(v) || !v.every((x) => Number.isInteger(x) && x >= 0 && x < 2 ** 32)) {
    throw new ControlError("ERR_BAD_REQUEST", `'${key}' must be a list of uint32`);
  }
  return v as number[];
}
