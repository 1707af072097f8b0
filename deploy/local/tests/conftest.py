"""Fixtures of the deployment tests (``npm run test:cluster``, deploy/local/test.sh): kvxfer's own
Docker daemon, started here when it is not running and stopped again by whoever started it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from common import DOCKER, LOCAL, run  # noqa: E402

IMAGES = ["kvxfer:local", "kvxfer-engine:local", "kvxfer-router:local", "kvxfer-pause:local"]


@pytest.fixture(scope="session")
def docker_daemon():
    env = run("bash", str(LOCAL / "docker.sh"), "env").stdout.strip()
    key, _, value = env.partition("=")
    os.environ[key] = value
    started = run(DOCKER, "version", check=False, timeout=20).returncode != 0
    if started:
        run("bash", str(LOCAL / "docker.sh"), "start", timeout=60)
    try:
        missing = [i for i in IMAGES if run(DOCKER, "image", "inspect", i, check=False).returncode != 0]
        if missing:
            pytest.fail(f"images missing: {missing}: build them with deploy/local/images.sh")
        yield
    finally:
        if started:
            run("bash", str(LOCAL / "docker.sh"), "stop", timeout=60)
