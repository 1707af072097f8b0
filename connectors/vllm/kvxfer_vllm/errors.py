"""The connector's errors: one class, a stable string ``code`` and a message."""

from __future__ import annotations


class KvxferConnectorError(Exception):
    """A failure the connector reports. ``code`` is stable (tests assert on it)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RegistrationError(KvxferConnectorError):
    """The sidecar did not accept the KV cache (or never answered)."""


class LayoutError(KvxferConnectorError):
    """vLLM's KV tensors cannot be described as a kvxfer layout."""


class ConfigError(KvxferConnectorError):
    """``kv_connector_extra_config`` or the engine's settings are unusable."""


class LinkError(KvxferConnectorError):
    """The engine link is closed or its send queue is full."""
