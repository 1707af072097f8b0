/** The Agent: one UCX context and worker, the handles made through it, and its transfers. */
import { EventEmitter } from "node:events";

import { KvxferError } from "../errors.js";
import {
  addon,
  call,
  check,
  isBytes,
  type NativeAgent,
  type NativeEndpoint,
  type NativeEvent,
  type NativePrepared,
  type NativeRegion,
  type NativeRemoteRegion,
} from "./addon.js";
import { Endpoint, PreparedTransfer, Region, RemoteRegion } from "./handles.js";
import { settle } from "./trace.js";
import type {
  AgentOptions,
  Descriptors,
  ErrorMode,
  MemoryType,
  Notification,
  OpTrace,
} from "./types.js";

/** One operation of a transferMany() call. */
export interface TransferEntry {
  kind: "write" | "read";
  endpoint: Endpoint;
  local: Region;
  remote: RemoteRegion;
  descriptors: Descriptors;
  /** A write's notification, delivered after its data. */
  notification?: Uint8Array;
}

/** One region pair of a writeParts() operation. */
export interface WritePart {
  local: Region;
  remote: RemoteRegion;
  descriptors: Descriptors;
}

export interface AgentEvents {
  /** A batch of notifications, in arrival order. */
  notifications: [batch: Notification[]];
  /** An endpoint failed; every operation on it has been or will be rejected. */
  endpointFailed: [endpoint: Endpoint, code: string];
  /** A notification was refused unread: larger than maxNotificationBytes, or not eager. */
  notificationDropped: [peer: string, bytes: number];
  /**
   * Prepared transfers back from a post, one batch per delivery: `done` completed (every byte
   * remotely complete for a write, local for a read), `failed` failed or were lost (their
   * `state` throws why). With the progress thread, the way to learn that a post is over without
   * polling. Reported only while this event has a listener (a polling caller pays nothing).
   */
  prepared: [done: PreparedTransfer[], failed: PreparedTransfer[]];
}

const NAME_MAX = 200;

/** One UCX context and worker, driven by its own progress thread. */
export class Agent extends EventEmitter<AgentEvents> {
  readonly name: string;
  private readonly native: NativeAgent;
  private readonly endpoints = new Map<number, Endpoint>();
  /** Endpoint settles waiting for their event, by seq (Endpoint.settled). */
  private readonly settles = new Map<number, (code: string) => void>();
  private settleSeq = 0;
  private closedFlag = false;
  private closingFlag = false;
  /** Each native prepared transfer's wrapper, for `prepared` events. */
  private readonly preparedByNative = new WeakMap<NativePrepared, PreparedTransfer>();

  constructor(options: AgentOptions = {}) {
    super();
    const name = options.name ?? `kvxfer-${process.pid}-${Math.random().toString(16).slice(2, 10)}`;
    check(
      typeof name === "string" && name.length > 0 && Buffer.byteLength(name) <= NAME_MAX,
      "ERR_INVALID_ARGUMENT",
      `agent name must be 1..${NAME_MAX} bytes`,
    );
    const maxNotificationBytes = options.maxNotificationBytes ?? 4 << 20;
    check(
      Number.isInteger(maxNotificationBytes) && maxNotificationBytes > 0,
      "ERR_INVALID_ARGUMENT",
      "maxNotificationBytes must be a positive integer",
    );
    this.name = name;
    this.native = call(
      () =>
        new addon.Agent(
          {
            name,
            transports: options.transports ?? "",
            netDevices: options.netDevices ?? "",
            busyPoll: options.busyPoll ?? false,
            progress: options.progress ?? "thread",
            inlinePost: options.inlinePost ?? true,
            loopWake: options.loopWake ?? false,
            spinUs: options.spinUs ?? 0,
            tcpUserTimeoutMs: options.tcpUserTimeoutMs ?? 0,
            maxNotificationBytes,
          },
          (batch) => this.onNativeEvents(batch),
        ),
    );
    // `prepared` events cost an array per delivery: reported only while someone listens
    // ("newListener" comes before the listener is added, "removeListener" after it went).
    this.on("newListener", (event) => {
      if (event === "prepared" && !this.closedFlag) this.native.watchPrepared(true);
    });
    this.on("removeListener", (event) => {
      if (event === "prepared" && !this.closedFlag)
        this.native.watchPrepared(this.listenerCount("prepared") > 0);
    });
  }

