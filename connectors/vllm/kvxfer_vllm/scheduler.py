"""The scheduler half of the connector: decides, per request, what moves.

Runs in vLLM's engine-core process. It never talks to the sidecar: it queues
``StepMessages`` that ``build_step`` hands to the workers with each step, and
learns completions from what the workers report (``on_worker_output``). Plain
Python: the adapter (connector.py) passes request fields in, so this is tested
without vLLM.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from . import timeline
from .bootstrap import BootstrapResolver, fill_source
from .groups import BlockList, GroupSpec, flat_ids, prefill_backoff, transfer_lists
from .messages import AbortMsg, ExpectMsg, GiveUpMsg, PrefillDoneMsg, StepMessages
from .stats import TransferStats
from .params import (
    BadParams,
    bind_token,
    parse_remote_prefill,
    prompt_digest,
    prefill_answer,
    token_of,
    transfer_id_of,
    wants_remote_decode,
    wants_remote_prefill,
)

log = logging.getLogger(__name__)


@dataclass
class _Waiting:
    transfer_id: str
    sent: bool


#: A request's block tables, one per KV cache group (vLLM's ``KVCacheBlocks.get_block_ids()``);
#: a flat list of ids is one group's.
Tables = list[list[int]]


def as_tables(block_ids: Sequence[int] | Sequence[Sequence[int]]) -> Tables:
    """``[1, 2]`` (one group) or ``[[1, 2], [3]]`` (one table per group) as tables."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [list(t) for t in block_ids]  # type: ignore[arg-type]
    return [list(block_ids)]  # type: ignore[arg-type]


@dataclass(frozen=True)
class Scheduled:
    """A request a step computes: its tokens once the step's forward has run, and the blocks the
    step gave it, per group (``replace``: all its blocks, as after a preemption; else added to
    those it had)."""

    tokens: int
    new_blocks: Sequence[int] | Sequence[Sequence[int]] = ()
    replace: bool = False


@dataclass
class _Candidate:
    """P: a request allocated in the step being built that ends with that step's forward."""

    params: dict[str, Any]
    tables: Tables
    prompt: Sequence[int]


@dataclass
class _Early:
    """P: a request whose PrefillDone went with its last prefill step (sent after the forward),
    before vLLM finished it: what its answer must repeat."""

    transfer_id: str
    token: str
    digest: str
    tables: Tables
    num_tokens: int


def _router_named(params: dict[str, Any]) -> bool:
    tid = params.get("transfer_id")
    return isinstance(tid, str) and tid != ""


def _transfer_token(params: dict[str, Any]) -> str:
    """P: the transfer's token. The router's when it gave one (push: it told D too). A router that
    names the transfer itself (transfer_id) without a token may have told D already (vllm-router's
    mooncake mode sends both at once): no token, the transfer binds to the first authenticated D
    that registers. Else a fresh one, which reaches D in P's answer. Raises BadParams."""
    return token_of(params) or ("" if _router_named(params) else secrets.token_hex(16))


