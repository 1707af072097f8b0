"""One side of a peer benchmark (`kvxfer bench peers`), for NIXL or Mooncake.

The TypeScript driver (bench/peers.ts) starts two of these per system and
drives them with JSON lines on stdin: one request per line
(`{"id": n, "op": ..., ...}`), one reply per request on stdout
(`{"id": n, "result": {...}}` or `{"id": n, "error": {"code", "message"}}`).
kvxfer's side of the same protocol is bench/peers/kvxfer-peer.ts, so the
driver runs the same work, in the same order, against all three systems.

Each system is used through its own public Python API, the way its users use
it: NIXL through `nixl_agent` with its UCX backend (register, prepared or
initialised transfers, `transfer`, notifications); Mooncake through
`mooncake.engine.TransferEngine` in P2P-handshake mode (no metadata server).

Times are CLOCK_MONOTONIC nanoseconds (`time.monotonic_ns`), the clock Node's
`process.hrtime` reads too, so the driver can subtract a post time taken in
one process from an arrival time taken in another on the same host.
"""

from __future__ import annotations

import base64
import ctypes
import importlib.metadata
import json
import mmap
import os
import select
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

# Replies go to a private copy of stdout; fd 1 then points at stderr, so that
# anything a native library prints cannot corrupt the protocol.
_REPLY = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


class BenchError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def now() -> int:
    return time.monotonic_ns()


@dataclass
class Buffer:
    """Page-aligned anonymous memory, touched, owned by this process."""

    mem: mmap.mmap
    base: int
    size: int

    @staticmethod
    def allocate(size: int) -> "Buffer":
        mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
        # First-touch page faults would otherwise land inside the first transfers.
        page = mmap.PAGESIZE
        view = memoryview(mem)
        for off in range(0, size, page):
            view[off] = 1
        view.release()
        return Buffer(mem, base, size)


def decode_descs(b64: str) -> list[tuple[int, int, int]]:
    """Float64 (localOffset, remoteOffset, length) triples, base64, as the planner makes them."""
    raw = base64.b64decode(b64)
    vals = memoryview(raw).cast("d")
    return [(int(vals[i]), int(vals[i + 1]), int(vals[i + 2])) for i in range(0, len(vals), 3)]


