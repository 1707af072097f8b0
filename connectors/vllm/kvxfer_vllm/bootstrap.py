"""D's side of a router that names P by its bootstrap URL instead of P's sidecar address.

vllm-router in ``--kv-connector mooncake`` mode sends P and D their requests at once and gives D
``remote_bootstrap_addr`` (``http://P-host:bootstrap-port``) and ``remote_engine_id``, learnt from
that URL's ``GET /query`` (the P sidecar's ``--bootstrap``, in vLLM's Mooncake bootstrap form:
data-parallel rank → ``{engine_id, worker_addr: {tp rank: {pp rank: address}}}``). D needs P's
sidecar side channel to register its blocks (push): ``fill_source`` asks the same URL for it and
writes it into the params as ``remote_host`` / ``remote_port``, as if the router had sent them.

The scheduler asks for every new request, so answers are kept ``ttl_s`` (a restarted P sidecar
listens on a new port: at worst one such window of requests computes locally), and a failed
query for ``retry_s``, so an unreachable bootstrap costs one bounded wait, not one per request.
Plain Python, no vLLM.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from .params import BadParams, split_host_port

#: Largest /query answer read (one entry per data-parallel rank: a few hundred bytes each).
MAX_ANSWER_BYTES = 1 << 16


def _get(url: str, timeout_s: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - http(s) checked
        body: bytes = resp.read(MAX_ANSWER_BYTES + 1)
    if len(body) > MAX_ANSWER_BYTES:
        raise ValueError(f"answer longer than {MAX_ANSWER_BYTES} bytes")
    return body


class BootstrapResolver:
    def __init__(self, *, timeout_s: float = 2.0, ttl_s: float = 5.0, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 fetch: Callable[[str, float], bytes] = _get) -> None:
        self.timeout_s, self.ttl_s, self.retry_s = timeout_s, ttl_s, retry_s
        self._clock, self._fetch = clock, fetch
        #: url → (until, answer or the error it gave)
        self._cache: dict[str, tuple[float, dict[str, Any] | BadParams]] = {}

    def _query(self, base: str) -> dict[str, Any]:
        now = self._clock()
        hit = self._cache.get(base)
        if hit is not None and now < hit[0]:
            if isinstance(hit[1], BadParams):
                raise hit[1]
            return hit[1]
        try:
            answer = json.loads(_checked_get(self._fetch, base, self.timeout_s))
            if not isinstance(answer, dict):
                raise ValueError(f"expected a JSON object, got {type(answer).__name__}")
        except (OSError, ValueError) as err:  # URLError and JSONDecodeError among them
            bad = BadParams("remote_bootstrap_addr", f"{base}/query: {err}")
            self._cache[base] = (now + self.retry_s, bad)
            raise bad from err
        self._cache[base] = (now + self.ttl_s, answer)
        return answer

    def side_channel(self, base: str, engine_id: str) -> str:
        """P's sidecar side channel ``host:port`` for ``engine_id`` at bootstrap URL ``base``."""
        answer = self._query(base)
        served = []
        for entry in answer.values():
            if not isinstance(entry, dict):
                continue
            served.append(entry.get("engine_id"))
            if entry.get("engine_id") != engine_id:
                continue
            try:
                address = entry["worker_addr"]["0"]["0"]
            except (KeyError, TypeError):
                address = None
            if not isinstance(address, str) or ":" not in address:
                raise BadParams("remote_bootstrap_addr",
                                f"{base}/query names engine {engine_id!r} without a side channel (worker_addr 0/0)")
            return address
        raise BadParams("remote_engine_id", f"{engine_id!r} is not served by {base} (it serves {served})")


def _checked_get(fetch: Callable[[str, float], bytes], base: str, timeout_s: float) -> bytes:
    parts = urllib.parse.urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError("must be an http(s)://host:port URL")
    return fetch(base.rstrip("/") + "/query", timeout_s)


def fill_source(params: dict[str, Any], resolver: BootstrapResolver) -> None:
    """D's params naming P by bootstrap URL and engine id gain ``remote_host`` / ``remote_port``.

    Params that already name P's sidecar (``remote_host``), or name no bootstrap, are left as they
    are. Raises BadParams naming the field at fault.
    """
    if params.get("remote_host") or "remote_bootstrap_addr" not in params:
        return
    base, engine_id = params.get("remote_bootstrap_addr"), params.get("remote_engine_id")
    if not isinstance(base, str) or not base:
        raise BadParams("remote_bootstrap_addr", f"must be P's bootstrap URL, got {base!r}")
    if not isinstance(engine_id, str) or not engine_id:
        raise BadParams("remote_engine_id", f"must name P's engine (with remote_bootstrap_addr), got {engine_id!r}")
    address = resolver.side_channel(base, engine_id)
    try:
        params["remote_host"], params["remote_port"] = split_host_port(address)
    except ValueError as err:
        raise BadParams("remote_bootstrap_addr", f"{base}/query names side channel {address!r}") from err
