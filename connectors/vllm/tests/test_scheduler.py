"""The scheduler half, in-process: what each hook decides and what it queues for the worker."""

from __future__ import annotations

import pytest

from kvxfer_vllm.params import BadParams, parse_remote_prefill, strip_request_suffix, transfer_id_of
from kvxfer_vllm.scheduler import SchedulerLogic


def sched() -> SchedulerLogic:
    s = SchedulerLogic(engine_id="p0", tp_size=2)
    s.set_side_channel("10.1.2.3:4567")
    return s


def test_transfer_id_is_the_routers_or_the_request_id_without_vllms_suffix():
    assert strip_request_suffix("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert strip_request_suffix("cmpl-abc-0") == "cmpl-abc-0"
    assert transfer_id_of({"transfer_id": "router-7"}, "cmpl-x-0-1a2b3c4d") == "router-7"
    assert transfer_id_of({}, "cmpl-x-0-1a2b3c4d") == "cmpl-x-0"


def test_prefill_finished_holds_blocks_and_answers_what_d_needs():
    s = sched()
    delay, params = s.request_finished(
        "cmpl-r-0-deadbeef", {"do_remote_decode": True}, finished_ok=True, block_ids=[4, 7, 1], num_computed_tokens=70
    )
    assert delay is True
    # A fresh token binds the transfer to whichever D this answer reaches.
    token = params.pop("kvxfer_token")
    assert isinstance(token, str) and len(token) == 32
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "cmpl-r-0",
        "remote_engine_id": "p0",
        "remote_request_id": "cmpl-r-0-deadbeef",
        "remote_host": "10.1.2.3",
        "remote_port": 4567,
        "remote_block_ids": [4, 7, 1],
        "remote_num_tokens": 70,
        "tp_size": 2,
        "transfer_mode": "pull",
        "kvxfer_blocks_per_block": 1,
        "kvxfer_prompt_digest": "",
    }
    assert s.has_pending_work()
    step = s.build_step()
    assert [(m.transfer_id, m.block_ids, m.num_tokens, m.token) for m in step.prefill_done] == [
        ("cmpl-r-0", [4, 7, 1], 70, token)
    ]
    assert not s.build_step()
    assert s.has_pending_work()  # blocks held until the worker reports them sent
    s.on_worker_output({"cmpl-r-0-deadbeef"}, None)
    assert not s.has_pending_work()


@pytest.mark.parametrize(
    "params, ok, blocks",
    [({"do_remote_decode": True}, False, [1]), ({"do_remote_decode": True}, True, []), (None, True, [1]), ({}, True, [1])],
)
def test_prefill_that_moves_nothing_frees_at_once(params, ok, blocks):
    s = sched()
    assert s.request_finished("r", params, finished_ok=ok, block_ids=blocks, num_computed_tokens=10) == (False, None)
    assert not s.has_pending_work()


def test_prefill_without_a_known_side_channel_frees_at_once():
    s = SchedulerLogic(engine_id="p0", tp_size=1)
    assert s.request_finished("r", {"do_remote_decode": True}, finished_ok=True, block_ids=[1], num_computed_tokens=5) == (False, None)


def test_decode_pull_expects_every_prompt_token_after_the_local_prefix():
    s = sched()
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 9, "remote_block_ids": [5, 6, 8],
              "remote_num_tokens": 70, "transfer_id": "t1"}
    assert s.num_new_matched_tokens("d1", params, 70, 32) == (38, True)
    assert s.num_new_matched_tokens("d1", params, 70, 0) == (70, True)  # side-effect free
    s.after_alloc("d1", params, [3, 4, 9], 38, 70)
    assert params["do_remote_prefill"] is False
    s.after_alloc("d1", params, [3, 4, 9], 38, 70)  # a second allocation does not expect again
    (m,) = s.build_step().expect
    assert (m.transfer_id, m.block_ids, m.num_tokens, m.prefix_tokens, m.source, m.source_block_ids) == (
        "t1", [3, 4, 9], 70, 32, "h:9", [5, 6, 8])
    assert s.has_pending_work()
    s.on_worker_output(None, {"d1"})
    assert not s.has_pending_work()


