// In-process fakes for the sidecar's sides (context.ts): a manual clock, recording engine and
// peer senders, and agents whose writes, reads and notifications the test settles by hand. With
// them a lifecycle rule (lease, watchdog, abort drain, peer failure) is checked in milliseconds.
import { create } from "@bufbuild/protobuf";
import { pino } from "pino";

import {
  ExpectKvSchema,
  PrefillDoneSchema,
  type ExpectKv,
  type PrefillDone,
} from "../../src/gen/kvxfer/v1/engine_pb.js";
import {
  AgentMetadataSchema,
  PushRegSchema,
  RankMetadataSchema,
  type PushReg,
} from "../../src/gen/kvxfer/v1/peer_pb.js";
import type { Agent, OpTrace, Region } from "../../src/native/index.js";
import type { PeerBody } from "../../src/peer/messages.js";
import type { PeerCredentials } from "../../src/peer/side-channel.js";
import { kvLayout, singleGroup, type KvGroup, type KvLayout } from "../../src/plan/index.js";
import { kvLayoutToProto } from "../../src/plan/layout-proto.js";
import type { Clock } from "../../src/sidecar/clock.js";
import type { EngineMessage, LifecycleSettings, SideContext } from "../../src/sidecar/context.js";
import { PeerState, type RegisteredKv } from "../../src/peer/peer-state.js";
import { PeerTable } from "../../src/peer/peer-table.js";
import type { EventKind, SidecarEvent, TransferSide } from "../../src/sidecar/view.js";

/** Time that moves only when the test says so; timers run in order as it passes them. */
export class ManualClock implements Clock {
  private t = 1_000_000;
  private timers: { at: number; fn: () => void }[] = [];

  now(): number {
    return this.t;
  }

  after(ms: number, fn: () => void): void {
    this.timers.push({ at: this.t + ms, fn });
  }

  /** Moves time forward by `ms`, running each timer due on the way at its own time. */
  advance(ms: number): void {
    const end = this.t + ms;
    for (let i = 0; i < 10_000; i++) {
      this.timers.sort((a, b) => a.at - b.at);
      const next = this.timers[0];
      if (next === undefined || next.at > end) break;
      this.timers.shift();
      this.t = next.at;
      next.fn();
    }
    this.t = end;
  }
}

/** The steps of one native write or read, as a pair's trace names them (`pair S>D <step>`). */
export const OP_STEPS = [
  "submitted",
  "started",
  "first post",
  "posted",
  "flushed",
  "completed",
  "delivered",
] as const;

/** What the addon resolves an operation with: its steps (here all at one made-up time). */
function opTrace(): OpTrace {
  const us = 1_000_000;
  return {
    submittedUs: us,
    startedUs: us,
    firstPostUs: us,
    postedUs: us,
    flushedUs: us,
    notifiedUs: 0,
    completedUs: us,
    deliveredUs: us,
  };
}

/** One operation the test settles: `resolve()` (landed) or `reject()` (failed). */
export class PendingOp {
  private res!: (t: OpTrace) => void;
  reject!: (err: Error) => void;
  readonly promise = new Promise<OpTrace>((res, rej) => {
    this.res = res;
    this.reject = rej;
  });
  /** `landed` runs first: a notification the operation carries goes out once its data landed. */
  constructor(private readonly landed?: () => void) {}
  resolve(): void {
    this.landed?.();
    this.res(this.landed === undefined ? opTrace() : { ...opTrace(), notifiedUs: 1_000_000 });
  }
}