  /** This agent's worker address, for a peer's connect(). */
  get address(): Buffer {
    return call(() => this.native.address);
  }
  /** Operations (transfers and notifications) in flight. */
  get inflight(): number {
    return this.native.inflight;
  }
  /**
   * Operations with the progress thread that the calling thread posted itself so far
   * (inlinePost); the rest went through the thread. Always 0 with progress "caller" (where the
   * caller posts everything).
   */
  get inlinePosts(): number {
    return this.native.inlinePosts;
  }
  /**
   * Turns in which the event loop progressed the worker itself because its event fd fired
   * (loopWake) and delivered what arrived without the progress thread's hand-off. Always 0 with
   * loopWake false or progress "caller".
   */
  get loopTurns(): number {
    return this.native.loopTurns;
  }
  get closed(): boolean {
    return this.closedFlag;
  }
  /** The transport resources this agent's UCX context opened, as "transport/device". */
  get transports(): string[] {
    return call(() => this.native.transports);
  }
  /** The memory types this agent's UCX context serves ("host", "cuda", ...). */
  get memoryTypes(): string[] {
    return call(() => this.native.memoryTypes);
  }

  /**
   * Registers memory this process reaches at `address` but JavaScript does not own: CUDA device
   * memory (`memoryType: "cuda"`, e.g. a tensor's data pointer or one opened from a CUDA IPC
   * handle), CUDA host-pinned memory (`"cuda-host"`), or host memory mapped elsewhere. The
   * caller keeps the memory alive until the region is closed. A type this UCX cannot serve is
   * refused with ERR_MEMORY_TYPE_UNSUPPORTED, naming the type, the transports found and what is
   * missing; `cuda` and `cuda-host` need `device`, the CUDA device index.
   */
  registerAddress(
    address: bigint,
    length: number,
    options: { memoryType: MemoryType; device?: number },
  ): Region {
    check(
      typeof address === "bigint",
      "ERR_INVALID_ARGUMENT",
      "registerAddress: address must be a bigint",
    );
    check(
      typeof length === "number",
      "ERR_INVALID_ARGUMENT",
      "registerAddress: length must be a number",
    );
    check(
      typeof options?.memoryType === "string",
      "ERR_INVALID_ARGUMENT",
      "registerAddress: options.memoryType must be 'host', 'cuda' or 'cuda-host'",
    );
    return new Region(
      this,
      call(() => this.native.registerAddress(address, length, options.memoryType, options.device)),
    );
  }

  /** Registers a Buffer, TypedArray or ArrayBuffer; it stays referenced until the region closes. */
  registerMemory(memory: ArrayBufferLike | ArrayBufferView): Region {
    return new Region(
      this,
      call(() => this.native.registerMemory(memory)),
    );
  }

  /**
   * Maps `length` bytes at `offset` of a (shared-memory) file and registers them.
   *
   * `confineDir` (absolute): the file must be a regular file with one link, owned by this
   * process's effective uid, under that directory, reached without a symbolic link at any step
   * and without `..`; checked on the descriptor that is mapped (`ERR_REGION_OUTSIDE`,
   * `ERR_REGION_SYMLINK`, `ERR_REGION_NOT_REGULAR`, `ERR_REGION_OWNER`, `ERR_REGION_CHANGED`).
   * `populate`: pre-fault the whole mapping (default false: pages fault in on first use).
   */
  mapFile(
    path: string,
    options: { offset?: number; length: number; confineDir?: string; populate?: boolean },
  ): Region {
    check(
      typeof path === "string" && path.length > 0,
      "ERR_INVALID_ARGUMENT",
      "mapFile: path must be a non-empty string",
    );
    const offset = options.offset ?? 0;
    return new Region(
      this,
      call(() =>
        this.native.mapFile(path, offset, options.length, {
          ...(options.confineDir !== undefined ? { confineDir: options.confineDir } : {}),
          populate: options.populate ?? false,
        }),
      ),
    );
  }

  /**
   * Memory allocated and registered by UCX (zeroed is not guaranteed). On one
   * host, shared-memory transports move it with plain copies rather than a
   * system call per operation. `populate`: every page faulted in now (resident at once).
   */
  allocate(length: number, options: { populate?: boolean } = {}): Region {
    check(typeof length === "number", "ERR_INVALID_ARGUMENT", "allocate: length must be a number");
    return new Region(
      this,
      call(() => this.native.allocate(length, options.populate ?? false)),
    );
  }

