"""From an engine rank's KV tensors to the ``RegisterKvCache`` the sidecar takes.

Shared by the adapter (``register_kv_caches``) and the tests, which build their
tensors with vLLM's own allocation functions; torch only, no vLLM import.
"""

from __future__ import annotations

import torch

from ._gen.kvxfer.v1 import engine_pb2, layout_pb2
from .layout import DescribedLayout, TensorView
from .shm import SharedKv


def tensor_views(kv_caches: dict[str, torch.Tensor], files: SharedKv) -> list[TensorView]:
    """Each tensor as numbers, placed in the shared-memory file that holds it (LayoutError if none)."""
    views = []
    for name, t in kv_caches.items():
        region, offset = files.locate(t)
        views.append(
            TensorView(
                name=name,
                shape=tuple(t.shape),
                stride=tuple(t.stride()),
                offset=offset,
                itemsize=t.element_size(),
                dtype=str(t.dtype).removeprefix("torch."),
                region=region,
            )
        )
    return views


#: One region as rank 0 gathers it: (path, offset, length, segment id or None for a file, CUDA IPC
#: handle or b"" for host memory, CUDA device as the sidecar numbers it). A CUDA region's offset
#: is into the allocation its handle names (placement ``device``, ``device.py``).
RegionEntry = tuple[str, int, int, int | None, bytes, int]


def region_files(files: SharedKv) -> list[RegionEntry]:
    """This rank's regions, in region order (what rank 0 gathers)."""
    return files.regions()


def registration(
    engine_id: str, described: DescribedLayout, every_rank: list[list[RegionEntry]],
    groups: list[layout_pb2.KvCacheGroup] | None = None,
) -> engine_pb2.RegisterKvCache:
    """The registration of every rank's regions. ``groups``: the engine's KV cache groups (hybrid
    models, ``layout.group_message``); ``described`` is then group 0's layout."""
    layout = engine_pb2.RegisterKvCache(engine_id=engine_id)
    layout.layout.CopyFrom(described.layout)
    layout.layout.tp_rank = 0
    for g in groups or ():
        layout.groups.append(g)
    for rank, files in enumerate(every_rank):
        layout.ranks.append(
            engine_pb2.RankKvCache(
                rank=rank, regions=[_region(*f) for f in files]
            )
        )
    return layout


def _region(
    path: str, offset: int, length: int, segment: int | None, cuda_handle: bytes = b"", cuda_device: int = 0
) -> engine_pb2.RegionFile:
    if cuda_handle:
        return engine_pb2.RegionFile(offset=offset, length=length, cuda_ipc_handle=cuda_handle, cuda_device=cuda_device)
    if segment is not None:
        return engine_pb2.RegionFile(length=length, segment=segment)
    return engine_pb2.RegionFile(path=path, offset=offset, length=length)
