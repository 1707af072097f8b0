"""The adapter against the installed vLLM's own classes: a real VllmConfig, Request, KVCacheBlocks
and KVConnectorOutput through every scheduler-side hook, and the start-up refusals."""

from __future__ import annotations

import pytest
import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvxfer_vllm.connector import KvxferConnector, KvxferConnectorMetadata, KvxferHandshakeMetadata
from kvxfer_vllm.errors import ConfigError
from kvxfer_vllm.messages import PrefillDoneMsg, StepMessages
from kvxfer_vllm_testing.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("adapter") / "model"))


def vllm_config(model: str, extra: dict | None = None, engine_id: str = "p0"):
    ktc = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer_vllm.connector",
                           engine_id=engine_id, kv_role="kv_both", kv_connector_extra_config=extra or {})
    return EngineArgs(model=model, enforce_eager=True, max_model_len=512, block_size=32,
                      kv_transfer_config=ktc).create_engine_config()


def connector(model: str, **kw) -> KvxferConnector:
    return KvxferConnector(vllm_config(model, **kw), KVConnectorRole.SCHEDULER,
                           KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[]))


def request(rid: str, n: int, params: dict, max_tokens: int = 4) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(3, 3 + n)), sp, None)


def test_the_connector_is_a_complete_v1_connector(model):
    c = connector(model)
    assert isinstance(c, KVConnectorBase_V1)
    assert not KvxferConnector.__abstractmethods__


def test_prefill_side_hooks(model):
    c = connector(model)
    c.set_xfer_handshake_metadata({0: KvxferHandshakeMetadata(side_channel="127.0.0.1:4000", epoch=9)})
    r = request("cmpl-a-0-0badcafe", 70, {"do_remote_decode": True})
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    r.num_computed_tokens = 70
    delay, params = c.request_finished(r, [5, 6, 7])
    assert delay and params["transfer_id"] == "cmpl-a-0" and params["remote_port"] == 4000
    assert params["remote_block_ids"] == [5, 6, 7] and params["remote_num_tokens"] == 70
    assert c.has_pending_push_work()
    meta = c.build_connector_meta(None)  # type: ignore[arg-type]
    assert isinstance(meta, KvxferConnectorMetadata) and meta.step.prefill_done[0].block_ids == [5, 6, 7]
    c.update_connector_output(KVConnectorOutput(finished_sending={"cmpl-a-0-0badcafe"}))
    assert not c.has_pending_push_work()
    aborted = request("cmpl-b-0-0badcafe", 10, {"do_remote_decode": True})
    aborted.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(aborted, [1]) == (False, None)


def test_decode_side_hooks(model):
    c = connector(model)
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 4000,
              "remote_block_ids": [5, 6, 7], "remote_num_tokens": 70, "transfer_id": "t9"}
    r = request("cmpl-d-0-0badcafe", 70, params)
    assert c.get_num_new_matched_tokens(r, 32) == (38, True)
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in (11, 12, 13)],))
    c.update_state_after_alloc(r, blocks, 38)
    (m,) = c.build_connector_meta(None).step.expect  # type: ignore[arg-type]
    assert (m.block_ids, m.num_tokens, m.prefix_tokens, m.source, m.source_block_ids) == (
        [11, 12, 13], 70, 32, "127.0.0.1:4000", [5, 6, 7])
    c.update_connector_output(KVConnectorOutput(finished_recving={"cmpl-d-0-0badcafe"}))
    assert not c.has_pending_push_work()


class _StepLog:
    """Stands in for the worker half (which needs a sidecar): records what the adapter hands it."""

    def __init__(self) -> None:
        self.steps: list[StepMessages] = []

        self.after: list[StepMessages] = []

    def on_step(self, step: StepMessages) -> None:
        self.steps.append(step)

    def after_forward(self, step: StepMessages) -> None:
        self.after.append(step)


