"""``kvxfer bench vllm``: real vLLM P/D deployments through kvxfer, beside vLLM's own connectors.

The same random-weight model, the same engine flags and the same requests go to each system in
turn: one engine alone (the reference), kvxfer (pull and push, a P/D pair each), and with ``--vs``
vLLM's NixlConnector (as shipped, and with the two CPU fixes of ``peer_patches``),
NixlPushConnector (with those fixes) and MooncakeConnector (TCP). One deployment runs at a time
(P on core 0, D on core 1); rounds repeat the whole sequence, so drift and load hit every system
alike. Per (system, prompt length, requests in flight): TTFT p50/p90 and end-to-end latency from
the client (streamed), output tokens/s, CPU seconds per request of every process of the
deployment (engines and sidecars, from /proc), and every output's tokens against the one
engine's for the same prompt. A peer that is not installed, or a deployment that fails, is a row
that says so. One JSON object on stdout (``bench/vllm.ts`` formats it); progress on stderr.

    python -m kvxfer_vllm_testing.bench [--vs nixl,nixl-push,mooncake] [--lengths 32,256,1024,4096]
        [--concurrency 1,8] [--requests 8] [--rounds 2] [--output-tokens 16] [--quick]
        [--load N [--load-nice K]] [--prefault true|false] [--pin-engines]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from kvxfer_vllm.config import KV_MEMORY

from .harness import EngineSpec, Proc, SidecarProc, VllmServer, free_port, free_ports, metric, proc_stats
from .load import CpuHog, quantile_interval
from .netns import NetPair
from .netns import missing as netns_missing
from .tiny_model import TinyModelSpec, make_tiny_model

#: Bigger than the tests' model so the KV is not negligible: 8 layers x 4 KV heads x 64 = 8 KiB/token.
BENCH_MODEL = TinyModelSpec(layers=8, heads=8, kv_heads=4, head_dim=64, hidden=512, intermediate=1024,
                            max_positions=8192)
#: ``--model``: the bench's model (8 KiB of KV per token), or one with 64 KiB per token (32
#: layers, 8 KV heads: where the KV is large next to the compute, as in production models).
MODELS: dict[str, TinyModelSpec] = {
    "kv8": BENCH_MODEL,
    "kv64": TinyModelSpec(layers=32, heads=8, kv_heads=8, head_dim=64, hidden=512, intermediate=1024,
                          max_positions=8192),
}
#: Each engine's KV cache (``--kv-cache-mib``; 512 MiB: 8 prompts of 8192 tokens of the bench's model).
KV_CACHE_BYTES = 512 << 20


def link_name(mbit: int | None) -> str:
    """", link 1000 Mbit/s" / ", link uncapped" for a progress line ("" without --link)."""
    return "" if mbit is None else f", link {f'{mbit} Mbit/s' if mbit else 'uncapped'}"


def kv_bytes_per_token(m: TinyModelSpec) -> int:
    return m.layers * 2 * m.kv_heads * m.head_dim * 2

#: Every system, in the order a round runs them, with its label.
SYSTEMS: dict[str, str] = {
    "one": "one engine",
    "kvxfer-pull": "kvxfer pull",
    "kvxfer-push": "kvxfer push",
    "kvxfer-layerwise": "kvxfer push, layer-wise",
    # "2 fixes": the two CPU fixes of peer_patches (NIXL's progress delay, vLLM's core pinning).
    "nixl": "NixlConnector as shipped",
    "nixl-fixed": "NixlConnector, 2 fixes",
    "nixl-push": "NixlPushConnector, 2 fixes",
    "mooncake": "MooncakeConnector (TCP)",
}
#: ``--vs`` names -> the systems they add ("nixl-fixed": NixlConnector with its two CPU fixes alone).
VS: dict[str, list[str]] = {"nixl": ["nixl", "nixl-fixed"], "nixl-fixed": ["nixl-fixed"], "nixl-push": ["nixl-push"],
                            "mooncake": ["mooncake"]}
#: The Python distributions each peer needs (bench/peers/requirements.txt pins them).
PEER_DISTS: dict[str, list[str]] = {
    "nixl": ["nixl", "nixl-cu13"],
    "mooncake": ["mooncake-transfer-engine-non-cuda"],
}
PEER_MODULE = {"nixl": "nixl", "mooncake": "mooncake.engine"}
INSTALL_HINT = "kvxfer bench vllm --install-peers"
REQUEST_TIMEOUT = 300.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Answer:
    ttft: float
    e2e: float
    ids: list[int]
    #: Seconds from P's HTTP answer to D's first token (P/D only; negative when D's came first).
    d_side: float | None = None


def stream(url: str, model: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None,
           t0: float, headers: dict[str, str] | None = None) -> Answer:
    """Streams a greedy completion; times (seconds since ``t0``) of the first and last token, and
    the output's token ids."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    first = None
    ids: list[int] = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT,
                       headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                got = choice.get("token_ids") or []
                if got and first is None:
                    first = time.perf_counter() - t0
                ids.extend(got)
    last = time.perf_counter() - t0
    if not ids:
        raise RuntimeError(f"{url}: the stream carried no token_ids")
    return Answer(first if first is not None else last, last, ids)


def prefill(url: str, model: str, prompt: list[int], params: dict[str, Any],
            headers: dict[str, str] | None = None) -> dict[str, Any]:
    """P's half of a P/D request (``max_tokens=1``); P's answer."""
    r = requests.post(f"{url}/v1/completions", headers=headers, timeout=REQUEST_TIMEOUT, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "kv_transfer_params": params})
    if r.status_code != 200:
        raise RuntimeError(f"P {url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def answered(p_answer: dict[str, Any], hook: Callable[[], None] | None,
             at: dict[str, float] | None = None) -> dict[str, Any]:
    """P's answer, after running ``hook`` (a fault injected the moment P has answered); ``at["p"]``
    gets when it came."""
    if at is not None:
        at["p"] = time.perf_counter()
    if hook is not None:
        hook()
    return p_answer


def with_d_side(ans: Answer, at: dict[str, float], t0: float) -> Answer:
    """``ans`` with its D side: P's answer (``at["p"]``, see ``answered``) to D's first token."""
    if "p" in at:
        ans.d_side = ans.ttft - (at["p"] - t0)
    return ans


