"""GPU KV without host copies (``placement: device``), and the CUDA copies of ``host_buffer``.

``placement: device``: vLLM's KV tensors stay where vLLM allocated them and the sidecar moves
them in place. The sidecar is another process, so each rank's worker exports every CUDA
allocation that holds KV as a CUDA IPC handle (64 bytes, ``cudaIpcMemHandle_t``) plus the
storage's offset inside that allocation; rank 0 registers them over the engine link
(``RegionFile.cuda_ipc_handle``), and the sidecar opens them (``Agent.openCudaIpc``) and registers
them with UCX as CUDA memory (docs/gpu.md has the process model and why). Before ``PrefillDone``
the worker waits for the engine's compute stream up to now (one event), so the sidecar never
reads blocks a kernel is still writing; on D nothing waits: the sidecar reports ``KvReady`` only
after UCX completed its copies.

Everything CUDA goes through one narrow boundary, ``CudaBoundary`` (cuda.py): ``TorchCuda`` is the real one
(torch's CUDA API), and the tests give a stub that runs the same code over CPU tensors, so the
layouts, handles, device numbering and block math here are what runs on a GPU.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager
from typing import Any

import torch

from .cuda import CudaBoundary, CudaExport
from .errors import LayoutError
from .shm import SharedKv, SharedKvFile

log = logging.getLogger(__name__)

#: A CUDA IPC memory handle is 64 opaque bytes (``CU_IPC_HANDLE_SIZE``).
CUDA_IPC_HANDLE_BYTES = 64


#: torch's shareable-handle header (c10's ``CUDACachingAllocator::shareIpcHandle``): a version byte
#: (2 up to torch 2.12, 3 from 2.13, same payload), then the type: ``'c'`` for a cudaMalloc block
#: followed by its 64-byte ``cudaIpcMemHandle_t``, ``'e'`` for an expandable segment.
_TORCH_HANDLE_VERSIONS = (2, 3)
_TORCH_CUDA_MALLOC = ord("c")
_TORCH_EXPANDABLE = ord("e")


def cuda_ipc_handle(raw: bytes) -> bytes:
    """The ``cudaIpcMemHandle_t`` inside what torch's ``_share_cuda_()`` returns as the handle."""
    if len(raw) == CUDA_IPC_HANDLE_BYTES:  # torch before shareable-handle versioning: the handle itself
        return bytes(raw)
    if len(raw) >= 2 and raw[1] == _TORCH_EXPANDABLE:
        raise LayoutError(
            "ERR_CUDA_IPC",
            "the KV cache is in PyTorch expandable segments, which export no CUDA IPC handle: unset "
            "expandable_segments in PYTORCH_CUDA_ALLOC_CONF for placement 'device'",
        )
    if len(raw) == 2 + CUDA_IPC_HANDLE_BYTES and raw[1] == _TORCH_CUDA_MALLOC and raw[0] in _TORCH_HANDLE_VERSIONS:
        return bytes(raw[2:])
    head = f"version {raw[0]}, type {raw[1:2]!r}" if len(raw) >= 2 else "no header"
    raise LayoutError(
        "ERR_CUDA_IPC",
        f"torch exported a {len(raw)}-byte handle ({head}) that kvxfer does not know: a "
        f"{CUDA_IPC_HANDLE_BYTES}-byte cudaIpcMemHandle_t, or torch's version 2 or 3 'c' header before one",
    )


def sidecar_device(index: int, visible: str | None) -> int:
    """The device a sidecar with every GPU visible calls this process's device ``index``:
    ``CUDA_VISIBLE_DEVICES`` renumbers devices per process."""
    if visible is None or visible.strip() == "":
        return index
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise LayoutError(
            "ERR_CUDA_DEVICE", f"device {index} is not in CUDA_VISIBLE_DEVICES={visible!r}"
        )
    if not ids[index].isdigit():
        raise LayoutError(
            "ERR_CUDA_DEVICE",
            f"CUDA_VISIBLE_DEVICES={visible!r} names devices by UUID or MIG id; placement 'device' "
            "needs numeric indices so the sidecar can find the same GPU",
        )
    return int(ids[index])