/** An agent whose writes and reads wait for the test (or land at once with `autoLand`). */
export class FakeAgent {
  readonly address = new Uint8Array([1, 2, 3]);
  readonly ops: { kind: "write" | "read"; op: PendingOp }[] = [];
  autoLand = false;
  /** Posting throws (as the addon does for a request it refuses before it starts). */
  failToPost = false;
  inflight = 0;
  /** How many region pairs each writeParts carried. */
  readonly partCounts: number[] = [];
  /** Notifications sent, as sealed. */
  readonly notified: Uint8Array[] = [];
  /** How a notification fails: the promise rejects, or the call throws. */
  notifyFails: "reject" | "throw" | undefined = undefined;
  /** Endpoints whose operations were given up (`abandon`). */
  abandoned = 0;
  /** Each connect's worker address and options; keys imported; closes of endpoints and remotes. */
  readonly connects: { address: Uint8Array; options: unknown }[] = [];
  readonly imported: Uint8Array[] = [];
  closed = 0;

  /** Abandoned endpoints' flushes not over yet (`settleAbandoned()` ends them). */
  private readonly unsettled: (() => void)[] = [];

  connect(address?: Uint8Array, options?: unknown): unknown {
    if (address !== undefined) this.connects.push({ address, options });
    let settled: Promise<string> | undefined;
    return {
      state: "connected",
      importRemote: (key: Uint8Array) => {
        this.imported.push(key);
        return { close: () => void this.closed++ };
      },
      close: () => void this.closed++,
      abandon: () => {
        if (settled !== undefined) return;
        this.abandoned++;
        settled = new Promise((resolve) => this.unsettled.push(() => resolve("UCS_OK")));
      },
      get abandoned() {
        return settled !== undefined;
      },
      settled: () => settled ?? Promise.resolve("UCS_OK"),
    };
  }

  /** UCX is done with every abandoned endpoint's operations: their flushes complete. */
  settleAbandoned(): void {
    for (const done of this.unsettled.splice(0)) done();
  }

  /** Called with each notification as it goes out (notify, or a landed writeParts carrying one). */
  onNotified: (data: Uint8Array) => void = () => undefined;

  private sent(data: Uint8Array): void {
    this.notified.push(data);
    this.onNotified(data);
  }

  private op(kind: "write" | "read", notification?: Uint8Array): Promise<OpTrace> {
    if (this.failToPost) throw Object.assign(new Error("refused"), { code: "ERR_OUT_OF_BOUNDS" });
    const op = new PendingOp(
      notification === undefined ? undefined : () => this.sent(notification),
    );
    this.ops.push({ kind, op });
    if (this.autoLand) op.resolve();
    return op.promise;
  }

  write(): Promise<OpTrace> {
    return this.op("write");
  }

  /** All of a rank pair's region pairs and its notification: one operation, as in the addon. */
  writeParts(
    _ep?: unknown,
    parts?: readonly unknown[],
    notification?: Uint8Array,
  ): Promise<OpTrace> {
    if (parts !== undefined) this.partCounts.push(parts.length);
    return this.op("write", notification);
  }

  read(): Promise<OpTrace> {
    return this.op("read");
  }

  notify(_ep: unknown, data: Uint8Array): Promise<OpTrace> {
    if (this.notifyFails === "throw") throw new Error("endpoint closed");
    if (this.notifyFails === "reject") return Promise.reject(new Error("UCS_ERR_CANCELED"));
    this.sent(data);
    return Promise.resolve({
      ...opTrace(),
      firstPostUs: 0,
      postedUs: 0,
      flushedUs: 0,
      notifiedUs: 1_000_000,
    });
  }

  /** Settles every operation posted so far. */
  landAll(): void {
    for (const o of this.ops) o.op.resolve();
  }

  failAll(message = "UCS_ERR_CANCELED"): void {
    for (const o of this.ops)
      o.op.reject(Object.assign(new Error(message), { code: "ERR_TRANSFER" }));
  }
}

/** Two layers, two KV heads of 16, blocks of 16 tokens, 8 blocks: small enough to plan fast. */
export const SMALL: KvLayout = kvLayout({
  numLayers: 2,
  mla: false,
  totalKvHeads: 2,
  headDim: 16,
  dtype: "bfloat16",
  dtypeBytes: 2,
  blockSize: 16,
  numBlocks: 8,
  order: "HND",
  tpSize: 1,
  tpRank: 0,
});

