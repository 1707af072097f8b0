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

import { create, fromJson, type JsonValue } from "@bufbuild/protobuf";
import { type Logger } from "pino";

import {
  EngineLinkClient,
  engineMessage,
  kvCacheRegistration,
  AbortSchema,
  EngineToSidecarSchema,
  ExpectKvSchema,
  FailureReason,
  PrefillDoneSchema,
  LayersSavedSchema,
  AllocateKvSchema,
  type Allocated,
  ReleaseReason,
  type SidecarToEngine,
} from "../src/engine/link.js";
import { errorCode } from "../src/errors.js";
import { Agent, type Region } from "../src/native/index.js";
import { type KvLayout } from "../src/plan/index.js";
import { fillKv, verifyKv } from "./kv-pattern.js";
import { prng } from "./prng.js";
import {
  type SimEngineConfig,
  simKvFilePath,
  ControlError,
  type ControlRequest,
  str,
  optStr,
  int,
  intList,
} from "./engine-input.js";
import { BlockPool } from "./block-pool.js";

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

/** How often a re-registration refused by the same sidecar (old connection not yet gone) is retried. */
const MAX_ALREADY_RETRIES = 25;

/** One running simulated engine. */
export class SimEngine {
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
  /** Re-registrations refused as ERR_ENGINE_LINK_TAKEN by the same sidecar, in a row. */
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
        const path = simKvFilePath(
          this.cfg.shmDir,
          this.cfg.engineId,
          this.cfg.fileTag ?? process.pid,
          r,
          g,
        );
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
        errorCode(error) === "ERR_ENGINE_LINK_TAKEN" &&
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
    if (req.layerWise === true) return this.prefillByLayer(req, t, int(req, "layerMs", 0, 0));
    for (let r = 0; r < L.tpSize; r++) fillKv(L, r, this.memories[r]!, tid, blockIds, 0, tokens);
    await this.sendPrefillDone(t, optStr(req, "token"), false);
    return { blockIds };
  }

  /** `t`'s blocks go to the sidecar (held from now on); `layerWise`: before its layers are saved. */
  private async sendPrefillDone(t: LiveTransfer, token: string, layerWise: boolean): Promise<void> {
    t.phase = "held";
    t.gen = this.regGen;
    await this.link!.send(
      engineMessage(
        "prefillDone",
        create(PrefillDoneSchema, {
          transferId: t.transferId,
          blockIds: [...t.blockIds],
          numTokens: t.tokens,
          token,
          layerWise,
        }),
      ),
    );
  }

  /**
   * A layer-wise prefill, as a vLLM connector with layer-wise push sends it: PrefillDone
   * (layer_wise) before the forward, then each layer's KV and a LayersSaved for it, `layerMs`
   * apart. Every layer first holds another pattern (`<id>#stale`): a write the sidecar posted
   * before its layer was saved would land that at D. An abort meanwhile stops the layers; the
   * sidecar gives the blocks back as for any PrefillDone.
   */
  private async prefillByLayer(
    req: ControlRequest,
    t: LiveTransfer,
    layerMs: number,
  ): Promise<Record<string, unknown>> {
    const L = this.layout;
    const { transferId: tid, blockIds, tokens } = t;
    for (let r = 0; r < L.tpSize; r++)
      fillKv(L, r, this.memories[r]!, `${tid}#stale`, blockIds, 0, tokens);
    await this.sendPrefillDone(t, optStr(req, "token"), true);
    let layers = 0;
    for (; layers < L.numLayers && !t.aborted && !this.stopping; layers++) {
      if (layerMs > 0) await new Promise((r) => setTimeout(r, layerMs));
      for (let r = 0; r < L.tpSize; r++)
        fillKv(L, r, this.memories[r]!, tid, blockIds, 0, tokens, layers, layers + 1);
      await this.link!.send(
        engineMessage(
          "layersSaved",
          create(LayersSavedSchema, { transferIds: [tid], layers: layers + 1 }),
        ),
      );
    }
    return { blockIds, layersSaved: layers };
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
