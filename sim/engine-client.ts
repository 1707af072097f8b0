/**
 * Drives a simulated engine process (engine-main.js, compiled) over its JSON-lines control
 * protocol. Every call and every wait has a deadline; close() ends the process and waits for it
 * (bounded), then removes any KV file a killed engine left behind.
 */
import type { ChildProcess } from "node:child_process";
import { EventEmitter } from "node:events";
import { existsSync, unlinkSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import type { KvLayout } from "../src/plan/index.js";
import type { SimEngineRole, SimModel } from "./engine-input.js";
import { JsonLinesChild } from "./json-lines-child.js";

/** Flags of `kvxfer sim-engine`, as options. */
export interface SimEngineOptions {
  engineId: string;
  role: SimEngineRole;
  socket?: string;
  tp?: number;
  model?: SimModel;
  layers?: number;
  kvHeads?: number;
  headDim?: number;
  block?: number;
  blocks?: number;
  layout?: "hnd" | "nhd";
  scheme?: string;
  shmDir?: string;
  /** "segment": the sidecar allocates the KV (AllocateKv); default "file". */
  kvMemory?: "file" | "segment";
  seed?: number;
  registerTimeoutMs?: number;
  sidecarLostMs?: number;
  /** Decode: check the KV this long after KvReady (default 0: at once). */
  checkAfterMs?: number;
  /** How long a request waits for free blocks (default 10000; 0: refused at once). */
  blockWaitMs?: number;
  logLevel?: string;
}

/** The engine's first event, once its sidecar accepted the KV cache. */
export interface SimEngineReady {
  event: "ready";
  engineId: string;
  role: SimEngineRole;
  pid: number;
  socket: string;
  /** The sidecar's side channel ("host:port"), from `Registered`; what D's `expect` needs as `source`. */
  sideChannel: string;
  totalBlocks: number;
  /** `files[rank][region]`: the shared-memory files of the KV cache (kvMemory "file"). */
  files: string[][];
  /** `segments[rank][region]`: the segments the sidecar allocated (kvMemory "segment"). */
  segments: number[][];
  layout: KvLayout;
}

/** An event line: `verified`, `failed`, `released`, `bad-release`, `refused`, `unexpected`, ... */
export interface SimEngineEvent {
  event: string;
  transferId?: string;
  [key: string]: unknown;
}

export interface SimEngineStats {
  freeBlocks: number;
  totalBlocks: number;
  /** Live transfers (blocks held). */
  transfers: number;
  /** KvReady transfers whose every byte matched. */
  verified: number;
  /** KvFailed received. */
  failed: number;
  /** KvReady transfers with at least one wrong byte. */
  mismatches: number;
  refused: number;
  released: number;
  badReleases: number;
  /** Blocks still held, per live transfer id. */
  held: Record<string, number>;
  /** The sidecar's epoch from the last accepted registration. */
  epoch: string;
  /** Sidecar restarts this engine saw (a new epoch, or ERR_NOT_REGISTERED). */
  restarts: number;
  /** Transfers this engine ended itself (sidecar restarted or lost): failed and freed. */
  recovered: number;
}

export class SimEngineError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

/** Command-line flags for the options. */
export function simEngineArgs(o: SimEngineOptions): string[] {
  const args = ["--engine-id", o.engineId, "--role", o.role];
  const add = (flag: string, v: string | number | undefined): void => {
    if (v !== undefined) args.push(flag, String(v));
  };
  add("--socket", o.socket);
  add("--tp", o.tp);
  add("--model", o.model);
  add("--layers", o.layers);
  add("--kv-heads", o.kvHeads);
  add("--head-dim", o.headDim);
  add("--block", o.block);
  add("--blocks", o.blocks);
  add("--layout", o.layout);
  add("--scheme", o.scheme);
  add("--shm-dir", o.shmDir);
  add("--kv-memory", o.kvMemory);
  add("--seed", o.seed);
  add("--register-timeout-ms", o.registerTimeoutMs);
  add("--sidecar-lost-ms", o.sidecarLostMs);
  add("--check-after-ms", o.checkAfterMs);
  add("--block-wait-ms", o.blockWaitMs);
  add("--log-level", o.logLevel);
  return args;
}

/** The compiled engine-main.js: next to this file in dist/, or found from the source tree. */
export function simEngineScript(): string {
  const here = dirname(fileURLToPath(import.meta.url));
  const sibling = join(here, "engine-main.js");
  if (existsSync(sibling)) return sibling;
  let dir = here;
  for (let i = 0; i < 6; i++) {
    const candidate = join(dir, "dist", "sim", "engine-main.js");
    if (existsSync(candidate)) return candidate;
    dir = dirname(dir);
  }
  throw new Error("dist/sim/engine-main.js not found: run 'npm run build' first");
}

const MAX_EVENTS = 100_000;

export interface SimEngineSpawnOptions {
  /** A command to run node under, e.g. ["ip", "netns", "exec", "ns1"]. */
  prefix?: string[];
  env?: NodeJS.ProcessEnv;
  /** Bound on waiting for the `ready` event (default 15 s). */
  readyTimeoutMs?: number;
}

export class SimEngineProcess extends EventEmitter<{ event: [SimEngineEvent] }> {
  /** Every event line so far (the oldest dropped past 100 000), `ready` included. */
  readonly events: SimEngineEvent[] = [];
  /** The same events by transfer id, so that a wait for one transfer does not scan them all. */
  private readonly byTransfer = new Map<string, SimEngineEvent[]>();
  /** Pending `waitEvent` calls, each told of every event until its wait ends. */
  private readonly waiters = new Set<(e: SimEngineEvent) => void>();
  ready: SimEngineReady | undefined;
  private readonly proc: JsonLinesChild;

  private constructor(args: string[], opts: SimEngineSpawnOptions) {
    super();
    const argv = [...(opts.prefix ?? []), process.execPath, simEngineScript(), ...args];
    this.proc = new JsonLinesChild(argv, {
      name: "sim engine",
      ...(opts.env !== undefined ? { env: opts.env } : {}),
      makeError: (code, message) => new SimEngineError(code, message),
      onMessage: (msg) => {
        if (typeof msg.event !== "string") return;
        const ev = msg as SimEngineEvent;
        this.record(ev);
        this.dispatch(ev);
      },
      onExit: (code, signal) => this.dispatch({ event: "exit", code, signal }),
    });
  }

  /** Keeps `ev`; past MAX_EVENTS the oldest go, a tenth at a time (one shift per event is O(n)). */
  private record(ev: SimEngineEvent): void {
    this.events.push(ev);
    if (typeof ev.transferId === "string") {
      let list = this.byTransfer.get(ev.transferId);
      if (list === undefined) this.byTransfer.set(ev.transferId, (list = []));
      list.push(ev);
    }
    if (this.events.length <= MAX_EVENTS) return;
    for (const old of this.events.splice(0, MAX_EVENTS / 10)) {
      if (typeof old.transferId !== "string") continue;
      const list = this.byTransfer.get(old.transferId);
      list?.shift(); // a transfer's events are dropped oldest first, as they came
      if (list?.length === 0) this.byTransfer.delete(old.transferId);
    }
  }

  /** Tells the pending waiters, then the "event" listeners. */
  private dispatch(ev: SimEngineEvent): void {
    for (const w of [...this.waiters]) w(ev);
    this.emit("event", ev);
  }

  get child(): ChildProcess {
    return this.proc.child;
  }

  get stderr(): string {
    return this.proc.stderr;
  }

  private get exitReason(): string | undefined {
    return this.proc.exitReason;
  }

  /** Spawns an engine and waits (bounded) for its `ready` event; kills it if that fails. */
  static async start(
    options: SimEngineOptions | string[],
    spawnOptions: SimEngineSpawnOptions = {},
  ): Promise<SimEngineProcess> {
    const args = Array.isArray(options) ? options : simEngineArgs(options);
    const p = new SimEngineProcess(args, spawnOptions);
    try {
      const ready = await p.waitEvent(
        (e) => e.event === "ready" || e.event === "error" || e.event === "exit",
        spawnOptions.readyTimeoutMs ?? 15_000,
      );
      if (ready.event !== "ready") {
        throw new SimEngineError(
          typeof ready.code === "string" ? ready.code : "ERR_START",
          `sim engine did not start: ${String(ready.message ?? "")} ${p.stderr.slice(-2000)}`,
        );
      }
      p.ready = ready as unknown as SimEngineReady;
      return p;
    } catch (err) {
      await p.close(2000);
      throw err;
    }
  }

  /** One control request; rejects with SimEngineError (the engine's code, or ERR_TIMEOUT / ERR_EXITED). */
  call<T = Record<string, unknown>>(
    op: string,
    args: Record<string, unknown> = {},
    timeoutMs = 30_000,
  ): Promise<T> {
    return this.proc.call<T>(op, args, timeoutMs);
  }

  /** `token`: the transfer's token (PrefillDone.token), given to D's engine too. */
  prefill(transferId: string, tokens: number, computeMs = 0, timeoutMs = 30_000, token = "") {
    return this.call<{ blockIds: number[] }>(
      "prefill",
      { transferId, tokens, computeMs, ...(token !== "" ? { token } : {}) },
      timeoutMs,
    );
  }

  /**
   * A layer-wise prefill (PrefillDone with layer_wise, then a LayersSaved per layer, `layerMs`
   * apart); resolves once the last layer is saved, or the transfer was aborted meanwhile.
   */
  prefillByLayer(
    transferId: string,
    tokens: number,
    layerMs: number,
    token = "",
    timeoutMs = 30_000,
  ) {
    return this.call<{ blockIds: number[]; layersSaved: number }>(
      "prefill",
      { transferId, tokens, layerWise: true, layerMs, ...(token !== "" ? { token } : {}) },
      timeoutMs,
    );
  }

  expect(
    args: {
      transferId: string;
      tokens: number;
      source: string;
      prefixTokens?: number;
      sourceBlockIds?: number[];
      token?: string;
    },
    timeoutMs = 30_000,
  ) {
    return this.call<{ blockIds: number[] }>("expect", args, timeoutMs);
  }

  stats(timeoutMs = 10_000): Promise<SimEngineStats> {
    return this.call<SimEngineStats>("stats", {}, timeoutMs);
  }

  /**
   * The first event (already received, or still to come) that `pred` accepts. Rejects with
   * ERR_TIMEOUT after `timeoutMs`, or ERR_EXITED when the engine exits first. With `transferId`,
   * only that transfer's events are looked at (and the received ones found without a scan).
   */
  waitEvent(
    pred: (e: SimEngineEvent) => boolean,
    timeoutMs: number,
    transferId?: string,
  ): Promise<SimEngineEvent> {
    if (transferId !== undefined) {
      const inner = pred;
      pred = (e) => e.transferId === transferId && inner(e);
    }
    const seen =
      transferId === undefined
        ? this.events.find(pred)
        : this.byTransfer.get(transferId)?.find(pred);
    if (seen) return Promise.resolve(seen);
    return new Promise((resolve, reject) => {
      // Waiters are kept in a set of their own, not as "event" listeners: a driver legitimately
      // waits on hundreds of transfers at once (EventEmitter would warn past 10 listeners), and
      // each waiter leaves the set when its wait ends (match, exit or timeout).
      const onEvent = (e: SimEngineEvent): void => {
        if (pred(e)) {
          cleanup();
          resolve(e);
        } else if (e.event === "exit") {
          cleanup();
          reject(new SimEngineError("ERR_EXITED", this.exitReason ?? "sim engine exited"));
        }
      };
      const timer = setTimeout(() => {
        cleanup();
        reject(
          new SimEngineError(
            "ERR_TIMEOUT",
            `no matching sim engine event within ${timeoutMs} ms; last events: ${JSON.stringify(
              this.events.slice(-5),
            )}; stderr: ${this.stderr.slice(-1000)}`,
          ),
        );
      }, timeoutMs);
      const cleanup = (): void => {
        clearTimeout(timer);
        this.waiters.delete(onEvent);
      };
      if (this.exitReason !== undefined) {
        cleanup();
        reject(new SimEngineError("ERR_EXITED", this.exitReason));
        return;
      }
      this.waiters.add(onEvent);
    });
  }

  /** The event of one transfer, e.g. `waitTransfer("t1", "verified", 5000)`. */
  waitTransfer(transferId: string, event: string, timeoutMs: number): Promise<SimEngineEvent> {
    return this.waitEvent((e) => e.event === event, timeoutMs, transferId);
  }

  get pid(): number | undefined {
    return this.child.pid;
  }

  get running(): boolean {
    return this.proc.running;
  }

  kill(signal: NodeJS.Signals = "SIGKILL"): void {
    this.proc.kill(signal);
  }

  /** Waits (bounded) for the process to exit; null on timeout. */
  async waitExit(timeoutMs: number): Promise<number | null> {
    let timer: NodeJS.Timeout | undefined;
    const r = await Promise.race([
      this.proc.exited.then((code) => ({ code })),
      new Promise<undefined>((resolve) => {
        timer = setTimeout(() => resolve(undefined), timeoutMs);
      }),
    ]);
    clearTimeout(timer);
    return r === undefined ? null : r.code;
  }

  /**
   * Ends stdin (the engine exits cleanly), SIGKILLs it after `timeoutMs`, waits for the exit,
   * and removes KV files a killed engine could not. Returns the exit code (null if killed).
   */
  async close(timeoutMs = 5000): Promise<number | null> {
    await this.proc.stop(timeoutMs);
    for (const p of (this.ready?.files ?? []).flat()) {
      try {
        unlinkSync(p);
      } catch {
        // removed by the engine
      }
    }
    return this.child.exitCode;
  }
}