  /**
   * Opens CUDA device memory another process on this host exported (`cudaIpcGetMemHandle`, or
   * torch's `untyped_storage()._share_cuda_()`): `length` bytes at `offset` of the allocation
   * that the 64-byte `handle` names, on CUDA device `device` as this process numbers it, and
   * registers them as a `cuda` region. The driver (libcuda.so.1) is loaded on first use; without
   * it this refuses with ERR_CUDA_UNAVAILABLE naming the library and the loader's error. A handle
   * the driver cannot open, or memory on another device, is ERR_CUDA; a range outside the
   * allocation ERR_OUT_OF_BOUNDS; a UCX without CUDA transports ERR_MEMORY_TYPE_UNSUPPORTED.
   * Closing the region closes the mapping (docs/gpu.md).
   */
  openCudaIpc(
    handle: Uint8Array,
    options: { device: number; offset?: number; length: number },
  ): Region {
    check(isBytes(handle), "ERR_INVALID_ARGUMENT", "openCudaIpc: handle must be a Uint8Array");
    check(
      typeof options?.device === "number" && typeof options.length === "number",
      "ERR_INVALID_ARGUMENT",
      "openCudaIpc: options.device and options.length must be numbers",
    );
    return new Region(
      this,
      call(() =>
        this.native.openCudaIpc(handle, options.device, options.offset ?? 0, options.length),
      ),
    );
  }

  /**
   * Allocates `length` bytes of device memory on CUDA device `device` in this process
   * (cuMemAlloc) and registers them as a `cuda` region; closing the region frees them. Refusals
   * as for openCudaIpc.
   */
  allocateCuda(length: number, options: { device: number }): Region {
    check(
      typeof length === "number" && typeof options?.device === "number",
      "ERR_INVALID_ARGUMENT",
      "allocateCuda: length and options.device must be numbers",
    );
    return new Region(
      this,
      call(() => this.native.allocateCuda(length, options.device)),
    );
  }

  /**
   * Attaches and registers `length` bytes of a SysV shared-memory segment: one of this
   * process's user, owner-only (mode 0600), at least `length` bytes long. An engine maps the
   * regions its sidecar allocated this way; it is detached once closed and no view remains.
   */
  attachSegment(id: number, length: number): Region {
    check(
      typeof id === "number" && typeof length === "number",
      "ERR_INVALID_ARGUMENT",
      "attachSegment: id and length must be numbers",
    );
    return new Region(
      this,
      call(() => this.native.attachSegment(id, length)),
    );
  }

  /** Connects to a peer agent from its address. */
  connect(address: Uint8Array, options: { errorMode?: ErrorMode } = {}): Endpoint {
    check(isBytes(address), "ERR_INVALID_ARGUMENT", "connect: address must be a Buffer");
    const errorMode = options.errorMode ?? "none";
    check(
      errorMode === "none" || errorMode === "peer",
      "ERR_INVALID_ARGUMENT",
      `connect: errorMode must be 'none' or 'peer', got '${String(errorMode)}'`,
    );
    const native = call(() => this.native.connect(address, errorMode));
    const ep = new Endpoint(this, native, errorMode);
    this.endpoints.set(ep.id, ep);
    return ep;
  }

  /**
   * One-sided WRITE of every descriptor from `local` into `remote`. Resolves
   * when all data is remotely complete; with a notification, the peer receives
   * it only after all the data has landed.
   */
  write(
    ep: Endpoint,
    local: Region,
    remote: RemoteRegion,
    descriptors: Descriptors,
    notification?: Uint8Array,
  ): Promise<OpTrace> {
    this.checkNotClosing("write");
    this.checkTransfer(ep, local, remote, descriptors);
    if (notification !== undefined) {
      check(isBytes(notification), "ERR_INVALID_ARGUMENT", "write: notification must be a Buffer");
    }
    const p = call(() =>
      this.native.transfer(0, ep.native, local.native, remote.native, descriptors, notification),
    );
    return settle(p);
  }

