/**
 * The raw addon: the shape of what the `.node` file exports, the one place it is loaded, and how
 * a call into it is checked and its errors become KvxferErrors. Only the modules of src/native
 * use it; everything else uses what index.ts hands on.
 */
import { existsSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { KvxferError } from "../errors.js";
import type { Descriptors, EndpointState, ErrorMode, MemoryType, UcxInfo } from "./types.js";

export interface NativeRegion {
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

export interface NativePrepared {
  post(): void;
  state(): number;
  close(): void;
}

export interface NativeRemoteRegion {
  readonly length: number;
  close(): void;
}

export interface NativeEndpoint {
  readonly id: number;
  readonly state: EndpointState;
  importRemote(key: Uint8Array, populate?: boolean): NativeRemoteRegion;
  close(): void;
  /** With `seq`: true when an `endpointSettled` event with it follows. */
  abandon(seq?: number): boolean;
  /** True when an `endpointSettled` event with `seq` follows (false: closed). */
  settle(seq: number): boolean;
}

export type NativeEvent =
  | { type: "notification"; peer: string; data: Buffer; receivedUs: number; deliveredUs: number }
  | { type: "endpointFailed"; endpointId: number; code: string; ucsStatus: number }
  | { type: "notificationDropped"; peer: string; bytes: number }
  | { type: "endpointSettled"; endpointId: number; seq: number; code: string }
  | { type: "prepared"; done: NativePrepared[]; failed: NativePrepared[] };

export interface NativeAgent {
  readonly address: Buffer;
  readonly name: string;
  readonly inflight: number;
  readonly inlinePosts: number;
  readonly loopTurns: number;
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
  /** Whether returned prepared transfers are reported as `prepared` events. */
  watchPrepared(on: boolean): void;
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

export interface NativeAddon {
  Agent: new (
    options: {
      name: string;
      transports: string;
      netDevices: string;
      busyPoll: boolean;
      progress: "thread" | "caller";
      inlinePost: boolean;
      loopWake: boolean;
      spinUs: number;
      tcpUserTimeoutMs: number;
      maxNotificationBytes: number;
    },
    onEvents: (batch: NativeEvent[]) => void,
  ) => NativeAgent;
  MacKey: new (key: Uint8Array) => {
    sign(message: Uint8Array): Buffer;
    verify(message: Uint8Array, mac: Uint8Array): boolean;
  };
  ucxVersion: string;
  ucxInfo(transports?: string): UcxInfo;
  ucsStatusName(status: number): string;
  /**
   * Whether the workaround for UCX 1.22's software GET replies is in place (native/src/ucx_fix.cc):
   * "installed (N GET replies primed)", or why not.
   */
  ucxGetReplyFix(): string;
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

export const addon = loadAddon();

export function check(cond: boolean, code: string, message: string): asserts cond {
  if (!cond) throw new KvxferError(code, message);
}

export function isBytes(v: unknown): v is Uint8Array {
  return v instanceof Uint8Array;
}

/** Runs a native call, turning what it throws into a KvxferError. */
export function call<T>(fn: () => T): T {
  try {
    return fn();
  } catch (err) {
    throw KvxferError.from(err);
  }
}
