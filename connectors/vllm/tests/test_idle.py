"""The idle step's wait (kvxfer_vllm/idle.py), without vLLM: it ends at a worker's wake, at new
input in the engine core's queue, or at its bound, and a wake that came first is not lost."""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
from conftest import unique

from kvxfer_vllm.idle import IdleWaiter, waker


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
        t0 = time.monotonic()
        assert w.wait() == "bound"
        assert 0.09 < time.monotonic() - t0 < 2.0
    finally:
        w.close()


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
