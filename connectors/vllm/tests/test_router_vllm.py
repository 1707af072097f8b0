"""vLLM's own router (``vllm-router`` from PyPI) in front of real vLLM engines, two prefill and two
decode (2P2D, CPU build, a model made here), each engine with its kvxfer sidecar. The router is
unchanged and configured as its documentation says, in both of its P/D modes that kvxfer serves:

- ``--kv-connector nixl``: P first (``max_tokens=1``), then D with P's ``kv_transfer_params``
  relayed as they are: kvxfer pulls;
- ``--kv-connector mooncake``: P and D at once; the router learnt P's engine id at start-up from the
  P sidecar's ``--bootstrap`` and gives D a transfer id and P's bootstrap URL: kvxfer pushes.

Greedy output through the router equals one engine's alone, for several prompt lengths, with every
P and every D used; the router's per-worker request counts and the sidecars' transfer counts agree.
The fixture stops every process and checks nothing is left (processes, sockets, KV files).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import stop_deployment, unique

from kvxfer_vllm_testing.harness import EngineSpec, SidecarProc, VllmRouter, VllmServer, metric, output_ids
from kvxfer_vllm_testing.tiny_model import make_tiny_model

BLOCK = 32
MAX_TOKENS = 12
LENGTHS = [20, BLOCK, 70, 150]  # shorter than a block, exactly one, several with a partial last


@dataclass
class Cluster:
    ps: list[VllmServer]
    ds: list[VllmServer]
    p_scs: list[SidecarProc]
    d_scs: list[SidecarProc]
    routers: dict[str, VllmRouter]


def prompt(n: int, seed: int) -> list[int]:
    return [5 + (i * 6151 + seed * 7919) % 480 for i in range(n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("router")
    model = make_tiny_model(str(work / "model"))
    shm = Path("/dev/shm") / unique("kvxfer-router")
    shm.mkdir()
    sidecars: list[SidecarProc] = []
    front: list = []  # routers first, then engines: stopped in this order, before the sidecars
    try:
        def sidecar(role: str, *flags: str) -> SidecarProc:
            sc = SidecarProc(unique(role[0]), role, f"ipc:///tmp/{unique('kvxfer-router')}.sock", work, *flags)
            sidecars.append(sc)
            return sc

        p_scs = [sidecar("prefill", "--bootstrap", "127.0.0.1:0") for _ in range(2)]
        d_scs = [sidecar("decode", "--metrics", "127.0.0.1:0") for _ in range(2)]
        extra = {"sidecar_lost_timeout_s": 2.0, "register_timeout_s": 300.0}

        def engine(sc: SidecarProc, cores: str) -> VllmServer:
            e = VllmServer(EngineSpec(model, sc.engine_id, sc.socket, str(shm), block_size=BLOCK, cores=cores,
                                      extra=extra), work)
            front.append(e)
            return e

        ps = [engine(sc, str(i % 2)) for i, sc in enumerate(p_scs)]
        ds = [engine(sc, str(i % 2)) for i, sc in enumerate(d_scs)]
        for e in ps + ds:
            e.wait_ready()
        boot = [int(sc.ready["bootstrap"].rsplit(":", 1)[1]) for sc in p_scs]
        routers = {
            "nixl": VllmRouter([(p, None) for p in ps], ds, work, connector="nixl"),
            "mooncake": VllmRouter(list(zip(ps, boot)), ds, work, connector="mooncake"),
        }
        front[:0] = routers.values()
        for r in routers.values():
            r.wait_ready()
        yield Cluster(ps, ds, p_scs, d_scs, routers)
    finally:
        stop_deployment(front, sidecars, shm)


def counts(c: Cluster, router: VllmRouter) -> dict[str, float]:
    """Per engine: what the router sent it, and what its sidecar did."""
    out: dict[str, float] = {}
    for e, sc in zip(c.ps, c.p_scs):
        out[f"router→{e.spec.engine_id}"] = router.metric("vllm_router_pd_prefill_requests_total", worker=e.url)
        out[f"kvxfer {e.spec.engine_id} served"] = float(sc.status()["transfersMoved"])
    for e, sc in zip(c.ds, c.d_scs):
        out[f"router→{e.spec.engine_id}"] = router.metric("vllm_router_pd_decode_requests_total", worker=e.url)
        out[f"kvxfer {e.spec.engine_id} ready"] = metric(f"http://{sc.ready['metrics']}/metrics",
                                                          "kvxfer_transfers_ready_total")
    return out


@pytest.mark.parametrize("mode, kvxfer_mode", [("nixl", "pull"), ("mooncake", "push")])
def test_requests_through_vllm_router_decode_like_one_engine_and_counts_agree(cluster, mode, kvxfer_mode):
    router = cluster.routers[mode]
    before = counts(cluster, router)
    for i, n in enumerate(LENGTHS):
        ids = prompt(n, seed=100 * i + len(mode))
        want = output_ids(cluster.ps[0].complete(ids, MAX_TOKENS))  # one engine alone
        assert output_ids(router.complete(ids, MAX_TOKENS)) == want, f"{mode}: {n} tokens"
    after = counts(cluster, router)
    delta = {k: after[k] - before[k] for k in after}
    # Round robin: every P and every D served half of the requests, and each request was one
    # transfer on its P's sidecar and one KV_READY on its D's.
    half = len(LENGTHS) / 2
    for e in cluster.ps:
        assert delta[f"router→{e.spec.engine_id}"] == half, delta
        assert delta[f"kvxfer {e.spec.engine_id} served"] == half, delta
    for e in cluster.ds:
        assert delta[f"router→{e.spec.engine_id}"] == half, delta
        assert delta[f"kvxfer {e.spec.engine_id} ready"] == half, delta
    # The mode each transfer took is the one this router's flow gives.
    for sc in cluster.d_scs:
        ready = metric(f"http://{sc.ready['metrics']}/metrics", "kvxfer_transfers_ready_total", mode=kvxfer_mode)
        assert ready >= half, (sc.engine_id, kvxfer_mode, ready)
