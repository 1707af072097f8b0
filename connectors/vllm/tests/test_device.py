"""GPU KV in place (``placement: device``) and host_buffer's CUDA copies, with CUDA stubbed only at
its boundary (``device.CudaBoundary``): CPU tensors laid out by vLLM's own allocation code stand in
for GPU ones, and everything else — the layout, the regions and their IPC handles, device
numbering, block ids, the copies' bytes, the order of stream and event calls — is the code that
runs on a GPU. A real sidecar takes the registration and, on this machine without a CUDA
driver, refuses it naming libcuda.so.1. bench/gpu/run.sh runs the rest on a GPU."""

from __future__ import annotations

import contextlib
import hashlib

import pytest
import torch
from conftest import unique
from kvengine import BACKENDS, Model
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, MLAAttentionSpec, create_kv_cache_views

from kvxfer_vllm._gen.kvxfer.v1 import layout_pb2
from kvxfer_vllm.config import load_config
from kvxfer_vllm.device import CudaExport, DeviceKv, cuda_ipc_handle, sidecar_device
from kvxfer_vllm.errors import ConfigError, LayoutError, RegistrationError
from kvxfer_vllm.layout import TensorView, describe
from kvxfer_vllm.registration import region_files, registration, tensor_views
from kvxfer_vllm.shm import HostBuffer, SharedKvFiles
from kvxfer_vllm.worker import WorkerLogic


class StubCuda:
    """The CUDA boundary over CPU tensors: the tensors it is told about are "on the GPU"; every
    call is recorded. It has no way to synchronise a whole device, so nothing can."""

    def __init__(self, device_tensors=(), *, device: int = 0, handle_bytes: int = 64) -> None:
        self.device = device
        self.handle_bytes = handle_bytes
        self.on_device = {t.untyped_storage().data_ptr() for t in device_tensors}
        self.calls: list[str] = []

    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.on_device

    def device_of(self, t: torch.Tensor) -> int:
        return self.device

    def export(self, t: torch.Tensor) -> CudaExport:
        st = t.untyped_storage()
        self.calls.append("export")
        handle = hashlib.shake_256(str(st.data_ptr()).encode()).digest(self.handle_bytes)
        # The caching allocator hands out storages inside larger cudaMalloc segments.
        return CudaExport(handle=handle, device=self.device, offset=1 << 21, nbytes=st.nbytes())

    def pin(self, t: torch.Tensor) -> None:
        self.calls.append("pin")

    @contextlib.contextmanager
    def side_stream(self, device: int):
        self.calls.append("side{")
        yield
        self.calls.append("}")

    def side_waits_for_compute(self, device: int) -> None:
        self.calls.append("side-waits-compute")

    def record_on_side(self, device: int) -> object:
        self.calls.append("record")
        return object()

    def compute_waits_for(self, device: int, event: object) -> None:
        self.calls.append("compute-waits-event")

    def host_waits_for(self, event: object) -> None:
        self.calls.append("host-waits-event")

    def wait_compute(self, device: int) -> None:
        self.calls.append("host-waits-compute")


@pytest.fixture(autouse=True)
def _no_device_synchronize(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("torch.cuda.synchronize: the connector must never wait for the whole device")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


def gpu_kv(backend: str, *, tp: int, block_size: int, num_blocks: int = 16, model: Model = Model()):
    """Per rank, vLLM's KV views of one flat allocation (the "GPU" memory)."""
    packing, layout = BACKENDS[backend]
    mla = packing == "latent"
    heads = 1 if mla else max(1, model.total_kv_heads // tp)
    if mla:
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=model.head_size, dtype=model.dtype)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=model.head_size, dtype=model.dtype)
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(model.layers)]
    size = page * num_blocks * model.layers
    ranks = []
    for _ in range(tp):
        raw = torch.zeros(size, dtype=torch.int8)
        if layout.is_block_outermost:
            t = KVCacheTensor(size=size, layers=names, layer_stride=page, block_stride=page * model.layers)
        else:
            t = KVCacheTensor(size=size, layers=names, layer_stride=page * num_blocks, block_stride=page)
        ranks.append(dict(zip(names, create_kv_cache_views(raw, spec, num_blocks, layout, t))))
    return packing, ranks


