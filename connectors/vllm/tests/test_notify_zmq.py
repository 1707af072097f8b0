"""``kvxfer sidecar --notify-zmq``: D's sidecar tells a production-stack router "KV ready" the way
that router's ZmqProxy expects it: a PUSH message it decodes with msgspec as a ``NixlMsg`` struct
(``req_id: str``, production-stack's own fallback definition, re-declared here). Real sidecars move
real KV; the router's PULL socket is pyzmq's."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import msgspec
import pytest
import zmq
from conftest import unique, wait_for
from test_client import pair

from kvxfer_vllm.client import Event, SidecarClient
from kvxfer_vllm_testing.harness import free_port
from kvxfer_vllm.messages import AbortMsg, StepMessages


class NixlMsg(msgspec.Struct):
    """production-stack's src/vllm_router/services/request_service/zmq_proxy.py, without LMCache."""

    req_id: str


async def await_end(grpc_address: str, tid: str) -> Event:
    async with SidecarClient(grpc_address) as c:
        return await c.await_kv(tid, 20)


def metric(port: int, result: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(f'kvxfer_notify_zmq_total{{result="{result}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_one_message_per_ready_transfer_decoded_by_msgspec_none_for_failed_and_router_down(sidecars, shm_dir):
    ctx = zmq.Context()
    router = ctx.socket(zmq.PULL)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    metrics_port = free_port()
    flags = ("--notify-zmq", f"tcp://127.0.0.1:{port}", "--metrics", f"127.0.0.1:{metrics_port}")
    try:
        with pair(sidecars, shm_dir, flags) as pr:
            def receive(timeout: float) -> list[NixlMsg]:
                out, end = [], time.monotonic() + timeout
                while time.monotonic() < end:
                    if router.poll(50):
                        out.append(msgspec.msgpack.decode(router.recv(), type=NixlMsg))
                return out

            # ZeroMQ connects in the background: the first transfer may find no router yet.
            wait_for(lambda: metric(metrics_port, "sent") + metric(metrics_port, "dropped_no_router") >= 0, 5,
                     "D's metrics")
            time.sleep(0.5)
            ids = [unique("z") for _ in range(3)]
            for tid in ids:
                pr.expect(tid)
                pr.prefill_done(tid)
                wait_for(lambda tid=tid: pr.finished(tid), 20, f"transfer {tid}")
            got = receive(2.0)
            assert [m.req_id for m in got] == ids
            # A transfer D's engine aborts (it fails): no message.
            bad = unique("z-aborted")
            pr.expect(bad)
            pr.dw.on_step(StepMessages(abort=[AbortMsg(f"d-{bad}", bad)]))
            ev = asyncio.run(await_end(pr.d_sc.grpc, bad))
            assert ev.kind == "ABORTED"
            assert receive(1.0) == []
            assert metric(metrics_port, "sent") == 3
            # The router goes away: the next ready transfer costs a counted drop, and still completes.
            router.close(linger=0)
            time.sleep(0.5)
            late = unique("z-late")
            t0 = time.monotonic()
            pr.expect(late)
            pr.prefill_done(late)
            wait_for(lambda: pr.finished(late), 20, "the transfer with the router down")
            assert time.monotonic() - t0 < 20
            wait_for(lambda: metric(metrics_port, "dropped_no_router") == 1, 10, "the counted drop")
            assert metric(metrics_port, "sent") == 3
    finally:
        router.close(linger=0)
        ctx.term()


def test_a_prefill_only_sidecar_refuses_the_flag(sidecars):
    with pytest.raises(RuntimeError, match="--notify-zmq announces KV_READY, which only a decode side has"):
        sidecars("prefill", "--notify-zmq", "tcp://127.0.0.1:7500")
