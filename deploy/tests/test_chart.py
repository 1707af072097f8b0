"""The Helm chart (deploy/helm/kvxfer-pd), rendered by the real ``helm`` (scripts/setup-helm.sh)
for several deployments and checked three ways: every manifest against Kubernetes' own schemas
(kubernetes-validate, strict: an unknown field is an error); the wiring the deployment depends on
(the engine and its sidecar agree on engine id, socket and KV folder; the router names every
engine pod in the mode's form; TP, block size and leases land where they act); and the sidecar's
rendered environment started as a real ``kvxfer sidecar``, the connector's rendered config read by
vLLM's own ``KVTransferConfig``. Bad values stop ``helm template`` with a message naming them.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import requests
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "kvxfer-pd"
HELM = Path(os.environ.get("KVXFER_HELM", REPO / ".tools" / "bin" / "helm"))
K8S_VERSION = "1.33"
SECURE = ["--set", "peerTls.secretName=kvxfer-peer"]


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    if not HELM.exists():
        pytest.fail(f"{HELM} is missing: run scripts/setup-helm.sh (npm run quickstart does)")
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)


def render(*sets: str, release: str = "kv", namespace: str = "serving") -> list[dict[str, Any]]:
    out = helm("template", release, str(CHART), "--namespace", namespace, *sets)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    return docs


def one(docs, kind: str, name: str) -> dict[str, Any]:
    [d] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def containers(sts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in sts["spec"]["template"]["spec"]["containers"]}


def arg(c: dict[str, Any], flag: str) -> str:
    [v] = [a.split("=", 1)[1] for a in c["args"] if a.startswith(flag + "=")]
    return v


def test_helm_lint_passes():
    out = helm("lint", str(CHART), *SECURE)
    assert out.returncode == 0, out.stdout + out.stderr


CASES = {
    "pull 1P1D": (["--set", "prefill.replicas=1", "--set", "decode.replicas=1"], "pull", 1, 1, 1, 1),
    "push 2P2D, TP 2 to 4, block 32, short leases": (
        ["--set", "mode=push", "--set", "prefill.tensorParallelSize=2", "--set", "decode.tensorParallelSize=4",
         "--set", "blockSize=32", "--set", "kvxfer.leases.leaseMs=5000", "--set", "kvxfer.leases.regLeaseMs=4000"],
        "push", 2, 2, 2, 4),
    "pull 3P1D": (["--set", "prefill.replicas=3", "--set", "decode.replicas=1"], "pull", 3, 1, 1, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_deployment_is_valid_kubernetes_and_wired_together(case):
    sets, mode, n_p, n_d, tp_p, tp_d = CASES[case]
    docs = render(*SECURE, *sets)
    block = 32 if "blockSize=32" in sets else 16
    for role, n, tp in (("prefill", n_p, tp_p), ("decode", n_d, tp_d)):
        sts = one(docs, "StatefulSet", f"kv-kvxfer-pd-{role}")
        svc = one(docs, "Service", f"kv-kvxfer-pd-{role}")
        assert sts["spec"]["replicas"] == n and sts["spec"]["serviceName"] == svc["metadata"]["name"]
        assert svc["spec"]["clusterIP"] == "None"
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
        c = containers(sts)
        assert set(c) == {"vllm", "kvxfer"}
        vllm, side = c["vllm"], env_of(c["kvxfer"])
        cfg = json.loads(arg(vllm, "--kv-transfer-config"))
        # Engine and sidecar agree: engine id (the pod name), engine socket, KV folder.
        assert cfg["engine_id"] == "$(POD_NAME)" and env_of(vllm)["POD_NAME"] == side["KVXFER_ENGINE_ID"]
        assert side["KVXFER_ENGINE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        extra = cfg["kv_connector_extra_config"]
        assert extra["engine_socket"] == side["KVXFER_ENGINE_SOCKET"] and extra["shm_dir"] == side["KVXFER_KV_DIR"]
        assert extra["advertise"] == side["KVXFER_ADVERTISE"] == "$(POD_IP):7600"
        assert side["KVXFER_ROLE"] == role
        for cont in c.values():
            mounts = {m["name"]: m["mountPath"] for m in cont["volumeMounts"]}
            assert mounts["kvxfer-run"] == "/run/kvxfer" and mounts["dshm"] == "/dev/shm"
        # TP, block size, GPUs per engine, leases.
        assert arg(vllm, "--tensor-parallel-size") == str(tp) and arg(vllm, "--block-size") == str(block)
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert side["KVXFER_LEASE_MS"] == ("5000" if "kvxfer.leases.leaseMs=5000" in sets else "30000")
        assert side["KVXFER_REG_LEASE_MS"] == ("4000" if "kvxfer.leases.regLeaseMs=4000" in sets else "30000")
        # Push: P serves its coordinates for the router and D; nobody else does.
        assert ("KVXFER_BOOTSTRAP" in side) == (mode == "push" and role == "prefill")
        assert side["KVXFER_PEER_CERT"] == "/etc/kvxfer/peer/$(KVXFER_ENGINE_ID).crt"
    router = containers(one(docs, "Deployment", "kv-kvxfer-pd-router"))["router"]
    args = router["args"]
    assert arg(router, "--kv-connector") == {"pull": "nixl", "push": "mooncake"}[mode]
    # The router's own readiness (vllm-router's /health is 503 while any one engine is down, which
    # would take the router out of its Service with one engine pod: deploy/local/tests shows it).
    assert router["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert router["livenessProbe"]["httpGet"]["path"] == "/liveness"
    # It listens only once every engine is healthy: liveness waits for that (up to 10 min).
    startup = router["startupProbe"]
    assert startup["httpGet"]["path"] == "/liveness" and startup["periodSeconds"] * startup["failureThreshold"] >= 600
    # A rollout never leaves the Service without a serving router: the new pod is Ready before the
    # old one stops, and the old one serves on for 10 s (kube-proxy's rules catch up meanwhile:
    # deploy/local/tests restarts the router under load).
    deployment = one(docs, "Deployment", "kv-kvxfer-pd-router")["spec"]
    assert deployment["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert router["lifecycle"]["preStop"] == {"sleep": {"seconds": 10}}
    assert deployment["template"]["spec"]["terminationGracePeriodSeconds"] == 40
    # Every engine pod by its stable name, P with its bootstrap port in push mode.
    prefills = [args[i + 1:i + (3 if mode == "push" else 2)] for i, a in enumerate(args) if a == "--prefill"]
    decodes = [args[i + 1] for i, a in enumerate(args) if a == "--decode"]
    host = "http://kv-kvxfer-pd-{r}-{i}.kv-kvxfer-pd-{r}.serving.svc:8000"
    assert prefills == [[host.format(r="prefill", i=i), *(["8998"] if mode == "push" else [])] for i in range(n_p)]
    assert decodes == [host.format(r="decode", i=i) for i in range(n_d)]


@pytest.mark.parametrize("sets, message", [
    (["--set", "mode=sideways"], "mode must be pull or push, got sideways"),
    (["--set", "prefill.replicas=0"], "prefill.replicas must be at least 1, got 0"),
    (["--set", "decode.tensorParallelSize=0"], "decode.tensorParallelSize must be at least 1, got 0"),
    (["--set", "blockSize=0"], "blockSize must be at least 1, got 0"),
    (["--set", "router.drainSeconds=-1"], "router.drainSeconds must be 0 or more, got -1"),
])
def test_bad_values_stop_the_render_naming_them(sets, message):
    out = helm("template", "kv", str(CHART), *SECURE, *sets)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_peers_are_authenticated_unless_asked_not_to():
    out = helm("template", "kv", str(CHART))
    assert out.returncode != 0 and "peerTls.secretName must name the Secret" in out.stderr
    docs = render("--set", "peerTls.insecure=true")
    sts = one(docs, "StatefulSet", "kv-kvxfer-pd-prefill")
    side = env_of(containers(sts)["kvxfer"])
    assert side["KVXFER_INSECURE_PEERS"] == "true" and "KVXFER_PEER_CERT" not in side
    assert "kvxfer-peer" not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}


def test_the_grpc_api_uses_tls_by_default_with_readiness_over_http():
    """gRPC over mutual TLS with the peers' Secret by default; the kubelet's gRPC probe speaks no
    TLS, so readiness is then probed on the metrics port's GET /ready (gRPC health's answer)."""
    for role in ("prefill", "decode"):
        side = containers(one(render("--set", "peerTls.secretName=kv-peers"), "StatefulSet",
                              f"kv-kvxfer-pd-{role}"))["kvxfer"]
        env = env_of(side)
        assert env["KVXFER_TLS_CERT"] == env["KVXFER_PEER_CERT"] == "/etc/kvxfer/peer/$(KVXFER_ENGINE_ID).crt"
        assert env["KVXFER_TLS_KEY"] == env["KVXFER_PEER_KEY"] and env["KVXFER_TLS_CA"] == env["KVXFER_PEER_CA"]
        assert side["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 9400}
        assert "grpc" not in side["readinessProbe"]
    # Plain gRPC (asked for, or no certificates at all): the kubelet's gRPC probe.
    for sets in (("--set", "peerTls.secretName=kv-peers", "--set", "kvxfer.grpcTls=false"),
                 ("--set", "peerTls.insecure=true")):
        side = containers(one(render(*sets), "StatefulSet", "kv-kvxfer-pd-prefill"))["kvxfer"]
        assert "KVXFER_TLS_CERT" not in env_of(side)
        assert side["readinessProbe"]["grpc"] == {"port": 7700}


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value or argument."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_rendered_sidecar_environment_runs_a_real_sidecar(tmp_path):
    """P's kvxfer container as rendered (push, insecure peers: no certificates here), with the pod's
    fields filled in for this host: the real sidecar starts with it and its bootstrap answers the
    advertised side channel."""
    ports = {k: free_port() for k in ("side", "grpc", "metrics", "boot")}
    docs = render("--set", "mode=push", "--set", "peerTls.insecure=true",
                  "--set", f"kvxfer.sideChannelPort={ports['side']}", "--set", f"kvxfer.grpcPort={ports['grpc']}",
                  "--set", f"kvxfer.metricsPort={ports['metrics']}", "--set", f"kvxfer.bootstrapPort={ports['boot']}")
    container = containers(one(docs, "StatefulSet", "kv-kvxfer-pd-prefill"))["kvxfer"]
    pod = {"metadata.name": "kv-kvxfer-pd-prefill-0", "status.podIP": "127.0.0.1"}
    env: dict[str, str] = {}
    for e in container["env"]:  # in order: later values may name earlier ones
        env[e["name"]] = pod[e["valueFrom"]["fieldRef"]["fieldPath"]] if "valueFrom" in e else expand(e["value"], env)
    sock = tmp_path / "engine.sock"
    env["KVXFER_ENGINE_SOCKET"] = f"ipc://{sock}"  # /run/kvxfer is the pod's volume
    env["KVXFER_KV_DIR"] = str(tmp_path)
    env["KVXFER_TRANSPORTS"] = "shm,self"  # this host has no RDMA devices
    cli = REPO / "dist" / "src" / "cli" / "main.js"
    p = subprocess.Popen(["node", str(cli), *container["args"]], env={**os.environ, **env},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready = None
        deadline = time.monotonic() + 20
        while ready is None and time.monotonic() < deadline and p.poll() is None:
            if select.select([p.stdout], [], [], 0.2)[0]:
                line = p.stdout.readline()
                if line.startswith("{") and json.loads(line).get("event") == "ready":
                    ready = json.loads(line)
        assert ready is not None, f"sidecar not ready: {p.stderr.read() if p.poll() is not None else ''}"
        assert env["KVXFER_PREFAULT"] == "true"  # next to vLLM: no first-touch faults in transfers
        assert ready["engineId"] == "kv-kvxfer-pd-prefill-0" and ready["bootstrap"] == f"0.0.0.0:{ports['boot']}"
        answer = requests.get(f"http://127.0.0.1:{ports['boot']}/query", timeout=5).json()
        assert answer == {"0": {"engine_id": "kv-kvxfer-pd-prefill-0",
                                "worker_addr": {"0": {"0": f"127.0.0.1:{ports['side']}"}}}}
        metrics = requests.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5)
        assert metrics.status_code == 200
    finally:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        p.stdout.close()
        p.stderr.close()
    assert not sock.exists()


@pytest.mark.parametrize("buffer, device, placement", [("cpu", "cuda", "host_buffer"), ("", "cpu", "shared")])
def test_vllm_and_the_connector_read_the_rendered_config(buffer, device, placement):
    """The connector config as vLLM's own KVTransferConfig parses it, then as the connector loads
    it (which refuses an unknown key) on a GPU engine (host buffer) and a CPU one (shared)."""
    from vllm.config import KVTransferConfig

    from kvxfer_vllm.config import load_config

    docs = render(*SECURE, "--set", f"vllm.kvBufferDevice={buffer}")
    vllm_c = containers(one(docs, "StatefulSet", "kv-kvxfer-pd-decode"))["vllm"]
    pod = {"POD_NAME": "kv-kvxfer-pd-decode-0", "POD_IP": "10.0.0.9"}
    kv = KVTransferConfig(**json.loads(expand(arg(vllm_c, "--kv-transfer-config"), pod)))
    assert (kv.kv_connector, kv.engine_id, kv.kv_role) == ("KvxferConnector", "kv-kvxfer-pd-decode-0", "kv_both")
    assert kv.kv_buffer_device == (buffer or KVTransferConfig().kv_buffer_device)
    cfg = load_config(kv.engine_id, kv.kv_connector_extra_config, device)
    assert (cfg.placement, cfg.advertise, cfg.engine_socket) == (placement, "10.0.0.9:7600", "ipc:///run/kvxfer/engine.sock")
