"""An engine rank's KV cache in shared memory the sidecar moves: files it maps by path
(``SharedKvFiles``, kv_memory ``file``), or segments it allocates (``SharedKvSegments``,
kv_memory ``segment``).

``SharedKvFiles.placement()`` is a context manager that vLLM runs its KV cache
allocation inside (``get_mem_pool_context``): it catches the one flat
``torch.zeros`` allocation of the KV cache and returns a tensor backed by a new
shared-memory file instead, so the engine computes straight into memory the
sidecar reads and writes — no copies. Files are created owner-only and removed
when the engine exits: by ``close`` (the connector's shutdown, and an ``atexit``
hook), and, because vLLM force-kills its workers at shutdown (and an OOM kill
runs no Python at all), by a small watcher process that removes the file once
the process that made it is gone.

``SharedKvSegments`` asks the sidecar to allocate the rank's KV (``AllocateKv`` on the engine
link): UCX allocates it as a SysV segment, already marked for removal, mode 0600, which the engine
attaches. UCX then moves it with plain copies between two sidecars of one host, instead of a
system call per operation (docs/engine-link.md, "KV the sidecar allocates"). Nothing is left
behind however the engine exits: the segment goes when the sidecar and the engine have detached.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import functools
import logging
import os
import subprocess
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._gen.kvxfer.v1 import engine_pb2
from .cuda import CudaBoundary
from .errors import LayoutError, RegistrationError
from .link import DEFAULT_MAX_FRAME_BYTES, EngineLink

log = logging.getLogger(__name__)

#: Allocations smaller than this inside the placement context stay ordinary memory:
#: the KV cache is one large buffer, and small bookkeeping tensors have no business in shm.
MIN_SHARED_BYTES = 1 << 16


@dataclass
class SharedKvFile:
    #: The file's path; "" for a segment.
    path: str
    nbytes: int
    base: int
    tensor: torch.Tensor
    #: The SysV segment id of a region the sidecar allocated; None for a file.
    segment: int | None = None


class SharedKv:
    """An engine rank's shared KV memory, files or segments: its regions (``files``), the
    allocation context vLLM allocates inside, and where a tensor lies in them."""

    def __init__(self) -> None:
        self.files: list[SharedKvFile] = []
        self._closed = False

    def allocate(self, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def placement(self) -> AbstractContextManager[Any]:
        """Inside it, large 1-D int8 CPU ``torch.zeros`` allocations come from ``allocate``."""
        return _PlaceInSharedMemory(self)

    def regions(self) -> list[tuple[str, int, int, int | None, bytes, int]]:
        """This rank's regions as rank 0 gathers them (``registration.RegionEntry``)."""
        return [(f.path, 0, f.nbytes, f.segment, b"", 0) for f in self.files]

    def locate(self, tensor: torch.Tensor) -> tuple[int, int]:
        """(region index, byte offset) of a tensor's first element; LayoutError when it is in none."""
        ptr = tensor.data_ptr()
        for i, f in enumerate(self.files):
            if f.base <= ptr < f.base + f.nbytes:
                return i, ptr - f.base
        raise LayoutError(
            "ERR_NOT_SHARED",
            "a KV cache tensor is not in kvxfer's shared memory: vLLM did not allocate its KV cache "
            "through the connector's allocation context (get_mem_pool_context)",
        )


def _reserve(fd: int, nbytes: int, path: str) -> None:
    """Every page of a new KV file, allocated now: a full /dev/shm is a start-up error here, not a
    SIGBUS in the middle of a transfer or a forward pass. (Filesystems without fallocate keep the
    sparse file.)"""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return
        raise LayoutError(
            "ERR_SHM_FULL", f"cannot allocate {nbytes} bytes of KV cache in {path}: {os.strerror(err.errno)}"
        ) from err


def _make_resident(tensor: torch.Tensor) -> None:
    """Writes every page of a KV region once, as vLLM's own ``torch.zeros`` does for its KV.

    A file or segment mapped fresh has no page in this process's page table, and the first
    touch of each 4 KiB page is a page fault: measured here under load, 10-21 µs a page (a
    new shared-memory page: 177 ms for 32 MiB; an existing one in a new mapping: 86 ms). Left
    lazy, D paid them in its first forward pass over KV the sidecar had just written (and P in
    its prefill), once for every block until the whole cache had been used; vLLM's own KV
    never pays them. (The sidecar's own mapping has the same cost: ``--prefault true``.)"""
    tensor.zero_()


