"""``kvxfer bench vllm --models``: every model family through kvxfer and through vLLM's own
NixlConnector (with its two CPU fixes), in one run: KV bytes moved per request, TTFT, the KV
capacity each engine logs at start-up, and correctness against one engine alone.

Per family (``tiny_model.FAMILIES``, random weights made offline), one after another: one engine
alone (the reference: outputs, TTFT, capacity), kvxfer pull and push on one pair (distinct
prompts, so no prefix is cached), NixlConnector pull. Every system gets the same prompts. Bytes:
kvxfer's P sidecar counts what it served (``bytesMoved``); NixlConnector's D reports the bytes of
its reads (``vllm:nixl_bytes_transferred_sum``). The table goes to stderr, the JSON to stdout
and ``bench/results/models-<UTC time>.json``.

    python -m kvxfer_vllm_testing.models_bench [--families gemma3,qwen3-next] [--lengths 200,1000]
        [--requests 3] [--no-nixl]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .bench import KvxferPair, NixlPair, OneEngine, peers_installed, prompt_of
from .harness import REPO, metric
from .tiny_model import FAMILIES, TinyModelSpec, make_tiny_model

#: Longest prompt plus output the engines take (Qwen3-Next's attention blocks are 1056 tokens).
MAX_LEN = 2048
OUT = 8
#: What `--models` runs by default: every family but the plain Llama (the others cover it).
FAMILIES_BENCHED = ("qwen3", "mistral-sw", "gemma3", "qwen3-next", "deepseek-v2", "mixtral", "gpt-oss", "mamba2")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _p50(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1000, 1) if xs else None


def _serve(dep: Any, system: str, prompts: list[list[int]], bytes_of) -> dict[str, Any]:
    ttft, outs, moved = [], [], []
    for p in prompts:
        before = bytes_of()
        a = dep.serve(system, p, OUT)
        ttft.append(a.ttft)
        outs.append(a.ids)
        moved.append(bytes_of() - before)
    return {"ttft": ttft, "outs": outs, "bytes": moved}


def run_family(name: str, lengths: list[int], requests: int, nixl: bool, work: Path) -> dict[str, Any]:
    model = make_tiny_model(str(work / f"model-{name}"), TinyModelSpec(family=name, layers=4))
    prompts = {n: [prompt_of(n, 100_000 * (k + 1) + n) for k in range(requests)] for n in lengths}
    push_prompts = {n: [prompt_of(n, 900_000 + 100_000 * (k + 1) + n) for k in range(requests)] for n in lengths}
    row: dict[str, Any] = {"family": name, "attention": FAMILIES[name][0], "systems": {}}
    none = lambda: 0.0  # noqa: E731

    log(f"{name}: one engine")
    one = OneEngine(work, model, MAX_LEN)
    try:
        ref = {n: _serve(one, "one", prompts[n] + push_prompts[n], none) for n in lengths}
        row["systems"]["one"] = {"capacity": one.e.kv_capacity(),
                                 "ttft_ms": {n: _p50(ref[n]["ttft"][:requests]) for n in lengths}}
    finally:
        one.close()

    def record(system: str, got: dict[int, dict[str, Any]], capacity: int, which: str) -> None:
        out: dict[str, Any] = {"capacity": capacity, "ttft_ms": {}, "bytes_per_request": {}, "identical": {}}
        for n in lengths:
            want = ref[n]["outs"][:requests] if which == "pull" else ref[n]["outs"][requests:]
            out["ttft_ms"][n] = _p50(got[n]["ttft"])
            out["bytes_per_request"][n] = round(statistics.mean(got[n]["bytes"])) if got[n]["bytes"] else None
            out["identical"][n] = f"{sum(a == b for a, b in zip(got[n]['outs'], want))}/{len(want)}"
            out.setdefault("outs", {})[n] = got[n]["outs"]
        row["systems"][system] = out

    def failed(system: str, err: BaseException) -> None:
        log(f"{name}: {system} failed: {err}")
        row["systems"][system] = {"capacity": None, "ttft_ms": {}, "status": f"failed: {str(err)[:300]}"}

    log(f"{name}: kvxfer")
    try:
        kv = KvxferPair(work, model, MAX_LEN)
    except Exception as err:  # noqa: BLE001 - a row, not the end of the run
        failed("kvxfer-pull", err)
    else:
        try:
            moved = lambda: float(kv.p_sc.status()["bytesMoved"])  # noqa: E731
            for system, which, ps in (("kvxfer-pull", "pull", prompts), ("kvxfer-push", "push", push_prompts)):
                try:
                    record(system, {n: _serve(kv, system, ps[n], moved) for n in lengths}, kv.p.kv_capacity(), which)
                except Exception as err:  # noqa: BLE001
                    failed(system, err)
            row["hybrid_manager_on"] = "Turning off hybrid kv cache manager" not in kv.p.tail(10**7)
        finally:
            kv.close()
    if nixl:
        log(f"{name}: NixlConnector")
        try:
            nx = NixlPair(work, model, MAX_LEN, push=False, fixed=True)
        except Exception as err:  # noqa: BLE001
            failed("nixl-fixed", err)
        else:
            try:
                url = f"{nx.d.url}/metrics"
                moved = lambda: metric(url, "vllm:nixl_bytes_transferred_sum")  # noqa: E731
                record("nixl-fixed", {n: _serve(nx, "nixl-fixed", prompts[n], moved) for n in lengths},
                       nx.p.kv_capacity(), "pull")
            except Exception as err:  # noqa: BLE001
                failed("nixl-fixed", err)
            finally:
                nx.close()
        # Where kvxfer and NixlConnector both differ from one engine, whether they agree.
        pull, nx_row = row["systems"].get("kvxfer-pull", {}), row["systems"].get("nixl-fixed", {})
        if "outs" in pull and "outs" in nx_row:
            for n in lengths:
                a, b = pull["outs"][n], nx_row["outs"][n]
                row.setdefault("kvxfer_pull_equals_nixl", {})[n] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
    for s in row["systems"].values():
        s.pop("outs", None)
    return row


def table(rows: list[dict[str, Any]], lengths: list[int]) -> str:
    head = ["family", "system", "KV capacity (tokens)"]
    for n in lengths:
        head += [f"bytes/req {n}", f"TTFT p50 ms {n}", f"identical {n}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for system, s in r["systems"].items():
            cells = [r["family"], system + (f" ({s['status']})" if "status" in s else ""), str(s["capacity"])]
            for n in lengths:
                b = s.get("bytes_per_request", {}).get(n)
                cells += ["—" if b is None else f"{b:,}", str(s["ttft_ms"].get(n)), s.get("identical", {}).get(n, "—")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES_BENCHED))
    ap.add_argument("--lengths", default="200,1000")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--no-nixl", action="store_true", help="kvxfer and one engine only")
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}: one of {sorted(FAMILIES)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    nixl = not args.no_nixl and peers_installed().get("nixl", {}).get("installed", False)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    import vllm

    rows: list[dict[str, Any]] = []
    result = {"bench": "vllm-models", "started": started, "machine": f"{os.cpu_count()} cores, {platform.machine()}",
              "vllm": vllm.__version__, "lengths": lengths, "requests": args.requests, "output_tokens": OUT,
              "load_before": os.getloadavg(), "rows": rows}
    out = REPO / "bench" / "results" / f"models-{started.replace(':', '')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvxfer-models-") as tmp:
        for f in families:
            rows.append(run_family(f, lengths, args.requests, nixl, Path(tmp)))
            result["load_after"] = os.getloadavg()
            out.write_text(json.dumps(result, indent=1))  # after every family: a cut run keeps what it had
    log(table(rows, lengths))
    log(f"results: {out}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
