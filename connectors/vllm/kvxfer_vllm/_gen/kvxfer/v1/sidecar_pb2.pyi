from kvxfer_vllm._gen.kvxfer.v1 import peer_pb2 as _peer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_KV_READY: _ClassVar[EventKind]
    EVENT_KIND_FAILED: _ClassVar[EventKind]
    EVENT_KIND_EXPIRED: _ClassVar[EventKind]
    EVENT_KIND_ABORTED: _ClassVar[EventKind]
    EVENT_KIND_RELEASED: _ClassVar[EventKind]
    EVENT_KIND_PEER_UP: _ClassVar[EventKind]
    EVENT_KIND_PEER_DOWN: _ClassVar[EventKind]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_WAITING: _ClassVar[TransferState]
    TRANSFER_STATE_HELD: _ClassVar[TransferState]
    TRANSFER_STATE_MOVING: _ClassVar[TransferState]
    TRANSFER_STATE_CONFIRMING: _ClassVar[TransferState]
    TRANSFER_STATE_KV_READY: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
    TRANSFER_STATE_EXPIRED: _ClassVar[TransferState]
    TRANSFER_STATE_ABORTED: _ClassVar[TransferState]
    TRANSFER_STATE_RELEASED: _ClassVar[TransferState]
    TRANSFER_STATE_ABORTING: _ClassVar[TransferState]
    TRANSFER_STATE_DRAINING: _ClassVar[TransferState]

