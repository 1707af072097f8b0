/**
 * The simulated engine (`kvxfer sim-engine`): an engine process with a KV cache in shared-memory
 * files, speaking the engine link to its sidecar exactly as a vLLM connector would, and driven by
 * the (simulated) router over JSON lines on stdin/stdout.
 *
 * As P it "prefills" a request by writing the KV pattern of the transfer (kv-pattern.ts) into
 * freshly allocated blocks after a simulated compute time, then sends `PrefillDone`; its blocks
 * stay allocated until the sidecar sends `ReleaseBlocks`. As D it allocates blocks, writes the
 * cached prefix itself, sends `ExpectKv`, and on `KvReady` checks every byte of the request.
 *
 * Control protocol (one JSON object per line): requests `{ id, op, ... }`, replies
 * `{ id, result }` or `{ id, error: { code, message } }`, events `{ event, ... }`. See
 * docs/engine-link.md.
 */
import { performance } from "node:perf_hooks";
import { closeSync, ftruncateSync, openSync, unlinkSync } from "node:fs";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { parseArgs } from "node:util";

import { create, fromJson, type JsonValue } from "@bufbuild/protobuf";
import { type Logger, pino } from "pino";

import {
  EngineLinkClient,
  defaultEngineEndpoint,
  engineMessage,
  kvCacheRegistration,
} from "../src/engine/link.js";
import {
  AbortSchema,
  EngineToSidecarSchema,
  ExpectKvSchema,
  FailureReason,
  PrefillDoneSchema,
  AllocateKvSchema,
  type Allocated,
  ReleaseReason,
  type SidecarToEngine,
} from "../src/gen/kvxfer/v1/engine_pb.js";
import { Agent, type Region } from "../src/native/index.js";
import {
  type KvLayout,
  type KvRegionScheme,
  KV_REGION_SCHEMES,
  kvLayout,
  validateKvLayout,
} from "../src/plan/index.js";
import { fillKv, verifyKv } from "./kv-pattern.js";
import { prng } from "./prng.js";
import { stderrSink } from "../src/sidecar/log-sink.js";
import { ENGINE_ID_RULE, engineIdProblem } from "../src/engine/validate.js";

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

const SCHEMES = KV_REGION_SCHEMES;

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

class UsageError extends Error {
  readonly code = "ERR_USAGE";
}

function intFlag(value: string | undefined, name: string, fallback: number, min = 1): number {
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
  pid: number,
  rank: number,
  region: number,
): string {
  return join(shmDir, `kvxfer-${engineId}-${pid}-r${rank}-g${region}.kv`);
}

/** Errors of control requests; `code` goes into the reply. */
class ControlError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

/**
 * Free blocks of the engine's cache, handed out in random order (so tables are non-contiguous).
 * A request that needs more blocks than are free waits for releases, first come first served, as
 * a scheduler queues a request until its KV fits; one that needs more than the whole cache, or
 * that waited `waitMs`, is refused with ERR_NO_BLOCKS.
 */
class BlockPool {
  private readonly free: number[];
  private readonly waiters: {
    n: number;
    grant: (ids: number[]) => void;
    refuse: (err: Error) => void;
    timer: NodeJS.Timeout;
  }[] = [];
  constructor(
    readonly total: number,
    private readonly random: () => number,
    private readonly waitMs: number,
  ) {
    this.free = Array.from({ length: total }, (_, i) => i);
  }
  get freeCount(): number {
    return this.free.length;
  }
  async take(n: number): Promise<number[]> {
    if (n > this.total) {
      throw new ControlError(
        "ERR_NO_BLOCKS",
        `need ${n} blocks, the cache has ${this.total} in all`,
      );
    }
    if (this.waiters.length === 0 && n <= this.free.length) return this.pick(n);
    if (this.waitMs === 0) {
      throw new ControlError("ERR_NO_BLOCKS", `need ${n} blocks, ${this.free.length} are free`);
    }
    return new Promise((resolve, reject) => {
      const waiter = {
        n,
        grant: resolve,
        refuse: reject,
        timer: setTimeout(() => {
          const i = this.waiters.indexOf(waiter);
          if (i >= 0) this.waiters.splice(i, 1);
          reject(
            new ControlError(
              "ERR_NO_BLOCKS",
              `need ${n} blocks, ${this.free.length} were free after waiting ${this.waitMs} ms for releases`,
            ),
          );
          this.serve(); // a smaller request behind this one may fit now
        }, this.waitMs),
      };
      this.waiters.push(waiter);
    });
  }
  give(ids: Iterable<number>): void {
    for (const id of ids) this.free.push(id);
    this.serve();
  }
  /** Refuses every waiting request (the engine stops). */
  refuseWaiting(): void {
    for (const w of this.waiters.splice(0)) {
      clearTimeout(w.timer);
      w.refuse(
        new ControlError("ERR_ABORTED", "the engine stopped while this request waited for blocks"),
      );
    }
  }
  private serve(): void {
    while (this.waiters.length > 0 && this.waiters[0]!.n <= this.free.length) {
      const w = this.waiters.shift()!;
      clearTimeout(w.timer);
      w.grant(this.pick(w.n));
    }
  }
  private pick(n: number): number[] {
    const out: number[] = [];
    for (let i = 0; i < n; i++) {
      const j = Math.floor(this.random() * this.free.length);
      out.push(this.free[j]!);
      this.free[j] = this.free[this.free.length - 1]!;
      this.free.pop();
    }
    return out;
  }
}

