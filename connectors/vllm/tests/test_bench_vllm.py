"""``kvxfer bench vllm``'s quick variant, so the comparison harness stays alive: one prompt length,
kvxfer (pull) beside vLLM's own NixlConnector (with the bench's two CPU fixes), every output
token-identical to one engine's for the same prompt, with the KV moved (D's own counter). And vLLM's IPC files go to the harness's
scratch folders: while the deployments run, no process of theirs holds a socket or file directly
in /tmp, and after the run nothing they held is left there.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path

import pytest

from kvxfer_vllm_testing import bench
from kvxfer_vllm_testing.harness import VllmServer, group_pids
from kvxfer_vllm_testing.pki import shared_pki

TMP = Path("/tmp")


def held_paths(dep: bench.Deployment) -> set[str]:
    """Unix socket paths bound by, and files open in, every process of the deployment."""
    inodes: set[int] = set()
    paths: set[str] = set()
    for pid in group_pids({p.pid for p in dep.procs.values()}):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if m := re.fullmatch(r"socket:\[(\d+)\]", link):
                inodes.add(int(m.group(1)))
            elif link.startswith("/"):
                paths.add(link)
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and int(parts[6]) in inodes:
                paths.add(parts[7].lstrip("@"))
    return paths


def _thread_cores(pgid: int) -> set[int]:
    """The cores any thread of any process in the group may run on."""
    cores: set[int] = set()
    for pid in group_pids({pgid}):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                cores |= os.sched_getaffinity(int(tid))
            except OSError:  # the thread ended meanwhile
                pass
    return cores


def test_quick_kvxfer_and_nixl_token_identical_pinned_nothing_left_in_tmp() -> None:
    """One quick run of the bench, with ``--pin-engines``: kvxfer and NixlConnector decode like one
    engine, every thread of each engine (HTTP server, engine core, worker) runs on the engine's
    core (P 0, D 1, one engine 0), and nothing is left in /tmp. Without ``--pin-engines``,
    everything but vLLM's model threads floats (every other vLLM test runs that way)."""
    if importlib.util.find_spec("nixl") is None:
        pytest.fail("nixl is not installed in .venv: run scripts/setup-python.sh (it installs "
                    "bench/peers/requirements-nixl.txt)")
    tmp_before = set(os.listdir(TMP))
    held: set[str] = set()
    scratch: list[Path] = []
    seen: dict[str, tuple[str, set[int]]] = {}  # "<system> <process>" -> (its core, its threads' cores)

    def observe(dep: bench.Deployment) -> None:
        held.update(held_paths(dep))
        for name, proc in dep.procs.items():
            if isinstance(proc, VllmServer):
                scratch.append(proc.scratch)
                seen[f"{dep.systems[0]} {name}"] = (proc.spec.cores, _thread_cores(proc.pid))

    started = time.monotonic()
    result = bench.run(["one", "kvxfer-pull", "nixl-fixed"], lengths=[256], concurrency=[1], requests_per=2,
                       rounds=1, out_tokens=8, on_ready=observe, pin_engines=True)
    assert time.monotonic() - started < 1500
    rows = {r["system"]: r for r in result["rows"]}
    assert rows.keys() == {"one", "kvxfer-pull", "nixl-fixed"}
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row)
        assert row["error_count"] == 0, (name, row["errors"])
        assert row["ttft_ms"]["n"] == 2
        # Every request's TTFT is kept (the staircase at 8 in flight is read from them), and the
        # percentiles are of those samples (nearest rank: p90 of two is the larger).
        samples = row["ttft_ms"]["samples"]
        assert len(samples) == 2 and all(x > 0 for x in samples), (name, samples)
        assert abs(row["ttft_ms"]["p90"] - max(samples)) < 0.1, (name, row["ttft_ms"])
    for name in ("kvxfer-pull", "nixl-fixed"):
        assert rows[name]["correct"] == {"identical": 2, "compared": 2}, (name, rows[name])
        # The KV moved (D's own counter; 7 of 8 blocks at least, D computes the last token), so
        # identical outputs are not D recomputing the prompt.
        assert rows[name]["d_prompt_tokens_per_request"]["external_kv_transfer"] >= 100, (name, rows[name])
        # D's side (P's answer -> D's first token): a pull asks D after P answered, so it is part
        # of the TTFT, and one engine has none.
        d_side = rows[name]["d_side_ms"]
        assert d_side["n"] == 2 and 0 < d_side["p50"] < rows[name]["ttft_ms"]["p50"], (name, d_side)
    assert rows["one"]["d_side_ms"]["n"] == 0
    # The sidecars' own record (ListTransfers over gRPC) of failed transfers: none here.
    assert rows["kvxfer-pull"]["kv_failures"] is None, rows["kvxfer-pull"]["kv_failures"]
    assert result["peers"]["nixl"]["installed"] is True
    assert result["peers"]["nixl"]["versions"]["nixl"] == "1.5.1"
    assert result["engine"]["pinned"] == "every process of each engine"
    assert set(seen) == {"one engine", "kvxfer-pull P engine", "kvxfer-pull D engine",
                         "nixl-fixed P engine", "nixl-fixed D engine"}, seen
    for name, (cores, allowed) in seen.items():
        assert allowed == {int(cores)}, f"{name}: threads may run on {sorted(allowed)}, not only core {cores}"

    # vLLM's IPC sockets lived in the engines' scratch folders, not directly in /tmp ...
    assert held, "no socket or file of the deployments was observed"
    assert any(any(p.startswith(f"{s}/") for s in scratch) for p in held), sorted(held)
    in_tmp = sorted(p for p in held if Path(p).parent == TMP)
    assert not in_tmp, f"the deployments held these directly in /tmp: {in_tmp}"
    # ... and nothing they held, nor the scratch folders, is left; the run's own /tmp entries are
    # gone too (this process's CA goes when it exits). Other users of /tmp may add entries
    # meanwhile: only what the run's processes held is ours to check.
    assert not [s for s in scratch if s.exists()]
    left = [p for p in held if p.startswith("/tmp/") and os.path.exists(p)]
    assert not left, f"left in /tmp: {left}"
    new = set(os.listdir(TMP)) - tmp_before - {shared_pki().dir.name}
    ours = [n for n in new if n.startswith(("kvxfer-bench-vllm-", "kvxfer-vllm-"))]
    assert not ours, f"the bench's scratch left in /tmp: {ours}"
