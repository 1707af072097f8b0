"""The Helm chart on a real Kubernetes (deploy/local/up.sh: v1.34.4 built from the Go module
proxy, containerd, CoreDNS, kube-proxy, one node), with the images deploy/local/images.sh built
and deploy/local/values.yaml: 2 prefill and 2 decode pods (the simulated engine behind vLLM's
command line and kvxfer's sidecar, mutual TLS between sidecars and on their gRPC API) and
vLLM's router in front, reached through its Service's cluster IP.

In order, on one release:

1. ``helm install``: every pod Ready within a bound, as the kubelet judges it from the chart's
   probes;
2. a 2P2D workload through the router Service in pull (``--kv-connector nixl``): every answer
   equal to one engine's, every byte of every transfer checked on D, every P and D used;
3. a prefill pod deleted mid-load: no request fails (the router tries another P; D computes
   what it cannot receive), every answer right, the pod rescheduled and serving again, every
   block back on every engine;
4. a rolling upgrade of the decode StatefulSet under load without a failed request, then a
   rolling restart of the router Deployment under load without one;
5. probes proven by the kubelet: an engine SIGKILLed (the pod goes NotReady, the kubelet restarts
   the container, the sidecar exits 75 and is restarted, the pod is Ready again) and an engine
   frozen with SIGSTOP (its liveness probe fails, the kubelet kills and restarts it);
6. ``helm upgrade`` to push (``--kv-connector mooncake``, P's bootstrap port) and the workload
   again;
7. ``helm uninstall`` leaving nothing of the release in the cluster and no container running.

The cluster is started and stopped by the fixture (up.sh, down.sh); its recovery times are
printed.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from common import (KV_BYTES_PER_TOKEN, LOCAL, REPO, Pki, complete, helm, prompt, run, wait_for)

NS = f"kvxfer-test-{os.getpid()}"
RELEASE = "kv"
FULL = f"{RELEASE}-kvxfer-pd"
KUBECTL = str(REPO / ".tools" / "k8s-v1.34.4" / "bin" / "kubectl")
CONTAINERD_SOCK = "/run/kvxfer-k8s/containerd.sock"
READY_BOUND_S = 180
#: deploy/local/versions.sh
POD_CIDR, SERVICE_CIDR, POD_GATEWAY = "198.19.160.0/20", "198.19.192.0/20", "198.19.160.1"
LENGTHS = [17, 64, 100, 250, 513]
TIMINGS: dict[str, float] = {}
COUNTS: dict[str, int] = {}
LATENCY: list[str] = []


def kubectl(*args: str, timeout: float = 120, check: bool = True) -> str:
    return run(KUBECTL, *args, timeout=timeout, check=check).stdout


def kjson(*args: str) -> dict[str, Any]:
    return json.loads(kubectl(*args, "-o", "json"))


def reference(tokens: list[int], n: int) -> list[int]:
    """The simulated engine's output for a prompt (sim/vllm-server.ts outputTokens): a function of
    the prompt alone, so any P/D pair must answer it."""
    digest = hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()[:32]
    return [int.from_bytes(hashlib.sha256(f"{digest}:{i}".encode()).digest()[:4], "little") % 32_000
            for i in range(n)]


@pytest.fixture(scope="module")
def cluster(docker_daemon):
    env = run("bash", str(LOCAL / "up.sh"), "--env").stdout.strip()
    os.environ["KUBECONFIG"] = env.partition("=")[2]
    t0 = time.monotonic()
    try:
        run("bash", str(LOCAL / "up.sh"), timeout=300)
        TIMINGS["cluster up"] = time.monotonic() - t0
        yield
    finally:
        try:
            LATENCY.append(kube_proxy_latency())
        except Exception as err:  # noqa: BLE001 - a figure to print, never a reason to leave the cluster up
            LATENCY.append(f"metrics not read ({err})")
        t0 = time.monotonic()
        out = run("bash", str(LOCAL / "down.sh"), timeout=300, check=False)
        TIMINGS["cluster down"] = time.monotonic() - t0
        print("\n" + out.stdout + out.stderr)
        print("cluster test timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()))
        print("cluster test requests: " + ", ".join(f"{k} {v}" for k, v in COUNTS.items()))
        if LATENCY:
            print("kube-proxy: " + LATENCY[0])


@pytest.fixture(scope="module")
def release(cluster):
    kubectl("create", "namespace", NS)
    pki = Pki()
    try:
        for role in ("prefill", "decode"):
            for i in range(2):
                pod = f"{FULL}-{role}-{i}"
                pki.issue(pod, [f"{pod}.{FULL}-{role}.{NS}.svc", f"{pod}.{FULL}-{role}.{NS}.svc.cluster.local"])
        kubectl("-n", NS, "create", "secret", "generic", "kvxfer-peer",
                *[f"--from-file={f}" for f in pki.secret_files()])
    finally:
        pki.close()
    yield
    # Whatever a failed test left: the namespace goes, and with it everything in it.
    kubectl("delete", "namespace", NS, "--wait=true", "--timeout=120s", check=False, timeout=150)


def pods() -> list[dict[str, Any]]:
    return kjson("-n", NS, "get", "pods")["items"]


def pod(name: str) -> dict[str, Any]:
    return kjson("-n", NS, "get", "pod", name)


def is_ready(p: dict[str, Any]) -> bool:
    return p.get("metadata", {}).get("deletionTimestamp") is None and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))


def all_ready(expect: int = 5) -> bool:
    ps = pods()
    return len(ps) == expect and all(is_ready(p) for p in ps)


def pod_ip(name: str) -> str:
    return pod(name)["status"]["podIP"]


def container_status(name: str, container: str) -> dict[str, Any]:
    [c] = [c for c in pod(name)["status"]["containerStatuses"] if c["name"] == container]
    return c


def host_pid(name: str, container: str) -> int:
    """The container's process as the host sees it (containerd's task of the kubelet's container)."""
    cid = container_status(name, container)["containerID"].split("://", 1)[1]
    out = run("ctr", "--address", CONTAINERD_SOCK, "--namespace", "k8s.io", "tasks", "ls").stdout
    for line in out.splitlines()[1:]:
        task, pid, status = line.split()[:3]
        if task == cid and status == "RUNNING":
            return int(pid)
    raise RuntimeError(f"no running task for {name}/{container} ({cid})")


