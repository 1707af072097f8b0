"""The connector's per-transfer timeline, for ``kvxfer bench vllm --breakdown`` (breakdown.py).

Off unless ``KVXFER_VLLM_TIMELINE`` names a folder: then every process that loads the connector
appends one JSON line per mark to ``<folder>/<pid>.jsonl``: ``{"t": <CLOCK_MONOTONIC seconds>,
"ev": <name>, "tid": <transfer id>, ...}``. CLOCK_MONOTONIC is the clock the sidecars stamp
their trace hops with (src/sidecar/trace.ts, in µs), so both line up on one host. When off, a
mark costs one global read.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, TextIO

ENV = "KVXFER_VLLM_TIMELINE"

_folder = os.environ.get(ENV, "")
_lock = threading.Lock()
_out: TextIO | None = None
_pid = 0


def enabled() -> bool:
    return bool(_folder)


def mark(ev: str, tid: str, **fields: Any) -> None:
    """Records ``ev`` for transfer ``tid`` now (no-op unless the timeline is on)."""
    if not _folder:
        return
    t = time.monotonic()
    line = json.dumps({"t": t, "ev": ev, "tid": tid, **fields})
    global _out, _pid
    with _lock:
        if _out is None or _pid != os.getpid():  # a forked child writes its own file
            _pid = os.getpid()
            os.makedirs(_folder, exist_ok=True)
            _out = open(os.path.join(_folder, f"{_pid}.jsonl"), "a", buffering=1)
        _out.write(line + "\n")


def read(folder: str) -> list[dict[str, Any]]:
    """Every mark written under ``folder``, oldest first."""
    marks: list[dict[str, Any]] = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                marks.extend(json.loads(line) for line in f if line.strip())
    marks.sort(key=lambda m: m["t"])
    return marks
