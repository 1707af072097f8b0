// Multi-process fixture for the sidecar failure, bad-input and soak tests: real sidecar processes
// (dist/), real simulated engines, UCX over shared memory, ZeroMQ engine links and side channels,
// gRPC for events. Every wait is bounded; every process started here is stopped by close().
import { existsSync, readFileSync, unlinkSync } from "node:fs";
import { createServer } from "node:net";

import { SidecarClient, type EventWatch } from "../../../src/api/client.js";
import { type KvLayout, kvLayout } from "../../../src/plan/index.js";
import { llama8b } from "../../plan/cases.js";
import { isTerminal } from "../../../src/sidecar/lifecycle.js";
import type {
  SidecarEvent,
  TerminalKind,
  TransferInfo,
  TransferMode,
  TransferSide,
  TransferState,
} from "../../../src/sidecar/view.js";
import {
  SimEngineProcess,
  type SimEngineEvent,
  type SimEngineOptions,
  type SimEngineStats,
} from "../../../sim/engine-client.js";
import { SidecarProcess, type SidecarReady } from "../../../sim/sidecar-process.js";
import { until } from "../../until.js";

/** Waits (bounded, 10 s) until the sidecar behind `api` lists transfer `id` in `state`. */
export function awaitListed(api: SidecarClient, id: string, state: TransferState): Promise<void> {
  return until(
    async () =>
      (await api.listTransfers({ states: [state] })).transfers.some((t) => t.transferId === id),
    10_000,
    `${id} listed as ${state}`,
    20,
  );
}

export function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}

/** A TCP port that was free a moment ago (for a fixed `--listen` that survives a restart). */
export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const addr = srv.address();
      const port = typeof addr === "object" && addr !== null ? addr.port : 0;
      srv.close(() => resolve(port));
    });
  });
}

/** Resident set size of a process, KiB (VmRSS of /proc/<pid>/status). */
export function rssKiB(pid: number): number {
  const m = /VmRSS:\s+(\d+)\s+kB/.exec(readFileSync(`/proc/${pid}/status`, "utf8"));
  if (m === null) throw new Error(`no VmRSS for pid ${pid}`);
  return Number(m[1]);
}

let seq = 0;
/** A unique engine id (engine ids are [A-Za-z0-9._-]{1,128} everywhere). */
export function uniqueId(prefix: string): string {
  seq++;
  return `${prefix}-${process.pid}-${seq}-${Math.random().toString(36).slice(2, 6)}`;
}

/** The small model every test uses unless it says otherwise: 2 layers, 2 KV heads x 16, block 16. */
export const SMALL_ENGINE: Partial<SimEngineOptions> = {
  layers: 2,
  kvHeads: 2,
  headDim: 16,
  block: 16,
  blocks: 32,
  tp: 1,
};

export interface NodeOptions {
  role: "prefill" | "decode";
  /** Default: a unique id. A restarted node passes the old one. */
  engineId?: string;
  mode?: TransferMode;
  /** Side channel address; default 127.0.0.1:0. */
  listen?: string;
  /** Extra sidecar flags (leases, timeouts, ...). */
  sidecarArgs?: string[];
  /** Simulated engine shape; merged over SMALL_ENGINE. */
  engine?: Partial<SimEngineOptions>;
  logLevel?: string;
  /** Runs once the sidecar is ready, before the engine starts (e.g. registrations of its own). */
  beforeEngine?: (socket: string, ready: SidecarReady) => Promise<void>;
  /** UCX transports (default shm,self). */
  transports?: string;
  /** A command the sidecar runs under (a network namespace: `ip netns exec <ns>`). */
  prefix?: string[];
}

/** One engine with its sidecar, a gRPC client, and every event of the sidecar (WatchEvents from seq 0). */
export class KvNode {
  /** Events of the current sidecar process (a restarted sidecar starts a new list). */
  events: SidecarEvent[] = [];
  /** Events of sidecar processes before a `restartSidecar`, oldest first. */
  readonly earlierEvents: SidecarEvent[][] = [];
  private watch: EventWatch | undefined;
  private closed = false;

  private constructor(
    readonly role: "prefill" | "decode",
    readonly engineId: string,
    readonly socket: string,
    public sidecar: SidecarProcess,
    public ready: SidecarReady,
    readonly engine: SimEngineProcess,
    public client: SidecarClient,
    private readonly sidecarArgs: string[],
    private readonly spawnOptions: { prefix?: string[] } = {},
  ) {}

