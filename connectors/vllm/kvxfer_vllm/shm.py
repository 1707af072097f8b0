"""An engine rank's KV cache in shared-memory files the sidecar maps by path.

``SharedKvFiles.placement()`` is a context manager that vLLM runs its KV cache
allocation inside (``get_mem_pool_context``): it catches the one flat
``torch.zeros`` allocation of the KV cache and returns a tensor backed by a new
shared-memory file instead, so the engine computes straight into memory the
sidecar reads and writes — no copies. Files are created owner-only and removed
when the engine exits: by ``close`` (the connector's shutdown, and an ``atexit``
hook), and, because vLLM force-kills its workers at shutdown (and an OOM kill
runs no Python at all), by a small watcher process that removes the file once
the process that made it is gone.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .errors import LayoutError

log = logging.getLogger(__name__)

#: Allocations smaller than this inside the placement context stay ordinary memory:
#: the KV cache is one large buffer, and small bookkeeping tensors have no business in shm.
MIN_SHARED_BYTES = 1 << 16


@dataclass
class SharedKvFile:
    path: str
    nbytes: int
    base: int
    tensor: torch.Tensor


class SharedKvFiles:
    """The shared-memory files of one engine rank."""

    def __init__(self, shm_dir: str, engine_id: str, rank: int) -> None:
        self.shm_dir = shm_dir
        self.prefix = f"kvxfer-{engine_id}-r{rank}-{os.getpid()}"
        self.files: list[SharedKvFile] = []
        self._closed = False
        atexit.register(self.close)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zeroed int8 tensor of ``nbytes`` backed by a new owner-only file under ``shm_dir``."""
        if self._closed:
            raise LayoutError("ERR_CLOSED", "shared KV files already closed")
        path = os.path.join(self.shm_dir, f"{self.prefix}-g{len(self.files)}.kv")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        try:
            tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.int8)
        except Exception:
            os.unlink(path)
            raise
        self.files.append(SharedKvFile(path, nbytes, tensor.data_ptr(), tensor))
        _remove_when_gone(os.getpid(), path)
        log.info("kvxfer: KV cache region %s (%d bytes) in shared memory", path, nbytes)
        return tensor

    def placement(self) -> AbstractContextManager[Any]:
        """Inside it, large 1-D int8 CPU ``torch.zeros`` allocations come from new shared files."""
        return _PlaceInSharedMemory(self)

    def locate(self, tensor: torch.Tensor) -> tuple[int, int]:
        """(file index, byte offset) of a tensor's first element; LayoutError when it is in none."""
        ptr = tensor.data_ptr()
        for i, f in enumerate(self.files):
            if f.base <= ptr < f.base + f.nbytes:
                return i, ptr - f.base
        raise LayoutError(
            "ERR_NOT_SHARED",
            "a KV cache tensor is not in kvxfer's shared memory: vLLM did not allocate its KV cache "
            "through the connector's allocation context (get_mem_pool_context)",
        )

    def close(self) -> None:
        """Removes the files (idempotent). Mappings stay valid for tensors still alive."""
        if self._closed:
            return
        self._closed = True
        for f in self.files:
            try:
                os.unlink(f.path)
            except FileNotFoundError:
                pass
        atexit.unregister(self.close)


#: Polls the owner every half second; exits as soon as it has removed the file. Started in the
#: background by a shell that exits at once, so the watcher is nobody's descendant: vLLM kills
#: its workers' descendants at shutdown, and a kill of the engine's process group spares it too.
_WATCHER = '(while kill -0 "$0" 2>/dev/null; do sleep 0.5; done; rm -f -- "$1") </dev/null >/dev/null 2>&1 &'


def _remove_when_gone(pid: int, path: str) -> None:
    """A detached watcher that removes ``path`` once ``pid`` has exited, however it exited."""
    try:
        starter = subprocess.Popen(["sh", "-c", _WATCHER, str(pid), path], start_new_session=True,
                                   close_fds=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        starter.wait(10)
    except (OSError, subprocess.TimeoutExpired) as err:  # no sh: the file goes only with a clean exit
        log.warning("kvxfer: no watcher for %s (%s); a killed engine leaves it behind", path, err)


class _PlaceInSharedMemory(TorchFunctionMode):
    def __init__(self, files: SharedKvFiles) -> None:
        super().__init__()
        self.files = files

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.zeros and _is_flat_int8_cpu(args, kwargs):
            size = args[0] if args else kwargs["size"]
            n = int(size[0] if isinstance(size, (tuple, list, torch.Size)) else size)
            if n >= MIN_SHARED_BYTES:
                return self.files.allocate(n)
        return func(*args, **kwargs)


def _is_flat_int8_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if kwargs.get("dtype") is not torch.int8 or kwargs.get("out") is not None:
        return False
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return False
    size = args[0] if len(args) == 1 else kwargs.get("size") if not args else None
    if isinstance(size, (tuple, list, torch.Size)):
        return len(size) == 1 and isinstance(size[0], int)
    return isinstance(size, int)


class HostBuffer:
    """``host_buffer`` placement: a shared-memory mirror of KV tensors that stay where the
    engine put them (GPU memory). The mirror has the same shapes and strides, so the
    layout described from it matches the engine's; blocks are copied when they move:
    device -> mirror on P before the sidecar reads them, mirror -> device on D once the
    sidecar says they landed."""

    def __init__(self, files: SharedKvFiles) -> None:
        self.files = files
        self.device: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}

    def mirror(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One shared file per backing allocation; a view of it per layer, like the engine's."""
        by_storage: dict[int, torch.Tensor] = {}
        for name, t in kv_caches.items():
            key = t.untyped_storage().data_ptr()
            raw = by_storage.get(key)
            if raw is None:
                raw = self.files.allocate(t.untyped_storage().nbytes())
                by_storage[key] = raw
            host = torch.as_strided(raw.view(t.dtype), t.shape, t.stride(), t.storage_offset())
            self.device[name] = t
            self.host[name] = host
        return dict(self.host)

    def to_host(self, block_ids: list[int]) -> None:
        self._copy(self.device, self.host, block_ids)

    def to_device(self, block_ids: list[int]) -> None:
        self._copy(self.host, self.device, block_ids)

    @staticmethod
    def _copy(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], block_ids: list[int]) -> None:
        if not block_ids:
            return
        done: set[int] = set()
        for name, s in src.items():
            d = dst[name]
            if d.data_ptr() in done:  # layers sharing one cache
                continue
            done.add(d.data_ptr())
            idx = torch.tensor(block_ids, dtype=torch.long, device=s.device)
            rows = s.index_select(0, idx)
            d.index_copy_(0, idx.to(d.device), rows.to(d.device, non_blocking=False))
        if any(t.is_cuda for t in dst.values()) and torch.cuda.is_available():
            torch.cuda.synchronize()
