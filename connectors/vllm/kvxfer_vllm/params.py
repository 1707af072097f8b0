"""``kv_transfer_params``: what a router sends each engine and what P returns for D.

The field names follow vLLM's own P/D connectors (NixlConnector), so a router
written for them relays kvxfer's unchanged:

- to P: ``{"do_remote_decode": true}`` (optionally ``"transfer_id"``);
- P answers (``request_finished``): ``do_remote_prefill: true``, ``remote_host``,
  ``remote_port`` (P's sidecar side channel), ``remote_block_ids``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_num_tokens``, ``tp_size``,
  ``transfer_mode: "pull"`` and kvxfer's ``transfer_id``;
- to D: P's answer as is (pull: D reads P's blocks), or, for push, the same
  without ``remote_block_ids``: ``do_remote_prefill``, ``remote_host``,
  ``remote_port`` and ``transfer_id`` — D registers its blocks with P's sidecar
  while P computes, and P writes them as soon as prefill is done.

The transfer id both sidecars use is ``transfer_id`` when the router gives one,
else the request id with vLLM's internal ``-<8 hex>`` suffix removed.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .groups import BlockList

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
MAX_ID_BYTES = 256


def strip_request_suffix(request_id: str) -> str:
    """vLLM appends ``-<8 hex>`` to every request id it is given; the router knows the id without it."""
    return _SUFFIX.sub("", request_id)


#: Longest transfer token the sidecar accepts (PrefillDone.token / ExpectKv.token).
MAX_TOKEN_BYTES = 128


def token_of(params: dict[str, Any] | None) -> str:
    """The transfer's token (``kvxfer_token``): only the decode sidecar presenting it gets the KV.

    Empty when absent; raises BadParams when it is not a string of at most 128 bytes.
    """
    token = (params or {}).get("kvxfer_token", "")
    if not isinstance(token, str) or len(token.encode()) > MAX_TOKEN_BYTES:
        raise BadParams("kvxfer_token", f"must be a string of at most {MAX_TOKEN_BYTES} bytes")
    return token


#: Hex digits of ``kvxfer_prompt_digest`` (128 bits of SHA-256).
DIGEST_HEX = 32


def prompt_digest(token_ids: Sequence[int], n: int) -> str:
    """The digest of the first ``n`` token ids: what KV of ``n`` tokens is the KV of. ``""``
    when fewer than ``n`` ids are known (no digest can be made)."""
    if n <= 0 or len(token_ids) < n:
        return ""
    return hashlib.sha256(struct.pack(f"<{n}q", *token_ids[:n])).hexdigest()[:DIGEST_HEX]


def bind_token(token: str, digest: str) -> str:
    """The token a sidecar sees: the router's (or P's) ``kvxfer_token`` bound to the prompt's
    digest. P's PrefillDone and D's ExpectKv each carry it made from their own prompt, so P's
    sidecar serves a decode engine only when both tokens *and* prompts agree (a push registration
    for another prompt is refused before any write, ``ERR_BAD_TRANSFER_TOKEN``). Without a digest
    the token is as given."""
    if not digest:
        return token
    return "kvxfer-p1." + hashlib.sha256(f"{token}\0{digest}".encode()).hexdigest()


def transfer_id_of(params: dict[str, Any] | None, request_id: str) -> str:
    tid = (params or {}).get("transfer_id")
    if isinstance(tid, str) and tid:
        return tid
    return strip_request_suffix(request_id)


class BadParams(ValueError):
    """kv_transfer_params that name a remote transfer but cannot be used; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"kv_transfer_params.{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class RemotePrefill:
    """D's view of where its KV comes from."""

    transfer_id: str
    #: P sidecar's side channel, ``host:port``.
    source: str
    #: P's block table (pull) in kvxfer blocks (P's vLLM block ids split as P's backend splits
    #: them, ``kvxfer_blocks_per_block``), or None (push: P writes into D's blocks).
    source_block_ids: list[int] | None
    #: Tokens P computed, when P said (``remote_num_tokens``).
    num_tokens: int | None
    #: The transfer's token (``kvxfer_token``), presented to P's sidecar; empty if none.
    token: str = ""
    #: P's digest of the tokens its blocks hold (``kvxfer_prompt_digest``); empty if P gave none.
    prompt_digest: str = ""
    #: Hybrid models (pull): P's lists per KV cache group, in P's kvxfer blocks
    #: (``remote_block_ids`` one list per group, ``kvxfer_first_blocks``); ``source_block_ids``
    #: is then every block of them.
    source_groups: list[BlockList] | None = None


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_decode"))


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_prefill"))