def both(p_call: Callable[[], Any], d_call: Callable[[], Answer]) -> Answer:
    """P's and D's requests at once (push, and routers that send D P's coordinates up front)."""
    err: list[BaseException] = []

    def run_p() -> None:
        try:
            p_call()
        except BaseException as e:  # noqa: BLE001 - reported below
            err.append(e)

    th = threading.Thread(target=run_p, daemon=True)
    th.start()
    ans = d_call()
    th.join(REQUEST_TIMEOUT)
    if err:
        raise err[0]
    return ans


def cpu_seconds(procs: dict[str, Proc]) -> dict[str, float]:
    """utime + stime of every live process in each process's group (its session: the harness
    starts each in its own), from /proc, in seconds."""
    tck = os.sysconf("SC_CLK_TCK")
    groups = {p.pid: name for name, p in procs.items()}
    out = dict.fromkeys(procs, 0.0)
    for _, fields in proc_stats():
        name = groups.get(int(fields[2]))
        if name is not None:
            out[name] += (int(fields[11]) + int(fields[12])) / tck
    return out


class Deployment:
    """One deployment of one or more systems; ``procs`` are the processes whose CPU time counts."""

    systems: tuple[str, ...] = ()
    procs: dict[str, Proc]
    model: str

    def serve(self, system: str, prompt: list[int], out: int, dead_port: int | None = None,
              on_p_answer: Callable[[], None] | None = None) -> Answer:
        """One request through ``system``; with ``dead_port`` D is told that port (nothing listens
        there) for P's side channel (kvxfer: P's sidecar; NIXL: its side channel; Mooncake: its
        bootstrap server): the peer unreachable. ``on_p_answer`` runs once P's answer is in (pull:
        before D is asked; push: with D's request already out)."""
        raise NotImplementedError

    def d_prompt_tokens(self) -> dict[str, float]:
        """D's prompt tokens so far by where they came from (vLLM's own counter): the KV that moved
        (``external_kv_transfer``) and what D computed itself (``local_compute``); {} without a D."""
        d = self.decode_engine
        if d is None:
            return {}
        url = f"{d.url}/metrics"
        return {k: metric(url, "vllm:prompt_tokens_by_source_total", source=k)
                for k in ("external_kv_transfer", "local_compute")}

    def failed_transfers(self) -> dict[str, int]:
        """kvxfer only: the sidecars' transfers that ended failed, expired or aborted so far, counted
        by side, state and reason ({} for the others, whose failures show in D's prompt tokens)."""
        return {}

    @property
    def prefill_engine(self) -> VllmServer | None:
        """The engine that holds the blocks D reads (None: no transfer)."""
        return getattr(self, "p", None)

    @property
    def decode_engine(self) -> VllmServer | None:
        """The engine that loads P's KV (None: no transfer)."""
        return getattr(self, "d", None)

    def close(self) -> None:
        for p in self.procs.values():
            p.stop(60)


def _engine(work: Path, model: str, engine_id: str, cores: str, max_len: int, **kw: Any) -> EngineSpec:
    return EngineSpec(model, engine_id, "", "", block_size=32, kv_cache_bytes=KV_CACHE_BYTES, max_model_len=max_len,
                      cores=cores, **kw)


def _start(specs: list[EngineSpec], work: Path, pin: bool = False) -> list[VllmServer]:
    """The engines, ready; with ``pin`` every process of each on its ``cores`` (EngineSpec.pin)."""
    servers: list[VllmServer] = []
    try:
        for s in specs:
            servers.append(VllmServer(dataclasses.replace(s, pin=pin), work))
        for v in servers:
            v.wait_ready()
    except BaseException:
        for v in servers:
            v.stop(60)
        raise
    return servers


class OneEngine(Deployment):
    systems = ("one",)

    def __init__(self, work: Path, model: str, max_len: int, pin: bool = False) -> None:
        self.model = model
        (self.e,) = _start([_engine(work, model, f"one-{os.getpid()}", "0", max_len, connector=False)], work, pin)
        self.procs = {"engine": self.e}

    def serve(self, system: str, prompt: list[int], out: int, dead_port: int | None = None,
              on_p_answer: Callable[[], None] | None = None) -> Answer:
        return stream(self.e.url, self.model, prompt, out, None, time.perf_counter())


