"""The thin adapter: vLLM's V1 KV connector API, delegated by role.

This is the only module that imports vLLM. Load it with::

    --kv-transfer-config '{"kv_connector": "KvxferConnector",
                           "kv_connector_module_path": "kvxfer_vllm.connector",
                           "engine_id": "<the sidecar's --engine-id>",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute"}'

vLLM builds one instance per role: the scheduler role (engine-core process)
delegates to ``SchedulerLogic``; the worker role (each TP rank) places the KV
cache in shared memory and, on rank 0, delegates to ``WorkerLogic``, which
talks to the sidecar for every rank.
"""

from __future__ import annotations

import logging
import queue
import sys
from collections.abc import Container
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.platforms import current_platform

from . import timeline
from .config import ConnectorConfig, load_config
from .device import DeviceKv, TorchCuda
from .errors import ConfigError, LayoutError
from .groups import GroupSpec
from .idle import UNWATCHED_BOUND_S, IdleWaiter, WorkerRest, limit_engine_spin, wait_bound, waker
from .layout import DescribedLayout, describe, describe_groups, expand_block_ids, group_message, packing_of
from .messages import StepMessages
from .registration import RegionEntry, region_files, registration, tensor_views
from .scheduler import Scheduled, SchedulerLogic
from .shm import HostBuffer, SharedKv, SharedKvFiles, SharedKvSegments
from .stats import COUNTERS, merge, reduce
from .versions import check_vllm_version
from .worker import WorkerLogic

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """kvxfer_vllm's loggers write where vLLM's do, at vLLM's level (VLLM_LOGGING_LEVEL)."""
    ours, theirs = logging.getLogger("kvxfer_vllm"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level)
    ours.propagate = False


_log_like_vllm()


@dataclass
class KvxferConnectorMetadata(KVConnectorMetadata):
    step: StepMessages = field(default_factory=StepMessages)
    #: The step runs no model (nothing scheduled): the worker may wait a little for the sidecar.
    idle: bool = False
    #: The scheduler waited for the sidecar before this idle step (idle.py): the worker need not
    #: wait again, and may sleep, not spin, until the next step comes.
    waited: bool = False


#: How long an idle engine step waits for the sidecar (see WorkerLogic.take_results).
IDLE_WAIT_S = 0.005


@dataclass
class KvxferHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: where D must dial this engine's sidecar."""

    side_channel: str
    epoch: int
    #: kvxfer blocks per vLLM block (the attention backend's split), for P's answers; one per KV
    #: cache group for hybrid models.
    blocks_per_block: int | list[int] = 1


