/**
 * The handles an Agent makes: its registered memory (Region), the peers it connects to
 * (Endpoint), their memory imported on one endpoint (RemoteRegion), and transfers checked once to
 * be posted again and again (PreparedTransfer).
 */
import { KvxferError } from "../errors.js";
import {
  addon,
  call,
  check,
  isBytes,
  type NativeEndpoint,
  type NativePrepared,
  type NativeRegion,
  type NativeRemoteRegion,
} from "./addon.js";
import type { EndpointState, ErrorMode, MemoryType } from "./types.js";

/**
 * The agent that made a handle, as the handle sees it. The Agent class (agent.ts) is the one
 * owner; the handles name only this, so that they need nothing of the Agent's module.
 */
export interface HandleOwner {
  /** Sent with every notification as the sender's identity. */
  readonly name: string;
  /** @internal An endpoint closed: the agent stops reporting its failures. */
  forget(ep: Endpoint): void;
  /** @internal A number for one settle of an endpoint and the promise its event resolves. */
  awaitSettle(): { seq: number; settled: Promise<string> };
  /** @internal The settle `seq` needs no event: resolve it with `code` now. */
  settleNow(seq: number, code: string): void;
}

/** Local memory registered with an agent. */
export class Region {
  /** @internal */
  constructor(
    readonly agent: HandleOwner,
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
    readonly agent: HandleOwner,
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
    readonly agent: HandleOwner,
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
    if (this.abandonedSettle !== undefined) return;
    const { seq, settled } = this.agent.awaitSettle();
    this.abandonedSettle = settled;
    if (!this.native.abandon(seq)) this.agent.settleNow(seq, "UCS_OK");
  }

  /** `abandon()` was called: the reads and writes on it failed before UCX finished them. */
  get abandoned(): boolean {
    return this.abandonedSettle !== undefined;
  }

  /**
   * Resolves once UCX holds no operation posted on this endpoint so far: none of their bytes can
   * land any more (after `abandon()`: once the abandoned ones are over; over TCP they wait in the
   * old connection until the link comes back). With the flush's status name (`UCS_OK`, or why it
   * failed: the endpoint failed, which ends its operations too; `ERR_CLOSED`: the agent closed).
   * Resolves at once for an endpoint closed with nothing in flight. In error mode none on a link
   * that never comes back it never resolves: bound the wait.
   */
  settled(): Promise<string> {
    if (this.abandonedSettle !== undefined) return this.abandonedSettle;
    const { seq, settled } = this.agent.awaitSettle();
    if (!this.native.settle(seq)) this.agent.settleNow(seq, "UCS_OK");
    return settled;
  }

  private abandonedSettle?: Promise<string>;
}
