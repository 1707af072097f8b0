"""D finds P's sidecar from a router's bootstrap URL (vllm-router's mooncake mode): against a real
P sidecar's ``--bootstrap``, then each way it can go wrong, named, bounded and not repeated per
request; and P leaves a router-named transfer without a token so that D, told at the same time,
can register for it."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvxfer_vllm.bootstrap import MAX_ANSWER_BYTES, BootstrapResolver, _get, fill_source
from kvxfer_vllm.params import BadParams
from kvxfer_vllm.scheduler import SchedulerLogic


def mooncake_params(base: str, engine_id: str) -> dict:
    """What vllm-router --kv-connector mooncake sends D (observed from vllm-router 0.1.17)."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "xfer-1",
            "remote_bootstrap_addr": base, "remote_engine_id": engine_id}


def test_d_registers_with_the_side_channel_a_real_p_sidecar_serves(sidecars):
    p = sidecars("prefill", "--bootstrap", "127.0.0.1:0")
    base = f"http://{p.ready['bootstrap']}"
    s = SchedulerLogic(engine_id="d", tp_size=1)
    params = mooncake_params(base, p.engine_id)
    assert s.num_new_matched_tokens("r1", params, 70, 0) == (70, True)
    s.after_alloc("r1", params, [3, 4, 5], 70, 70)
    [m] = s.build_step().expect
    # Push: D's blocks, P's side channel, no source blocks (P writes when its prefill is done).
    assert (m.transfer_id, m.source, m.source_block_ids, m.block_ids, m.token) == (
        "xfer-1", p.side_channel, None, [3, 4, 5], "")


class Fetches:
    def __init__(self, answer: bytes | Exception) -> None:
        self.answer, self.urls = answer, []

    def __call__(self, url: str, timeout_s: float) -> bytes:
        assert 0 < timeout_s <= 2.0
        self.urls.append(url)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def answer(engine_id: str = "p-1", addr: object = "10.0.0.5:7100") -> bytes:
    return json.dumps({"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": addr}}}}).encode()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_answers_are_kept_for_the_ttl_then_asked_again():
    fetch, clock = Fetches(answer()), Clock()
    r = BootstrapResolver(fetch=fetch, clock=clock, ttl_s=5.0)
    for _ in range(3):
        params = mooncake_params("http://p:8998/", "p-1")
        fill_source(params, r)
        assert (params["remote_host"], params["remote_port"]) == ("10.0.0.5", 7100)
    assert fetch.urls == ["http://p:8998/query"]
    clock.t += 5.1
    fill_source(mooncake_params("http://p:8998/", "p-1"), r)
    assert len(fetch.urls) == 2


def test_an_unreachable_bootstrap_is_named_and_asked_again_only_after_the_retry_wait():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    urls: list[str] = []

    def fetch(url: str, timeout_s: float) -> bytes:
        """The real GET the first time (refused); an answer after that, if it is asked again."""
        urls.append(url)
        return _get(url, timeout_s) if len(urls) == 1 else answer()

    clock = Clock()
    r = BootstrapResolver(clock=clock, retry_s=1.0, fetch=fetch)
    with pytest.raises(BadParams) as e:
        r.side_channel(f"http://127.0.0.1:{port}", "p-1")
    assert e.value.field == "remote_bootstrap_addr" and f"127.0.0.1:{port}/query" in str(e.value)
    assert "Connection refused" in str(e.value)
    with pytest.raises(BadParams):  # within the retry wait: not asked again
        r.side_channel(f"http://127.0.0.1:{port}", "p-1")
    assert len(urls) == 1
    clock.t += 1.1
    assert r.side_channel(f"http://127.0.0.1:{port}", "p-1") == "10.0.0.5:7100"
    assert len(urls) == 2


