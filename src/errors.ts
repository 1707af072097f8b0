/**
 * kvxfer's error class and the catalogue of its error codes. Every layer may
 * import this module (it imports nothing); `src/native/index.ts` re-exports
 * `KvxferError` as part of the addon's public face.
 */

/**
 * The one error class of kvxfer. `code` is stable (tests and callers match on
 * it, never on message text); `ucsStatus` is the numeric UCX status when UCX
 * produced the failure.
 */
export class KvxferError extends Error {
  override readonly name = "KvxferError";
  readonly code: string;
  readonly ucsStatus: number | undefined;

  constructor(
    code: string,
    message: string,
    options: { ucsStatus?: number; cause?: unknown } = {},
  ) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.code = code;
    this.ucsStatus = options.ucsStatus;
  }

  /**
   * Converts anything thrown by the addon into a KvxferError (a KvxferError
   * is returned as is). Made inside an async function, its stack continues
   * through the functions awaiting it.
   */
  static from(err: unknown): KvxferError {
    if (err instanceof KvxferError) return err;
    const e = err as { code?: unknown; message?: unknown; ucsStatus?: unknown } | null;
    const code = typeof e?.code === "string" ? e.code : "ERR_INTERNAL";
    const message = typeof e?.message === "string" ? e.message : String(err);
    const ucsStatus = typeof e?.ucsStatus === "number" ? e.ucsStatus : undefined;
    return new KvxferError(
      code,
      message,
      ucsStatus === undefined ? { cause: err } : { ucsStatus, cause: err },
    );
  }
}

/** True when `err` is a KvxferError with the given code. */
export function hasCode(err: unknown, code: string): boolean {
  return err instanceof KvxferError && err.code === code;
}

/**
 * Every `ERR_*` code kvxfer emits (TypeScript in src/ and the addon in
 * native/src), with what it means. The codes reach callers as
 * `KvxferError.code`, in `Refused` answers on the engine link, in peer
 * `Failed` messages and handshake refusals, in events' `reason`, and in the
 * simulated engine's JSON lines. UCX's own statuses come as their UCX names
 * (`UCS_ERR_*`) and are not listed. docs/api.md ("Error codes") has the same
 * table with details; test/errors-catalogue.test.ts keeps the source, this
 * catalogue and that table in step.
 */
