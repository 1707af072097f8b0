"""Transfer statistics the worker half collects and vLLM reports in its own ``/metrics``.

vLLM (0.32) asks each worker's connector for ``get_kv_connector_stats()`` after every step,
sends the ``data`` dict to its logger process, aggregates it there with this connector's
``build_kv_connector_stats``, and hands it to ``build_prom_metrics``' ``observe`` — the same
path NixlConnector's ``NixlKVConnectorStats`` takes. Plain Python, no vLLM import: the adapter
(connector.py) wraps it in vLLM's base classes.

Counters (all since the last report, summed by ``aggregate``):

- ``transfers``: D, loads that landed (KvReady); P, transfers D confirmed (released
  ``TRANSFERRED``);
- ``bytes``: KV bytes of those transfers (tokens moved x bytes per token, all ranks);
- ``seconds``: D, time from ExpectKv sent to KvReady, summed (with ``transfers``: the mean);
- ``failures``: transfers that failed, any reason (``KvFailed``, a refusal, a lost sidecar);
- ``expired``: of those, a deadline or lease ran out (P's lease, D's watchdog);
- ``recomputed``: D loads reported failed to vLLM, which computes the prompt itself;
- ``link_down``: requests failed at once because the sidecar link was down;
- ``mismatched``: D requests whose prompt did not match the KV P described (``kvxfer_prompt_digest``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

COUNTERS = ("transfers", "bytes", "seconds", "failures", "expired", "recomputed", "link_down", "mismatched")


@dataclass
class TransferStats:
    """Thread-safe counters; ``take()`` returns what accumulated and starts again."""

    data: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, name: str, by: float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown kvxfer counter {name!r}")
        with self._lock:
            self.data[name] = self.data.get(name, 0) + by

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self.data = self.data, {}
        return out

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.data)


def merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Two workers' (or two intervals') counters, summed."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def reduce(data: dict[str, float]) -> dict[str, float]:
    """What vLLM's log line shows for an interval: the counters and the mean transfer time."""
    out = {k: data.get(k, 0) for k in COUNTERS}
    n = data.get("transfers", 0)
    out["avg_transfer_ms"] = round(1000 * data.get("seconds", 0) / n, 3) if n else 0.0
    return out
