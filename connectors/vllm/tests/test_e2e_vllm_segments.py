"""Real vLLM engines with their KV in segments the sidecars allocate (kv_connector_extra_config
``kv_memory: segment``): each worker asks its sidecar for the rank's KV (``AllocateKv``) inside
vLLM's KV cache allocation and attaches it; no KV file exists. D's tokens must equal one engine's
alone, in pull and in push. Its own module, so that its two engines start only once the other
module's have stopped (two cores)."""

from __future__ import annotations

import os
import re

import pytest
from conftest import pd_deployment, prompt, unique

from kvxfer_vllm_testing.harness import output_ids

BLOCK = 32
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    with pd_deployment(tmp_path_factory.mktemp("e2e-seg"), BLOCK, {"kv_memory": "segment"}) as dep:
        yield dep


def own_segments() -> set[int]:
    """Owner-only SysV segments of this user (the sidecars' KV allocations among them)."""
    with open("/proc/sysvipc/shm", encoding="ascii") as f:
        header = f.readline().split()
        rows = [dict(zip(header, line.split())) for line in f]
    return {int(r["shmid"]) for r in rows if int(r["uid"]) == os.geteuid() and int(r["perms"], 8) & 0o777 == 0o600}


@pytest.mark.parametrize("n", [70, 200])
def test_segments_decode_token_for_token_like_one_engine(pd, n):
    assert not os.listdir(pd.shm), "with kv_memory 'segment' no KV file is made"
    for engine in (pd.p, pd.d):
        said = re.findall(r"KV cache region in segment (\d+) \(\d+ bytes\), allocated by the sidecar",
                          engine.log_path.read_text())
        assert said and {int(x) for x in said} <= own_segments(), engine.log_path
    ids = prompt(n, seed=5000 + n)
    want = output_ids(pd.p.complete(ids, MAX_TOKENS))
    got, params = pd.router.pull(ids, MAX_TOKENS, unique("seg-pull"))
    assert params["remote_num_tokens"] == n
    assert got == want
    ids = prompt(n, seed=6000 + n)
    want = output_ids(pd.p.complete(ids, MAX_TOKENS))
    assert pd.router.push(ids, MAX_TOKENS, unique("seg-push")) == want
    assert pd.p_sc.status()["bytesMoved"] > 0
