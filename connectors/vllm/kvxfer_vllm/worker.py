"""The worker half of the connector: the one process that talks to the sidecar.

Runs in the TP-rank-0 worker (it registers every rank's KV cache, so the sidecar
answers it alone). It sends what the scheduler queued (``on_step``), turns the
sidecar's replies into vLLM's completion sets (``take_results``), and keeps the
promise the engine relies on: a block is reported free (sent) or failed
(received, with a load error) only once no write into it can still arrive —
``ReleaseBlocks`` from the sidecar, or the sidecar provably gone.

Restarts: the link's monitor reports a lost connection; on reconnect the worker
registers again. A sidecar with a new epoch (or one that answers
``ERR_NOT_REGISTERED``) forgot every transfer, so they fail here at once (D
recomputes, P frees). A sidecar that does not come back within
``sidecar_lost_timeout_s`` gets the same treatment.

While the link is down (from the lost connection until a re-registration is
accepted) every new transfer fails here at once instead of being queued for a
sidecar that may never answer: D recomputes, P frees its blocks. The bound
above is only for what was already in flight when the link dropped.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ._gen.kvxfer.v1 import engine_pb2, layout_pb2
from . import timeline
from .errors import LinkError, RegistrationError
from .link import EngineLink
from .groups import BlockList
from .layout import expand_block_ids
from .messages import PrefillDoneMsg, StepMessages
from .stats import TransferStats

log = logging.getLogger(__name__)

#: A re-registration refused because the sidecar has not yet seen the old connection end is
#: retried this often, this far apart (5 s in all).
_MAX_ALREADY_RETRIES = 25
_ALREADY_RETRY_S = 0.2

_MAX_GIVING_UP = 10_000

#: A registration the sidecar cannot take yet is asked again this often (register()).
_REREGISTER_S = 0.5


def _code(error: str) -> str:
    """The code of a ``"<code>: text"`` error (``Registered.error``): decisions read it, never the text."""
    head = error.split(":", 1)[0].strip()
    return head if head.startswith("ERR_") else ""


#: Refusals that a later answer (or the next sidecar) may turn into an acceptance.
_RETRYABLE = frozenset({"ERR_ENGINE_LINK_TAKEN", "ERR_NEEDS_NEW_SIDECAR"})


def _retryable(error: str) -> bool:
    return _code(error) in _RETRYABLE

_EXPIRED_REASONS = (engine_pb2.FAILURE_REASON_TIMEOUT, engine_pb2.FAILURE_REASON_LEASE_EXPIRED)

@dataclass
class _P:
    request_id: str
    num_tokens: int = 0


@dataclass
class _D:
    request_id: str
    block_ids: list[int]
    failing: bool = False
    aborted: bool = False
    #: Tokens that move ([prefix, num_tokens)) and when ExpectKv left, for the statistics.
    tokens: int = 0
    started: float = 0.0


@dataclass
class Results:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class RegionFile:
    path: str
    offset: int
    length: int


class WorkerLogic:
    """``register`` once, then ``on_step`` / ``take_results`` every engine step."""

    def __init__(
        self,
        *,
        engine_id: str,
        engine_socket: str,
        register_timeout_s: float,
        sidecar_lost_timeout_s: float,
        max_frame_bytes: int,
        expand_blocks: Callable[[list[int]], list[int]] = list,
        group_blocks_per_block: list[int] | None = None,
        on_kv_ready: Callable[[list[int]], None] | None = None,
        before_prefill_done: Callable[[list[int]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        bytes_per_token: int = 0,
        on_activity: Callable[[], None] | None = None,
        layer_names: list[str] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.register_timeout_s = register_timeout_s
        self.lost_timeout_s = sidecar_lost_timeout_s
        self._expand = expand_blocks
        #: Hybrid models: kvxfer blocks per vLLM block of each KV cache group.
        self._group_split = group_blocks_per_block
        self._on_kv_ready = on_kv_ready
        self._before_prefill_done = before_prefill_done
        self._clock = clock
        #: KV bytes of one token on every rank together (for the bytes counter).
        self.bytes_per_token = bytes_per_token
        #: What vLLM's /metrics reports (stats.py).
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._p: dict[str, _P] = {}
        self._d: dict[str, _D] = {}
        self._results = Results()
        #: P: transfer ids given up (GiveUpMsg) whose ERR_UNKNOWN_TRANSFER answer is expected.
        self._giving_up: set[str] = set()
        #: Set whenever the sidecar says something (or the link changes): wakes an idle wait.
        self._activity = threading.Event()
        #: Called at the same moments: wakes the scheduler's idle wait (idle.py).
        self._on_activity = on_activity
        self._registration: engine_pb2.EngineToSidecar | None = None
        self._registered = threading.Event()
        self._reg_answer: engine_pb2.Registered | None = None
        #: True while ``register`` waits: answers go to it, reconnects do not re-register.
        self._initial = False
        self.epoch = 0
        self.side_channel = ""
        self._lost_since: float | None = None
        self._ever_connected = False
        self.restarts = 0
        # An ERR_NOT_REGISTERED already counted the restart the next registration answer confirms.
        self._restart_counted = False
        #: Re-registrations refused in a row because the sidecar still saw the old connection.
        self._already_retries = 0
        #: The latest failures the sidecar reported, (transfer id, reason, message), newest last.
        self.failures: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=64)
        #: Layer-wise push: each KV layer's place in the registered layout (its slot order); a
        #: layer that shares another's KV is not there (it moves with that one).
        self._layer_pos = {n: i for i, n in enumerate(layer_names or [])}
        #: The layer-wise transfers of the forward under way, its layers saved, and how many of
        #: them (from layer 0, without a gap) the sidecar was told of.
        self._lw_tids: list[str] = []
        self._lw_done: list[bool] = []
        self._lw_told = 0
        self.link = EngineLink(engine_socket, self._on_message, self._on_state, max_frame_bytes)

    # --- registration -----------------------------------------------------------------

    def register(self, reg: engine_pb2.RegisterKvCache) -> engine_pb2.Registered:
        """Sends RegisterKvCache and waits (bounded) for the answer; RegistrationError otherwise.

        A refusal that says the sidecar still holds an engine that is gone (a restarted engine
        under a running sidecar: the sidecar stops for a restart once the old one is provably
        gone, ``--engine-lease-ms``), or still sees another live connection, is asked again every
        ``_REREGISTER_S`` until ``register_timeout_s``; the next sidecar takes it."""
        self._registration = engine_pb2.EngineToSidecar(register=reg)
        self._initial = True
        self.link.start()
        deadline = self._clock() + self.register_timeout_s
        last = ""
        try:
            while True:
                self._registered.clear()
                self._reg_answer = None
                self.link.send(self._registration)
                left = deadline - self._clock()
                if left <= 0 or not self._registered.wait(left):
                    raise RegistrationError(
                        "ERR_REGISTER_TIMEOUT",
                        f"no kvxfer sidecar accepted this engine on {self.link.endpoint} within "
                        f"{self.register_timeout_s:g} s"
                        + (f" (last answer: {last})" if last else "")
                        + f": start `kvxfer sidecar --engine-id {self.engine_id}` with that --engine-socket",
                    )
                ans = self._reg_answer
                assert ans is not None
                if ans.ok:
                    self.epoch = ans.epoch
                    self.side_channel = ans.side_channel
                    with self._lock:
                        self._lost_since = None  # a sidecar that went away while we asked
                    return ans
                if not _retryable(ans.error):
                    raise RegistrationError("ERR_REGISTER_REFUSED", f"the sidecar refused the KV cache: {ans.error}")
                if last != ans.error:
                    log.warning("kvxfer: the sidecar cannot take this engine yet (%s); asking again", ans.error)
                last = ans.error
                time.sleep(max(0.0, min(_REREGISTER_S, deadline - self._clock())))
        finally:
            self._initial = False

    # --- engine steps -------------------------------------------------------------------

    def on_step(self, step: StepMessages) -> None:
        """Sends this step's messages. A message that cannot reach the sidecar fails its transfer here."""
        if not step:
            return
        for a in step.abort:
            self._abort(a.request_id, a.transfer_id)
        for g in step.give_up:
            # P's request ended without KV: its sidecar answers D's registration (push) with a
            # failure at once. It knows nothing of the transfer yet, so it answers
            # ERR_UNKNOWN_TRANSFER (nothing is held), which is expected here.
            if self.link_down():
                continue  # a sidecar we cannot reach is not holding D's registration for long
            with self._lock:
                if len(self._giving_up) >= _MAX_GIVING_UP:
                    self._giving_up.clear()  # answers lost with a sidecar: only log noise at stake
                self._giving_up.add(g.transfer_id)
            self._send(engine_pb2.EngineToSidecar(abort=engine_pb2.Abort(transfer_id=g.transfer_id)))
        self._prefill_done(step.prefill_done)
        if step.prefill_done_layer_wise:
            self._lw_tids = self._prefill_done(step.prefill_done_layer_wise, layer_wise=True)
            self._lw_done = [False] * len(self._layer_pos)
            self._lw_told = 0
        for e in step.expect:
            if self.link_down():
                # The KV cannot come through a sidecar we cannot reach: D computes it.
                self.stats.count("link_down")
                self.stats.count("failures")
                self.stats.count("recomputed")
                with self._lock:
                    self._results.finished_recving.add(e.request_id)
                    self._results.failed_recving.add(e.request_id)
                continue
            with self._lock:
                if e.transfer_id in self._d or e.transfer_id in self._p:
                    log.error("kvxfer: transfer id %s is already live here; request %s computes locally", e.transfer_id, e.request_id)
                    self._results.finished_recving.add(e.request_id)
                    self._results.failed_recving.add(e.request_id)
                    continue
                self._d[e.transfer_id] = _D(e.request_id, self._flat(e.block_ids, e.groups),
                                            tokens=e.num_tokens - e.prefix_tokens, started=self._clock())
            expect = engine_pb2.ExpectKv(
                transfer_id=e.transfer_id,
                source=e.source,
                num_tokens=e.num_tokens,
                prefix_tokens=e.prefix_tokens,
                token=e.token,
            )
            if e.groups is not None:
                expect.groups.extend(self._lists(e.groups))
            else:
                expect.block_ids.extend(self._expand(e.block_ids))
            if e.source_groups is not None:
                # Already in P's kvxfer blocks (the scheduler split them as P's answer said).
                expect.source_groups.extend(
                    layout_pb2.KvBlockList(first_block=g.first, block_ids=g.ids) for g in e.source_groups)
                expect.has_source_block_ids = True
            elif e.source_block_ids is not None:
                # Already in P's kvxfer blocks (the scheduler split them as P's answer said).
                expect.source_block_ids.extend(e.source_block_ids)
                expect.has_source_block_ids = True
            log.debug("kvxfer: ExpectKv %s from %s (blocks %s, tokens %d..%d, %s)", e.transfer_id, e.source,
                      e.block_ids, e.prefix_tokens, e.num_tokens, "pull" if e.source_block_ids is not None else "push")
            timeline.mark("d.worker.sent", e.transfer_id)
            if not self._send(engine_pb2.EngineToSidecar(expect_kv=expect)):
                self._fail_d(e.transfer_id)

    def after_forward(self, step: StepMessages) -> None:
        """Sends the PrefillDone of the prefills this step's forward completed (called once it has
        run); for layer-wise ones, that every layer is saved (a layer the forward did not report
        is saved too by now)."""
        if step.prefill_done_after_forward:
            self._prefill_done(step.prefill_done_after_forward)
        if self._lw_tids:
            if self._lw_told < len(self._lw_done):
                self._tell_layers(len(self._lw_done))
            self._lw_tids = []

    def layer_saved(self, layer_name: str) -> None:
        """The forward saved ``layer_name``'s KV (vLLM's ``save_kv_layer``, after its attention):
        with layer-wise transfers in this forward, the sidecar hears how many layers from the
        first are saved, once per layer that adds to them."""
        if not self._lw_tids:
            return
        i = self._layer_pos.get(layer_name)
        if i is None or self._lw_done[i]:
            return
        self._lw_done[i] = True
        n = self._lw_told
        while n < len(self._lw_done) and self._lw_done[n]:
            n += 1
        if n > self._lw_told:
            self._tell_layers(n)

    def _tell_layers(self, n: int) -> None:
        self._lw_told = n
        if n == len(self._lw_done):
            for tid in self._lw_tids:
                timeline.mark("p.worker.layers", tid)
        self._send(engine_pb2.EngineToSidecar(
            layers_saved=engine_pb2.LayersSaved(transfer_ids=self._lw_tids, layers=n)))

    def _prefill_done(self, msgs: list[PrefillDoneMsg], *, layer_wise: bool = False) -> list[str]:
        """Sends each PrefillDone; returns the transfer ids that reached the sidecar."""
        sent: list[str] = []
        for m in msgs:
            if self.link_down():
                # Nobody can read these blocks now: the engine gets them back at once.
                self.stats.count("link_down")
                self.stats.count("failures")
                with self._lock:
                    self._results.finished_sending.add(m.request_id)
                continue
            if self._before_prefill_done is not None:
                # Host-buffer mode: the blocks reach shared memory before the sidecar may read them.
                self._before_prefill_done(self._flat(m.block_ids, m.groups))
            with self._lock:
                if m.transfer_id in self._p or m.transfer_id in self._d:
                    log.error("kvxfer: transfer id %s is already live here; request %s is not sent", m.transfer_id, m.request_id)
                    self._results.finished_sending.add(m.request_id)
                    continue
                self._p[m.transfer_id] = _P(m.request_id, m.num_tokens)
            log.debug("kvxfer: PrefillDone %s (%d blocks, %d tokens)", m.transfer_id, len(m.block_ids), m.num_tokens)
            done = engine_pb2.PrefillDone(transfer_id=m.transfer_id, num_tokens=m.num_tokens, token=m.token,
                                          layer_wise=layer_wise)
            if m.groups is not None:
                done.groups.extend(self._lists(m.groups))
            else:
                done.block_ids.extend(self._expand(m.block_ids))
            msg = engine_pb2.EngineToSidecar(prefill_done=done)
            timeline.mark("p.worker.sent", m.transfer_id)
            if not self._send(msg):
                self._end_p(m.transfer_id, failed=True)
            else:
                sent.append(m.transfer_id)
        return sent

    def _lists(self, groups: list[BlockList]) -> list[layout_pb2.KvBlockList]:
        """vLLM's per-group lists in kvxfer blocks: each group split as its backend splits blocks."""
        split = self._group_split or [1] * len(groups)
        return [
            layout_pb2.KvBlockList(first_block=g.first * k, block_ids=expand_block_ids(g.ids, k))
            for g, k in zip(groups, split)
        ]

    def _flat(self, block_ids: list[int], groups: list[BlockList] | None) -> list[int]:
        """Every kvxfer block of a transfer (what host-buffer mode copies)."""
        if groups is None:
            return self._expand(block_ids)
        return [b for g in self._lists(groups) for b in g.block_ids]

    def take_results(self, idle_wait_s: float = 0.0) -> Results:
        """What finished since the last call (and the sidecar-lost bound, checked here).

        ``idle_wait_s``: on an engine step that ran no model (vLLM steps in a tight loop while a
        request waits for its KV), wait up to this long for the sidecar when nothing has finished,
        instead of returning at once: measured here, a decode engine waiting on a push burned
        1.5 cores spinning, and the prefill it waited for ran at half speed on the same machine."""
        if idle_wait_s > 0:
            with self._lock:
                quiet = not (self._results.finished_sending or self._results.finished_recving)
                busy = bool(self._p or self._d)
            if quiet and busy:
                self._activity.wait(idle_wait_s)
        self._activity.clear()
        with self._lock:
            lost = self._lost_since
        if lost is not None and self._clock() - lost > self.lost_timeout_s and self.in_flight():
            # Fires for whatever is in flight each time the bound has passed; _lost_since stays
            # set until a re-registration is accepted, and nothing new joins meanwhile (on_step
            # fails it at once), so this runs once per loss in practice.
            log.error("kvxfer: sidecar gone for %.1f s: failing every transfer in flight", self._clock() - lost)
            self._fail_all_in_flight()
        with self._lock:
            out, self._results = self._results, Results()
        return out

    def link_down(self) -> bool:
        """True from a lost connection until the sidecar accepts a registration again."""
        with self._lock:
            return self._lost_since is not None

    def in_flight(self) -> int:
        with self._lock:
            return len(self._p) + len(self._d)

    def close(self) -> None:
        self.link.close()

    # --- internals -------------------------------------------------------------------------

    def _send(self, msg: engine_pb2.EngineToSidecar) -> bool:
        try:
            self.link.send(msg)
            return True
        except LinkError as err:
            log.error("kvxfer: cannot reach the sidecar: %s", err)
            return False

    def _abort(self, request_id: str, transfer_id: str) -> None:
        with self._lock:
            d = self._d.get(transfer_id)
            if d is None:
                # Already ended (or never reached the sidecar): the blocks are the engine's.
                self._results.finished_sending.add(request_id)
                return
            d.aborted = True
        self._send(engine_pb2.EngineToSidecar(abort=engine_pb2.Abort(transfer_id=transfer_id)))

    def _end_p(self, tid: str, *, failed: bool = False) -> None:
        with self._lock:
            p = self._p.pop(tid, None)
            if p is not None:
                self._results.finished_sending.add(p.request_id)
        if p is not None and failed:
            self.stats.count("failures")

    def _fail_d(self, tid: str) -> None:
        """D's blocks are safe (nothing can write them any more): report the load as failed."""
        with self._lock:
            d = self._d.pop(tid, None)
            if d is not None:
                self._finish_d(d, failed=True)

    def _finish_d(self, d: _D, *, failed: bool, landed: int = 0) -> None:
        """Under the lock. A request that ended meanwhile gets its blocks back (sent); otherwise
        its load is done, failed or not. ``landed``: the bytes the sidecar says landed (KvReady;
        0 from a sidecar that does not say: estimated from the tokens)."""
        if d.aborted:
            self._results.finished_sending.add(d.request_id)
            return
        self._results.finished_recving.add(d.request_id)
        if failed:
            self._results.failed_recving.add(d.request_id)
            self.stats.count("failures")
            self.stats.count("recomputed")
        else:
            self.stats.count("transfers")
            self.stats.count("bytes", landed or d.tokens * self.bytes_per_token)
            self.stats.count("seconds", self._clock() - d.started)

    def _ready_d(self, tid: str, landed: int = 0) -> None:
        timeline.mark("d.worker.kv_ready", tid)
        with self._lock:
            d = self._d.get(tid)
        if d is None:
            log.warning("kvxfer: KvReady for unknown transfer %s", tid)
            return
        if self._on_kv_ready is not None and not d.aborted:
            # Host-buffer mode: the KV landed in shared memory; bring it to the engine's blocks.
            self._on_kv_ready(d.block_ids)
        with self._lock:
            d = self._d.pop(tid, None)
            if d is not None:
                self._finish_d(d, failed=False, landed=landed)

    def _count_p_release(self, tid: str, reason: int) -> None:
        with self._lock:
            p = self._p.get(tid)
        if p is None:
            return
        if reason == engine_pb2.RELEASE_REASON_TRANSFERRED:
            self.stats.count("transfers")
            self.stats.count("bytes", p.num_tokens * self.bytes_per_token)
            return
        self.stats.count("failures")
        if reason == engine_pb2.RELEASE_REASON_EXPIRED:
            self.stats.count("expired")

    def _fail_all_in_flight(self) -> None:
        with self._lock:
            p_ids = list(self._p)
            d_ids = list(self._d)
        for tid in p_ids:
            self._end_p(tid, failed=True)
        for tid in d_ids:
            self._fail_d(tid)

    def _active(self) -> None:
        self._activity.set()
        if self._on_activity is not None:
            self._on_activity()

    def _on_state(self, state: str) -> None:
        self._active()
        if state == "disconnected":
            with self._lock:
                if self._lost_since is None:
                    self._lost_since = self._clock()
            log.warning("kvxfer: lost the sidecar connection on %s", self.link.endpoint)
        elif state == "connected":
            first = not self._ever_connected
            self._ever_connected = True
            # A reconnect while register() waits also sends: a frame the old sidecar never read
            # died with it (register() keeps the first answer).
            if not first and self._registration is not None:
                log.info("kvxfer: sidecar connection back; registering again")
                self._send(self._registration)

    def _on_message(self, msg: engine_pb2.SidecarToEngine) -> None:
        try:
            self._handle(msg)
        finally:
            self._active()

    def _handle(self, msg: engine_pb2.SidecarToEngine) -> None:
        kind = msg.WhichOneof("msg")
        log.debug("kvxfer: sidecar says %s", kind)
        if kind == "registered":
            self._on_registered(msg.registered)
        elif kind == "kv_ready":
            self._ready_d(msg.kv_ready.transfer_id, msg.kv_ready.bytes)
        elif kind == "kv_failed":
            f = msg.kv_failed
            with self._lock:
                d = self._d.get(f.transfer_id)
                if d is not None:
                    d.failing = True
                    if f.reason in _EXPIRED_REASONS:
                        self.stats.count("expired")
                self.failures.append((f.transfer_id, engine_pb2.FailureReason.Name(f.reason), f.message))
            log.info("kvxfer: transfer %s failed (%s): %s; waiting for its blocks",
                     msg.kv_failed.transfer_id, engine_pb2.FailureReason.Name(msg.kv_failed.reason), msg.kv_failed.message)
        elif kind == "release_blocks":
            tid = msg.release_blocks.transfer_id
            with self._lock:
                is_p, is_d = tid in self._p, tid in self._d
            if is_p:
                self._count_p_release(tid, msg.release_blocks.reason)
                self._end_p(tid)
            elif is_d:
                self._fail_d(tid)
        elif kind == "refused":
            self._on_refused(msg.refused)

    def _on_registered(self, ans: engine_pb2.Registered) -> None:
        if self._initial:
            if not self._registered.is_set():
                self._reg_answer = ans
                self._registered.set()
            return
        # A re-registration after a reconnect: the link is up again once it is accepted.
        if ans.ok:
            with self._lock:
                self._lost_since = None
        counted, self._restart_counted = self._restart_counted, False
        if ans.ok:
            self._already_retries = 0
        if ans.ok and ans.epoch != self.epoch:
            log.warning("kvxfer: the sidecar restarted (epoch %d -> %d): failing the transfers it forgot", self.epoch, ans.epoch)
            self.epoch = ans.epoch
            if not counted:  # one restart, however many ways it was noticed
                self.restarts += 1
            self._fail_all_in_flight()
        elif not ans.ok and ans.epoch == self.epoch:
            # The same sidecar still holds this registration (ERR_ENGINE_LINK_TAKEN). After a
            # reconnect it hands the link to the new connection only once it has seen the old one
            # end (ERR_ENGINE_LINK_TAKEN until then): ask again shortly, bounded.
            if (
                _code(ans.error) == "ERR_ENGINE_LINK_TAKEN"
                and self._registration is not None
                and self._already_retries < _MAX_ALREADY_RETRIES
            ):
                self._already_retries += 1
                retry = threading.Timer(_ALREADY_RETRY_S, self._send, args=(self._registration,))
                retry.daemon = True
                retry.start()
        elif not ans.ok and _code(ans.error) == "ERR_ALREADY_REGISTERED":
            pass  # this connection owns the link already (a registration sent twice)
        elif not ans.ok:
            log.error("kvxfer: the sidecar refused the re-registration: %s", ans.error)

    def _on_refused(self, r: engine_pb2.Refused) -> None:
        tid = r.transfer_id
        if r.code == "ERR_NOT_REGISTERED":
            # The sidecar does not know this engine: it restarted without us seeing the
            # connection drop. Everything it had is gone; register again.
            self._fail_all_in_flight()
            if self._restart_counted:
                return  # already registering again; older messages are refused one by one
            log.warning("kvxfer: the sidecar does not know this engine (restarted?); registering again")
            self._restart_counted = True
            self.restarts += 1
            if self._registration is not None:
                self._send(self._registration)
            return
        with self._lock:
            is_p, is_d = tid in self._p, tid in self._d
            given_up = r.code == "ERR_UNKNOWN_TRANSFER" and tid in self._giving_up
            self._giving_up.discard(tid)
        if given_up:
            return
        log.warning("kvxfer: sidecar refused %s for transfer %r: %s", r.code, tid, r.message)
        # The refused message never started a transfer on the sidecar: nothing of it can
        # write (D) or read (P) these blocks.
        if is_p:
            self._end_p(tid, failed=True)
        elif is_d:
            self._fail_d(tid)