class SchedulerLogic:
    def __init__(self, *, engine_id: str, tp_size: int, advertise: str = "",
                 resolver: BootstrapResolver | None = None, early_prefill_done: bool = False,
                 groups: Sequence[GroupSpec] | None = None, layer_wise: bool = False) -> None:
        self.engine_id = engine_id
        #: The engine's KV cache groups (hybrid models); None: one group of full attention, whose
        #: blocks travel as a plain list.
        self.groups = list(groups) if groups is not None and _hybrid(groups) else None
        #: Prompt tokens P leaves to D (state groups, see groups.py); D expects that many fewer.
        self.backoff = prefill_backoff(groups or ())
        #: Sliding windows free blocks when vLLM finishes a request: no PrefillDone before that.
        self._sliding = any(g.kind == "sliding" for g in self.groups or ())
        #: P: tell the sidecar of a prefill when the forward that completes it has run, not when vLLM
        #: has processed that step's output and run the next one (only where the forward has really
        #: run when the worker's after-forward hook is called: a CPU engine).
        self._early_enabled = early_prefill_done
        #: P: those early prefills go before their forward, layer by layer (one group only).
        self._layer_wise = layer_wise and early_prefill_done and self.groups is None
        self._candidates: dict[str, _Candidate] = {}
        self._early: dict[str, _Early] = {}
        #: D: P's side channel from a router's bootstrap URL (vllm-router's mooncake mode).
        self._resolver = resolver or BootstrapResolver()
        self.tp_size = tp_size
        #: P's side channel as D must dial it; set from the worker's handshake metadata.
        self.side_channel = advertise
        self._advertise = advertise
        self._next = StepMessages()
        #: P: requests whose blocks the sidecar holds, until the worker reports them sent.
        self._holding: set[str] = set()
        #: D: requests whose KV is coming, until the worker reports them received.
        self._waiting: dict[str, _Waiting] = {}
        #: D: requests that finished (aborted) while their KV was coming: blocks held until sent.
        self._aborting: set[str] = set()
        self._warned: set[str] = set()
        #: kvxfer blocks per vLLM block on this engine (from the worker's handshake metadata), one
        #: per group when there are several.
        self.blocks_per_block: int | list[int] = 1
        #: D: the digest of each expecting request's prompt, from the check to ExpectKv.
        self._digests: dict[str, str] = {}
        #: D, timeline only: requests whose KV arrived, until a step computes them.
        self._landed: dict[str, str] = {}
        #: What this half counts for vLLM's metrics (prompt mismatches).
        self.stats = TransferStats()

    def set_side_channel(self, address: str, blocks_per_block: int | list[int] = 1) -> None:
        """What the worker learned at registration: the sidecar's side channel (an ``advertise``
        setting wins) and how this engine's backend splits blocks."""
        if not self._advertise:
            self.side_channel = address
        self.blocks_per_block = blocks_per_block

    # --- D --------------------------------------------------------------------------

    def num_new_matched_tokens(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        num_prompt_tokens: int,
        num_computed: int,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> tuple[int, bool]:
        if not wants_remote_prefill(params):
            return 0, False
        assert params is not None
        try:
            fill_source(params, self._resolver)
            remote = parse_remote_prefill(params, request_id, len(self.groups or ()) or 1)
        except BadParams as err:
            if request_id not in self._warned:
                self._warned.add(request_id)
                log.warning("kvxfer: request %s computes its prompt locally: %s", request_id, err)
            return 0, False
        total = self._expected_tokens(remote.num_tokens, num_prompt_tokens)
        if prompt_token_ids is not None:
            # The KV must be this prompt's: P says which tokens its blocks hold (pull), and the
            # token D presents is bound to D's prompt (push: P's sidecar compares).
            mine = prompt_digest(prompt_token_ids, total)
            if remote.prompt_digest and mine != remote.prompt_digest:
                # (P digests the prompt tokens its blocks hold, at most its prompt: the same
                # ``total`` tokens for the same prompt, whatever P generated after them.)
                params["do_remote_prefill"] = False  # decided: computed here, never expected
                self.stats.count("mismatched")
                self.stats.count("recomputed")
                log.warning(
                    "kvxfer: request %s computes its prompt locally: ERR_PROMPT_MISMATCH: "
                    "kv_transfer_params.kvxfer_prompt_digest names other tokens than this prompt's "
                    "first %d (transfer %s is not read)", request_id, total, remote.transfer_id)
                return 0, False
            self._digests[request_id] = mine
        count = total - num_computed
        return (count, True) if count > 0 else (0, False)

    def _expected_tokens(self, remote: int | None, num_prompt_tokens: int) -> int:
        """D: the prompt tokens whose KV comes from P: what P said it computed, at most the prompt
        less the tokens P leaves to D (state groups)."""
        cap = num_prompt_tokens - self.backoff if num_prompt_tokens > self.backoff else num_prompt_tokens
        return min(remote or cap, cap)

    def lists_of(self, tables: Tables, num_tokens: int) -> tuple[list[int], list[BlockList] | None]:
        """A transfer's blocks as the messages carry them: the flat list, and (hybrid) one list per
        group (groups.transfer_lists; ValueError when a table cannot be a transfer's)."""
        if self.groups is None:
            return list(tables[0]) if tables else [], None
        lists = transfer_lists(self.groups, tables, num_tokens)
        return flat_ids(lists), lists

    def after_alloc(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        block_ids: Sequence[int] | Sequence[Sequence[int]],
        num_external_tokens: int,
        num_prompt_tokens: int,
    ) -> None:
        if not wants_remote_prefill(params):
            return
        assert params is not None
        # Asked once per request: a later allocation for the same request must not re-expect.
        params["do_remote_prefill"] = False
        digest = self._digests.pop(request_id, "")
        if num_external_tokens <= 0:
            return
        try:
            remote = parse_remote_prefill(params, request_id, len(self.groups or ()) or 1)
        except BadParams:  # already reported by num_new_matched_tokens, which returned 0
            return
        total = self._expected_tokens(remote.num_tokens, num_prompt_tokens)
        prefix = total - num_external_tokens
        if prefix < 0:
            log.error("kvxfer: request %s expects %d tokens but %d are external", request_id, total, num_external_tokens)
            return
        try:
            flat, lists = self.lists_of(as_tables(block_ids), total)
        except ValueError as err:
            log.error("kvxfer: request %s: its blocks cannot take the KV: %s", request_id, err)
            return
        self._next.expect.append(
            ExpectMsg(
                request_id=request_id,
                transfer_id=remote.transfer_id,
                block_ids=flat,
                num_tokens=total,
                prefix_tokens=prefix,
                source=remote.source,
                source_block_ids=remote.source_block_ids,
                token=bind_token(remote.token, digest),
                groups=lists,
                source_groups=remote.source_groups,
            )
        )
        self._waiting[request_id] = _Waiting(remote.transfer_id, sent=False)
        timeline.mark("d.sched.alloc", remote.transfer_id, tokens=num_external_tokens)

    # --- P --------------------------------------------------------------------------

    def p_allocated(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        block_ids: Sequence[int] | Sequence[Sequence[int]],
        prompt_token_ids: Sequence[int] | None,
        max_tokens: int | None,
    ) -> None:
        """P: vLLM allocated blocks to a request as it left the waiting queue (``block_ids``: all it
        holds). A request for remote decode that may generate one token ends with the step that
        completes its prompt: that step (``build_step`` follows it there) sends its PrefillDone
        when its forward has run, a step earlier than vLLM finishing the request would."""
        if (not self._early_enabled or max_tokens != 1 or not wants_remote_decode(params) or self._sliding
                or not block_ids or prompt_token_ids is None or not self.side_channel):
            return
        assert params is not None
        self._candidates[request_id] = _Candidate(params, as_tables(block_ids), prompt_token_ids)

    @property
    def early_candidates(self) -> Set[str]:
        """P: the ids of the requests ``build_step`` follows toward an early PrefillDone (a live
        view; empty on most steps, when the adapter collects nothing for it)."""
        return self._candidates.keys()

    def _take_early(self, scheduled: Mapping[str, Scheduled]) -> None:
        """Candidates whose whole prompt this step computes get their PrefillDone sent after its
        forward. The token and digest are chosen now; P's answer repeats them (request_finished)."""
        for rid, c in list(self._candidates.items()):
            s = scheduled.get(rid)
            if s is None:
                continue
            new = as_tables(s.new_blocks) if s.new_blocks else [[] for _ in c.tables]
            if s.replace:
                c.tables = new
            else:
                for table, more in zip(c.tables, new):
                    table.extend(more)
            n = len(c.prompt)
            if s.tokens < n:
                continue  # a chunk of the prompt: its last one decides
            del self._candidates[rid]
            if s.tokens != n or n <= 0:
                continue  # not a plain prefill: sent when vLLM finishes it
            try:
                token = _transfer_token(c.params)
            except BadParams:
                continue  # request_finished reports it and gives up
            tid = transfer_id_of(c.params, rid)
            digest = prompt_digest(c.prompt, n)
            try:
                flat, lists = self.lists_of(c.tables, n)
            except ValueError:
                continue  # request_finished tries again with vLLM's final tables
            msg = PrefillDoneMsg(rid, tid, flat, n, bind_token(token, digest), groups=lists)
            if self._layer_wise:
                self._next.prefill_done_layer_wise.append(msg)
            else:
                self._next.prefill_done_after_forward.append(msg)
            self._early[rid] = _Early(tid, token, digest, c.tables, n)
            self._holding.add(rid)
            timeline.mark("p.sched.early", tid, tokens=n)

    # --- both -----------------------------------------------------------------------

    def request_finished(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        *,
        finished_ok: bool,
        block_ids: Sequence[int] | Sequence[Sequence[int]],
        num_computed_tokens: int,
        token_ids: Sequence[int] | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks, kv_transfer_params for the response). ``token_ids``: the
        request's prompt; P's answer carries the digest of the part its blocks hold (the first
        ``num_computed_tokens``, at most the prompt: what D's prompt is checked against).
        ``block_ids``: the request's blocks, or (hybrid) one table per group."""
        tables = as_tables(block_ids)
        self._digests.pop(request_id, None)
        self._candidates.pop(request_id, None)
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            # D: the request ended while its KV was still coming.
            if not waiting.sent:
                self._next.expect = [m for m in self._next.expect if m.request_id != request_id]
                return False, None
            # The sidecar may still write into these blocks: they stay held until it
            # says none can land (the worker reports the request as sent).
            self._next.abort.append(AbortMsg(request_id, waiting.transfer_id))
            self._aborting.add(request_id)
            return True, None
        early = self._early.pop(request_id, None)
        if early is not None:
            # The sidecar has this request's PrefillDone (sent after its last forward): its blocks
            # stay held until the sidecar releases them, whatever happens to the request now.
            if (finished_ok and num_computed_tokens == early.num_tokens
                    and self._same_blocks(tables, early.tables, num_computed_tokens)):
                timeline.mark("p.sched.finished", early.transfer_id, tokens=num_computed_tokens)
                return True, self._answer(request_id, early.transfer_id, tables, num_computed_tokens,
                                          early.token, early.digest)
            log.warning(
                "kvxfer: request %s (transfer %s) ended %s after its PrefillDone was sent; no answer for D, "
                "the sidecar releases the blocks when the transfer ends or expires", request_id,
                early.transfer_id, "without finishing" if not finished_ok else
                f"with {num_computed_tokens} tokens in blocks {tables}, not the "
                f"{early.num_tokens} in {early.tables} sent")
            return True, None
        if not wants_remote_decode(params):
            return False, None
        assert params is not None
        if not finished_ok or not any(tables) or num_computed_tokens <= 0:
            self._give_up(request_id, params, "ended without KV" if finished_ok else "aborted")
            return False, None
        if not self.side_channel:
            log.error("kvxfer: request %s: no side channel known for this engine's sidecar; D will compute it", request_id)
            self._give_up(request_id, params, "no side channel")
            return False, None
        tid = transfer_id_of(params, request_id)
        try:
            token = _transfer_token(params)
        except BadParams as err:
            log.error("kvxfer: request %s: %s; D will compute it", request_id, err)
            self._give_up(request_id, params, "bad kvxfer_token")
            return False, None
        digest = prompt_digest(token_ids, min(num_computed_tokens, len(token_ids))) if token_ids is not None else ""
        try:
            flat, lists = self.lists_of(tables, num_computed_tokens)
        except ValueError as err:
            log.error("kvxfer: request %s: its blocks cannot be sent: %s; D will compute it", request_id, err)
            self._give_up(request_id, params, "unusable blocks")
            return False, None
        self._next.prefill_done.append(
            PrefillDoneMsg(request_id, tid, flat, num_computed_tokens, bind_token(token, digest), groups=lists)
        )
        self._holding.add(request_id)
        timeline.mark("p.sched.finished", tid, tokens=num_computed_tokens)
        return True, self._answer(request_id, tid, tables, num_computed_tokens, token, digest)

    def _same_blocks(self, a: Tables, b: Tables, num_tokens: int) -> bool:
        """Whether two tables name the same blocks for a transfer of ``num_tokens`` tokens."""
        try:
            return self.lists_of(a, num_tokens) == self.lists_of(b, num_tokens)
        except ValueError:
            return False

    def _answer(self, request_id: str, tid: str, tables: Tables, num_tokens: int, token: str,
                digest: str) -> dict[str, Any]:
        flat, lists = self.lists_of(tables, num_tokens)
        return prefill_answer(
            transfer_id=tid,
            engine_id=self.engine_id,
            request_id=request_id,
            side_channel=self.side_channel,
            block_ids=flat if lists is None else [lst.ids for lst in lists],
            first_blocks=None if lists is None else [lst.first for lst in lists],
            num_tokens=num_tokens,
            tp_size=self.tp_size,
            blocks_per_block=self.blocks_per_block,
            token=token,
            digest=digest,
        )

    def _give_up(self, request_id: str, params: dict[str, Any], why: str) -> None:
        """P: no KV will come for this request. Only a transfer the router named can have reached
        D before P's answer (push: D registers while P computes), so only that one is told."""
        if not _router_named(params):
            return
        tid = transfer_id_of(params, request_id)
        log.info("kvxfer: request %s (transfer %s) %s: telling D not to wait", request_id, tid, why)
        self._next.give_up.append(GiveUpMsg(request_id, tid))

    def build_step(self, scheduled: Mapping[str, Scheduled] | None = None) -> StepMessages:
        """This step's messages. ``scheduled``: the requests this step computes (P's early
        PrefillDone, see ``p_allocated``; without it, none is sent early)."""
        if self._candidates and scheduled:
            self._take_early(scheduled)
        step, self._next = self._next, StepMessages()
        for m in step.expect:
            w = self._waiting.get(m.request_id)
            if w is not None:
                w.sent = True
        if timeline.enabled():
            for m in step.expect:
                timeline.mark("d.sched.step", m.transfer_id)
            for p in step.prefill_done + step.prefill_done_after_forward + step.prefill_done_layer_wise:
                timeline.mark("p.sched.step", p.transfer_id)
        return step

    def on_worker_output(self, finished_sending: set[str] | None, finished_recving: set[str] | None) -> None:
        for r in finished_sending or ():
            self._holding.discard(r)
            self._aborting.discard(r)
        for r in finished_recving or ():
            w = self._waiting.pop(r, None)
            if w is not None and timeline.enabled():
                timeline.mark("d.sched.received", w.transfer_id)
                if len(self._landed) < 10_000:
                    self._landed[r] = w.transfer_id

    def mark_admitted(self, scheduled: dict[str, int]) -> None:
        """Timeline only: the first step that computes a request whose KV arrived."""
        for r in [r for r in self._landed if r in scheduled]:
            timeline.mark("d.sched.admitted", self._landed.pop(r), tokens=scheduled[r])

    def waits_on_sidecar(self) -> bool:
        """True when transfers are live but this step has nothing to tell the sidecar: what the
        engine waits for can only come from it (idle.py)."""
        return not self._next and bool(self._holding or self._waiting or self._aborting)

    def has_pending_work(self) -> bool:
        """True while the engine must keep stepping so the workers can hear the sidecar."""
        return bool(self._next or self._holding or self._waiting or self._aborting)


def _hybrid(groups: Sequence[GroupSpec]) -> bool:
    """Whether an engine's groups need per-group lists (anything but one full-attention group)."""
    return len(groups) != 1 or groups[0].kind != "full"
