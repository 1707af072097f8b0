/**
 * The engine's KV registration: RegisterKvCache and AllocateKv checked against the caps and the
 * KV directory, each rank's regions mapped (files, segments, CUDA IPC handles) on its agent, the
 * files watched for shrinking, and everything closed at the end. The facade (sidecar.ts) hands
 * it the engine's registration messages and reads the registered KV (`kv`) from it.
 */
import { equals } from "@bufbuild/protobuf";
import {
  closeSync,
  constants,
  fstatSync,
  ftruncateSync,
  openSync,
  realpathSync,
  statSync,
} from "node:fs";
import { availableParallelism } from "node:os";
import type { Logger } from "pino";

import {
  RegisterKvCacheSchema,
  type AllocateKv,
  type RegisterKvCache,
} from "../gen/kvxfer/v1/engine_pb.js";
import { KvxferError } from "../errors.js";
import { checkAllocateKv, checkRegisterKvCache, type RegionSource } from "../engine/validate.js";
import { Agent, type Region } from "../native/index.js";
import { MAX_PEER_MESSAGE_BYTES, agentName } from "../peer/messages.js";
import type { KvLayout } from "../plan/index.js";
import { KvAllocations } from "./allocations.js";
import type { EngineMessage, ErrorPort } from "./context.js";
import type { SidecarLifecycle } from "./sidecar-lifecycle.js";
import type { RegisteredKv } from "../peer/peer-state.js";
import type { KvGate } from "../peer/peer-table.js";

/** The settings registration reads (SidecarOptions, resolved). */
export interface KvSettings {
  readonly netDevices: readonly string[];
  readonly transports: string;
  readonly busyPoll: boolean;
  readonly spinUs: number | "auto";
  readonly kvDir: string;
  readonly maxRegistrationBytes: number;
  readonly maxKvBytes: number;
  readonly prefault: boolean;
  /** A peer silent this long is down: also how long a TCP connection may go unacknowledged. */
  readonly peerTimeoutMs: number;
}

/** The ports registration is built with. */
export interface KvHost {
  readonly engineId: string;
  readonly epoch: bigint;
  readonly opts: KvSettings;
  readonly log: Logger;
  readonly errors: ErrorPort;
  /** The engine: answers to the sender of the engine message being handled. */
  readonly engine: { answer(msg: EngineMessage): void };
  /** The side channel (its bound address goes into every Registered). */
  readonly channel: { readonly address: string };
  /** The sidecar's lifecycle: told REGISTERED once a registration is accepted. */
  readonly life: Pick<SidecarLifecycle, "on" | "draining">;
  /** The peer dispatch: a registered rank's agent's notifications and endpoint failures. */
  readonly agents: { wire(agent: Agent, rank: number): void };
}

/**
 * The engine link connection a message came from, as far as ownership goes (link.ts): the link
 * belongs to the connection whose registration was accepted, and only the sidecar decides that.
 */
export interface EngineConnection {
  /** The connection's id (stable for its life); allocations are freed when it ends. */
  readonly id?: string;
  /** This connection owns the link. */
  readonly isOwner: boolean;
  /** The owner's connection is up (false: no owner yet, or its connection ended). */
  readonly ownerConnected: boolean;
  /** Makes this connection the owner (called once a registration from it is accepted). */
  adopt(): void;
}

/** A KV file mapped for a region: a descriptor of the mapped inode and the bytes it must hold. */
interface KvFile {
  /** Opened read-write: a file that shrank is given its size back (ftruncate), see kvShrunk. */
  readonly fd: number;
  readonly path: string;
  readonly end: number;
  readonly rank: number;
  readonly region: number;
}

/** The spin after activity that "auto" gives a registration whose agents have two cores each. */
export const AUTO_SPIN_US = 200;

/** `--spin-us` for a registration of `agents` ranks ("auto": see SidecarOptions.spinUs). */
export function spinFor(
  spinUs: number | "auto",
  agents: number,
  cores = availableParallelism(),
): number {
  if (spinUs !== "auto") return spinUs;
  return agents * 2 <= cores ? AUTO_SPIN_US : 0;
}

