"""Patches for vLLM's own connectors, applied only inside the processes ``kvxfer bench vllm``
starts (this folder goes first on their PYTHONPATH; nothing in .venv is edited). Which ones:
``KVXFER_BENCH_PATCHES``, a comma-separated list:

- ``nixl-delay``: NIXL's Python API creates every agent with a progress-thread delay of 0, so
  the thread spins a core; this gives it ``KVXFER_BENCH_NIXL_DELAY_US`` (100) microseconds.
- ``nixl-affinity``: on CPU, vLLM's NIXL worker pins the model thread to the last core of each
  NUMA node (vllm.platforms.cpu ``discover_numa_topology``), which moves P's prefill onto D's core
  on a small machine; with an empty topology the engine keeps the cores it was bound to.
- ``mooncake-device``: MooncakeConnector's worker asks ``torch.accelerator.current_device_index()``
  unconditionally, which raises without an accelerator; here it answers 0.

Each patch runs right after its module is imported (a finder that wraps the module's loader),
so a process that never imports the module is left untouched.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class _NixlBindings:
    """NIXL's bindings module as ``_api`` sees it, with every agent's progress delay set."""

    def __init__(self, real: ModuleType, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - NIXL's name
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def _nixl_delay(api: ModuleType) -> None:
    api.nixlBind = _NixlBindings(api.nixlBind, int(os.environ.get("KVXFER_BENCH_NIXL_DELAY_US", "100")))


def _nixl_affinity(cpu: ModuleType) -> None:
    cpu.CpuPlatform.discover_numa_topology = classmethod(lambda cls: [])


def _mooncake_device(_: ModuleType) -> None:
    import torch

    if not torch.cuda.is_available():
        torch.accelerator.current_device_index = lambda: 0


_BY_NAME: dict[str, tuple[tuple[str, ...], Callable[[ModuleType], None]]] = {
    "nixl-delay": (("nixl_cu13._api", "nixl_cu12._api"), _nixl_delay),
    "nixl-affinity": (("vllm.platforms.cpu",), _nixl_affinity),
    "mooncake-device": (("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector",),
                        _mooncake_device),
}


class _PatchedLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, patch: Callable[[ModuleType], None]) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchedLoader(spec.loader, patch)
                return spec
        return None


def install(names: list[str]) -> None:
    patches: dict[str, Callable[[ModuleType], None]] = {}
    for n in names:
        if n not in _BY_NAME:
            raise ValueError(f"KVXFER_BENCH_PATCHES: unknown patch {n!r} ({', '.join(_BY_NAME)})")
        modules, fn = _BY_NAME[n]
        for m in modules:
            if m in sys.modules:
                fn(sys.modules[m])
            patches[m] = fn
    sys.meta_path.insert(0, _AfterImport(patches))


_wanted = [n for n in os.environ.get("KVXFER_BENCH_PATCHES", "").split(",") if n]
if _wanted:
    install(_wanted)
