"""The connector's settings, from ``kv_transfer_config.kv_connector_extra_config``.

Every key is optional; unknown keys are refused (a typo must not silently fall
back to a default). The engine id comes from ``kv_transfer_config.engine_id``
and must equal the sidecar's ``--engine-id``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

_ENGINE_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

#: How the KV cache reaches the sidecar.
#: - ``shared``: vLLM allocates its KV cache inside a shared-memory file that the
#:   sidecar maps: zero copies (CPU engines).
#: - ``host_buffer``: the KV cache stays where vLLM put it (GPU memory) and a
#:   shared-memory mirror holds the blocks that move: P copies device -> host after
#:   prefill, D copies host -> device once the KV has landed.
#: - ``device``: the KV cache stays in GPU memory and the sidecar moves it in place: each worker
#:   exports its KV allocations as CUDA IPC handles, the sidecar opens them (``device.py``,
#:   docs/gpu.md). Not yet the default on GPUs: it has not run on a GPU yet.
PLACEMENTS = ("shared", "host_buffer", "device")
#: Where the shared KV lives (``kv_memory``): files the sidecar maps, or segments it allocates.
KV_MEMORY = ("file", "segment")


@dataclass(frozen=True)
class ConnectorConfig:
    engine_id: str
    #: ZeroMQ endpoint of the sidecar's engine link (the sidecar's --engine-socket).
    engine_socket: str
    #: Folder for the shared-memory KV files (the sidecar maps them from there).
    shm_dir: str
    placement: str
    #: Where the shared KV lives: ``file`` (files under shm_dir the sidecar maps) or ``segment``
    #: (segments the sidecar allocates: plain copies between two sidecars of one host).
    kv_memory: str
    #: Bound on waiting for the sidecar's ``Registered`` at start-up.
    register_timeout_s: float
    #: After the sidecar connection drops, how long to wait for it to come back before
    #: the engine fails every transfer in flight itself (recompute on D, free on P).
    sidecar_lost_timeout_s: float
    #: ``host:port`` to advertise as this engine's side channel in kv_transfer_params
    #: (default: what the sidecar reports in ``Registered``).
    advertise: str
    #: Largest frame accepted from the sidecar.
    max_frame_bytes: int
    #: An engine step with nothing to run while transfers are live waits this long at most for
    #: the sidecar or new input, instead of stepping again at once (idle.py; at most a quarter of
    #: ``sidecar_lost_timeout_s``); 0: vLLM's loop.
    idle_wait_s: float = 0.5
    #: A worker that is in no step and read nothing from its queue for this long sleeps on the
    #: queue's notification instead of spinning out vLLM's second (idle.py ``WorkerRest``); 0: vLLM's.
    worker_rest_s: float = 0.003
    #: The engine core, waiting for its workers' answer to a step, spins this long after its last
    #: read before it sleeps on the queue's notification (idle.py ``limit_engine_spin``); vLLM
    #: spins a second. 0: vLLM's.
    engine_spin_s: float = 0.002
    #: P (push): tell the sidecar of a prefill before the forward that completes it, then of each
    #: layer as its attention has saved its KV, so its writes leave while later layers compute
    #: (CPU engines, one KV cache group, TP 1; elsewhere whole-request push, logged once).
    layer_wise: bool = False


_KEYS = {
    "engine_socket",
    "shm_dir",
    "placement",
    "kv_memory",
    "register_timeout_s",
    "sidecar_lost_timeout_s",
    "advertise",
    "max_frame_bytes",
    "idle_wait_s",
    "worker_rest_s",
    "engine_spin_s",
    "layer_wise",
}


def default_engine_socket(engine_id: str) -> str:
    """The sidecar's default engine link endpoint (src/engine/link.ts ``defaultEngineEndpoint``)."""
    return f"ipc:///tmp/kvxfer-{engine_id}.sock"