  /**
   * One operation for several region pairs on one endpoint: every part's WRITEs in order, one
   * flush, then (if given) the notification, which the peer receives only after every part's
   * data has landed. Resolves when all of it is remotely complete. Parts with no descriptors are
   * skipped; a bad part refuses the whole operation before anything is posted.
   */
  writeParts(
    ep: Endpoint,
    parts: readonly WritePart[],
    notification?: Uint8Array,
  ): Promise<OpTrace> {
    this.checkNotClosing("writeParts");
    check(ep instanceof Endpoint, "ERR_INVALID_ARGUMENT", "endpoint is not an Endpoint");
    check(Array.isArray(parts), "ERR_INVALID_ARGUMENT", "writeParts: parts must be an array");
    const native = parts.map((p, i) => {
      this.checkTransfer(ep, p.local, p.remote, p.descriptors, `writeParts part ${i}: `);
      return [p.local.native, p.remote.native, p.descriptors] as [
        NativeRegion,
        NativeRemoteRegion,
        Descriptors,
      ];
    });
    if (notification !== undefined) {
      check(
        isBytes(notification),
        "ERR_INVALID_ARGUMENT",
        "writeParts: notification must be a Buffer",
      );
    }
    const p = call(() => this.native.writeParts(ep.native, native, notification));
    return settle(p);
  }

  /** One-sided READ of every descriptor from `remote` into `local`; resolves when all data is local. */
  read(
    ep: Endpoint,
    local: Region,
    remote: RemoteRegion,
    descriptors: Descriptors,
  ): Promise<OpTrace> {
    this.checkNotClosing("read");
    this.checkTransfer(ep, local, remote, descriptors);
    const p = call(() =>
      this.native.transfer(1, ep.native, local.native, remote.native, descriptors),
    );
    return settle(p);
  }

  /**
   * Several independent writes and reads in one call: each entry is checked as write()/read()
   * check theirs (a bad entry refuses them all, naming it, before anything is posted), then all
   * are handed to the progress thread together, with one wake-up. One promise per entry, in
   * order; each settles on its own.
   */
  transferMany(entries: readonly TransferEntry[]): Promise<OpTrace>[] {
    this.checkNotClosing("transferMany");
    check(Array.isArray(entries), "ERR_INVALID_ARGUMENT", "transferMany: entries must be an array");
    const native = entries.map((e, i) => {
      const where = `transferMany entry ${i}: `;
      check(
        e.kind === "write" || e.kind === "read",
        "ERR_INVALID_ARGUMENT",
        `${where}kind must be 'write' or 'read'`,
      );
      this.checkTransfer(e.endpoint, e.local, e.remote, e.descriptors, where);
      if (e.notification !== undefined) {
        check(
          isBytes(e.notification),
          "ERR_INVALID_ARGUMENT",
          `${where}notification must be a Buffer`,
        );
      }
      return [
        e.kind === "write" ? 0 : 1,
        e.endpoint.native,
        e.local.native,
        e.remote.native,
        e.descriptors,
        e.notification,
      ] as [0 | 1, NativeEndpoint, NativeRegion, NativeRemoteRegion, Descriptors, Uint8Array?];
    });
    return call(() => this.native.transferMany(native)).map((p) => settle(p));
  }

  /**
   * A write (`kind` "write", with an optional notification delivered after its data) or a read,
   * checked now as write() and read() check theirs, and kept to be posted again and again
   * (PreparedTransfer.post()): the per-request path without a promise, for callers that poll.
   */
  prepare(
    kind: "write" | "read",
    ep: Endpoint,
    local: Region,
    remote: RemoteRegion,
    descriptors: Descriptors,
    notification?: Uint8Array,
  ): PreparedTransfer {
    this.checkNotClosing("prepare");
    check(
      kind === "write" || kind === "read",
      "ERR_INVALID_ARGUMENT",
      "prepare: kind must be 'write' or 'read'",
    );
    this.checkTransfer(ep, local, remote, descriptors, "prepare: ");
    if (notification !== undefined) {
      check(
        isBytes(notification),
        "ERR_INVALID_ARGUMENT",
        "prepare: notification must be a Buffer",
      );
    }
    const native = call(() =>
      this.native.prepare(
        kind === "write" ? 0 : 1,
        ep.native,
        local.native,
        remote.native,
        descriptors,
        notification,
      ),
    );
    const prepared = new PreparedTransfer(this, native);
    this.preparedByNative.set(native, prepared);
    return prepared;
  }

  /**
   * With `progress: "caller"`: posts what is queued, progresses the UCX worker until it is idle
   * and settles what completed (promises resolve, notifications are emitted before this returns),
   * all on this thread. Returns the number of operations settled. With the default progress
   * thread it only delivers what that thread has queued (normally nothing: it delivers by itself).
   */
  progress(): number {
    if (this.closedFlag) return 0;
    return this.native.progress();
  }

