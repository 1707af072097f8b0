"""A router's client for a kvxfer sidecar's gRPC API (asyncio, ``grpc.aio``).

Two calls replace a router's own wait for "KV ready" (a ZMQ PULL socket, a timeout, a set of
finished request ids that only grows):

- ``await_kv(transfer_id, deadline)``: the transfer's terminal event on this sidecar, the moment
  it is logged, whether that was before the call, during it or (within ``deadline`` seconds)
  after; ``TimeoutError`` otherwise.
- ``watch(from_seq)``: every event with a larger sequence number, each once and in order; a
  broken stream is reopened (with backoff) from the last one delivered, so a reconnect loses and
  repeats nothing. It stops with ``WatchError`` only when the sidecar can no longer give what
  was missed: the events were dropped from its log (OUT_OF_RANGE), or it restarted and numbers
  its events from 1 again (FAILED_PRECONDITION: the epoch changed).

The messages are generated from ``proto/`` (``scripts/gen-proto.sh``; ``npm test`` fails when
they are stale), and each call's path and types are read from the generated ``Sidecar`` service
descriptor, so nothing here restates the proto. Needs ``grpcio`` (the ``client`` extra).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from google.protobuf import message_factory

from kvxfer_vllm._gen.kvxfer.v1 import sidecar_pb2 as pb

TERMINAL = ("KV_READY", "FAILED", "EXPIRED", "ABORTED", "RELEASED")

#: Statuses after which resuming cannot help: the watch stops with WatchError.
_FINAL = {
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.NOT_FOUND,
}


def _method(channel: grpc.aio.Channel, name: str, streaming: bool):
    """The ``Sidecar`` service's method ``name`` on ``channel``, as the generated descriptor says."""
    m = pb.DESCRIPTOR.services_by_name["Sidecar"].methods_by_name[name]
    response = message_factory.GetMessageClass(m.output_type)
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(f"/{m.containing_service.full_name}/{m.name}",
                request_serializer=lambda r: r.SerializeToString(),
                response_deserializer=response.FromString)


def _name(enum, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix)


@dataclass(frozen=True)
class Event:
    """One entry of the sidecar's event log."""

    seq: int
    kind: str  # KV_READY, FAILED, EXPIRED, ABORTED, RELEASED, PEER_UP, PEER_DOWN
    time_ms: int
    transfer_id: str
    peer: str
    side: str  # prefill, decode, or "" for peer events
    reason: str
    bytes: int
    mode: str  # push, pull, or ""

    @property
    def ready(self) -> bool:
        return self.kind == "KV_READY"

    @staticmethod
    def from_proto(e: pb.Event) -> Event:
        side = _name(pb.TransferSide, e.side, "TRANSFER_SIDE_")
        mode = _name(pb.TransferMode, e.mode, "TRANSFER_MODE_")
        return Event(
            seq=e.seq,
            kind=_name(pb.EventKind, e.kind, "EVENT_KIND_"),
            time_ms=e.time_ms,
            transfer_id=e.transfer_id,
            peer=e.peer,
            side="" if side == "UNSPECIFIED" else side.lower(),
            reason=e.reason,
            bytes=e.bytes,
            mode="" if mode == "UNSPECIFIED" else mode.lower(),
        )


