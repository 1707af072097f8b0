"""The connector's timeline (``KVXFER_VLLM_TIMELINE``, read by ``kvxfer bench vllm --breakdown``),
and the package's import graph (no module imports one that imports it back)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from kvxfer_vllm import timeline
from kvxfer_vllm.messages import StepMessages
from kvxfer_vllm.scheduler import SchedulerLogic

PKG = Path(__file__).resolve().parents[1] / "kvxfer_vllm"

_SCRIPT = r"""
import sys, time
from kvxfer_vllm.scheduler import SchedulerLogic
s = SchedulerLogic(engine_id="d0", tp_size=1)
params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5000,
          "transfer_id": "t-1", "remote_block_ids": [3, 4], "remote_engine_id": "p0",
          "remote_num_tokens": 64, "kvxfer_token": "ab" * 16}
before = time.clock_gettime(time.CLOCK_MONOTONIC)
assert s.num_new_matched_tokens("r-1", params, 64, 0) == (64, True)
s.after_alloc("r-1", params, [7, 8], 64, 64)
s.build_step()
s.on_worker_output(None, {"r-1"})
s.mark_admitted({"other": 5})
s.mark_admitted({"r-1": 1})
s.mark_admitted({"r-1": 1})  # a later step: not the admission
print(before, time.clock_gettime(time.CLOCK_MONOTONIC))
"""


def _run(env_extra: dict[str, str]) -> str:
    env = dict(os.environ, **env_extra)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_marks_a_d_transfer_once_per_hop_on_the_sidecars_clock(tmp_path: Path):
    before, after = map(float, _run({timeline.ENV: str(tmp_path)}).split())
    files = list(tmp_path.glob("*.jsonl"))
    assert len(files) == 1
    marks = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [(m["ev"], m["tid"]) for m in marks] == [
        ("d.sched.alloc", "t-1"),
        ("d.sched.step", "t-1"),
        ("d.sched.received", "t-1"),
        ("d.sched.admitted", "t-1"),
    ]
    assert marks[-1]["tokens"] == 1
    # CLOCK_MONOTONIC seconds, the sidecars' trace clock (in µs there), in order.
    assert all(before <= m["t"] <= after for m in marks)
    assert [m["t"] for m in marks] == sorted(m["t"] for m in marks)
    assert timeline.read(str(tmp_path)) == marks


def test_off_by_default_writes_nothing_and_keeps_no_state(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != timeline.ENV}
    out = subprocess.run([sys.executable, "-c", _SCRIPT + "\nassert not s._landed\n"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.iterdir()) == []


def test_in_process_the_scheduler_hooks_run_with_the_timeline_off():
    assert not timeline.enabled() or os.environ.get(timeline.ENV)
    s = SchedulerLogic(engine_id="d0", tp_size=1)
    s.mark_admitted({"x": 1})
    assert s.build_step() == StepMessages()


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, at any level (TYPE_CHECKING blocks included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvxfer_vllm."):
            out.add(node.module.split(".")[1])
    return {m for m in out if (PKG / f"{m}.py").exists()}


def test_no_import_cycles_in_the_package():
    graph = {p.stem: _imports(p) for p in PKG.glob("*.py")}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif len(path) < len(graph):
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert cycles == [], f"import cycles: {cycles[:5]}"


def test_breakdown_lines_up_router_connector_and_sidecar_marks():
    from kvxfer_vllm_testing import breakdown

    router = {"sent": 10.0, "p.answer": 10.5, "d.first": 10.9, "ref.sent": 11.0, "ref.first": 11.05}
    conn = [{"t": 10.52, "ev": "d.worker.sent", "tid": "t"}, {"t": 10.7, "ev": "d.worker.kv_ready", "tid": "t"},
            {"t": 10.71, "ev": "d.sched.received", "tid": "t"}, {"t": 10.8, "ev": "d.sched.admitted", "tid": "t",
                                                                 "tokens": 1}]
    d_hops = [("engine.expectKv", 10.521), ("peer.resolved", 10.525), ("planned", 10.53), ("pair 0>0 first post", 10.54),
              ("pair 0>0 completed", 10.6), ("pair 1>0 completed", 10.65), ("engine.kvReady sent", 10.69)]
    marks = breakdown._marks(router, conn, [], d_hops)
    ms = breakdown.segments(marks)
    assert "ref.sent" not in marks
    assert round(ms["transfer: read posted -> completed"], 3) == 110.0  # the last rank pair's
    assert round(ms["D side: P answer -> first token"], 3) == 400.0
    assert round(ms["KvReady sent -> D connector got it"], 3) == 10.0
    assert round(ms["D sidecar: ExpectKv -> peer resolved"], 3) == 4.0
    assert round(ms["D sidecar: peer resolved -> planned"], 3) == 5.0
    assert breakdown.admitted_tokens(conn) == 1
    res = {"kv_memory": "file", "sidecar_flags": [], "machine": "m", "segments": [s[0] for s in breakdown.SEGMENTS],
           "lengths": {"1024": {"median_ms": ms}}}
    assert "D side: P answer -> first token" in breakdown.table(res)
    assert "engines pinned" not in breakdown.table(res)
    assert breakdown.table(res | {"pinned_engines": True}).splitlines()[0] == "KV in files, engines pinned"


def test_breakdown_push_segments_and_the_slowest_tenth():
    """A push request's segments (D registered at the start, P's write after its forward), and the
    table's slowest-tenth block: the slowest by TTFT, beside the medians."""
    from kvxfer_vllm_testing import breakdown

    router = {"sent": 10.0, "p.answer": 10.3, "d.first": 10.4}
    conn = [{"t": 10.01, "ev": "d.worker.sent", "tid": "t"}, {"t": 10.25, "ev": "p.worker.sent", "tid": "t"},
            {"t": 10.33, "ev": "d.worker.kv_ready", "tid": "t"}]
    p_hops = [("engine.prefillDone", 10.26), ("pair 0>0 first post", 10.27), ("pair 0>0 completed", 10.3)]
    d_hops = [("engine.expectKv", 10.012), ("peer.pushReg sent", 10.015), ("engine.kvReady sent", 10.32)]
    ms = breakdown.segments(breakdown._marks(router, conn, p_hops, d_hops), "push")
    assert round(ms["D registration: router -> D ExpectKv sent"], 3) == 10.0
    assert round(ms["P sidecar: PrefillDone -> write posted"], 3) == 10.0
    assert round(ms["transfer: write posted -> completed"], 3) == 30.0
    assert round(ms["P completed -> D KvReady sent"], 3) == 20.0
    assert round(ms["P PrefillDone sent -> D first token"], 3) == 150.0
    assert "D sidecar: ExpectKv -> peer resolved" not in ms  # a pull segment
    rows = [{"tid": f"r{i}", "ms": {breakdown.RANK_BY: float(t)}} for i, t in enumerate([50, 90, 40, 60, 45, 55, 52, 48,
                                                                                           51, 47, 70, 49])]
    assert breakdown.slowest(rows) == ["r10", "r1"]  # a tenth of 12, rounded up: the two slowest, slowest last
    assert breakdown.slowest(rows[:3]) == ["r1"]  # at least one
    res = {"mode": "push", "kv_memory": "file", "sidecar_flags": [], "machine": "m",
           "segments": [s[0] for s in breakdown.PUSH_SEGMENTS],
           "lengths": {"32": {"median_ms": {breakdown.RANK_BY: 50.5}, "slowest": ["r10", "r1"], "requests": rows}}}
    text = breakdown.table(res)
    assert text.splitlines()[0] == "push, KV in files"
    assert "32 tokens, the slowest 2 of 12 by TTFT (ms): median, then each" in text
    assert any(line.startswith(breakdown.RANK_BY) and line.split()[-3:] == ["50.5", "70.0", "90.0"]
               for line in text.splitlines())