interface LiveTransfer {
  readonly transferId: string;
  readonly side: "prefill" | "decode";
  readonly blockIds: readonly number[];
  /** Blocks not yet returned to the pool. */
  readonly held: Set<number>;
  readonly tokens: number;
  readonly prefixTokens: number;
  /** computing (P, before PrefillDone) → held; expecting (D) → failed after KvFailed. */
  phase: "computing" | "held" | "expecting" | "failed";
  aborted: boolean;
  /**
   * The registration generation when this transfer's message went to the sidecar (undefined:
   * not sent yet). A sidecar that answers a later registration with a new epoch never saw it.
   */
  gen?: number;
}

interface ControlRequest {
  id?: unknown;
  op?: unknown;
  [key: string]: unknown;
}

function str(req: ControlRequest, key: string): string {
  const v = req[key];
  if (typeof v !== "string" || v.length === 0) {
    throw new ControlError("ERR_BAD_REQUEST", `'${key}' must be a non-empty string`);
  }
  return v;
}

/** An optional string field ('' when absent). */
function optStr(req: ControlRequest, key: string): string {
  const v = req[key];
  if (v === undefined) return "";
  if (typeof v !== "string") throw new ControlError("ERR_BAD_REQUEST", `'${key}' must be a string`);
  return v;
}

function int(req: ControlRequest, key: string, min: number, fallback?: number): number {
  const v = req[key] ?? fallback;
  if (typeof v !== "number" || !Number.isSafeInteger(v) || v < min) {
    throw new ControlError("ERR_BAD_REQUEST", `'${key}' must be an integer >= ${min}`);
  }
  return v;
}

function intList(req: ControlRequest, key: string): number[] | undefined {
  const v = req[key];
  if (v === undefined) return undefined;
  if (!Array.isArray(v) || !v.every((x) => Number.isInteger(x) && x >= 0 && x < 2 ** 32)) {
    throw new ControlError("ERR_BAD_REQUEST", `'${key}' must be a list of uint32`);
  }
  return v as number[];
}

/** How often a re-registration refused by the same sidecar (old connection not yet gone) is retried. */
const MAX_ALREADY_RETRIES = 25;

/** One running simulated engine. */
class SimEngine {
  private readonly layout: KvLayout;
  private readonly pool: BlockPool;
  private readonly live = new Map<string, LiveTransfer>();
  private readonly files: string[][] = [];
  /** kvMemory "segment": the segment of each (rank, region), as the sidecar allocated it. */
  private readonly segments: number[][] = [];
  /** Waiting for the sidecar's Allocated answer (one rank at a time); a Refused ends it too. */
  private allocating:
    { rank: number; settle: (m: Pick<Allocated, "ok" | "error" | "segments">) => void } | undefined;
  private readonly regions: Region[][] = [];
  private readonly memories: Uint8Array[][] = [];
  private agent: Agent | undefined;
  private link: EngineLinkClient | undefined;
  private registered:
    ((ok: boolean, error: string, sideChannel: string, epoch: bigint) => void) | undefined;
  /** When the last re-registration was sent (0: none outstanding). */
  private reRegisteringSince = 0;
  /** The sidecar's epoch from the last accepted registration. */
  private epoch: bigint | undefined;
  /** Bumped by every RegisterKvCache sent; a transfer remembers the value it was sent under. */
  private regGen = 0;
  private everConnected = false;
  /** Re-registrations refused as ERR_ALREADY_REGISTERED by the same sidecar, in a row. */
  private alreadyRetries = 0;
  private lostTimer: NodeJS.Timeout | undefined;
  /** Checks of KV waiting for --check-after-ms (cleared at stop). */
  private readonly checks = new Set<NodeJS.Timeout>();
  private stopping: Promise<void> | undefined;
  /** Transfers waiting for free blocks (see BlockPool). */
  private readonly waitingForBlocks = new Set<string>();
  private readonly counters = {
    verified: 0,
    failed: 0,
    mismatches: 0,
    refused: 0,
    released: 0,
    badReleases: 0,
    /** Sidecar restarts seen (a new epoch, or ERR_NOT_REGISTERED). */
    restarts: 0,
    /** Transfers this engine ended itself because its sidecar restarted or was lost. */
    recovered: 0,
  };