def engine_stats(name: str) -> dict[str, Any]:
    return requests.get(f"http://{pod_ip(name)}:8000/kvxfer/stats", timeout=5).json()


def engine_names() -> list[str]:
    return [f"{FULL}-{r}-{i}" for r in ("prefill", "decode") for i in range(2)]


def router_url() -> str:
    ip = kjson("-n", NS, "get", "service", f"{FULL}-router")["spec"]["clusterIP"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(SERVICE_CIDR), ip
    return f"http://{ip}:8000"


@dataclass
class Result:
    n: int
    ok: bool
    answer: dict[str, Any] | None = None
    error: str = ""
    at: float = 0.0


@dataclass
class Load:
    """Requests through the router, ``concurrency`` at a time, until stopped (or ``count`` sent)."""

    url: str
    concurrency: int = 4
    count: int | None = None
    max_tokens: int = 8
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sent: int = 0

    def _next(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or (self.count is not None and self._sent >= self.count):
                return None
            self._sent += 1
            return self._sent

    def _worker(self) -> None:
        while (i := self._next()) is not None:
            n = LENGTHS[i % len(LENGTHS)]
            tokens = prompt(n, seed=10_000 + i + os.getpid())
            t = time.monotonic()
            try:
                ans = complete(self.url, tokens, self.max_tokens, timeout=150)
                ok = ans["choices"][0]["token_ids"] == reference(tokens, self.max_tokens)
                r = Result(n, ok, ans, "" if ok else "wrong output", t)
            except Exception as err:  # noqa: BLE001 - every failure is a result to report
                r = Result(n, False, None, str(err)[:300], t)
            with self._lock:
                self.results.append(r)

    def run(self) -> "Load":
        self._threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(self.concurrency)]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 200) -> list[Result]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self._threads), "requests still running after the bound"
        return self.results

    def wait(self, timeout: float = 300) -> list[Result]:
        for t in self._threads:
            t.join(timeout)
        return self.stop()


