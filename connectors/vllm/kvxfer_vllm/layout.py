"""vLLM's KV cache tensors, described as a kvxfer ``KvLayout``.

vLLM (0.32+) hands ``register_kv_caches`` one view per attention layer, shaped
``[blocks, heads, tokens, C]`` (``C`` elements per cell) over one flat
allocation. What a cell holds depends on the attention backend, so the adapter
names the backend's *packing* and this module turns shapes and strides into
kvxfer slots (one per layer and K|V) with explicit head and token strides:

================  ==========================================  ====================
packing           backend (examples)                          where K and V live
================  ==========================================  ====================
``kv_in_tokens``  CPU_ATTN                                    per (block, head): K's N tokens, then V's
``kv_in_cell``    FLASH_ATTN, TRITON_ATTN                     per (block, head, token): K dims, then V dims
``kv_in_heads``   FLASHINFER                                  heads 0..H-1 are K, H..2H-1 are V
``latent``        MLA backends                                one latent per (block, token)
================  ==========================================  ====================

``kv_in_tokens`` blocks are not plain rows: the CPU kernels reorder a (block,
head) run by ISA (``cpu_attn_reshape_and_cache``, probed against this table in
``tests/test_layout.py``):

==========  ===================================  =================================
ISA         K of one (block, head), N tokens     V
==========  ===================================  =================================
vec, vec16  column-major ``[dim][token]``        rows ``[token][dim]``
amx         tiles of 16 tokens, private inside   ``[dim / 16][token / 2][...]`` (pairs)
==========  ===================================  =================================

The layout carries that as run orders (``KvRunOrder``: dims in groups
outermost, tokens in tiles), so the planner cuts runs by token and P and D may
use different block sizes. It still sets ``opaque_blocks``, so a sidecar that
predates run orders refuses a pairing it cannot map instead of moving the wrong
bytes; an ISA missing from ``CPU_RUN_ORDERS`` (neon, vsx, ...) gets no run
orders: whole (block, head) runs, one block size on both sides.

A backend missing from ``BACKEND_PACKING`` is refused at start-up by name
(``LayoutError ERR_LAYOUT_UNSUPPORTED``): guessing a packing would move the
wrong bytes. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._gen.kvxfer.v1 import layout_pb2
from .errors import LayoutError
from .groups import GroupSpec

BACKEND_PACKING: dict[str, str] = {
    "CPU_ATTN": "kv_in_tokens",
    "FLASH_ATTN": "kv_in_cell",
    "TRITON_ATTN": "kv_in_cell",
    "FLASHINFER": "kv_in_heads",
    "FLASHMLA": "latent",
    "FLASH_ATTN_MLA": "latent",
    "TRITON_MLA": "latent",
    "CUTLASS_MLA": "latent",
    "FLASHINFER_MLA": "latent",
    "CPU_MLA": "latent",
    # vLLM-CPU picks AMX_MLA over CPU_MLA wherever the CPU has AMX tiles; its cache writer
    # (concat_and_cache_mla_cpu) stores plain latent rows, probed in tests/test_layout.py.
    "AMX_MLA": "latent",
}
PACKINGS = ("kv_in_tokens", "kv_in_cell", "kv_in_heads", "latent")

#: CPU attention ISA -> (K, V) run orders as (dim group, token tile); a dim group of 0 is the head
#: size (plain rows). Only ISAs whose order was probed from the kernel are here.
CPU_RUN_ORDERS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "vec": ((1, 1), (0, 1)),
    "vec16": ((1, 1), (0, 1)),
    "amx": ((0, 16), (16, 2)),
}


def cpu_run_orders(isa: str | None, head_size: int) -> list[layout_pb2.KvRunOrder]:
    """The K and V run orders of CPU attention with ``isa``, or [] when unknown (whole blocks only)."""
    orders = CPU_RUN_ORDERS.get(isa or "")
    if orders is None:
        return []
    return [layout_pb2.KvRunOrder(dim_group=g or head_size, token_tile=t) for g, t in orders]


def packing_of(backend_name: str) -> str:
    packing = BACKEND_PACKING.get(backend_name)
    if packing is None:
        raise LayoutError(
            "ERR_LAYOUT_UNSUPPORTED",
            f"attention backend {backend_name} is not one kvxfer can map (known: "
            f"{', '.join(sorted(BACKEND_PACKING))}); pick one of those with --attention-backend",
        )
    return packing


@dataclass(frozen=True)
class TensorView:
    """One layer's KV view, as numbers: elements of ``itemsize`` bytes, ``offset`` bytes into its region."""

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    itemsize: int
    dtype: str
    region: int = 0


