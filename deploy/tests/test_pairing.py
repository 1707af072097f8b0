"""The engine pod's two containers under crashes, as the kubelet would restart them (issue 35).

No cluster runs here: a small ``Kubelet`` runs each container of the rendered prefill pod as a real
process and, as the pod's ``restartPolicy`` says, starts a container's process again whenever it
ends (after a back-off, seconds here instead of the kubelet's 10 s doubling to 5 min), judging
readiness the way the rendered probe does (the sidecar's gRPC health). The ``kvxfer`` container
runs the real sidecar with the rendered environment; the ``vllm`` container's stand-in is the
simulated engine (``kvxfer sim-engine``) speaking the engine link with the rendered engine id,
socket and KV folder: like vLLM's connector it registers at start, re-registers when its sidecar
restarts, and fails to start (exit 1, which the kubelet restarts) when its sidecar refuses it.

Each crash is a SIGKILL of one container's process, and the pod must come back to ready by itself:
no pod deletion, no manual restart.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from test_chart import REPO, containers, expand, free_port, one, render

CLI = REPO / "dist" / "src" / "cli" / "main.js"
BACKOFF_S = 0.3


def health(address: str) -> str:
    """grpc.health.v1 Check for service "" (what the rendered ``grpc`` readiness probe asks)."""
    with grpc.insecure_channel(address) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda _: b"",
                               response_deserializer=lambda b: b)
        try:
            raw = check(None, timeout=2)
        except grpc.RpcError:
            return "DOWN"
    status = raw[1] if len(raw) >= 2 and raw[0] == 0x08 else 0
    return {1: "SERVING", 2: "NOT_SERVING"}.get(status, f"UNKNOWN({status})")


class Container:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.p: subprocess.Popen | None = None
        self.restarts = -1
        self.exit_codes: list[int] = []

    def start(self) -> None:
        self.restarts += 1
        with open(self.log, "a") as log:
            self.p = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)

    def ended(self) -> bool:
        return self.p is not None and self.p.poll() is not None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.p is not None
        os.killpg(self.p.pid, sig)
        self.p.wait(10)

    def stop(self) -> None:
        if self.p is None or self.p.poll() is not None:
            return
        os.killpg(self.p.pid, signal.SIGTERM)
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(5)


class Kubelet:
    """``restartPolicy: Always`` for each container of one pod, one process each."""

    def __init__(self, restart_policy: str, containers: list[Container]) -> None:
        assert restart_policy == "Always"
        self.containers = containers
        self.due: dict[str, float] = {}

    def start(self) -> None:
        for c in self.containers:
            c.start()

    def tick(self) -> None:
        now = time.monotonic()
        for c in self.containers:
            if c.ended() and c.name not in self.due:
                assert c.p is not None
                c.exit_codes.append(c.p.returncode)
                self.due[c.name] = now + BACKOFF_S
            if c.name in self.due and now >= self.due[c.name]:
                del self.due[c.name]
                c.start()

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.tick()
            got = predicate()
            if got:
                return got
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout} s: {what}")

    def stop(self) -> None:
        for c in reversed(self.containers):
            c.stop()


def test_either_container_crashing_recovers_without_deleting_the_pod(tmp_path):
    ports = {k: free_port() for k in ("side", "grpc", "metrics")}
    docs = render("--set", "peerTls.insecure=true", "--set", "prefill.replicas=1", "--set", "decode.replicas=1",
                  "--set", f"kvxfer.sideChannelPort={ports['side']}", "--set", f"kvxfer.grpcPort={ports['grpc']}",
                  "--set", f"kvxfer.metricsPort={ports['metrics']}", "--set", "kvxfer.leases.engineLeaseMs=2000")
    sts = one(docs, "StatefulSet", "kv-kvxfer-pd-prefill")
    spec = sts["spec"]["template"]["spec"]
    pod = containers(sts)
    sidecar, vllm = pod["kvxfer"], pod["vllm"]
    # The pairing the chart states: each container restarts alone; readiness follows the engine;
    # liveness of each is its own process.
    assert spec["restartPolicy"] == "Always"
    assert sidecar["readinessProbe"]["grpc"]["port"] == ports["grpc"]
    assert "tcpSocket" in sidecar["livenessProbe"]
    assert vllm["livenessProbe"]["httpGet"]["path"] == "/health" and "startupProbe" in vllm
    cfg = json.loads(next(a for a in vllm["args"] if a.startswith("--kv-transfer-config=")).split("=", 1)[1])
    extra = cfg["kv_connector_extra_config"]
    assert extra["register_timeout_s"] > 300  # outlasts the kubelet's longest back-off

    shm = Path("/dev/shm") / f"kvxfer-pairing-{os.getpid()}"
    shm.mkdir()
    sock = tmp_path / "engine.sock"
    pod_fields = {"metadata.name": "kv-kvxfer-pd-prefill-0", "status.podIP": "127.0.0.1"}
    env: dict[str, str] = {}
    for e in sidecar["env"]:
        env[e["name"]] = pod_fields[e["valueFrom"]["fieldRef"]["fieldPath"]] if "valueFrom" in e else expand(e["value"], env)
    assert env["KVXFER_ENGINE_LEASE_MS"] == "2000"
    # The pod's volumes, on this host: /run/kvxfer and /dev/shm.
    env.update(KVXFER_ENGINE_SOCKET=f"ipc://{sock}", KVXFER_KV_DIR=str(shm), KVXFER_TRANSPORTS="shm,self",
               KVXFER_LOG_LEVEL="info")
    assert extra["engine_socket"] == "ipc:///run/kvxfer/engine.sock" and extra["shm_dir"] == "/dev/shm"
    engine_id = pod_fields["metadata.name"]  # the connector's engine_id is $(POD_NAME)
    kv = Container("kvxfer", ["node", str(CLI), *sidecar["args"]], env, tmp_path / "kvxfer.log")
    eng = Container("vllm", ["node", str(CLI), "sim-engine", "--engine-id", engine_id, "--role", "prefill",
                             "--socket", f"ipc://{sock}", "--shm-dir", str(shm), "--layers", "2", "--kv-heads", "2",
                             "--head-dim", "16", "--block", "16", "--blocks", "32", "--register-timeout-ms", "3000"],
                    {}, tmp_path / "vllm.log")
    kubelet = Kubelet(spec["restartPolicy"], [kv, eng])
    addr = f"127.0.0.1:{ports['grpc']}"
    ready = lambda: health(addr) == "SERVING"
    timings: dict[str, float] = {}
    try:
        kubelet.start()
        kubelet.wait(ready, 30, "the pod ready at first")
        # 1. The engine crashes (its files stay: SIGKILL). The kubelet restarts it; the sidecar
        #    refuses it until the old one is provably gone (the lease), then exits 75 and is
        #    restarted; the engine's next start registers with the new sidecar.
        t0 = time.monotonic()
        eng.kill()
        kubelet.wait(lambda: not ready(), 5, "readiness to follow the dead engine")
        kubelet.wait(lambda: kv.restarts == 1, 20, "the sidecar to stop for the new engine")
        kubelet.wait(ready, 30, "the pod ready again after the engine crashed")
        timings["engine SIGKILLed"] = time.monotonic() - t0
        assert kv.exit_codes == [75]
        # 2. The sidecar crashes. The kubelet restarts it; the engine registers again (new epoch).
        t0 = time.monotonic()
        engine_restarts = eng.restarts
        kv.kill()
        kubelet.wait(lambda: kv.restarts == 2, 10, "the sidecar restarted")
        kubelet.wait(ready, 30, "the pod ready again after the sidecar crashed")
        timings["sidecar SIGKILLed"] = time.monotonic() - t0
        assert eng.restarts == engine_restarts  # the engine lived through it
        # 3. The engine ends cleanly (its files go with it): the sidecar stops at once, not after
        #    the lease, and both come back.
        t0 = time.monotonic()
        assert eng.p is not None and eng.p.stdin is not None
        eng.p.stdin.write(json.dumps({"id": 1, "op": "exit"}) + "\n")
        eng.p.stdin.flush()
        kubelet.wait(lambda: kv.restarts == 3, 10, "the sidecar to stop after the engine exited")
        kubelet.wait(ready, 30, "the pod ready again after the engine exited")
        timings["engine exited"] = time.monotonic() - t0
        assert kv.exit_codes[-1] == 75
        print("\nrecovered without deleting the pod: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
              + f" (restarts: kvxfer {kv.restarts}, vllm {eng.restarts}; back-off {BACKOFF_S} s, engine lease 2 s)")
    finally:
        kubelet.stop()
        for c in (kv, eng):
            if c.p is not None and c.p.stdin is not None:
                c.p.stdin.close()
            if c.p is not None and c.p.stdout is not None:
                c.p.stdout.close()
        # The SIGKILLed engine's files: in a pod they stay in the emptyDir until the pod goes.
        shutil.rmtree(shm, ignore_errors=True)
    assert not sock.exists()