def _number(extra: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError("ERR_CONFIG", f"kv_connector_extra_config.{key} must be a number, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError("ERR_CONFIG", f"kv_connector_extra_config.{key} must be within {lo}..{hi}, got {value}")
    return float(value)


def load_config(engine_id: str | None, extra: dict[str, Any] | None, device_type: str) -> ConnectorConfig:
    """Checks and completes the settings. ``device_type`` is vLLM's platform ("cpu", "cuda", ...)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _KEYS)
    if unknown:
        raise ConfigError(
            "ERR_CONFIG",
            f"unknown kv_connector_extra_config key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}",
        )
    if not engine_id or not _ENGINE_ID.match(engine_id):
        raise ConfigError(
            "ERR_CONFIG",
            f"kv_transfer_config.engine_id must be 1..128 of [A-Za-z0-9._-] and equal the sidecar's "
            f"--engine-id, got {engine_id!r}",
        )
    placement = extra.get("placement", "shared" if device_type == "cpu" else "host_buffer")
    if placement not in PLACEMENTS:
        raise ConfigError("ERR_CONFIG", f"kv_connector_extra_config.placement must be one of {PLACEMENTS}, got {placement!r}")
    if placement == "shared" and device_type != "cpu":
        raise ConfigError(
            "ERR_CONFIG",
            f"placement 'shared' needs the KV cache in host memory, but this engine's device is "
            f"{device_type!r}: use placement 'host_buffer' (with kv_buffer_device 'cpu')",
        )
    if placement == "device" and device_type != "cuda":
        raise ConfigError(
            "ERR_CONFIG",
            f"placement 'device' registers the KV cache in GPU memory in place, but this engine's device is "
            f"{device_type!r}: use placement 'shared'",
        )
    socket = extra.get("engine_socket", default_engine_socket(engine_id))
    if not isinstance(socket, str) or "://" not in socket:
        raise ConfigError("ERR_CONFIG", f"kv_connector_extra_config.engine_socket must be a ZeroMQ endpoint, got {socket!r}")
    shm_dir = extra.get("shm_dir", "/dev/shm")
    if not isinstance(shm_dir, str) or not os.path.isdir(shm_dir):
        raise ConfigError("ERR_CONFIG", f"kv_connector_extra_config.shm_dir {shm_dir!r} is not a folder")
    kv_memory = extra.get("kv_memory", "file")
    if kv_memory not in KV_MEMORY:
        raise ConfigError("ERR_CONFIG", f"kv_connector_extra_config.kv_memory must be one of {KV_MEMORY}, got {kv_memory!r}")
    advertise = extra.get("advertise", "")
    if not isinstance(advertise, str) or (advertise and not re.match(r"^[^:\s]+:\d{1,5}$", advertise)):
        raise ConfigError("ERR_CONFIG", f"kv_connector_extra_config.advertise must be 'host:port', got {advertise!r}")
    layer_wise = extra.get("layer_wise", False)
    if not isinstance(layer_wise, bool):
        raise ConfigError("ERR_CONFIG", f"kv_connector_extra_config.layer_wise must be true or false, got {layer_wise!r}")
    return ConnectorConfig(
        engine_id=engine_id,
        engine_socket=socket,
        shm_dir=shm_dir,
        placement=placement,
        kv_memory=kv_memory,
        register_timeout_s=_number(extra, "register_timeout_s", 60.0, 0.1, 3600.0),
        sidecar_lost_timeout_s=_number(extra, "sidecar_lost_timeout_s", 10.0, 0.1, 3600.0),
        advertise=advertise,
        max_frame_bytes=int(_number(extra, "max_frame_bytes", 16 << 20, 64, 1 << 30)),
        idle_wait_s=_number(extra, "idle_wait_s", 0.5, 0.0, 10.0),
        worker_rest_s=_number(extra, "worker_rest_s", 0.003, 0.0, 10.0),
        engine_spin_s=_number(extra, "engine_spin_s", 0.002, 0.0, 10.0),
        layer_wise=layer_wise,
    )
