/** kvxfer.v1.Sidecar's handlers: GetStatus, ListTransfers, WatchEvents, AwaitTransfer. */
import * as grpc from "@grpc/grpc-js";
import { create } from "@bufbuild/protobuf";
import {
  type AwaitTransferRequest,
  AwaitTransferResponseSchema,
  type GetStatusResponse,
  type ListTransfersRequest,
  type ListTransfersResponse,
  ListTransfersResponseSchema,
  TransferSide as PbTransferSide,
  type WatchEventsResponse,
} from "../gen/kvxfer/v1/sidecar_pb.js";
import { KvxferError } from "../errors.js";
import type { TransferSide } from "../sidecar/view.js";
import {
  eventKinds,
  eventToProto,
  statusToProto,
  transferSides,
  transferStates,
  transferToProto,
} from "./convert.js";
import { callClient } from "./call-shares.js";
import {
  type ActiveAwait,
  type ActiveWatch,
  ApiState,
  checkTransferId,
  deadlineMs,
  DEFAULT_LIST_LIMIT,
  fail,
  type ServiceError,
  MAX_FILTER_IDS,
  MAX_LIST_LIMIT,
  namesFromProto,
  seqFromProto,
  toStatus,
} from "./api-state.js";

/** kvxfer.v1.Sidecar: GetStatus, ListTransfers, WatchEvents, AwaitTransfer. */
export class SidecarRpcs {
  constructor(private readonly s: ApiState) {}

  /** The handlers grpc-js calls, by method name. */
  handlers(): grpc.UntypedServiceImplementation {
    return {
      GetStatus: this.getStatus.bind(this),
      ListTransfers: this.listTransfers.bind(this),
      WatchEvents: this.watchEvents.bind(this),
      AwaitTransfer: this.awaitTransfer.bind(this),
    };
  }

  getStatus(
    call: grpc.ServerUnaryCall<unknown, GetStatusResponse>,
    cb: grpc.sendUnaryData<GetStatusResponse>,
  ): void {
    this.s.callSeen(call);
    const { view, events, watches } = this.s;
    try {
      const status = view.status();
      cb(
        null,
        statusToProto(
          status,
          { firstSeq: events.firstSeq, lastSeq: events.lastSeq, watchers: watches.size },
          Date.now(),
        ),
      );
    } catch (err) {
      this.s.log.error({ err }, "GetStatus failed");
      cb(toStatus(err));
    }
  }

  listTransfers(
    call: grpc.ServerUnaryCall<ListTransfersRequest, ListTransfersResponse>,
    cb: grpc.sendUnaryData<ListTransfersResponse>,
  ): void {
    this.s.callSeen(call);
    try {
      const req = call.request;
      const states = namesFromProto(transferStates, req.states, "transfer state");
      if (req.limit > MAX_LIST_LIMIT)
        throw new KvxferError(
          "ERR_INVALID_ARGUMENT",
          `limit ${req.limit} is above the most one call returns (${MAX_LIST_LIMIT})`,
        );
      const limit = req.limit === 0 ? DEFAULT_LIST_LIMIT : req.limit;
      const all = this.s.view.transfers({
        ...(states.length > 0 ? { states } : {}),
        ...(req.peer !== "" ? { peer: req.peer } : {}),
      });
      cb(
        null,
        create(ListTransfersResponseSchema, {
          transfers: all.slice(0, limit).map(transferToProto),
          total: BigInt(all.length),
        }),
      );
    } catch (err) {
      if (!(err instanceof KvxferError)) this.s.log.error({ err }, "ListTransfers failed");
      cb(toStatus(err));
    }
  }

  watchEvents(call: ActiveWatch["call"]): void {
    this.s.callSeen(call);
    const { s } = this;
    const { events, watches } = s;
    const req = call.request;
    const w: ActiveWatch = { call, sub: undefined, lastSentSeq: 0, paused: false };
    const release = (): void => {
      if (!watches.delete(w)) return;
      s.watchShares.delete(w);
    };
    const finish = (status: ServiceError | undefined): void => {
      if (!watches.has(w)) return;
      release();
      w.sub?.close();
      if (call.cancelled) return;
      if (status === undefined) call.end();
      else call.emit("error", status);
    };
    w.end = finish;
    const send = (msg: WatchEventsResponse | Uint8Array): void => {
      if (!call.write(msg)) {
        w.paused = true;
        w.sub?.pause();
      }
    };
    try {
      if (s.closing) throw new KvxferError("ERR_CLOSED", "the sidecar is shutting down");
      const kinds = namesFromProto(eventKinds, req.kinds, "event kind");
      if (req.transferIds.length > MAX_FILTER_IDS)
        throw new KvxferError(
          "ERR_INVALID_ARGUMENT",
          `${req.transferIds.length} transfer ids in the filter (at most ${MAX_FILTER_IDS})`,
        );
      for (const id of req.transferIds) checkTransferId(id, "a transfer id in the filter");
      if (req.epoch !== 0n && req.epoch !== s.epoch)
        return void call.emit(
          "error",
          fail(
            grpc.status.FAILED_PRECONDITION,
            `the sidecar's epoch is ${s.epoch}, not ${req.epoch}: it restarted and numbers events from 1 again; resume from after_seq 0`,
          ),
        );
      const afterSeq = req.liveOnly ? events.lastSeq : seqFromProto(req.afterSeq, "after_seq");
      // Room for it: another client's oldest stream may make room (it ends RESOURCE_EXHAUSTED).
      const client = callClient(call);
      const room = s.watchShares.admit(w, client);
      if ("refused" in room) throw new KvxferError("ERR_TOO_MANY_WAITERS", room.refused);
      room.displaced?.end?.(
        fail(
          grpc.status.RESOURCE_EXHAUSTED,
          `displaced: every WatchEvents stream (${s.maxWatchers}) is taken and this client holds the most; ${client.name} needed one`,
        ),
      );
      watches.add(w);
      w.sub = events.subscribe(
        afterSeq,
        {
          ...(kinds.length > 0 ? { kinds } : {}),
          ...(req.transferIds.length > 0 ? { transferIds: req.transferIds } : {}),
        },
        {
          onEvent: (ev) => {
            w.lastSentSeq = ev.seq;
            send(s.encodeEvent(ev));
            if (ev.transferId !== "") s.view.traced?.(ev.transferId, ev.side, "event.written");
          },
          onCaughtUp: () => {
            w.lastSentSeq = Math.max(w.lastSentSeq, w.sub?.scannedSeq ?? 0);
            send(s.progress(w.sub?.scannedSeq ?? events.lastSeq, true));
          },
          onEnd: (err) => finish(err === undefined ? undefined : toStatus(err)),
        },
        {
          liveOnly: req.liveOnly,
          ...(s.watchBufferLimit !== undefined ? { bufferLimit: s.watchBufferLimit } : {}),
        },
      );
      // First message: where the stream starts and which epoch it belongs to.
      send(s.progress(afterSeq, false));
    } catch (err) {
      release();
      call.emit("error", toStatus(err));
      return;
    }
    call.on("drain", () => {
      w.paused = false;
      w.sub?.resume();
    });
    call.on("cancelled", () => finish(undefined));
    call.on("error", () => finish(undefined));
  }

