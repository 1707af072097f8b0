"""``kvxfer bench vllm --breakdown``: where one P/D request's time goes, hop by hop, in real vLLM.

Starts the bench's P/D pair (bench.py: two CPU engines, P on core 0, D on core 1, their
sidecars) with the connector's timeline on (timeline.py), sends pull (or, ``--modes push``, push)
requests of each prompt length, and lines up, per request, on the host's CLOCK_MONOTONIC: the
router's clock (request sent, P's HTTP answer, D's first streamed token), the connector's marks
in both engines, and both sidecars' trace hops (ListTransfers). Prints one JSON object on
stdout: per length the median of each segment, the slowest tenth of the requests by TTFT (at
least one) and every request's raw timeline; with ``--table`` a text table too, the slowest
tenth's segments beside the medians.

    python -m kvxfer_vllm_testing.breakdown [--modes pull|push] [--lengths 32,256,1024,4096] [--requests 5] [--pin-engines] [--table]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from kvxfer_vllm import timeline

from .bench import BENCH_MODEL, prompt_of
from .harness import EngineSpec, SidecarProc, VllmServer
from .tiny_model import make_tiny_model


class SidecarFlagsPair:
    """Two CPU engines (P on core 0, D on core 1, the bench's settings) and their sidecars, with
    extra flags for both sidecars; ``pin``: every process of each engine on its core, as
    ``bench vllm --pin-engines`` runs them (otherwise only the model threads are bound)."""

    def __init__(self, work: Path, model: str, kv_memory: str, max_len: int, flags: list[str],
                 pin: bool = False, connector: dict[str, Any] | None = None) -> None:
        self.shm = Path(tempfile.mkdtemp(prefix="kvxfer-breakdown-", dir="/dev/shm"))
        tag = f"{os.getpid()}-{kv_memory}-{time.monotonic_ns()}"
        started: list[Any] = []
        try:
            # Everything started so far is stopped if a start fails or the run is stopped meanwhile.
            self.p_sc = SidecarProc(f"bp-{tag}", "prefill", f"ipc://{work}/p-{tag}.sock", work, *flags)
            started.append(self.p_sc)
            self.d_sc = SidecarProc(f"bd-{tag}", "decode", f"ipc://{work}/d-{tag}.sock", work, *flags)
            started.append(self.d_sc)
            extra = {"placement": "shared", "kv_memory": kv_memory, "register_timeout_s": 600.0, **(connector or {})}
            common: dict[str, Any] = dict(block_size=32, kv_cache_bytes=512 << 20, max_model_len=max_len, extra=extra,
                                          pin=pin)
            self.p = VllmServer(EngineSpec(model, self.p_sc.engine_id, self.p_sc.socket, str(self.shm), cores="0", **common), work)
            started.insert(0, self.p)
            self.d = VllmServer(EngineSpec(model, self.d_sc.engine_id, self.d_sc.socket, str(self.shm), cores="1", **common), work)
            started.insert(0, self.d)
            self.p.wait_ready()
            self.d.wait_ready()
        except BaseException:
            for proc in started:
                proc.stop(60)
            shutil.rmtree(self.shm, ignore_errors=True)
            raise
        host, port = self.p_sc.side_channel.rsplit(":", 1)
        self.p_addr = (host, int(port))

    def close(self) -> None:
        for s in (self.p, self.d):
            s.stop(60)
        for sc in (self.p_sc, self.d_sc):
            sc.stop()
        shutil.rmtree(self.shm, ignore_errors=True)





#: (name, from, to): the segments of a pull request, each between two marks (see _marks).
SEGMENTS = [
    ("router -> P answer", "sent", "p.answer"),
    ("P answer -> P PrefillDone sent", "p.answer", "p.worker.sent"),
    ("P answer -> D ExpectKv sent", "p.answer", "d.worker.sent"),
    ("D ExpectKv sent -> D sidecar got it", "d.worker.sent", "d.sc.engine.expectKv"),
    ("D sidecar: ExpectKv -> peer resolved", "d.sc.engine.expectKv", "d.sc.peer.resolved"),
    ("D sidecar: peer resolved -> planned", "d.sc.peer.resolved", "d.sc.planned"),
    ("D sidecar: planned -> read posted", "d.sc.planned", "d.sc.first post"),
    ("transfer: read posted -> completed", "d.sc.first post", "d.sc.completed"),
    ("D sidecar: completed -> KvReady sent", "d.sc.completed", "d.sc.engine.kvReady sent"),
    ("KvReady sent -> D connector got it", "d.sc.engine.kvReady sent", "d.worker.kv_ready"),
    ("D connector -> D scheduler knows", "d.worker.kv_ready", "d.sched.received"),
    ("D scheduler knows -> step admits it", "d.sched.received", "d.sched.admitted"),
    ("step admits it -> first token", "d.sched.admitted", "d.first"),
    ("D side: P answer -> first token", "p.answer", "d.first"),
    ("TTFT: router -> first token", "sent", "d.first"),
    # The reference, same engine, same moment: D alone, the prompt already in its prefix cache
    # (what D's side costs when no KV has to move: HTTP, scheduling, one token, streaming).
    ("ref: D alone, prompt cached -> first token", "ref.sent", "ref.first"),
]


#: The segments of a push request: D registers when it is asked (at once, beside P), P's sidecar
#: writes when P's forward has computed the prompt, D's engine admits the request once it lands.
PUSH_SEGMENTS = [
    ("router -> P answer", "sent", "p.answer"),
    ("D registration: router -> D ExpectKv sent", "sent", "d.worker.sent"),
    ("D ExpectKv sent -> D sidecar got it", "d.worker.sent", "d.sc.engine.expectKv"),
    ("D sidecar: ExpectKv -> PushReg sent", "d.sc.engine.expectKv", "d.sc.peer.pushReg sent"),
    ("router -> P PrefillDone sent", "sent", "p.worker.sent"),
    ("P PrefillDone sent -> P sidecar got it", "p.worker.sent", "p.sc.engine.prefillDone"),
    ("P sidecar: PrefillDone -> write posted", "p.sc.engine.prefillDone", "p.sc.first post"),
    ("transfer: write posted -> completed", "p.sc.first post", "p.sc.completed"),
    ("P completed -> D KvReady sent", "p.sc.completed", "d.sc.engine.kvReady sent"),
    ("KvReady sent -> D connector got it", "d.sc.engine.kvReady sent", "d.worker.kv_ready"),
    ("D connector -> D scheduler knows", "d.worker.kv_ready", "d.sched.received"),
    ("D scheduler knows -> step admits it", "d.sched.received", "d.sched.admitted"),
    ("step admits it -> first token", "d.sched.admitted", "d.first"),
    ("P PrefillDone sent -> D first token", "p.worker.sent", "d.first"),
    ("D side: P answer -> first token", "p.answer", "d.first"),
    ("TTFT: router -> first token", "sent", "d.first"),
    ("ref: D alone, prompt cached -> first token", "ref.sent", "ref.first"),
]

SEGMENTS_OF = {"pull": SEGMENTS, "push": PUSH_SEGMENTS}

#: What the slowest requests are picked by.
RANK_BY = "TTFT: router -> first token"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def first_token(pair: SidecarFlagsPair, prompt: list[int], params: dict[str, Any] | None) -> float:
    """Streams 2 tokens from D; when the first arrived (monotonic seconds)."""
    body: dict[str, Any] = {"model": pair.d.spec.model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
                            "ignore_eos": True, "stream": True}
    if params is not None:
        body["kv_transfer_params"] = params
    first = None
    with requests.post(f"{pair.d.url}/v1/completions", json=body, stream=True, timeout=300) as s:
        if s.status_code != 200:
            raise RuntimeError(f"D: HTTP {s.status_code}: {s.text[:300]}")
        for line in s.iter_lines():
            if line.startswith(b"data: {") and first is None:
                first = time.monotonic()
    if first is None:
        raise RuntimeError("D streamed no token")
    return first


def pull_once(pair: SidecarFlagsPair, prompt: list[int], tid: str) -> dict[str, float]:
    """One pull request as a router makes it, then the reference (the same prompt to D alone,
    now in its prefix cache); the router's marks (monotonic seconds)."""
    t: dict[str, float] = {"sent": time.monotonic()}
    r = requests.post(f"{pair.p.url}/v1/completions", json={
        "model": pair.p.spec.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}, timeout=300)
    t["p.answer"] = time.monotonic()
    t["d.first"] = first_token(pair, prompt, r.json()["kv_transfer_params"])
    t["ref.sent"] = time.monotonic()
    t["ref.first"] = first_token(pair, prompt, None)
    return t


def push_once(pair: SidecarFlagsPair, prompt: list[int], tid: str) -> dict[str, float]:
    """One push request as a router makes it (D and P asked at once, D with P's coordinates),
    then the reference; the router's marks (monotonic seconds)."""
    params = {"do_remote_prefill": True, "remote_host": pair.p_addr[0], "remote_port": pair.p_addr[1],
              "transfer_id": tid}
    got: dict[str, Any] = {}

    def d_side() -> None:
        try:
            got["first"] = first_token(pair, prompt, params)
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            got["error"] = e

    t: dict[str, float] = {"sent": time.monotonic()}
    th = threading.Thread(target=d_side, daemon=True)
    th.start()
    r = requests.post(f"{pair.p.url}/v1/completions", json={
        "model": pair.p.spec.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}, timeout=300)
    t["p.answer"] = time.monotonic()
    if r.status_code != 200:
        raise RuntimeError(f"P: HTTP {r.status_code}: {r.text[:300]}")
    th.join(timeout=300)
    if "error" in got:
        raise got["error"]
    if "first" not in got:
        raise RuntimeError("D streamed no token within 300 s")
    t["d.first"] = got["first"]
    t["ref.sent"] = time.monotonic()
    t["ref.first"] = first_token(pair, prompt, None)
    return t


def sidecar_traces(sc: SidecarProc, sizes: dict[str, tuple[int, int]] | None = None
                   ) -> dict[str, list[tuple[str, float]]]:
    """transfer id -> its hops (name, monotonic seconds) on one sidecar, from ListTransfers;
    ``sizes`` gets each transfer's (bytes, descriptors)."""
    transfers = sc.transfers()
    if sizes is not None:
        sizes.update({t.transfer_id: (t.bytes, t.descriptors) for t in transfers})
    return {t.transfer_id: [(h.hop, h.at_us / 1e6) for h in t.trace] for t in transfers}


def _marks(router: dict[str, float], conn: list[dict[str, Any]], p_hops: list[tuple[str, float]],
           d_hops: list[tuple[str, float]]) -> dict[str, float]:
    """Every mark of one transfer by name (the first of each; sidecar pair steps by their step)."""
    m = {k: v for k, v in router.items() if not k.startswith("ref.")}
    for c in conn:
        m.setdefault(c["ev"], c["t"])
    for prefix, hops in (("p.sc.", p_hops), ("d.sc.", d_hops)):
        for hop, t in hops:
            # "pair 0>0 first post" -> "first post" (first start, last finish over rank pairs)
            name = prefix + (hop.split(" ", 2)[2] if hop.startswith("pair ") else hop)
            if name.endswith(("completed", "delivered", "posted", "flushed")):
                m[name] = max(m.get(name, t), t)
            else:
                m.setdefault(name, t)
    return m


def segments(marks: dict[str, float], mode: str = "pull") -> dict[str, float]:
    """Milliseconds per segment (absent when a mark is missing)."""
    return {name: (marks[b] - marks[a]) * 1000 for name, a, b in SEGMENTS_OF[mode] if a in marks and b in marks}


def slowest(rows: list[dict[str, Any]], share: float = 0.1) -> list[str]:
    """The transfer ids of the slowest ``share`` of ``rows`` by TTFT (at least one), slowest last."""
    ranked = sorted((r for r in rows if RANK_BY in r["ms"]), key=lambda r: r["ms"][RANK_BY])
    return [r["tid"] for r in ranked[-max(1, math.ceil(len(ranked) * share)):]]


def admitted_tokens(conn: list[dict[str, Any]]) -> int | None:
    """Tokens D's first step computed for the request (1 when every prompt token moved)."""
    return next((c.get("tokens") for c in conn if c["ev"] == "d.sched.admitted"), None)


def run(lengths: list[int], per: int, work: Path, kv_memory: str, model: str, flags: list[str],
        pin: bool = False, connector: dict[str, Any] | None = None, mode: str = "pull") -> dict[str, Any]:
    once = push_once if mode == "push" else pull_once
    folder = work / f"timeline-{kv_memory}-{time.monotonic_ns()}"
    os.environ[timeline.ENV] = str(folder)  # the engines inherit it
    pair = SidecarFlagsPair(work, model, kv_memory, max(lengths) + 80, flags, pin, connector)
    router: dict[str, dict[str, float]] = {}
    order: list[tuple[int, str]] = []
    seed = 10_000
    try:
        for i in range(2):  # warm-up: lazy initialisation in both engines and sidecars
            seed += 1
            pull_once(pair, prompt_of(64, seed), f"warm{seed}")
        for i in range(per):
            for n in lengths:  # interleaved, so drift hits every length alike
                seed += 1
                tid = f"bd{n}-{i}-{seed}"
                router[tid] = once(pair, prompt_of(n, seed), tid)
                order.append((n, tid))
        time.sleep(0.5)  # the last marks reach their files
        sizes: dict[str, tuple[int, int]] = {}
        p_tr, d_tr = sidecar_traces(pair.p_sc), sidecar_traces(pair.d_sc, sizes)
    finally:
        pair.close()
    conn: dict[str, list[dict[str, Any]]] = {}
    for m in timeline.read(str(folder)):
        conn.setdefault(m["tid"], []).append(m)
    out: dict[str, Any] = {"mode": mode, "kv_memory": kv_memory, "sidecar_flags": flags, "pinned_engines": pin,
                           "connector": connector or {},
                           "machine": f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
                           "segments": [s[0] for s in SEGMENTS_OF[mode]], "lengths": {}}
    for n in lengths:
        rows = []
        for ln, tid in order:
            if ln != n:
                continue
            marks = _marks(router[tid], conn.get(tid, []), p_tr.get(tid, []), d_tr.get(tid, []))
            ms = segments(marks, mode)
            ms["ref: D alone, prompt cached -> first token"] = (router[tid]["ref.first"] - router[tid]["ref.sent"]) * 1000
            kv_bytes, descriptors = sizes.get(tid, (0, 0))
            rows.append({"tid": tid, "ms": ms, "d_first_step_tokens": admitted_tokens(conn.get(tid, [])),
                         "kv_bytes": kv_bytes, "descriptors": descriptors,
                         "marks_ms": {k: round((v - router[tid]["sent"]) * 1000, 3) for k, v in
                                      sorted(marks.items(), key=lambda kv: kv[1])}})
        med = {}
        for name, _, _ in SEGMENTS_OF[mode]:
            xs = [r["ms"][name] for r in rows if name in r["ms"]]
            if xs:
                med[name] = round(statistics.median(xs), 2)
        out["lengths"][str(n)] = {"median_ms": med, "slowest": slowest(rows), "requests": rows}
    return out


def table(res: dict[str, Any]) -> str:
    """Per segment, each length's median; then, per length, the slowest tenth's own segments."""
    lengths = list(res["lengths"])
    width = max(len(s) for s in res["segments"])
    pinned = ", engines pinned" if res.get("pinned_engines") else ""
    mode = "push, " if res.get("mode") == "push" else ""
    lines = [f"{mode}KV in {res['kv_memory']}s {' '.join(res['sidecar_flags'])}".strip() + pinned,
             f"{'segment (median ms)'.ljust(width)}  " + "  ".join(f"{n:>7}" for n in lengths)]

    def cell(c: float | None) -> str:
        return f"{c:7.1f}" if c is not None else "      -"

    for s in res["segments"]:
        lines.append(f"{s.ljust(width)}  " + "  ".join(cell(res["lengths"][n]["median_ms"].get(s)) for n in lengths))
    for n in lengths:
        by_tid = {r["tid"]: r for r in res["lengths"][n].get("requests", [])}
        slow = [by_tid[t] for t in res["lengths"][n].get("slowest", []) if t in by_tid]
        if not slow:
            continue
        lines.append(f"{n} tokens, the slowest {len(slow)} of {len(by_tid)} by TTFT (ms): median, then each")
        for s in res["segments"]:
            lines.append(f"{s.ljust(width)}  {cell(res['lengths'][n]['median_ms'].get(s))}  "
                         + "  ".join(cell(r["ms"].get(s)) for r in slow))
    lines.append(f"({res['machine']})")
    return "\n".join(lines)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(prog="kvxfer bench vllm --breakdown", description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="pull", choices=("pull", "push"),
                    help="the requests' transfer mode (one: pull or push)")
    ap.add_argument("--lengths", default="32,256,1024,4096")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--kv-memory", default="file", help="file, segment or both (file,segment): one pair each, in turn")
    ap.add_argument("--prefault", default="true", help="the sidecars' --prefault: true, false or both (false,true)")
    ap.add_argument("--rounds", type=int, default=1, help="pairs per kind, alternating kinds (drift hits each alike)")
    ap.add_argument("--pin-engines", action="store_true",
                    help="every process of each engine on its core (taskset), as the bench's --pin-engines")
    ap.add_argument("--idle-wait-s", type=float, help="both connectors' idle_wait_s (default: the connector's)")
    ap.add_argument("--worker-rest-s", type=float, help="both connectors' worker_rest_s (default: the connector's)")
    ap.add_argument("--engine-spin-s", type=float, help="both connectors' engine_spin_s (default: the connector's)")
    ap.add_argument("--table", action="store_true", help="also print the table on stderr")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    connector = {k: v for k, v in (("idle_wait_s", a.idle_wait_s), ("worker_rest_s", a.worker_rest_s),
                                   ("engine_spin_s", a.engine_spin_s)) if v is not None}
    work = Path(tempfile.mkdtemp(prefix="kvxfer-breakdown-"))
    runs = []
    try:
        spec = dataclasses.replace(BENCH_MODEL, max_positions=max(4096, max(lengths) + 128))
        model = make_tiny_model(str(work / "model"), spec)
        for r in range(a.rounds):
            for kind, prefault in [(k, f) for k in a.kv_memory.split(",") for f in a.prefault.split(",")]:
                log(f"round {r + 1}: KV in {kind}s, sidecars with --prefault {prefault} ...")
                res = run(lengths, a.requests, work, kind, model, ["--prefault", prefault], a.pin_engines, connector,
                          a.modes)
                res["round"] = r + 1
                if a.table:
                    log(table(res))
                runs.append(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