export class KvRegistry implements KvGate {
  /** The engine's KV cache once registered: layout, one agent per rank, its regions. */
  kv: RegisteredKv | undefined;
  /** The accepted registration, and the identity (device, inode) of each file it mapped. */
  private registration: { msg: RegisterKvCache; files: string[] } | undefined;
  /** The KV directory with symbolic links resolved (the operator's setting may name a link). */
  private readonly kvDirResolved: string;
  /**
   * Bytes of KV files mapped now (checked against maxKvBytes). A sidecar holds one registration
   * today; code that drops or replaces one (re-registration) must subtract its bytes.
   */
  private mappedBytes = 0;
  /** The KV files mapped, watched for shrinking (openKvFiles). */
  private kvFiles: KvFile[] = [];
  /** Why the registered KV is broken (a file shrank after registration), once it is. */
  private kvBroken: string | undefined;
  /** Regions allocated for the engine (AllocateKv) that no registration took yet. */
  private readonly allocations = new KvAllocations();
  constructor(private readonly host: KvHost) {
    try {
      this.kvDirResolved = realpathSync(host.opts.kvDir);
    } catch {
      this.kvDirResolved = host.opts.kvDir;
    }
  }

  /** Why peer handshakes are refused now: no KV registered yet, or the sidecar draining. */
  notAccepting(): { code: string; message: string } | undefined {
    if (this.kv === undefined)
      return { code: "ERR_NOT_READY", message: "the engine has not registered its KV cache" };
    if (this.host.life.draining)
      return { code: "ERR_DRAINING", message: "the sidecar is draining" };
    return undefined;
  }

  /**
   * Whether the registered engine removed its KV: every file of the accepted registration is
   * gone from disk or replaced (the simulated engine and the vLLM connector remove theirs when
   * they end). A segment shows nothing here: false.
   */
  filesGone(): boolean {
    const cur = this.registration;
    if (cur === undefined || cur.files.length === 0) return false;
    if (cur.files.some((id) => id === "" || id.startsWith("segment:"))) return false;
    const now = KvRegistry.fileIdentities(cur.msg);
    return cur.files.every((id, i) => now[i] !== id);
  }

  /**
   * A descriptor of every KV file mapped (the same inode, by device and inode), with the bytes
   * its region needs: how kvShrunk sees a file shrink under the mapping. Best effort: a file
   * that cannot be opened again is not checked.
   */
  private openKvFiles(reg: RegisterKvCache, layout: KvLayout): KvFile[] {
    const out: KvFile[] = [];
    for (const rk of reg.ranks)
      for (const [g, f] of rk.regions.entries()) {
        if (f.segment !== undefined) continue; // a SysV segment cannot shrink
        try {
          const fd = openSync(f.path, constants.O_RDWR | constants.O_NOFOLLOW);
          out.push({
            fd,
            path: f.path,
            end: Number(f.offset) + layout.regionBytes[g]!,
            rank: rk.rank,
            region: g,
          });
        } catch (err) {
          this.host.log.warn({ err, path: f.path }, "cannot reopen a KV file to watch its size");
        }
      }
    return out;
  }

  /** Why a mapped KV file no longer covers its region, or undefined (one fstat per file). */
  private kvShrunk(): string | undefined {
    for (const f of this.kvFiles) {
      let size: number;
      try {
        size = fstatSync(f.fd).size;
      } catch {
        continue;
      }
      if (size >= f.end) continue;
      // What the file held is gone, and every page past its end faults (SIGBUS) when touched,
      // by us or by a peer's read. Its size is given back at once (the lost pages read as
      // zeros, they fault no more), and the KV stays broken: every transfer fails from now on.
      this.kvBroken ??=
        `rank ${f.rank} region ${f.region}: KV file '${f.path}' shrank to ${size} bytes ` +
        `after registration; the region needs ${f.end} (restart the sidecar and the engine)`;
      try {
        ftruncateSync(f.fd, f.end);
      } catch (err) {
        this.host.log.error({ err, path: f.path }, "cannot give a shrunk KV file its size back");
      }
    }
    return this.kvBroken;
  }

  /**
   * (device, inode) of every file of a registration, in order ("" for a file stat cannot see);
   * a segment's id for a segment.
   */
  private static fileIdentities(reg: RegisterKvCache): string[] {
    return reg.ranks.flatMap((rk) =>
      rk.regions.map((f) => {
        if (f.segment !== undefined) return `segment:${f.segment}`;
        // A CUDA IPC handle names one allocation of a live process (the open mapping keeps it).
        if (f.cudaIpcHandle.length > 0) {
          return `cuda:${f.cudaDevice}:${Buffer.from(f.cudaIpcHandle).toString("hex")}`;
        }
        try {
          const st = statSync(f.path, { bigint: true });
          return `${st.dev}:${st.ino}`;
        } catch {
          return "";
        }
      }),
    );
  }

