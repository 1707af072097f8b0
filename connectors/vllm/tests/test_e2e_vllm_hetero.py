"""P with block 32, D with block 64: two real vLLM CPU engines whose blocks differ in size.

vLLM's CPU attention keeps K column-major inside a (block, head), so a P block is not a slice of
a D block's bytes; the layouts carry that order (run orders) and the planner cuts each head's K
by columns. The KV must actually move (P's sidecar counts the bytes, D counts the prompt as
external hits) and D's tokens must equal those of one engine alone, in pull and in push.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import Deployment, prompt, stop_deployment, unique

from kvxfer_vllm.layout import CPU_RUN_ORDERS
from kvxfer_vllm_testing.harness import EngineSpec, PdRouter, SidecarProc, VllmServer, metric, output_ids
from kvxfer_vllm_testing.tiny_model import TinyModelSpec, make_tiny_model

P_BLOCK, D_BLOCK = 32, 64
MAX_TOKENS = 16
SPEC = TinyModelSpec()
#: KV bytes of one token on one rank: layers x (K, V) x KV heads x head size x bf16.
TOKEN_BYTES = SPEC.layers * 2 * SPEC.kv_heads * SPEC.head_dim * 2


def token_unit(block_size: int) -> int:
    """Tokens the planner moves at a time between these engines: the least common multiple of
    the K and V token tiles of the CPU attention kernel vLLM picks here for ``block_size``.
    The ISA is the CPU's ("amx" keeps K in tiles of 16 tokens, so a partial block moves whole
    tiles; "vec" is column-major, one token at a time), so it is asked of vLLM, not assumed."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.bfloat16, block_size, SPEC.head_dim)
    return math.lcm(*(tile for _, tile in CPU_RUN_ORDERS[isa]))


def moved_tokens(n: int) -> int:
    """Prompt tokens whose KV crosses: every token, rounded up to the kernel's token unit."""
    unit = math.lcm(token_unit(P_BLOCK), token_unit(D_BLOCK))
    return math.ceil(n / unit) * unit


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    work: Path = tmp_path_factory.mktemp("hetero")
    model = make_tiny_model(str(work / "model"))
    shm = Path("/dev/shm") / unique("kvxfer-hetero")
    shm.mkdir()
    p_sc = SidecarProc(unique("p"), "prefill", f"ipc:///tmp/{unique('kvxfer-hetero')}.sock", work)
    d_sc = SidecarProc(unique("d"), "decode", f"ipc:///tmp/{unique('kvxfer-hetero')}.sock", work)
    extra = {"sidecar_lost_timeout_s": 2.0, "register_timeout_s": 300.0}
    p = VllmServer(EngineSpec(model, p_sc.engine_id, p_sc.socket, str(shm), block_size=P_BLOCK, cores="0",
                              extra=extra), work)
    d = VllmServer(EngineSpec(model, d_sc.engine_id, d_sc.socket, str(shm), block_size=D_BLOCK, cores="1",
                              extra=extra), work)
    try:
        p.wait_ready()
        d.wait_ready()
        yield Deployment(p, d, p_sc, d_sc, PdRouter(p, d, p_sc.side_channel), work, shm)
    finally:
        stop_deployment([p, d], [p_sc, d_sc], shm)


def external_hits(pd: Deployment) -> float:
    return metric(f"{pd.d.url}/metrics", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


LENGTHS = [20, P_BLOCK, D_BLOCK + 6, 200]  # within one P block, one, a partial D block, several


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("n", LENGTHS)
def test_block_32_to_64_moves_kv_and_decodes_like_one_engine(pd, n, mode):
    ids = prompt(n, seed=3 * n + (mode == "push"))
    # One engine alone (P, block 32; D's own answer would hit the KV this test moves to it).
    want = output_ids(pd.p.complete(ids, MAX_TOKENS))
    moved, hits = pd.p_sc.status()["bytesMoved"], external_hits(pd)
    if mode == "pull":
        got, params = pd.router.pull(ids, MAX_TOKENS, unique("hetero"))
        assert len(params["remote_block_ids"]) == math.ceil(n / P_BLOCK)
    else:
        got = pd.router.push(ids, MAX_TOKENS, unique("hetero"))
    assert got == want
    # D took every prompt token as an external hit, and each came over the wire, nothing more than
    # the kernel's token tiles round up to.
    assert external_hits(pd) - hits == n
    assert pd.p_sc.status()["bytesMoved"] - moved == moved_tokens(n) * TOKEN_BYTES


def test_one_engine_answers_alike_with_block_32_and_64(pd):
    """The reference holds for either block size: alone, P (32) and D (64) decode the same tokens."""
    for n in LENGTHS:
        ids = prompt(n, seed=5000 + n)
        assert output_ids(pd.d.complete(ids, MAX_TOKENS)) == output_ids(pd.p.complete(ids, MAX_TOKENS))