/** Like SMALL with 8 KV heads, for `tpSize` ranks and blocks of `blockSize` tokens. */
export function smallTp(tpSize: number, blockSize = 16): KvLayout {
  return kvLayout({ ...SMALL, totalKvHeads: 8, tpSize, blockSize });
}

export const SETTINGS: LifecycleSettings = {
  leaseMs: 1000,
  regLeaseMs: 800,
  transferTimeoutMs: 5000,
  abortGraceMs: 200,
  settleBoundMs: 300,
  tombstoneMs: 10_000,
  maxTransfers: 2,
  // Each peer's share of P's registrations before PrefillDone, and the pool they are kept in
  // (each by default maxTransfers / 8), are tested on their own.
  maxPerPeer: 1000,
  maxUnconfirmed: 1000,
  exclusivePrefillBlocks: false,
};

/** D's push drain after the last renewal: P's registration lease, the grace, the settle bound. */
export const PUSH_DRAIN_MS = SETTINGS.regLeaseMs + SETTINGS.abortGraceMs + SETTINGS.settleBoundMs!;

export interface Recorded {
  kind: EventKind;
  transferId: string;
  side: string;
  reason: string;
}

/** `layout`'s registered KV: one fake agent serving every rank (its operations are recorded
 * together), and regions whose remote keys are all `[5]`. */
function fakeKv(
  layout: KvLayout,
  agent: FakeAgent,
  groups: readonly KvGroup[] = singleGroup(layout),
): RegisteredKv {
  return {
    layout,
    groups,
    agents: Array.from({ length: layout.tpSize }, () => agent as unknown as Agent),
    regions: Array.from({ length: layout.tpSize }, () =>
      layout.regionBytes.map(() => ({ remoteKey: () => new Uint8Array([5]) }) as Region),
    ),
  };
}

/** A side's world: the context it is built with, and everything it said, as recorded. */
export class FakeWorld {
  readonly clock = new ManualClock();
  readonly agent = new FakeAgent();
  readonly engine: EngineMessage[] = [];
  readonly refused: { transferId: string; code: string }[] = [];
  /** The refusals' texts, as `code: message`. */
  readonly refusedText: string[] = [];
  readonly toPeer: { peer: string; body: PeerBody }[] = [];
  /** The PeerState each of `toPeer` went to (which handshake), by index. */
  readonly toPeerState: PeerState[] = [];
  /**
   * Notifications a side sealed to post itself (P's XferDone on each pair's endpoint), in the
   * order they went out: a pair's XferDone only once its writes landed.
   */
  readonly sealed: PeerBody[] = [];
  private readonly sealedBodies = new WeakMap<Uint8Array, PeerBody>();
  readonly events: Recorded[] = [];
  /** Each event's transfer id and peer. */
  readonly eventPeers: string[] = [];
  readonly errors: string[] = [];
  /** What the side reported as metrics: ready transfers and failures, in order. */
  readonly ready: { mode: string; latencyMs: number; bytes: number }[] = [];
  readonly failures: string[] = [];
  moved = 0;
  readonly ctx: SideContext;