def test_a_cpu_engine_sends_a_steps_messages_when_vllm_binds_them_before_the_forward(model):
    # vLLM 0.32 calls start_load_kv after the forward (synchronous on CPU): P's PrefillDone sent
    # there waited a whole prefill step, and D's read waited for it (journal/vllm.md).
    c = connector(model)
    c.worker = log = _StepLog()  # type: ignore[assignment]
    meta = KvxferConnectorMetadata(step=StepMessages(prefill_done=[PrefillDoneMsg("r", "t", [5], 32)]))
    c.bind_connector_metadata(meta)
    assert log.steps == [meta.step]
    c.start_load_kv(None)  # type: ignore[arg-type]
    c.clear_connector_metadata()
    assert log.steps == [meta.step]  # once
    # Where the forward is only launched (a GPU), the messages go in start_load_kv, as before.
    c._send_at_bind = False
    later = KvxferConnectorMetadata(step=StepMessages(prefill_done=[PrefillDoneMsg("r2", "t2", [6], 32)]))
    c.bind_connector_metadata(later)
    assert log.steps == [meta.step]
    c.start_load_kv(None)  # type: ignore[arg-type]
    assert log.steps == [meta.step, later.step]


def test_a_cpu_prefill_is_announced_after_the_forward_that_completes_it(model):
    """vLLM's own SchedulerOutput for the step that computes a one-token request's whole prompt:
    its PrefillDone rides that step and the worker sends it from wait_for_save (after the forward
    on CPU); request_finished, a step later, answers with the same blocks and token."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    c = connector(model)
    c.set_xfer_handshake_metadata({0: KvxferHandshakeMetadata(side_channel="127.0.0.1:4000", epoch=9)})
    r = request("cmpl-f-0-0badcafe", 70, {"do_remote_decode": True}, max_tokens=1)
    c.update_state_after_alloc(r, KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in (5, 6, 7)],)), 0)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(r, ([5, 6, 7],))]
    out.num_scheduled_tokens = {r.request_id: 70}
    out.total_num_scheduled_tokens = 70
    meta = c.build_connector_meta(out)
    assert isinstance(meta, KvxferConnectorMetadata) and not meta.step.prefill_done
    (m,) = meta.step.prefill_done_after_forward
    assert (m.transfer_id, m.block_ids, m.num_tokens) == ("cmpl-f-0", [5, 6, 7], 70)
    c.worker = log = _StepLog()  # type: ignore[assignment]
    c.bind_connector_metadata(meta)
    assert log.steps == [meta.step] and log.after == []
    c.wait_for_save()
    assert log.after == [meta.step]
    c.clear_connector_metadata()
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    r.num_computed_tokens = 70
    delay, params = c.request_finished(r, [5, 6, 7])
    assert delay and params["remote_block_ids"] == [5, 6, 7] and params["remote_num_tokens"] == 70
    assert not c.build_connector_meta(SchedulerOutput.make_empty()).step  # announced once


def test_configuration_errors_stop_the_engine_at_start_up(model):
    with pytest.raises(ConfigError, match="shm_dri"):
        connector(model, extra={"shm_dri": "/dev/shm"})
    with pytest.raises(ConfigError, match="engine_id"):
        connector(model, engine_id="no spaces please")


def test_other_vllm_versions_are_refused_at_start_up(model, monkeypatch):
    cfg = vllm_config(model)
    monkeypatch.setattr(vllm, "__version__", "0.29.1")
    with pytest.raises(ConfigError) as e:
        KvxferConnector(cfg, KVConnectorRole.SCHEDULER, None)
    assert e.value.code == "ERR_VLLM_VERSION" and "0.29.1" in e.value.message


def test_transfer_counters_reach_vllms_prometheus_metrics():
    """The connector's stats as vLLM's logger process handles them: built from each worker's dict,
    aggregated, reduced for the log line, and observed into per-engine Prometheus counters."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvxfer_vllm.connector import PROM_COUNTERS, KvxferConnector

    a = KvxferConnector.build_kv_connector_stats({"transfers": 2, "bytes": 4096, "seconds": 0.5})
    b = KvxferConnector.build_kv_connector_stats({"transfers": 1, "failures": 1, "recomputed": 1, "mismatched": 1})
    s = a.aggregate(b)
    assert s.reduce()["transfers"] == 3 and s.reduce()["avg_transfer_ms"] == pytest.approx(166.667)
    assert KvxferConnector.build_kv_connector_stats({}).is_empty() and not s.is_empty()
    reg = CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (Counter, Gauge, Histogram)}
    from types import SimpleNamespace

    prom = KvxferConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(s.to_dict(), 0)
    text = generate_latest(reg).decode()
    for key, value in {"transfers": 3, "bytes": 4096, "mismatched": 1, "recomputed": 1, "expired": 0}.items():
        assert f'{PROM_COUNTERS[key][0]}_total{{engine="0",model_name="m"}} {float(value)}' in text


