"""Real P/D deployments on one machine, for the tests and ``kvxfer bench vllm``: kvxfer sidecars
(the built ``kvxfer`` CLI), vLLM OpenAI servers with this connector, and a router client that does
what vLLM's own P/D proxy does. Every process runs in its own session and is stopped with its
children; every wait has a bound. Addresses are loopback only.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from .pki import shared_pki

REPO = Path(__file__).resolve().parents[3]


def cli_path() -> Path:
    """The built kvxfer CLI: $KVXFER_CLI, else this checkout's dist/src/cli/main.js."""
    p = Path(os.environ.get("KVXFER_CLI", REPO / "dist" / "src" / "cli" / "main.js"))
    if not p.exists():
        raise FileNotFoundError(f"{p} is missing: run `npm run build` (or set KVXFER_CLI)")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Proc:
    """A child in its own session: ``stop`` ends it and everything it started."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None, stdout: Any = None) -> None:
        self.args = args
        self.log_path = log
        self._log = open(log, "w")
        self.p = subprocess.Popen(
            args, stdout=stdout if stdout is not None else self._log, stderr=self._log, env=env,
            start_new_session=True, text=True,
        )

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self) -> None:
        """SIGKILL to the whole group: a crash, as peers see it. Returns once the leader is reaped,
        or after 30 s (on a loaded machine a vLLM with NIXL's spinning threads took longer than
        10 s to go); ``stop`` reaps what is left."""
        self._signal_group(signal.SIGKILL)
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the leader (it shuts its own children down, as vLLM does), the whole group
        a bound later, SIGKILL at the end; returns once nothing of the group is left."""
        if self.alive():
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.p.wait(10)
        deadline = time.monotonic() + timeout
        while _group_alive(self.p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(self.p.pid):
            self._signal_group(signal.SIGTERM)
            time.sleep(1)
        self._signal_group(signal.SIGKILL)
        self._log.close()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def wait_healthy(self, url: str, what: str, timeout: float, interval: float, fatal: tuple[str, ...] = ()) -> None:
        """Until ``url`` answers 200 (bounded); fails naming ``what`` if the process exits first, or
        at once when its log shows one of ``fatal`` (an error it would otherwise hang on)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{what} exited while starting:\n{self.tail()}")
            if fatal and any(f in self.tail(20000) for f in fatal):
                raise RuntimeError(f"{what} failed while starting:\n{self.tail()}")
            try:
                if requests.get(url, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(interval)
        raise RuntimeError(f"{what} not ready within {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""


def proc_stats():
    """(pid, the fields of /proc/PID/stat after the command) for every live process; after the
    command: state ppid pgrp session ... utime (index 11) stime (12)."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    yield int(d), f.read().rsplit(")", 1)[1].split()
            except OSError:
                pass


def group_pids(pgids: set[int]) -> list[int]:
    """Every live process whose process group is one of ``pgids``."""
    return [pid for pid, fields in proc_stats() if int(fields[2]) in pgids]


#: What vLLM's processes make in /dev/shm through Python's multiprocessing: shared memory
#: (``psm_*``: the executor's message queues, 160-240 MiB each) and named semaphores (``sem.mp-*``).
#: Their makers remove them on a clean exit; after a SIGKILL nobody does.
MP_SHM_PREFIXES = ("psm_", "sem.mp-")