def test_decode_push_has_no_source_blocks():
    s = sched()
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 9, "transfer_id": "t2"}
    assert s.num_new_matched_tokens("d2", params, 20, 0) == (20, True)
    s.after_alloc("d2", params, [1], 20, 20)
    (m,) = s.build_step().expect
    assert m.source_block_ids is None and m.prefix_tokens == 0


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"remote_port": 9}, "remote_host"),
        ({"remote_host": "h", "remote_port": "9"}, "remote_port"),
        ({"remote_host": "h", "remote_port": 70000}, "remote_port"),
        ({"remote_host": "h", "remote_port": 9, "remote_block_ids": [[1], [2]]}, "remote_block_ids"),
        ({"remote_host": "h", "remote_port": 9, "remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"remote_host": "h", "remote_port": 9, "remote_num_tokens": -1}, "remote_num_tokens"),
        ({"remote_host": "h", "remote_port": 9, "transfer_id": "x" * 300}, "transfer_id"),
    ],
)
def test_unusable_params_name_the_field_and_the_prompt_is_computed_locally(bad, field):
    with pytest.raises(BadParams) as e:
        parse_remote_prefill({"do_remote_prefill": True, **bad}, "r")
    assert e.value.field == field
    assert sched().num_new_matched_tokens("r", {"do_remote_prefill": True, **bad}, 10, 0) == (0, False)


def test_source_blocks_are_split_as_ps_backend_splits_them():
    p = parse_remote_prefill({"remote_host": "h", "remote_port": 1, "remote_block_ids": [3, 0],
                              "kvxfer_blocks_per_block": 2}, "r")
    assert p.source_block_ids == [6, 7, 0, 1]
    with pytest.raises(BadParams) as e:
        parse_remote_prefill({"remote_host": "h", "remote_port": 1, "kvxfer_blocks_per_block": 0}, "r")
    assert e.value.field == "kvxfer_blocks_per_block"


def test_vllm_group_form_of_block_ids_is_accepted():
    p = parse_remote_prefill({"remote_host": "h", "remote_port": 1, "remote_block_ids": [[4, 5]]}, "r")
    assert p.source_block_ids == [4, 5]


def test_decode_request_that_ends_while_kv_is_coming():
    s = sched()
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 9, "transfer_id": "t3"}
    s.num_new_matched_tokens("d3", params, 20, 0)
    s.after_alloc("d3", params, [1], 20, 20)
    # Not yet handed to the worker: nothing can write the blocks, they go back at once.
    assert s.request_finished("d3", params, finished_ok=False, block_ids=[1], num_computed_tokens=0) == (False, None)
    assert not s.build_step()
    # Handed to the worker: the sidecar may still write, so the blocks wait for its word.
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 9, "transfer_id": "t4"}
    s.after_alloc("d4", params, [2], 20, 20)
    s.build_step()
    assert s.request_finished("d4", params, finished_ok=False, block_ids=[2], num_computed_tokens=0) == (True, None)
    (a,) = s.build_step().abort
    assert (a.request_id, a.transfer_id) == ("d4", "t4")
    assert s.has_pending_work()
    s.on_worker_output({"d4"}, None)
    assert not s.has_pending_work()


def test_the_routers_token_binds_the_transfer_and_reaches_d():
    s = sched()
    _, params = s.request_finished(
        "r-1", {"do_remote_decode": True, "kvxfer_token": "router-tok"}, finished_ok=True, block_ids=[1],
        num_computed_tokens=10,
    )
    assert params["kvxfer_token"] == "router-tok"
    assert s.build_step().prefill_done[0].token == "router-tok"
    assert parse_remote_prefill(params, "r-1").token == "router-tok"
    # Not a string of at most 128 bytes: P does not send it, D names the field.
    assert s.request_finished("r-2", {"do_remote_decode": True, "kvxfer_token": "x" * 129}, finished_ok=True,
                              block_ids=[1], num_computed_tokens=10) == (False, None)
    with pytest.raises(BadParams, match="kvxfer_token"):
        parse_remote_prefill({"remote_host": "h", "remote_port": 1, "kvxfer_token": 7}, "r")


