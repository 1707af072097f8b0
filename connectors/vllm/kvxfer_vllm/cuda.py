"""The CUDA boundary: every CUDA call the connector makes, as one narrow protocol.

``device.TorchCuda`` is the real one (torch's CUDA API); the tests give a stub over CPU tensors.
Its own module so that ``shm.py`` (the host buffer's copies) and ``device.py`` (which builds on
``shm.SharedKv``) both use it without importing each other.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class CudaExport:
    """One CUDA allocation as another process opens it."""

    #: ``cudaIpcMemHandle_t`` of the allocation (the caching allocator's segment) holding the storage.
    handle: bytes
    #: The device as this process numbers it (torch's index).
    device: int
    #: Byte offset of the storage's first byte inside that allocation.
    offset: int
    #: The storage's size in bytes.
    nbytes: int


class CudaBoundary(Protocol):
    """The CUDA calls the connector makes, and nothing else."""

    def is_device(self, tensor: torch.Tensor) -> bool: ...

    def device_of(self, tensor: torch.Tensor) -> int: ...

    def export(self, tensor: torch.Tensor) -> CudaExport: ...

    def pin(self, tensor: torch.Tensor) -> None:
        """Page-locks a host tensor's memory (``cudaHostRegister``) so copies to and from it are DMA."""

    def side_stream(self, device: int) -> AbstractContextManager[Any]:
        """A context in which torch's CUDA work on ``device`` goes to the connector's copy stream."""

    def side_waits_for_compute(self, device: int) -> None:
        """The copy stream waits for what the engine queued so far on its compute stream."""

    def record_on_side(self, device: int) -> Any:
        """An event at the copy stream's current end."""

    def compute_waits_for(self, device: int, event: Any) -> None:
        """The engine's compute stream waits for ``event`` (the host does not)."""

    def host_waits_for(self, event: Any) -> None:
        """The calling thread waits for ``event`` alone (never the whole device)."""

    def wait_compute(self, device: int) -> None:
        """The calling thread waits until the compute stream has run what it has queued so far."""