  static async start(o: NodeOptions): Promise<KvNode> {
    const engineId = o.engineId ?? uniqueId(o.role === "prefill" ? "p" : "d");
    // A fresh engine socket per start (a SIGKILLed sidecar leaves its ipc file behind).
    const socket = `ipc:///tmp/kvxfer-test-${engineId}-${Date.now().toString(36)}.sock`;
    const sidecarArgs = [
      "--engine-id",
      engineId,
      "--role",
      o.role,
      "--engine-socket",
      socket,
      "--listen",
      o.listen ?? "127.0.0.1:0",
      "--mode",
      o.mode ?? "auto",
      "--transports",
      o.transports ?? "shm,self",
      "--log-level",
      o.logLevel ?? "warn",
      ...(o.sidecarArgs ?? []),
    ];
    const spawnOptions = o.prefix !== undefined ? { prefix: o.prefix } : {};
    const sidecar = new SidecarProcess(sidecarArgs, spawnOptions);
    let ready: SidecarReady;
    try {
      ready = await sidecar.ready;
    } catch (err) {
      await sidecar.close(2000);
      throw err;
    }
    let engine: SimEngineProcess;
    try {
      await o.beforeEngine?.(socket, ready);
      engine = await SimEngineProcess.start({
        ...SMALL_ENGINE,
        ...o.engine,
        engineId,
        role: o.role,
        socket,
      });
    } catch (err) {
      await sidecar.close(2000);
      throw err;
    }
    const client = new SidecarClient(ready.grpc!);
    const node = new KvNode(
      o.role,
      engineId,
      socket,
      sidecar,
      ready,
      engine,
      client,
      sidecarArgs,
      spawnOptions,
    );
    // From seq 0: the sidecar replays what it retained, so no event is missed.
    node.watch = client.watch({}, (ev) => node.events.push(ev));
    return node;
  }

  /**
   * kill -9 of the sidecar alone (the engine keeps running), then, after `downMs`, a new sidecar
   * process with the same flags (same engine id and engine socket; a new epoch). Resolves once
   * the new one is ready and watched. Bounded. `whileDown` runs once the old one has exited
   * (its host vanishing after it, say), before the wait.
   */
  async restartSidecar(
    downMs = 0,
    whileDown?: () => void | Promise<void>,
  ): Promise<{ killedAt: number; upAt: number }> {
    this.sidecar.kill("SIGKILL");
    const killedAt = Date.now();
    await this.sidecar.close(5000);
    await whileDown?.();
    this.watch?.cancel();
    this.client.close();
    this.earlierEvents.push(this.events);
    this.events = [];
    if (downMs > 0) await sleep(downMs);
    const sidecar = new SidecarProcess(this.sidecarArgs, this.spawnOptions);
    this.sidecar = sidecar;
    this.ready = await sidecar.ready;
    this.client = new SidecarClient(this.ready.grpc!);
    const events = this.events;
    this.watch = this.client.watch({}, (ev) => events.push(ev));
    return { killedAt, upAt: Date.now() };
  }

  get sideChannel(): string {
    return this.ready.sideChannel;
  }

  get sidecarPid(): number {
    return this.sidecar.child.pid!;
  }

  /** Terminal events of one transfer on this sidecar (as watched over gRPC). */
  terminal(transferId: string): SidecarEvent[] {
    return this.events.filter((e) => e.transferId === transferId && isTerminal(e.kind));
  }

  /**
   * Waits (bounded) until this sidecar lists `transferId` on `side` and `pred` accepts it (its
   * state, peer, trace hops): the state a test goes on from, instead of a sleep.
   */
  async waitTransfer(
    transferId: string,
    side: TransferSide,
    pred: (t: TransferInfo) => boolean,
    what: string,
    timeoutMs = 10_000,
  ): Promise<TransferInfo> {
    let found: TransferInfo | undefined;
    await until(
      async () => {
        const { transfers } = await this.client.listTransfers();
        found = transfers.find((t) => t.transferId === transferId && t.side === side && pred(t));
        return found !== undefined;
      },
      timeoutMs,
      `${transferId} on ${this.engineId}'s ${side} side: ${what}`,
      20,
    );
    return found!;
  }