@dataclass(frozen=True)
class DescribedLayout:
    layout: layout_pb2.KvLayout
    #: Layer names in slot order (unique tensors; layers sharing another's KV are left out).
    layers: list[str]
    #: kvxfer blocks per vLLM (scheduler) block: > 1 when the backend splits blocks.
    blocks_per_block: int


def layer_index(name: str) -> int:
    """``model.layers.12.self_attn.attn`` -> 12 (the first number in the name)."""
    m = re.search(r"\.(\d+)\.", f".{name}.")
    if m is None:
        raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"KV cache layer {name!r} has no layer number")
    return int(m.group(1))


def kv_heads_per_rank(total_kv_heads: int, tp_size: int, mla: bool) -> int:
    if mla or tp_size >= total_kv_heads:
        return 1
    return total_kv_heads // tp_size


def describe(
    views: list[TensorView],
    *,
    packing: str,
    head_size: int,
    total_kv_heads: int,
    tp_size: int,
    tp_rank: int,
    block_size: int,
    region_bytes: list[int],
    cpu_isa: str | None = None,
) -> DescribedLayout:
    """The kvxfer layout of one rank. ``block_size`` is vLLM's (scheduler) block size; ``cpu_isa``
    the CPU attention's ISA (``layer.isa``) for ``kv_in_tokens``, which fixes its run orders."""
    if packing not in PACKINGS:
        raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"packing {packing!r} is not one of {PACKINGS}")
    if not views:
        raise LayoutError("ERR_LAYOUT_UNSUPPORTED", "the engine registered no KV cache tensors")
    mla = packing == "latent"
    # Layers that share another layer's KV (cross-layer sharing) move once.
    seen: dict[tuple[int, int], str] = {}
    unique: list[TensorView] = []
    for v in sorted(views, key=lambda v: (layer_index(v.name), v.name)):
        key = (v.region, v.offset)
        if key in seen:
            continue
        seen[key] = v.name
        unique.append(v)
    first = unique[0]
    e = first.itemsize
    hpr = kv_heads_per_rank(total_kv_heads, tp_size, mla)
    slots: list[layout_pb2.KvSlotAddress] = []
    strides: tuple[int, int, int] | None = None
    num_blocks = tokens = 0
    for v in unique:
        where = f"layer {v.name}"
        if len(v.shape) != 4 or len(v.stride) != 4:
            raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"{where}: expected a [blocks, heads, tokens, cell] view, got shape {v.shape}")
        if (v.itemsize, v.dtype) != (e, first.dtype):
            raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"{where}: dtype {v.dtype} differs from {first.dtype}")
        b, h, n, c = v.shape
        sb, sh, sn, sc = v.stride
        if sc != 1:
            raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"{where}: cell elements are not contiguous (stride {sc})")
        want_heads = 2 * hpr if packing == "kv_in_heads" else hpr
        want_cell = {"kv_in_tokens": 2 * head_size, "kv_in_cell": 2 * head_size, "kv_in_heads": head_size, "latent": head_size}[packing]
        if h != want_heads:
            raise LayoutError(
                "ERR_LAYOUT_MISMATCH",
                f"{where}: {h} head slots, but {total_kv_heads} KV heads over TP {tp_size} with packing {packing} make {want_heads}",
            )
        if c != want_cell:
            raise LayoutError("ERR_LAYOUT_MISMATCH", f"{where}: cell of {c} elements, packing {packing} with head size {head_size} needs {want_cell}")
        row = head_size * e
        if packing == "kv_in_tokens":
            # The backend re-reads each (block, head) run of n cells as 2n rows: K rows, then V rows.
            if sn != c or sh < n * c:
                raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"{where}: a (block, head) run is not one dense [tokens][cell] block (strides {v.stride})")
            k, vv, hs, ts = v.offset, v.offset + n * row, sh * e, row
        elif packing == "kv_in_cell":
            k, vv, hs, ts = v.offset, v.offset + row, sh * e, sn * e
        elif packing == "kv_in_heads":
            k, vv, hs, ts = v.offset, v.offset + hpr * sh * e, sh * e, sn * e
        else:
            k, vv, hs, ts = v.offset, None, sh * e, sn * e
        this = (sb * e, hs, ts)
        if strides is None:
            strides, num_blocks, tokens = this, b, n
        elif (this, b, n) != (strides, num_blocks, tokens):
            raise LayoutError(
                "ERR_LAYOUT_UNSUPPORTED",
                f"{where}: blocks/strides {b}, {n}, {this} differ from layer {first.name}'s {num_blocks}, {tokens}, {strides}",
            )
        slots.append(layout_pb2.KvSlotAddress(region=v.region, offset=k))
        if vv is not None:
            slots.append(layout_pb2.KvSlotAddress(region=v.region, offset=vv))
    assert strides is not None
    if block_size % tokens != 0:
        raise LayoutError("ERR_LAYOUT_MISMATCH", f"vLLM block size {block_size} is not a multiple of the tensors' {tokens} tokens per block")
    block_stride, head_stride, token_stride = strides
    order = layout_pb2.KV_BLOCK_ORDER_HND if head_stride >= token_stride or hpr == 1 else layout_pb2.KV_BLOCK_ORDER_NHD
    layout = layout_pb2.KvLayout(
        num_layers=len(unique),
        mla=mla,
        total_kv_heads=1 if mla else total_kv_heads,
        head_dim=head_size,
        dtype=first.dtype,
        dtype_bytes=e,
        block_size=tokens,
        num_blocks=num_blocks,
        order=order,
        tp_size=tp_size,
        tp_rank=tp_rank,
        block_stride=block_stride,
        slots=slots,
        region_bytes=region_bytes,
        head_stride=head_stride,
        token_stride=token_stride,
        opaque_blocks=packing == "kv_in_tokens",
        run_orders=cpu_run_orders(cpu_isa, head_size) if packing == "kv_in_tokens" else [],
    )
    return DescribedLayout(layout=layout, layers=[v.name for v in unique], blocks_per_block=block_size // tokens)


def expand_block_ids(block_ids: list[int], blocks_per_block: int) -> list[int]:
    """vLLM block ids -> kvxfer block ids when the backend splits each block into ``blocks_per_block``."""
    if blocks_per_block == 1:
        return list(block_ids)
    return [b * blocks_per_block + j for b in block_ids for j in range(blocks_per_block)]


def describe_state(
    views: list[TensorView],
    *,
    tp_size: int,
    tp_rank: int,
    region_bytes: list[int],
) -> DescribedLayout:
    """The kvxfer layout of a state group (Mamba, linear attention) on one rank: each layer's view
    is ``[blocks, 1, 1, bytes]`` of one state per block (vLLM's raw state pages: the state's
    tensors, then padding up to the block stride). One slot per layer; a block of one token holding
    one "latent" of the state's bytes, so a transfer moves a slot's state and nothing of its
    padding. ``blocks_per_block`` is 1: vLLM never splits a state block."""
    if not views:
        raise LayoutError("ERR_LAYOUT_UNSUPPORTED", "a state group registered no tensors")
    slots: list[layout_pb2.KvSlotAddress] = []
    first = views[0]
    shape: tuple[int, int, int] | None = None
    for v in sorted(views, key=lambda v: (layer_index(v.name), v.name)):
        where = f"layer {v.name}"
        if len(v.shape) != 4 or v.shape[1:3] != (1, 1) or v.stride[3] != 1:
            raise LayoutError("ERR_LAYOUT_UNSUPPORTED",
                              f"{where}: expected a [blocks, 1, 1, bytes] state view, got shape {v.shape} strides {v.stride}")
        this = (v.shape[0], v.shape[3] * v.itemsize, v.stride[0] * v.itemsize)
        if shape is None:
            shape = this
        elif this != shape:
            raise LayoutError("ERR_LAYOUT_UNSUPPORTED",
                              f"{where}: blocks/bytes/stride {this} differ from layer {first.name}'s {shape}")
        slots.append(layout_pb2.KvSlotAddress(region=v.region, offset=v.offset))
    assert shape is not None
    num_blocks, state_bytes, block_stride = shape
    layout = layout_pb2.KvLayout(
        num_layers=len(slots),
        mla=True,
        total_kv_heads=1,
        head_dim=state_bytes,
        dtype="uint8",
        dtype_bytes=1,
        block_size=1,
        num_blocks=num_blocks,
        order=layout_pb2.KV_BLOCK_ORDER_HND,
        tp_size=tp_size,
        tp_rank=tp_rank,
        block_stride=block_stride,
        slots=slots,
        region_bytes=region_bytes,
    )
    return DescribedLayout(layout=layout, layers=[v.name for v in views], blocks_per_block=1)


GROUP_KIND_PB = {
    "full": layout_pb2.KV_GROUP_KIND_FULL,
    "sliding": layout_pb2.KV_GROUP_KIND_SLIDING,
    "state": layout_pb2.KV_GROUP_KIND_STATE,
}


def group_message(kind: str, described: DescribedLayout, *, sliding_window: int = 0,
                  state_shape: str = "") -> layout_pb2.KvCacheGroup:
    """One group as ``RegisterKvCache.groups`` carries it (its layout's tp_rank 0)."""
    g = layout_pb2.KvCacheGroup(kind=GROUP_KIND_PB[kind], sliding_window=sliding_window if kind == "sliding" else 0,
                                state_shape=state_shape if kind == "state" else "")
    g.layout.CopyFrom(described.layout)
    g.layout.tp_rank = 0
    return g


def describe_groups(
    groups: list[GroupSpec],
    views: list[TensorView],
    *,
    packings: list[str | None],
    head_sizes: list[int],
    total_kv_heads: int,
    tp_size: int,
    region_bytes: list[int],
    cpu_isas: list[str | None] | None = None,
) -> list[DescribedLayout]:
    """Each KV cache group's layout on one rank (hybrid models): attention groups as their
    backend (``packings[g]``) lays them out, state groups as raw state pages. Groups overlay one
    allocation (vLLM's hybrid manager), so a group's layout holds only its own layers' slots."""
    by_name = {v.name: v for v in views}
    out = []
    for g, spec in enumerate(groups):
        mine = [by_name[n] for n in spec.layer_names if n in by_name]
        if not mine:
            raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"KV cache group {g} ({spec.kind}) registered no tensors")
        if spec.kind == "state":
            out.append(describe_state(mine, tp_size=tp_size, tp_rank=0, region_bytes=region_bytes))
            continue
        packing = packings[g]
        if packing is None:
            raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"KV cache group {g} ({spec.kind}) has no attention backend")
        out.append(describe(
            mine,
            packing=packing,
            head_size=head_sizes[g],
            total_kv_heads=1 if packing == "latent" else total_kv_heads,
            tp_size=tp_size,
            tp_rank=0,
            block_size=spec.block_size,
            region_bytes=region_bytes,
            cpu_isa=(cpu_isas or [None] * len(groups))[g],
        ))
    return out
