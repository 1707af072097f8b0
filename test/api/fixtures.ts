/**
 * A small SidecarView over real data for the API tests: transfers move through
 * their states and each one that ends appends its terminal event to a real
 * EventLog, as the sidecar does. (The real sidecar replaces it when wired.)
 */
import type { EventLog } from "../../src/sidecar/event-log.js";
import type {
  PeerInfo,
  SidecarEvent,
  SidecarStatus,
  SidecarView,
  TerminalKind,
  TransferFilter,
  TransferInfo,
  TransferMode,
  TransferSide,
  TransferState,
} from "../../src/sidecar/view.js";

interface MutableTransfer {
  transferId: string;
  side: TransferSide;
  mode: TransferMode | "";
  state: TransferState;
  peer: string;
  bytes: number;
  descriptors: number;
  reason: string;
  timings: {
    registeredMs: number;
    prefillDoneMs: number;
    dataStartedMs: number;
    dataDoneMs: number;
    readyMs: number;
    endedMs: number;
  };
  trace: { hop: string; us: number }[];
}

export class FixtureSidecar implements SidecarView {
  readonly epoch = 0x1234_5678_9abc_def0n;
  readonly startedMs = Date.now();
  draining = false;
  private readonly table = new Map<string, MutableTransfer>();
  private readonly peers: PeerInfo[] = [
    {
      engineId: "prefill-0",
      epoch: 7n,
      state: "connected",
      lastSeenMs: Date.now(),
      sideChannel: "127.0.0.1:5555",
    },
  ];
  bytesMoved = 0;
  transfersMoved = 0;

  constructor(readonly events: EventLog) {}

  status(): SidecarStatus {
    const byState: Record<string, number> = {};
    for (const t of this.table.values()) byState[t.state] = (byState[t.state] ?? 0) + 1;
    return {
      engineId: "decode-0",
      epoch: this.epoch,
      role: "decode",
      mode: "auto",
      tpSize: 2,
      layoutSummary: "32 layers, 8 KV heads x 128, bfloat16, block 16, HND",
      startedMs: this.startedMs,
      draining: this.draining,
      ucx: { version: "1.22.0", transports: ["cma/memory", "tcp/lo"], memoryTypes: ["host"] },
      peers: this.peers,
      transfersByState: byState,
      bytesMoved: this.bytesMoved,
      transfersMoved: this.transfersMoved,
      leaseTableSize: 0,
      lastErrors: ["peer prefill-1: connection reset"],
    };
  }

  transfers(filter: TransferFilter = {}): TransferInfo[] {
    const out: TransferInfo[] = [];
    for (const t of this.table.values()) {
      if (filter.states !== undefined && !filter.states.includes(t.state)) continue;
      if (filter.peer !== undefined && t.peer !== filter.peer) continue;
      out.push({ ...t, timings: { ...t.timings }, trace: [...t.trace] });
    }
    return out;
  }

  /** A transfer D expects from `peer`. */
  start(transferId: string, peer = "prefill-0", mode: TransferMode = "pull"): void {
    const now = Date.now();
    this.table.set(transferId, {
      transferId,
      side: "decode",
      mode,
      state: "WAITING",
      peer,
      bytes: 0,
      descriptors: 0,
      reason: "",
      timings: {
        registeredMs: now,
        prefillDoneMs: 0,
        dataStartedMs: 0,
        dataDoneMs: 0,
        readyMs: 0,
        endedMs: 0,
      },
      trace: [{ hop: "engine.expectKv", us: now * 1000 }],
    });
  }

  moving(transferId: string): void {
    const t = this.must(transferId);
    t.state = "MOVING";
    t.timings.prefillDoneMs = t.timings.dataStartedMs = Date.now();
  }

  /** Ends a transfer: state, timings, one terminal event in the log. */
  end(transferId: string, kind: TerminalKind, bytes = 4096, reason = ""): SidecarEvent {
    const t = this.table.get(transferId) ?? (this.start(transferId), this.must(transferId));
    const now = Date.now();
    t.state = kind;
    t.bytes = bytes;
    t.descriptors = 4;
    t.reason = reason;
    t.timings.dataDoneMs = t.timings.readyMs = t.timings.endedMs = now;
    if (kind === "KV_READY") {
      this.bytesMoved += bytes;
      this.transfersMoved++;
    }
    // Tombstones are bounded in the real sidecar; here the table is dropped by tests.
    return this.events.append({
      kind,
      timeMs: now,
      transferId,
      peer: t.peer,
      side: t.side,
      reason,
      bytes,
      mode: t.mode === "auto" ? "pull" : t.mode,
    });
  }

  forget(transferId: string): void {
    this.table.delete(transferId);
  }

  private must(id: string): MutableTransfer {
    const t = this.table.get(id);
    if (t === undefined) throw new Error(`no transfer ${id}`);
    return t;
  }
}

/** The rejection of `p` (fails when it resolves), bounded. */
export async function rejection(
  p: Promise<unknown>,
  timeoutMs = 10_000,
): Promise<{ code?: number; details?: string; message: string }> {
  let timer: NodeJS.Timeout | undefined;
  try {
    await Promise.race([
      p,
      new Promise((_, reject) => {
        timer = setTimeout(
          () => reject(new Error(`still pending after ${timeoutMs} ms`)),
          timeoutMs,
        );
      }),
    ]);
  } catch (err) {
    if (err instanceof Error && err.message.startsWith("still pending")) throw err;
    return err as { code?: number; details?: string; message: string };
  } finally {
    clearTimeout(timer);
  }
  throw new Error("expected a rejection, got a result");
}
