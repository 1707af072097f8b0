"""What the scheduler half hands the worker half each engine step.

vLLM carries it from the scheduler process to the worker processes inside the
connector metadata; only the worker that registered with the sidecar speaks on
the engine link, so every message to the sidecar travels this way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .groups import BlockList


@dataclass(frozen=True)
class PrefillDoneMsg:
    """P: a request's prefill finished; its KV sits in ``block_ids`` until released."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    #: The transfer's token: only a decode sidecar presenting it may take the KV.
    token: str = ""
    #: Hybrid models: one list per KV cache group, in vLLM block ids (``block_ids`` is then every
    #: block of them); None: ``block_ids`` is the one group's table.
    groups: list[BlockList] | None = None


@dataclass(frozen=True)
class ExpectMsg:
    """D: KV for tokens ``[prefix_tokens, num_tokens)`` should land in ``block_ids``."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    num_tokens: int
    prefix_tokens: int
    source: str
    #: P's blocks (pull) in P's kvxfer blocks; D's ``block_ids`` are vLLM ids (the worker splits them).
    source_block_ids: list[int] | None
    #: The transfer's token, from P's answer or the router.
    token: str = ""
    #: Hybrid models: D's lists per group, in vLLM block ids (as PrefillDoneMsg.groups).
    groups: list[BlockList] | None = None
    #: Hybrid models, pull: P's lists per group, in P's kvxfer blocks.
    source_groups: list[BlockList] | None = None


@dataclass(frozen=True)
class AbortMsg:
    """D: the request went away while its KV was still coming."""

    request_id: str
    transfer_id: str


@dataclass(frozen=True)
class GiveUpMsg:
    """P: a request the router named a transfer for ended without KV (aborted, finished without
    blocks): P's sidecar tells D, which may have registered for it (push), to compute it."""

    request_id: str
    transfer_id: str


@dataclass
class StepMessages:
    prefill_done: list[PrefillDoneMsg] = field(default_factory=list)
    expect: list[ExpectMsg] = field(default_factory=list)
    abort: list[AbortMsg] = field(default_factory=list)
    give_up: list[GiveUpMsg] = field(default_factory=list)
    #: P: prefills that this step's forward completes, sent when the forward has run (the worker's
    #: ``after_forward``), not when the step starts like the lists above.
    prefill_done_after_forward: list[PrefillDoneMsg] = field(default_factory=list)
    #: P, layer-wise push: prefills that this step's forward completes, sent before the forward
    #: (layer_wise), each layer announced as the forward saves it (the worker's ``layer_saved``).
    prefill_done_layer_wise: list[PrefillDoneMsg] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill_done or self.expect or self.abort or self.give_up or self.prefill_done_after_forward
                    or self.prefill_done_layer_wise)