class KvxferPair(Deployment):
    """kvxfer's connector and sidecars: pull (P first, D with P's answer) and push (both at once,
    D told P's sidecar address and the transfer id). The bench gives each mode a pair of its own."""

    systems = ("kvxfer-pull", "kvxfer-push", "kvxfer-layerwise")

    def __init__(self, work: Path, model: str, max_len: int, placement: str = "shared",
                 kv_memory: str = "file", pin: bool = False, idle_wait_s: float | None = None,
                 prefault: bool = True, worker_rest_s: float | None = None,
                 engine_spin_s: float | None = None, net: NetPair | None = None, layer_wise: bool = False) -> None:
        self.model = model
        self.shm = Path(tempfile.mkdtemp(prefix="kvxfer-bench-", dir="/dev/shm"))
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.procs = {}
        try:
            # --prefault true (the default here): the sidecars' mappings of the KV resident at once,
            # as operations.md advises for vLLM and the Helm chart deploys (without it, page faults
            # were most of a 1024-token read: journal/vllm.md); --prefault false is the CLI's default.
            pf = "true" if prefault else "false"

            def sidecar(side: str, role: str) -> SidecarProc:
                eid, sock = f"b{side}-{tag}", f"ipc://{work}/{side}-{tag}.sock"
                if net is None:
                    return SidecarProc(eid, role, sock, work, "--prefault", pf)
                # --link: each sidecar on its own "host", UCX over TCP on the (capped) data veth;
                # its engine stays here and reaches it over the ipc:// file.
                h = net.hosts[side]
                return SidecarProc(eid, role, sock, work, "--prefault", pf, "--transports", "tcp,self",
                                   "--net-devices", h.dev, listen=f"{h.address}:0", grpc=f"{h.mgmt_address}:0",
                                   prefix=h.prefix)

            self.p_sc = sidecar("p", "prefill")
            self.procs["P sidecar"] = self.p_sc
            self.d_sc = sidecar("d", "decode")
            self.procs["D sidecar"] = self.d_sc

            def spec(sc: SidecarProc, cores: str) -> EngineSpec:
                return EngineSpec(model, sc.engine_id, sc.socket, str(self.shm), block_size=32,
                                  kv_cache_bytes=KV_CACHE_BYTES, max_model_len=max_len, cores=cores,
                                  extra={"register_timeout_s": 600.0, "placement": placement,
                                         "kv_memory": kv_memory,
                                         **({"idle_wait_s": idle_wait_s} if idle_wait_s is not None else {}),
                                         **({"worker_rest_s": worker_rest_s} if worker_rest_s is not None else {}),
                                         **({"engine_spin_s": engine_spin_s} if engine_spin_s is not None else {}),
                                         **({"layer_wise": True} if layer_wise else {})})

            self.p, self.d = _start([spec(self.p_sc, "0"), spec(self.d_sc, "1")], work, pin)
            self.procs = {"P engine": self.p, "D engine": self.d, "P sidecar": self.p_sc, "D sidecar": self.d_sc}
        except BaseException:
            self.close()
            raise
        host, port = self.p_sc.side_channel.rsplit(":", 1)
        self.p_addr = (host, int(port))

    def serve(self, system: str, prompt: list[int], out: int, dead_port: int | None = None,
              on_p_answer: Callable[[], None] | None = None) -> Answer:
        tid = uuid.uuid4().hex
        t0 = time.perf_counter()
        p_params = {"do_remote_decode": True, "transfer_id": tid}
        at: dict[str, float] = {}
        if system == "kvxfer-pull":
            pr = answered(prefill(self.p.url, self.model, prompt, p_params), on_p_answer, at)
            params = dict(pr["kv_transfer_params"])
            if dead_port is not None:
                params["remote_port"] = dead_port
            return with_d_side(stream(self.d.url, self.model, prompt, out, params, t0), at, t0)
        d_params = {"do_remote_prefill": True, "remote_host": self.p_addr[0],
                    "remote_port": self.p_addr[1] if dead_port is None else dead_port, "transfer_id": tid}
        return with_d_side(both(lambda: answered(prefill(self.p.url, self.model, prompt, p_params), on_p_answer, at),
                                lambda: stream(self.d.url, self.model, prompt, out, d_params, t0)), at, t0)

    def failed_transfers(self) -> dict[str, int]:
        from kvxfer_vllm._gen.kvxfer.v1 import sidecar_pb2 as pb

        out: dict[str, int] = {}
        for sc in (self.p_sc, self.d_sc):
            for t in sc.transfers(pb.TRANSFER_STATE_FAILED, pb.TRANSFER_STATE_EXPIRED, pb.TRANSFER_STATE_ABORTED):
                side = pb.TransferSide.Name(t.side).removeprefix("TRANSFER_SIDE_")
                state = pb.TransferState.Name(t.state).removeprefix("TRANSFER_STATE_").lower()
                key = f"{side} {state}: {t.reason[:160]}"
                out[key] = out.get(key, 0) + 1
        return out

    def close(self) -> None:
        for p in self.procs.values():
            p.stop(60)
        shutil.rmtree(self.shm, ignore_errors=True)


class NixlPair(Deployment):
    """vLLM's NixlConnector (pull) or NixlPushConnector on CPU (``kv_buffer_device: cpu``), as a
    router drives them: pull as vLLM's toy proxy does; push with P's side channel up front and
    the same ``X-Request-Id`` on both halves (the push connector pairs P's and D's requests by id)."""

    def __init__(self, work: Path, model: str, max_len: int, *, push: bool, fixed: bool, pin: bool = False,
                 net: NetPair | None = None) -> None:
        self.model, self.push = model, push
        self.systems = ("nixl-push",) if push else (("nixl-fixed",) if fixed else ("nixl",))
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.p_id, self.d_id = f"np-{tag}", f"nd-{tag}"
        # HTTP and side-channel ports, distinct (a side channel that cannot bind hangs the engine).
        p_http, d_http, self.p_port, d_side = free_ports(4)
        patches = ("nixl-delay", "nixl-affinity") if fixed else ()

        # --link: each engine on its own "host" (NIXL's agent lives in the engine), its UCX over
        # TCP on the (capped) data veth, its side channel there too, HTTP on the management veth.
        self.p_host = "127.0.0.1" if net is None else net.hosts["p"].address

        def spec(eid: str, side_name: str, cores: str, http: int, side: int) -> EngineSpec:
            cfg = {"kv_connector": "NixlPushConnector" if push else "NixlConnector", "kv_role": "kv_both",
                   "kv_buffer_device": "cpu", "engine_id": eid}
            env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
            where: dict[str, Any] = {}
            if net is not None:
                h = net.hosts[side_name]
                env |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": h.address, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": h.dev}
                where = {"prefix": h.prefix, "host": h.mgmt_address}
            return _engine(work, model, eid, cores, max_len, kv_config=cfg, patches=patches, port=http, env=env,
                           **where)

        self.p, self.d = _start([spec(self.p_id, "p", "0", p_http, self.p_port),
                                 spec(self.d_id, "d", "1", d_http, d_side)], work, pin)
        self.procs = {"P engine": self.p, "D engine": self.d}

    def serve(self, system: str, prompt: list[int], out: int, dead_port: int | None = None,
              on_p_answer: Callable[[], None] | None = None) -> Answer:
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        p_params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                    "remote_block_ids": None, "remote_host": None, "remote_port": None}
        at: dict[str, float] = {}
        if not self.push:
            pr = answered(prefill(self.p.url, self.model, prompt, p_params, headers), on_p_answer, at)
            params = dict(pr["kv_transfer_params"])
            if dead_port is not None:
                params["remote_port"] = dead_port
            return with_d_side(stream(self.d.url, self.model, prompt, out, params, t0, headers), at, t0)
        # P's request id as vLLM's OpenAI server makes it from the header (its engine then appends a
        # random suffix, which the push connector strips when it pairs P's and D's requests).
        d_params = {"do_remote_prefill": True, "remote_engine_id": self.p_id, "remote_host": self.p_host,
                    "remote_port": self.p_port if dead_port is None else dead_port, "tp_size": 1,
                    "remote_request_id": f"cmpl-{rid}-0"}
        return with_d_side(
            both(lambda: answered(prefill(self.p.url, self.model, prompt, p_params, headers), on_p_answer, at),
                 lambda: stream(self.d.url, self.model, prompt, out, d_params, t0, headers)), at, t0)


