"""The idle step's wait (kvxfer_vllm/idle.py), without vLLM: it ends at a worker's wake, at new
input in the engine core's queue, or at its bound, and a wake that came first is not lost."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

import pytest
from conftest import unique

from kvxfer_vllm.idle import UNWATCHED_BOUND_S, IdleWaiter, WorkerRest, limit_engine_spin, wait_bound, waker


@pytest.fixture
def waiter():
    w = IdleWaiter(unique("idle"), bound_s=5.0)
    yield w
    w.close()


def _later(s: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(s), fn()), daemon=True)
    t.start()
    return t


def test_a_workers_wake_ends_the_wait_at_once(waiter):
    waiter.attach(queue.Queue())
    wake = waker(waiter_engine(waiter))
    t0 = time.monotonic()
    _later(0.1, wake)
    assert waiter.wait() == "wake"
    assert 0.05 < time.monotonic() - t0 < 2.0


def test_new_input_in_the_attached_queue_ends_the_wait_and_stays_for_its_reader(waiter):
    q: queue.Queue = queue.Queue()
    waiter.attach(q)
    t0 = time.monotonic()
    _later(0.1, lambda: q.put("request"))
    assert waiter.wait() == "input"
    assert time.monotonic() - t0 < 2.0
    assert q.get_nowait() == "request"
    # Input already there: no wait at all.
    q.put("another")
    t0 = time.monotonic()
    assert waiter.wait() == "input"
    assert time.monotonic() - t0 < 0.5


def test_a_wake_before_the_wait_is_not_lost_and_counts_once(waiter):
    q: queue.Queue = queue.Queue()
    waiter.attach(q)
    waker(waiter_engine(waiter))()
    deadline = time.monotonic() + 2
    while not waiter._woken and time.monotonic() < deadline:  # the reader thread takes it
        time.sleep(0.01)
    t0 = time.monotonic()
    assert waiter.wait() == "wake"
    assert time.monotonic() - t0 < 0.5
    waiter.bound_s = 0.1
    assert waiter.wait() == "bound"
    assert waiter.ended == {"wake": 1, "input": 0, "bound": 1}


def test_nothing_happens_the_bound_ends_it():
    w = IdleWaiter(unique("idle"), bound_s=0.1)
    try:
        w.attach(queue.Queue())
        t0 = time.monotonic()
        assert w.wait() == "bound"
        assert 0.09 < time.monotonic() - t0 < 2.0
    finally:
        w.close()


def test_without_an_input_queue_the_bound_is_short(waiter):
    """New input cannot end a wait with no queue attached, so a new request waits for the bound:
    it is cut to UNWATCHED_BOUND_S whatever bound_s says (5 s here), and is bound_s once a queue
    is attached."""
    t0 = time.monotonic()
    assert waiter.wait() == "bound"
    assert UNWATCHED_BOUND_S * 0.9 < time.monotonic() - t0 < 1.0
    waiter.attach(queue.Queue())
    waiter.bound_s = 0.3
    t0 = time.monotonic()
    assert waiter.wait() == "bound"
    assert 0.27 < time.monotonic() - t0 < 2.0


def test_the_bound_is_at_most_a_quarter_of_the_sidecar_lost_bound():
    assert wait_bound(0.5, 10.0) == 0.5
    assert wait_bound(0.5, 1.0) == 0.25
    assert wait_bound(0.05, 0.1) == 0.025


def test_a_reader_blocked_on_the_queue_still_gets_its_item_after_wakes(waiter):
    """The engine core blocks on ``input_queue.get()`` when it has nothing at all; a wake notifies
    the same condition, which must not lose or duplicate what is put later."""
    q: queue.Queue = queue.Queue()
    waiter.attach(q)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(q.get(timeout=5)), daemon=True)
    reader.start()
    wake = waker(waiter_engine(waiter))
    for _ in range(3):
        wake()
    time.sleep(0.1)
    assert got == []
    q.put("request")
    reader.join(5)
    assert got == ["request"]


def test_a_waker_with_no_scheduler_listening_neither_blocks_nor_raises():
    wake = waker(unique("nobody"))
    t0 = time.monotonic()
    for _ in range(1000):
        wake()
    assert time.monotonic() - t0 < 2.0


def test_one_engine_ids_socket_per_process():
    engine = unique("idle")
    w = IdleWaiter(engine, bound_s=0.1)
    try:
        with pytest.raises(OSError):
            IdleWaiter(engine, bound_s=0.1)
        # Another process's scheduler of the same engine id binds its own name.
        IdleWaiter(engine, bound_s=0.1, pid=os.getpid() + 1).close()
    finally:
        w.close()


def waiter_engine(w: IdleWaiter) -> str:
    """The engine id a waiter was made for (its socket's name)."""
    name = w._sock.getsockname()
    name = name.decode() if isinstance(name, bytes) else name
    return name.lstrip("\0").removeprefix("kvxfer-idle-").rsplit("-", 1)[0]


# ---- WorkerRest: a worker stops spinning once its engine has gone quiet ----------------------


class _Spin:
    """What WorkerRest touches of vLLM's SpinCondition: the reader's last read."""

    def __init__(self, last_read: float) -> None:
        self.last_read = last_read


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_worker_rest_marks_a_quiet_reader_idle_and_leaves_a_busy_one_alone() -> None:
    clock = _Clock()
    rest = WorkerRest(rest_after_s=0.02, period_s=3600, clock=clock)  # the thread never looks
    try:
        spin = _Spin(last_read=99.0)
        assert not rest.check()  # nothing attached
        rest.attach(spin)
        assert not rest.check()  # no step has ended yet
        rest.step_ended()  # at 100.0; the last read (99.0) came before
        clock.t = 100.01
        assert not rest.check() and spin.last_read == 99.0  # not quiet long enough
        clock.t = 100.03
        assert rest.check() and spin.last_read == 0.0 and rest.rested == 1
        assert not rest.check() and rest.rested == 1  # resting already: nothing more to do
        # A step that has begun is running: left alone however long it takes.
        spin.last_read = 100.04
        clock.t = 100.041
        rest.step_began()
        clock.t = 105.0
        assert not rest.check() and spin.last_read == 100.04
        rest.step_ended()  # it ended at 105.0
        clock.t = 105.05
        assert rest.check() and spin.last_read == 0.0 and rest.rested == 2
    finally:
        rest.close()


def test_worker_rest_counts_a_read_after_a_steps_end_as_activity_not_as_a_step() -> None:
    """vLLM 0.32 sends a step that runs the model as two messages (execute_model, whose end the
    connector sees, then sample_tokens, read after it): the reader rests rest_after_s after that
    last read, not never."""
    clock = _Clock()
    rest = WorkerRest(rest_after_s=0.02, period_s=3600, clock=clock)
    try:
        spin = _Spin(last_read=100.0)  # execute_model read
        rest.attach(spin)
        rest.step_began()
        clock.t = 100.2
        rest.step_ended()  # the forward ran 200 ms
        spin.last_read = 100.201  # sample_tokens read
        clock.t = 100.211
        assert not rest.check() and spin.last_read == 100.201  # read 10 ms ago: may spin
        clock.t = 100.222
        assert rest.check() and spin.last_read == 0.0 and rest.rested == 1
    finally:
        rest.close()


class _RealSpin:
    """vLLM's own SpinCondition, a writer and a reader on one notification socket."""

    def __init__(self) -> None:
        import zmq
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        self.ctx = zmq.Context()
        self.path = f"/tmp/{unique('kvxfer-rest')}"
        address = f"ipc://{self.path}"
        self.writer = SpinCondition(is_reader=False, context=self.ctx, notify_address=address)
        self.reader = SpinCondition(is_reader=True, context=self.ctx, notify_address=address)

    def spin_cpu(self, seconds: float, after_read: Callable[[], None] | None = None) -> float:
        """CPU seconds a reader thread spends in `seconds` of waits after one read."""
        out: list[float] = []

        def run() -> None:
            self.reader.record_read()
            if after_read is not None:
                after_read()
            c0 = time.thread_time()
            end = time.monotonic() + seconds
            while time.monotonic() < end:  # bounded: each wait is at most 50 ms
                self.reader.wait(timeout_ms=50)
            out.append(time.thread_time() - c0)

        t = threading.Thread(target=run)
        t.start()
        t.join(timeout=seconds + 5)
        assert not t.is_alive()
        return out[0]

    def woken_after_notify(self) -> float:
        """How long a reader that sleeps waits when a write notifies 50 ms into its wait."""
        woke: list[float] = []

        def wait_once() -> None:
            t0 = time.monotonic()
            self.reader.wait(timeout_ms=2000)
            woke.append(time.monotonic() - t0)

        waiter = threading.Thread(target=wait_once)
        waiter.start()
        time.sleep(0.05)
        self.writer.notify()
        waiter.join(timeout=5)
        assert woke
        return woke[0]

    def close(self) -> None:
        for s in (self.writer.local_notify_socket, self.reader.local_notify_socket, self.reader.read_cancel_socket,
                  self.reader.write_cancel_socket):
            s.close(linger=0)
        self.ctx.term()
        if os.path.exists(self.path):
            os.unlink(self.path)


def test_worker_rest_thread_ends_a_real_spin_condition_spin() -> None:
    """vLLM's own SpinCondition: a reader waiting on it spins (sched_yield) for a second after its
    last read; with WorkerRest it sleeps on the notification socket within rest_after_s, burns
    (almost) no CPU, and a write still wakes it at once."""
    real = _RealSpin()
    try:
        spinning = real.spin_cpu(0.5)
        rest = WorkerRest(rest_after_s=0.02)
        rest.attach(real.reader)
        try:
            resting = real.spin_cpu(0.5, rest.step_ended)
            assert rest.rested >= 1
            # A write notifies: a resting reader is woken well within its 2 s poll.
            assert real.woken_after_notify() < 1.0
        finally:
            rest.close()
        # vLLM's loop spins most of the half second; resting, the reader sleeps after ~20 ms.
        assert spinning > 0.2, spinning
        assert resting < spinning / 3, (resting, spinning)
    finally:
        real.close()


def test_limit_engine_spin_makes_the_engine_cores_reads_sleep_after_spin_s() -> None:
    """The engine core's reads of its workers' answers (an executor's ``response_mqs``, each with
    vLLM's SpinCondition): after ``limit_engine_spin`` a reader spins ``spin_s``, not a second,
    and a write still wakes it at once; an executor without queues is left alone."""
    real = _RealSpin()
    try:
        class _Mq:
            _spin_condition = real.reader

        class _Executor:
            response_mqs = [_Mq()]

        spinning = real.spin_cpu(0.5)
        assert limit_engine_spin(_Executor(), 0.002) == 1 and real.reader.busy_loop_s == 0.002
        sleeping = real.spin_cpu(0.5)
        assert real.woken_after_notify() < 1.0
        assert spinning > 0.2, spinning
        assert sleeping < spinning / 3, (sleeping, spinning)
        assert limit_engine_spin(object(), 0.002) == 0  # one process: no queues
        assert limit_engine_spin(None, 0.002) == 0
    finally:
        real.close()
