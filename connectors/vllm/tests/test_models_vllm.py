"""Every model family through a real P/D pair, in pull and push, with vLLM's hybrid KV cache
manager on (the connector supports it): tiny random-weight models of each family made offline
(``tiny_model.FAMILIES``), one engine alone as the reference, then P and D with their sidecars.

For each family and mode:
- D's output is token-identical to the engine alone; for MLA (DeepSeek-V2 on vLLM-CPU's
  ``CPU_MLA``) the documented difference instead, asserted exactly: every full block of P's KV
  arrives byte-identical, but D's recompute of the prompt's last token writes another rope part
  than P computed (its latent is the same), so D's tokens are not the engine's alone;
- D counts the prompt's tokens as external (``vllm:prompt_tokens_by_source_total``): all of
  them, or all but the last where the family's protocol leaves it to D (state groups);
- the bytes P's sidecar moved are exactly the window arithmetic's: every block of a full group,
  only the held tail of a sliding window (at most its last cdiv(window, block) + 1 blocks), one
  state slot per state layer;
- the KV capacity each engine logs at start-up equals the engine alone's.

``npm test`` runs the families in ``KVXFER_MODEL_FAMILIES`` (default: Gemma 3, sliding and
full groups, and Mamba-2, a state group: the cheapest of the hybrid kinds); ``npm run test:models`` runs them all. Each family's engines start once (about a
minute on two cores) and are stopped at the end, leaving nothing behind.
"""

from __future__ import annotations

import glob
import math
import re
import os
from dataclasses import dataclass

import pytest
from conftest import pd_deployment, prompt, stop_deployment, unique

from kvxfer_vllm_testing.harness import EngineSpec, VllmServer, metric, output_ids
from kvxfer_vllm_testing.tiny_model import TinyModelSpec, make_tiny_model

MAX_TOKENS = 8
LAYERS = 4
WINDOW = 64
ALL = ("qwen3", "mistral-sw", "gemma3", "qwen3-next", "deepseek-v2", "mixtral", "gpt-oss", "mamba2")
FAMILIES = tuple(f for f in os.environ.get("KVXFER_MODEL_FAMILIES", "gemma3,mamba2").split(",") if f)
assert set(FAMILIES) <= set(ALL), FAMILIES


@dataclass(frozen=True)
class Shape:
    """What moves for a family: per layer kind, and how vLLM sizes its blocks."""

    full: int = 0  # full-attention layers
    sliding: int = 0  # sliding-window layers
    state: int = 0  # linear-attention (state) layers
    mla: int = 0  # MLA layers
    block: int = 32  # vLLM's block size for the attention layers
    state_bytes: int = 0  # one state slot, per layer
    backoff: int = 0  # prompt tokens D computes itself
    lengths: tuple[int, ...] = (20, 70, 200)  # inside one block, past the window, far past it
    max_model_len: int = 1024
    #: Bytes of one token of one attention layer: 2 KV heads x head dims x K and V x bfloat16.
    token_bytes: int = 2 * 32 * 2 * 2


def _ssm_state_bytes() -> int:
    """Bytes of one element of a recurrent (SSM) state as vLLM-CPU stores it on this machine: it
    forces float32 where the CPU has AVX-512 BF16 (its accelerated state kernels,
    ``vllm/platforms/cpu.py``), else the state keeps the model's bfloat16."""
    import torch

    return 4 if torch.cpu._is_avx512_bf16_supported() else 2


SSM = _ssm_state_bytes()
#: GDN's state per layer: conv bfloat16[3, 1024] + recurrent [4, 128, 128] (see _ssm_state_bytes).
GDN_STATE = 3 * 1024 * 2 + 4 * 128 * 128 * SSM
#: vLLM raises the attention block to the state page, in multiples of 32 tokens (256 bytes a
#: token of the one full layer): 1056 tokens with a float32 state, 544 with bfloat16.
GDN_BLOCK = math.ceil(GDN_STATE / 256 / 32) * 32