@dataclass
class KvxferConnectorStats(KVConnectorStats):
    """The counters of stats.py as vLLM carries them from the workers (and the scheduler) to its
    logger process: ``data`` is a plain dict of numbers, summed by ``aggregate``."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: Prometheus counter per kvxfer counter, in vLLM's /metrics (``_total`` is added by the client).
PROM_COUNTERS = {
    "transfers": ("vllm:kvxfer_transfers", "KV transfers completed through kvxfer (D: loaded; P: sent)."),
    "bytes": ("vllm:kvxfer_transfer_bytes", "KV bytes of the completed kvxfer transfers."),
    "seconds": ("vllm:kvxfer_transfer_seconds", "D: seconds from ExpectKv to KV ready, summed over transfers."),
    "failures": ("vllm:kvxfer_transfer_failures", "kvxfer transfers that failed, any reason."),
    "expired": ("vllm:kvxfer_transfers_expired", "kvxfer transfers failed because a lease or deadline ran out."),
    "recomputed": ("vllm:kvxfer_recomputed_requests", "D requests computed locally instead of loading KV."),
    "link_down": ("vllm:kvxfer_link_down_requests", "Requests failed at once because the sidecar link was down."),
    "mismatched": ("vllm:kvxfer_prompt_mismatches", "D requests whose prompt did not match P's kvxfer_prompt_digest."),
}
assert set(PROM_COUNTERS) == set(COUNTERS)


class KvxferPromMetrics(KVConnectorPromMetrics):
    """One counter per kvxfer counter and engine (vLLM's labels), fed by ``observe``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in PROM_COUNTERS.items():
            c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = {i: c.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and engine_idx in per_engine and value > 0:
                per_engine[engine_idx].inc(value)


def _bytes_per_token(layout: Any) -> int:
    """KV bytes of one token on one rank: the rank's regions over its token slots."""
    slots = layout.num_blocks * layout.block_size
    return sum(layout.region_bytes) // slots if slots else 0


def _allow_amx_tiles() -> None:
    """Asks Linux for the AMX tile state for this process, where the CPU has AMX tiles.

    vLLM's CPU attention takes its AMX kernel for bfloat16 KV in blocks of 32 whenever the CPU
    reports AMX tiles, but vLLM 0.32 never requests the tile state (``arch_prctl`` with
    ``ARCH_REQ_XCOMP_PERM``); Linux then kills the first tile instruction with SIGILL unless
    something else in the process asked first (oneDNN does, for a large enough bfloat16 matrix
    product). A decode engine whose first step follows a KV transfer runs one token through
    attention before any such product: measured here, its worker died with SIGILL in
    ``cpu_attention_with_kv_cache`` on a Xeon with ``amx_tile``, and asking first fixed it.
    Asking is harmless where AMX is absent or already allowed.
    """
    cpu = getattr(torch, "cpu", None)
    supported = getattr(cpu, "_is_amx_tile_supported", None)
    request = getattr(cpu, "_init_amx", None)
    if supported is None or request is None or not supported():
        return
    if not request():
        log.warning("kvxfer: the CPU has AMX tiles but Linux refused their state; "
                       "vLLM's AMX attention may fail with SIGILL")


def _spec_kind(spec: Any) -> str:
    """A vLLM KV cache spec's group kind for kvxfer (groups.py); ConfigError for one it cannot move.
    Exact types: vLLM's subclasses (chunked-local, sink, RSWA attention, ...) keep other blocks."""
    from vllm.v1 import kv_cache_interface as kci

    kinds = {kci.FullAttentionSpec: "full", kci.MLAAttentionSpec: "full", kci.SlidingWindowSpec: "sliding",
             kci.SlidingWindowMLASpec: "sliding", kci.MambaSpec: "state"}
    kind = kinds.get(type(spec))
    if kind is None:
        raise ConfigError("ERR_CONFIG", f"kvxfer cannot move KV of a {type(spec).__name__} cache group "
                                        "(it moves full, sliding-window and MLA attention, and Mamba / linear-attention state)")
    return kind


def _shape_name(spec: Any) -> str:
    """A state's tensors by dtype and shape: ``bfloat16[3,1024];float32[4,128,128]``."""
    return ";".join(f"{str(d).removeprefix('torch.')}[{','.join(map(str, sh))}]" for sh, d in zip(spec.shapes, spec.dtypes))


def group_specs(kv_cache_config: KVCacheConfig) -> list[GroupSpec]:
    """The KV cache groups that take part in a transfer (vLLM's ``transfer_groups``), as numbers."""
    out = []
    for g in kv_cache_config.transfer_groups:
        spec = g.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one type, by layer
        if inner:
            kinds = {_spec_kind(x) for x in inner.values()}
            if len(kinds) != 1:
                raise ConfigError("ERR_CONFIG", f"KV cache group of layers {g.layer_names} mixes {sorted(kinds)}")
            first = next(iter(inner.values()))
        else:
            first = spec
        kind = _spec_kind(first)
        out.append(GroupSpec(
            kind=kind,
            block_size=spec.block_size,
            layer_names=tuple(g.layer_names),
            sliding_window=(getattr(first, "sliding_window", 0) or 0) if kind == "sliding" else 0,
            state_shape=_shape_name(first) if kind == "state" else "",
            speculative_blocks=getattr(first, "num_speculative_blocks", 0) if kind == "state" else 0,
        ))
    return out


def _scheduled(out: SchedulerOutput | None, wanted: Container[str],
               select: Any = tuple) -> dict[str, Scheduled]:
    """The ``wanted`` requests this step computes, as SchedulerLogic.build_step takes them (vLLM
    0.32's fields; an output without them gives none, and P's PrefillDone then waits for vLLM to
    finish the request). ``select``: a step's per-group blocks -> the transfer groups' tables."""
    counts = getattr(out, "num_scheduled_tokens", None)
    new = getattr(out, "scheduled_new_reqs", None)
    cached = getattr(out, "scheduled_cached_reqs", None)
    if counts is None or new is None or cached is None:
        return {}
    got = {r.req_id: Scheduled(r.num_computed_tokens + counts.get(r.req_id, 0)) for r in new if r.req_id in wanted}
    for i, rid in enumerate(cached.req_ids):
        if rid not in wanted:
            continue
        blocks = cached.new_block_ids[i]
        got[rid] = Scheduled(cached.num_computed_tokens[i] + counts.get(rid, 0),
                             [list(b) for b in select(blocks)] if blocks else [],
                             replace=rid in cached.resumed_req_ids)
    return got


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise ConfigError("ERR_CONFIG", "kvxfer does not move KV between pipeline-parallel stages (pipeline_parallel_size > 1)")
        if getattr(pc, "decode_context_parallel_size", 1) > 1 or getattr(pc, "prefill_context_parallel_size", 1) > 1:
            raise ConfigError("ERR_CONFIG", "kvxfer does not support context parallelism (decode/prefill_context_parallel_size > 1)")
        self.cfg: ConnectorConfig = load_config(ktc.engine_id, ktc.kv_connector_extra_config, current_platform.device_type)
        self.tp_size = pc.tensor_parallel_size
        self.scheduler: SchedulerLogic | None = None
        self.worker: WorkerLogic | None = None
        self._files: SharedKv | None = None
        self._host: HostBuffer | None = None
        self._rank = 0
        self._blocks_per_block = 1
        #: Scheduler: the wait of an idle step (idle.py); None where it cannot run.
        self._idle: IdleWaiter | None = None
        self._idle_attached = False
        #: Scheduler: the engine core's spin on its workers' answers was limited (idle.py).
        self._spin_limited = False
        self._engine_core: Any = None
        #: Worker (every rank): ends the worker's spin once its engine has gone quiet (idle.py);
        #: made at the first step, False where it cannot run.
        self._rest: WorkerRest | bool | None = None
        #: Send each step's messages when vLLM binds the step's metadata, before the forward, not
        #: in start_load_kv: vLLM 0.32 calls that after the forward is launched, which on a CPU
        #: engine means after the whole forward has run. P's PrefillDone then waited for P's next
        #: step to finish (a 2 x 1024-token prefill here: ~780 ms), and D's read waited with it
        #: for P's acknowledgement (journal/vllm.md, "The step P's PrefillDone waited for"). On a
        #: GPU the launch returns at once and the device hooks expect the step's kernels queued.
        self._send_at_bind = current_platform.device_type == "cpu"
        #: The KV cache groups that move (hybrid models: several, each its own kind and layout).
        self._groups = group_specs(kv_cache_config) if kv_cache_config is not None else []
        self._hybrid = len(self._groups) > 1 or any(g.kind != "full" for g in self._groups)
        #: Layer-wise push (``layer_wise``), where it can run; else whole-request push, said once.
        refusal = self._layer_wise_refusal() if self.cfg.layer_wise else None
        self._layer_wise = self.cfg.layer_wise and refusal is None
        if refusal is not None and role == KVConnectorRole.SCHEDULER:
            log.warning("kvxfer: layer_wise is set but %s: pushing each request whole", refusal)
        if role == KVConnectorRole.WORKER and current_platform.device_type == "cpu":
            _allow_amx_tiles()
        if role == KVConnectorRole.SCHEDULER:
            # P's PrefillDone when the forward that completes the prompt has run (wait_for_save), a
            # step before vLLM finishes the request: on a CPU engine that hook runs after the forward.
            self.scheduler = SchedulerLogic(engine_id=self.cfg.engine_id, tp_size=self.tp_size, advertise=self.cfg.advertise,
                                            early_prefill_done=self._send_at_bind, groups=self._groups or None,
                                            layer_wise=self._layer_wise)
            # Data parallel engines step in waves together: not waited in (vLLM's own loop).
            self._idle = _idle_waiter(self.cfg) if getattr(pc, "data_parallel_size", 1) == 1 else None

    def _layer_wise_refusal(self) -> str | None:
        """Why layer-wise push cannot run on this engine, or None. It needs the forward to have
        really run when ``save_kv_layer`` is called (a CPU engine: on a GPU the kernels are only
        queued then), one KV cache group, one rank (rank 0 speaks for all, and another rank's
        layer is not known saved) and the KV where the sidecar reads it (placement ``shared``)."""
        if not self._send_at_bind:
            return f"it needs a CPU engine (this one is {current_platform.device_type!r})"
        if self._hybrid:
            return "the model has several KV cache groups"
        if self.tp_size != 1:
            return f"tensor parallel size is {self.tp_size} (it needs 1)"
        if self.cfg.placement != "shared":
            return f"placement is {self.cfg.placement!r} (it needs 'shared')"
        return None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+: sleep mode remaps the KV cache, which the sidecar has mapped by path;
        an engine that sleeps must not keep this connector."""
        return False

    # ==== worker role ==========================================================================

    def _tp_rank(self) -> int:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        if self.cfg.placement != "shared":
            return None
        self._rank = self._tp_rank()
        self._files = self._shared_kv()
        return self._files.placement()

    def _shared_kv(self) -> SharedKv:
        if self.cfg.kv_memory == "segment":
            return SharedKvSegments(
                self.cfg.engine_socket,
                self.cfg.engine_id,
                self._rank,
                self.tp_size,
                timeout_s=self.cfg.register_timeout_s,
                max_frame_bytes=self.cfg.max_frame_bytes,
            )
        return SharedKvFiles(self.cfg.shm_dir, self.cfg.engine_id, self._rank)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._rank = self._tp_rank()
        device_kv: DeviceKv | None = None
        if self.cfg.placement == "device":
            # vLLM's GPU tensors in place: exported as CUDA IPC handles for the sidecar.
            device_kv = DeviceKv(TorchCuda())
            device_kv.add(kv_caches)
            self._files = device_kv
        if self._files is None:
            self._files = self._shared_kv()
        if self.cfg.placement == "host_buffer":
            self._host = HostBuffer(self._files, TorchCuda() if current_platform.device_type == "cuda" else None)
            described_tensors = self._host.mirror(kv_caches)
        else:
            described_tensors = kv_caches
        views = tensor_views(described_tensors, self._files)
        region_bytes = [f.nbytes for f in self._files.files]
        groups_msg: list[Any] | None = None
        group_split: list[int] | None = None
        if self._hybrid:
            per_group = self._describe_groups(views, region_bytes)
            described = per_group[0][1]
            groups_msg = [group_message(g.kind, d, sliding_window=g.sliding_window, state_shape=g.state_shape)
                          for g, d in per_group]
            group_split = [d.blocks_per_block for _, d in per_group]
            bytes_per_token = sum(_bytes_per_token(d.layout) for g, d in per_group if g.kind != "state")
        else:
            mc = self._vllm_config.model_config
            described = describe(
                views,
                packing=packing_of(self._backend_name(list(kv_caches))),
                head_size=mc.get_head_size(),
                total_kv_heads=1 if mc.use_mla else mc.get_total_num_kv_heads(),
                tp_size=self.tp_size,
                tp_rank=0,
                block_size=self._vllm_config.cache_config.block_size,
                region_bytes=region_bytes,
                cpu_isa=self._cpu_isa(list(kv_caches)),
            )
            bytes_per_token = _bytes_per_token(described.layout)
        log.info(
            "kvxfer: KV cache of %d layers, %s, block %d, head/token stride %d/%d, %d region(s) in %s",
            described.layout.num_layers, described.layout.dtype, described.layout.block_size,
            described.layout.head_stride, described.layout.token_stride, len(self._files.files),
            "GPU memory, in place" if device_kv is not None
            else "segments the sidecar allocated" if self.cfg.kv_memory == "segment" else self.cfg.shm_dir,
        )
        every_rank = self._gather(region_files(self._files))
        if self._rank != 0:
            return
        bpb = described.blocks_per_block
        self._blocks_per_block = group_split if group_split is not None else bpb
        host = self._host
        self.worker = WorkerLogic(
            bytes_per_token=described.layout.tp_size * bytes_per_token,
            group_blocks_per_block=group_split,
            engine_id=self.cfg.engine_id,
            engine_socket=self.cfg.engine_socket,
            register_timeout_s=self.cfg.register_timeout_s,
            sidecar_lost_timeout_s=self.cfg.sidecar_lost_timeout_s,
            max_frame_bytes=self.cfg.max_frame_bytes,
            expand_blocks=lambda ids: expand_block_ids(ids, bpb),
            on_kv_ready=host.to_device if host is not None else None,
            on_activity=waker(self.cfg.engine_id) if self.cfg.idle_wait_s > 0 else None,
            layer_names=described.layers if self._layer_wise else None,
            before_prefill_done=(
                host.to_host if host is not None else device_kv.before_prefill_done if device_kv is not None else None
            ),
        )
        ans = self.worker.register(registration(self.cfg.engine_id, described, every_rank, groups_msg))
        log.info("kvxfer: registered with the sidecar (side channel %s, epoch %d)", ans.side_channel, ans.epoch)

    def _describe_groups(self, views: list[Any], region_bytes: list[int]) -> list[tuple[GroupSpec, DescribedLayout]]:
        """Each KV cache group's layout on this rank (layout.describe_groups)."""
        attention = [g.kind != "state" for g in self._groups]
        described = describe_groups(
            self._groups,
            views,
            packings=[packing_of(self._backend_name(list(g.layer_names))) if a else None
                      for g, a in zip(self._groups, attention)],
            head_sizes=[self._group_attention_spec(i).head_size if a else 0 for i, a in enumerate(attention)],
            total_kv_heads=self._vllm_config.model_config.get_total_num_kv_heads(),
            tp_size=self.tp_size,
            region_bytes=region_bytes,
            cpu_isas=[self._cpu_isa(list(g.layer_names)) if a else None for g, a in zip(self._groups, attention)],
        )
        return list(zip(self._groups, described))

    def _group_attention_spec(self, g_index: int) -> Any:
        spec = self._kv_cache_config.transfer_groups[g_index].kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)
        return next(iter(inner.values())) if inner else spec

    def _backend_name(self, layer_names: list[str]) -> str:
        ctx = self._vllm_config.compilation_config.static_forward_context
        names = set()
        for n in layer_names:
            backend = getattr(ctx.get(n), "attn_backend", None)
            if backend is None:
                raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"layer {n} has no attention backend kvxfer can read")
            names.add(backend.get_name())
        if len(names) != 1:
            raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"layers use several attention backends {sorted(names)}")
        return names.pop()

    def _cpu_isa(self, layer_names: list[str]) -> str | None:
        """The CPU attention's ISA, which its metadata builder sets on every layer; None if unset or mixed."""
        ctx = self._vllm_config.compilation_config.static_forward_context
        isas = {getattr(ctx.get(n), "isa", None) for n in layer_names}
        return isas.pop() if len(isas) == 1 else None

    def _gather(self, mine: list[RegionEntry]) -> list[list[RegionEntry]]:
        """Every rank's region files, in rank order (rank 0 registers them all)."""
        if self.tp_size == 1:
            return [mine]
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        out: list[Any] = [None] * self.tp_size
        dist.all_gather_object(out, mine, group=get_tp_group().cpu_group)
        return [list(map(tuple, files)) for files in out]

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.worker is None:
            return None
        return KvxferHandshakeMetadata(
            side_channel=self.worker.side_channel, epoch=self.worker.epoch, blocks_per_block=self._blocks_per_block
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._rest:
            self._rest.step_began()
        if self.worker is not None and self._send_at_bind and isinstance(connector_metadata, KvxferConnectorMetadata):
            self.worker.on_step(connector_metadata.step)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is None or self._send_at_bind or not self.has_connector_metadata():
            return  # (on CPU, sent when it was bound)
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxferConnectorMetadata)
        self.worker.on_step(meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # After the layer's attention (on CPU the forward has run it): its KV is final.
        if self.worker is not None and self._layer_wise:
            self.worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        # After the forward: the prefills it completed (on CPU only, where the forward has run).
        if self.worker is not None and isinstance(self._connector_metadata, KvxferConnectorMetadata):
            self.worker.after_forward(self._connector_metadata.step)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._step_ended()
        if self.worker is None:
            return KVConnectorTransferResults()
        meta = self._connector_metadata
        idle = isinstance(meta, KvxferConnectorMetadata) and meta.idle
        waited = isinstance(meta, KvxferConnectorMetadata) and meta.waited
        if waited:
            # The scheduler waits for the sidecar between idle steps: vLLM's worker would spin for
            # a second after this step's read (its message queue's busy loop), a core for nothing.
            _sleep_until_next_step()
        r = self.worker.take_results(IDLE_WAIT_S if idle and not waited else 0.0)
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
        )

    def _step_ended(self) -> None:
        """Every rank's worker, at the end of each step: its rest clock (idle.py WorkerRest)."""
        if self._rest is None:
            self._rest = False
            if self.cfg.worker_rest_s > 0:
                mq = _find_worker_mq(warn=False)
                if mq is not None:
                    self._rest = WorkerRest(self.cfg.worker_rest_s)
                    self._rest.attach(mq._spin_condition)
        if self._rest:
            self._rest.step_ended()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What was counted since the last call, on TP rank 0's worker and on the scheduler."""
        half = self.worker or self.scheduler
        data = half.stats.take() if half is not None else {}
        return KvxferConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvxferConnectorStats(data=dict(data) if data is not None else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_finished_count(self) -> int | None:
        # TP rank 0 reports for every rank: it registered all of them with the sidecar.
        return 1

    def shutdown(self) -> None:
        if self._idle is not None:
            self._idle.close()
        if self._rest:
            self._rest.close()
        if self.worker is not None:
            self.worker.close()
        if self._files is not None:
            self._files.close()

    # ==== scheduler role =======================================================================

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self.scheduler is not None
        for m in metadata.values():
            if isinstance(m, KvxferHandshakeMetadata) and m.side_channel:
                self.scheduler.set_side_channel(m.side_channel, m.blocks_per_block)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.num_new_matched_tokens(
            request.request_id, request.kv_transfer_params, request.num_prompt_tokens, num_computed_tokens,
            prompt_token_ids=request.prompt_token_ids,
        )

    def _tables(self, block_ids: Any) -> list[list[int]]:
        """vLLM's per-group blocks of a request -> the transfer groups' tables."""
        if not block_ids:
            return [[] for _ in self._groups] or [[]]
        if self._groups:
            return [list(t) for t in self._kv_cache_config.select_transfer_block_ids(block_ids)]
        return [list(block_ids[0])]

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """D loads every group that moves (the request's own blocks, not a prefix store)."""
        return self._kv_cache_config.transfer_group_ids if self._groups else (0,)

    def on_new_request(self, request: Request) -> None:
        """P, with state groups: the prompt's last token is D's to compute (groups.py)."""
        assert self.scheduler is not None
        backoff = self.scheduler.backoff
        params = request.kv_transfer_params
        if (not backoff or not params or not params.get("do_remote_decode") or params.get("_kvxfer_backed_off")
                or request.num_prompt_tokens <= backoff or request.prompt_token_ids is None):
            return
        _drop_prompt_tail(request, backoff)
        params["_kvxfer_backed_off"] = True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        block_ids = self._tables(blocks.get_block_ids())
        sp = request.sampling_params
        self.scheduler.p_allocated(
            request.request_id,
            request.kv_transfer_params,
            block_ids,
            request.prompt_token_ids,
            sp.max_tokens if sp is not None else None,
        )
        self.scheduler.after_alloc(
            request.request_id,
            request.kv_transfer_params,
            block_ids,
            num_external_tokens,
            request.num_prompt_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        if not self._spin_limited:
            self._spin_limited = True
            core = _engine_core()
            if core is not None and self.cfg.engine_spin_s > 0:
                n = limit_engine_spin(getattr(core, "model_executor", None), self.cfg.engine_spin_s)
                log.info("kvxfer: the engine core spins %.4f s on its workers' answers, then sleeps (%d queue(s))",
                         self.cfg.engine_spin_s, n)
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        waited = False
        if idle and self._idle is not None and self.scheduler.waits_on_sidecar():
            # Nothing to run, nothing to tell the sidecar, transfers live: wait here for the
            # sidecar (a worker's wake) or new input, not in a tight loop of empty steps.
            if not self._idle_attached:
                self._idle_attached = True
                self._engine_core = _engine_core()
                if self._engine_core is not None:
                    self._idle.attach(self._engine_core.input_queue)
                else:
                    log.warning("kvxfer: vLLM's engine-core input queue not found: an idle step waits "
                                "for the sidecar only (new requests may wait up to %.2f s)", UNWATCHED_BOUND_S)
            # Not while a batch scheduled earlier still runs (async scheduling): its output is due.
            if not getattr(self._engine_core, "batch_queue", None):
                self._idle.wait()
                waited = True
        if timeline.enabled():
            self.scheduler.mark_admitted(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        wanted = self.scheduler.early_candidates
        scheduled = _scheduled(scheduler_output, wanted, self._tables) if wanted else None
        return KvxferConnectorMetadata(step=self.scheduler.build_step(scheduled), idle=idle, waited=waited)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.on_worker_output(connector_output.finished_sending, connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Without the hybrid manager (``--disable-hybrid-kv-cache-manager``): one group."""
        return self._finished(request, [list(block_ids)])

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """With the hybrid manager: one table per KV cache group (sliding windows already freed
        what left the window)."""
        return self._finished(request, self._tables(block_ids))

    def _finished(self, request: Request, tables: list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        assert self.scheduler is not None
        return self.scheduler.request_finished(
            request.request_id,
            request.kv_transfer_params,
            finished_ok=request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED),
            block_ids=tables,
            num_computed_tokens=request.num_computed_tokens,
            token_ids=request.prompt_token_ids,
        )

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_work()


def _drop_prompt_tail(request: Any, n: int) -> None:
    """Removes the last ``n`` prompt tokens of a request vLLM has not scheduled yet (vLLM 0.32's
    ``Request`` fields): P computes the rest and answers for that many tokens."""
    del request.prompt_token_ids[-n:]
    del request._all_token_ids[-n:]
    request.num_prompt_tokens -= n


def _idle_waiter(cfg: ConnectorConfig) -> IdleWaiter | None:
    """The scheduler's idle wait (idle.py), unless switched off or its socket cannot be bound."""
    if cfg.idle_wait_s <= 0:
        return None
    try:
        return IdleWaiter(cfg.engine_id, bound_s=wait_bound(cfg.idle_wait_s, cfg.sidecar_lost_timeout_s))
    except OSError as err:
        log.warning("kvxfer: no idle wait (%s): an idle engine steps as vLLM's loop does", err)
        return None


def _engine_core() -> Any:
    """vLLM's engine core, up the stack from the scheduler's call into the connector: it keeps
    its client requests in ``input_queue`` (a ``queue.Queue``, vLLM 0.32-0.33), and the idle wait
    ends when something is put there."""
    f = sys._getframe(1)
    while f is not None:
        core = f.f_locals.get("self")
        if isinstance(getattr(core, "input_queue", None), queue.Queue):
            return core
        f = f.f_back
    return None


#: The worker's message queue from the engine core (vLLM's ``rpc_broadcast_mq``), once found.
_worker_mq: list[Any] = []


def _find_worker_mq(warn: bool = True) -> Any:
    """The worker's message queue from the engine core, found once up the calling stack (the
    worker process's loop holds it as ``rpc_broadcast_mq``, vLLM 0.32-0.33); None if not there."""
    if not _worker_mq:
        f = sys._getframe(1)
        found = None
        while f is not None and found is None:
            mq = getattr(f.f_locals.get("self"), "rpc_broadcast_mq", None)
            if hasattr(getattr(mq, "_spin_condition", None), "last_read"):
                found = mq
            f = f.f_back
        if found is None and not warn:
            return None  # a one-process engine (no queue, no spin): looked for again if asked
        _worker_mq.append(found)
        if found is None:
            log.warning("kvxfer: vLLM's worker message queue not found: an idle worker spins as vLLM's does")
    return _worker_mq[0]


def _sleep_until_next_step() -> None:
    """vLLM's worker reads its next step from a shared-memory queue, spinning (``sched_yield``)
    for ``busy_loop_s`` (1 s) after each read before it sleeps on the queue's notification
    socket (vLLM 0.32-0.33, ``SpinCondition``). Marking the last read long past makes its next
    wait sleep at once; every write notifies, so the next step wakes it as soon as it is queued."""
    mq = _find_worker_mq()
    if mq is not None and mq._spin_condition is not None:
        mq._spin_condition.last_read = 0.0