class SharedKvFiles(SharedKv):
    """The shared-memory files of one engine rank."""

    def __init__(self, shm_dir: str, engine_id: str, rank: int) -> None:
        super().__init__()
        self.shm_dir = shm_dir
        self.prefix = f"kvxfer-{engine_id}-r{rank}-{os.getpid()}"
        atexit.register(self.close)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zeroed int8 tensor of ``nbytes`` backed by a new owner-only file under ``shm_dir``."""
        if self._closed:
            raise LayoutError("ERR_CLOSED", "shared KV files already closed")
        path = os.path.join(self.shm_dir, f"{self.prefix}-g{len(self.files)}.kv")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            _reserve(fd, nbytes, path)
        except Exception:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        try:
            tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.int8)
            _make_resident(tensor)
        except Exception:
            os.unlink(path)
            raise
        self.files.append(SharedKvFile(path, nbytes, tensor.data_ptr(), tensor))
        _remove_when_gone(os.getpid(), path)
        log.info("kvxfer: KV cache region %s (%d bytes) in shared memory", path, nbytes)
        return tensor

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


class SharedKvSegments(SharedKv):
    """The KV of one engine rank in a segment its sidecar allocates (kv_memory ``segment``).

    ``allocate`` sends ``AllocateKv`` for the rank on a connection of its own, waits (bounded) for
    ``Allocated``, and attaches the segment. The connection stays open until ``close``: the sidecar
    frees an allocation no registration has taken when the connection that asked ends, and with
    TP > 1 rank 0 registers every rank's segments later. One allocation per rank: ``AllocateKv``
    names all of a rank's regions at once, and vLLM allocates a rank's KV cache as one tensor.
    """

    def __init__(
        self,
        engine_socket: str,
        engine_id: str,
        rank: int,
        tp_size: int,
        *,
        timeout_s: float = 60.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        super().__init__()
        self.engine_socket = engine_socket
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._link: EngineLink | None = None

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zeroed int8 tensor of ``nbytes`` in a segment the sidecar allocated for this rank."""
        if self._closed:
            raise LayoutError("ERR_CLOSED", "shared KV segments already closed")
        if self.files:
            raise LayoutError(
                "ERR_LAYOUT_UNSUPPORTED",
                f"kv_memory 'segment' holds one KV allocation per rank, and rank {self.rank} asked for "
                f"a second ({nbytes} bytes): use kv_memory 'file'",
            )
        segment = self._ask(nbytes)
        base = _attach(segment, nbytes)
        tensor = torch.frombuffer((ctypes.c_int8 * nbytes).from_address(base), dtype=torch.int8)
        _make_resident(tensor)
        self.files.append(SharedKvFile("", nbytes, base, tensor, segment))
        log.info("kvxfer: KV cache region in segment %d (%d bytes), allocated by the sidecar", segment, nbytes)
        return tensor

    def _ask(self, nbytes: int) -> int:
        answer: list[engine_pb2.Allocated | engine_pb2.Refused] = []
        done = threading.Event()

        def on_message(msg: engine_pb2.SidecarToEngine) -> None:
            kind = msg.WhichOneof("msg")
            if kind == "allocated" and msg.allocated.rank == self.rank:
                answer.append(msg.allocated)
                done.set()
            elif kind == "refused":
                answer.append(msg.refused)
                done.set()

        self._link = EngineLink(self.engine_socket, on_message, None, self.max_frame_bytes)
        self._link.start()
        self._link.send(
            engine_pb2.EngineToSidecar(
                allocate=engine_pb2.AllocateKv(rank=self.rank, lengths=[nbytes], tp_size=self.tp_size)
            )
        )
        if not done.wait(self.timeout_s):
            raise RegistrationError(
                "ERR_ALLOCATE_TIMEOUT",
                f"no kvxfer sidecar answered AllocateKv on {self.engine_socket} within {self.timeout_s:g} s: "
                f"start `kvxfer sidecar --engine-id {self.engine_id}` with that --engine-socket",
            )
        a = answer[0]
        if isinstance(a, engine_pb2.Refused):
            raise RegistrationError("ERR_ALLOCATE_REFUSED", f"the sidecar refused AllocateKv: {a.code}: {a.message}")
        if not a.ok:
            raise RegistrationError("ERR_ALLOCATE_REFUSED", f"the sidecar refused AllocateKv: {a.error}")
        if len(a.segments) != 1:
            raise RegistrationError(
                "ERR_ALLOCATE_REFUSED", f"the sidecar answered {len(a.segments)} segments for one region"
            )
        return int(a.segments[0])

    def close(self) -> None:
        """Closes the allocation's connection (idempotent). The segments stay attached while the
        process lives, for tensors still alive; ``detach`` drops them once none is used."""
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.close()

    def detach(self) -> None:
        """Detaches every segment: no tensor of them may be touched afterwards (tests)."""
        self.close()
        for f in self.files:
            _libc().shmdt(ctypes.c_void_p(f.base))
        self.files.clear()


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.restype = ctypes.c_int
    libc.shmdt.argtypes = [ctypes.c_void_p]
    return libc