  /**
   * Whether `reg` describes exactly the KV cache already registered: the same message (engine
   * id, layout, files, offsets, lengths) and the same files on disk (a file recreated at the
   * same path is another file).
   */
  private isSameCache(reg: RegisterKvCache): boolean {
    const cur = this.registration;
    if (cur === undefined || !equals(RegisterKvCacheSchema, cur.msg, reg)) return false;
    const ids = KvRegistry.fileIdentities(reg);
    return (
      ids.length === cur.files.length && ids.every((id, i) => id !== "" && id === cur.files[i])
    );
  }

  /** RegisterKvCache: checked, mapped, answered (Registered) to its sender. */
  register(reg: RegisterKvCache, conn?: EngineConnection): void {
    const fail = (error: string): void => {
      this.host.errors.note(`register: ${error}`);
      this.host.log.warn({ error }, "engine registration refused");
      this.answerRegistered(error);
    };
    if (this.kv !== undefined) {
      if (conn === undefined || conn.isOwner)
        return fail("ERR_ALREADY_REGISTERED: the KV cache is already registered");
      if (conn.ownerConnected) {
        this.host.log.warn(
          "a registration from a second engine connection refused: the link is taken",
        );
        return fail(
          "ERR_ENGINE_LINK_TAKEN: another live connection owns this engine link (one engine per sidecar)",
        );
      }
      if (!this.isSameCache(reg)) {
        return fail(
          "ERR_NEEDS_NEW_SIDECAR: the engine that registered is gone, but this registration names " +
            "other memory; a new engine process needs a new sidecar (new epoch): with " +
            "--engine-lease-ms this sidecar stops by itself once the old engine is provably gone " +
            "(its KV files removed, or its connection gone that long), else restart it",
        );
      }
      // The owner's connection ended and the same engine (same files) registers again from a
      // new connection: it reconnected. It takes the link back; what was held for it follows
      // the answer.
      this.host.log.warn(
        "the engine reconnected and registered again: link handed to its new connection",
      );
      this.answerRegistered();
      conn.adopt();
      return;
    }
    const checked = checkRegisterKvCache(reg);
    if (!checked.ok) return fail(`${checked.problem.code}: ${checked.problem.message}`);
    const { layout, groups, ranks } = checked.cache;
    if (checked.cache.engineId !== this.host.engineId) {
      return fail(
        `ERR_BAD_ENGINE_ID: engine id '${checked.cache.engineId}' is not this sidecar's '${this.host.engineId}'`,
      );
    }
    // What this registration maps: every region of every rank (the engine's files are
    // checked, and mapped, only if the total fits both caps).
    const bytes = layout.tpSize * layout.regionBytes.reduce((a, b) => a + b, 0);
    if (bytes > this.host.opts.maxRegistrationBytes) {
      return fail(
        `ERR_REGION_TOO_LARGE: the registration maps ${bytes} bytes (${ranks.length} ranks x ` +
          `${layout.regionBytes.length} regions), more than --max-registration-bytes ${this.host.opts.maxRegistrationBytes}`,
      );
    }
    if (this.mappedBytes + bytes > this.host.opts.maxKvBytes) {
      return fail(
        `ERR_REGION_TOO_LARGE: the registration maps ${bytes} bytes; with the ${this.mappedBytes} ` +
          `already mapped that is more than --max-kv-bytes ${this.host.opts.maxKvBytes}`,
      );
    }
    // A rank whose regions this sidecar allocated (AllocateKv) registers them by segment id,
    // with the agent that allocated them; every other rank gets a new agent.
    const agents: Agent[] = [];
    const created: Agent[] = [];
    const regions: Region[][] = [];
    const owned: number[] = [];
    try {
      for (const rk of ranks) {
        const own = this.allocations.get(rk.rank);
        const usesOwn =
          own !== undefined &&
          rk.regions.some((f) => own.regions.some((r) => r.segment === f.segment));
        if (usesOwn && own.tpSize !== layout.tpSize) {
          throw new KvxferError(
            "ERR_BAD_REGIONS",
            `rank ${rk.rank}: its regions were allocated for tp_size ${own.tpSize}, the layout has ${layout.tpSize}`,
          );
        }
        const agent = usesOwn ? own.agent : this.newAgent(rk.rank, ranks.length);
        if (usesOwn) owned.push(rk.rank);
        else created.push(agent);
        agents.push(agent);
        regions.push(
          rk.regions.map((f, i) =>
            this.regionOf(agent, rk.rank, i, f, layout.regionBytes[i]!, usesOwn ? own : undefined),
          ),
        );
      }
    } catch (err) {
      for (const a of created) a.close();
      const e = KvxferError.from(err);
      return fail(`${e.code}: ${e.message}`);
    }
    for (const [i, agent] of agents.entries()) this.host.agents.wire(agent, ranks[i]!.rank);
    // The registration owns what it uses; what it does not use is freed.
    for (const rank of owned) this.allocations.take(rank);
    this.allocations.freeAll();
    this.kvFiles = this.openKvFiles(reg, layout);
    this.kv = { layout, groups, agents, regions, shrunk: () => this.kvShrunk() };
    this.host.life.on("REGISTERED");
    this.mappedBytes += bytes;
    this.registration = { msg: reg, files: KvRegistry.fileIdentities(reg) };
    conn?.adopt();
    this.host.log.info(
      { tp: layout.tpSize, regions: layout.regionBytes.length },
      "KV cache registered",
    );
    this.answerRegistered();
  }

