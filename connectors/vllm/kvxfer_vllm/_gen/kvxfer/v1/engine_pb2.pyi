from kvxfer_vllm._gen.kvxfer.v1 import layout_pb2 as _layout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FailureReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_REASON_UNSPECIFIED: _ClassVar[FailureReason]
    FAILURE_REASON_TIMEOUT: _ClassVar[FailureReason]
    FAILURE_REASON_PEER_FAILED: _ClassVar[FailureReason]
    FAILURE_REASON_ABORTED: _ClassVar[FailureReason]
    FAILURE_REASON_INCOMPATIBLE: _ClassVar[FailureReason]
    FAILURE_REASON_BAD_REQUEST: _ClassVar[FailureReason]
    FAILURE_REASON_TRANSFER_ERROR: _ClassVar[FailureReason]
    FAILURE_REASON_LEASE_EXPIRED: _ClassVar[FailureReason]
    FAILURE_REASON_UNREACHABLE: _ClassVar[FailureReason]
    FAILURE_REASON_OVERLOADED: _ClassVar[FailureReason]

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    RELEASE_REASON_TRANSFERRED: _ClassVar[ReleaseReason]
    RELEASE_REASON_EXPIRED: _ClassVar[ReleaseReason]
    RELEASE_REASON_ABORTED: _ClassVar[ReleaseReason]
    RELEASE_REASON_FAILED: _ClassVar[ReleaseReason]
FAILURE_REASON_UNSPECIFIED: FailureReason
FAILURE_REASON_TIMEOUT: FailureReason
FAILURE_REASON_PEER_FAILED: FailureReason
FAILURE_REASON_ABORTED: FailureReason
FAILURE_REASON_INCOMPATIBLE: FailureReason
FAILURE_REASON_BAD_REQUEST: FailureReason
FAILURE_REASON_TRANSFER_ERROR: FailureReason
FAILURE_REASON_LEASE_EXPIRED: FailureReason
FAILURE_REASON_UNREACHABLE: FailureReason
FAILURE_REASON_OVERLOADED: FailureReason
RELEASE_REASON_UNSPECIFIED: ReleaseReason
RELEASE_REASON_TRANSFERRED: ReleaseReason
RELEASE_REASON_EXPIRED: ReleaseReason
RELEASE_REASON_ABORTED: ReleaseReason
RELEASE_REASON_FAILED: ReleaseReason

class RegionFile(_message.Message):
    __slots__ = ("path", "offset", "length", "segment", "cuda_ipc_handle", "cuda_device")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    segment: int
    cuda_ipc_handle: bytes
    cuda_device: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., segment: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ..., cuda_device: _Optional[int] = ...) -> None: ...

class AllocateKv(_message.Message):
    __slots__ = ("rank", "lengths", "tp_size")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    lengths: _containers.RepeatedScalarFieldContainer[int]
    tp_size: int
    def __init__(self, rank: _Optional[int] = ..., lengths: _Optional[_Iterable[int]] = ..., tp_size: _Optional[int] = ...) -> None: ...

class RankKvCache(_message.Message):
    __slots__ = ("rank", "regions")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    regions: _containers.RepeatedCompositeFieldContainer[RegionFile]
    def __init__(self, rank: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[RegionFile, _Mapping]]] = ...) -> None: ...

class RegisterKvCache(_message.Message):
    __slots__ = ("engine_id", "layout", "ranks", "groups")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    layout: _layout_pb2.KvLayout
    ranks: _containers.RepeatedCompositeFieldContainer[RankKvCache]
    groups: _containers.RepeatedCompositeFieldContainer[_layout_pb2.KvCacheGroup]
    def __init__(self, engine_id: _Optional[str] = ..., layout: _Optional[_Union[_layout_pb2.KvLayout, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankKvCache, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[_layout_pb2.KvCacheGroup, _Mapping]]] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("transfer_id", "block_ids", "num_tokens", "token", "groups", "layer_wise")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LAYER_WISE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    token: str
    groups: _containers.RepeatedCompositeFieldContainer[_layout_pb2.KvBlockList]
    layer_wise: bool
    def __init__(self, transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., token: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[_layout_pb2.KvBlockList, _Mapping]]] = ..., layer_wise: _Optional[bool] = ...) -> None: ...

