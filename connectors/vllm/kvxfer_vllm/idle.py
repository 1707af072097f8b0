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
  bound) still runs. Each wait that ends there is a whole empty step of the engine core and its
  workers; at the first bound, 0.05 s, those steps were a push-registered D's extra CPU over a
  pull D's (0.35 against 0.28 CPU-s per 4096-token request), so the bound is long (the
  connector's ``idle_wait_s``, 0.5 s by default) and shortened where something depends on it: to
  a quarter of the sidecar-lost bound (``wait_bound``), and to ``UNWATCHED_BOUND_S`` while no
  input queue is attached (then a new request waits for the bound).

No vLLM here: the adapter (connector.py) finds the input queue and decides when a step is idle.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


#: The bound of a wait that new input cannot end (no input queue attached): a new request waits
#: for it, so it stays short.
UNWATCHED_BOUND_S = 0.05


def wait_bound(idle_wait_s: float, lost_timeout_s: float) -> float:
    """The idle wait's bound: ``idle_wait_s``, but at most a quarter of the sidecar-lost bound,
    which the worker checks once per step (a wait must not stretch it by more than that)."""
    return min(idle_wait_s, lost_timeout_s / 4)


def wake_address(engine_id: str, pid: int) -> bytes:
    """The abstract unix socket the scheduler of engine ``engine_id`` in process ``pid`` reads."""
    return b"\0kvxfer-idle-" + f"{engine_id}-{pid}".encode()[:90]


class IdleWaiter:
    """The scheduler side's wait in an idle engine step. ``attach`` the engine core's input queue
    first (without it the wait still ends at a worker's wake or the bound, at most
    ``UNWATCHED_BOUND_S``)."""

    def __init__(self, engine_id: str, bound_s: float, pid: int | None = None) -> None:
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
        bound = self.bound_s if self._queue is not None else min(self.bound_s, UNWATCHED_BOUND_S)
        with cond:
            if not self._woken and not self._has_input():
                cond.wait(bound)
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


class WorkerRest:
    """Ends a worker's spin once its engine has gone quiet.

    vLLM's worker reads each step from a shared-memory queue and, after every read, spins
    (``sched_yield``) for a second before it sleeps on the queue's notification socket
    (``SpinCondition``, vLLM 0.32-0.33): so back-to-back steps cost no wake-up. An engine that has
    finished its last request then burns a core for that second, and a decode engine between
    requests (the next prompt still in prefill) does so after every request: about one CPU-second
    per request at long prompts, measured here, on the same cores the prefill needs.

    A thread here looks every ``period_s``: once a step has ended (``step_ended``), no step has
    begun since (``step_began``) and nothing was read from the queue for ``rest_after_s``, it
    marks the queue's last read long past (``last_read = 0``), so the spinning reader sleeps at
    its next look; every write to the queue notifies, so the next step wakes it at once. A step
    that has begun is left alone however long it runs. Reads that are not steps count only as
    activity: vLLM 0.32 sends each step that runs the model as two messages, ``execute_model``
    then ``sample_tokens``, so the last read of such a step comes after its end (reading that as
    "a step is running", as this class did first, left a prefill engine's worker spinning for
    the whole second after every prefill, on the core its sidecar needed). A race with a read
    just then costs that reader one wake-up, nothing more.
    """

    def __init__(self, rest_after_s: float = 0.003, period_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rest_after_s = rest_after_s
        self.period_s = period_s if period_s is not None else max(rest_after_s / 2, 0.001)
        self._clock = clock
        self._spin: Any = None
        self._began = 0.0
        self._ended = 0.0
        #: Times a spinning reader was told to sleep (for tests and logs).
        self.rested = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvxfer-worker-rest", daemon=True)
        self._thread.start()

    def attach(self, spin_condition: Any) -> None:
        """The reader's ``SpinCondition`` (anything with a ``last_read`` of ``time.monotonic``)."""
        self._spin = spin_condition

    def step_began(self) -> None:
        """The worker began a step (its connector metadata bound)."""
        self._began = self._clock()

    def step_ended(self) -> None:
        """The worker finished a step (its results taken): what comes next is a read."""
        self._ended = self._clock()

    def check(self) -> bool:
        """One look (the thread's, or a test's): tells a reader idle long enough to sleep."""
        spin = self._spin
        ended = self._ended
        if spin is None or ended == 0.0 or self._began > ended:
            return False  # nothing attached, no step seen yet, or inside a step
        last_read = spin.last_read
        if last_read == 0.0:
            return False  # already resting
        if self._clock() - max(ended, last_read) < self.rest_after_s:
            return False  # a step, or another message, came too recently
        spin.last_read = 0.0
        self.rested += 1
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check()
            except Exception:  # a bug here must not kill the worker: log once and stop looking
                log.exception("kvxfer: worker rest check failed; the worker spins as vLLM's does")
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def limit_engine_spin(executor: Any, spin_s: float) -> int:
    """Makes the engine core sleep, not spin, while its workers run a step.

    vLLM's engine core reads each step's answer from its workers' shared-memory queues, and a
    reader spins (``sched_yield``) for ``busy_loop_s`` (a second) after its last read before it
    sleeps on the queue's notification socket (``SpinCondition``, vLLM 0.32-0.33). Steps come
    back to back while requests run, so the engine core spins for the whole of every step: a
    profile of a decode engine here put 62% of its engine core's active samples in that
    ``sched_yield``, and, unpinned, it spins on the cores the model and the sidecars need. With
    ``busy_loop_s`` = ``spin_s`` it spins only that long after an answer; the worker's write
    notifies, so a longer step's answer wakes it at once. Returns the queues changed (0 where the executor has none,
    e.g. one process)."""
    changed = 0
    for mq in getattr(executor, "response_mqs", None) or ():
        spin = getattr(mq, "_spin_condition", None)
        if spin is not None and hasattr(spin, "busy_loop_s"):
            spin.busy_loop_s = spin_s
            changed += 1
    return changed