@pytest.mark.parametrize(
    "finished_ok, blocks, computed",
    [(False, [1], 40), (True, [], 0), (True, [1], 0)],
    ids=["aborted", "no-blocks", "nothing-computed"],
)
def test_p_gives_up_a_router_named_transfer_that_ends_without_kv(finished_ok, blocks, computed):
    """Push: D may have registered for a transfer the router named before P finished. When P's
    request ends without KV, the worker is told to give it up (its sidecar tells D at once)."""
    s = sched()
    params = {"do_remote_decode": True, "transfer_id": "router-9"}
    assert s.request_finished("cmpl-a-0-deadbeef", params, finished_ok=finished_ok, block_ids=blocks,
                              num_computed_tokens=computed) == (False, None)
    step = s.build_step()
    assert [(g.request_id, g.transfer_id) for g in step.give_up] == [("cmpl-a-0-deadbeef", "router-9")]
    assert not step.prefill_done and not s.has_pending_work()
    # A transfer P named itself reaches D only in P's answer: nobody to tell.
    s.request_finished("cmpl-b-0-deadbeef", {"do_remote_decode": True}, finished_ok=False, block_ids=[1],
                       num_computed_tokens=4)
    assert not s.build_step()


def test_kv_is_bound_to_its_prompt():
    """P's answer carries the digest of the tokens its blocks hold; D checks its prompt against it
    before anything is expected (a mismatch is computed locally, counted, named). The token each
    side hands its sidecar is bound to its own prompt, so P's sidecar also tells prompts apart
    (push, where D never sees P's answer)."""
    from kvxfer_vllm.params import bind_token, prompt_digest

    prompt = [5, 9, 2, 7] * 10  # 40 tokens
    other = [5, 9, 2, 8] * 10
    p = sched()
    _, answer = p.request_finished("cmpl-r-0-deadbeef", {"do_remote_decode": True}, finished_ok=True,
                                   block_ids=[1, 2], num_computed_tokens=41, token_ids=prompt)
    assert answer["kvxfer_prompt_digest"] == prompt_digest(prompt, 40) != prompt_digest(other, 40)
    [done] = p.build_step().prefill_done
    assert done.token == bind_token(answer["kvxfer_token"], answer["kvxfer_prompt_digest"]) != answer["kvxfer_token"]
    # D with the same prompt: expected, with the same bound token as P's.
    d = sched()
    assert d.num_new_matched_tokens("d1", dict(answer), 40, 0, prompt_token_ids=prompt) == (40, True)
    params = dict(answer)
    d.num_new_matched_tokens("d1", params, 40, 0, prompt_token_ids=prompt)
    d.after_alloc("d1", params, [7, 8], 40, 40)
    [e] = d.build_step().expect
    assert e.token == done.token
    # D with another prompt (another request's params, right token): refused by name, computed here.
    forged = dict(answer)
    assert d.num_new_matched_tokens("d2", forged, 40, 0, prompt_token_ids=other) == (0, False)
    d.after_alloc("d2", forged, [3, 4], 0, 40)
    assert not d.build_step() and d.stats.snapshot() == {"mismatched": 1, "recomputed": 1}
    # A digest that is not one is bad params (computed locally).
    assert d.num_new_matched_tokens("d3", {**answer, "kvxfer_prompt_digest": "zz"}, 40, 0, prompt_token_ids=prompt) == (0, False)
    # Push: D has no answer from P, only the router's params; its token is bound to its prompt.
    push = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 9, "transfer_id": "t9", "kvxfer_token": "k"}
    for pid, ids in (("d4", prompt), ("d5", other)):
        params = dict(push)
        assert d.num_new_matched_tokens(pid, params, 40, 0, prompt_token_ids=ids) == (40, True)
        d.after_alloc(pid, params, [1], 40, 40)
    e4, e5 = d.build_step().expect
    assert e4.token == bind_token("k", prompt_digest(prompt, 40)) and e5.token != e4.token


