from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvBlockOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_BLOCK_ORDER_UNSPECIFIED: _ClassVar[KvBlockOrder]
    KV_BLOCK_ORDER_HND: _ClassVar[KvBlockOrder]
    KV_BLOCK_ORDER_NHD: _ClassVar[KvBlockOrder]

class KvGroupKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_GROUP_KIND_UNSPECIFIED: _ClassVar[KvGroupKind]
    KV_GROUP_KIND_FULL: _ClassVar[KvGroupKind]
    KV_GROUP_KIND_SLIDING: _ClassVar[KvGroupKind]
    KV_GROUP_KIND_STATE: _ClassVar[KvGroupKind]
KV_BLOCK_ORDER_UNSPECIFIED: KvBlockOrder
KV_BLOCK_ORDER_HND: KvBlockOrder
KV_BLOCK_ORDER_NHD: KvBlockOrder
KV_GROUP_KIND_UNSPECIFIED: KvGroupKind
KV_GROUP_KIND_FULL: KvGroupKind
KV_GROUP_KIND_SLIDING: KvGroupKind
KV_GROUP_KIND_STATE: KvGroupKind

class KvRunOrder(_message.Message):
    __slots__ = ("dim_group", "token_tile")
    DIM_GROUP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TILE_FIELD_NUMBER: _ClassVar[int]
    dim_group: int
    token_tile: int
    def __init__(self, dim_group: _Optional[int] = ..., token_tile: _Optional[int] = ...) -> None: ...

class KvSlotAddress(_message.Message):
    __slots__ = ("region", "offset")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    region: int
    offset: int
    def __init__(self, region: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "mla", "total_kv_heads", "head_dim", "dtype", "dtype_bytes", "block_size", "num_blocks", "order", "tp_size", "tp_rank", "block_stride", "slots", "region_bytes", "head_stride", "token_stride", "opaque_blocks", "run_orders")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MLA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEAD_STRIDE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRIDE_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUN_ORDERS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    mla: bool
    total_kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int
    block_size: int
    num_blocks: int
    order: KvBlockOrder
    tp_size: int
    tp_rank: int
    block_stride: int
    slots: _containers.RepeatedCompositeFieldContainer[KvSlotAddress]
    region_bytes: _containers.RepeatedScalarFieldContainer[int]
    head_stride: int
    token_stride: int
    opaque_blocks: bool
    run_orders: _containers.RepeatedCompositeFieldContainer[KvRunOrder]
    def __init__(self, num_layers: _Optional[int] = ..., mla: _Optional[bool] = ..., total_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., dtype_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., order: _Optional[_Union[KvBlockOrder, str]] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., block_stride: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[KvSlotAddress, _Mapping]]] = ..., region_bytes: _Optional[_Iterable[int]] = ..., head_stride: _Optional[int] = ..., token_stride: _Optional[int] = ..., opaque_blocks: _Optional[bool] = ..., run_orders: _Optional[_Iterable[_Union[KvRunOrder, _Mapping]]] = ...) -> None: ...

class KvCacheGroup(_message.Message):
    __slots__ = ("kind", "sliding_window", "layout", "state_shape")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STATE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    kind: KvGroupKind
    sliding_window: int
    layout: KvLayout
    state_shape: str
    def __init__(self, kind: _Optional[_Union[KvGroupKind, str]] = ..., sliding_window: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., state_shape: _Optional[str] = ...) -> None: ...

class KvBlockList(_message.Message):
    __slots__ = ("first_block", "block_ids")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...
