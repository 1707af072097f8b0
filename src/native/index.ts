/**
 * The typed face of the native UCX addon. This is the only module that loads
 * the `.node` file; everything else in kvxfer uses these classes.
 *
 * An Agent is one UCX context and worker with its own progress thread. It
 * registers memory (Regions), connects to peers (Endpoints), imports peers'
 * memory (RemoteRegions) and moves bytes with one-sided WRITE and READ.
 */
import { EventEmitter } from "node:events";
import { existsSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { performance } from "node:perf_hooks";
import { fileURLToPath } from "node:url";

import { KvxferError } from "../errors.js";

// The addon's public face includes its error class (defined in src/errors.ts for every layer).
export { KvxferError, hasCode } from "../errors.js";

// --- the raw addon -----------------------------------------------------------

interface NativeRegion {
  readonly address: bigint;
  readonly length: number;
  readonly memoryType: MemoryType;
  readonly device: number | null;
  readonly path: string | null;
  readonly segment: number | null;
  readonly closed: boolean;
  remoteKey(): Buffer;
  view(): ArrayBuffer;
  close(): void;
}

interface NativePrepared {
  post(): void;
  state(): number;
  close(): void;
}

interface NativeRemoteRegion {
  readonly length: number;
  close(): void;
}

interface NativeEndpoint {
  readonly id: number;
  readonly state: EndpointState;
  importRemote(key: Uint8Array, populate?: boolean): NativeRemoteRegion;
  close(): void;
  abandon(): void;
}

type NativeEvent =
  | { type: "notification"; peer: string; data: Buffer; receivedUs: number; deliveredUs: number }
  | { type: "endpointFailed"; endpointId: number; code: string; ucsStatus: number }
  | { type: "notificationDropped"; peer: string; bytes: number };

interface NativeAgent {
  readonly address: Buffer;
  readonly name: string;
  readonly inflight: number;
  readonly transports: string[];
  readonly memoryTypes: string[];
  registerMemory(memory: ArrayBufferLike | ArrayBufferView): NativeRegion;
  registerAddress(
    address: bigint,
    length: number,
    memoryType: string,
    device: number | undefined,
  ): NativeRegion;
  mapFile(
    path: string,
    offset: number,
    length: number,
    options?: { confineDir?: string; populate?: boolean },
  ): NativeRegion;
  allocate(length: number, populate?: boolean): NativeRegion;
  openCudaIpc(handle: Uint8Array, device: number, offset: number, length: number): NativeRegion;
  allocateCuda(length: number, device: number): NativeRegion;
  attachSegment(id: number, length: number): NativeRegion;
  connect(address: Uint8Array, errorMode: ErrorMode): NativeEndpoint;
  transfer(
    kind: 0 | 1,
    ep: NativeEndpoint,
    local: NativeRegion,
    remote: NativeRemoteRegion,
    descriptors: Descriptors,
    notification?: Uint8Array,
  ): Promise<Float64Array>;
  writeParts(
    ep: NativeEndpoint,
    parts: [NativeRegion, NativeRemoteRegion, Descriptors][],
    notification?: Uint8Array,
  ): Promise<Float64Array>;
  notify(ep: NativeEndpoint, bytes: Uint8Array): Promise<Float64Array>;
  transferMany(
    entries: [
      0 | 1,
      NativeEndpoint,
      NativeRegion,
      NativeRemoteRegion,
      Descriptors,
      (Uint8Array | undefined)?,
    ][],
  ): Promise<Float64Array>[];
  progress(): number;
  prepare(
    kind: 0 | 1,
    ep: NativeEndpoint,
    local: NativeRegion,
    remote: NativeRemoteRegion,
    descriptors: Descriptors,
    notification?: Uint8Array,
  ): NativePrepared;
  close(): void;
  beginClose(): void;
}

interface NativeAddon {
  Agent: new (
    options: {
      name: string;
      transports: string;
      netDevices: string;
      busyPoll: boolean;
      progress: "thread" | "caller";
      spinUs: number;
      maxNotificationBytes: number;
    },
    onEvents: (batch: NativeEvent[]) => void,
  ) => NativeAgent;
  ucxVersion: string;
  ucxInfo(transports?: string): UcxInfo;
  ucsStatusName(status: number): string;
}

function findPackageRoot(start: string): string {
  let dir = start;
  for (let i = 0; i < 8; i++) {
    if (existsSync(join(dir, "package.json")) && existsSync(join(dir, "native"))) return dir;
    dir = dirname(dir);
  }
  throw new KvxferError("ERR_NATIVE_MISSING", `cannot find the kvxfer package root above ${start}`);
}

function loadAddon(): NativeAddon {
  // UCX's own SIGSEGV/SIGBUS handlers would turn V8's WebAssembly traps into
  // crashes; an operator's explicit setting still wins.
  process.env.UCX_ERROR_SIGNALS ??= "";
  // UCX's memory hooks patch mmap/munmap for its registration cache. Under
  // Node they crashed V8's garbage collector here (SIGSEGV in about 1 of 40
  // two-process runs; none in 100 with the hooks off). kvxfer registers its
  // regions explicitly and passes the handle with every operation, so it does
  // not need the cache.
  process.env.UCX_MEM_EVENTS ??= "no";
  const root = findPackageRoot(dirname(fileURLToPath(import.meta.url)));
  // KVXFER_ADDON: another build of the addon (e.g. against another UCX install).
  const path = process.env.KVXFER_ADDON ?? join(root, "build", "native", "Release", "kvxfer.node");
  if (!existsSync(path)) {
    throw new KvxferError(
      "ERR_NATIVE_MISSING",
      `the native addon is not built (${path}); run 'npm run build' (needs libucx-dev and cmake)`,
    );
  }
  return createRequire(import.meta.url)(path) as NativeAddon;
}

const addon = loadAddon();

/** The UCX library version the addon runs on. */
export const ucxVersion: string = addon.ucxVersion;

/**
 * What a region's memory is. `host`: ordinary memory; `cuda`: CUDA device memory (registered as
 * UCX's CUDA memory type; moved by cuda_ipc on one host, GPUDirect RDMA across hosts);
 * `cuda-host`: CUDA host-pinned memory (host memory to UCX, reachable by every host transport).
 */
export type MemoryType = "host" | "cuda" | "cuda-host";

/** The UCX this process runs on, as a default context sees it (UCX_* variables apply). */
export interface UcxInfo {
  /** UCX's library version, e.g. "1.22.0". */
  version: string;
  /** Every transport resource the context opened, as "transport/device" ("cma/memory", "tcp/eth0"). */
  transports: string[];
  /** The memory types it serves ("host", and "cuda" where its CUDA transports loaded). */
  memoryTypes: string[];
}

const ucxInfoCache = new Map<string, UcxInfo>();

/**
 * The UCX version, transports and memory types of this process; `transports` (as UCX_TLS, e.g.
 * "tcp,self") narrows them as an agent's option would. A context is opened and closed to read
 * them, once per transport list; later calls return the same object.
 */
export function ucxInfo(transports = ""): UcxInfo {
  let info = ucxInfoCache.get(transports);
  if (info === undefined) {
    info = call(() => addon.ucxInfo(transports));
    ucxInfoCache.set(transports, info);
  }
  return info;
}

/** One line for logs and tables: "UCX 1.22.0 (self, tcp, sysv, posix, cma; host)". */
export function describeUcx(info: UcxInfo = ucxInfo()): string {
  const tls = [...new Set(info.transports.map((t) => t.split("/")[0]))];
  return `UCX ${info.version} (${tls.join(", ")}; memory: ${info.memoryTypes.join(", ")})`;
}

// --- public types ------------------------------------------------------------

/** `none`: no error handling (keeps shared-memory transports); `peer`: UCX reports peer failure. */
export type ErrorMode = "none" | "peer";
export type EndpointState = "connected" | "failed" | "closed";

/**
 * Descriptors: one typed array of (localOffset, remoteOffset, length) triples.
 * A Float64Array (integers up to 2^53), a BigUint64Array, or a Uint8Array view
 * of little-endian float64 triples (8-byte aligned).
 */
export type Descriptors = Float64Array | BigUint64Array | Uint8Array;

export interface AgentOptions {
  /** Sent with every notification as the sender's identity. Default: random. */
  name?: string;
  /** UCX transport list (as UCX_TLS), e.g. "shm,self" or "tcp". Default: UCX's choice. */
  transports?: string;
  /** UCX network devices (as UCX_NET_DEVICES), e.g. "veth0". Default: all. */
  netDevices?: string;
  /** Spin on the worker instead of sleeping on its event fd. */
  busyPoll?: boolean;
  /**
   * Who progresses the UCX worker. `thread` (default): the agent's own progress thread, so
   * transfers move while JavaScript is busy and posting 100 000 descriptors never blocks the
   * event loop. `caller`: no thread; each write, read or notification is posted inside the call
   * that makes it, and nothing else happens until the caller calls `agent.progress()`, which
   * progresses the worker and settles what completed, on the JavaScript thread (as NIXL's Python
   * loop does). For latency-critical callers that poll: no thread hand-off, no wake-up.
   */
  progress?: "thread" | "caller";
  /**
   * After any activity, keep polling this many microseconds before sleeping
   * (the reply to what was just sent usually comes within it; waking a
   * sleeping thread costs milliseconds on a VM). Default 0.
   */
  spinUs?: number;
  /** Largest notification accepted or sent. Default 4 MiB. */
  maxNotificationBytes?: number;
}

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

export interface Notification {
  /** The sending agent's name. */
  peer: string;
  data: Buffer;
  /** When this agent's progress thread received it (monoUs()). */
  receivedUs: number;
  /** When it reached JavaScript (monoUs()). */
  deliveredUs: number;
}

/**
 * When a write, read or notification passed each step, in microseconds of CLOCK_MONOTONIC
 * (monoUs(); comparable between processes of one host); 0: the step did not happen (a
 * notification posts nothing and flushes nothing; a write without one notifies nothing).
 */
export interface OpTrace {
  /** Handed from the JavaScript thread to the progress thread. */
  submittedUs: number;
  /** Taken by the progress thread. */
  startedUs: number;
  /** First put/get posted. */
  firstPostUs: number;
  /** Last put/get posted. */
  postedUs: number;
  /** Flush complete: every byte remotely complete. */
  flushedUs: number;
  /** The notification's send completed. */
  notifiedUs: number;
  /** The completion queued for JavaScript. */
  completedUs: number;
  /** The completion reached JavaScript. */
  deliveredUs: number;
}

const MONO_OFFSET_US = Number(process.hrtime.bigint() / 1000n) - performance.now() * 1000;

/**
 * Microseconds of CLOCK_MONOTONIC, the clock of OpTrace and Notification timestamps: comparable
 * between processes of one host (not between hosts).
 */
export function monoUs(): number {
  return Math.round(performance.now() * 1000 + MONO_OFFSET_US);
}

export interface AgentEvents {
  /** A batch of notifications, in arrival order. */
  notifications: [batch: Notification[]];
  /** An endpoint failed; every operation on it has been or will be rejected. */
  endpointFailed: [endpoint: Endpoint, code: string];
  /** A notification was refused unread: larger than maxNotificationBytes, or not eager. */
  notificationDropped: [peer: string, bytes: number];
}

const NAME_MAX = 200;

function check(cond: boolean, code: string, message: string): asserts cond {
  if (!cond) throw new KvxferError(code, message);
}

function isBytes(v: unknown): v is Uint8Array {
  return v instanceof Uint8Array;
}

/** Runs a native call, turning what it throws into a KvxferError. */
function call<T>(fn: () => T): T {
  try {
    return fn();
  } catch (err) {
    throw KvxferError.from(err);
  }
}

/**
 * Awaits a native promise; a rejection becomes a KvxferError. Its stack reaches the caller through
 * V8's async stack traces ("at async ..." for each awaiting function), which cost nothing until an
 * error is made: capturing a stack at every call was 4-8% of a sidecar's JavaScript thread.
 */
async function settle(promise: Promise<Float64Array>): Promise<OpTrace> {
  try {
    return toTrace(await promise);
  } catch (err) {
    throw KvxferError.from(err);
  }
}

/**
 * An operation's steps as the addon reports them: a Float64Array in OpTrace's order (one
 * allocation per completion in native code, where an object cost a property set per step).
 */
function toTrace(t: Float64Array): OpTrace {
  return {
    submittedUs: t[0]!,
    startedUs: t[1]!,
    firstPostUs: t[2]!,
    postedUs: t[3]!,
    flushedUs: t[4]!,
    notifiedUs: t[5]!,
    completedUs: t[6]!,
    deliveredUs: t[7]!,
  };
}

// --- handles -----------------------------------------------------------------

/** Local memory registered with an agent. */
export class Region {
  /** @internal */
  constructor(
    readonly agent: Agent,
    /** @internal */ readonly native: NativeRegion,
  ) {}

  get length(): number {
    return this.native.length;
  }
  get address(): bigint {
    return this.native.address;
  }
  /** What the memory is: host, CUDA device or CUDA host-pinned. */
  get memoryType(): MemoryType {
    return this.native.memoryType;
  }
  /** The CUDA device of a `cuda` or `cuda-host` region, or null. */
  get device(): number | null {
    return this.native.device;
  }
  /** The shared-memory file this region maps, or null for a registered Buffer. */
  get path(): string | null {
    return this.native.path;
  }
  /**
   * The id of the SysV shared-memory segment this region is (memory `allocate()` got from
   * UCX's sysv memory domain, narrowed to mode 0600; or a segment `attachSegment()` attached),
   * or null.
   */
  get segment(): number | null {
    return this.native.segment;
  }
  get closed(): boolean {
    return this.native.closed;
  }
  /** The packed remote key a peer needs to WRITE to or READ from this region. */
  remoteKey(): Buffer {
    return call(() => this.native.remoteKey());
  }
  /**
   * The region's bytes (for a mapped file: detached when the region closes). CUDA device memory
   * has none the CPU can read: ERR_MEMORY_TYPE.
   */
  bytes(): Uint8Array {
    const v = call(() => this.native.view());
    return v instanceof ArrayBuffer ? new Uint8Array(v) : (v as Uint8Array);
  }
  /** Idempotent; the memory is unregistered once no transfer uses it. */
  close(): void {
    this.native.close();
  }
}

/**
 * A write or read checked once by `agent.prepare()` and posted again and again: `post()` hands it
 * over with no argument check, no promise and no allocation, and `state` says where it is, as a
 * NIXL transfer handle is reposted and its state polled. With caller progress, nothing moves
 * unless the caller calls `agent.progress()`. The handles it names stay open until it closes.
 */
export class PreparedTransfer {
  /** @internal */
  constructor(
    readonly agent: Agent,
    /** @internal */ readonly native: NativePrepared,
  ) {}

  /**
   * Posts the transfer. ERR_BUSY while the last post is in flight; ERR_CLOSED once it or its
   * agent is closed; the endpoint's failure once it failed.
   */
  post(): void {
    call(() => this.native.post());
  }

  /**
   * `idle` (never posted), `pending` (in flight), `done` (the last post completed: every byte
   * remotely complete for a write, local for a read). A failed post throws its error here, each
   * time it is asked until the next post.
   */
  get state(): "idle" | "pending" | "done" {
    const s = this.native.state();
    if (s === 1) return "pending";
    if (s === 0) return "done";
    if (s === 2) return "idle";
    if (s === -10000)
      throw new KvxferError(
        "ERR_CLOSED",
        "the prepared transfer was lost (its endpoint abandoned or its agent closed mid-flight)",
      );
    throw KvxferError.from(
      Object.assign(new Error(`the prepared transfer failed: UCX status ${s}`), {
        code: addon.ucsStatusName(s),
        ucsStatus: s,
      }),
    );
  }

  /** Idempotent; once it is not in flight, the handles it named are released. */
  close(): void {
    this.native.close();
  }
}

/** A peer's region, imported on one endpoint. */
export class RemoteRegion {
  /** @internal */
  constructor(
    readonly endpoint: Endpoint,
    /** @internal */ readonly native: NativeRemoteRegion,
  ) {}
  get length(): number {
    return this.native.length;
  }
  close(): void {
    this.native.close();
  }
}

/** A connection to one peer agent. */
export class Endpoint {
  /** @internal */
  constructor(
    readonly agent: Agent,
    /** @internal */ readonly native: NativeEndpoint,
    readonly errorMode: ErrorMode,
  ) {}

  get id(): number {
    return this.native.id;
  }
  get state(): EndpointState {
    return this.native.state;
  }
  /**
   * Imports a peer's region from the remote key its Region.remoteKey() produced. `populate`:
   * when UCX maps the peer's region into this process (shared-memory transports, memory the
   * peer allocated through UCX), its pages are faulted in now instead of by the first WRITEs.
   */
  importRemote(remoteKey: Uint8Array, options: { populate?: boolean } = {}): RemoteRegion {
    check(isBytes(remoteKey), "ERR_INVALID_ARGUMENT", "importRemote: remoteKey must be a Buffer");
    return new RemoteRegion(
      this,
      call(() => this.native.importRemote(remoteKey, options.populate ?? false)),
    );
  }
  /** Idempotent; the endpoint is closed once no transfer uses it. */
  close(): void {
    this.native.close();
    this.agent.forget(this);
  }
  /**
   * Gives up on the peer: every transfer on this endpoint rejects now with
   * `UCS_ERR_CONNECTION_RESET` and the endpoint is `failed`. For a peer known to be dead whose
   * operations UCX (error mode none) would never complete; UCX's own requests are left to run
   * out, and the worker is not destroyed at close while any remain.
   */
  abandon(): void {
    this.native.abandon();
  }
}

/** One UCX context and worker, driven by its own progress thread. */
export class Agent extends EventEmitter<AgentEvents> {
  readonly name: string;
  private readonly native: NativeAgent;
  private readonly endpoints = new Map<number, Endpoint>();
  private closedFlag = false;
  private closingFlag = false;

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
            spinUs: options.spinUs ?? 0,
            maxNotificationBytes,
          },
          (batch) => this.onNativeEvents(batch),
        ),
    );
  }

  /** This agent's worker address, for a peer's connect(). */
  get address(): Buffer {
    return call(() => this.native.address);
  }
  /** Operations (transfers and notifications) in flight. */
  get inflight(): number {
    return this.native.inflight;
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
    return new PreparedTransfer(
      this,
      call(() =>
        this.native.prepare(
          kind === "write" ? 0 : 1,
          ep.native,
          local.native,
          remote.native,
          descriptors,
          notification,
        ),
      ),
    );
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
      } else {
        const ep = this.endpoints.get(ev.endpointId);
        if (ep !== undefined) this.emit("endpointFailed", ep, ev.code);
      }
    }
    if (notes !== undefined) this.emit("notifications", notes);
  }
}
