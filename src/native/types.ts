/**
 * The addon's public types that are plain data: what memory a region is, what UCX offers, an
 * agent's options, a descriptor array, a notification and an operation's trace.
 */

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
   * With the progress thread (the default): a small write, read or notification (at most 64
   * descriptors and 256 KiB) is posted by the calling thread itself, under the worker's lock, when
   * the progress thread is not inside the worker and nothing is queued before it; an operation
   * that completes at once (shared memory, most small ones) then never crosses threads. What
   * does not complete goes on with the progress thread. Its promise settles as always, in a later
   * turn of the event loop. Default true; false hands every operation to the thread.
   */
  inlinePost?: boolean;
  /**
   * With the progress thread (the default): the event loop also watches the worker's event fd
   * and, when it fires, progresses the worker itself (when the progress thread is not inside it)
   * and delivers what arrived (notifications, completions) in that same turn, instead of waiting
   * for the progress thread to wake and hand it over: one wake-up on the path of a notification
   * or an answer, not two in a row. The progress thread still watches too, so transfers move
   * while JavaScript is busy. Default false: an event then wakes two threads of the receiving
   * process, and in a sidecar pair on two cores that delayed the writer's own completion
   * (docs/native.md, "The event loop's watch on the worker").
   */
  loopWake?: boolean;
  /**
   * After any activity, keep polling this many microseconds before sleeping
   * (the reply to what was just sent usually comes within it; waking a
   * sleeping thread costs milliseconds on a VM). Default 0.
   */
  spinUs?: number;
  /**
   * TCP transports: give a connection up once bytes it sent stay unacknowledged this long
   * (TCP_USER_TIMEOUT, as UCX_TCP_USER_TIMEOUT; that variable, when set, wins). Its operations
   * then fail instead of resuming at TCP's next backed-off retransmission after a partition
   * heals (up to two minutes later). Default 0: UCX's default (the kernel's).
   */
  tcpUserTimeoutMs?: number;
  /** Largest notification accepted or sent. Default 4 MiB. */
  maxNotificationBytes?: number;
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