  /** A new agent for `rank` of `ranks`. */
  /** Registered, to the engine that asked: ok, or the error that refused it. */
  private answerRegistered(error = ""): void {
    this.host.engine.answer({
      case: "registered",
      value: {
        ok: error === "",
        error,
        sideChannel: this.host.channel.address,
        epoch: this.host.epoch,
      },
    });
  }

  private newAgent(rank: number, ranks: number): Agent {
    const netDevices = this.host.opts.netDevices[rank] ?? this.host.opts.netDevices[0];
    return new Agent({
      name: agentName(this.host.engineId, this.host.epoch, rank),
      ...(this.host.opts.transports !== "" ? { transports: this.host.opts.transports } : {}),
      ...(netDevices !== undefined ? { netDevices } : {}),
      maxNotificationBytes: MAX_PEER_MESSAGE_BYTES,
      busyPoll: this.host.opts.busyPoll,
      spinUs: spinFor(this.host.opts.spinUs, ranks),
      // A connection that delivers nothing for twice as long as a silent peer is declared down
      // is given up by the kernel: after a partition longer than that, the old connections fail
      // (their reads and writes settle at once) instead of resuming at TCP's next backed-off
      // retransmission, seconds to minutes after the heal, while the blocks they touch stay
      // held (docs/operations.md, "Network faults"). Twice: a cut the peer outlives (shorter
      // than the peer timeout) must not cost the connections its transfers go on over (with
      // one timeout, under load, a pull right after a 1.5 s cut found its endpoint reset). A
      // slow link keeps being acknowledged. A connection failed with GET replies queued crashed
      // P inside UCX 1.22 (5 of 11 runs of net-faults.test.ts, 2026-12-05) until the addon
      // primed those replies (native/src/ucx_fix.cc); a D killed mid-pull did the same.
      tcpUserTimeoutMs: 2 * this.host.opts.peerTimeoutMs,
    });
  }

  /**
   * Region `g` of `rank` as a registration names it: a file under --kv-dir; a segment this
   * sidecar allocated for exactly that rank and region (`own`); or a segment it did not allocate
   * (one a previous sidecar allocated, named again by an engine that outlived it), attached and
   * registered like a file: owner-only and this user's, or refused.
   */
  private regionOf(
    agent: Agent,
    rank: number,
    g: number,
    f: RegionSource,
    need: number,
    own: { regions: readonly Region[] } | undefined,
  ): Region {
    const where = `rank ${rank} region ${g}`;
    if (f.cudaIpc !== undefined) {
      // The engine's GPU KV, registered in place (placement `device`, docs/gpu.md).
      try {
        return agent.openCudaIpc(f.cudaIpc.handle, {
          device: f.cudaIpc.device,
          offset: f.offset,
          length: need,
        });
      } catch (err) {
        const e = KvxferError.from(err);
        throw new KvxferError(e.code, `${where}: ${e.message}`);
      }
    }
    if (f.segment === undefined) {
      if (own !== undefined) {
        throw new KvxferError(
          "ERR_BAD_REGIONS",
          `${where}: a file, where the rank's other regions are the segments allocated for it ` +
            "(register every region of an allocated rank by its segment)",
        );
      }
      try {
        return agent.mapFile(f.path, {
          offset: f.offset,
          length: need,
          // The directory as configured, or as resolved when the engine names it so
          // (e.g. /dev/shm a link to /run/shm): below it nothing is followed.
          confineDir: f.path.startsWith(this.kvDirResolved + "/")
            ? this.kvDirResolved
            : this.host.opts.kvDir,
          populate: this.host.opts.prefault,
        });
      } catch (err) {
        const e = KvxferError.from(err);
        const hint = e.code.startsWith("ERR_REGION_") ? ` (--kv-dir ${this.host.opts.kvDir})` : "";
        throw new KvxferError(e.code, `${where}: ${e.message}${hint}`);
      }
    }
    if (own !== undefined) {
      const r = own.regions[g];
      if (r === undefined || r.segment !== f.segment) {
        throw new KvxferError(
          "ERR_BAD_REGIONS",
          `${where}: segment ${f.segment} is not the one allocated for it (${r?.segment ?? "none"})`,
        );
      }
      if (r.length < need) {
        throw new KvxferError(
          "ERR_BAD_REGIONS",
          `${where}: segment ${f.segment} has ${r.length} bytes, the region ${need}`,
        );
      }
      return r;
    }
    try {
      return agent.attachSegment(f.segment, need);
    } catch (err) {
      const e = KvxferError.from(err);
      throw new KvxferError(e.code, `${where}: ${e.message}`);
    }
  }

