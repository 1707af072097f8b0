"""Fixtures that start real kvxfer sidecars (the built TypeScript CLI) and always stop them.

Every wait is bounded; every process, socket and shared-memory file a test makes is gone
after it (``leftovers`` checks).
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from pathlib import Path

import pytest

from kvxfer_vllm.harness import REPO, SidecarProc

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