  constructor(
    private readonly cfg: SimEngineConfig,
    private readonly log: Logger,
    private readonly out: (obj: Record<string, unknown>) => void,
  ) {
    this.layout = cfg.layout;
    this.pool = new BlockPool(cfg.layout.numBlocks, prng(cfg.seed), cfg.blockWaitMs);
  }

  /**
   * Creates and maps the KV files (or, kvMemory "segment", has the sidecar allocate them and
   * attaches them), connects the link, registers; resolves with the ready event.
   */
  async start(): Promise<Record<string, unknown>> {
    const L = this.layout;
    this.agent = new Agent({ transports: "self", name: `sim-engine-${this.cfg.engineId}` });
    if (this.cfg.kvMemory === "file") this.createFiles();
    this.link = new EngineLinkClient({
      endpoint: this.cfg.socket,
      logger: this.log,
      onMessage: (msg) => this.onSidecar(msg),
      onState: (state) => this.onLinkState(state),
    });
    if (this.cfg.kvMemory === "segment") await this.attachAllocated();
    const answer = await new Promise<{
      ok: boolean;
      error: string;
      sideChannel: string;
      epoch: bigint;
    }>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.registered = undefined;
        reject(
          new ControlError(
            "ERR_REGISTER_TIMEOUT",
            `no sidecar answered at ${this.cfg.socket} within ${this.cfg.registerTimeoutMs} ms ` +
              `(is \`kvxfer sidecar --engine-id ${this.cfg.engineId}\` running on that engine socket?)`,
          ),
        );
      }, this.cfg.registerTimeoutMs);
      this.registered = (ok, error, sideChannel, epoch) => {
        clearTimeout(timer);
        this.registered = undefined;
        resolve({ ok, error, sideChannel, epoch });
      };
      this.sendRegister().catch((err: unknown) => {
        clearTimeout(timer);
        reject(err instanceof Error ? err : new Error(String(err)));
      });
    });
    if (!answer.ok) {
      throw new ControlError(
        "ERR_REGISTER_REFUSED",
        `the sidecar refused the KV cache: ${answer.error}`,
      );
    }
    this.epoch = answer.epoch;
    return {
      event: "ready",
      engineId: this.cfg.engineId,
      role: this.cfg.role,
      pid: process.pid,
      socket: this.cfg.socket,
      sideChannel: answer.sideChannel,
      totalBlocks: L.numBlocks,
      files: this.files,
      segments: this.segments,
      layout: L,
    };
  }

  private createFiles(): void {
    const L = this.layout;
    for (let r = 0; r < L.tpSize; r++) {
      const paths: string[] = [];
      const regions: Region[] = [];
      this.files.push(paths);
      this.regions.push(regions);
      for (let g = 0; g < L.regionBytes.length; g++) {
        const path = simKvFilePath(this.cfg.shmDir, this.cfg.engineId, process.pid, r, g);
        const fd = openSync(path, "wx", 0o600);
        paths.push(path);
        try {
          ftruncateSync(fd, L.regionBytes[g]!);
        } finally {
          closeSync(fd);
        }
        regions.push(this.agent!.mapFile(path, { length: L.regionBytes[g]! }));
      }
      this.memories.push(regions.map((reg) => reg.bytes()));
    }
  }

  /** Has the sidecar allocate each rank's regions (AllocateKv), and attaches them. */
  private async attachAllocated(): Promise<void> {
    const L = this.layout;
    for (let rank = 0; rank < L.tpSize; rank++) {
      const answer = await new Promise<Pick<Allocated, "ok" | "error" | "segments">>(
        (resolve, reject) => {
          const timer = setTimeout(() => {
            this.allocating = undefined;
            reject(
              new ControlError(
                "ERR_REGISTER_TIMEOUT",
                `no sidecar answered AllocateKv at ${this.cfg.socket} within ${this.cfg.registerTimeoutMs} ms`,
              ),
            );
          }, this.cfg.registerTimeoutMs);
          this.allocating = {
            rank,
            settle: (m) => {
              clearTimeout(timer);
              this.allocating = undefined;
              resolve(m);
            },
          };
          const msg = create(AllocateKvSchema, {
            rank,
            tpSize: L.tpSize,
            lengths: L.regionBytes.map((n) => BigInt(n)),
          });
          this.link!.send(engineMessage("allocate", msg)).catch((err: unknown) => {
            clearTimeout(timer);
            reject(err instanceof Error ? err : new Error(String(err)));
          });
        },
      );
      if (!answer.ok) {
        throw new ControlError(
          "ERR_ALLOCATE_REFUSED",
          `the sidecar refused to allocate rank ${rank}'s KV: ${answer.error}`,
        );
      }
      const regions = answer.segments.map((id, g) =>
        this.agent!.attachSegment(id, L.regionBytes[g]!),
      );
      this.segments.push([...answer.segments]);
      this.regions.push(regions);
      this.memories.push(regions.map((reg) => reg.bytes()));
    }
  }

  private async sendRegister(): Promise<void> {
    this.regGen++;
    const L = this.layout;
    const msg = kvCacheRegistration(
      this.cfg.engineId,
      L,
      this.cfg.kvMemory === "segment" ? this.segments : this.files,
    );
    await this.link!.send(engineMessage("register", msg));
  }

  // --- sidecar → engine ------------------------------------------------------

  private onSidecar(msg: SidecarToEngine): void {
    const m = msg.msg;
    switch (m.case) {
      case "registered":
        if (this.registered)
          this.registered(m.value.ok, m.value.error, m.value.sideChannel, m.value.epoch);
        else this.onReRegistered(m.value.ok, m.value.error, m.value.epoch);
        this.reRegisteringSince = 0;
        return;
      case "kvReady":
        if (this.cfg.checkAfterMs === 0) {
          this.onKvReady(m.value.transferId);
        } else {
          const transferId = m.value.transferId;
          // stop() clears these timers before it unmaps the KV.
          const timer = setTimeout(() => {
            this.checks.delete(timer);
            this.onKvReady(transferId);
          }, this.cfg.checkAfterMs);
          this.checks.add(timer);
        }
        return;
      case "allocated":
        // An answer to an earlier request (another rank) is not this one's.
        if (this.allocating?.rank === m.value.rank) this.allocating.settle(m.value);
        return;
      case "kvFailed": {
        const tid = m.value.transferId;
        const t = this.live.get(tid);
        if (t) t.phase = "failed";
        this.counters.failed++;
        this.out({
          event: "failed",
          transferId: tid,
          known: t !== undefined,
          reason: FailureReason[m.value.reason] ?? String(m.value.reason),
          message: m.value.message,
        });
        return;
      }
      case "releaseBlocks":
        this.onRelease(m.value.transferId, m.value.blockIds, m.value.reason);
        return;
      case "refused":
        this.counters.refused++;
        // A refusal at the link (e.g. ERR_NOT_OWNER: another engine owns it) answers AllocateKv.
        if (m.value.transferId === "")
          this.allocating?.settle({
            ok: false,
            error: `${m.value.code}: ${m.value.message}`,
            segments: [],
          });
        this.out({
          event: "refused",
          transferId: m.value.transferId,
          code: m.value.code,
          message: m.value.message,
        });
        if (m.value.code === "ERR_NOT_REGISTERED" && !this.registered)
          this.onNotRegistered(m.value.transferId);
        return;
      case undefined:
        return;
    }
  }

  // --- sidecar restarts and death ------------------------------------------------

  private onLinkState(state: "connected" | "disconnected"): void {
    if (this.stopping) return;
    if (state === "disconnected") {
      this.log.warn("lost the sidecar connection");
      this.out({ event: "link", state });
      if (this.lostTimer === undefined) {
        this.lostTimer = setTimeout(() => {
          this.lostTimer = undefined;
          this.log.error(
            { ms: this.cfg.sidecarLostMs },
            "sidecar gone too long: failing every transfer in flight",
          );
          this.failInFlight(
            "SIDECAR_LOST",
            `no sidecar for ${this.cfg.sidecarLostMs} ms`,
            () => true,
          );
        }, this.cfg.sidecarLostMs);
      }
      return;
    }
    clearTimeout(this.lostTimer);
    this.lostTimer = undefined;
    const first = !this.everConnected;
    this.everConnected = true;
    if (first) return; // the first registration is already on its way
    this.out({ event: "link", state });
    // A new connection: a restarted sidecar (which forgot us), or the same one (which hands the
    // link back to this connection). Either way, register again; the epoch says which.
    this.reRegister("the sidecar connection is back");
  }

  private reRegister(why: string): void {
    if (this.registered || this.stopping) return; // the first registration is still pending
    this.log.warn({ why }, "registering again");
    this.reRegisteringSince = Date.now();
    this.sendRegister().catch((err: unknown) => this.log.error({ err }, "re-register failed"));
  }

  private onReRegistered(ok: boolean, error: string, epoch: bigint): void {
    const restarted = ok && this.epoch !== undefined && epoch !== this.epoch;
    this.out({ event: "registered", ok, error, epoch: String(epoch), restarted });
    if (!ok) {
      if (
        epoch === this.epoch &&
        error.startsWith("ERR_ALREADY_REGISTERED") &&
        error.includes("another live connection") &&
        this.alreadyRetries < MAX_ALREADY_RETRIES
      ) {
        // The same sidecar has not yet seen our old connection end (it hands the link to a new
        // connection of the same engine only then): ask again shortly.
        this.alreadyRetries++;
        setTimeout(() => this.reRegister("the sidecar still sees our old connection"), 200);
        return;
      }
      this.log.error({ error }, "the sidecar refused the re-registration");
      return;
    }
    this.alreadyRetries = 0;
    if (restarted) {
      // A new sidecar: whatever was sent to the old one before this registration is lost.
      this.counters.restarts++;
      this.epoch = epoch;
      const gen = this.regGen;
      this.failInFlight(
        "SIDECAR_RESTARTED",
        `the sidecar restarted (epoch ${epoch}); it never heard of this transfer`,
        (t) => t.gen! < gen,
      );
    }
  }

  private onNotRegistered(transferId: string): void {
    // The refused message started nothing: its own blocks come back at once.
    const t = this.live.get(transferId);
    if (t !== undefined && t.gen !== undefined) {
      this.endLocally(t, "NOT_REGISTERED", "the sidecar does not know this engine");
    }
    if (
      this.reRegisteringSince !== 0 &&
      Date.now() - this.reRegisteringSince < this.cfg.registerTimeoutMs
    )
      return; // already registering again; older messages are being refused one by one
    // The sidecar forgot this engine (it restarted without our seeing the connection drop):
    // everything it had is gone.
    this.counters.restarts++;
    this.failInFlight("SIDECAR_RESTARTED", "the sidecar answered ERR_NOT_REGISTERED", () => true);
    this.reRegister("the sidecar answered ERR_NOT_REGISTERED");
  }

  /**
   * Ends every transfer the sidecar was told about (and `pick` accepts) on this side, as
   * KvFailed + ReleaseBlocks would: D recomputes, P frees. No block stays held for a sidecar
   * that cannot answer any more.
   */
  private failInFlight(reason: string, message: string, pick: (t: LiveTransfer) => boolean): void {
    for (const t of [...this.live.values()]) {
      if (t.gen === undefined || !pick(t)) continue;
      this.endLocally(t, reason, message);
    }
  }

  private endLocally(t: LiveTransfer, reason: string, message: string): void {
    this.counters.recovered++;
    if (t.side === "decode" && t.phase !== "failed") {
      this.counters.failed++;
      this.out({
        event: "failed",
        transferId: t.transferId,
        known: true,
        reason,
        message,
        local: true,
      });
    }
    this.pool.give(t.held);
    t.held.clear();
    this.live.delete(t.transferId);
    this.out({
      event: "released",
      transferId: t.transferId,
      side: t.side,
      reason,
      blocks: t.blockIds.length,
      local: true,
    });
  }

  private onKvReady(transferId: string): void {
    const t = this.live.get(transferId);
    if (!t || t.side !== "decode" || t.phase !== "expecting") {
      this.out({
        event: "unexpected",
        kind: "kvReady",
        transferId,
        why: t ? `transfer is ${t.side}/${t.phase}` : "unknown transfer",
      });
      return;
    }
    let checkedBytes = 0;
    let mismatches = 0;
    let first: string | undefined;
    const checkStart = performance.now();
    for (let r = 0; r < this.layout.tpSize; r++) {
      const c = verifyKv(this.layout, r, this.memories[r]!, transferId, t.blockIds, 0, t.tokens);
      checkedBytes += c.checkedBytes;
      mismatches += c.mismatches;
      first ??= c.first;
    }
    const ok = mismatches === 0 && checkedBytes > 0;
    if (ok) this.counters.verified++;
    else this.counters.mismatches++;
    if (!ok) this.log.error({ transferId, mismatches, first }, "KV VERIFICATION FAILED");
    this.out({
      event: "verified",
      transferId,
      ok,
      checkedBytes,
      mismatches,
      checkMs: Math.round((performance.now() - checkStart) * 100) / 100,
      ...(first === undefined ? {} : { first }),
    });
    // Decode is "done": the blocks go back to the engine's pool.
    this.pool.give(t.held);
    t.held.clear();
    this.live.delete(transferId);
  }

  private onRelease(transferId: string, blockIds: readonly number[], reason: ReleaseReason): void {
    const t = this.live.get(transferId);
    if (!t || t.phase === "computing") {
      this.counters.badReleases++;
      this.out({
        event: "bad-release",
        transferId,
        blockIds: [...blockIds],
        why: t ? "prefill has not finished" : "unknown transfer",
      });
      return;
    }
    const bad: number[] = [];
    const freed: number[] = [];
    for (const id of blockIds) {
      if (t.held.delete(id)) freed.push(id);
      else bad.push(id);
    }
    this.pool.give(freed);
    if (bad.length > 0 || blockIds.length === 0) {
      this.counters.badReleases++;
      this.out({
        event: "bad-release",
        transferId,
        blockIds: bad,
        why: blockIds.length === 0 ? "no block ids" : "blocks not held by this transfer",
      });
    }
    if (t.held.size === 0) {
      this.live.delete(transferId);
      this.counters.released++;
      this.out({
        event: "released",
        transferId,
        side: t.side,
        reason: ReleaseReason[reason] ?? String(reason),
        blocks: t.blockIds.length,
      });
    }
  }

  // --- router → engine --------------------------------------------------------

  private needRole(role: "prefill" | "decode"): void {
    if (this.cfg.role !== role && this.cfg.role !== "both") {
      throw new ControlError("ERR_WRONG_ROLE", `this engine is ${this.cfg.role}, not ${role}`);
    }
  }

  private newTransferId(req: ControlRequest): string {
    const tid = str(req, "transferId");
    if (this.live.has(tid) || this.waitingForBlocks.has(tid)) {
      throw new ControlError("ERR_DUPLICATE", `transfer '${tid}' is already live on this engine`);
    }
    return tid;
  }

  /** Blocks for a new transfer; its id counts as live while it waits for them. */
  private async takeBlocks(tid: string, tokens: number): Promise<number[]> {
    this.waitingForBlocks.add(tid);
    try {
      return await this.pool.take(Math.ceil(tokens / this.layout.blockSize));
    } finally {
      this.waitingForBlocks.delete(tid);
    }
  }

  async handle(req: ControlRequest): Promise<Record<string, unknown>> {
    switch (req.op) {
      case "prefill":
        return this.prefill(req);
      case "expect":
        return this.expect(req);
      case "abort": {
        const tid = str(req, "transferId");
        const t = this.live.get(tid);
        if (t) t.aborted = true;
        await this.link!.send(engineMessage("abort", create(AbortSchema, { transferId: tid })));
        return { known: t !== undefined };
      }
      case "drop": {
        // What an engine does after a refusal: take its blocks back without the sidecar.
        const tid = str(req, "transferId");
        const t = this.live.get(tid);
        if (!t) throw new ControlError("ERR_UNKNOWN_TRANSFER", `transfer '${tid}' is not live`);
        const n = t.held.size;
        this.pool.give(t.held);
        t.held.clear();
        this.live.delete(tid);
        return { freed: n };
      }
      case "send": {
        // A hand-made engine message (JSON form of EngineToSidecar), for bad-input tests.
        let msg;
        try {
          msg = fromJson(EngineToSidecarSchema, req.message as JsonValue);
        } catch (err) {
          throw new ControlError("ERR_BAD_REQUEST", `'message': ${(err as Error).message}`);
        }
        await this.link!.send(msg);
        return {};
      }
      case "send-raw": {
        const hex = str(req, "hex");
        await this.link!.sendRaw(Buffer.from(hex, "hex"));
        return {};
      }
      case "stats":
        return {
          freeBlocks: this.pool.freeCount,
          totalBlocks: this.pool.total,
          transfers: this.live.size,
          held: Object.fromEntries([...this.live.values()].map((t) => [t.transferId, t.held.size])),
          epoch: String(this.epoch ?? 0n),
          ...this.counters,
        };
      case "exit":
        return {};
      default:
        throw new ControlError("ERR_UNKNOWN_OP", `unknown op '${String(req.op)}'`);
    }
  }

  private async prefill(req: ControlRequest): Promise<Record<string, unknown>> {
    this.needRole("prefill");
    const tid = this.newTransferId(req);
    const tokens = int(req, "tokens", 1);
    const computeMs = int(req, "computeMs", 0, 0);
    const L = this.layout;
    const blockIds = await this.takeBlocks(tid, tokens);
    const t: LiveTransfer = {
      transferId: tid,
      side: "prefill",
      blockIds,
      held: new Set(blockIds),
      tokens,
      prefixTokens: 0,
      phase: "computing",
      aborted: false,
    };
    this.live.set(tid, t);
    if (computeMs > 0) await new Promise((r) => setTimeout(r, computeMs));
    if (t.aborted || this.stopping) {
      // The sidecar never learned these blocks: they come back here.
      this.pool.give(t.held);
      t.held.clear();
      this.live.delete(tid);
      this.out({
        event: "released",
        transferId: tid,
        side: "prefill",
        reason: "ABORTED_BEFORE_DONE",
        blocks: blockIds.length,
      });
      throw new ControlError("ERR_ABORTED", `transfer '${tid}' was aborted during prefill`);
    }
    for (let r = 0; r < L.tpSize; r++) fillKv(L, r, this.memories[r]!, tid, blockIds, 0, tokens);
    t.phase = "held";
    t.gen = this.regGen;
    await this.link!.send(
      engineMessage(
        "prefillDone",
        create(PrefillDoneSchema, {
          transferId: tid,
          blockIds,
          numTokens: tokens,
          token: optStr(req, "token"),
        }),
      ),
    );
    return { blockIds };
  }

  private async expect(req: ControlRequest): Promise<Record<string, unknown>> {
    this.needRole("decode");
    const tid = this.newTransferId(req);
    const tokens = int(req, "tokens", 1);
    const prefixTokens = int(req, "prefixTokens", 0, 0);
    if (prefixTokens > tokens) {
      throw new ControlError(
        "ERR_BAD_REQUEST",
        `'prefixTokens' ${prefixTokens} is above 'tokens' ${tokens}`,
      );
    }
    const source = str(req, "source");
    const sourceBlockIds = intList(req, "sourceBlockIds");
    const L = this.layout;
    const blockIds = await this.takeBlocks(tid, tokens);
    this.live.set(tid, {
      transferId: tid,
      side: "decode",
      blockIds,
      held: new Set(blockIds),
      tokens,
      prefixTokens,
      phase: "expecting",
      aborted: false,
      gen: this.regGen,
    });
    // The prefix is "already cached" on D: written here with the same pattern.
    for (let r = 0; r < L.tpSize; r++)
      fillKv(L, r, this.memories[r]!, tid, blockIds, 0, prefixTokens);
    await this.link!.send(
      engineMessage(
        "expectKv",
        create(ExpectKvSchema, {
          transferId: tid,
          source,
          blockIds,
          numTokens: tokens,
          prefixTokens,
          sourceBlockIds: sourceBlockIds ?? [],
          hasSourceBlockIds: sourceBlockIds !== undefined,
          token: optStr(req, "token"),
        }),
      ),
    );
    return { blockIds };
  }

  /** Idempotent: closes the link, unmaps and removes the KV files. */
  stop(): Promise<void> {
    this.stopping ??= (async () => {
      this.registered = undefined;
      clearTimeout(this.lostTimer);
      this.pool.refuseWaiting();
      // A delayed check must not read the KV once it is unmapped.
      for (const timer of this.checks) clearTimeout(timer);
      this.checks.clear();
      await this.link?.close(1000);
      for (const regions of this.regions) for (const r of regions) r.close();
      this.agent?.close();
      this.removeFiles();
    })();
    return this.stopping;
  }

  /** Synchronous, for the process 'exit' hook: a crash must not leave files in /dev/shm. */
  removeFiles(): void {
    for (const paths of this.files) {
      for (const p of paths) {
        try {
          unlinkSync(p);
        } catch {
          // already gone
        }
      }
    }
    this.files.length = 0;
  }
}