def check_results(results: list[Result], what: str) -> dict[str, int]:
    """No failed request, every answer right; D's KV received (every byte checked) or computed
    there. Returns the count of each outcome."""
    failed = [r for r in results if not r.ok]
    assert not failed, f"{what}: {len(failed)} of {len(results)} requests failed: {[r.error for r in failed[:5]]}"
    outcomes: dict[str, int] = {}
    for r in results:
        kv = r.answer["kvxfer"]
        assert kv["role"] == "decode", kv
        if kv["kv"] == "received":
            assert kv["checkedBytes"] == r.n * KV_BYTES_PER_TOKEN and kv["mismatches"] == 0, kv
        else:
            assert kv["kv"] == "recomputed" and kv["reason"], kv
        outcomes[kv["kv"]] = outcomes.get(kv["kv"], 0) + 1
    return outcomes


def blocks_back() -> dict[str, Any] | None:
    """Every engine's blocks free (nothing held by a transfer); None while one is not."""
    stats = {n: engine_stats(n) for n in engine_names()}
    return stats if all(s["freeBlocks"] == s["totalBlocks"] for s in stats.values()) else None


def test_install_every_pod_ready_within_the_bound(release):
    t0 = time.monotonic()
    helm("install", RELEASE, str(REPO / "deploy" / "helm" / "kvxfer-pd"), "--namespace", NS,
         "-f", str(LOCAL / "values.yaml"), "--set", "peerTls.secretName=kvxfer-peer", timeout=120)
    wait_for("every pod Ready", READY_BOUND_S, all_ready, every=1)
    TIMINGS["install to all Ready"] = time.monotonic() - t0
    for p in pods():
        spec = {c["name"]: c for c in p["spec"]["containers"]}
        if "kvxfer" in spec:  # the engine pods carry the chart's probes, which the kubelet ran
            assert spec["kvxfer"]["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert spec["vllm"]["livenessProbe"]["httpGet"]["path"] == "/health"
        assert ipaddress.ip_address(p["status"]["podIP"]) in ipaddress.ip_network(POD_CIDR), p["status"]["podIP"]


def test_pull_workload_through_the_router_service(release):
    before = {n: engine_stats(n)["outcomes"] for n in engine_names()}
    results = Load(router_url(), concurrency=4, count=24).run().wait()
    outcomes = check_results(results, "pull")
    assert outcomes == {"received": 24}, outcomes
    after = {n: engine_stats(n)["outcomes"] for n in engine_names()}
    for n in engine_names():
        kind = "sent" if "-prefill-" in n else "received"
        assert after[n].get(kind, 0) - before[n].get(kind, 0) > 0, (n, before[n], after[n])
    assert wait_for("every block back", 30, blocks_back)


def test_prefill_pod_deleted_mid_load_recovers(release):
    victim = f"{FULL}-prefill-0"
    old_uid = pod(victim)["metadata"]["uid"]
    load = Load(router_url(), concurrency=4).run()
    time.sleep(3)
    t0 = time.monotonic()
    # As an operator or a node drain deletes it: SIGTERM to both containers, which drain (the
    # engine's /health goes 503 at once and it answers while requests still come; the sidecar
    # refuses new transfers and finishes those in flight).
    kubectl("-n", NS, "delete", "pod", victim, "--wait=false")
    wait_for("the prefill pod rescheduled and Ready", READY_BOUND_S,
             lambda: (p := pod(victim))["metadata"]["uid"] != old_uid and is_ready(p), every=0.5)
    TIMINGS["prefill pod deleted -> new pod Ready"] = time.monotonic() - t0
    time.sleep(3)
    results = load.stop()
    outcomes = check_results(results, "prefill pod deleted")
    COUNTS["prefill deletion: requests"] = len(results)
    COUNTS["prefill deletion: recomputed"] = outcomes.get("recomputed", 0)
    # The new pod serves: a burst with every P in turn.
    sent = engine_stats(victim)["outcomes"].get("sent", 0)
    check_results(Load(router_url(), concurrency=2, count=8).run().wait(), "after the prefill pod came back")
    assert engine_stats(victim)["outcomes"].get("sent", 0) > sent, "the new prefill pod was not used"
    assert wait_for("every block back", 60, blocks_back)


def test_rolling_upgrade_of_decode_without_a_failed_request(release):
    load = Load(router_url(), concurrency=4).run()
    time.sleep(2)
    t0 = time.monotonic()
    kubectl("-n", NS, "rollout", "restart", f"statefulset/{FULL}-decode")
    kubectl("-n", NS, "rollout", "status", f"statefulset/{FULL}-decode", "--timeout=300s", timeout=320)
    TIMINGS["decode rolling upgrade"] = time.monotonic() - t0
    time.sleep(3)
    results = load.stop()
    outcomes = check_results(results, "decode rolling upgrade")
    COUNTS["decode upgrade: requests"] = len(results)
    COUNTS["decode upgrade: recomputed"] = outcomes.get("recomputed", 0)
    assert wait_for("all Ready", 60, all_ready)
    assert wait_for("every block back", 60, blocks_back)


def test_rolling_restart_of_the_router_without_a_failed_request(release):
    # The router's Service address: each rollout moves it from the old pod to the new one, and
    # kube-proxy rewrites its rules a moment after the pod changes (the chart's preStop sleep
    # keeps the old router serving meanwhile).
    old = {p["metadata"]["name"] for p in pods() if "-router-" in p["metadata"]["name"]}
    load = Load(router_url(), concurrency=4).run()
    time.sleep(2)
    t0 = time.monotonic()
    kubectl("-n", NS, "rollout", "restart", f"deployment/{FULL}-router")
    kubectl("-n", NS, "rollout", "status", f"deployment/{FULL}-router", "--timeout=300s", timeout=320)
    wait_for("the old router pod gone", 120,
             lambda: not old & {p["metadata"]["name"] for p in pods()} and all_ready(), every=0.5)
    TIMINGS["router rolling restart -> old pod gone"] = time.monotonic() - t0
    time.sleep(3)
    results = load.stop()
    check_results(results, "router rolling restart")
    COUNTS["router restart: requests"] = len(results)


def kube_proxy_latency() -> str:
    """kube-proxy's own account of how late its rules were (its metrics: from an endpoint change
    to the rules that carry it, and one sync of the rules)."""
    text = requests.get(f"http://{POD_GATEWAY}:10249/metrics", timeout=5).text
    out = []
    for metric, what in (("kubeproxy_network_programming_duration_seconds", "endpoint change -> rules"),
                         ("kubeproxy_sync_proxy_rules_duration_seconds", "rules sync")):
        total = count = 0.0
        buckets: list[tuple[str, float]] = []
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == f"{metric}_sum":
                total = float(value)
            elif name == f"{metric}_count":
                count = float(value)
            elif name.startswith(f"{metric}_bucket{{"):
                buckets.append((name.split('le="', 1)[1].split('"', 1)[0], float(value)))
        if count:
            # The smallest bucket that holds every observation: a bound on the slowest one.
            top = next(le for le, n in buckets if n >= count)
            out.append(f"{what}: {count:.0f} times, mean {total / count * 1000:.0f} ms, slowest <= {top} s")
    return "; ".join(out) or "no observations"


def test_probes_the_kubelet_runs_restart_a_crashed_and_a_frozen_engine(release):
    # A crash: the kubelet restarts the engine container; the sidecar refuses the new engine until
    # the old one is provably gone (3 s), exits 75 and is restarted; readiness follows.
    name = f"{FULL}-decode-0"
    vllm0 = container_status(name, "vllm")["restartCount"]
    kv0 = container_status(name, "kvxfer")["restartCount"]
    t0 = time.monotonic()
    os.kill(host_pid(name, "vllm"), signal.SIGKILL)
    wait_for("the pod NotReady", 30, lambda: not is_ready(pod(name)), every=0.2)
    wait_for("the sidecar restarted for the new engine", 120,
             lambda: container_status(name, "kvxfer")["restartCount"] == kv0 + 1, every=0.5)
    wait_for("the pod Ready again", 120, lambda: is_ready(pod(name)), every=0.5)
    TIMINGS["engine SIGKILLed -> pod Ready"] = time.monotonic() - t0
    assert container_status(name, "vllm")["restartCount"] == vllm0 + 1
    assert container_status(name, "kvxfer")["lastState"]["terminated"]["exitCode"] == 75
    # A hang: /health stops answering; the liveness probe (3 x 10 s) fails, the kubelet kills the
    # container and starts it again.
    name = f"{FULL}-prefill-1"
    vllm0 = container_status(name, "vllm")["restartCount"]
    t0 = time.monotonic()
    os.kill(host_pid(name, "vllm"), signal.SIGSTOP)
    wait_for("the kubelet restarting the frozen engine", 120,
             lambda: container_status(name, "vllm")["restartCount"] == vllm0 + 1, every=1)
    wait_for("the pod Ready again", 120, lambda: is_ready(pod(name)), every=0.5)
    TIMINGS["engine frozen -> liveness restart -> pod Ready"] = time.monotonic() - t0
    events = kjson("-n", NS, "get", "events", "--field-selector", f"involvedObject.name={name}")["items"]
    assert any(e["reason"] == "Unhealthy" and "Liveness probe failed" in e["message"] for e in events), \
        [e["message"] for e in events]
    assert wait_for("all Ready", 60, all_ready)
    check_results(Load(router_url(), concurrency=2, count=8).run().wait(), "after the restarts")


def test_push_workload_after_helm_upgrade(release):
    t0 = time.monotonic()
    helm("upgrade", RELEASE, str(REPO / "deploy" / "helm" / "kvxfer-pd"), "--namespace", NS, "--reuse-values",
         "--set", "mode=push", timeout=120)
    kubectl("-n", NS, "rollout", "status", f"statefulset/{FULL}-prefill", "--timeout=300s", timeout=320)
    kubectl("-n", NS, "rollout", "status", f"deployment/{FULL}-router", "--timeout=300s", timeout=320)
    wait_for("every pod Ready", READY_BOUND_S, all_ready, every=1)
    TIMINGS["upgrade to push -> all Ready"] = time.monotonic() - t0
    results = Load(router_url(), concurrency=4, count=24).run().wait()
    outcomes = check_results(results, "push")
    assert outcomes == {"received": 24}, outcomes
    # Push: D's transfer id is the router's (xfer-...), and P wrote into D's blocks.
    assert all(r.answer["kvxfer"]["transferId"].startswith("xfer-") for r in results), results[0].answer
    assert wait_for("every block back", 30, blocks_back)


def test_uninstall_leaves_nothing(release):
    helm("uninstall", RELEASE, "--namespace", NS, "--wait", "--timeout", "120s", timeout=150)
    wait_for("no pod left", 120, lambda: pods() == [], every=1)
    left = kubectl("-n", NS, "get", "all,configmaps,secrets,serviceaccounts,endpointslices,pvc",
                   "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name")
    assert left.strip() == "", left
    # Only the test's own Secret (not the chart's) and the namespace's defaults remain.
    secrets = kubectl("-n", NS, "get", "secrets", "-o", "name").split()
    assert secrets == ["secret/kvxfer-peer"], secrets
    kubectl("-n", NS, "delete", "secret", "kvxfer-peer")

    def no_task_running() -> bool:
        out = run("ctr", "--address", CONTAINERD_SOCK, "--namespace", "k8s.io", "tasks", "ls").stdout
        return all(line.split()[2] != "RUNNING" for line in out.splitlines()[1:])

    assert wait_for("no container running on the node", 60, no_task_running)
