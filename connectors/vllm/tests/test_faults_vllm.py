"""Issue 35's faults with two real vLLM engines (CPU build) and their sidecars: a sidecar that stays
down, P's request aborted in push mode, and a request sent straight to D with another request's
``kv_transfer_params``. For each: what the client gets (token for token what one engine alone
answers), how long it takes, the blocks held on both engines afterwards (vLLM's own
``kv_cache_usage_perc``), and what the connector counted in vLLM's ``/metrics``.

One deployment for the module (about a minute and a half to start on two cores).
"""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import requests
from conftest import Deployment, pd_deployment, prompt, unique, wait_for

from kvxfer_vllm_testing.harness import PdRouter, SidecarProc, output_ids

BLOCK = 32
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with pd_deployment(tmp_path_factory.mktemp("faults"), BLOCK, {}) as dep:
        yield dep


def reference(pd: Deployment, ids: list[int]) -> list[int]:
    return output_ids(pd.p.complete(ids, MAX_TOKENS))


def usage(server) -> float:
    return server.metric("vllm:kv_cache_usage_perc")


def moved(pd: Deployment) -> int:
    return int(pd.p_sc.status()["bytesMoved"])


def test_a_request_with_another_prompts_params_is_refused_by_name(pd):
    """Another request's params (right token) sent straight to D with a different prompt: D sees
    the digest does not match its prompt and computes it itself; nothing is read from P. The real
    request then loads its KV as if nothing happened, and no block stays held."""
    a, b = prompt(70, seed=3501), prompt(70, seed=3502)
    want_a, want_b = reference(pd, a), reference(pd, b)
    params = pd.p.complete(a, 1, {"do_remote_decode": True})["kv_transfer_params"]
    assert len(params["kvxfer_prompt_digest"]) == 32
    before = moved(pd)
    mismatches = pd.d.metric("vllm:kvxfer_prompt_mismatches_total")
    assert output_ids(pd.d.complete(b, MAX_TOKENS, params)) == want_b
    wait_for(lambda: pd.d.metric("vllm:kvxfer_prompt_mismatches_total") == mismatches + 1, 10,
             "the mismatch counted in D's /metrics")
    assert moved(pd) == before  # the forgery read nothing
    assert output_ids(pd.d.complete(a, MAX_TOKENS, params)) == want_a
    assert moved(pd) > before  # the real request loaded P's KV
    wait_for(lambda: usage(pd.p) == 0 and usage(pd.d) == 0, 30, "no block held on P or D", interval=0.5)
    assert pd.d.metric("vllm:kvxfer_transfers_total") >= 1


def test_p_aborted_during_a_push_d_recomputes_at_once(pd):
    """Push: D registers its blocks while P computes; P's client reads the first token and hangs
    up, so P aborts the request while it is still generating. P's connector gives the transfer
    up, its sidecar fails D's registration, and D computes the prompt at once instead of after
    its 60 s transfer timeout; nothing is moved and no block stays held."""
    ids = prompt(90, seed=3503)
    want = reference(pd, ids)
    tid, token = unique("abort"), secrets.token_hex(16)
    host, port = pd.p_sc.side_channel.rsplit(":", 1)
    out: dict = {}

    def decode() -> None:
        out["d"] = pd.d.complete(ids, MAX_TOKENS, {"do_remote_prefill": True, "remote_host": host,
                                                   "remote_port": int(port), "transfer_id": tid, "kvxfer_token": token})
        out["t"] = time.monotonic()

    th = threading.Thread(target=decode, daemon=True)
    th.start()
    time.sleep(1.0)  # D's registration reaches P's sidecar
    before = moved(pd)
    # P streams; its client reads the first token and hangs up, so P aborts the request while it is
    # still generating (900 tokens: a fixed read timeout was outrun by a fast machine finishing 400).
    body = {"model": pd.p.spec.model, "prompt": ids, "max_tokens": 900, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid, "kvxfer_token": token}}
    with requests.post(f"{pd.p.url}/v1/completions", json=body, stream=True, timeout=30) as r:
        assert r.status_code == 200, r.text[:500]
        first = next(line for line in r.iter_lines() if line.startswith(b"data:"))
        assert first != b"data: [DONE]", "P finished before its client hung up"
        t0 = time.monotonic()
    # leaving the block closed the connection: P's client is gone
    th.join(60)
    assert "d" in out, "D did not answer"
    took = out["t"] - t0
    assert output_ids(out["d"]) == want
    assert took < 20, f"D answered {took:.1f} s after P's client left (transfer timeout 60 s)"
    assert moved(pd) == before, "P's sidecar moved KV for a request P aborted"
    wait_for(lambda: usage(pd.p) == 0 and usage(pd.d) == 0, 30, "no block held on P or D", interval=0.5)
    print(f"\npush, P aborted: D answered {took:.1f} s after P's client left; held afterwards: P 0, D 0")