/**
 * Runs a simulated engine until `exit`, end of stdin, SIGTERM or SIGINT; resolves with the
 * process exit code once its KV files are removed. The caller exits the process with it.
 */
export async function runSimEngine(argv: readonly string[]): Promise<number> {
  const write = (obj: Record<string, unknown>): void => {
    process.stdout.write(JSON.stringify(obj) + "\n");
  };
  process.stdout.on("error", () => undefined); // a driver that went away must not crash us
  let cfg: SimEngineConfig;
  try {
    cfg = parseSimEngineArgs(argv);
  } catch (err) {
    const e = err as { code?: string; message: string };
    write({ event: "error", code: e.code ?? "ERR_USAGE", message: e.message });
    process.stderr.write(`${e.message}\n${SIM_ENGINE_USAGE}\n`);
    return 2;
  }
  const log = pino(
    { name: "sim-engine", level: cfg.logLevel, base: { engineId: cfg.engineId, pid: process.pid } },
    // Never blocks, like the sidecar's (src/sidecar/log-sink.ts).
    stderrSink(),
  );
  const engine = new SimEngine(cfg, log, write);
  const onExit = (): void => engine.removeFiles();
  process.on("exit", onExit);

  let finish!: (code: number) => void;
  const done = new Promise<number>((resolve) => (finish = resolve));
  let exitCode: number | undefined;
  const shutdown = (code: number): void => {
    if (exitCode !== undefined) return;
    exitCode = code;
    void engine.stop().then(
      () => finish(code),
      (err: unknown) => {
        log.error({ err }, "shutdown failed");
        finish(code === 0 ? 1 : code);
      },
    );
  };
  const onTerm = (): void => shutdown(143);
  const onInt = (): void => shutdown(130);
  process.once("SIGTERM", onTerm);
  process.once("SIGINT", onInt);

  let ready = false;
  const pending: ControlRequest[] = [];
  const serve = (req: ControlRequest): void => {
    const id = req.id;
    engine.handle(req).then(
      (result) => {
        write({ id, result });
        if (req.op === "exit") shutdown(0);
      },
      (err: unknown) => {
        const e = err as { code?: unknown; message?: unknown };
        write({
          id,
          error: {
            code: typeof e?.code === "string" ? e.code : "ERR_INTERNAL",
            message: typeof e?.message === "string" ? e.message : String(err),
          },
        });
      },
    );
  };
  const lines = createInterface({ input: process.stdin });
  lines.on("line", (line) => {
    if (line.trim() === "") return;
    let req: ControlRequest;
    try {
      req = JSON.parse(line) as ControlRequest;
      if (typeof req !== "object" || req === null) throw new Error("not an object");
    } catch (err) {
      write({
        id: null,
        error: { code: "ERR_BAD_REQUEST", message: `bad JSON line: ${(err as Error).message}` },
      });
      return;
    }
    if (ready) serve(req);
    else pending.push(req);
  });
  // End of stdin stops the engine, but not before its start has an answer: an engine started
  // with stdin closed still registers (or says why it could not, exit code 1).
  let stdinClosed = false;
  lines.on("close", () => {
    stdinClosed = true;
    if (ready) shutdown(0);
  });

  try {
    write(await engine.start());
    ready = true;
    for (const req of pending.splice(0)) serve(req);
    if (stdinClosed) shutdown(0);
  } catch (err) {
    const e = err as { code?: unknown; message?: unknown };
    const error = {
      code: typeof e?.code === "string" ? e.code : "ERR_START",
      message: typeof e?.message === "string" ? e.message : String(err),
    };
    // One line for whoever reads stderr (the JSON event is for a driver); no stack trace.
    if (exitCode === undefined)
      process.stderr.write(`kvxfer sim-engine: ${error.code}: ${error.message}\n`);
    write({ event: "error", ...error });
    for (const req of pending.splice(0)) write({ id: req.id, error });
    shutdown(1);
  }
  const code = await done;
  lines.close();
  process.off("SIGTERM", onTerm);
  process.off("SIGINT", onInt);
  process.off("exit", onExit);
  return code;
}