class DeviceKv(SharedKv):
    """An engine rank's GPU KV allocations, exported for the sidecar: one region per CUDA storage
    (layers viewing one storage share a region, as with shared-memory files)."""

    def __init__(self, cuda: CudaBoundary, *, visible_devices: str | None = None) -> None:
        super().__init__()
        self.cuda = cuda
        self.exports: list[CudaExport] = []
        self.visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible_devices is None else visible_devices

    def add(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Exports every storage the KV tensors view, once each, in first-seen order."""
        for name, t in kv_caches.items():
            if not self.cuda.is_device(t):
                raise LayoutError(
                    "ERR_NOT_ON_DEVICE",
                    f"layer {name}: placement 'device' needs the KV cache in GPU memory, but this "
                    f"tensor is on {t.device}; use placement 'shared' (CPU) or 'host_buffer'",
                )
            storage = t.untyped_storage()
            base = storage.data_ptr()
            if any(f.base == base for f in self.files):
                continue
            export = self.cuda.export(t)
            if len(export.handle) != CUDA_IPC_HANDLE_BYTES:
                raise LayoutError(
                    "ERR_CUDA_IPC",
                    f"layer {name}: a {len(export.handle)}-byte handle, not a {CUDA_IPC_HANDLE_BYTES}-byte CUDA IPC handle",
                )
            if export.nbytes != storage.nbytes():
                raise LayoutError(
                    "ERR_CUDA_IPC",
                    f"layer {name}: the export covers {export.nbytes} bytes, the storage has {storage.nbytes()}",
                )
            self.files.append(SharedKvFile("", export.nbytes, base, t))
            self.exports.append(export)
            log.info("kvxfer: KV cache region on CUDA device %d (%d bytes at offset %d of its allocation)",
                     export.device, export.nbytes, export.offset)

    def regions(self) -> list[tuple[str, int, int, int | None, bytes, int]]:
        """This rank's regions as rank 0 gathers them (``registration.RegionEntry``)."""
        return [
            ("", e.offset, e.nbytes, None, e.handle, sidecar_device(e.device, self.visible))
            for e in self.exports
        ]

    def device(self) -> int:
        return self.exports[0].device

    def before_prefill_done(self, block_ids: list[int]) -> None:
        """P: the sidecar may read the blocks once the kernels queued before now have run. Rank 0
        waits for its own stream only: with TP > 1 its last layer's all-reduce completes only after
        every rank wrote that layer's KV, and every earlier layer's before it."""
        self.cuda.wait_compute(self.device())

    def allocate(self, nbytes: int) -> torch.Tensor:
        raise LayoutError("ERR_LAYOUT_UNSUPPORTED", "placement 'device' allocates nothing: vLLM's tensors are registered in place")

    def close(self) -> None:
        # The engine owns the memory; the sidecar closes its mappings when the link ends.
        self._closed = True


class TorchCuda:
    """The real boundary: torch's CUDA API (runs only where torch sees a GPU)."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def is_device(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_cuda)

    def device_of(self, tensor: torch.Tensor) -> int:
        return int(tensor.device.index or 0)

    def export(self, tensor: torch.Tensor) -> CudaExport:
        # (device, handle, storage bytes, offset in the allocation, ref-counter handle/offset,
        # event handle, event sync required): torch's own CUDA IPC export.
        shared = tensor.untyped_storage()._share_cuda_()
        return CudaExport(handle=cuda_ipc_handle(bytes(shared[1])), device=int(shared[0]), offset=int(shared[3]),
                          nbytes=int(shared[2]))

    def pin(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.untyped_storage().nbytes()
        err = torch.cuda.cudart().cudaHostRegister(tensor.untyped_storage().data_ptr(), nbytes, 0)
        if int(err) != 0:
            log.warning("kvxfer: cudaHostRegister of the host buffer (%d bytes) failed (%s): copies stay pageable",
                        nbytes, err)

    def _side(self, device: int) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def side_stream(self, device: int) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self._side(device))

    def side_waits_for_compute(self, device: int) -> None:
        self._side(device).wait_stream(torch.cuda.current_stream(device))

    def record_on_side(self, device: int) -> Any:
        return self._side(device).record_event()

    def compute_waits_for(self, device: int, event: Any) -> None:
        torch.cuda.current_stream(device).wait_event(event)

    def host_waits_for(self, event: Any) -> None:
        event.synchronize()

    def wait_compute(self, device: int) -> None:
        torch.cuda.current_stream(device).record_event().synchronize()