def described(kv, packing, files, *, tp, block_size, model: Model = Model()):
    return describe(
        tensor_views(kv, files), packing=packing, head_size=model.head_size,
        total_kv_heads=1 if packing == "latent" else model.total_kv_heads, tp_size=tp, tp_rank=0,
        block_size=block_size, region_bytes=[f.nbytes for f in files.files],
    )


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASH_ATTN/cross-layer", "FLASHMLA"])
def test_device_regions_carry_handles_offsets_and_the_sidecars_device_numbers(backend, tmp_path):
    packing, ranks = gpu_kv(backend, tp=2, block_size=16)
    every_rank, layouts = [], []
    for r, kv in enumerate(ranks):
        cuda = StubCuda(kv.values(), device=r)
        dkv = DeviceKv(cuda, visible_devices="4,5")
        dkv.add(kv)
        assert cuda.calls == ["export"], "one export per allocation, however many layers view it"
        layouts.append(described(kv, packing, dkv, tp=2, block_size=16).layout)
        every_rank.append(region_files(dkv))
    reg = registration("gpu-p", _described_of(ranks[0], packing), every_rank)
    for r, rk in enumerate(reg.ranks):
        (region,) = rk.regions
        assert (region.path, region.offset, region.HasField("segment")) == ("", 1 << 21, False)
        assert len(region.cuda_ipc_handle) == 64 and region.cuda_device == 4 + r
        assert region.length == next(iter(ranks[r].values())).untyped_storage().nbytes()
    # The layout is the one the same tensors get in shared memory: only where the bytes live differs.
    files = SharedKvFiles(str(tmp_path), unique("e"), 0)
    try:
        raw = files.allocate(next(iter(ranks[0].values())).untyped_storage().nbytes())
        mirror = {n: torch.as_strided(raw.view(t.dtype), t.shape, t.stride(), t.storage_offset()) for n, t in ranks[0].items()}
        assert layouts[0] == described(mirror, packing, files, tp=2, block_size=16).layout
    finally:
        files.close()


def _described_of(kv, packing):
    dkv = DeviceKv(StubCuda(kv.values()), visible_devices="")
    dkv.add(kv)
    return described(kv, packing, dkv, tp=2, block_size=16)


def test_flashinfer_and_heterogeneous_tp_and_block_sizes_describe_as_on_cpu():
    # FLASHINFER: K heads then V heads per block; P TP 1 with blocks of 16, D TP 2 with blocks of 32.
    def flashinfer(tp, block):
        heads = 4 // tp
        raw = torch.zeros(8 * 2 * heads * block * 32 * 2, dtype=torch.int8)
        shape = (8, 2 * heads, block, 32)
        stride = (2 * heads * block * 32, block * 32, 32, 1)
        return {f"model.layers.{i}.self_attn.attn": torch.as_strided(raw.view(torch.bfloat16)[i:], shape, stride) for i in range(1)}

    p_kv, d_kv = flashinfer(1, 16), flashinfer(2, 32)
    out = {}
    for name, kv, tp, block in (("p", p_kv, 1, 16), ("d", d_kv, 2, 32)):
        dkv = DeviceKv(StubCuda(kv.values()), visible_devices="")
        dkv.add(kv)
        out[name] = describe(tensor_views(kv, dkv), packing="kv_in_heads", head_size=32, total_kv_heads=4, tp_size=tp,
                             tp_rank=0, block_size=block, region_bytes=[f.nbytes for f in dkv.files]).layout
    p, d = out["p"], out["d"]
    assert (p.tp_size, p.block_size, d.tp_size, d.block_size) == (1, 16, 2, 32)
    # V's slot is after the rank's K heads: 4 heads of P, 2 of each D rank.
    assert [s.offset for s in p.slots] == [0, 4 * 16 * 32 * 2]
    assert [s.offset for s in d.slots] == [0, 2 * 32 * 32 * 2]
    assert p.order == d.order == layout_pb2.KV_BLOCK_ORDER_HND


