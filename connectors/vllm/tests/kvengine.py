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

    def connect(self, socket: str, *, lost_timeout_s: float = 10.0, layer_wise: bool = False) -> WorkerLogic:
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
            layer_names=self.described.layers if layer_wise else None,
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


#: A hybrid model's groups for HybridKvEngine: (kind, layers) in group order.
HYBRID_GROUPS = (("full", 1), ("sliding", 2), ("state", 1))


class HybridKvEngine:
    """All TP ranks of one engine of a hybrid model, as vLLM 0.32's hybrid KV cache manager lays
    it out (vLLM's own ``allocate_kv_cache``): one allocation per rank that the groups overlay
    (one block pool: a block id belongs to one group at a time), full-attention, sliding-window
    and Mamba-state layers, the state page padded to the attention page. Registered with its groups
    through ``WorkerLogic``, as the adapter registers a hybrid engine."""

    def __init__(self, shm_dir: str, engine_id: str, *, backend: str, tp: int, block_size: int, num_blocks: int,
                 groups: tuple[tuple[str, int], ...] = HYBRID_GROUPS, window: int = 64, heads: int = 2,
                 head_size: int = 32) -> None:
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
        from vllm.v1.worker.utils import allocate_kv_cache

        from kvxfer_vllm.groups import GroupSpec
        from kvxfer_vllm.layout import describe_groups, group_message

        self.engine_id = engine_id
        self.packing, layout = BACKENDS[backend]
        per_rank = max(1, heads // tp)
        full = FullAttentionSpec(block_size=block_size, num_kv_heads=per_rank, head_size=head_size, dtype=torch.bfloat16)
        sw = SlidingWindowSpec(block_size=block_size, num_kv_heads=per_rank, head_size=head_size, dtype=torch.bfloat16,
                               sliding_window=window)
        page = full.page_size_bytes
        # A state sharded over TP as vLLM shards GDN's: each rank holds its share of the heads.
        state = MambaSpec(block_size=block_size, shapes=((3, 64 // tp), (2 // tp or 1, 16, 16)),
                          dtypes=(torch.bfloat16, torch.float32), page_size_padded=page)
        self.state_bytes = state.state_content_size_bytes
        specs = {"full": full, "sliding": sw, "state": state}
        self.group_layers: list[list[str]] = []
        i = 0
        for kind, n in groups:
            self.group_layers.append([f"model.layers.{i + j}.{'mamba' if kind == 'state' else 'attn'}" for j in range(n)])
            i += n
        # vLLM's overlay: the j-th layer of every group shares the j-th layer slot of the allocation.
        slots = max(n for _, n in groups)
        size = page * num_blocks * slots
        tensors = [KVCacheTensor(size=size, layers=layers, layer_stride=page * num_blocks, block_stride=page)
                   for layers in self.group_layers]
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                            kv_cache_groups=[KVCacheGroupSpec(list(layers), specs[kind])
                                             for (kind, _), layers in zip(groups, self.group_layers)])
        self.groups = [GroupSpec(kind, block_size, tuple(layers), sliding_window=window if kind == "sliding" else 0,
                                 state_shape=f"tp{tp}" if kind == "state" else "")
                       for (kind, _), layers in zip(groups, self.group_layers)]
        self.files: list[SharedKv] = []
        self.ranks: list[dict[str, torch.Tensor]] = []
        for rank in range(tp):
            files = SharedKvFiles(shm_dir, engine_id, rank)
            with files.placement():
                self.ranks.append(allocate_kv_cache(cfg, torch.device("cpu"), layout, [block_size] * len(groups)))
            self.files.append(files)
        described = describe_groups(
            self.groups, tensor_views(self.ranks[0], self.files[0]),
            packings=[None if k == "state" else self.packing for k, _ in groups],
            head_sizes=[head_size] * len(groups), total_kv_heads=heads, tp_size=tp,
            region_bytes=[f.nbytes for f in self.files[0].files], cpu_isas=["vec"] * len(groups))
        self.described = described[0]
        self.group_messages = [group_message(g.kind, d, sliding_window=g.sliding_window, state_shape=g.state_shape)
                               for g, d in zip(self.groups, described)]
        self.worker: WorkerLogic | None = None

    def connect(self, socket: str) -> WorkerLogic:
        self.worker = WorkerLogic(engine_id=self.engine_id, engine_socket=socket, register_timeout_s=20.0,
                                  sidecar_lost_timeout_s=10.0, max_frame_bytes=16 << 20,
                                  group_blocks_per_block=[1] * len(self.groups))
        self.worker.register(registration(self.engine_id, self.described, [region_files(f) for f in self.files],
                                          self.group_messages))
        return self.worker

    def raw(self, rank: int) -> torch.Tensor:
        """The rank's whole allocation as bytes."""
        return self.files[rank].files[0].tensor.view(torch.uint8)

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for r in range(len(self.ranks)):
            raw = self.raw(r)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        for f in self.files:
            f.close()