  constructor(
    settings: Partial<LifecycleSettings> = {},
    readonly layout: KvLayout = SMALL,
  ) {
    const log = pino({ level: "silent" });
    const kv = fakeKv(layout, this.agent);
    this.agent.onNotified = (data) => {
      const body = this.sealedBodies.get(data);
      if (body !== undefined) this.sealed.push(body);
    };
    this.ctx = {
      clock: this.clock,
      settings: { ...SETTINGS, ...settings },
      log,
      kvs: { kv },
      engine: {
        send: (msg) => this.engine.push(msg),
        refuse: (transferId, code, message) => {
          this.refused.push({ transferId, code });
          this.refusedText.push(`${code}: ${message}`);
        },
      },
      peers: {
        send: (peer, body) => {
          this.toPeer.push({ peer: peer.engineId, body });
          this.toPeerState.push(peer);
        },
        seal: (_peer, body) => {
          const sealed = new Uint8Array(0);
          this.sealedBodies.set(sealed, body);
          return sealed;
        },
      },
      events: {
        emit: (kind, transferId, peer, side, reason) => {
          this.events.push({ kind, transferId, side, reason });
          this.eventPeers.push(`${transferId} ${peer}`);
        },
      },
      errors: { note: (text) => this.errors.push(text) },
      tally: {
        moved: (bytes) => (this.moved += bytes),
        metrics: {
          transferReady: (mode, latencyMs, bytes) => this.ready.push({ mode, latencyMs, bytes }),
          transferFailed: (reason) => this.failures.push(reason),
          setQueueDepth: () => undefined,
        },
      },
    };
  }

  /** A peer engine with SMALL's layout, reached through this world's agent. */
  /**
   * A peer engine as the peer table holds it. It is heard from all the time (its lastSeenMs is
   * now, as for a peer that heartbeats), until `silent(peer)`.
   */
  peer(engineId = "peer-0", layout: KvLayout = this.layout): PeerState {
    const peer = new PeerState(
      peerMetadata(engineId, 7n, layout),
      singleGroup(layout),
      this.ctx.kvs.kv!.agents,
      "none",
      this.ctx.log,
      this.clock.now(),
      false,
    );
    const clock = this.clock;
    let heardAt: number | undefined;
    Object.defineProperty(peer, "lastSeenMs", {
      get: () => heardAt ?? clock.now(),
      set: (v: number) => (heardAt = v),
    });
    return peer;
  }

  /** `peer` is heard from no more (its lastSeenMs stays at now). */
  silent(peer: PeerState): void {
    peer.lastSeenMs = this.clock.now();
  }

  /** The cases of the engine messages sent for `transferId`, in order. */
  engineSaid(transferId: string): string[] {
    return this.engine
      .filter((m) => (m.value as { transferId?: string }).transferId === transferId)
      .map((m) => {
        if (m.case === "releaseBlocks") return `releaseBlocks:${m.value.reason}`;
        return m.case ?? "";
      });
  }

  /** The cases of the peer notifications sent about `transferId`, in order. */
  peerSaid(transferId: string): string[] {
    return this.toPeer
      .filter((m) => (m.body.value as { transferId?: string }).transferId === transferId)
      .map((m) => (m.body.case === "failed" ? `failed:${m.body.value.code}` : (m.body.case ?? "")));
  }

  eventsOf(transferId: string): string[] {
    return this.events.filter((e) => e.transferId === transferId).map((e) => e.kind);
  }
}

/** A peer engine's handshake metadata: `layout`'s ranks, fake worker addresses and keys. */
export function peerMetadata(engineId: string, epoch: bigint, layout: KvLayout = SMALL) {
  return create(AgentMetadataSchema, {
    engineId,
    epoch,
    layout: kvLayoutToProto(layout),
    sideChannel: "127.0.0.1:1",
    ranks: Array.from({ length: layout.tpSize }, (_, rank) =>
      create(RankMetadataSchema, {
        rank,
        workerAddress: new Uint8Array([9, rank]),
        remoteKeys: layout.regionBytes.map(() => new Uint8Array([5])),
      }),
    ),
  });
}

export function prefillDone(transferId: string, token = "", blocks = [0, 1]): PrefillDone {
  return create(PrefillDoneSchema, { transferId, blockIds: blocks, numTokens: 20, token });
}

/** D's PushReg for blocks [4, 5], 20 tokens, the settings' registration lease. */
export function pushReg(transferId: string, token = ""): PushReg {
  return create(PushRegSchema, {
    transferId,
    blockIds: [4, 5],
    numTokens: 20,
    prefixTokens: 0,
    leaseMs: SETTINGS.regLeaseMs,
    token,
  });
}