  /**
   * AllocateKv: one rank's regions as SysV segments UCX allocated (allocations.ts), answered
   * with their ids (Allocated). Refused once a registration was accepted, and beyond the caps.
   */
  allocate(msg: AllocateKv, conn?: EngineConnection): void {
    const answer = (ok: boolean, error: string, segments: number[] = []): void =>
      this.host.engine.answer({
        case: "allocated",
        value: { rank: msg.rank, ok, error, segments },
      });
    const fail = (error: string): void => {
      this.host.errors.note(`allocate: ${error}`);
      this.host.log.warn({ rank: msg.rank, error }, "KV allocation refused");
      answer(false, error);
    };
    if (this.kv !== undefined) {
      return fail(
        "ERR_ALREADY_REGISTERED: the KV cache is already registered (allocate before registering)",
      );
    }
    const problem = checkAllocateKv(msg);
    if (problem !== undefined) return fail(`${problem.code}: ${problem.message}`);
    const lengths = msg.lengths.map(Number);
    const bytes = lengths.reduce((a, b) => a + b, 0);
    const others = this.allocations.bytes - (this.allocations.get(msg.rank)?.bytes ?? 0);
    if (others + bytes > this.host.opts.maxRegistrationBytes) {
      return fail(
        `ERR_REGION_TOO_LARGE: allocating ${bytes} bytes for rank ${msg.rank} (${others} already ` +
          `allocated) is more than --max-registration-bytes ${this.host.opts.maxRegistrationBytes}`,
      );
    }
    if (this.mappedBytes + others + bytes > this.host.opts.maxKvBytes) {
      return fail(
        `ERR_REGION_TOO_LARGE: allocating ${bytes} bytes for rank ${msg.rank}; with the ` +
          `${this.mappedBytes + others} already mapped or allocated that is more than --max-kv-bytes ${this.host.opts.maxKvBytes}`,
      );
    }
    try {
      const a = this.allocations.allocate(
        msg.rank,
        msg.tpSize,
        lengths,
        conn?.id ?? "",
        () => this.newAgent(msg.rank, msg.tpSize),
        this.host.opts.prefault,
      );
      const segments = a.regions.map((r) => r.segment!);
      this.host.log.info({ rank: msg.rank, bytes, segments }, "KV regions allocated");
      answer(true, "", segments);
    } catch (err) {
      const e = KvxferError.from(err);
      fail(`${e.code}: rank ${msg.rank}: ${e.message}`);
    }
  }

  /** The engine link connection `id` ended: what it allocated and did not register is freed. */
  connectionEnded(id: string): void {
    const n = this.allocations.freeConnection(id);
    if (n > 0)
      this.host.log.info({ ranks: n }, "unregistered KV allocations freed: their connection ended");
  }

  /**
   * A sweep's check: the problem when a mapped KV file is found shrunk for the first time (its
   * size is given back at once), else undefined.
   */
  newlyBroken(): string | undefined {
    const was = this.kvBroken;
    if (this.kvFiles.length === 0 || this.kvShrunk() === undefined || was !== undefined)
      return undefined;
    return this.kvBroken;
  }

  /** Frees what was allocated, stops watching the files, closes every agent. */
  close(): void {
    this.allocations.freeAll();
    for (const f of this.kvFiles.splice(0)) closeSync(f.fd);
    if (this.kv !== undefined) {
      // Every rank's shutdown starts at once: a stop waits out one deadline, not one per rank.
      for (const a of this.kv.agents) a.beginClose();
      for (const a of this.kv.agents) a.close();
      // Transfers ending during the stop notify no one (PeerTable.send finds no agent).
      this.kv = { ...this.kv, agents: [] };
    }
  }
}
