"""Fixtures that start real kvxfer sidecars (the built TypeScript CLI) and always stop them.

Every wait is bounded; every process, socket and shared-memory file a test makes is gone
after it (``leftovers`` checks).
"""

from __future__ import annotations

import itertools
import json
import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CLI = REPO / "dist" / "src" / "cli" / "main.js"
_ids = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


class Sidecar:
    """One `kvxfer sidecar` process: started, ready line read (bounded), stopped on close."""

    def __init__(self, engine_id: str, role: str, socket: str, log_dir: Path, *extra: str) -> None:
        if not CLI.exists():
            pytest.fail(f"{CLI} is missing: run `npm run build` first")
        self.engine_id = engine_id
        self.socket = socket
        self.log_path = log_dir / f"sidecar-{engine_id}.log"
        args = [
            "node", str(CLI), "sidecar",
            "--engine-id", engine_id,
            "--role", role,
            "--engine-socket", socket,
            "--listen", "127.0.0.1:0",
            "--grpc", "127.0.0.1:0",
            "--log-level", "info",
            *extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True)
        self.ready = self._read_ready(20.0)
        self.side_channel: str = self.ready["sideChannel"]
        self.grpc: str = self.ready["grpc"]

    def _read_ready(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if r:
                line = self.proc.stdout.readline()
                if line.strip().startswith("{"):
                    ev = json.loads(line)
                    if ev.get("event") == "ready":
                        return ev
            if self.proc.poll() is not None:
                break
        self.close()
        pytest.fail(f"sidecar {self.engine_id} not ready in {timeout} s: {self.log_path.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: what a crash looks like to its engine and peers."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()
        path = self.socket.removeprefix("ipc://")
        if self.socket.startswith("ipc://") and os.path.exists(path):
            os.unlink(path)  # a SIGKILLed sidecar cannot remove its socket file

    def status(self) -> dict:
        out = subprocess.run(
            ["node", str(CLI), "status", self.grpc, "--json"], capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


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

    def start(role: str, *extra: str, engine_id: str | None = None, socket: str | None = None) -> Sidecar:
        eid = engine_id or unique(role[0])
        sock = socket or f"ipc:///tmp/{unique('kvxfer-py')}.sock"
        s = Sidecar(eid, role, sock, workdir, *extra)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


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
