/**
 * Between the sidecar's view types (src/sidecar/view.ts) and the gRPC
 * messages: the server converts view -> proto, the client proto -> view. The
 * one place enum names are mapped.
 */
import { create, type MessageInitShape } from "@bufbuild/protobuf";
import { Role } from "../gen/kvxfer/v1/peer_pb.js";
import {
  type Event,
  EventKind as PbEventKind,
  EventSchema,
  type GetStatusResponse,
  GetStatusResponseSchema,
  PeerState,
  type Transfer,
  TransferMode as PbTransferMode,
  TransferSchema,
  TransferSide as PbTransferSide,
  TransferState as PbTransferState,
} from "../gen/kvxfer/v1/sidecar_pb.js";
import { watchEventsResponseToBinary } from "../gen/kvxfer/v1/sidecar_binary.js";
import type {
  EventKind,
  SidecarEvent,
  SidecarRole,
  SidecarStatus,
  TransferInfo,
  TransferMode,
  TransferSide,
  TransferState,
} from "../sidecar/view.js";

/** Two-way map between string names and enum numbers; unknown names/numbers give undefined. */
export class EnumMap<N extends string, E extends number> {
  private readonly toNum = new Map<string, E>();
  private readonly toName = new Map<number, N>();
  /**
   * Each name maps to the member of the protobuf enum `pb` with the same name
   * in capitals ("prefill" -> PREFILL); `names` keeps its order in `names()`.
   */
  constructor(names: readonly N[], pb: Readonly<Record<string, string | number>>) {
    for (const n of names) {
      const e = pb[n.toUpperCase()];
      if (typeof e !== "number") throw new Error(`no enum member ${n.toUpperCase()}`);
      this.toNum.set(n, e as E);
      this.toName.set(e, n);
    }
  }
  num(name: string): E | undefined {
    return this.toNum.get(name);
  }
  name(num: number): N | undefined {
    return this.toName.get(num);
  }
  names(): N[] {
    return [...this.toNum.keys()] as N[];
  }
}

export const eventKinds = new EnumMap<EventKind, PbEventKind>(
  ["KV_READY", "FAILED", "EXPIRED", "ABORTED", "RELEASED", "PEER_UP", "PEER_DOWN"],
  PbEventKind,
);

export const transferStates = new EnumMap<TransferState, PbTransferState>(
  [
    "WAITING",
    "HELD",
    "MOVING",
    "CONFIRMING",
    "ABORTING",
    "DRAINING",
    "KV_READY",
    "FAILED",
    "EXPIRED",
    "ABORTED",
    "RELEASED",
  ],
  PbTransferState,
);

export const transferSides = new EnumMap<TransferSide, PbTransferSide>(
  ["prefill", "decode"],
  PbTransferSide,
);

export const transferModes = new EnumMap<TransferMode, PbTransferMode>(
  ["push", "pull", "auto"],
  PbTransferMode,
);

const roles = new EnumMap<SidecarRole, Role>(["prefill", "decode", "both"], Role);

const big = (n: number): bigint => BigInt(Math.max(0, Math.trunc(n)));
const num = (n: bigint): number => Number(n);

/** An event's fields as an Event init (for `create`, or the generated encoder without it). */
export function eventInit(ev: SidecarEvent): MessageInitShape<typeof EventSchema> {
  return {
    seq: big(ev.seq),
    kind: eventKinds.num(ev.kind) ?? PbEventKind.UNSPECIFIED,
    timeMs: big(ev.timeMs),
    transferId: ev.transferId,
    peer: ev.peer,
    side: transferSides.num(ev.side) ?? PbTransferSide.UNSPECIFIED,
    reason: ev.reason,
    bytes: big(ev.bytes),
    mode: transferModes.num(ev.mode) ?? PbTransferMode.UNSPECIFIED,
  };
}

export function eventToProto(ev: SidecarEvent): Event {
  return create(EventSchema, eventInit(ev));
}

/** A WatchEventsResponse carrying `e`, as bytes (the server encodes each event once). */
export function encodeEventResponse(e: MessageInitShape<typeof EventSchema>): Uint8Array {
  return watchEventsResponseToBinary({ msg: { case: "event", value: e } });
}

/** Throws when the kind is not one this client knows (a newer server). */
export function eventFromProto(ev: Event): SidecarEvent {
  const kind = eventKinds.name(ev.kind);
  if (kind === undefined) throw new Error(`unknown event kind ${ev.kind} (seq ${ev.seq})`);
  return {
    seq: num(ev.seq),
    kind,
    timeMs: num(ev.timeMs),
    transferId: ev.transferId,
    peer: ev.peer,
    side: transferSides.name(ev.side) ?? "",
    reason: ev.reason,
    bytes: num(ev.bytes),
    mode: transferModes.name(ev.mode) ?? "",
  };
}

export interface LogPosition {
  readonly firstSeq: number;
  readonly lastSeq: number;
  readonly watchers: number;
}