def mp_shm_mapped(pids: list[int]) -> set[Path]:
    """The multiprocessing files in /dev/shm that ``pids`` have mapped. Found by inode: a named
    semaphore is mapped under the temporary name glibc made it with (since removed), then linked
    to its ``sem.mp-*`` name."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                inodes.add(int(parts[4]))
    found: set[Path] = set()
    if inodes:
        with os.scandir("/dev/shm") as entries:
            for e in entries:
                try:
                    if e.name.startswith(MP_SHM_PREFIXES) and e.inode() in inodes:
                        found.add(Path(e.path))
                except OSError:
                    pass
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class SidecarProc(Proc):
    """``kvxfer sidecar``; ``ready`` holds its ready line (side channel, gRPC address, epoch).
    Peers are authenticated with certificates from ``shared_pki()`` unless ``flags`` name others."""

    def __init__(self, engine_id: str, role: str, socket_ep: str, log_dir: Path, *flags: str,
                 ready_timeout: float = 20.0, listen: str = "127.0.0.1:0", grpc: str = "127.0.0.1:0",
                 prefix: tuple[str, ...] = ()) -> None:
        self.engine_id = engine_id
        self.socket = socket_ep
        auth = [] if "--peer-cert" in flags or "--insecure-peers" in flags else shared_pki().flags(engine_id)
        # KVXFER_SIDECAR_NODE_ARGS: flags for node itself (e.g. "--cpu-prof --cpu-prof-dir=DIR"),
        # as the simulator's sidecars take them; node refuses --cpu-prof in NODE_OPTIONS.
        node_args = os.environ.get("KVXFER_SIDECAR_NODE_ARGS", "").split()
        # ``prefix``: e.g. ``ip netns exec NS`` (a sidecar on another "host": netns.py).
        args = [*prefix, "node", *node_args, str(cli_path()), "sidecar", "--engine-id", engine_id, "--role", role,
                "--engine-socket", socket_ep, "--listen", listen, "--grpc", grpc,
                "--log-level", "info", *auth, *flags]
        super().__init__(args, log_dir / f"sidecar-{engine_id}-{time.monotonic_ns()}.log", stdout=subprocess.PIPE)
        self.ready = self._read_ready(ready_timeout)
        self.side_channel: str = self.ready["sideChannel"]
        self.grpc: str = self.ready["grpc"]

    def _read_ready(self, timeout: float) -> dict[str, Any]:
        out = self.p.stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([out], [], [], 0.2)[0]:
                line = out.readline()
                if line.startswith("{") and json.loads(line).get("event") == "ready":
                    return json.loads(line)
            if not self.alive():
                break
        self.stop()
        raise RuntimeError(f"sidecar {self.engine_id} not ready within {timeout} s:\n{self.tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        super().stop(timeout)
        if self.p.stdout:
            self.p.stdout.close()
        path = self.socket.removeprefix("ipc://")
        if self.socket.startswith("ipc://"):
            # A SIGKILLed sidecar cannot remove its own socket file, nor the lock beside it.
            for f in (path, path + ".lock"):
                if os.path.exists(f):
                    os.unlink(f)

    def transfers(self, *states: int, limit: int = 10_000) -> list[Any]:
        """The sidecar's transfers (``kvxfer.v1.Transfer``, trace included) from ListTransfers over
        gRPC; only those in ``states`` when given."""
        import grpc

        from kvxfer_vllm._gen.kvxfer.v1 import sidecar_pb2 as pb

        with grpc.insecure_channel(self.grpc) as ch:
            call = ch.unary_unary("/kvxfer.v1.Sidecar/ListTransfers",
                                  request_serializer=lambda r: r.SerializeToString(),
                                  response_deserializer=pb.ListTransfersResponse.FromString)
            return list(call(pb.ListTransfersRequest(states=list(states), limit=limit), timeout=30).transfers)

    def status(self) -> dict[str, Any]:
        out = subprocess.run(["node", str(cli_path()), "status", self.grpc, "--json"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"kvxfer status {self.grpc}: {out.stderr.strip()}")
        return json.loads(out.stdout)


@dataclass
class EngineSpec:
    model: str
    engine_id: str
    socket: str
    shm_dir: str
    port: int = field(default_factory=free_port)
    block_size: int = 32
    kv_cache_bytes: int = 32 << 20
    max_model_len: int = 1024
    dtype: str = "bfloat16"
    #: CPU cores for the engine's OpenMP threads ("0", "1", "0-1" or "nobind").
    cores: str = "nobind"
    #: More kv_connector_extra_config.
    extra: dict[str, Any] = field(default_factory=dict)
    #: Without the connector: a plain single engine (the reference).
    connector: bool = True
    #: Another connector's whole ``--kv-transfer-config`` (vLLM's own, for the bench's peers).
    kv_config: dict[str, Any] | None = None
    #: More environment for the engine's processes.
    env: dict[str, str] = field(default_factory=dict)
    #: Patches from ``peer_patches/sitecustomize.py`` for the engine's processes (none: no patch).
    patches: tuple[str, ...] = ()
    #: Every process of the engine (HTTP server, engine core, worker, all their threads) on
    #: ``cores``, through ``taskset``; otherwise only vLLM's model threads are bound and the rest
    #: float over every core (where, on a shared host, they take time from the other engine).
    pin: bool = False
    #: Run the engine on another "host": e.g. ``ip netns exec NS`` (netns.py), serving HTTP on
    #: ``host`` (an address that namespace has, reachable from here).
    prefix: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    #: More flags for vLLM's server (e.g. ``--max-num-batched-tokens 128``: chunked prefill).
    args: tuple[str, ...] = ()


#: ``sitecustomize`` for the peers' patches: first on the PYTHONPATH of engines that ask for them.
PEER_PATCHES = Path(__file__).resolve().parent / "peer_patches"


class VllmServer(Proc):
    """One vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``).

    Its processes' temporary files (vLLM's IPC sockets, ``VLLM_RPC_BASE_PATH``, and whatever
    else asks ``tempfile``: ``TMPDIR``) go to a scratch folder of their own, removed by ``stop``:
    a vLLM start otherwise leaves ``/tmp/<uuid>`` sockets behind. ``stop`` and ``kill`` also
    remove the multiprocessing files in /dev/shm its processes had mapped (``MP_SHM_PREFIXES``),
    which a SIGKILLed engine leaves (a bench's fault rows left 8 GiB of them)."""

    def __init__(self, spec: EngineSpec, log_dir: Path) -> None:
        self.spec = spec
        # Short and in /tmp: a unix socket's path must stay under 108 bytes.
        self.scratch = Path(tempfile.mkdtemp(prefix="kvxfer-vllm-"))
        self.url = f"http://{spec.host}:{spec.port}"
        self.mp_shm: set[Path] = set()
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model,
                "--host", spec.host, "--port", str(spec.port), "--enforce-eager",
                "--max-model-len", str(spec.max_model_len), "--block-size", str(spec.block_size),
                "--kv-cache-memory-bytes", str(spec.kv_cache_bytes), "--max-num-seqs", "16",
                "--dtype", spec.dtype, *spec.args]
        if spec.pin:
            if spec.cores == "nobind":
                raise ValueError(f"engine {spec.engine_id}: pin needs cores to pin to (cores is 'nobind')")
            args = ["taskset", "--cpu-list", spec.cores, *args]
        args = [*spec.prefix, *args]
        if spec.kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(spec.kv_config)]
        elif spec.connector:
            cfg = {
                "kv_connector": "KvxferConnector",
                "kv_connector_module_path": "kvxfer_vllm.connector",
                "engine_id": spec.engine_id,
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"engine_socket": spec.socket, "shm_dir": spec.shm_dir, **spec.extra},
            }
            args += ["--kv-transfer-config", json.dumps(cfg)]
        env = dict(os.environ, VLLM_HOST_IP="127.0.0.1", VLLM_CPU_OMP_THREADS_BIND=spec.cores,
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
                   VLLM_RPC_BASE_PATH=str(self.scratch), TMPDIR=str(self.scratch), **spec.env)
        if spec.patches:
            env["KVXFER_BENCH_PATCHES"] = ",".join(spec.patches)
            env["PYTHONPATH"] = os.pathsep.join(x for x in (str(PEER_PATCHES), env.get("PYTHONPATH")) if x)
        try:
            super().__init__(args, log_dir / f"vllm-{spec.engine_id}-{spec.port}.log", env=env)
        except BaseException:
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise

    def stop(self, timeout: float = 30.0) -> None:
        self.note_mp_shm()
        super().stop(timeout)
        self._remove_leftovers()

    def kill(self) -> None:
        self.note_mp_shm()
        super().kill()
        self._remove_leftovers()

    def note_mp_shm(self) -> set[Path]:
        """Remembers (and returns) the multiprocessing files in /dev/shm the engine's processes
        have mapped now, so that ``stop`` and ``kill`` can remove what a killed process left."""
        if self.alive():
            self.mp_shm |= mp_shm_mapped(group_pids({self.pid}))
        return set(self.mp_shm)

    def _remove_leftovers(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        # A process still dying has them mapped; removing the names is what a clean exit does.
        for f in self.mp_shm:
            f.unlink(missing_ok=True)

    def wait_ready(self, timeout: float = 600.0) -> None:
        # NIXL's side-channel listener dies on a port taken meanwhile, and the engine then never
        # becomes ready: fail at once instead of waiting out the bound.
        self.wait_healthy(f"{self.url}/health", f"vLLM {self.spec.engine_id}", timeout, 0.5,
                          fatal=("Exception in thread nixl_handshake_listener",))
        self.note_mp_shm()

    def complete(self, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None = None,
                 timeout: float = 120.0) -> dict[str, Any]:
        return complete(self.url, self.spec.model, prompt, max_tokens, kv_transfer_params, timeout)

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric's samples on /metrics (0 when absent)."""
        return metric(f"{self.url}/metrics", name)

    def kv_capacity(self) -> int:
        """The KV cache size in tokens vLLM logged at start-up ("CPU KV cache size: N tokens", or
        GPU's); ValueError when the log has none."""
        m = re.search(r"KV cache size: ([\d,]+) tokens", self.tail(10**7))
        if m is None:
            raise ValueError(f"{self.log_path}: no 'KV cache size' line")
        return int(m.group(1).replace(",", ""))


def complete(url: str, model: str, prompt: list[int], max_tokens: int,
             kv_transfer_params: dict[str, Any] | None = None, timeout: float = 120.0) -> dict[str, Any]:
    """A greedy completion of token ids, answered with token ids, from an OpenAI server at ``url``."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    r = requests.post(f"{url}/v1/completions", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples at ``url`` whose labels include ``labels`` (0 when absent)."""
    text = requests.get(url, timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


class VllmRouter(Proc):
    """vLLM's router (``vllm-router``, PyPI) in its prefill/decode mode in front of engines.

    ``connector="nixl"``: prefill on a P with ``max_tokens=1``, then P's ``kv_transfer_params``
    to a D (kvxfer: pull). ``"mooncake"``: P and D at once, D told the transfer id, P's engine id
    and P's bootstrap URL, the P sidecar's ``--bootstrap`` (kvxfer: push). ``prefills`` pairs
    each P with its bootstrap port (mooncake) or None.
    """

    def __init__(self, prefills: list[tuple[VllmServer, int | None]], decodes: list[VllmServer], log_dir: Path,
                 *, connector: str = "nixl", policy: str = "round_robin") -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = decodes[0].spec.model
        args = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation",
                "--kv-connector", connector, "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                # One attempt per request, so the router's counts are the requests sent.
                "--disable-retries", "--request-timeout-secs", "120", "--log-level", "warning"]
        for p, boot in prefills:
            args += ["--prefill", p.url, *([str(boot)] if boot is not None else [])]
        for d in decodes:
            args += ["--decode", d.url]
        super().__init__(args, log_dir / f"vllm-router-{connector}-{self.port}.log")

    def wait_ready(self, timeout: float = 120.0) -> None:
        self.wait_healthy(f"{self.url}/health", "vllm-router", timeout, 0.3)

    def complete(self, prompt: list[int], max_tokens: int, timeout: float = 180.0) -> dict[str, Any]:
        return complete(self.url, self.model, prompt, max_tokens, None, timeout)

    def metric(self, name: str, **labels: str) -> float:
        return metric(f"http://127.0.0.1:{self.metrics_port}/metrics", name, **labels)


def output_ids(resp: dict[str, Any]) -> list[int]:
    choice = resp["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise RuntimeError("the server returned no token_ids (return_token_ids unsupported?)")
    return list(ids)


class PdRouter:
    """What a P/D router does (vLLM's toy proxy): prefill on P with ``max_tokens=1`` and
    ``do_remote_decode``, then decode on D with what P answered (pull), or — push — ask D first
    with P's sidecar address and a transfer id, while P computes."""

    def __init__(self, p: VllmServer, d: VllmServer, p_side_channel: str) -> None:
        self.p, self.d = p, d
        self.p_host, port = p_side_channel.rsplit(":", 1)
        self.p_port = int(port)

    def pull(self, prompt: list[int], max_tokens: int, transfer_id: str) -> tuple[list[int], dict[str, Any]]:
        # The router names the transfer, so it gives the token too (P's answer takes it to D).
        pr = self.p.complete(prompt, 1, {"do_remote_decode": True, "transfer_id": transfer_id,
                                         "kvxfer_token": secrets.token_hex(16)})
        params = pr.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"P answered no kv_transfer_params: {pr}")
        return output_ids(self.d.complete(prompt, max_tokens, params)), params

    def push(self, prompt: list[int], max_tokens: int, transfer_id: str) -> list[int]:
        out: dict[str, Any] = {}
        # D registers before P answers, so the router binds the transfer itself: both get the token.
        token = secrets.token_hex(16)

        def decode() -> None:
            try:
                out["d"] = self.d.complete(prompt, max_tokens, {
                    "do_remote_prefill": True, "remote_host": self.p_host, "remote_port": self.p_port,
                    "transfer_id": transfer_id, "kvxfer_token": token})
            except BaseException as err:  # noqa: BLE001 - reported below
                out["err"] = err

        t = threading.Thread(target=decode, daemon=True)
        t.start()
        self.p.complete(prompt, 1, {"do_remote_decode": True, "transfer_id": transfer_id, "kvxfer_token": token})
        t.join(180)
        if "err" in out:
            raise out["err"]
        if "d" not in out:
            raise RuntimeError("D did not answer within 180 s")
        return output_ids(out["d"])