def _segment_info(segment: int) -> tuple[int, int, int] | None:
    """(mode, size, uid) of a SysV segment, from /proc/sysvipc/shm; None when there is none."""
    with open("/proc/sysvipc/shm", encoding="ascii") as f:
        header = f.readline().split()
        for line in f:
            row = dict(zip(header, line.split()))
            if int(row["shmid"]) == segment:
                return int(row["perms"], 8), int(row["size"]), int(row["uid"])
    return None


def _attach(segment: int, nbytes: int) -> int:
    """Attaches the sidecar's segment after checking it is this user's, owner-only and big enough."""
    info = _segment_info(segment)
    if info is None:
        raise RegistrationError("ERR_NO_SUCH_SEGMENT", f"the sidecar answered segment {segment}, which does not exist")
    mode, size, uid = info
    if uid != os.geteuid() or mode & 0o077:
        raise RegistrationError(
            "ERR_SEGMENT_PERMISSIONS",
            f"segment {segment} is mode {mode:o} of uid {uid}: the KV must be owner-only (0600) and this user's",
        )
    if size < nbytes:
        raise RegistrationError("ERR_SEGMENT", f"segment {segment} has {size} bytes, the KV needs {nbytes}")
    addr = _libc().shmat(segment, None, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise RegistrationError("ERR_SEGMENT", f"cannot attach segment {segment}: {os.strerror(err)}")
    return int(addr)


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
    def __init__(self, files: SharedKv) -> None:
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
    sidecar says they landed.

    With GPU tensors the copies run on a copy stream of their own (``cuda``, the CUDA boundary
    in ``device.py``) and are ordered by events, never by synchronising the device: P's copy
    waits for the engine's compute stream and the worker waits for that copy alone before
    ``PrefillDone``; D's copy is queued and the engine's compute stream waits for it, so the host
    does not wait at all. The mirror is page-locked so both directions are DMA."""

    def __init__(self, files: SharedKv, cuda: CudaBoundary | None = None) -> None:
        self.files = files
        self.cuda = cuda
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
                if self.cuda is not None and self.cuda.is_device(t):
                    self.cuda.pin(raw)
            host = torch.as_strided(raw.view(t.dtype), t.shape, t.stride(), t.storage_offset())
            self.device[name] = t
            self.host[name] = host
        return dict(self.host)

    def _gpu(self) -> int | None:
        """The engine's CUDA device, or None when its KV is plain memory."""
        if self.cuda is None:
            return None
        for t in self.device.values():
            if self.cuda.is_device(t):
                return self.cuda.device_of(t)
        return None

    def _pairs(self, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        done: set[int] = set()
        out = []
        for name, s in src.items():
            d = dst[name]
            if d.data_ptr() in done:  # layers sharing one cache
                continue
            done.add(d.data_ptr())
            out.append((s, d))
        return out

    def to_host(self, block_ids: list[int]) -> None:
        """P, before PrefillDone: the request's blocks, device -> mirror, complete on return."""
        if not block_ids:
            return
        gpu = self._gpu()
        if gpu is None:
            _copy_rows(self._pairs(self.device, self.host), block_ids)
            return
        cuda = self.cuda
        assert cuda is not None
        with cuda.side_stream(gpu):
            cuda.side_waits_for_compute(gpu)  # the kernels that wrote the blocks first
            staged = []
            for s, d in self._pairs(self.device, self.host):
                idx = torch.tensor(block_ids, dtype=torch.long, device=s.device)
                staged.append((d, s.index_select(0, idx).to(d.device, non_blocking=True)))
            event = cuda.record_on_side(gpu)
        cuda.host_waits_for(event)  # this copy alone, not the device
        idx_host = torch.tensor(block_ids, dtype=torch.long)
        for d, rows in staged:
            d.index_copy_(0, idx_host, rows)

    def to_device(self, block_ids: list[int]) -> None:
        """D, on KvReady: the landed blocks, mirror -> device, ahead of the engine's next kernels."""
        if not block_ids:
            return
        gpu = self._gpu()
        if gpu is None:
            _copy_rows(self._pairs(self.host, self.device), block_ids)
            return
        cuda = self.cuda
        assert cuda is not None
        idx_host = torch.tensor(block_ids, dtype=torch.long)
        with cuda.side_stream(gpu):
            for s, d in self._pairs(self.host, self.device):
                rows = s.index_select(0, idx_host)
                d.index_copy_(0, idx_host.to(d.device, non_blocking=True), rows.to(d.device, non_blocking=True))
            event = cuda.record_on_side(gpu)
        cuda.compute_waits_for(gpu, event)  # the engine's next kernels read these blocks


def _copy_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]) -> None:
    """Plain memory on both sides: the blocks, row by row."""
    idx = torch.tensor(block_ids, dtype=torch.long)
    for s, d in pairs:
        d.index_copy_(0, idx, s.index_select(0, idx))