export function statusToProto(
  s: SidecarStatus,
  log: LogPosition,
  nowMs: number,
): GetStatusResponse {
  return create(GetStatusResponseSchema, {
    engineId: s.engineId,
    epoch: s.epoch,
    role: roles.num(s.role) ?? Role.UNSPECIFIED,
    mode: transferModes.num(s.mode) ?? PbTransferMode.UNSPECIFIED,
    tpSize: s.tpSize,
    layoutSummary: s.layoutSummary,
    startedMs: big(s.startedMs),
    uptimeMs: big(nowMs - s.startedMs),
    draining: s.draining,
    peers: s.peers.map((p) => ({
      engineId: p.engineId,
      epoch: p.epoch,
      state: p.state === "connected" ? PeerState.CONNECTED : PeerState.FAILED,
      lastSeenMs: big(p.lastSeenMs),
      sideChannel: p.sideChannel,
    })),
    transfersByState: Object.fromEntries(
      Object.entries(s.transfersByState).map(([k, v]) => [k, Math.max(0, Math.trunc(v))]),
    ),
    bytesMoved: big(s.bytesMoved),
    transfersMoved: big(s.transfersMoved),
    leaseTableSize: big(s.leaseTableSize),
    lastErrors: [...s.lastErrors],
    ucxVersion: s.ucx.version,
    ucxTransports: [...s.ucx.transports],
    ucxMemoryTypes: [...s.ucx.memoryTypes],
    firstSeq: big(log.lastSeq === 0 ? 0 : log.firstSeq),
    lastSeq: big(log.lastSeq),
    watchers: log.watchers,
  });
}

/** The status as a client sees it: the view's fields plus uptime and the event log's position. */
export interface SidecarStatusReply extends SidecarStatus, LogPosition {
  readonly uptimeMs: number;
}

export function statusFromProto(s: GetStatusResponse): SidecarStatusReply {
  return {
    engineId: s.engineId,
    epoch: s.epoch,
    role: roles.name(s.role) ?? "both",
    mode: transferModes.name(s.mode) ?? "auto",
    tpSize: s.tpSize,
    layoutSummary: s.layoutSummary,
    startedMs: num(s.startedMs),
    uptimeMs: num(s.uptimeMs),
    draining: s.draining,
    peers: s.peers.map((p) => ({
      engineId: p.engineId,
      epoch: p.epoch,
      state: p.state === PeerState.CONNECTED ? "connected" : "failed",
      lastSeenMs: num(p.lastSeenMs),
      sideChannel: p.sideChannel,
    })),
    transfersByState: { ...s.transfersByState },
    bytesMoved: num(s.bytesMoved),
    transfersMoved: num(s.transfersMoved),
    leaseTableSize: num(s.leaseTableSize),
    lastErrors: [...s.lastErrors],
    ucx: {
      version: s.ucxVersion,
      transports: [...s.ucxTransports],
      memoryTypes: [...s.ucxMemoryTypes],
    },
    firstSeq: num(s.firstSeq),
    lastSeq: num(s.lastSeq),
    watchers: s.watchers,
  };
}

export function transferToProto(t: TransferInfo): Transfer {
  return create(TransferSchema, {
    transferId: t.transferId,
    side: transferSides.num(t.side) ?? PbTransferSide.UNSPECIFIED,
    mode: transferModes.num(t.mode) ?? PbTransferMode.UNSPECIFIED,
    state: transferStates.num(t.state) ?? PbTransferState.UNSPECIFIED,
    peer: t.peer,
    bytes: big(t.bytes),
    descriptors: big(t.descriptors),
    reason: t.reason,
    timings: {
      registeredMs: big(t.timings.registeredMs),
      prefillDoneMs: big(t.timings.prefillDoneMs),
      dataStartedMs: big(t.timings.dataStartedMs),
      dataDoneMs: big(t.timings.dataDoneMs),
      readyMs: big(t.timings.readyMs),
      endedMs: big(t.timings.endedMs),
    },
    trace: t.trace.map((h) => ({ hop: h.hop, atUs: big(h.us) })),
  });
}

export function transferFromProto(t: Transfer): TransferInfo {
  const tm = t.timings;
  return {
    transferId: t.transferId,
    side: transferSides.name(t.side) ?? "decode",
    mode: transferModes.name(t.mode) ?? "",
    state: transferStates.name(t.state) ?? "WAITING",
    peer: t.peer,
    bytes: num(t.bytes),
    descriptors: num(t.descriptors),
    reason: t.reason,
    timings: {
      registeredMs: num(tm?.registeredMs ?? 0n),
      prefillDoneMs: num(tm?.prefillDoneMs ?? 0n),
      dataStartedMs: num(tm?.dataStartedMs ?? 0n),
      dataDoneMs: num(tm?.dataDoneMs ?? 0n),
      readyMs: num(tm?.readyMs ?? 0n),
      endedMs: num(tm?.endedMs ?? 0n),
    },
    trace: t.trace.map((h) => ({ hop: h.hop, us: num(h.atUs) })),
  };
}
