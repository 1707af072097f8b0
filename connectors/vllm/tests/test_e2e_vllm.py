"""The real thing: two vLLM engines (P and D, CPU build) serving a model made here, each with its
kvxfer sidecar, driven like vLLM's own P/D proxy. With greedy sampling D's tokens must equal those
of one engine alone, in pull and in push; prefix caching on D moves only the tail; a P sidecar that
dies costs a recompute, not the request, and leaves no block held on either engine.

The engines start once for the module (about a minute and a half on two cores) and are stopped,
with their sidecars, at the end; the fixture then checks that no process, socket or
shared-memory file is left.
"""

from __future__ import annotations

import math

import pytest
from conftest import Deployment, pd_deployment, prompt, unique, wait_for

from kvxfer_vllm_testing.harness import PdRouter, SidecarProc, VllmServer, output_ids

BLOCK = 32
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with pd_deployment(tmp_path_factory.mktemp("e2e"), BLOCK, {}) as dep:
        yield dep


def reference(pd: Deployment, ids: list[int]) -> list[int]:
    """One engine alone: P serves the whole request itself (no kv_transfer_params)."""
    return output_ids(pd.p.complete(ids, MAX_TOKENS))


LENGTHS = [20, BLOCK, 70, 200]  # shorter than a block, exactly one, several with a partial last


@pytest.mark.parametrize("n", LENGTHS)
def test_pull_decodes_token_for_token_like_one_engine(pd, n):
    ids = prompt(n, seed=n)
    want = reference(pd, ids)
    got, params = pd.router.pull(ids, MAX_TOKENS, unique("pull"))
    assert params["remote_num_tokens"] == n and len(params["remote_block_ids"]) == math.ceil(n / BLOCK)
    assert got == want


@pytest.mark.parametrize("n", LENGTHS)
def test_push_decodes_token_for_token_like_one_engine(pd, n):
    ids = prompt(n, seed=1000 + n)
    want = reference(pd, ids)
    assert pd.router.push(ids, MAX_TOKENS, unique("push")) == want


def test_prefix_cached_on_d_moves_only_the_tail(pd):
    """Two requests share 64 tokens (two blocks): the second moves only the blocks after them."""
    shared = prompt(2 * BLOCK, seed=77)
    a, b = shared + prompt(40, seed=78), shared + prompt(30, seed=79)
    want_a, want_b = reference(pd, a), reference(pd, b)
    # P's sidecar counts the bytes of every transfer it serves (push and pull).
    moved = lambda: pd.p_sc.status()["bytesMoved"]  # noqa: E731
    before = moved()
    got_a, _ = pd.router.pull(a, MAX_TOKENS, unique("pre"))
    mid = moved()
    got_b, _ = pd.router.pull(b, MAX_TOKENS, unique("pre"))
    after = moved()
    assert (got_a, got_b) == (want_a, want_b)
    per_block = (mid - before) / math.ceil(len(a) / BLOCK)  # vLLM CPU blocks move whole
    assert per_block > 0
    assert after - mid == per_block * (math.ceil(len(b) / BLOCK) - 2)


def kv_blocks_in_use(server: VllmServer) -> float:
    return server.metric("vllm:kv_cache_usage_perc")


def test_p_sidecar_killed_d_recomputes_and_no_block_stays_held(pd):
    """kill -9 of P's sidecar after P's prefill: D cannot reach it, fails the load, and vLLM
    recomputes the prompt (kv_load_failure_policy=recompute) with the same tokens; P's connector
    frees the blocks its dead sidecar held. Then P's sidecar comes back and P/D works again."""
    ids = prompt(90, seed=4242)
    want = reference(pd, ids)
    pr = pd.p.complete(ids, 1, {"do_remote_decode": True, "transfer_id": unique("dead")})
    params = pr["kv_transfer_params"]
    pd.p_sc.kill()
    got = output_ids(pd.d.complete(ids, MAX_TOKENS, params))
    assert got == want
    # No block held: KV usage back to zero on both engines (bounded by the connector's 2 s bound).
    wait_for(lambda: kv_blocks_in_use(pd.p) == 0 and kv_blocks_in_use(pd.d) == 0, 60,
             "KV cache usage back to 0 on P and D", interval=0.5)
    # A sidecar restarted on the same socket: P's connector registers again; pull works again.
    pd.p_sc = SidecarProc(pd.p_sc.engine_id, "prefill", pd.p_sc.socket, pd.work)
    pd.router = PdRouter(pd.p, pd.d, pd.p_sc.side_channel)
    wait_for(lambda: pd.p_sc.status()["layoutSummary"] != "not registered", 30, "P to register again")
    ids2 = prompt(50, seed=4243)
    got2, _ = pd.router.pull(ids2, MAX_TOKENS, unique("back"))
    assert got2 == reference(pd, ids2)
