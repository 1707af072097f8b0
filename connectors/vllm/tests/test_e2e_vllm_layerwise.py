"""Layer-wise push with two real vLLM engines (CPU build): P's connector (``layer_wise: true``)
names each prompt's blocks before the forward that completes it and each layer as its attention
saves it; P's sidecar writes the layers into D's blocks as they come. With greedy sampling D's
tokens must equal those of one engine alone: prompts shorter than a block, several blocks with
a partial last one, a prompt in five chunks (``--max-num-batched-tokens 128``: the layers of its
last chunk's forward carry every earlier chunk's KV too), a prefix P has cached and D has not
(those blocks go with the layers of the new ones), and pull beside it on the same engines (a
read is only answered held once every layer was saved). Every push moved the KV (D computed none
of the prompt it was sent) by a layer-wise PrefillDone (its trace has "engine.layersSaved all").
"""

from __future__ import annotations

import pytest
from conftest import Deployment, pd_deployment, prompt, unique

from kvxfer_vllm_testing.harness import metric, output_ids

BLOCK = 32
MAX_TOKENS = 12
CHUNK = 128


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with pd_deployment(tmp_path_factory.mktemp("layerwise"), BLOCK, {"layer_wise": True},
                       engine_args=("--max-num-batched-tokens", str(CHUNK))) as dep:
        yield dep


def reference(pd: Deployment, ids: list[int]) -> list[int]:
    return output_ids(pd.p.complete(ids, MAX_TOKENS))


def moved_tokens(pd: Deployment) -> float:
    return metric(f"{pd.d.url}/metrics", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def layer_wise_on_p(pd: Deployment, tid: str) -> bool:
    """Whether P's sidecar served ``tid`` from a layer-wise PrefillDone, and released it."""
    (t,) = [t for t in pd.p_sc.transfers() if t.transfer_id == tid]
    return any(h.hop == "engine.layersSaved all" for h in t.trace)


@pytest.mark.parametrize("n", [20, BLOCK, 200, 5 * CHUNK - 40])
def test_layer_wise_push_decodes_token_for_token_like_one_engine(pd, n):
    ids = prompt(n, seed=5000 + n)
    before = moved_tokens(pd)
    tid = unique("lw")
    got = pd.router.push(ids, MAX_TOKENS, tid)
    # The reference after the push: P had not computed this prompt before.
    assert got == reference(pd, ids)
    assert moved_tokens(pd) - before == n, "D computed part of the prompt instead of loading P's KV"
    assert layer_wise_on_p(pd, tid)


def test_a_prefix_p_has_cached_goes_with_the_new_blocks(pd):
    """P has the first 96 tokens cached (one engine's answer to a prompt sharing them), D has
    not: the push moves every block, the cached ones with the layers of the forward that
    computes the rest."""
    shared = prompt(3 * BLOCK, seed=5101)
    warm = shared + prompt(10, seed=5102)
    reference(pd, warm)  # P's prefix cache now holds `shared`; D has never seen it
    ids = shared + prompt(50, seed=5103)
    before = moved_tokens(pd)
    tid = unique("lw-prefix")
    got = pd.router.push(ids, MAX_TOKENS, tid)
    assert got == reference(pd, ids)
    assert moved_tokens(pd) - before == len(ids)
    assert layer_wise_on_p(pd, tid)


def test_pull_beside_layer_wise_push(pd):
    """D reads after P answered: every layer was saved by then, the read counts."""
    ids = prompt(150, seed=5201)
    got, params = pd.router.pull(ids, MAX_TOKENS, unique("lw-pull"))
    assert params["remote_num_tokens"] == 150
    assert got == reference(pd, ids)