class TransferSide(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_SIDE_UNSPECIFIED: _ClassVar[TransferSide]
    TRANSFER_SIDE_PREFILL: _ClassVar[TransferSide]
    TRANSFER_SIDE_DECODE: _ClassVar[TransferSide]

class TransferMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_MODE_UNSPECIFIED: _ClassVar[TransferMode]
    TRANSFER_MODE_PUSH: _ClassVar[TransferMode]
    TRANSFER_MODE_PULL: _ClassVar[TransferMode]
    TRANSFER_MODE_AUTO: _ClassVar[TransferMode]

class PeerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_STATE_UNSPECIFIED: _ClassVar[PeerState]
    PEER_STATE_CONNECTED: _ClassVar[PeerState]
    PEER_STATE_FAILED: _ClassVar[PeerState]
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_KV_READY: EventKind
EVENT_KIND_FAILED: EventKind
EVENT_KIND_EXPIRED: EventKind
EVENT_KIND_ABORTED: EventKind
EVENT_KIND_RELEASED: EventKind
EVENT_KIND_PEER_UP: EventKind
EVENT_KIND_PEER_DOWN: EventKind
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_WAITING: TransferState
TRANSFER_STATE_HELD: TransferState
TRANSFER_STATE_MOVING: TransferState
TRANSFER_STATE_CONFIRMING: TransferState
TRANSFER_STATE_KV_READY: TransferState
TRANSFER_STATE_FAILED: TransferState
TRANSFER_STATE_EXPIRED: TransferState
TRANSFER_STATE_ABORTED: TransferState
TRANSFER_STATE_RELEASED: TransferState
TRANSFER_STATE_ABORTING: TransferState
TRANSFER_STATE_DRAINING: TransferState
TRANSFER_SIDE_UNSPECIFIED: TransferSide
TRANSFER_SIDE_PREFILL: TransferSide
TRANSFER_SIDE_DECODE: TransferSide
TRANSFER_MODE_UNSPECIFIED: TransferMode
TRANSFER_MODE_PUSH: TransferMode
TRANSFER_MODE_PULL: TransferMode
TRANSFER_MODE_AUTO: TransferMode
PEER_STATE_UNSPECIFIED: PeerState
PEER_STATE_CONNECTED: PeerState
PEER_STATE_FAILED: PeerState

class Event(_message.Message):
    __slots__ = ("seq", "kind", "time_ms", "transfer_id", "peer", "side", "reason", "bytes", "mode")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIME_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: EventKind
    time_ms: int
    transfer_id: str
    peer: str
    side: TransferSide
    reason: str
    bytes: int
    mode: TransferMode
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., time_ms: _Optional[int] = ..., transfer_id: _Optional[str] = ..., peer: _Optional[str] = ..., side: _Optional[_Union[TransferSide, str]] = ..., reason: _Optional[str] = ..., bytes: _Optional[int] = ..., mode: _Optional[_Union[TransferMode, str]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("engine_id", "epoch", "state", "last_seen_ms", "side_channel")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    state: PeerState
    last_seen_ms: int
    side_channel: str
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., state: _Optional[_Union[PeerState, str]] = ..., last_seen_ms: _Optional[int] = ..., side_channel: _Optional[str] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("engine_id", "epoch", "role", "mode", "tp_size", "layout_summary", "started_ms", "uptime_ms", "draining", "peers", "transfers_by_state", "bytes_moved", "transfers_moved", "lease_table_size", "last_errors", "first_seq", "last_seq", "watchers", "ucx_version", "ucx_transports", "ucx_memory_types")
    class TransfersByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    STARTED_MS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_MOVED_FIELD_NUMBER: _ClassVar[int]
    LEASE_TABLE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERRORS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    WATCHERS_FIELD_NUMBER: _ClassVar[int]
    UCX_VERSION_FIELD_NUMBER: _ClassVar[int]
    UCX_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    UCX_MEMORY_TYPES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    role: _peer_pb2.Role
    mode: TransferMode
    tp_size: int
    layout_summary: str
    started_ms: int
    uptime_ms: int
    draining: bool
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    transfers_by_state: _containers.ScalarMap[str, int]
    bytes_moved: int
    transfers_moved: int
    lease_table_size: int
    last_errors: _containers.RepeatedScalarFieldContainer[str]
    first_seq: int
    last_seq: int
    watchers: int
    ucx_version: str
    ucx_transports: _containers.RepeatedScalarFieldContainer[str]
    ucx_memory_types: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., role: _Optional[_Union[_peer_pb2.Role, str]] = ..., mode: _Optional[_Union[TransferMode, str]] = ..., tp_size: _Optional[int] = ..., layout_summary: _Optional[str] = ..., started_ms: _Optional[int] = ..., uptime_ms: _Optional[int] = ..., draining: _Optional[bool] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., transfers_by_state: _Optional[_Mapping[str, int]] = ..., bytes_moved: _Optional[int] = ..., transfers_moved: _Optional[int] = ..., lease_table_size: _Optional[int] = ..., last_errors: _Optional[_Iterable[str]] = ..., first_seq: _Optional[int] = ..., last_seq: _Optional[int] = ..., watchers: _Optional[int] = ..., ucx_version: _Optional[str] = ..., ucx_transports: _Optional[_Iterable[str]] = ..., ucx_memory_types: _Optional[_Iterable[str]] = ...) -> None: ...

class TransferTimings(_message.Message):
    __slots__ = ("registered_ms", "prefill_done_ms", "data_started_ms", "data_done_ms", "ready_ms", "ended_ms")
    REGISTERED_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_STARTED_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_DONE_MS_FIELD_NUMBER: _ClassVar[int]
    READY_MS_FIELD_NUMBER: _ClassVar[int]
    ENDED_MS_FIELD_NUMBER: _ClassVar[int]
    registered_ms: int
    prefill_done_ms: int
    data_started_ms: int
    data_done_ms: int
    ready_ms: int
    ended_ms: int
    def __init__(self, registered_ms: _Optional[int] = ..., prefill_done_ms: _Optional[int] = ..., data_started_ms: _Optional[int] = ..., data_done_ms: _Optional[int] = ..., ready_ms: _Optional[int] = ..., ended_ms: _Optional[int] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("transfer_id", "side", "mode", "state", "peer", "bytes", "descriptors", "reason", "timings", "trace")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    side: TransferSide
    mode: TransferMode
    state: TransferState
    peer: str
    bytes: int
    descriptors: int
    reason: str
    timings: TransferTimings
    trace: _containers.RepeatedCompositeFieldContainer[TraceHop]
    def __init__(self, transfer_id: _Optional[str] = ..., side: _Optional[_Union[TransferSide, str]] = ..., mode: _Optional[_Union[TransferMode, str]] = ..., state: _Optional[_Union[TransferState, str]] = ..., peer: _Optional[str] = ..., bytes: _Optional[int] = ..., descriptors: _Optional[int] = ..., reason: _Optional[str] = ..., timings: _Optional[_Union[TransferTimings, _Mapping]] = ..., trace: _Optional[_Iterable[_Union[TraceHop, _Mapping]]] = ...) -> None: ...

class TraceHop(_message.Message):
    __slots__ = ("hop", "at_us")
    HOP_FIELD_NUMBER: _ClassVar[int]
    AT_US_FIELD_NUMBER: _ClassVar[int]
    hop: str
    at_us: int
    def __init__(self, hop: _Optional[str] = ..., at_us: _Optional[int] = ...) -> None: ...

class ListTransfersRequest(_message.Message):
    __slots__ = ("states", "peer", "limit")
    STATES_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[TransferState]
    peer: str
    limit: int
    def __init__(self, states: _Optional[_Iterable[_Union[TransferState, str]]] = ..., peer: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListTransfersResponse(_message.Message):
    __slots__ = ("transfers", "total")
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    total: int
    def __init__(self, transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("after_seq", "transfer_ids", "kinds", "live_only", "epoch")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    transfer_ids: _containers.RepeatedScalarFieldContainer[str]
    kinds: _containers.RepeatedScalarFieldContainer[EventKind]
    live_only: bool
    epoch: int
    def __init__(self, after_seq: _Optional[int] = ..., transfer_ids: _Optional[_Iterable[str]] = ..., kinds: _Optional[_Iterable[_Union[EventKind, str]]] = ..., live_only: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class WatchProgress(_message.Message):
    __slots__ = ("seq", "epoch", "first_seq", "caught_up")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    seq: int
    epoch: int
    first_seq: int
    caught_up: bool
    def __init__(self, seq: _Optional[int] = ..., epoch: _Optional[int] = ..., first_seq: _Optional[int] = ..., caught_up: _Optional[bool] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("event", "progress")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    event: Event
    progress: WatchProgress
    def __init__(self, event: _Optional[_Union[Event, _Mapping]] = ..., progress: _Optional[_Union[WatchProgress, _Mapping]] = ...) -> None: ...

class AwaitTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "side")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    side: TransferSide
    def __init__(self, transfer_id: _Optional[str] = ..., side: _Optional[_Union[TransferSide, str]] = ...) -> None: ...

class AwaitTransferResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: Event
    def __init__(self, event: _Optional[_Union[Event, _Mapping]] = ...) -> None: ...
