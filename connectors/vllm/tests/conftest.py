"""Fixtures that start real kvxfer sidecars (the built TypeScript CLI) and always stop them.

Every wait is bounded; every process, socket and shared-memory file a test makes is gone
after it (``leftovers`` checks).
"""

from __future__ import annotations

import random

import contextlib
import itertools
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvxfer_vllm_testing.harness import REPO, EngineSpec, PdRouter, Proc, SidecarProc, VllmServer, _group_alive
from kvxfer_vllm_testing.tiny_model import make_tiny_model

_ids = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def shm_dir():
    """A private folder in /dev/shm for this test's KV files; the test must leave it empty."""
    d = Path("/dev/shm") / unique("kvxfer-pytest")
    d.mkdir()
    yield d
    left = sorted(p.name for p in d.iterdir())
    shutil.rmtree(d, ignore_errors=True)
    assert not left, f"shared-memory files left behind: {left}"


@pytest.fixture
def sidecars(workdir: Path):
    """``start(role, *flags, engine_id=..., socket=...)`` -> Sidecar; all stopped afterwards."""
    started: list[Sidecar] = []

    def start(role: str, *extra: str, engine_id: str | None = None, socket: str | None = None) -> SidecarProc:
        eid = engine_id or unique(role[0])
        sock = socket or f"ipc:///tmp/{unique('kvxfer-py')}.sock"
        s = SidecarProc(eid, role, sock, workdir, *extra)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    """Polls ``predicate`` until it returns something truthy; fails the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def stop_deployment(front: list[Proc], sidecars: list[SidecarProc], shm: Path) -> None:
    """Stops a real deployment and checks it left nothing: ``front`` (routers, then engines) first,
    then the sidecars; no process of any of them, no KV file in ``shm`` (removed), no socket."""
    for proc in front:
        proc.stop(60)
    for sc in sidecars:
        sc.stop()
    # vLLM force-kills its workers at shutdown; the connector's watchers remove their files
    # within half a second of the worker's death.
    deadline = time.monotonic() + 10
    while os.listdir(shm) and time.monotonic() < deadline:
        time.sleep(0.2)
    left_files = sorted(os.listdir(shm))
    shutil.rmtree(shm, ignore_errors=True)
    for proc in [*front, *sidecars]:
        assert not _group_alive(proc.pid), f"{proc.args[:4]} left processes behind"
    assert not left_files, f"shared-memory files left behind: {left_files}"
    for sc in sidecars:
        assert not os.path.exists(sc.socket.removeprefix("ipc://")), f"{sc.socket} left behind"


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids made from ``seed`` (two seeds share no prefix: no prefix-cache hit; the
    former arithmetic gave seeds 1000 apart the same prompt)."""
    rng = random.Random(seed)
    return [3 + rng.randrange(500) for _ in range(n)]


@dataclass
class Deployment:
    """Two real vLLM engines (P on core 0, D on core 1), each with its sidecar, and a P/D router."""

    p: VllmServer
    d: VllmServer
    p_sc: SidecarProc
    d_sc: SidecarProc
    router: PdRouter
    work: Path
    shm: Path


@contextlib.contextmanager
def pd_deployment(work: Path, block: int, extra: dict[str, Any], model: str | None = None,
                  max_model_len: int = 1024, engine_args: tuple[str, ...] = ()) -> Iterator[Deployment]:
    """Starts a P/D deployment of a tiny model made here (or ``model``), with ``extra``
    kv_connector_extra_config; stops it at the end and checks it left nothing (``stop_deployment``)."""
    model = model or make_tiny_model(str(work / "model"))
    shm = Path("/dev/shm") / unique("kvxfer-e2e")
    shm.mkdir()
    p_sc = SidecarProc(unique("p"), "prefill", f"ipc:///tmp/{unique('kvxfer-e2e')}.sock", work)
    d_sc = SidecarProc(unique("d"), "decode", f"ipc:///tmp/{unique('kvxfer-e2e')}.sock", work)
    extra = {"sidecar_lost_timeout_s": 2.0, "register_timeout_s": 300.0, **extra}
    p = VllmServer(EngineSpec(model, p_sc.engine_id, p_sc.socket, str(shm), block_size=block, cores="0", extra=extra,
                              max_model_len=max_model_len, args=engine_args), work)
    d = VllmServer(EngineSpec(model, d_sc.engine_id, d_sc.socket, str(shm), block_size=block, cores="1", extra=extra,
                              max_model_len=max_model_len, args=engine_args), work)
    dep = None
    try:
        p.wait_ready()
        d.wait_ready()
        dep = Deployment(p, d, p_sc, d_sc, PdRouter(p, d, p_sc.side_channel), work, shm)
        yield dep
    finally:
        # Tests may replace a sidecar (a restart): stop the current ones and the originals.
        sidecars = {id(s): s for s in (p_sc, d_sc, *((dep.p_sc, dep.d_sc) if dep else ()))}.values()
        stop_deployment([p, d], list(sidecars), shm)