export function expectKv(transferId: string, pull = false, token = "", blocks = [2, 3]): ExpectKv {
  return create(ExpectKvSchema, {
    transferId,
    source: "127.0.0.1:1",
    blockIds: blocks,
    numTokens: 20,
    prefixTokens: 0,
    sourceBlockIds: pull ? [0, 1] : [],
    hasSourceBlockIds: pull,
    token,
  });
}

/** Lets promise callbacks run (the sides await their agents' operations). */
export async function settle(): Promise<void> {
  for (let i = 0; i < 5; i++) await new Promise<void>((r) => setImmediate(r));
}

/** A peer table of P "p0" at epoch 11, with a fake host that records what the table tells it. */
export class PeerTableWorld {
  static readonly EPOCH = 11n;
  readonly clock = new ManualClock();
  readonly downs: { peer: string; epoch: bigint; why: string }[] = [];
  readonly ups: { peer: string; epoch: bigint }[] = [];
  readonly errors: string[] = [];
  readonly events: string[] = [];
  /** The same events with their reasons. */
  readonly reasons: string[] = [];
  /** What the sides answer to "any live transfer with this peer?". */
  live = true;
  /** What the sides answer to "reads or writes in flight with this peer?". */
  busy = false;
  /** The engine's KV is registered (false: the sidecar has stopped and its agents are gone). */
  registered = true;
  readonly agent = new FakeAgent();
  readonly table: PeerTable;

  constructor(
    o: {
      notAccepting?: boolean;
      authenticated?: boolean;
      engineId?: string;
      role?: "prefill" | "decode" | "both";
      layout?: KvLayout;
      peerCredentials?: PeerCredentials;
      peerMessagesPerSec?: number;
      /** The engine's KV cache groups (default: one full group of `layout`). */
      groups?: readonly KvGroup[];
    } = {},
  ) {
    const kv = fakeKv(o.layout ?? SMALL, this.agent, o.groups);
    const world = this;
    this.table = new PeerTable(
      {
        engineId: o.engineId ?? "p0",
        epoch: PeerTableWorld.EPOCH,
        role: o.role ?? "prefill",
        clock: this.clock,
        log: pino({ level: "silent" }),
        channel: { address: "127.0.0.1:2", authenticated: o.authenticated === true },
        kvs: {
          get kv() {
            return world.registered ? kv : undefined;
          },
          notAccepting: () =>
            o.notAccepting === true ? { code: "ERR_NOT_READY", message: "not yet" } : undefined,
        },
        events: {
          peerEvent: (kind, peer, reason) => {
            this.events.push(`${kind} ${peer}`);
            this.reasons.push(`${kind} ${peer}: ${reason}`);
          },
        },
        errors: { note: (text) => this.errors.push(text) },
        sides: {
          peerDown: (peer, why) => this.downs.push({ peer: peer.engineId, epoch: peer.epoch, why }),
          peerUp: (peer) => this.ups.push({ peer: peer.engineId, epoch: peer.epoch }),
          peerReached: () => undefined,
          busyWith: () => this.busy,
          liveWith: () => this.live,
        },
      },
      {
        errorMode: "none",
        heartbeatMs: 1000,
        handshakeTimeoutMs: 1000,
        peerTimeoutMs: 5000,
        peerKeepaliveMs: 30_000,
        tombstoneMs: 60_000,
        abortGraceMs: 200,
        peerCredentials: o.peerCredentials,
        ...(o.peerMessagesPerSec !== undefined ? { peerMessagesPerSec: o.peerMessagesPerSec } : {}),
      },
    );
  }
}

/** An event as the sides append it to the event log (the log assigns its seq). */
export function logEvent(
  transferId: string,
  kind: EventKind = "KV_READY",
  side: TransferSide | "" = "decode",
): Omit<SidecarEvent, "seq"> {
  return {
    kind,
    timeMs: Date.now(),
    transferId,
    peer: "p",
    side,
    reason: "",
    bytes: 1,
    mode: "push",
  };
}
