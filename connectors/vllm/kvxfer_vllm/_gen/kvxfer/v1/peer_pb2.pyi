from kvxfer_vllm._gen.kvxfer.v1 import layout_pb2 as _layout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_BOTH: Role

class RankMetadata(_message.Message):
    __slots__ = ("rank", "worker_address", "remote_keys")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_KEYS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    worker_address: bytes
    remote_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, rank: _Optional[int] = ..., worker_address: _Optional[bytes] = ..., remote_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AgentMetadata(_message.Message):
    __slots__ = ("engine_id", "epoch", "role", "layout", "ranks", "side_channel", "groups")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SIDE_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    epoch: int
    role: Role
    layout: _layout_pb2.KvLayout
    ranks: _containers.RepeatedCompositeFieldContainer[RankMetadata]
    side_channel: str
    groups: _containers.RepeatedCompositeFieldContainer[_layout_pb2.KvCacheGroup]
    def __init__(self, engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., layout: _Optional[_Union[_layout_pb2.KvLayout, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankMetadata, _Mapping]]] = ..., side_channel: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[_layout_pb2.KvCacheGroup, _Mapping]]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("metadata", "expected_epoch", "mac_key")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAC_KEY_FIELD_NUMBER: _ClassVar[int]
    metadata: AgentMetadata
    expected_epoch: int
    mac_key: bytes
    def __init__(self, metadata: _Optional[_Union[AgentMetadata, _Mapping]] = ..., expected_epoch: _Optional[int] = ..., mac_key: _Optional[bytes] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("metadata", "error_code", "error", "mac_key")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MAC_KEY_FIELD_NUMBER: _ClassVar[int]
    metadata: AgentMetadata
    error_code: str
    error: str
    mac_key: bytes
    def __init__(self, metadata: _Optional[_Union[AgentMetadata, _Mapping]] = ..., error_code: _Optional[str] = ..., error: _Optional[str] = ..., mac_key: _Optional[bytes] = ...) -> None: ...

class PushReg(_message.Message):
    __slots__ = ("transfer_id", "block_ids", "num_tokens", "prefix_tokens", "lease_ms", "token", "groups")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    prefix_tokens: int
    lease_ms: int
    token: str
    groups: _containers.RepeatedCompositeFieldContainer[_layout_pb2.KvBlockList]
    def __init__(self, transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., lease_ms: _Optional[int] = ..., token: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[_layout_pb2.KvBlockList, _Mapping]]] = ...) -> None: ...

class XferDone(_message.Message):
    __slots__ = ("transfer_id", "src_rank", "dst_rank", "bytes", "since_prefill_done_ms")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SINCE_PREFILL_DONE_MS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    src_rank: int
    dst_rank: int
    bytes: int
    since_prefill_done_ms: int
    def __init__(self, transfer_id: _Optional[str] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., bytes: _Optional[int] = ..., since_prefill_done_ms: _Optional[int] = ...) -> None: ...

class ReadDone(_message.Message):
    __slots__ = ("transfer_id", "bytes", "token")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    bytes: int
    token: str
    def __init__(self, transfer_id: _Optional[str] = ..., bytes: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class ReadAck(_message.Message):
    __slots__ = ("transfer_id", "held", "unknown")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    held: bool
    unknown: bool
    def __init__(self, transfer_id: _Optional[str] = ..., held: _Optional[bool] = ..., unknown: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("transfer_ids",)
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    transfer_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, transfer_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortXfer(_message.Message):
    __slots__ = ("transfer_id", "reason", "token")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    token: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class AbortAck(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class Failed(_message.Message):
    __slots__ = ("transfer_id", "code", "message", "token")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    code: str
    message: str
    token: str
    def __init__(self, transfer_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class PeerMessage(_message.Message):
    __slots__ = ("sender_engine_id", "sender_epoch", "receiver_epoch", "seq", "push_reg", "xfer_done", "read_done", "read_ack", "heartbeat", "abort", "abort_ack", "failed")
    SENDER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PUSH_REG_FIELD_NUMBER: _ClassVar[int]
    XFER_DONE_FIELD_NUMBER: _ClassVar[int]
    READ_DONE_FIELD_NUMBER: _ClassVar[int]
    READ_ACK_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ABORT_ACK_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    sender_engine_id: str
    sender_epoch: int
    receiver_epoch: int
    seq: int
    push_reg: PushReg
    xfer_done: XferDone
    read_done: ReadDone
    read_ack: ReadAck
    heartbeat: Heartbeat
    abort: AbortXfer
    abort_ack: AbortAck
    failed: Failed
    def __init__(self, sender_engine_id: _Optional[str] = ..., sender_epoch: _Optional[int] = ..., receiver_epoch: _Optional[int] = ..., seq: _Optional[int] = ..., push_reg: _Optional[_Union[PushReg, _Mapping]] = ..., xfer_done: _Optional[_Union[XferDone, _Mapping]] = ..., read_done: _Optional[_Union[ReadDone, _Mapping]] = ..., read_ack: _Optional[_Union[ReadAck, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., abort: _Optional[_Union[AbortXfer, _Mapping]] = ..., abort_ack: _Optional[_Union[AbortAck, _Mapping]] = ..., failed: _Optional[_Union[Failed, _Mapping]] = ...) -> None: ...

class SealedPeerMessage(_message.Message):
    __slots__ = ("message", "mac")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    message: bytes
    mac: bytes
    def __init__(self, message: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...
