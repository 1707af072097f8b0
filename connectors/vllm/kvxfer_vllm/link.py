"""The engine's end of the engine link (docs/engine-link.md): a ZeroMQ DEALER
connected to the sidecar's ROUTER, one protobuf message per frame.

One I/O thread owns the socket (ZeroMQ sockets are not thread-safe): ``send``
queues an encoded frame and wakes it through a pipe; received frames are
size-capped, decoded and handed to ``on_message`` on that thread; a socket
monitor reports ``connected`` / ``disconnected`` to ``on_state``, which is how
the connector notices a sidecar that died or restarted. Nothing blocks the
caller: a full queue raises ``LinkError ERR_SEND_FAILED`` at once.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from ._gen.kvxfer.v1 import engine_pb2
from .errors import LinkError

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 16 << 20
#: Frames queued for the I/O thread at most (the sidecar's side holds as many).
MAX_QUEUED = 100_000
LINGER_MS = 200

MessageHandler = Callable[[engine_pb2.SidecarToEngine], None]
StateHandler = Callable[[str], None]


class EngineLink:
    """The connector's engine link. ``start()`` returns at once: ZeroMQ connects and
    reconnects by itself, so the engine may start before its sidecar."""

    def __init__(
        self,
        endpoint: str,
        on_message: MessageHandler,
        on_state: StateHandler | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self.endpoint = endpoint
        self.max_frame_bytes = max_frame_bytes
        self._on_message = on_message
        self._on_state = on_state or (lambda _state: None)
        self._out: collections.deque[list[bytes]] = collections.deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.connected = False
        self.dropped_frames = 0

    def start(self) -> None:
        if self._thread is not None:
            raise LinkError("ERR_STATE", "engine link already started")
        self._thread = threading.Thread(target=self._run, name="kvxfer-engine-link", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._start_error is not None:
            raise LinkError("ERR_CONNECT", f"cannot connect the engine link to {self.endpoint}: {self._start_error}")

    def send(self, msg: engine_pb2.EngineToSidecar) -> None:
        """Queues one message; raises LinkError (ERR_CLOSED, ERR_SEND_FAILED when the queue is full)."""
        self.send_raw(msg.SerializeToString())

    def send_raw(self, frame: bytes | list[bytes]) -> None:
        """Queues raw frames (tests send what an engine should not)."""
        frames = frame if isinstance(frame, list) else [frame]
        with self._lock:
            if self._closed:
                raise LinkError("ERR_CLOSED", "engine link is closed")
            if len(self._out) >= MAX_QUEUED:
                raise LinkError("ERR_SEND_FAILED", f"{MAX_QUEUED} messages already queued for the sidecar")
            self._out.append(frames)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread is awake

    def close(self, timeout: float = 2.0) -> None:
        """Idempotent and bounded; what is queued gets LINGER_MS to leave."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # --- the I/O thread -------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = mon = None
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            sock.setsockopt(zmq.SNDHWM, MAX_QUEUED)
            sock.setsockopt(zmq.SNDTIMEO, 0)
            # ZeroMQ drops a connection that sends a frame above this, before buffering it.
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes * 4)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(self.endpoint)
        except Exception as err:  # noqa: BLE001 - reported to start()
            self._start_error = err
            self._ready.set()
            for s in (mon, sock):
                if s is not None:
                    s.close(0)
            ctx.term()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closed:
                events = dict(poller.poll(100))
                if self._wake_r in events:
                    self._drain_wakeups()
                self._flush(sock)
                if mon in events:
                    self._monitor(mon)
                if sock in events:
                    self._receive(sock)
            self._flush(sock)
        finally:
            sock.disable_monitor()
            mon.close(0)
            sock.close(LINGER_MS)
            ctx.term()

    def _drain_wakeups(self) -> None:
        try:
            while select.select([self._wake_r], [], [], 0)[0]:
                if not os.read(self._wake_r, 4096):
                    break
        except OSError:
            pass

    def _flush(self, sock: zmq.Socket) -> None:
        while True:
            with self._lock:
                if not self._out:
                    return
                frames = self._out.popleft()
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                self.dropped_frames += 1
                log.warning("kvxfer engine link: sidecar queue full, message dropped")
            except zmq.ZMQError as err:
                self.dropped_frames += 1
                log.error("kvxfer engine link: send failed: %s", err)

    def _monitor(self, mon: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event.get("event")
            if kind == zmq.EVENT_CONNECTED:
                self.connected = True
                self._notify_state("connected")
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self._notify_state("disconnected")

    def _notify_state(self, state: str) -> None:
        try:
            self._on_state(state)
        except Exception:  # noqa: BLE001 - a handler bug must not stop the link
            log.exception("kvxfer engine link: state handler failed")

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 1:
                log.warning("kvxfer engine link: sidecar sent %d parts; dropped", len(frames))
                continue
            body = frames[0]
            if len(body) > self.max_frame_bytes:
                log.warning("kvxfer engine link: sidecar frame of %d bytes above the cap; dropped", len(body))
                continue
            msg = engine_pb2.SidecarToEngine()
            try:
                msg.ParseFromString(body)
            except Exception as err:  # noqa: BLE001 - malformed input is logged, never fatal
                log.warning("kvxfer engine link: malformed frame from the sidecar: %s", err)
                continue
            if msg.WhichOneof("msg") is None:
                log.warning("kvxfer engine link: sidecar sent a message with nothing set; dropped")
                continue
            try:
                self._on_message(msg)
            except Exception:  # noqa: BLE001
                log.exception("kvxfer engine link: message handler failed")


def engine_message(**kind: object) -> engine_pb2.EngineToSidecar:
    """``engine_message(prefill_done=engine_pb2.PrefillDone(...))``."""
    return engine_pb2.EngineToSidecar(**kind)  # type: ignore[arg-type]