class SidecarError(Exception):
    """The sidecar refused a call: ``code`` is its gRPC status, ``details`` its reason."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class WatchError(SidecarError):
    """A watch that cannot resume (events dropped, or the sidecar restarted: see the module doc)."""


class EventWatch:
    """``async for ev in watch``: events in order, once each, across reconnects."""

    def __init__(self, client: SidecarClient, from_seq: int, kinds: Sequence[str], transfer_ids: Sequence[str],
                 epoch: int, min_backoff: float, max_backoff: float) -> None:
        self._client = client
        #: The last seq delivered (or that the sidecar said it looked past for this filter).
        self.last_seq = from_seq
        #: The sidecar epoch the sequence numbers belong to (known after the first message).
        self.epoch = epoch
        #: How many times the stream was reopened.
        self.reconnects = 0
        self._kinds = [pb.EventKind.Value(f"EVENT_KIND_{k}") for k in kinds]
        self._ids = list(transfer_ids)
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._call = None

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()

    async def _events(self) -> AsyncIterator[Event]:
        failures = 0
        while True:
            req = pb.WatchEventsRequest(after_seq=self.last_seq, kinds=self._kinds, transfer_ids=self._ids,
                                        epoch=self.epoch)
            self._call = self._client._watch_events(req)
            healthy = False
            try:
                async for res in self._call:
                    healthy = True
                    which = res.WhichOneof("msg")
                    if which == "progress":
                        self.epoch = res.progress.epoch
                        # The sidecar considered everything up to this seq for this filter.
                        self.last_seq = max(self.last_seq, res.progress.seq)
                    elif which == "event":
                        if res.event.seq <= self.last_seq:
                            continue  # never twice
                        self.last_seq = res.event.seq
                        yield Event.from_proto(res.event)
                err: grpc.aio.AioRpcError | None = None
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and self._call.cancelled():
                    return
                err = e
            finally:
                self._call.cancel()
            if err is not None and err.code() in _FINAL:
                raise WatchError(err.code(), err.details() or "")
            failures = 1 if healthy else failures + 1
            self.reconnects += 1
            await asyncio.sleep(min(self._max_backoff, self._min_backoff * 2 ** (failures - 1)))


class SidecarClient:
    """One sidecar's gRPC API. ``async with SidecarClient("127.0.0.1:50051") as c: ...``"""

    def __init__(self, address: str, *, credentials: grpc.ChannelCredentials | None = None,
                 timeout: float = 10.0) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = (grpc.aio.secure_channel(address, credentials) if credentials is not None
                         else grpc.aio.insecure_channel(address))
        self._await_transfer = _method(self._channel, "AwaitTransfer", streaming=False)
        self._watch_events = _method(self._channel, "WatchEvents", streaming=True)

    async def __aenter__(self) -> SidecarClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def await_kv(self, transfer_id: str, deadline: float, side: str | None = None) -> Event:
        """The transfer's terminal event (``ev.ready`` for KV_READY) within ``deadline`` seconds.

        A transfer that ended before the call answers at once; one not yet known to the sidecar is
        waited for (the router may ask before the engine told its sidecar). A connection that
        breaks is retried until the deadline. ``TimeoutError`` when the deadline passes first;
        ``SidecarError`` when the sidecar refuses (e.g. INVALID_ARGUMENT for a malformed id).
        """
        if deadline <= 0:
            raise ValueError(f"deadline must be > 0 seconds, got {deadline}")
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        req = pb.AwaitTransferRequest(transfer_id=transfer_id)
        if side is not None:
            req.side = pb.TransferSide.Value(f"TRANSFER_SIDE_{side.upper()}")
        backoff = 0.05
        while True:
            left = end - loop.time()
            if left <= 0:
                raise TimeoutError(f"transfer '{transfer_id}' has not ended within {deadline} s")
            try:
                res = await self._await_transfer(req, timeout=left, wait_for_ready=True)
                return Event.from_proto(res.event)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise TimeoutError(f"transfer '{transfer_id}' has not ended within {deadline} s") from None
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise SidecarError(e.code(), e.details() or "") from None
            await asyncio.sleep(min(backoff, max(0.0, end - loop.time())))
            backoff = min(1.0, backoff * 2)

    def watch(self, from_seq: int = 0, *, kinds: Sequence[str] = (), transfer_ids: Sequence[str] = (),
              epoch: int = 0, min_backoff: float = 0.05, max_backoff: float = 2.0) -> EventWatch:
        """Events with seq > ``from_seq`` (of ``epoch`` when given), optionally only these kinds
        (e.g. ``("KV_READY", "FAILED")``) or transfers; see ``EventWatch``."""
        return EventWatch(self, from_seq, kinds, transfer_ids, epoch, min_backoff, max_backoff)