def early_sched() -> SchedulerLogic:
    s = SchedulerLogic(engine_id="p0", tp_size=1, early_prefill_done=True)
    s.set_side_channel("10.1.2.3:4567")
    return s


def test_a_one_token_prefill_is_announced_after_the_forward_that_completes_it():
    """P (on CPU): the step that computes the whole prompt of a request that may generate one token
    carries its PrefillDone, to be sent after that step's forward; vLLM finishing the request then
    only answers, with the same token, digest and blocks."""
    from kvxfer_vllm.params import bind_token, prompt_digest
    from kvxfer_vllm.scheduler import Scheduled

    s = early_sched()
    prompt = list(range(3, 73))  # 70 tokens
    s.p_allocated("cmpl-e-0-deadbeef", {"do_remote_decode": True}, [4, 7, 1], prompt, 1)
    step = s.build_step({"cmpl-e-0-deadbeef": Scheduled(70)})
    assert not step.prefill_done  # not before the forward
    (m,) = step.prefill_done_after_forward
    assert (m.request_id, m.transfer_id, m.block_ids, m.num_tokens) == ("cmpl-e-0-deadbeef", "cmpl-e-0", [4, 7, 1], 70)
    assert s.has_pending_work()
    delay, params = s.request_finished("cmpl-e-0-deadbeef", {"do_remote_decode": True}, finished_ok=True,
                                       block_ids=[4, 7, 1], num_computed_tokens=70, token_ids=prompt)
    assert delay is True
    assert params["remote_block_ids"] == [4, 7, 1] and params["remote_num_tokens"] == 70
    assert params["kvxfer_prompt_digest"] == prompt_digest(prompt, 70)
    assert m.token == bind_token(params["kvxfer_token"], params["kvxfer_prompt_digest"])
    assert not s.build_step()  # sent once
    s.on_worker_output({"cmpl-e-0-deadbeef"}, None)
    assert not s.has_pending_work()


def test_layer_wise_the_prefill_goes_before_its_forward_with_its_last_chunk():
    """Layer-wise push: the step that completes the prompt carries its PrefillDone to be sent when
    the step is bound (before its forward), not after it; a chunked prompt only with its last
    chunk (its earlier chunks' KV is final by then, every layer of it)."""
    from kvxfer_vllm.scheduler import Scheduled

    s = SchedulerLogic(engine_id="p0", tp_size=1, early_prefill_done=True, layer_wise=True)
    s.set_side_channel("10.1.2.3:4567")
    s.p_allocated("r", {"do_remote_decode": True, "transfer_id": "t"}, [1, 2], list(range(100)), 1)
    assert not s.build_step({"r": Scheduled(64)})
    step = s.build_step({"r": Scheduled(100, [9])})
    assert not step.prefill_done_after_forward and not step.prefill_done
    (m,) = step.prefill_done_layer_wise
    assert (m.transfer_id, m.block_ids, m.num_tokens) == ("t", [1, 2, 9], 100)
    # Without early PrefillDone (a GPU engine) there is no layer-wise either.
    g = SchedulerLogic(engine_id="p0", tp_size=1, early_prefill_done=False, layer_wise=True)
    g.set_side_channel("10.1.2.3:4567")
    g.p_allocated("r", {"do_remote_decode": True}, [1], list(range(10)), 1)
    assert not g.build_step({"r": Scheduled(10)})