def loaded_library_version(prefix: str, symbol: str) -> str:
    """Version string of a shared library this process has loaded (e.g. NIXL's bundled libucp)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if f"/{prefix}" in line and ".so" in line}
    for path in sorted(paths):
        try:
            fn = getattr(ctypes.CDLL(path), symbol)
            fn.restype = ctypes.c_char_p
            return f"{fn().decode()} ({os.path.basename(path)})"
        except (OSError, AttributeError):
            continue
    return "unknown"


def package_version(*names: str) -> str:
    for n in names:
        try:
            return f"{n} {importlib.metadata.version(n)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


class Side:
    """What every system's side implements; the driver calls these by op name."""

    buf: Buffer | None = None
    # Progress between requests (see request_lines).
    idle_progress = False

    def idle(self) -> None:
        pass

    def need_buf(self) -> Buffer:
        if self.buf is None:
            raise BenchError("ERR_STATE", "alloc first")
        return self.buf

    # Subclasses fill these in.
    def init(self, req: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def alloc(self, req: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def connect(self, req: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


def wait_until(pred: Callable[[], bool], timeout_ms: float, what: str) -> None:
    deadline = now() + int(timeout_ms * 1e6)
    while not pred():
        if now() > deadline:
            raise BenchError("ERR_TIMEOUT", f"{what}: not done within {timeout_ms:.0f} ms")


def flight_outcomes(
    count: int,
    post: Callable[[int], Any],
    check: Callable[[Any], str],
    timeout_ms: float,
) -> list[dict[str, Any]]:
    """`count` transfers posted at once, polled until each is done or failed, or the deadline.

    `post(i)` starts transfer i and returns its handle (or raises); `check(h)` answers "DONE",
    "ERR" or "PROC". A transfer pending at the deadline is reported so, not waited for.
    """
    t0 = now()
    out: list[dict[str, Any] | None] = [None] * count
    handles: list[Any] = [None] * count
    for i in range(count):
        try:
            handles[i] = post(i)
        except Exception as e:  # noqa: BLE001  (a refused post is this transfer's outcome)
            out[i] = {"ok": False, "ms": (now() - t0) / 1e6, "error": f"{type(e).__name__}: {e}"}
    deadline = t0 + int(timeout_ms * 1e6)
    while any(o is None for o in out) and now() < deadline:
        for i, h in enumerate(handles):
            if out[i] is not None:
                continue
            try:
                s = check(h)
            except Exception as e:  # noqa: BLE001
                out[i] = {"ok": False, "ms": (now() - t0) / 1e6, "error": f"{type(e).__name__}: {e}"}
                continue
            if s == "DONE":
                out[i] = {"ok": True, "ms": (now() - t0) / 1e6}
            elif s == "ERR":
                out[i] = {"ok": False, "ms": (now() - t0) / 1e6, "error": "transfer failed"}
    ms = (now() - t0) / 1e6
    return [o if o is not None else {"ok": False, "ms": ms, "error": "pending at the deadline"} for o in out]


# --- NIXL --------------------------------------------------------------------


class NixlSide(Side):
    def __init__(self) -> None:
        try:
            import nixl_cu12 as nixl  # the CUDA-12 wheel; works without a GPU for DRAM
        except ImportError:
            import nixl  # type: ignore[no-redef]
        self.nixl = nixl
        self.agent: Any = None
        self.remote = ""
        self.remote_base = 0
        self.remote_size = 0
        self.notes: list[tuple[str, bytes, int]] = []

    def init(self, req: dict[str, Any]) -> dict[str, Any]:
        import numpy  # noqa: F401  (NIXL needs it; fail here, clearly, if missing)

        params: dict[str, str] = {}
        if isinstance(req.get("errorMode"), str):
            params["ucx_error_handling_mode"] = req["errorMode"]
        conf = self.nixl.nixl_agent_config(
            enable_prog_thread=bool(req.get("progressThread", False)),
            enable_listen_thread=False,  # metadata travels through the driver: no listener
            backends=[],
        )
        self.agent = self.nixl.nixl_agent(str(req["name"]), conf)
        self.agent.create_backend("UCX", params)
        self.idle_progress = bool(req.get("idleProgress", False))
        return {
            "system": "nixl",
            "version": package_version("nixl-cu12", "nixl"),
            "ucx": loaded_library_version("libucp", "ucp_get_version_string"),
            "backend": "UCX",
            "backendParams": self.agent.get_backend_params("UCX"),
        }

    def alloc(self, req: dict[str, Any]) -> dict[str, Any]:
        self.buf = Buffer.allocate(int(req["size"]))
        self.agent.register_memory([(self.buf.base, self.buf.size, 0, "")], "DRAM")
        md = self.agent.get_agent_metadata()
        return {
            "peerInfo": {
                "md": base64.b64encode(md).decode(),
                "base": self.buf.base,
                "size": self.buf.size,
            }
        }

    def connect(self, req: dict[str, Any]) -> dict[str, Any]:
        info = req["peerInfo"]
        name = self.agent.add_remote_agent(base64.b64decode(info["md"]))
        self.remote = name.decode() if isinstance(name, bytes) else str(name)
        self.remote_base = int(info["base"])
        self.remote_size = int(info["size"])
        self.agent.make_connection(self.remote)
        return {"remote": self.remote}

    def _lists(self, triples: Any) -> tuple[Any, Any]:
        """Local and remote Nx3 (address, length, device) arrays from offset triples (an Nx3 array)."""
        np = sys.modules["numpy"]
        buf = self.need_buf()
        n = len(triples)
        local = np.zeros((n, 3), dtype=np.uint64)
        remote = np.zeros((n, 3), dtype=np.uint64)
        local[:, 0] = triples[:, 0] + buf.base
        local[:, 1] = triples[:, 2]
        remote[:, 0] = triples[:, 1] + self.remote_base
        remote[:, 1] = triples[:, 2]
        return local, remote

    def _wait_xfer(self, h: Any, timeout_ms: float) -> None:
        def done() -> bool:
            s = self.agent.check_xfer_state(h)
            if s == "ERR":
                raise BenchError("ERR_XFER", "NIXL transfer failed")
            return s == "DONE"

        wait_until(done, timeout_ms, "NIXL transfer")

    def bw(self, req: dict[str, Any]) -> dict[str, Any]:
        """`iters` requests of one descriptor of `size` bytes, `window` in flight, prepared handles reposted."""
        buf = self.need_buf()
        op = "WRITE" if req["kind"] == "write" else "READ"
        size, iters, window = int(req["size"]), int(req["iters"]), int(req["window"])
        slots = max(1, min(window, buf.size // size, self.remote_size // size))
        local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(buf.base + i * size, size, 0) for i in range(slots)], "DRAM"
        )
        remote = self.agent.prep_xfer_dlist(
            self.remote, [(self.remote_base + i * size, size, 0) for i in range(slots)], "DRAM"
        )
        handles = [self.agent.make_prepped_xfer(op, local, [i % slots], remote, [i % slots]) for i in range(window)]
        posted = [False] * window
        started = done = 0
        deadline = now() + int(float(req.get("timeoutMs", 120_000)) * 1e6)
        c0 = time.process_time_ns()
        t0 = now()
        stop_at = t0 + int(float(req.get("maxMs", 1e9)) * 1e6)
        while done < iters:
            if started < iters and now() > stop_at:
                iters = started  # time is up: finish what is in flight, count what was done
            for i, h in enumerate(handles):
                if posted[i]:
                    s = self.agent.check_xfer_state(h)
                    if s == "PROC":
                        continue
                    if s == "ERR":
                        raise BenchError("ERR_XFER", "NIXL transfer failed")
                    posted[i] = False
                    done += 1
                if started < iters:
                    s = self.agent.transfer(h)
                    if s == "ERR":
                        raise BenchError("ERR_XFER", "NIXL transfer post failed")
                    started += 1
                    if s == "DONE":
                        done += 1
                    else:
                        posted[i] = True
            if now() > deadline:
                raise BenchError("ERR_TIMEOUT", f"bw: {done}/{iters} done before the deadline")
        seconds = (now() - t0) / 1e9
        cpu_ms = (time.process_time_ns() - c0) / 1e6
        for h in handles:
            self.agent.release_xfer_handle(h)
        self.agent.release_dlist_handle(local)
        self.agent.release_dlist_handle(remote)
        return {"seconds": seconds, "n": iters, "gbps": iters * size / seconds / 1e9, "msgRate": iters / seconds, "cpuMs": cpu_ms}

    def kv(self, req: dict[str, Any]) -> dict[str, Any]:
        """One KV-shaped WRITE: the planner's descriptors as one transfer with one notification."""
        np = sys.modules["numpy"]
        triples = np.frombuffer(base64.b64decode(req["descs"]), dtype=np.float64).reshape(-1, 3).astype(np.uint64)
        local, remote = self._lists(triples)
        t_post = now()
        h = self.agent.initialize_xfer(
            "WRITE",
            self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs(remote, "DRAM"),
            self.remote,
            str(req["tag"]).encode(),
        )
        if self.agent.transfer(h) == "ERR":
            raise BenchError("ERR_XFER", "NIXL transfer post failed")
        t_ret = now()
        self._wait_xfer(h, float(req.get("timeoutMs", 30_000)))
        t_done = now()
        self.agent.release_xfer_handle(h)
        return {"tPostNs": t_post, "tReturnNs": t_ret, "tDoneNs": t_done}

    def flight(self, req: dict[str, Any]) -> dict[str, Any]:
        """`count` transfers of `size` bytes at once, each its own READ or WRITE (bench peers --faults)."""
        buf = self.need_buf()
        op = "WRITE" if req["kind"] == "write" else "READ"
        size, count = int(req["size"]), int(req["count"])
        if count * size > min(buf.size, self.remote_size):
            raise BenchError("ERR_ARGS", f"flight: {count} x {size} B exceeds the buffers")

        def post(i: int) -> Any:
            h = self.agent.initialize_xfer(
                op,
                self.agent.get_xfer_descs([(buf.base + i * size, size, 0)], "DRAM"),
                self.agent.get_xfer_descs([(self.remote_base + i * size, size, 0)], "DRAM"),
                self.remote,
            )
            if self.agent.transfer(h) == "ERR":
                raise BenchError("ERR_XFER", "NIXL transfer post failed")
            return h

        def check(h: Any) -> str:
            s = self.agent.check_xfer_state(h)
            return "DONE" if s == "DONE" else "ERR" if s == "ERR" else "PROC"

        return {"transfers": flight_outcomes(count, post, check, float(req.get("timeoutMs", 30_000)))}

    def descpost(self, req: dict[str, Any]) -> dict[str, Any]:
        """`count` descriptors of `size` bytes in one WRITE; build, prepare, post and complete timed apart."""
        np = sys.modules["numpy"]
        buf = self.need_buf()
        count, size, stride = int(req["count"]), int(req["size"]), int(req["stride"])
        slots = min(buf.size, self.remote_size) // stride
        t0 = now()
        offs = (np.arange(count, dtype=np.uint64) % np.uint64(slots)) * np.uint64(stride)
        triples = np.stack([offs, offs, np.full(count, size, dtype=np.uint64)], axis=1)
        local, remote = self._lists(triples)
        t1 = now()
        h = self.agent.initialize_xfer(
            "WRITE",
            self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs(remote, "DRAM"),
            self.remote,
        )
        t2 = now()
        if self.agent.transfer(h) == "ERR":
            raise BenchError("ERR_XFER", "NIXL transfer post failed")
        t3 = now()
        self._wait_xfer(h, float(req.get("timeoutMs", 120_000)))
        t4 = now()
        self.agent.release_xfer_handle(h)
        return {
            "buildMs": (t1 - t0) / 1e6,
            "prepMs": (t2 - t1) / 1e6,
            "transferCallMs": (t3 - t2) / 1e6,
            "postMs": (t3 - t1) / 1e6,
            "completeMs": (t4 - t1) / 1e6,
        }

    def _poll_notes(self) -> None:
        for peer, msgs in self.agent.get_new_notifs().items():
            t = now()
            for m in msgs:
                self.notes.append((peer, m, t))

    def idle(self) -> None:
        # get_new_notifs progresses the UCX worker; what it finds is kept for the next request.
        self._poll_notes()

    def _take_notes(self) -> list[tuple[str, bytes, int]]:
        self._poll_notes()
        got, self.notes = self.notes, []
        return got

    def wait_notes(self, req: dict[str, Any]) -> dict[str, Any]:
        tags = {str(t).encode() for t in req["tags"]}
        seen: dict[str, int] = {}

        def got_all() -> bool:
            self._poll_notes()
            keep = []
            for peer, m, t in self.notes:
                if m in tags:
                    seen[m.decode()] = t
                else:
                    keep.append((peer, m, t))
            self.notes = keep
            return len(seen) == len(tags)

        wait_until(got_all, float(req.get("timeoutMs", 30_000)), "notifications")
        return {"arrivals": seen}

    def ping(self, req: dict[str, Any]) -> dict[str, Any]:
        """`reps` round trips of a small notification, one in flight."""
        reps = int(req["reps"])
        payload = b"p" * int(req["bytes"])
        deadline = now() + int(float(req.get("timeoutMs", 60_000)) * 1e6)
        t0 = now()
        for _ in range(reps):
            self.agent.send_notif(self.remote, payload)
            while True:
                if self._take_notes():
                    break
                if now() > deadline:
                    raise BenchError("ERR_TIMEOUT", "ping: no answer")
        seconds = (now() - t0) / 1e9
        return {"seconds": seconds, "n": reps, "rate": reps / seconds}

    def pong(self, req: dict[str, Any]) -> dict[str, Any]:
        reps = int(req["reps"])
        deadline = now() + int(float(req.get("timeoutMs", 60_000)) * 1e6)
        answered = 0
        while answered < reps:
            for peer, m, _ in self._take_notes():
                self.agent.send_notif(peer, m)
                answered += 1
            if now() > deadline:
                raise BenchError("ERR_TIMEOUT", f"pong: {answered}/{reps}")
        return {"n": answered}


# --- Mooncake ----------------------------------------------------------------


class MooncakeSide(Side):
    def __init__(self) -> None:
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

        self.TransferNotify = TransferNotify
        self.Opcode = TransferOpcode
        self.te = TransferEngine()
        self.target = ""
        self.remote_base = 0
        self.remote_size = 0
        self.notes: list[tuple[str, int]] = []

    def init(self, req: dict[str, Any]) -> dict[str, Any]:
        host = str(req["bindAddress"])
        # P2P handshake: no metadata server; peers name each other host:rpc_port.
        rc = self.te.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise BenchError("ERR_INIT", f"TransferEngine.initialize returned {rc}")
        self.session = f"{host}:{self.te.get_rpc_port()}"
        return {
            "system": "mooncake",
            "version": package_version(
                "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"
            ),
            "ucx": "none (own TCP and RDMA transports)",
            "session": self.session,
        }

    def alloc(self, req: dict[str, Any]) -> dict[str, Any]:
        self.buf = Buffer.allocate(int(req["size"]))
        rc = self.te.register_memory(self.buf.base, self.buf.size)
        if rc != 0:
            raise BenchError("ERR_REGISTER", f"register_memory returned {rc}")
        return {"peerInfo": {"session": self.session, "base": self.buf.base, "size": self.buf.size}}

    def connect(self, req: dict[str, Any]) -> dict[str, Any]:
        info = req["peerInfo"]
        self.target = str(info["session"])
        self.remote_base = int(info["base"])
        self.remote_size = int(info["size"])
        return {"remote": self.target}

    def _submit(self, kind: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        fn = self.te.batch_transfer_async_write if kind == "write" else self.te.batch_transfer_async_read
        bid = fn(self.target, local, remote, lengths)
        if bid == 0:
            raise BenchError("ERR_XFER", "Mooncake batch submit failed")
        return int(bid)

    def bw(self, req: dict[str, Any]) -> dict[str, Any]:
        buf = self.need_buf()
        size, iters, window = int(req["size"]), int(req["iters"]), int(req["window"])
        slots = max(1, min(window, buf.size // size, self.remote_size // size))
        inflight: list[int | None] = [None] * window
        started = done = 0
        deadline = now() + int(float(req.get("timeoutMs", 120_000)) * 1e6)
        c0 = time.process_time_ns()
        t0 = now()
        stop_at = t0 + int(float(req.get("maxMs", 1e9)) * 1e6)
        while done < iters:
            if started < iters and now() > stop_at:
                iters = started  # time is up: finish what is in flight, count what was done
            for i in range(window):
                bid = inflight[i]
                if bid is not None:
                    s = self.te.transfer_check_status(bid)
                    if s == 0:
                        continue
                    if s < 0:
                        raise BenchError("ERR_XFER", f"Mooncake transfer status {s}")
                    inflight[i] = None
                    done += 1
                if started < iters:
                    off = (i % slots) * size
                    inflight[i] = self._submit(req["kind"], [buf.base + off], [self.remote_base + off], [size])
                    started += 1
            if now() > deadline:
                raise BenchError("ERR_TIMEOUT", f"bw: {done}/{iters} done before the deadline")
        seconds = (now() - t0) / 1e9
        cpu_ms = (time.process_time_ns() - c0) / 1e6
        return {"seconds": seconds, "n": iters, "gbps": iters * size / seconds / 1e9, "msgRate": iters / seconds, "cpuMs": cpu_ms}

    def kv(self, req: dict[str, Any]) -> dict[str, Any]:
        buf = self.need_buf()
        triples = decode_descs(req["descs"])
        t_post = now()
        local = [buf.base + lo for lo, _, _ in triples]
        remote = [self.remote_base + ro for _, ro, _ in triples]
        lengths = [n for _, _, n in triples]
        rc = self.te.batch_transfer_sync(
            self.target, local, remote, lengths, self.Opcode.Write,
            self.TransferNotify("bench", str(req["tag"])),
        )
        t_done = now()
        if rc != 0:
            raise BenchError("ERR_XFER", f"batch_transfer_sync returned {rc}")
        # A synchronous call: it returns when the data (and the notification) went out.
        return {"tPostNs": t_post, "tReturnNs": t_done, "tDoneNs": t_done}

    def flight(self, req: dict[str, Any]) -> dict[str, Any]:
        """`count` transfers of `size` bytes at once, each its own batch (bench peers --faults)."""
        buf = self.need_buf()
        size, count = int(req["size"]), int(req["count"])
        if count * size > min(buf.size, self.remote_size):
            raise BenchError("ERR_ARGS", f"flight: {count} x {size} B exceeds the buffers")

        def post(i: int) -> Any:
            off = i * size
            return self._submit(req["kind"], [buf.base + off], [self.remote_base + off], [size])

        def check(bid: Any) -> str:
            s = self.te.transfer_check_status(bid)
            return "PROC" if s == 0 else "ERR" if s < 0 else "DONE"

        return {"transfers": flight_outcomes(count, post, check, float(req.get("timeoutMs", 30_000)))}

    def descpost(self, req: dict[str, Any]) -> dict[str, Any]:
        buf = self.need_buf()
        count, size, stride = int(req["count"]), int(req["size"]), int(req["stride"])
        slots = min(buf.size, self.remote_size) // stride
        t0 = now()
        offs = [(i % slots) * stride for i in range(count)]
        local = [buf.base + o for o in offs]
        remote = [self.remote_base + o for o in offs]
        lengths = [size] * count
        t1 = now()
        bid = self._submit("write", local, remote, lengths)
        t2 = now()
        rc = self.te.get_batch_transfer_status([bid])
        t3 = now()
        if rc != 0:
            raise BenchError("ERR_XFER", f"get_batch_transfer_status returned {rc}")
        return {
            "buildMs": (t1 - t0) / 1e6,
            "prepMs": 0.0,
            "transferCallMs": (t2 - t1) / 1e6,
            "postMs": (t2 - t1) / 1e6,
            "completeMs": (t3 - t1) / 1e6,
        }

    def _poll_notes(self) -> None:
        got = self.te.get_notifies()
        if got:
            t = now()
            for n in got:
                self.notes.append((str(n.msg), t))

    def wait_notes(self, req: dict[str, Any]) -> dict[str, Any]:
        tags = {str(t) for t in req["tags"]}
        seen: dict[str, int] = {}

        def got_all() -> bool:
            self._poll_notes()
            keep = []
            for m, t in self.notes:
                if m in tags:
                    seen[m] = t
                else:
                    keep.append((m, t))
            self.notes = keep
            return len(seen) == len(tags)

        wait_until(got_all, float(req.get("timeoutMs", 30_000)), "notifications")
        return {"arrivals": seen}

    def _note_write(self, payload: str) -> None:
        # Mooncake has no standalone notification: a 1-byte WRITE carries it.
        buf = self.need_buf()
        rc = self.te.transfer_sync(
            self.target, buf.base, self.remote_base, 1, self.Opcode.Write,
            self.TransferNotify("bench", payload),
        )
        if rc != 0:
            raise BenchError("ERR_XFER", f"transfer_sync returned {rc}")

    def ping(self, req: dict[str, Any]) -> dict[str, Any]:
        reps = int(req["reps"])
        payload = "p" * int(req["bytes"])
        deadline = now() + int(float(req.get("timeoutMs", 60_000)) * 1e6)
        t0 = now()
        for _ in range(reps):
            self._note_write(payload)
            while not self.te.get_notifies():
                if now() > deadline:
                    raise BenchError("ERR_TIMEOUT", "ping: no answer")
        seconds = (now() - t0) / 1e9
        return {"seconds": seconds, "n": reps, "rate": reps / seconds}

    def pong(self, req: dict[str, Any]) -> dict[str, Any]:
        reps = int(req["reps"])
        deadline = now() + int(float(req.get("timeoutMs", 60_000)) * 1e6)
        answered = 0
        while answered < reps:
            for n in self.te.get_notifies():
                self._note_write(str(n.msg))
                answered += 1
            if now() > deadline:
                raise BenchError("ERR_TIMEOUT", f"pong: {answered}/{reps}")
        return {"n": answered}


# --- the loop ----------------------------------------------------------------


def request_lines(side_ref: list[Side | None]) -> Any:
    """Lines from stdin. While the side asks for it (NIXL over TCP), it is progressed between
    requests instead of blocking: its peer's puts and gets need this side's UCX to progress."""
    buf = b""
    while True:
        side = side_ref[0]
        while side is not None and side.idle_progress:
            ready, _, _ = select.select([0], [], [], 0)
            if ready:
                break
            side.idle()
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line


def main() -> None:
    system = sys.argv[1] if len(sys.argv) > 1 else ""
    side: Side | None = None
    side_ref: list[Side | None] = [None]
    for line in request_lines(side_ref):
        try:
            req = json.loads(line)
        except json.JSONDecodeError:
            continue
        rid = req.get("id")
        op = str(req.get("op"))
        try:
            if op == "exit":
                _REPLY.write(json.dumps({"id": rid, "result": {}}) + "\n")
                break
            if side is None:
                # Importing the peer's package happens here, so a missing or broken
                # install becomes an error reply the driver can put in its table.
                if system == "nixl":
                    side = NixlSide()
                elif system == "mooncake":
                    side = MooncakeSide()
                else:
                    raise BenchError("ERR_ARGUMENT", f"unknown system '{system}'")
            fn = getattr(side, op, None)
            if fn is None or op.startswith("_"):
                raise BenchError("ERR_ARGUMENT", f"unknown op '{op}'")
            side_ref[0] = side
            result = fn(req)
            _REPLY.write(json.dumps({"id": rid, "result": result}) + "\n")
        except ImportError as e:
            msg = f"{type(e).__name__}: {e}"
            _REPLY.write(json.dumps({"id": rid, "error": {"code": "ERR_NOT_INSTALLED", "message": msg}}) + "\n")
        except BenchError as e:
            _REPLY.write(json.dumps({"id": rid, "error": {"code": e.code, "message": str(e)}}) + "\n")
        except Exception as e:  # noqa: BLE001  (any failure of the peer is a result to report)
            msg = f"{type(e).__name__}: {e}"
            _REPLY.write(json.dumps({"id": rid, "error": {"code": "ERR_PEER", "message": msg}}) + "\n")
    _REPLY.flush()
    os._exit(0)  # skip the peers' atexit teardown: the driver has what it needs


if __name__ == "__main__":
    main()
