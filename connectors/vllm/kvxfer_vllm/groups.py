"""vLLM's KV cache groups as kvxfer sees them, and which blocks of each group a transfer names.

With vLLM's hybrid KV cache manager a model's layers fall into groups (full attention, sliding
window, MLA, Mamba / linear-attention state), each with its own block table per request, all
drawing from one block pool. The adapter reads the groups from vLLM's ``KVCacheConfig`` into
``GroupSpec`` (plain numbers); this module decides, from a request's per-group block tables, the
lists the sidecar gets (``BlockList``: where the held part starts, and its blocks):

- full attention (and MLA): every block from the first;
- sliding window: only the tail that still matters, the last ``cdiv(window, block) + 1`` blocks
  of the prompt (vLLM puts its null block in place of blocks that left the window; those are
  neither named nor moved, and D's stay null);
- state: the one slot holding the request's running state (the last real block of its table).

State groups change the P/D protocol (``PREFILL_BACKOFF``): a recurrent state cannot take the
prompt's last token twice, and vLLM's D always computes at least that token to sample from it, so
P stops one token short and D loads the state after ``N - 1`` tokens, then computes token ``N``
itself. Both sides decide it from their own groups (the same model), not from the request.

Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import LayoutError

KINDS = ("full", "sliding", "state")

#: vLLM's null block (``BlockPool.null_block``): the id of every block a request does not hold.
NULL_BLOCK = 0


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group, as numbers."""

    kind: str
    #: vLLM's (scheduler) block size of the group, in tokens.
    block_size: int
    layer_names: tuple[str, ...]
    #: Tokens in the window (sliding only).
    sliding_window: int = 0
    #: State only: the state's tensors, e.g. ``bfloat16[3,1024];float32[4,128,128]``.
    state_shape: str = ""
    #: State only: trailing scratch slots vLLM allocates per request for speculative decoding.
    speculative_blocks: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError("ERR_LAYOUT_UNSUPPORTED", f"KV cache group kind {self.kind!r} is not one of {KINDS}")


@dataclass(frozen=True)
class BlockList:
    """One group's block list for the sidecar: ``ids[i]`` is block index ``first + i``."""

    first: int
    ids: list[int]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prefill_backoff(groups: Sequence[GroupSpec]) -> int:
    """Prompt tokens P leaves for D to compute: 1 with a state group (see the module), else 0."""
    return 1 if any(g.kind == "state" for g in groups) else 0


def window_blocks(g: GroupSpec) -> int:
    """Blocks of a sliding-window group a transfer names: the window, plus one for a window that
    does not start on a block boundary."""
    return cdiv(g.sliding_window, g.block_size) + 1


def transfer_lists(groups: Sequence[GroupSpec], tables: Sequence[Sequence[int]], num_tokens: int) -> list[BlockList]:
    """The lists of a request whose ``num_tokens`` prompt tokens the transfer covers, from its
    per-group block tables (vLLM's, with null blocks). Raises ValueError naming the group when a
    table cannot be a transfer's (too short, a null block inside the part that moves)."""
    if len(tables) != len(groups):
        raise ValueError(f"{len(tables)} block tables for {len(groups)} KV cache groups")
    out: list[BlockList] = []
    for g, (spec, table) in enumerate(zip(groups, tables)):
        table = list(table)
        if spec.kind == "state":
            # The running state sits before the speculative scratch slots; nulls before it are
            # superseded or not yet allocated states.
            live = table[: len(table) - spec.speculative_blocks] if spec.speculative_blocks else table
            slots = [b for b in live if b != NULL_BLOCK]
            if not slots:
                raise ValueError(f"group {g} (state) holds no state slot")
            out.append(BlockList(0, [slots[-1]]))
            continue
        end = cdiv(num_tokens, spec.block_size)
        if len(table) < end:
            raise ValueError(f"group {g} ({spec.kind}) has {len(table)} blocks, {num_tokens} tokens need {end}")
        start = max(0, end - window_blocks(spec)) if spec.kind == "sliding" else 0
        if spec.kind == "sliding":
            while start < end - 1 and table[start] == NULL_BLOCK:
                start += 1
        ids = table[start:end]
        if NULL_BLOCK in ids:
            raise ValueError(f"group {g} ({spec.kind}) has the null block at index {start + ids.index(NULL_BLOCK)}, "
                             "inside the tokens that move")
        out.append(BlockList(start, ids))
    return out


def flat_ids(lists: Sequence[BlockList]) -> list[int]:
    """Every block of the lists, group by group."""
    return [b for lst in lists for b in lst.ids]