def test_a_chunked_prompt_is_announced_with_its_last_chunk_and_all_its_blocks():
    from kvxfer_vllm.scheduler import Scheduled

    s = early_sched()
    s.p_allocated("r", {"do_remote_decode": True, "transfer_id": "t"}, [1, 2], list(range(100)), 1)
    assert not s.build_step({"r": Scheduled(64)})  # first chunk
    assert not s.build_step({})  # a step without it
    (m,) = s.build_step({"r": Scheduled(100, [9, 5])}).prefill_done_after_forward
    assert m.block_ids == [1, 2, 9, 5] and m.num_tokens == 100
    # Preempted and resumed: vLLM gives all its blocks again.
    s2 = early_sched()
    s2.p_allocated("r", {"do_remote_decode": True}, [1, 2], list(range(100)), 1)
    s2.build_step({"r": Scheduled(64)})
    (m,) = s2.build_step({"r": Scheduled(100, [6, 3, 8, 4], replace=True)}).prefill_done_after_forward
    assert m.block_ids == [6, 3, 8, 4]


@pytest.mark.parametrize(
    "params, max_tokens, side_channel, enabled",
    [({"do_remote_decode": True}, 2, True, True),  # may decode on P: ends later
     ({"do_remote_decode": True}, None, True, True),
     ({}, 1, True, True),  # not for remote decode
     ({"do_remote_decode": True}, 1, False, True),  # no side channel known
     ({"do_remote_decode": True}, 1, True, False)],  # not on this device (a GPU's forward is async)
)
def test_other_prefills_are_announced_when_vllm_finishes_them(params, max_tokens, side_channel, enabled):
    from kvxfer_vllm.scheduler import Scheduled

    s = SchedulerLogic(engine_id="p0", tp_size=1, early_prefill_done=enabled)
    if side_channel:
        s.set_side_channel("10.1.2.3:4567")
    s.p_allocated("r", params, [1], list(range(10)), max_tokens)
    assert not s.build_step({"r": Scheduled(10)})
    if params and side_channel:
        s.request_finished("r", params, finished_ok=True, block_ids=[1], num_computed_tokens=10)
        assert [m.request_id for m in s.build_step().prefill_done] == ["r"]


def test_an_announced_prefill_that_is_aborted_keeps_its_blocks_until_the_sidecar_lets_go():
    """The sidecar may be reading the blocks already: whatever vLLM decides about the request, they
    are freed only when the worker reports the transfer over; D gets no answer to read with."""
    from kvxfer_vllm.scheduler import Scheduled

    s = early_sched()
    s.p_allocated("r", {"do_remote_decode": True}, [1, 2], list(range(40)), 1)
    s.build_step({"r": Scheduled(40)})
    assert s.request_finished("r", {"do_remote_decode": True}, finished_ok=False, block_ids=[1, 2],
                              num_computed_tokens=40) == (True, None)
    assert not s.build_step()  # no second PrefillDone, no give-up: the transfer runs its course
    assert s.has_pending_work()
    s.on_worker_output({"r"}, None)
    assert not s.has_pending_work()
    # Other blocks than announced (not expected from vLLM): held, and no answer points D at them.
    s.p_allocated("q", {"do_remote_decode": True}, [3], list(range(20)), 1)
    s.build_step({"q": Scheduled(20)})
    assert s.request_finished("q", {"do_remote_decode": True}, finished_ok=True, block_ids=[3, 4],
                              num_computed_tokens=20) == (True, None)


def test_a_candidate_that_ends_before_its_last_chunk_is_forgotten():
    from kvxfer_vllm.scheduler import Scheduled

    s = early_sched()
    s.p_allocated("r", {"do_remote_decode": True}, [1], list(range(100)), 1)
    s.build_step({"r": Scheduled(50)})
    assert s.request_finished("r", {"do_remote_decode": True}, finished_ok=False, block_ids=[1],
                              num_computed_tokens=50) == (False, None)
    assert not s.build_step({"r": Scheduled(100)})
    assert not s.has_pending_work()