class MooncakePair(Deployment):
    """vLLM's MooncakeConnector over TCP as vllm-router's mooncake mode drives it: P and D at once,
    D told P's engine id, P's bootstrap URL and the transfer id. Its worker needs the
    ``mooncake-device`` patch to start without an accelerator."""

    systems = ("mooncake",)

    def __init__(self, work: Path, model: str, max_len: int, pin: bool = False) -> None:
        self.model = model
        tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.p_id = f"mp-{tag}"
        p_http, d_http, self.boot = free_ports(3)

        def spec(eid: str, role: str, cores: str, http: int) -> EngineSpec:
            cfg = {"kv_connector": "MooncakeConnector", "kv_role": role, "kv_buffer_device": "cpu",
                   "engine_id": eid, "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
            return _engine(work, model, eid, cores, max_len, kv_config=cfg, patches=("mooncake-device",), port=http,
                           env={"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.boot)})

        self.p, self.d = _start([spec(self.p_id, "kv_producer", "0", p_http),
                                 spec(f"md-{tag}", "kv_consumer", "1", d_http)], work, pin)
        self.procs = {"P engine": self.p, "D engine": self.d}

    def serve(self, system: str, prompt: list[int], out: int, dead_port: int | None = None,
              on_p_answer: Callable[[], None] | None = None) -> Answer:
        t0 = time.perf_counter()
        tid = uuid.uuid4().hex
        d_params = {"do_remote_prefill": True, "remote_engine_id": self.p_id,
                    "remote_bootstrap_addr": f"http://127.0.0.1:{self.boot if dead_port is None else dead_port}",
                    "transfer_id": tid}
        at: dict[str, float] = {}
        return with_d_side(both(lambda: answered(prefill(self.p.url, self.model, prompt,
                                                         {"do_remote_decode": True, "transfer_id": tid}), on_p_answer, at),
                                lambda: stream(self.d.url, self.model, prompt, out, d_params, t0)), at, t0)


#: The deployments a round starts, in order, with the systems each serves.
def deployments(systems: list[str], kvxfer: dict[str, Any], pin: bool = False, net: NetPair | None = None
                ) -> list[tuple[tuple[str, ...], Callable[[Path, str, int], Deployment]]]:
    """``pin``: every process of every engine on its core (EngineSpec.pin), for every system alike;
    ``net``: P's and D's transfer agents (kvxfer's sidecars, NIXL's engines) on the two "hosts"
    of that pair of namespaces, their KV over TCP on its data link (``--link``)."""
    out: list[tuple[tuple[str, ...], Callable[[Path, str, int], Deployment]]] = [
        (("one",), lambda w, m, n: OneEngine(w, m, n, pin=pin))]
    # One pair per mode, like every other system: pull and push on one pair would share its
    # engines' prefix caches, and push (asked second, the same prompts) found all but the last
    # block of each prompt already on D and on P (it moved 32 of 256 prompt tokens).
    for mode in ("kvxfer-pull", "kvxfer-push", "kvxfer-layerwise"):
        if mode in systems:
            out.append(((mode,), lambda w, m, n, lw=mode == "kvxfer-layerwise": KvxferPair(
                w, m, n, **kvxfer, pin=pin, net=net, layer_wise=lw)))
    if "nixl" in systems:
        out.append((("nixl",), lambda w, m, n: NixlPair(w, m, n, push=False, fixed=False, pin=pin, net=net)))
    if "nixl-fixed" in systems:
        out.append((("nixl-fixed",), lambda w, m, n: NixlPair(w, m, n, push=False, fixed=True, pin=pin, net=net)))
    if "nixl-push" in systems:
        out.append((("nixl-push",), lambda w, m, n: NixlPair(w, m, n, push=True, fixed=True, pin=pin, net=net)))
    if "mooncake" in systems:
        out.append((("mooncake",), lambda w, m, n: MooncakePair(w, m, n, pin=pin)))
    return out


def peer_of(system: str) -> str | None:
    return "nixl" if system.startswith("nixl") else ("mooncake" if system == "mooncake" else None)


def peers_installed() -> dict[str, dict[str, Any]]:
    """Each peer's distributions and versions, whether its module imports' spec is found, and how
    it got there (bench/peers/requirements.txt, hash-checked, without dependencies)."""
    out: dict[str, dict[str, Any]] = {}
    for peer, dists in PEER_DISTS.items():
        versions: dict[str, str | None] = {}
        for d in dists:
            try:
                versions[d] = importlib.metadata.version(d)
            except importlib.metadata.PackageNotFoundError:
                versions[d] = None
        try:
            found = importlib.util.find_spec(PEER_MODULE[peer].split(".")[0]) is not None
        except (ImportError, ValueError):
            found = False
        ok = found and all(versions.values())
        out[peer] = {"installed": ok, "versions": versions,
                     "how": ("pip install --no-deps -r bench/peers/requirements.txt (pinned, hash-checked; "
                             "scripts/setup-python.sh installs NIXL's part)") if ok else f"missing: run {INSTALL_HINT}"}
    return out


def prompt_of(n: int, seed: int) -> list[int]:
    """A distinct prompt per request (random ids), so no request hits a prefix cache."""
    rnd = random.Random(seed)
    return [rnd.randrange(3, BENCH_MODEL.vocab) for _ in range(n)]


@dataclass
class Cell:
    """What one (system, prompt length, in flight) collects over the rounds."""

    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    #: P's answer to D's first token, per request (P/D systems).
    d_side: list[float] = field(default_factory=list)
    out_tokens: int = 0
    wall: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    requests: int = 0
    correct: int = 0
    compared: int = 0
    errors: list[str] = field(default_factory=list)
    status: str = "ok"
    #: D's prompt tokens by source over the cell's requests (what moved, what D computed).
    d_tokens: dict[str, float] = field(default_factory=dict)
    #: --link: bytes sent over the data link (both directions) during the cell's batches.
    link_bytes: int = 0
    #: kvxfer: the cell's transfers that failed, by side, state and reason (the sidecars' own record).
    kv_failures: dict[str, int] = field(default_factory=dict)


def nearest_rank(ordered: list[float], p: float) -> float | None:
    """The ``p`` quantile of an already sorted list, by nearest rank (None when it is empty)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, -(-int(p * len(ordered) * 1000) // 1000) - 1))]


def distribution(xs: list[float]) -> dict[str, Any]:
    """p50, p90 and every sample of ``xs`` (seconds), in ms; the samples in the order the requests
    were sent, round after round: at 8 in flight a cell's TTFT is a staircase of P's prefill steps,
    and its p50 can sit on a step."""
    ms = [x * 1000 for x in xs]
    ordered = sorted(ms)
    # 95% intervals by order statistics (load.quantile_interval): None where the samples are too
    # few to bound that side (a p90 of 15 samples has no upper end).
    return {"p50": nearest_rank(ordered, 0.5), "p90": nearest_rank(ordered, 0.9), "n": len(ms),
            "p50_ci": list(quantile_interval(ordered, 0.5)), "p90_ci": list(quantile_interval(ordered, 0.9)),
            "samples": [round(x, 1) for x in ms]}


def run(systems: list[str], lengths: list[int], concurrency: list[int], requests_per: int, rounds: int,
        out_tokens: int, work_root: Path | None = None,
        on_ready: Callable[[Deployment], None] | None = None, kvxfer: dict[str, Any] | None = None,
        faults: bool = False, pin_engines: bool = False, load: CpuHog | None = None,
        link_mbit: list[int] | None = None, model_spec: TinyModelSpec = BENCH_MODEL,
        kv_cache_bytes: int = 512 << 20) -> dict[str, Any]:
    """The bench; ``kvxfer`` holds the connector's ``placement`` and ``kv_memory`` and the sidecars'
    ``prefault``; ``pin_engines`` puts every process of each engine on its core (the model threads
    are always bound); ``load`` runs beside every deployment, from the first to the last (``--load``);
    ``on_ready`` sees each deployment once it has answered its warm-up requests; ``link_mbit``
    (``--link``): P's and D's transfer agents on two network namespaces, the KV over TCP on the
    veth between them, capped at each of these Mbit/s each way in turn (0: not capped) on the
    same deployments, so every link's cells run in the same rounds."""
    kvxfer = {"placement": "shared", "kv_memory": "file", "prefault": True, **(kvxfer or {})}
    load = load or CpuHog(0)
    import vllm

    peers = peers_installed()
    work = Path(tempfile.mkdtemp(prefix="kvxfer-bench-vllm-", dir=work_root))
    global KV_CACHE_BYTES
    KV_CACHE_BYTES = kv_cache_bytes
    model = make_tiny_model(str(work / "model"), model_spec)
    max_len = max(lengths) + out_tokens + 64
    links: list[int | None] = list(link_mbit) if link_mbit else [None]
    cells: dict[tuple[str, int | None, int, int], Cell] = {
        (s, lk, n, c): Cell() for s in systems for lk in links for n in lengths for c in concurrency}
    reference: dict[int, list[int]] = {}
    fault_rows: list[dict[str, Any]] = []
    one_engine: list[OneEngine] = []
    load_before = os.getloadavg()
    net: NetPair | None = None
    try:
        if link_mbit:
            net = NetPair("bl", 71)
        load.start()
        for r in range(rounds):
            for served, make in deployments(systems, kvxfer, pin_engines, net):
                missing = [s for s in served if (pe := peer_of(s)) is not None and not peers[pe]["installed"]]
                for s in missing:
                    for (cs, _, _, _), cell in cells.items():
                        if cs == s:
                            cell.status = f"not installed: run {INSTALL_HINT}"
                served = tuple(s for s in served if s not in missing)
                if not served:
                    continue
                log(f"round {r + 1}/{rounds}: starting {', '.join(SYSTEMS[s] for s in served)} ...")
                dep = None
                for attempt in (1, 2):  # a port taken by another process meanwhile: once more, new ports
                    try:
                        dep = make(work, model, max_len)
                        break
                    except Exception as err:  # noqa: BLE001 - a failed deployment is a row, not a crash
                        log(f"  failed to start (attempt {attempt}): {str(err)[:2000]}")
                        failure = err
                if dep is None:
                    err = failure
                    for (cs, _, _, _), cell in cells.items():
                        if cs in served:
                            cell.status = f"failed to start: {str(err).splitlines()[0][:300]}"
                    continue
                try:
                    for s in served:  # the first requests of each kind pay for lazy initialisation
                        for w in range(2):
                            try:
                                dep.serve(s, prompt_of(64, 10_000_000 + w), 2)
                            except Exception as err:  # noqa: BLE001
                                log(f"  warm-up of {s} failed: {err}")
                    if on_ready is not None:
                        on_ready(dep)
                    for lk in links:
                        if net is not None and lk:
                            net.cap(lk)
                        elif net is not None:
                            net.uncap()
                        for n in lengths:
                            for c in concurrency:
                                for s in served:
                                    cell = cells[(s, lk, n, c)]
                                    sent = net.sent_bytes() if net is not None else 0
                                    batch(dep, s, cell, n, c, requests_per, r, out_tokens, reference,
                                          salt=0 if lk is None else lk + 1)
                                    if net is not None:
                                        cell.link_bytes += net.sent_bytes() - sent
                                log(f"  {n} tokens, {c} in flight{link_name(lk)}: done")
                    if faults and r == 0 and isinstance(dep, OneEngine):
                        one_engine.append(dep)
                        continue  # kept running: the fault rows compare with its outputs
                    if faults and r == 0 and one_engine:
                        ref = one_engine[0]
                        for s in served:
                            fault_rows.append(unreachable_peer(
                                dep, s, min(lengths), out_tokens,
                                lambda pr: stream(ref.e.url, model, pr, out_tokens, None, time.perf_counter()).ids))
                            log(f"  fault rows of {s}: {fault_rows[-1]}")
                finally:
                    if dep not in one_engine:
                        dep.close()
        if faults and one_engine:
            ref = one_engine[0]
            try:
                fault_rows += destructive_fault_rows(
                    systems, kvxfer, peers, work, model, max_len, min(lengths), max(concurrency), out_tokens,
                    lambda pr: stream(ref.e.url, model, pr, out_tokens, None, time.perf_counter()).ids,
                    pin_engines)
            except Exception as err:  # noqa: BLE001 - the rounds' rows stand; the failure is a row
                log(f"fault rows failed: {err}")
                fault_rows.append({"system": "-", "label": "-", "fault": "(the harness)", "tokens": 0,
                                   "client": f"harness error: {str(err)[:200]}", "identical": None,
                                   "e2e_ms": 0.0, "next_request_identical": "-"})
    finally:
        for dep in one_engine:
            dep.close()
        load.stop()
        if net is not None:
            net.destroy()
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for (s, lk, n, c), cell in cells.items():
        if cell.status == "ok" and cell.errors and not cell.ttft:
            cell.status = f"failed: {cell.errors[0][:300]}"
        label = SYSTEMS[s] if len(links) == 1 else f"{SYSTEMS[s]}, {f'{lk} Mbit/s' if lk else 'uncapped'}"
        rows.append({
            "system": s, "label": label, "tokens": n, "concurrency": c, "status": cell.status,
            # --link: the data link's cap for this cell (0: not capped; absent without --link).
            **({"link_mbit": lk} if lk is not None else {}),
            "requests": cell.requests,
            "ttft_ms": distribution(cell.ttft),
            "e2e_ms": distribution(cell.e2e),
            # P's HTTP answer -> D's first token: what D's side costs once P has answered.
            "d_side_ms": distribution(cell.d_side),
            "output_tokens_per_s": cell.out_tokens / cell.wall if cell.wall > 0 else None,
            "cpu_s_per_request": ({k: v / cell.requests for k, v in cell.cpu.items()} | {
                "total": sum(cell.cpu.values()) / cell.requests}) if cell.requests else None,
            "correct": {"identical": cell.correct, "compared": cell.compared},
            # Per request, from D's vLLM: prompt tokens whose KV moved, and those D computed itself.
            "d_prompt_tokens_per_request": {k: v / cell.requests for k, v in cell.d_tokens.items()}
            if cell.requests and cell.d_tokens else None,
            # --link: what crossed the data link per request (the KV and its control messages).
            "link_mib_per_request": cell.link_bytes / cell.requests / 2**20 if net is not None and cell.requests
            else None,
            "kv_failures": cell.kv_failures or None,
            "errors": cell.errors[:3], "error_count": len(cell.errors),
        })
    return {
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, load {load_before[0]:.2f} before, "
                   f"{os.getloadavg()[0]:.2f} after",
        "vllm": vllm.__version__,
        "peers": peers,
        "model": {"layers": model_spec.layers, "kv_heads": model_spec.kv_heads, "head_dim": model_spec.head_dim,
                  "dtype": "bfloat16",
                  "kv_bytes_per_token": kv_bytes_per_token(model_spec)},
        "engine": {"block_size": 32, "max_model_len": max_len, "kv_cache_bytes": kv_cache_bytes, "cores": "P 0, D 1, one 0",
                   "pinned": "every process of each engine" if pin_engines else "the model threads only",
                   "enforce_eager": True},
        "load": load.describe(),
        "link": None if not link_mbit else {
            "mbits": link_mbit,
            "what": "P's and D's transfer agents in two network namespaces, KV over TCP on one veth, "
                    + " / ".join(f"tbf {x} Mbit/s each way" if x else "not capped" for x in link_mbit)
                    + (" (in turn, on the same deployments)" if len(link_mbit) > 1 else "")},
        "kvxfer": kvxfer, "output_tokens": out_tokens, "rounds": rounds, "requests_per_round": requests_per,
        "rows": rows,
        "fault_rows": fault_rows,
    }


def destructive_fault_rows(systems: list[str], kvxfer: dict[str, Any], peers: dict[str, dict[str, Any]], work: Path,
                           model: str, max_len: int, n: int, in_flight: int, out: int,
                           reference_of: Callable[[list[int]], list[int]], pin: bool = False) -> list[dict[str, Any]]:
    """Each of ``DESTRUCTIVE_FAULTS`` for each installed P/D system, on a deployment of its own."""
    rows: list[dict[str, Any]] = []
    for served, make in deployments(systems, kvxfer, pin):
        for s in served:
            if s == "one" or ((pe := peer_of(s)) is not None and not peers[pe]["installed"]):
                continue
            for fault in DESTRUCTIVE_FAULTS:
                name = FAULT_LABELS[fault.__name__]
                log(f"fault ({fault.__name__}) on {SYSTEMS[s]}: starting ...")
                try:
                    dep = make(work, model, max_len)
                except Exception as err:  # noqa: BLE001 - a row, not a crash
                    rows.append({"system": s, "label": SYSTEMS[s], "fault": name, "tokens": n,
                                 "client": f"failed to start: {str(err).splitlines()[0][:200]}",
                                 "identical": None, "e2e_ms": 0.0, "next_request_identical": "-"})
                    continue
                try:
                    for w in range(2):  # lazy initialisation, as in the rounds
                        dep.serve(s, prompt_of(64, 10_000_000 + w), 2)
                    rows.append(fault(dep, s, n, out, reference_of, in_flight))
                    log(f"  fault row: {rows[-1]}")
                except Exception as err:  # noqa: BLE001
                    rows.append({"system": s, "label": SYSTEMS[s], "fault": name, "tokens": n,
                                 "client": f"harness error: {str(err)[:200]}", "identical": None, "e2e_ms": 0.0,
                                 "next_request_identical": "-"})
                finally:
                    dep.close()
    return rows


def batch(dep: Deployment, system: str, cell: Cell, n: int, c: int, count: int, rnd: int, out: int,
          reference: dict[int, list[int]], salt: int = 0) -> None:
    """``count`` requests of ``n`` tokens, ``c`` at a time; the same prompts for every system.
    ``salt`` (--link: one per link) gives other prompts, so that no link's requests find another
    link's in a prefix cache."""
    seeds = [hash((n, c, rnd, i, *((salt,) if salt else ()))) & 0x7FFFFFFF for i in range(count)]
    before = cpu_seconds(dep.procs)
    d_before = dep.d_prompt_tokens()
    failed_before = dep.failed_transfers()
    t0 = time.perf_counter()

    def one(seed: int) -> tuple[int, Answer | BaseException]:
        try:
            return seed, dep.serve(system, prompt_of(n, seed), out)
        except Exception as err:  # noqa: BLE001 - counted in the row
            return seed, err

    pool = ThreadPoolExecutor(max_workers=c)
    try:
        results = list(pool.map(one, seeds))
    finally:
        # Not waiting here: when SIGTERM unwinds the run, stopping the deployment (run's finally)
        # is what ends the requests still out (each may wait up to REQUEST_TIMEOUT otherwise).
        pool.shutdown(wait=False, cancel_futures=True)
    cell.wall += time.perf_counter() - t0
    after = cpu_seconds(dep.procs)
    for k, v in dep.d_prompt_tokens().items():
        cell.d_tokens[k] = cell.d_tokens.get(k, 0.0) + v - d_before.get(k, 0.0)
    for k, v in dep.failed_transfers().items():
        if v > failed_before.get(k, 0):
            cell.kv_failures[k] = cell.kv_failures.get(k, 0) + v - failed_before.get(k, 0)
    for k in after:
        cell.cpu[k] = cell.cpu.get(k, 0.0) + after[k] - before.get(k, 0.0)
    cell.requests += count
    for seed, res in results:
        if isinstance(res, BaseException):
            cell.errors.append(str(res)[:300])
            continue
        cell.ttft.append(res.ttft)
        cell.e2e.append(res.e2e)
        if res.d_side is not None:
            cell.d_side.append(res.d_side)
        cell.out_tokens += len(res.ids)
        if system == "one":
            reference[seed] = res.ids
        elif seed in reference:
            cell.compared += 1
            cell.correct += res.ids == reference[seed]


def unreachable_peer(dep: Deployment, system: str, n: int, out: int, reference_of: Callable[[list[int]], list[int]],
                     hold_s: float = 60.0) -> dict[str, Any]:
    """One request whose D is told a dead port for P's side channel: what the client sees, whether
    D's output is still one engine's (D recomputed: D's prompt tokens by source say so), how long
    until P's KV cache usage is back to an idle P's (P's blocks returned; polled up to ``hold_s``,
    P probed so that its gauge refreshes), and whether the next ordinary request is correct."""
    prompt = prompt_of(n, 20_000_000 + n)
    row: dict[str, Any] = {"system": system, "label": SYSTEMS[system], "fault": "peer unreachable", "tokens": n}
    p = dep.prefill_engine
    baseline = probed_usage(p, dep.model)
    faulted_request(row, dep, system, prompt, out, reference_of, dead_port=free_port())
    if p is not None:
        row["p_kv_usage_zero_after_s"] = p_blocks_free(p, dep.model, baseline, hold_s)
    row["next_request_identical"] = serves_correctly(
        lambda pr: dep.serve(system, pr, out), prompt_of(n, 20_000_001 + n), reference_of)
    return row


def faulted_request(row: dict[str, Any], dep: Deployment, system: str, prompt: list[int], out: int,
                    reference_of: Callable[[list[int]], list[int]], **serve: Any) -> None:
    """One request through ``system`` with a fault (``serve``'s keywords): what the client saw,
    whether the output is one engine's, the time, and D's prompt tokens by source, into ``row``."""
    d_before = dep.d_prompt_tokens()
    t0 = time.perf_counter()
    try:
        ans = dep.serve(system, prompt, out, **serve)
        row["client"] = "answered"
        row["identical"] = ans.ids == reference_of(prompt)
    except Exception as err:  # noqa: BLE001 - what the client sees is the finding
        row["client"] = f"error: {str(err)[:200]}"
        row["identical"] = None
    row["e2e_ms"] = (time.perf_counter() - t0) * 1000
    row["d_prompt_tokens"] = kv_source(d_before, dep.d_prompt_tokens())


def serves_correctly(call: Callable[[list[int]], Answer], prompt: list[int],
                     reference_of: Callable[[list[int]], list[int]]) -> bool | str:
    """After a fault: whether ``call`` answers ``prompt`` with one engine's tokens ("error: ..." if not at all)."""
    try:
        return call(prompt).ids == reference_of(prompt)
    except Exception as err:  # noqa: BLE001
        return f"error: {str(err)[:200]}"


def kv_source(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """D's prompt tokens between two readings of vLLM's counter, by where they came from."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def probed_usage(p: VllmServer | None, model: str) -> float | None:
    """P's KV cache usage gauge right after a one-token request of its own, which makes P step and
    refresh the gauge (on an idle P: the probe's own block). None: no P, or P does not answer."""
    if p is None:
        return None
    try:
        stream(p.url, model, [5, 6, 7], 1, None, time.perf_counter())
        return p.metric("vllm:kv_cache_usage_perc")
    except (requests.RequestException, RuntimeError):
        return None


def p_blocks_free(p: VllmServer, model: str, baseline: float | None, hold_s: float) -> float | None:
    """Seconds until P's probed KV cache usage is back at ``baseline`` (an idle P's, from
    ``probed_usage`` before the fault). None: not within ``hold_s``, or P is gone."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < hold_s:
        usage = probed_usage(p, model)
        if usage is None:
            return None
        if baseline is not None and usage <= baseline + 1e-9:
            return time.monotonic() - t0
        time.sleep(0.5)
    return None


def p_killed_after_answer(dep: Deployment, system: str, n: int, out: int,
                          reference_of: Callable[[list[int]], list[int]], in_flight: int) -> dict[str, Any]:
    """P's engine SIGKILLed the moment its answer reaches the client (pull: before D is asked;
    push: D's request already out): what the client sees, whether D's output is one engine's, and
    whether D's prompt came from moved KV or was recomputed; then whether D alone still serves."""
    prompt = prompt_of(n, 30_000_000 + n)
    row: dict[str, Any] = {"system": system, "label": SYSTEMS[system],
                           "fault": FAULT_LABELS["p_killed_after_answer"], "tokens": n}
    p = dep.prefill_engine
    assert p is not None
    faulted_request(row, dep, system, prompt, out, reference_of, on_p_answer=p.kill)
    d = dep.decode_engine
    assert d is not None
    # D on its own (no transfer): does it still serve correctly?
    row["next_request_identical"] = serves_correctly(
        lambda pr: stream(d.url, dep.model, pr, out, None, time.perf_counter()), prompt_of(n, 30_000_001 + n),
        reference_of)
    return row


def d_killed_mid_load(dep: Deployment, system: str, n: int, out: int,
                      reference_of: Callable[[list[int]], list[int]], in_flight: int,
                      hold_s: float = 60.0) -> dict[str, Any]:
    """``in_flight`` requests at once; D's engine SIGKILLed as soon as P has answered the first of
    them: how many the client got answered and what the others saw, how long until P's KV cache
    usage is back to an idle P's (P's blocks returned), and whether P alone still serves."""
    row: dict[str, Any] = {"system": system, "label": SYSTEMS[system],
                           "fault": FAULT_LABELS["d_killed_mid_load"], "tokens": n}
    p = dep.prefill_engine
    d = dep.decode_engine
    assert d is not None
    assert p is not None
    baseline = probed_usage(p, dep.model)
    first = threading.Event()
    prompts = [prompt_of(n, 40_000_000 + i) for i in range(in_flight)]

    def one(pr: list[int]) -> Answer | BaseException:
        try:
            return dep.serve(system, pr, out, on_p_answer=first.set)
        except Exception as err:  # noqa: BLE001 - counted in the row
            return err

    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=in_flight)
    try:
        futures = [pool.submit(one, pr) for pr in prompts]
        first.wait(REQUEST_TIMEOUT)
        d.kill()
        results = [f.result(REQUEST_TIMEOUT + 30) for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    row["e2e_ms"] = (time.perf_counter() - t0) * 1000
    errors = [r for r in results if isinstance(r, BaseException)]
    row["client"] = f"{len(results) - len(errors)}/{len(results)} answered" + (
        f"; error: {str(errors[0])[:160]}" if errors else "")
    done = [(pr, r) for pr, r in zip(prompts, results) if not isinstance(r, BaseException)]
    row["identical"] = all(r.ids == reference_of(pr) for pr, r in done) if done else None
    row["p_kv_usage_zero_after_s"] = p_blocks_free(p, dep.model, baseline, hold_s)
    # P on its own: does it still serve correctly?
    row["next_request_identical"] = serves_correctly(
        lambda pr: stream(p.url, dep.model, pr, out, None, time.perf_counter()), prompt_of(n, 40_000_100 + n),
        reference_of)
    return row


#: Faults that end the deployment they hit: each runs on a fresh one, after the rounds.
DESTRUCTIVE_FAULTS = (p_killed_after_answer, d_killed_mid_load)
FAULT_LABELS = {"p_killed_after_answer": "P's engine killed after answering",
                "d_killed_mid_load": "D's engine killed mid-load"}


def main() -> None:
    # SIGTERM (a stopped parent, a timeout) unwinds like Ctrl-C: engines, sidecars and files go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(prog="kvxfer bench vllm", description=__doc__.splitlines()[0])
    ap.add_argument("--vs", default="",
                    help="peers beside kvxfer: nixl (as shipped and fixed), nixl-fixed, nixl-push, mooncake (comma-separated)")
    ap.add_argument("--modes", default="pull,push",
                    help="kvxfer's modes: pull, push, layerwise (push with the connector's layer_wise)")
    ap.add_argument("--placement", default="shared", choices=("shared", "host_buffer"), help="kvxfer's KV placement")
    ap.add_argument("--kv-memory", default="file", choices=KV_MEMORY, help="kvxfer's KV memory")
    ap.add_argument("--lengths", default="32,256,1024,4096")
    ap.add_argument("--concurrency", default="1,8", help="requests in flight")
    ap.add_argument("--requests", type=int, default=8, help="requests per cell and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--faults", action="store_true",
                    help="each P/D system once with P's side channel unreachable (after the first round's "
                         "requests), then on fresh deployments: P's engine killed after answering, D's engine "
                         "killed mid-load")
    ap.add_argument("--quick", action="store_true", help="256 tokens, 1 in flight, 2 requests, 1 round")
    ap.add_argument("--idle-wait-s", type=float, default=None,
                    help="kvxfer's idle_wait_s (default: the connector's; 0: vLLM's own loop while waiting)")
    ap.add_argument("--worker-rest-s", type=float, default=None,
                    help="kvxfer's worker_rest_s (default: the connector's; 0: vLLM's worker spins a second "
                         "after each step)")
    ap.add_argument("--engine-spin-s", type=float, default=None,
                    help="kvxfer's engine_spin_s (default: the connector's; 0: vLLM's engine core spins a second "
                         "on its workers' answers)")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="N CPU hog processes (a Python busy loop each, not pinned) beside the engines for the "
                         "whole run, so loaded cells are reproducible")
    ap.add_argument("--load-nice", type=int, default=0, metavar="K", help="the hogs' niceness (default 0)")
    ap.add_argument("--prefault", default="true", choices=("true", "false"),
                    help="kvxfer's sidecars' --prefault (default true, as the Helm chart deploys them)")
    ap.add_argument("--link", default=None, metavar="MBIT[,MBIT...]",
                    help="P's and D's transfer agents (kvxfer's sidecars, NIXL's engines) on two network namespaces "
                         "joined by one veth, their KV over TCP, capped at MBIT Mbit/s each way (tbf; 0: not capped); "
                         "several: each in turn on the same deployments, every round; needs root, ip, tc, iptables")
    ap.add_argument("--model", default="kv8", choices=tuple(MODELS),
                    help="kv8: the bench's model (8 layers, 8 KiB of KV per token); kv64: 32 layers, 8 KV heads "
                         "(64 KiB per token)")
    ap.add_argument("--kv-cache-mib", type=int, default=512, help="each engine's KV cache (MiB)")
    ap.add_argument("--pin-engines", action="store_true",
                    help="every process of each engine on its core (taskset), for every system alike; "
                         "without it only vLLM's model threads are bound")
    a = ap.parse_args()
    systems = ["one"]
    for m in a.modes.split(","):
        if m not in ("pull", "push", "layerwise"):
            ap.error(f"--modes: unknown mode {m!r} (pull, push, layerwise)")
        systems.append(f"kvxfer-{m}")
    for v in (x for x in a.vs.split(",") if x):
        if v not in VS:
            ap.error(f"--vs: unknown peer {v!r} ({', '.join(VS)})")
        systems += VS[v]
    systems = [s for s in SYSTEMS if s in systems]
    links: list[int] | None = None
    if a.link is not None:
        try:
            links = [int(x) for x in a.link.split(",")]
        except ValueError:
            ap.error(f"--link: {a.link!r} is not a list of rates in Mbit/s (0: not capped)")
        if any(x < 0 for x in links):
            ap.error(f"--link: {a.link!r} is not a list of rates in Mbit/s (0: not capped)")
        if (why := netns_missing()) is not None:
            ap.error(f"--link: {why}")
        if "mooncake" in systems:
            ap.error("--link: MooncakeConnector runs on loopback only here (not split across namespaces)")
        if a.faults:
            ap.error("--link and --faults: one at a time")
    if a.quick:
        lengths, conc, reqs, rounds = [256], [1], 2, 1
    else:
        lengths = [int(x) for x in a.lengths.split(",")]
        conc = [int(x) for x in a.concurrency.split(",")]
        reqs, rounds = a.requests, a.rounds
    res = run(systems, lengths, conc, max(reqs, max(conc)), rounds, a.output_tokens,
              kvxfer={"placement": a.placement, "kv_memory": a.kv_memory, "prefault": a.prefault == "true",
                      **({"idle_wait_s": a.idle_wait_s} if a.idle_wait_s is not None else {}),
                      **({"worker_rest_s": a.worker_rest_s} if a.worker_rest_s is not None else {}),
                      **({"engine_spin_s": a.engine_spin_s} if a.engine_spin_s is not None else {})},
              faults=a.faults,
              pin_engines=a.pin_engines, load=CpuHog(a.load, a.load_nice), link_mbit=links,
              model_spec=MODELS[a.model], kv_cache_bytes=a.kv_cache_mib << 20)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
