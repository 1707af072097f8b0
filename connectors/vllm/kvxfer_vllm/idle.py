"""An engine with nothing to run waits for the sidecar instead of stepping (issue 51).

vLLM's engine-core loop steps while any request is in its scheduler, runnable or not: a decode
request whose pushed KV is still coming, a prefill request whose blocks wait for D's read. Each
such step builds an empty batch, sends it to the worker, waits for its answer and sleeps 1 ms,
then does it again, so a decode engine waiting for a push spends a core doing nothing (and,
unpinned, takes it from the prefill it is waiting for). The worker's own short wait
(``WorkerLogic.take_results``) only stretched each empty step to a few milliseconds.

Here the scheduler's half of the connector waits inside such a step instead, before the batch
goes to the worker, until one of:

- new input reaches the engine core (a request, an abort, a utility call): the engine core's
  input queue is a ``queue.Queue``, and the wait is on its own ``not_empty`` condition, so a put
  ends it at once;
- the sidecar says something to a worker (KvReady, Released, KvFailed, the link going down or
  coming back): the worker sends one datagram to a socket this process bound, named by the
  engine id and this process's pid (``wake_address``), and its reader thread notifies the same
  condition;
- a bound passes (``bound_s``), so whatever else the worker checks each step (the sidecar-lost
  bound) still runs.

No vLLM here: the adapter (connector.py) finds the input queue and decides when a step is idle.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def wake_address(engine_id: str, pid: int) -> bytes:
    """The abstract unix socket the scheduler of engine ``engine_id`` in process ``pid`` reads."""
    return b"\0kvxfer-idle-" + f"{engine_id}-{pid}".encode()[:90]


class IdleWaiter:
    """The scheduler side's wait in an idle engine step. ``attach`` the engine core's input queue
    first (without it the wait still ends at a worker's wake or the bound)."""

    def __init__(self, engine_id: str, bound_s: float = 0.05, pid: int | None = None) -> None:
        self.bound_s = bound_s
        self._cond = threading.Condition()
        self._queue: queue.Queue | None = None
        self._woken = False
        #: Waits that ended by a wake, by new input, or by the bound (for tests and logs).
        self.ended = {"wake": 0, "input": 0, "bound": 0}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(wake_address(engine_id, os.getpid() if pid is None else pid))
        except OSError:
            self._sock.close()
            raise
        self._reader = threading.Thread(target=self._read, name="kvxfer-idle-wake", daemon=True)
        self._reader.start()

    def attach(self, q: queue.Queue) -> None:
        """Waits end when something is put in ``q`` (its ``not_empty`` condition is the one
        waited on, under ``q``'s own lock)."""
        # Once, before the first wait, from the thread that waits; the reader thread picks the new
        # condition up at its next wake (one read of an attribute).
        self._queue = q
        self._cond = q.not_empty

    def wait(self) -> str:
        """Waits until woken, input is queued, or the bound passes; says which."""
        cond = self._cond
        with cond:
            if not self._woken and not self._has_input():
                cond.wait(self.bound_s)
            if self._woken:
                why = "wake"
            elif self._has_input():
                why = "input"
            else:
                why = "bound"
            self._woken = False
        self.ended[why] += 1
        return why

    def _has_input(self) -> bool:
        # Under the queue's lock already (its qsize() would take it again).
        return self._queue is not None and len(self._queue.queue) > 0

    def _read(self) -> None:
        while True:
            try:
                self._sock.recv(64)
            except OSError:
                return  # closed
            cond = self._cond
            with cond:
                self._woken = True
                cond.notify_all()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def waker(engine_id: str) -> Callable[[], None]:
    """What a worker calls whenever the sidecar says something: one datagram to its engine's
    scheduler, which runs in the worker's parent process (vLLM's multiprocess executor) or in the
    worker's own (one process). Never blocks, never raises: with no scheduler waiting, or its
    socket's buffer full of wakes already, there is nothing to do."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    targets = {wake_address(engine_id, os.getppid()), wake_address(engine_id, os.getpid())}

    def wake() -> None:
        for t in targets:
            try:
                sock.sendto(b"w", t)
            except OSError:
                pass

    return wake