def test_device_refusals_name_the_cause():
    _, (kv,) = gpu_kv("FLASH_ATTN", tp=1, block_size=16)
    with pytest.raises(LayoutError, match="needs the KV cache in GPU memory") as e:
        DeviceKv(StubCuda(()), visible_devices="").add(kv)
    assert e.value.code == "ERR_NOT_ON_DEVICE"
    with pytest.raises(LayoutError, match="a 96-byte handle") as e:
        DeviceKv(StubCuda(kv.values(), handle_bytes=96), visible_devices="").add(kv)
    assert e.value.code == "ERR_CUDA_IPC"
    with pytest.raises(LayoutError, match="allocates nothing"):
        DeviceKv(StubCuda(()), visible_devices="").allocate(1 << 20)


def test_torch_shareable_handles_are_unwrapped_to_the_cuda_ipc_handle():
    raw = bytes(range(64))
    assert cuda_ipc_handle(raw) == raw  # torch before its handles had a header
    assert cuda_ipc_handle(bytes([2]) + b"c" + raw) == raw  # torch <= 2.12
    assert cuda_ipc_handle(bytes([3]) + b"c" + raw) == raw  # torch 2.13
    with pytest.raises(LayoutError, match="expandable_segments") as e:
        cuda_ipc_handle(bytes([3]) + b"e" + raw + b"more")
    assert e.value.code == "ERR_CUDA_IPC"
    with pytest.raises(LayoutError, match="version 4"):
        cuda_ipc_handle(bytes([4]) + b"c" + raw)
    with pytest.raises(LayoutError, match="5-byte handle"):
        cuda_ipc_handle(b"short")


def test_sidecar_device_numbers_follow_cuda_visible_devices():
    assert sidecar_device(1, None) == 1
    assert sidecar_device(1, "") == 1
    assert sidecar_device(0, "3,1") == 3 and sidecar_device(1, " 3, 1 ") == 1
    with pytest.raises(LayoutError, match="not in CUDA_VISIBLE_DEVICES"):
        sidecar_device(2, "3,1")
    with pytest.raises(LayoutError, match="numeric indices"):
        sidecar_device(0, "GPU-8f6c1a2e-0000-0000-0000-000000000000")


def test_prefill_done_waits_for_the_compute_stream_only():
    _, (kv,) = gpu_kv("FLASH_ATTN", tp=1, block_size=16)
    cuda = StubCuda(kv.values(), device=2)
    dkv = DeviceKv(cuda, visible_devices="")
    dkv.add(kv)
    dkv.before_prefill_done([3, 1])
    assert cuda.calls == ["export", "host-waits-compute"]


def test_placement_device_config():
    assert load_config("g0", {"placement": "device"}, "cuda").placement == "device"
    with pytest.raises(ConfigError, match="placement 'device' registers the KV cache in GPU memory"):
        load_config("g0", {"placement": "device"}, "cpu")
    # Not the default until it has run on a GPU.
    assert load_config("g0", {}, "cuda").placement == "host_buffer"


def test_a_real_sidecar_refuses_device_regions_without_a_cuda_driver(sidecars):
    """The registration crosses the engine link and reaches openCudaIpc in the sidecar, which
    has no driver to open the handles with here: refused by name, and nothing stays registered."""
    sc = sidecars("prefill")
    packing, ranks = gpu_kv("FLASH_ATTN", tp=1, block_size=16)
    dkv = DeviceKv(StubCuda(ranks[0].values()), visible_devices="")
    dkv.add(ranks[0])
    d = described(ranks[0], packing, dkv, tp=1, block_size=16)
    w = WorkerLogic(engine_id=sc.engine_id, engine_socket=sc.socket, register_timeout_s=20.0,
                    sidecar_lost_timeout_s=10.0, max_frame_bytes=16 << 20)
    try:
        with pytest.raises(RegistrationError) as e:
            w.register(registration(sc.engine_id, d, [region_files(dkv)]))
        assert e.value.code == "ERR_REGISTER_REFUSED"
        assert "ERR_CUDA_UNAVAILABLE" in e.value.message and "libcuda.so.1" in e.value.message
        assert "rank 0 region 0" in e.value.message
    finally:
        w.close()