  /** The first sidecar event (already seen or still to come) that `pred` accepts; bounded. */
  async waitEvent(pred: (e: SidecarEvent) => boolean, timeoutMs: number): Promise<SidecarEvent> {
    let found: SidecarEvent | undefined;
    await until(
      () => (found = this.events.find(pred)) !== undefined,
      timeoutMs,
      () => `a sidecar event of ${this.engineId}; last: ${JSON.stringify(this.events.slice(-4))}`,
      10,
    );
    return found!;
  }

  /** The engine's event of one transfer, with the time it arrived here. */
  async engineEvent(transferId: string, event: string, timeoutMs: number): Promise<SimEngineEvent> {
    return this.engine.waitTransfer(transferId, event, timeoutMs);
  }

  /** The engine's `refused` event for `transferId` among its events after the first `since`. */
  /**
   * Proves the sidecar has handled every engine message sent before it: an Abort for a transfer
   * nobody knows, whose refusal comes back on the same ordered link after whatever the earlier
   * messages caused. A check that "nothing more happened" waits for this, not for a sleep.
   */
  async barrier(tag: string): Promise<void> {
    const since = this.engine.events.length;
    const transferId = `barrier-${tag}`;
    await this.engine.call("send", { message: { abort: { transferId } } });
    const r = await this.refusal(transferId, since);
    if (r.code !== "ERR_UNKNOWN_TRANSFER") throw new Error(`barrier ${tag}: refused ${r.code}`);
  }

  async refusal(transferId: string, since: number, timeoutMs = 10_000): Promise<SimEngineEvent> {
    let found: SimEngineEvent | undefined;
    await until(
      () =>
        (found = this.engine.events
          .slice(since)
          .find((e) => e.event === "refused" && e.transferId === transferId)) !== undefined,
      timeoutMs,
      () =>
        `a refusal of '${transferId}' on ${this.role}; last ${JSON.stringify(this.engine.events.slice(-3))}`,
    );
    return found!;
  }

  /** Waits (bounded) until the engine has every block back; returns its stats. */
  async allBlocksFree(timeoutMs = 10_000): Promise<SimEngineStats> {
    let s: SimEngineStats | undefined;
    await until(
      async () => {
        s = await this.engine.stats();
        return s.freeBlocks === s.totalBlocks;
      },
      timeoutMs,
      () => `every block of ${this.engineId} free (last stats ${JSON.stringify(s)})`,
      50,
    );
    return s!;
  }

