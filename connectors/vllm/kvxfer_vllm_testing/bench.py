"""``kvxfer bench vllm``: a real vLLM P/D pair through kvxfer against one engine alone.

Starts two vLLM engines (CPU build, a random-weight model made here) with their sidecars, then,
per prompt length, alternates requests served by one engine alone (P, no transfer) and by the P/D
pair through kvxfer (pull, push), measuring from the client: time to first token (streamed) and
end-to-end latency; and, from the sidecars, the KV bytes each P/D request moved. Prints one JSON
object on stdout (the TypeScript ``bench/vllm.ts`` formats it); progress on stderr.

    python -m kvxfer_vllm_testing.bench [--lengths 32,256,1024] [--requests 8] [--output-tokens 16]
                                [--modes pull,push] [--placements shared,host_buffer]
                                [--kv-memory file,segment] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from kvxfer_vllm.config import KV_MEMORY
from .harness import EngineSpec, SidecarProc, VllmServer
from .tiny_model import TinyModelSpec, make_tiny_model

#: Bigger than the tests' model so the KV is not negligible: 8 layers x 4 KV heads x 64 = 8 KiB/token.
BENCH_MODEL = TinyModelSpec(layers=8, heads=8, kv_heads=4, head_dim=64, hidden=512, intermediate=1024,
                            max_positions=4096)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def stream(server: VllmServer, prompt: list[int], max_tokens: int, params: dict[str, Any] | None,
           t0: float) -> tuple[float, float]:
    """Streams a completion; returns (first token, last token) times in seconds since ``t0``."""
    body: dict[str, Any] = {"model": server.spec.model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": True}
    if params is not None:
        body["kv_transfer_params"] = params
    first = None
    with requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                first = time.perf_counter() - t0
    last = time.perf_counter() - t0
    return (first if first is not None else last), last


def percentile(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-int(p * len(s) * 1000) // 1000) - 1))] if s else float("nan")


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": percentile(xs, 0.5) * 1000, "p99": percentile(xs, 0.99) * 1000, "n": len(xs)}


class Pair:
    def __init__(self, work: Path, model: str, placement: str, kv_memory: str, max_len: int) -> None:
        self.shm = Path(tempfile.mkdtemp(prefix="kvxfer-bench-", dir="/dev/shm"))
        tag = f"{os.getpid()}-{placement}-{kv_memory}"
        self.p_sc = SidecarProc(f"bp-{tag}", "prefill", f"ipc:///tmp/kvxfer-bench-p-{tag}.sock", work)
        self.d_sc = SidecarProc(f"bd-{tag}", "decode", f"ipc:///tmp/kvxfer-bench-d-{tag}.sock", work)
        extra = {"placement": placement, "kv_memory": kv_memory, "register_timeout_s": 600.0}
        common = dict(block_size=32, kv_cache_bytes=512 << 20, max_model_len=max_len, extra=extra)
        self.p = VllmServer(EngineSpec(model, self.p_sc.engine_id, self.p_sc.socket, str(self.shm), cores="0", **common), work)
        self.d = VllmServer(EngineSpec(model, self.d_sc.engine_id, self.d_sc.socket, str(self.shm), cores="1", **common), work)
        self.p.wait_ready()
        self.d.wait_ready()
        host, port = self.p_sc.side_channel.rsplit(":", 1)
        self.p_addr = (host, int(port))

    def moved(self) -> int:
        """KV bytes P's sidecar has moved (P counts every transfer, push and pull; D only pushes)."""
        return int(self.p_sc.status()["bytesMoved"])

    def one_engine(self, prompt: list[int], out: int) -> tuple[float, float]:
        return stream(self.p, prompt, out, None, time.perf_counter())

    def pd(self, mode: str, prompt: list[int], out: int, tid: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        if mode == "pull":
            r = requests.post(f"{self.p.url}/v1/completions", json={
                "model": self.p.spec.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}, timeout=300).json()
            return stream(self.d, prompt, out, r["kv_transfer_params"], t0)
        res: dict[str, Any] = {}

        def prefill() -> None:
            requests.post(f"{self.p.url}/v1/completions", json={
                "model": self.p.spec.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}, timeout=300)

        th = threading.Thread(target=prefill, daemon=True)
        th.start()
        res["t"] = stream(self.d, prompt, out, {"do_remote_prefill": True, "remote_host": self.p_addr[0],
                                                "remote_port": self.p_addr[1], "transfer_id": tid}, t0)
        th.join(300)
        return res["t"]

    def close(self) -> None:
        for s in (self.p, self.d):
            s.stop(60)
        for sc in (self.p_sc, self.d_sc):
            sc.stop()
        shutil.rmtree(self.shm, ignore_errors=True)


def prompt_of(n: int, seed: int) -> list[int]:
    """A distinct prompt per request (random ids), so no request hits a prefix cache. (An
    arithmetic sequence mod the vocabulary repeated every few hundred seeds: measured, a
    1024-token request then moved 24 of its 32 blocks.)"""
    rnd = random.Random(seed)
    return [rnd.randrange(3, BENCH_MODEL.vocab) for _ in range(n)]


def run(lengths: list[int], requests_per: int, out_tokens: int, modes: list[str], placements: list[str],
        kv_memories: tuple[str, ...] = ("file",)) -> dict[str, Any]:
    import vllm

    work = Path(tempfile.mkdtemp(prefix="kvxfer-bench-vllm-"))
    model = make_tiny_model(str(work / "model"), BENCH_MODEL)
    result: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, load {os.getloadavg()[0]:.2f}",
        "vllm": vllm.__version__,
        "model": {"layers": BENCH_MODEL.layers, "kv_heads": BENCH_MODEL.kv_heads, "head_dim": BENCH_MODEL.head_dim,
                  "dtype": "bfloat16", "kv_bytes_per_token": BENCH_MODEL.layers * 2 * BENCH_MODEL.kv_heads * BENCH_MODEL.head_dim * 2},
        "output_tokens": out_tokens,
        "rows": [],
    }
    seed = 1
    try:
        for placement, kv_memory in [(p, k) for p in placements for k in kv_memories]:
            log(f"starting P and D (placement {placement}, KV in {kv_memory}s) ...")
            pair = Pair(work, model, placement, kv_memory, max(lengths) + out_tokens + 64)
            try:
                # Warm-up: the first request of each kind pays for lazy initialisation.
                for mode in ["one"] + modes:
                    seed += 1
                    (pair.one_engine if mode == "one" else lambda p, o: pair.pd(mode, p, o, f"w{seed}"))(prompt_of(64, seed), 2)
                for n in lengths:
                    samples: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "e2e": []} for m in ["one"] + modes}
                    # KV bytes per request, from P's sidecar, with one untimed request per mode
                    # (asking the sidecar costs a process start: kept out of the timed requests).
                    moved: dict[str, int] = {}
                    for mode in modes:
                        seed += 1
                        before = pair.moved()
                        pair.pd(mode, prompt_of(n, seed), 2, f"k{seed}")
                        moved[mode] = pair.moved() - before
                    for i in range(requests_per):
                        for mode in ["one"] + modes:  # alternate, so drift hits every kind alike
                            seed += 1
                            p = prompt_of(n, seed)
                            ttft, e2e = pair.one_engine(p, out_tokens) if mode == "one" else pair.pd(mode, p, out_tokens, f"b{seed}")
                            samples[mode]["ttft"].append(ttft)
                            samples[mode]["e2e"].append(e2e)
                    log(f"  {placement}, {kv_memory} {n} tokens: done")
                    for mode in ["one"] + modes:
                        result["rows"].append({
                            "placement": placement, "kv_memory": kv_memory, "tokens": n, "mode": mode,
                            "ttft_ms": summary(samples[mode]["ttft"]), "e2e_ms": summary(samples[mode]["e2e"]),
                            "kv_bytes": moved.get(mode, 0),
                        })
            finally:
                pair.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    # SIGTERM (a stopped parent, a timeout) unwinds like Ctrl-C: engines, sidecars and files go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(prog="kvxfer bench vllm", description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32,256,1024")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--modes", default="pull,push")
    ap.add_argument("--placements", default="shared,host_buffer")
    ap.add_argument("--kv-memory", default="file", help="file, segment or both (file,segment)")
    ap.add_argument("--quick", action="store_true", help="3 requests per length, shared placement only")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    reqs = 3 if a.quick else a.requests
    placements = ["shared"] if a.quick else a.placements.split(",")
    for m in a.modes.split(","):
        if m not in ("pull", "push"):
            ap.error(f"--modes: unknown mode {m!r} (pull, push)")
    for pl in placements:
        if pl not in ("shared", "host_buffer"):
            ap.error(f"--placements: unknown placement {pl!r} (shared, host_buffer)")
    kv_memories = tuple(a.kv_memory.split(","))
    for k in kv_memories:
        if k not in KV_MEMORY:
            ap.error(f"--kv-memory: unknown kind {k!r} ({', '.join(KV_MEMORY)})")
    res = run(lengths, reqs, a.output_tokens, a.modes.split(","), placements, kv_memories)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