  awaitTransfer(
    call: grpc.ServerUnaryCall<AwaitTransferRequest, unknown>,
    cb: grpc.sendUnaryData<unknown>,
  ): void {
    this.s.callSeen(call);
    const { s } = this;
    const req = call.request;
    let side: TransferSide | undefined;
    try {
      if (s.closing) throw new KvxferError("ERR_CLOSED", "the sidecar is shutting down");
      checkTransferId(req.transferId, "transfer_id");
      if (req.side !== PbTransferSide.UNSPECIFIED) {
        side = transferSides.name(req.side);
        if (side === undefined)
          throw new KvxferError("ERR_INVALID_ARGUMENT", `unknown side ${req.side}`);
      }
    } catch (err) {
      return cb(toStatus(err));
    }
    const callDeadline = deadlineMs(call);
    const capped = Date.now() + s.maxAwaitMs;
    const abort = new AbortController();
    const a: ActiveAwait = { abort };
    const client = callClient(call);
    const room = s.awaitShares.admit(a, client);
    if ("refused" in room) return cb(fail(grpc.status.RESOURCE_EXHAUSTED, room.refused));
    if (room.displaced !== undefined) {
      room.displaced.displaced = `displaced: every AwaitTransfer slot is taken and this client holds the most; ${client.name} needed one`;
      room.displaced.abort.abort();
    }
    s.awaits.add(a);
    call.on("cancelled", () => abort.abort());
    s.events
      .waitFor(req.transferId, {
        deadlineMs: Math.min(callDeadline, capped),
        ...(side !== undefined ? { side } : {}),
        signal: abort.signal,
      })
      .then(
        (ev) => {
          if (ev !== undefined) {
            cb(null, create(AwaitTransferResponseSchema, { event: eventToProto(ev) }));
            s.view.traced?.(ev.transferId, ev.side, "event.answered");
            return;
          }
          if (call.cancelled) return;
          if (a.displaced !== undefined)
            return cb(fail(grpc.status.RESOURCE_EXHAUSTED, a.displaced));
          if (s.closing) return cb(fail(grpc.status.UNAVAILABLE, "the sidecar is shutting down"));
          cb(
            fail(
              grpc.status.DEADLINE_EXCEEDED,
              capped < callDeadline
                ? `transfer '${req.transferId}' has not ended within the server's longest wait (${s.maxAwaitMs} ms)`
                : `transfer '${req.transferId}' has not ended before the deadline`,
            ),
          );
        },
        (err: unknown) => cb(toStatus(err)),
      )
      .finally(() => {
        s.awaits.delete(a);
        s.awaitShares.delete(a);
      });
  }

  /**
   * Tells filtered watchers how far the server has looked, so they can resume
   * from a retained seq even when none of their own events came for a while.
   */
  sendProgress(): void {
    for (const w of this.s.watches) {
      const scanned = w.sub?.scannedSeq ?? 0;
      if (!w.paused && w.sub?.caughtUp && scanned > w.lastSentSeq) {
        w.lastSentSeq = scanned;
        if (!w.call.write(this.s.progress(scanned, false))) {
          w.paused = true;
          w.sub.pause();
        }
      }
    }
  }

  /** Ends every open stream (UNAVAILABLE) and wait (server stopping). */
  endAll(): void {
    const shutdown = fail(grpc.status.UNAVAILABLE, "the sidecar is shutting down");
    for (const w of [...this.s.watches]) {
      this.s.watches.delete(w);
      w.sub?.close();
      if (!w.call.cancelled) w.call.emit("error", shutdown);
    }
    for (const a of this.s.awaits) a.abort.abort();
  }
}