def _ids(value: Any, field: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise BadParams(field, f"must be a list of block ids, got {type(value).__name__}")
    out: list[int] = []
    for i, b in enumerate(value):
        if isinstance(b, bool) or not isinstance(b, int) or b < 0 or b >= 1 << 32:
            raise BadParams(field, f"[{i}] = {b!r} is not a block id")
        out.append(b)
    return out


def _block_tables(value: Any) -> list[list[int]]:
    """``[1, 2]`` (one group), or vLLM's per-group form ``[[1, 2], [3]]``."""
    if not isinstance(value, (list, tuple)):
        raise BadParams("remote_block_ids", f"must be a list of block ids, got {type(value).__name__}")
    if value and isinstance(value[0], (list, tuple)):
        return [_ids(t, f"remote_block_ids[{g}]") for g, t in enumerate(value)]
    return [_ids(value, "remote_block_ids")]


def _split(ids: list[int], n: int) -> list[int]:
    return ids if n == 1 else [b * n + j for b in ids for j in range(n)]


def _per_group(value: Any, field: str, groups: int, lo: int, hi: int, default: int) -> list[int]:
    """An int for every group, or one per group."""
    if value is None:
        return [default] * groups
    values = value if isinstance(value, (list, tuple)) else [value] * groups
    if len(values) != groups:
        raise BadParams(field, f"lists {len(values)} values for {groups} KV cache groups")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise BadParams(field, f"must be an integer {lo}..{hi}, got {v!r}")
    return list(values)


def parse_remote_prefill(params: dict[str, Any], request_id: str, num_groups: int = 1) -> RemotePrefill:
    """Reads D's params; raises BadParams naming the field at fault. ``num_groups``: D's KV cache
    groups, which P's block lists must match one for one."""
    host = params.get("remote_host")
    port = params.get("remote_port")
    if not isinstance(host, str) or not host:
        raise BadParams("remote_host", f"must name P's sidecar host, got {host!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise BadParams("remote_port", f"must be P's sidecar side channel port, got {port!r}")
    tid = transfer_id_of(params, request_id)
    if len(tid.encode()) > MAX_ID_BYTES:
        raise BadParams("transfer_id", f"is longer than {MAX_ID_BYTES} bytes")
    blocks = params.get("remote_block_ids")
    tables = _block_tables(blocks) if blocks not in (None, (), []) else None
    n_groups = len(tables) if tables is not None else num_groups
    if n_groups != num_groups:
        raise BadParams("remote_block_ids", f"lists {n_groups} KV cache groups, this engine has {num_groups}")
    split = _per_group(params.get("kvxfer_blocks_per_block", 1), "kvxfer_blocks_per_block", n_groups, 1, 1024, 1)
    firsts = _per_group(params.get("kvxfer_first_blocks"), "kvxfer_first_blocks", n_groups, 0, (1 << 32) - 1, 0)
    source_blocks: list[int] | None = None
    source_groups: list[BlockList] | None = None
    if tables is not None and (n_groups > 1 or "kvxfer_first_blocks" in params):
        source_groups = [BlockList(f * k, _split(t, k)) for t, f, k in zip(tables, firsts, split)]
        source_blocks = [b for g in source_groups for b in g.ids]
    elif tables is not None:
        source_blocks = _split(tables[0], split[0])
    n = params.get("remote_num_tokens")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise BadParams("remote_num_tokens", f"must be a token count, got {n!r}")
    digest = params.get("kvxfer_prompt_digest", "")
    if not isinstance(digest, str) or (digest and not re.fullmatch(f"[0-9a-f]{{{DIGEST_HEX}}}", digest)):
        raise BadParams("kvxfer_prompt_digest", f"must be {DIGEST_HEX} hex digits, got {digest!r}")
    return RemotePrefill(
        transfer_id=tid,
        source=f"{host}:{port}",
        source_block_ids=source_blocks,
        num_tokens=n or None,
        token=token_of(params),
        prompt_digest=digest,
        source_groups=source_groups,
    )


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def prefill_answer(
    *,
    transfer_id: str,
    engine_id: str,
    request_id: str,
    side_channel: str,
    block_ids: list[int] | list[list[int]],
    num_tokens: int,
    tp_size: int,
    blocks_per_block: int | list[int] = 1,
    first_blocks: list[int] | None = None,
    token: str = "",
    digest: str = "",
) -> dict[str, Any]:
    """What P returns for D (vLLM relays it in the response's ``kv_transfer_params``). Hybrid
    models: ``block_ids`` one list per KV cache group, each starting at block index
    ``first_blocks[g]`` (a sliding window's tail)."""
    host, port = split_host_port(side_channel)
    extra: dict[str, Any] = {} if first_blocks is None else {"kvxfer_first_blocks": list(first_blocks)}
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_block_ids": [list(b) if isinstance(b, list) else b for b in block_ids],
        "remote_num_tokens": num_tokens,
        "tp_size": tp_size,
        "transfer_mode": "pull",
        # kvxfer blocks per vLLM block on P (> 1 when P's attention backend splits blocks).
        "kvxfer_blocks_per_block": blocks_per_block,
        # Binds the transfer to the decode engine this answer reaches (docs/security.md).
        "kvxfer_token": token,
        # The tokens P's blocks hold: D checks its prompt against it before it reads.
        "kvxfer_prompt_digest": digest,
        **extra,
    }