  /** SIGKILL the sidecar and the engine (a crash); waits (bounded) for both to be gone. */
  async kill(): Promise<void> {
    this.sidecar.kill("SIGKILL");
    this.engine.kill("SIGKILL");
    await this.close();
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.watch?.cancel();
    this.client.close();
    await this.engine.close(3000).catch(() => undefined);
    await this.sidecar.close(5000).catch(() => undefined);
    const path = this.socket.replace(/^ipc:\/\//, "");
    if (existsSync(path)) {
      try {
        unlinkSync(path);
      } catch {
        // gone
      }
    }
  }
}

export interface PairOptions {
  mode?: TransferMode;
  /** Flags for both sidecars, then per side. */
  sidecarArgs?: string[];
  pArgs?: string[];
  dArgs?: string[];
  engine?: Partial<SimEngineOptions>;
  pEngine?: Partial<SimEngineOptions>;
  dEngine?: Partial<SimEngineOptions>;
  pListen?: string;
}

export interface Pair {
  p: KvNode;
  d: KvNode;
  close(): Promise<void>;
}

/** Starts a P node and a D node (each a sidecar process and a sim engine process). */
export async function startPair(o: PairOptions = {}): Promise<Pair> {
  const [p, d] = await Promise.allSettled([
    KvNode.start({
      role: "prefill",
      ...(o.mode !== undefined ? { mode: o.mode } : {}),
      ...(o.pListen !== undefined ? { listen: o.pListen } : {}),
      sidecarArgs: [...(o.sidecarArgs ?? []), ...(o.pArgs ?? [])],
      engine: { ...o.engine, ...o.pEngine },
    }),
    KvNode.start({
      role: "decode",
      ...(o.mode !== undefined ? { mode: o.mode } : {}),
      sidecarArgs: [...(o.sidecarArgs ?? []), ...(o.dArgs ?? [])],
      engine: { ...o.engine, ...o.dEngine },
    }),
  ]);
  return pairOf(p, d);
}

/** A P and a D node started together: both, or neither (the one that started is closed). */
export async function pairOf(
  p: PromiseSettledResult<KvNode>,
  d: PromiseSettledResult<KvNode>,
): Promise<Pair> {
  if (p.status === "rejected" || d.status === "rejected") {
    if (p.status === "fulfilled") await p.value.close();
    if (d.status === "fulfilled") await d.value.close();
    throw p.status === "rejected" ? p.reason : (d as PromiseRejectedResult).reason;
  }
  return {
    p: p.value,
    d: d.value,
    close: async () => {
      await Promise.all([p.value.close(), d.value.close()]);
    },
  };
}

/**
 * One good transfer from `p` to `d`, byte-verified by D's engine: push (P and D at once) or pull
 * (prefill, then ExpectKv with P's block ids). Checks one KV_READY on D and one RELEASED on P.
 */
export async function goodTransfer(
  p: KvNode,
  d: KvNode,
  transferId: string,
  o: { tokens?: number; pull?: boolean; timeoutMs?: number } = {},
): Promise<SimEngineEvent> {
  const tokens = o.tokens ?? 40;
  const timeoutMs = o.timeoutMs ?? 15_000;
  // Bound to D as a router would: only a sidecar presenting the token gets the transfer.
  const token = `tok-${transferId}`;
  if (o.pull === true) {
    const { blockIds } = await p.engine.prefill(transferId, tokens, 0, timeoutMs, token);
    await d.engine.expect(
      { transferId, tokens, source: p.sideChannel, sourceBlockIds: blockIds, token },
      timeoutMs,
    );
  } else {
    await Promise.all([
      p.engine.prefill(transferId, tokens, 0, timeoutMs, token),
      d.engine.expect({ transferId, tokens, source: p.sideChannel, token }, timeoutMs),
    ]);
  }
  const verified = await d.engineEvent(transferId, "verified", timeoutMs);
  if (verified.ok !== true)
    throw new Error(`transfer ${transferId} did not verify: ${JSON.stringify(verified)}`);
  const released = await p.engineEvent(transferId, "released", timeoutMs);
  if (released.reason !== "TRANSFERRED")
    throw new Error(`P released ${transferId} as ${String(released.reason)}`);
  const ready = await d.waitEvent(
    (e) => e.transferId === transferId && e.kind === "KV_READY",
    timeoutMs,
  );
  await p.waitEvent((e) => e.transferId === transferId && e.kind === "RELEASED", timeoutMs);
  if (ready.side !== "decode") throw new Error(`KV_READY of ${transferId} on side ${ready.side}`);
  return verified;
}

/** One layer of Llama 3 8B's KV, block 16: 64 KiB per block (K and V), one region per rank. */
export function oneLayerLayout(numBlocks: number, tpSize = 1): KvLayout {
  return kvLayout({
    ...llama8b,
    numLayers: 1,
    blockSize: 16,
    numBlocks,
    order: "HND",
    tpSize,
    tpRank: 0,
  });
}

/**
 * A node whose sidecar is up while its engine waits to start: tests speak the engine link
 * (`socket`) to a sidecar no engine has registered with yet, then `start()` the engine.
 */
export class HeldNode {
  private constructor(
    readonly engineId: string,
    readonly socket: string,
    readonly grpc: SidecarClient,
    private readonly release: () => void,
    private readonly starting: Promise<KvNode>,
  ) {}

  static async start(o: NodeOptions & { engineId: string }): Promise<HeldNode> {
    let socket = "";
    let grpc: SidecarClient | undefined;
    let sidecarUp: () => void = () => {};
    let release: () => void = () => {};
    const up = new Promise<void>((r) => (sidecarUp = r));
    const go = new Promise<void>((r) => (release = r));
    const starting = KvNode.start({
      ...o,
      beforeEngine: async (s, ready) => {
        socket = s;
        grpc = new SidecarClient(ready.grpc!);
        sidecarUp();
        await go;
      },
    });
    starting.catch(() => undefined);
    await Promise.race([up, starting]);
    return new HeldNode(o.engineId, socket, grpc!, release, starting);
  }

  /** Lets the engine start; resolves once it registered. */
  start(): Promise<KvNode> {
    this.release();
    return this.starting;
  }

  /** Stops the node, started or not. */
  async close(): Promise<void> {
    this.release();
    this.grpc.close();
    await this.starting.then((n) => n.close()).catch(() => undefined);
  }
}