SHAPES = {
    "qwen3": Shape(full=4),
    "mixtral": Shape(full=4),
    "mistral-sw": Shape(sliding=4),
    "gemma3": Shape(sliding=3, full=1),
    # One block plus one token last: D computes the token past a whole block alone.
    "qwen3-next": Shape(state=3, full=1, block=GDN_BLOCK, state_bytes=GDN_STATE, backoff=1,
                        lengths=(20, 200, GDN_BLOCK + 1), max_model_len=2048),
    # The block is the MLA backend's (mla_backend): 16 on CPU_MLA, the engine's 32 on AMX_MLA.
    "deepseek-v2": Shape(mla=4),
    "gpt-oss": Shape(sliding=2, full=2, token_bytes=2 * 64 * 2 * 2),
    # Mamba-2's state: conv bfloat16[3, 256 + 2 x 16] + recurrent [8, 32, 16] (see _ssm_state_bytes).
    "mamba2": Shape(state=4, state_bytes=3 * 288 * 2 + 8 * 32 * 16 * SSM, backoff=1, lengths=(20, 200)),
}
#: MLA: a 576-element latent (512 + 64 rope) of bfloat16 per token.
LATENT = 576 * 2


def expected_bytes(shape: Shape, n: int) -> int:
    """What P's sidecar moves for a prompt of ``n`` tokens (D holds none of it)."""
    moved = n - shape.backoff
    b = shape.block
    blocks = math.ceil(moved / b)
    # CPU attention moves whole blocks (the last block's tail goes along).
    total = shape.full * blocks * b * shape.token_bytes
    if shape.sliding:
        # The tail both sides hold: vLLM keeps the blocks of the last window - 1 tokens, kvxfer
        # names at most the last cdiv(window, block) + 1 of them.
        first = max(blocks - (math.ceil(WINDOW / b) + 1), max(0, moved - WINDOW + 1) // b)
        total += shape.sliding * (blocks - first) * b * shape.token_bytes
    total += shape.mla * moved * LATENT  # MLA rows move token by token
    total += shape.state * shape.state_bytes
    return total




@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """One family's engines, started once for its tests: the reference engine alone (its outputs
    and KV capacity taken, then stopped), then the P/D pair."""
    yield from _family(request.param, tmp_path_factory)


def _family(name: str, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"models-{name}")
    model = make_tiny_model(str(work / "model"), TinyModelSpec(family=name, layers=LAYERS, window=WINDOW))
    shape = SHAPES[name]
    prompts = {(mode, n): prompt(n, seed=(7 if mode == "pull" else 11) * 1000 + n)
               for mode in ("pull", "push") for n in shape.lengths}
    # The reference: one engine alone, no connector, the same cache size and block size.
    one = VllmServer(EngineSpec(model, unique("one"), "", "", block_size=32, cores="0", connector=False,
                                max_model_len=shape.max_model_len), work)
    (work / "one-shm").mkdir()
    try:
        one.wait_ready()
        want = {k: output_ids(one.complete(ids, MAX_TOKENS)) for k, ids in prompts.items()}
        # State groups: what D computes, one engine computing the prompt's last token alone after
        # the rest hit its prefix cache (possible where the rest is whole blocks).
        for (mode, n), ids in prompts.items():
            if shape.backoff and (n - 1) % shape.block == 0:
                one.complete(ids[:-1], 1)
                want[(mode, n, "last-alone")] = output_ids(one.complete(ids, MAX_TOKENS))
        capacity = one.kv_capacity()
    finally:
        stop_deployment([one], [], work / "one-shm")
    with pd_deployment(work, 32, {}, model=model, max_model_len=shape.max_model_len) as dep:
        yield name, dep, prompts, want, capacity


def external(dep) -> float:
    return metric(f"{dep.d.url}/metrics", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def kv_file(dep, engine_id: str) -> bytes:
    (path,) = [f for f in glob.glob(f"{dep.shm}/*.kv") if f"-{engine_id}-" in f]
    with open(path, "rb") as f:
        return f.read()


def mla_backend(dep) -> str:
    """The MLA backend P's vLLM picked, as its log names it: AMX_MLA wherever the CPU has AMX
    tiles (its blocks are the engine's, multiples of 32), else CPU_MLA (vLLM forces 16 tokens)."""
    found = re.findall(r"Using (\w*MLA) backend", dep.p.tail(10**7))
    assert found, "P's vLLM log names no MLA backend"
    return found[-1]


def check_mla_difference(dep, params, n: int, got: list[int], want: list[int]) -> None:
    """DeepSeek-V2 on vLLM-CPU: the documented difference, exactly (docs/operations.md)."""
    p_kv, d_kv = kv_file(dep, dep.p_sc.engine_id), kv_file(dep, dep.d_sc.engine_id)
    tokens = 16 if mla_backend(dep) == "CPU_MLA" else 32
    block = tokens * LATENT
    p_ids = params["remote_block_ids"]
    # Every row of P's first layer that D does not recompute (all but the last token's) arrives
    # byte-identical, at the same place in one of D's blocks.
    for k, b in enumerate(p_ids):
        rows = min(tokens, n - 1 - k * tokens) * LATENT
        if rows > 0:
            d_starts = {d_kv[i:i + rows] for i in range(0, len(d_kv) // LAYERS, block)}
            assert p_kv[b * block:b * block + rows] in d_starts, f"P's block {k}: rows differ on D"
    # The last prompt token, recomputed by D: the same latent, another rope part than P's.
    row = p_ids[(n - 1) // tokens] * block + ((n - 1) % tokens) * LATENT
    p_row = p_kv[row:row + LATENT]
    d_rows = [d_kv[i:i + LATENT] for i in range(0, len(d_kv) // LAYERS, LATENT) if d_kv[i:i + 1024] == p_row[:1024]]
    assert d_rows and all(r[1024:] != p_row[1024:] for r in d_rows)
    assert got != want


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_each_family_moves_its_kv_and_decodes_like_one_engine(family, mode):
    """At each of the family's prompt lengths (``Shape.lengths``), one request after another."""
    name, dep, prompts, want, _ = family
    for n in SHAPES[name].lengths:
        check_one(name, dep, prompts, want, mode, n)


def check_one(name: str, dep, prompts, want, mode: str, n: int) -> None:
    shape = SHAPES[name]
    ids = prompts[(mode, n)]
    bytes_before, ext_before = dep.p_sc.status()["bytesMoved"], external(dep)
    tid = unique(mode)
    if mode == "pull":
        got, params = dep.router.pull(ids, MAX_TOKENS, tid)
        assert params["remote_num_tokens"] == n - shape.backoff
    else:
        got, params = dep.router.push(ids, MAX_TOKENS, tid), None
    assert external(dep) - ext_before == n - shape.backoff, f"{n} tokens, {mode}: tokens counted external"
    moved = dep.p_sc.status()["bytesMoved"] - bytes_before
    assert moved == expected_bytes(shape, n), f"{n} tokens, {mode}: bytes moved"
    if shape.sliding:
        # Never more than the window's blocks, whatever the prompt's length.
        assert moved <= (shape.full * math.ceil(n / shape.block)
                         + shape.sliding * (math.ceil(WINDOW / shape.block) + 1)) * shape.block * shape.token_bytes
    if shape.mla and mode == "pull":
        check_mla_difference(dep, params, n, got, want[(mode, n)])
    elif shape.mla:
        assert got != want[(mode, n)]  # the same difference (checked byte by byte in pull)
    elif shape.backoff:
        # D computes the last prompt token alone (one step, vLLM's single-token state update)
        # where the engine alone computes it inside the prompt's chunk: the same tokens as that
        # engine computing it alone, and the same first token as the engine alone.
        if (mode, n, "last-alone") in want:
            assert got == want[(mode, n, "last-alone")], f"{n} tokens, {mode}"
        assert got[0] == want[(mode, n)][0], f"{n} tokens, {mode}"
    else:
        assert got == want[(mode, n)], f"{n} tokens, {mode}"


def test_kv_capacity_with_the_connector_is_the_engine_alones(family):
    """The hybrid manager stays on: each engine's KV cache holds as many tokens as without kvxfer."""
    name, dep, _, _, capacity = family
    assert "Turning off hybrid kv cache manager" not in dep.p.tail(10**7)
    assert dep.p.kv_capacity() == capacity and dep.d.kv_capacity() == capacity