@pytest.mark.parametrize("body, field, words", [
    (answer(engine_id="p-2"), "remote_engine_id", "'p-1' is not served by http://p:1 (it serves ['p-2'])"),
    (answer(addr=None), "remote_bootstrap_addr", "without a side channel"),
    (answer(addr="nocolon"), "remote_bootstrap_addr", "without a side channel"),
    (json.dumps({"0": {"engine_id": "p-1"}}).encode(), "remote_bootstrap_addr", "without a side channel"),
    (b"not json", "remote_bootstrap_addr", "http://p:1/query: Expecting value"),
    (b"[1, 2]", "remote_bootstrap_addr", "expected a JSON object, got list"),
])
def test_a_bad_answer_is_refused_naming_what_is_wrong(body, field, words):
    with pytest.raises(BadParams) as e:
        BootstrapResolver(fetch=Fetches(body)).side_channel("http://p:1", "p-1")
    assert e.value.field == field and words in str(e.value)


@pytest.mark.parametrize("base", ["file:///etc/passwd", "p:8998", "http://p:1/elsewhere", "http://:1"])
def test_only_an_http_url_of_a_host_is_asked(base):
    fetch = Fetches(answer())
    with pytest.raises(BadParams, match="must be an http"):
        BootstrapResolver(fetch=fetch).side_channel(base, "p-1")
    assert fetch.urls == []


def test_an_oversized_answer_is_refused():
    class Big(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b" " * (MAX_ANSWER_BYTES + 10))

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Big)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(BadParams, match=f"answer longer than {MAX_ANSWER_BYTES} bytes"):
            BootstrapResolver().side_channel(f"http://127.0.0.1:{srv.server_port}", "p-1")
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


@pytest.mark.parametrize("params, field", [
    ({"remote_bootstrap_addr": 7, "remote_engine_id": "p-1"}, "remote_bootstrap_addr"),
    ({"remote_bootstrap_addr": "http://p:1", "remote_engine_id": None}, "remote_engine_id"),
])
def test_params_that_cannot_name_a_bootstrap_are_refused_and_the_request_computes_locally(params, field):
    fetch = Fetches(answer())
    with pytest.raises(BadParams) as e:
        fill_source({"do_remote_prefill": True, **params}, BootstrapResolver(fetch=fetch))
    assert e.value.field == field and fetch.urls == []
    s = SchedulerLogic(engine_id="d", tp_size=1, resolver=BootstrapResolver(fetch=fetch))
    assert s.num_new_matched_tokens("r", {"do_remote_prefill": True, **params}, 10, 0) == (0, False)


def test_params_naming_ps_sidecar_are_left_as_they_are():
    fetch = Fetches(answer())
    params = {"remote_host": "h", "remote_port": 9, "remote_bootstrap_addr": "http://p:1", "remote_engine_id": "p-1"}
    fill_source(params, BootstrapResolver(fetch=fetch))
    assert (params["remote_host"], params["remote_port"], fetch.urls) == ("h", 9, [])


def test_p_leaves_a_router_named_transfer_without_a_token_and_makes_one_otherwise():
    s = SchedulerLogic(engine_id="p", tp_size=1, advertise="127.0.0.1:7000")
    # vllm-router's mooncake mode: transfer_id, no token (D was told the same id, not a token).
    _, named = s.request_finished("r1", {"do_remote_decode": True, "transfer_id": "xfer-1"},
                                  finished_ok=True, block_ids=[1], num_computed_tokens=5)
    # A router's own token wins; with neither, P names the transfer and makes a token.
    _, given = s.request_finished("r2", {"do_remote_decode": True, "transfer_id": "x2", "kvxfer_token": "tok"},
                                  finished_ok=True, block_ids=[2], num_computed_tokens=5)
    _, own = s.request_finished("r3-0-1a2b3c4d", {"do_remote_decode": True},
                                finished_ok=True, block_ids=[3], num_computed_tokens=5)
    assert (named["kvxfer_token"], given["kvxfer_token"]) == ("", "tok")
    assert own["transfer_id"] == "r3-0" and len(own["kvxfer_token"]) == 32
    assert [m.token for m in s.build_step().prefill_done] == ["", "tok", own["kvxfer_token"]]