def test_a_sidecar_that_stays_down_costs_a_recompute_not_a_hang(pd):
    """D's sidecar dies and stays down past ``sidecar_lost_timeout_s`` (2 s here): every request
    sent to D afterwards, pull and push, is computed by D at once and correct; D holds no block.
    P's sidecar then dies too: P's requests free their blocks at once. Both come back and P/D
    moves KV again."""
    d_sc = pd.d_sc
    d_sc.kill()
    time.sleep(3)  # past the bound
    router = PdRouter(pd.p, pd.d, pd.p_sc.side_channel)
    times = []
    for i in range(4):
        ids = prompt(60 + i, seed=3510 + i)
        want = reference(pd, ids)
        t0 = time.monotonic()
        got = router.pull(ids, MAX_TOKENS, unique("down"))[0] if i % 2 == 0 else router.push(ids, MAX_TOKENS, unique("down"))
        times.append(time.monotonic() - t0)
        assert got == want
    assert max(times) < 20, times
    wait_for(lambda: usage(pd.d) == 0, 10, "no block held on D", interval=0.5)
    assert pd.d.metric("vllm:kvxfer_link_down_requests_total") >= 4
    # P's sidecar down too: a prefill for D is answered and its blocks are P's again at once.
    pd.p_sc.kill()
    time.sleep(3)
    pd.p.complete(prompt(80, seed=3520), 1, {"do_remote_decode": True})
    wait_for(lambda: usage(pd.p) == 0, 5, "P's blocks back at once", interval=0.25)
    print(f"\nsidecars down: requests answered in {', '.join(f'{t:.1f}' for t in times)} s; held afterwards: P 0, D 0")
    # Both come back: the connectors register again and P/D moves KV again.
    # P's sidecar on its old side channel: P's engine advertises the address it learned at start.
    pd.p_sc = SidecarProc(pd.p_sc.engine_id, "prefill", pd.p_sc.socket, pd.work, "--listen", pd.p_sc.side_channel)
    pd.d_sc = SidecarProc(d_sc.engine_id, "decode", d_sc.socket, pd.work)
    for sc in (pd.p_sc, pd.d_sc):
        wait_for(lambda sc=sc: sc.status()["layoutSummary"] != "not registered", 30, "the engines to register again")
    pd.router = PdRouter(pd.p, pd.d, pd.p_sc.side_channel)
    ids = prompt(50, seed=3530)
    before = moved(pd)
    assert pd.router.pull(ids, MAX_TOKENS, unique("back"))[0] == reference(pd, ids)
    assert moved(pd) > before


def test_an_engine_killed_leaves_nothing_in_dev_shm(pd):
    """SIGKILL to D's engine, as the bench's fault rows do: its processes cannot remove vLLM's
    multiprocessing files in /dev/shm (the executor's message queues, 160-240 MiB each, and its
    semaphores), so the harness does. Last in the module: the deployment goes after it."""
    files = {f for f in pd.d.note_mp_shm() if f.exists()}
    for kind in ("psm_", "sem.mp-"):
        assert any(f.name.startswith(kind) for f in files), f"no {kind}* in /dev/shm mapped by D's engine: {files}"
    pd.d.kill()
    assert not pd.d.alive()
    left = sorted(str(f) for f in files if f.exists())
    assert not left, f"left in /dev/shm by the killed engine: {left}"
