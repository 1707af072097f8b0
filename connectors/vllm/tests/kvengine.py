"""An engine's KV cache as vLLM 0.32 lays it out, without an engine: the tests allocate it with
vLLM's own ``create_kv_cache_views`` inside the connector's shared-memory placement, describe it
with the connector's code, and register it with a real sidecar through ``WorkerLogic``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    MLAAttentionSpec,
    create_kv_cache_views,
)

from kvxfer_vllm.layout import describe
from kvxfer_vllm.registration import region_files, registration, tensor_views
from kvxfer_vllm.shm import HostBuffer, SharedKv, SharedKvFiles, SharedKvSegments
from kvxfer_vllm.worker import WorkerLogic

#: backend name -> (packing, vLLM layout its kernels read)
BACKENDS = {
    "CPU_ATTN": ("kv_in_tokens", KVCacheLayout.LBHNC),
    "FLASH_ATTN": ("kv_in_cell", KVCacheLayout.LBNHC),
    # Cross-layer ("block outermost"): one block holds every layer's page.
    "FLASH_ATTN/cross-layer": ("kv_in_cell", KVCacheLayout.BLNHC),
    "FLASHMLA": ("latent", KVCacheLayout.LBHNC),
}


@dataclass
class Model:
    layers: int = 2
    total_kv_heads: int = 2
    head_size: int = 32
    dtype: torch.dtype = torch.bfloat16


class KvEngine:
    """All TP ranks of one engine: per rank, one shared file (or, ``kv_memory="segment"``, one
    segment its sidecar on ``socket`` allocates) holding every layer's KV."""

    def __init__(self, shm_dir: str, engine_id: str, *, backend: str, tp: int, block_size: int,
                 num_blocks: int, model: Model = Model(), host_buffer: bool = False,
                 kv_memory: str = "file", socket: str | None = None) -> None:
        self.engine_id = engine_id
        self.packing, layout = BACKENDS[backend]
        mla = self.packing == "latent"
        heads = 1 if mla else max(1, model.total_kv_heads // tp)
        if mla:
            spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=model.head_size, dtype=model.dtype)
        else:
            spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=model.head_size, dtype=model.dtype)
        page = spec.page_size_bytes
        names = [f"model.layers.{i}.self_attn.attn" for i in range(model.layers)]
        size = page * num_blocks * model.layers
        self.files: list[SharedKv] = []
        #: The engine's own KV per rank (device memory in host-buffer mode; here plain memory).
        self.ranks: list[dict[str, torch.Tensor]] = []
        #: host_buffer placement: the shared mirror per rank, copied to and from ``ranks``.
        self.hosts: list[HostBuffer] = []
        for rank in range(tp):
            files: SharedKv
            if kv_memory == "segment":
                assert socket is not None, "segments come from a sidecar: give its socket"
                files = SharedKvSegments(socket, engine_id, rank, tp, timeout_s=20.0)
            else:
                files = SharedKvFiles(shm_dir, engine_id, rank)
            if host_buffer:
                raw = torch.zeros(size, dtype=torch.int8)
            else:
                with files.placement():
                    raw = torch.zeros(size, dtype=torch.int8)
            if layout.is_block_outermost:
                t = KVCacheTensor(size=size, layers=names, layer_stride=page, block_stride=page * model.layers)
            else:
                t = KVCacheTensor(size=size, layers=names, layer_stride=page * num_blocks, block_stride=page)
            self.files.append(files)
            self.ranks.append(dict(zip(names, create_kv_cache_views(raw, spec, num_blocks, layout, t))))
            if host_buffer:
                self.hosts.append(HostBuffer(files))
                self.hosts[-1].mirror(self.ranks[-1])
        shared0 = self.hosts[0].host if host_buffer else self.ranks[0]
        self.described = describe(
            tensor_views(shared0, self.files[0]),
            packing=self.packing,
            head_size=model.head_size,
            total_kv_heads=1 if mla else model.total_kv_heads,
            tp_size=tp,
            tp_rank=0,
            block_size=block_size,
            region_bytes=[f.nbytes for f in self.files[0].files],
        )
        self.worker: WorkerLogic | None = None

    def connect(self, socket: str, *, lost_timeout_s: float = 10.0) -> WorkerLogic:
        hosts = self.hosts

        def each(fn_name: str):
            return (lambda ids: [getattr(h, fn_name)(ids) for h in hosts]) if hosts else None

        self.worker = WorkerLogic(
            engine_id=self.engine_id,
            engine_socket=socket,
            register_timeout_s=20.0,
            sidecar_lost_timeout_s=lost_timeout_s,
            max_frame_bytes=16 << 20,
            on_kv_ready=each("to_device"),
            before_prefill_done=each("to_host"),
        )
        self.worker.register(self.registration())
        return self.worker

    def registration(self):
        return registration(self.engine_id, self.described, [region_files(f) for f in self.files])

    def fill_random(self, seed: int) -> None:
        """Random bytes in the engine's own KV (the shared files, or device memory with a host buffer)."""
        g = torch.Generator().manual_seed(seed)
        for rank in self.ranks:
            base = next(iter(rank.values()))
            raw = torch.as_strided(base.view(torch.int8), (base.untyped_storage().nbytes(),), (1,), 0)
            raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=g))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        for f in self.files:
            # Segments: detached here, the engine's tensors are not touched after close.
            f.detach() if isinstance(f, SharedKvSegments) else f.close()