  /** Sends a notification; it arrives after every write on `ep` that completed before this call. */
  notify(ep: Endpoint, bytes: Uint8Array): Promise<OpTrace> {
    this.checkNotClosing("notify");
    check(
      ep instanceof Endpoint && ep.agent === this,
      "ERR_INVALID_ARGUMENT",
      "notify: endpoint is not this agent's",
    );
    check(isBytes(bytes), "ERR_INVALID_ARGUMENT", "notify: bytes must be a Buffer or Uint8Array");
    const p = call(() => this.native.notify(ep.native, bytes));
    return settle(p);
  }

  /**
   * Idempotent. Cancels what is in flight (those promises reject with
   * ERR_CLOSED), closes endpoints, regions and remote regions, stops the thread.
   */
  close(): void {
    if (this.closedFlag) return;
    this.closedFlag = true;
    this.native.close();
    this.endpoints.clear();
    // Closed: the worker is gone, and with it every operation a settle waited for.
    for (const done of this.settles.values()) done("ERR_CLOSED");
    this.settles.clear();
  }

  /**
   * Starts closing without waiting: what is queued is cancelled and the shutdown deadline starts
   * now; new operations are refused (ERR_CLOSED). `close()` then waits for the rest. Closing
   * several agents (a sidecar's ranks): `beginClose()` each, then `close()` each, so they wait
   * out one deadline together instead of one after another. Idempotent.
   */
  beginClose(): void {
    if (this.closedFlag || this.closingFlag) return;
    this.closingFlag = true;
    this.native.beginClose();
  }

  private checkNotClosing(what: string): void {
    if (this.closingFlag && !this.closedFlag)
      throw new KvxferError("ERR_CLOSED", `${what}: the agent is closing`);
  }

  /** @internal */
  forget(ep: Endpoint): void {
    this.endpoints.delete(ep.id);
  }

  /** @internal */
  awaitSettle(): { seq: number; settled: Promise<string> } {
    const seq = ++this.settleSeq;
    if (this.closedFlag) return { seq, settled: Promise.resolve("ERR_CLOSED") };
    const settled = new Promise<string>((resolve) => this.settles.set(seq, resolve));
    return { seq, settled };
  }

  /** @internal */
  settleNow(seq: number, code: string): void {
    const done = this.settles.get(seq);
    this.settles.delete(seq);
    done?.(code);
  }

  private checkTransfer(
    ep: Endpoint,
    local: Region,
    remote: RemoteRegion,
    descriptors: Descriptors,
    where = "",
  ): void {
    check(ep instanceof Endpoint, "ERR_INVALID_ARGUMENT", `${where}endpoint is not an Endpoint`);
    check(local instanceof Region, "ERR_INVALID_ARGUMENT", `${where}local is not a Region`);
    check(
      remote instanceof RemoteRegion,
      "ERR_INVALID_ARGUMENT",
      `${where}remote is not a RemoteRegion`,
    );
    check(
      descriptors instanceof Float64Array ||
        descriptors instanceof BigUint64Array ||
        descriptors instanceof Uint8Array,
      "ERR_DESC_TYPE",
      `${where}descriptors must be a Float64Array, BigUint64Array or Uint8Array of (localOffset, remoteOffset, length) triples`,
    );
  }

  private wrapPrepared(natives: NativePrepared[]): PreparedTransfer[] {
    const out: PreparedTransfer[] = [];
    for (const n of natives) {
      const t = this.preparedByNative.get(n);
      if (t !== undefined) out.push(t);
    }
    return out;
  }

  private onNativeEvents(batch: NativeEvent[]): void {
    let notes: Notification[] | undefined;
    for (const ev of batch) {
      if (ev.type === "notification") {
        (notes ??= []).push({
          peer: ev.peer,
          data: ev.data,
          receivedUs: ev.receivedUs,
          deliveredUs: ev.deliveredUs,
        });
      } else if (ev.type === "notificationDropped") {
        this.emit("notificationDropped", ev.peer, ev.bytes);
      } else if (ev.type === "endpointSettled") {
        this.settleNow(ev.seq, ev.code);
      } else if (ev.type === "prepared") {
        this.emit("prepared", this.wrapPrepared(ev.done), this.wrapPrepared(ev.failed));
      } else {
        const ep = this.endpoints.get(ev.endpointId);
        if (ep !== undefined) this.emit("endpointFailed", ep, ev.code);
      }
    }
    if (notes !== undefined) this.emit("notifications", notes);
  }
}