class LayersSaved(_message.Message):
    __slots__ = ("transfer_ids", "layers")
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    transfer_ids: _containers.RepeatedScalarFieldContainer[str]
    layers: int
    def __init__(self, transfer_ids: _Optional[_Iterable[str]] = ..., layers: _Optional[int] = ...) -> None: ...

class ExpectKv(_message.Message):
    __slots__ = ("transfer_id", "source", "block_ids", "num_tokens", "prefix_tokens", "source_block_ids", "has_source_block_ids", "token", "groups", "source_groups")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_SOURCE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    source: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    prefix_tokens: int
    source_block_ids: _containers.RepeatedScalarFieldContainer[int]
    has_source_block_ids: bool
    token: str
    groups: _containers.RepeatedCompositeFieldContainer[_layout_pb2.KvBlockList]
    source_groups: _containers.RepeatedCompositeFieldContainer[_layout_pb2.KvBlockList]
    def __init__(self, transfer_id: _Optional[str] = ..., source: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., source_block_ids: _Optional[_Iterable[int]] = ..., has_source_block_ids: _Optional[bool] = ..., token: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[_layout_pb2.KvBlockList, _Mapping]]] = ..., source_groups: _Optional[_Iterable[_Union[_layout_pb2.KvBlockList, _Mapping]]] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class EngineToSidecar(_message.Message):
    __slots__ = ("register", "prefill_done", "expect_kv", "abort", "allocate", "layers_saved")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    EXPECT_KV_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_SAVED_FIELD_NUMBER: _ClassVar[int]
    register: RegisterKvCache
    prefill_done: PrefillDone
    expect_kv: ExpectKv
    abort: Abort
    allocate: AllocateKv
    layers_saved: LayersSaved
    def __init__(self, register: _Optional[_Union[RegisterKvCache, _Mapping]] = ..., prefill_done: _Optional[_Union[PrefillDone, _Mapping]] = ..., expect_kv: _Optional[_Union[ExpectKv, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., allocate: _Optional[_Union[AllocateKv, _Mapping]] = ..., layers_saved: _Optional[_Union[LayersSaved, _Mapping]] = ...) -> None: ...

class KvReady(_message.Message):
    __slots__ = ("transfer_id", "bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class KvFailed(_message.Message):
    __slots__ = ("transfer_id", "reason", "message")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: FailureReason
    message: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[_Union[FailureReason, str]] = ..., message: _Optional[str] = ...) -> None: ...

class ReleaseBlocks(_message.Message):
    __slots__ = ("transfer_id", "block_ids", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: ReleaseReason
    def __init__(self, transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[_Union[ReleaseReason, str]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("ok", "error", "side_channel", "epoch")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    side_channel: str
    epoch: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., side_channel: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class Refused(_message.Message):
    __slots__ = ("transfer_id", "code", "message")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    code: str
    message: str
    def __init__(self, transfer_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Allocated(_message.Message):
    __slots__ = ("rank", "ok", "error", "segments")
    RANK_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    ok: bool
    error: str
    segments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., segments: _Optional[_Iterable[int]] = ...) -> None: ...

class SidecarToEngine(_message.Message):
    __slots__ = ("registered", "kv_ready", "kv_failed", "release_blocks", "refused", "allocated")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    KV_READY_FIELD_NUMBER: _ClassVar[int]
    KV_FAILED_FIELD_NUMBER: _ClassVar[int]
    RELEASE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    kv_ready: KvReady
    kv_failed: KvFailed
    release_blocks: ReleaseBlocks
    refused: Refused
    allocated: Allocated
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., kv_ready: _Optional[_Union[KvReady, _Mapping]] = ..., kv_failed: _Optional[_Union[KvFailed, _Mapping]] = ..., release_blocks: _Optional[_Union[ReleaseBlocks, _Mapping]] = ..., refused: _Optional[_Union[Refused, _Mapping]] = ..., allocated: _Optional[_Union[Allocated, _Mapping]] = ...) -> None: ...