def test_the_tiny_model_has_a_chat_template(model):
    """Chat requests to the test engines need no --chat-template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok.apply_chat_template([{"role": "user", "content": "w1 w2"}, {"role": "user", "content": "w3"}])
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == [4, 5, 6]


def hybrid_config() -> KVCacheConfig:
    """vLLM's groups of a hybrid model: full attention, a sliding window of 64, a Mamba state."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    sw = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=64)
    state = MambaSpec(block_size=32, shapes=((3, 64), (2, 16, 16)), dtypes=(torch.bfloat16, torch.float32),
                      page_size_padded=full.page_size_bytes)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.attn"], full), KVCacheGroupSpec(["model.layers.1.attn"], sw),
        KVCacheGroupSpec(["model.layers.2.mamba"], state)])


def test_a_hybrid_model_keeps_vllms_hybrid_manager_and_names_every_groups_blocks(model):
    """SupportsHMA: P's request_finished_all_groups gets one table per group; the sidecar gets the
    full group's blocks, the window's tail without vLLM's null blocks, and the state's slot; P
    stops one prompt token short (a state group), and D expects that many tokens."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    assert supports_hma(KvxferConnector)
    c = KvxferConnector(vllm_config(model), KVConnectorRole.SCHEDULER, hybrid_config())
    c.set_xfer_handshake_metadata({0: KvxferHandshakeMetadata(side_channel="127.0.0.1:4000", epoch=9,
                                                              blocks_per_block=[1, 1, 1])})
    assert c.get_loaded_kv_cache_group_ids(request("x", 4, {})) == (0, 1, 2)
    r = request("cmpl-h-0-0badcafe", 200, {"do_remote_decode": True})
    c.on_new_request(r)
    assert r.num_prompt_tokens == 199 and len(r.prompt_token_ids) == 199  # the last token is D's
    c.on_new_request(r)
    assert r.num_prompt_tokens == 199  # once
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    r.num_computed_tokens = 199
    full = list(range(1, 8))
    window = [0, 0, 0, 0, 12, 13, 14]  # vLLM freed what left the window
    delay, params = c.request_finished_all_groups(r, (full, window, [0, 30]))
    assert delay and params["remote_num_tokens"] == 199
    assert params["remote_block_ids"] == [full, [12, 13, 14], [30]] and params["kvxfer_first_blocks"] == [0, 4, 0]
    (m,) = c.build_connector_meta(None).step.prefill_done  # type: ignore[arg-type]
    assert [(g.first, g.ids) for g in m.groups] == [(0, full), (4, [12, 13, 14]), (0, [30])]
    assert m.block_ids == [*full, 12, 13, 14, 30] and m.num_tokens == 199

    # D, pull: P's answer as the router relays it; the same model, so one token fewer expected.
    d = KvxferConnector(vllm_config(model, engine_id="d0"), KVConnectorRole.SCHEDULER, hybrid_config())
    dr = request("cmpl-hd-0-0badcafe", 200, dict(params))
    assert d.get_num_new_matched_tokens(dr, 0) == (199, True)
    tables = ([KVCacheBlock(block_id=b) for b in range(20, 27)],
              [KVCacheBlock(block_id=b) for b in (0, 0, 0, 0, 40, 41, 42)], [KVCacheBlock(block_id=50)])
    d.update_state_after_alloc(dr, KVCacheBlocks(blocks=tables), 199)
    (e,) = d.build_connector_meta(None).step.expect  # type: ignore[arg-type]
    assert [(g.first, g.ids) for g in e.groups] == [(0, list(range(20, 27))), (4, [40, 41, 42]), (0, [50])]
    assert [(g.first, g.ids) for g in e.source_groups] == [(0, full), (4, [12, 13, 14]), (0, [30])]
    # Push: D registers before P answers; it knows the count from its own groups.
    pr = request("cmpl-hp-0-0badcafe", 200, {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                                            "remote_port": 4000, "transfer_id": "tp"})
    assert d.get_num_new_matched_tokens(pr, 0) == (199, True)


def test_a_cache_group_kvxfer_cannot_move_is_refused_at_start_up(model):
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheGroupSpec

    spec = ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                                     attention_chunk_size=128)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a.0.x"], spec)])
    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec cache group"):
        KvxferConnector(vllm_config(model), KVConnectorRole.SCHEDULER, cfg)