# --- host_buffer's CUDA copies -------------------------------------------------------------------


def host_buffer(tmp_path, backend="FLASH_ATTN"):
    _, (kv,) = gpu_kv(backend, tp=1, block_size=16)
    g = torch.Generator().manual_seed(5)
    raw = next(iter(kv.values()))
    flat = torch.as_strided(raw.view(torch.int8), (raw.untyped_storage().nbytes(),), (1,), 0)
    flat.copy_(torch.randint(-128, 128, flat.shape, dtype=torch.int8, generator=g))
    cuda = StubCuda(kv.values(), device=0)
    files = SharedKvFiles(str(tmp_path), unique("hb"), 0)
    hb = HostBuffer(files, cuda)
    hb.mirror(kv)
    return hb, cuda, kv, files


def test_host_buffer_p_copies_on_a_side_stream_after_compute_and_waits_for_that_copy_alone(tmp_path):
    hb, cuda, kv, files = host_buffer(tmp_path)
    try:
        assert cuda.calls == ["pin"], "the mirror is page-locked once"
        cuda.calls.clear()
        hb.to_host([5, 2])
        assert cuda.calls == ["side{", "side-waits-compute", "record", "}", "host-waits-event"]
        for name, dev in kv.items():
            host = hb.host[name]
            assert torch.equal(host[[5, 2]].view(torch.int8), dev[[5, 2]].view(torch.int8))
            assert not host[[0, 1, 3, 4]].view(torch.int8).any(), "only the request's blocks move"
    finally:
        files.close()


def test_host_buffer_d_queues_its_copy_and_the_compute_stream_waits_not_the_host(tmp_path):
    hb, cuda, kv, files = host_buffer(tmp_path, "FLASH_ATTN/cross-layer")
    try:
        for name, host in hb.host.items():
            host[7].view(torch.int8).fill_(9)
            host[3].view(torch.int8).fill_(-3)
        before = {n: t.clone() for n, t in kv.items()}
        cuda.calls.clear()
        hb.to_device([7, 3])
        assert cuda.calls == ["side{", "record", "}", "compute-waits-event"]
        for name, dev in kv.items():
            assert bool((dev[7].view(torch.int8) == 9).all()) and bool((dev[3].view(torch.int8) == -3).all())
            others = [b for b in range(dev.shape[0]) if b not in (7, 3)]
            assert torch.equal(dev[others].view(torch.int8), before[name][others].view(torch.int8))
    finally:
        files.close()


def test_host_buffer_without_a_gpu_copies_plainly(tmp_path):
    _, (kv,) = gpu_kv("FLASH_ATTN", tp=1, block_size=16)
    for t in kv.values():
        t.view(torch.int8).fill_(1)
    files = SharedKvFiles(str(tmp_path), unique("hb"), 0)
    try:
        hb = HostBuffer(files, StubCuda(()))
        hb.mirror(kv)
        hb.to_host([0])
        assert all(bool((h[0].view(torch.int8) == 1).all()) for h in hb.host.values())
        assert hb.cuda.calls == []
    finally:
        files.close()


def test_tensor_views_of_device_kv_are_storage_relative():
    _, (kv,) = gpu_kv("FLASH_ATTN", tp=1, block_size=16)
    dkv = DeviceKv(StubCuda(kv.values()), visible_devices="")
    dkv.add(kv)
    views = tensor_views(kv, dkv)
    assert all(isinstance(v, TensorView) and v.region == 0 for v in views)
    assert sorted(v.offset for v in views) == [0, views[1].offset] and views[1].offset > 0