export const ERROR_CODES = {
  ERR_ABORTED: "the transfer was aborted, by an engine or by the peer, before it finished",
  ERR_ALLOCATE_REFUSED: "simulated engine: the sidecar refused its AllocateKv",
  ERR_ALLOCATE_TIMEOUT: "vLLM connector: no sidecar answered its AllocateKv in time",
  ERR_ALREADY_REGISTERED:
    "a registration was already accepted: RegisterKvCache again from its connection, or AllocateKv",
  ERR_BAD_ADDRESS:
    "an address kvxfer cannot parse: a side channel host:port or a UCX worker address",
  ERR_BAD_BLOCKS: "block ids that do not fit the layout or the token count",
  ERR_BAD_ENGINE_ID: "an engine id that is malformed, or not this sidecar's",
  ERR_BAD_LAYERS:
    "a layer-wise PrefillDone or a LayersSaved that does not fit the registered layout or the transfer",
  ERR_BAD_LAYOUT: "RegisterKvCache carries a layout that fails validation",
  ERR_BAD_REGIONS: "RegisterKvCache's ranks or region files do not match the layout",
  ERR_BAD_REMOTE_KEY: "a remote key that is not a kvxfer remote key",
  ERR_BAD_SOURCE: "ExpectKv's source (P's side channel) is empty or too long",
  ERR_BAD_TOKENS: "token counts that are zero, inconsistent, or differ between P and D",
  ERR_BAD_TRANSFER_ID:
    "a transfer id that is empty, too long, or holds a character outside printable ASCII other than space (U+0021..U+007E)",
  ERR_BAD_TRANSFER_TOKEN:
    "a transfer token that is too long, or not the one the transfer was given",
  ERR_BIND: "the engine link cannot bind its endpoint",
  ERR_BLOCKS_IN_USE: "blocks that a live transfer already holds",
  ERR_BUSY: "a prepared transfer posted again while its last post is still in flight",
  ERR_CLOSED:
    "the object is closed or shutting down (agent, handle, engine link, event log, server)",
  ERR_CONFIG: "a setting (flag, KVXFER_* variable, config file, certificate) is refused",
  ERR_CONNECT: "vLLM connector: the engine link cannot connect to the sidecar's socket",
  ERR_CUDA:
    "a CUDA driver call failed (an IPC handle that does not open, memory on another device, out of device memory)",
  ERR_CUDA_DEVICE:
    "vLLM connector: a KV cache device that is not in CUDA_VISIBLE_DEVICES, or not readable",
  ERR_CUDA_IPC: "vLLM connector: GPU KV memory that exports no CUDA IPC handle kvxfer can use",
  ERR_CUDA_UNAVAILABLE:
    "CUDA memory asked for where there is no usable CUDA driver or no such device",
  ERR_DESC_MISALIGNED: "a descriptor byte view that does not start on an 8-byte boundary",
  ERR_DESC_TRUNCATED: "descriptors that are not a whole number of triples",
  ERR_DESC_TYPE: "descriptors that are not one of the accepted typed arrays",
  ERR_DRAINING: "the sidecar is draining (SIGTERM): no new transfers or handshakes",
  ERR_DUPLICATE: "a transfer id that is already live, or a second registration for one transfer",
  ERR_ENDED: "a push registration for a transfer that has already ended on P",
  ERR_ENDPOINT_MISMATCH: "a remote region used on another endpoint than the one it was imported on",
  ERR_ENGINE_LINK_TAKEN:
    "RegisterKvCache refused for now: another live connection owns this sidecar's engine link",
  ERR_ENGINE_SOCKET_IN_USE: "another live process holds the engine link's ipc socket",
  ERR_FELL_BEHIND: "a watcher did not read while too many live events waited for it",
  ERR_FILE: "an I/O error on a KV region file, other than a missing file",
  ERR_INTERNAL: "an error that carried no code of its own",
  ERR_INVALID_ARGUMENT: "an argument or request field is wrong (type, empty, unknown name, limit)",
  ERR_INVALID_LENGTH: "a zero, negative or non-integer length",
  ERR_INVALID_OFFSET: "a negative, non-integer or NaN offset",
  ERR_LAYOUT_INCOMPATIBLE: "two valid layouts cannot exchange KV",
  ERR_LAYOUT_INVALID: "a layout is malformed on its own",
  ERR_LAYOUT_MISMATCH:
    "vLLM connector: KV cache tensors whose shapes or strides do not match the model",
  ERR_LAYOUT_UNSUPPORTED:
    "vLLM connector: an attention backend or KV cache group kvxfer cannot map",
  ERR_LEASE_EXPIRED: "P's lease on the blocks ran out before D was done",
  ERR_LISTEN:
    "the sidecar cannot listen on --listen, --grpc or --metrics (port taken, not allowed, not this machine's address)",
  ERR_MALFORMED: "a frame or message that does not parse, or lacks a part it needs",
  ERR_MEMORY_TYPE:
    "an operation the region's memory type does not allow (a CPU view of CUDA memory)",
  ERR_MEMORY_TYPE_UNSUPPORTED:
    "a memory type the running UCX cannot serve (cuda without UCX's cuda transports or a driver)",
  ERR_NATIVE_MISSING: "the native addon is not built, or the package root is not found",
  ERR_NEEDS_NEW_SIDECAR:
    "RegisterKvCache refused: a new engine process registers other memory than the gone one",
  ERR_NOTIFICATION_TOO_LARGE: "a notification above the agent's maxNotificationBytes",
  ERR_NOT_FOUND: "the transfer's terminal event has been dropped from the event log",
  ERR_NOT_ON_DEVICE: "vLLM connector: placement 'device' with a KV cache that is not in GPU memory",
  ERR_NOT_OWNER: "a transfer message from a connection that does not own the engine link",
  ERR_NOT_READY: "a handshake before this sidecar's engine has registered",
  ERR_NOT_REGISTERED: "a transfer message before the engine registered its KV cache",
  ERR_NOT_SHARED: "vLLM connector: a KV cache tensor outside the shared memory kvxfer allocated",
  ERR_NO_SEGMENT:
    "UCX allocated KV memory outside SysV shared memory, which an engine cannot attach",
  ERR_NO_SOURCE_BLOCKS: "a pull without ExpectKv.source_block_ids",
  ERR_NO_SUCH_FILE: "a KV region file that does not exist",
  ERR_NO_SUCH_SEGMENT: "a SysV shared-memory segment id that does not exist",
  ERR_OUT_OF_BOUNDS: "a range that leaves its region, or a file shorter than offset + length",
  ERR_OUT_OF_RANGE: "a sequence number outside the event log (too new, or events dropped)",
  ERR_OVERLOADED:
    "a capacity limit is reached (live transfers, peers, registrations before prefill, notifications)",
  ERR_PEER_DOWN: "the peer sidecar went down while the transfer was live",
  ERR_PLAN_INVALID: "a transfer request that does not fit the layouts",
  ERR_PROMPT_MISMATCH: "P's KV is for another prompt than D's (kvxfer_prompt_digest)",
  ERR_REGION_CHANGED: "a KV region file was replaced between its check and its open",
  ERR_REGION_NOT_REGULAR: "a KV region path that is not a regular file with one link",
  ERR_REGION_OUTSIDE: "a KV region path that is relative, has '..', or is not under --kv-dir",
  ERR_REGION_OWNER: "a KV region file, or a folder on its way, not owned by the sidecar's uid",
  ERR_REGION_SYMLINK: "a symbolic link on the way to a KV region file",
  ERR_REGION_TOO_LARGE: "a registration that maps more than the sidecar's caps allow",
  ERR_REGISTER_REFUSED: "simulated engine: the sidecar refused its RegisterKvCache",
  ERR_REGISTER_TIMEOUT: "simulated engine: no sidecar answered its RegisterKvCache in time",
  ERR_REPLAY: "a peer message whose sequence number was already seen",
  ERR_SEGMENT: "a SysV shared-memory segment that cannot be attached or narrowed to its owner",
  ERR_SEGMENT_PERMISSIONS:
    "a SysV shared-memory segment of another user, or not owner-only (mode 0600)",
  ERR_SEND_FAILED: "the engine link's send queue is full",
  ERR_SHM_FULL: "vLLM connector: the shared-memory folder cannot hold the KV cache",
  ERR_STALE_EPOCH: "a peer message from an earlier epoch of that peer",
  ERR_STATE: "the engine link was started twice",
  ERR_TIMEOUT: "something did not happen within its deadline",
  ERR_TOO_LARGE: "a frame or message above its size cap",
  ERR_TOO_MANY_WAITERS: "too many AwaitTransfer calls or WatchEvents streams at once",
  ERR_UNAUTHENTICATED:
    "a peer without valid credentials, or a peer message whose MAC does not check",
  ERR_UNKNOWN_TRANSFER: "a transfer id that is not known here",
  ERR_UNREACHABLE: "a side channel that cannot be reached, or gave no answer in time",
  ERR_VLLM_VERSION: "vLLM connector: a vLLM release the connector does not support",
  ERR_WRONG_AGENT: "a handle that belongs to another agent",
  ERR_WRONG_ROLE: "a message for the other role (PrefillDone to a decode sidecar, ...)",
} as const;

/** A code in the catalogue. */
export type ErrorCode = keyof typeof ERROR_CODES;

/**
 * The code of an error carried as text ("<code>: what happened", as `Registered.error`), for
 * deciding by code, never by the words after it; "" when the text does not start with a code.
 */
export function errorCode(error: string): string {
  return /^(ERR_[A-Z0-9_]+)(?::|$)/.exec(error)?.[1] ?? "";
}
