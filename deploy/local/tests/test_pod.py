"""The chart's engine pod by hand, with Docker (deploy/local/docker.sh): the prefill and the decode
pod of ``helm template`` with deploy/local/values.yaml, each made the way a kubelet makes it:

- a sandbox container (the pause image) holding the pod's network namespace and a shareable IPC
  namespace, whose /dev/shm both containers see (the chart's ``dshm`` emptyDir: the KV files);
- a Docker volume for the chart's ``kvxfer-run`` emptyDir (the engine socket);
- the ``vllm`` container (the simulated engine behind vLLM's command line) and the ``kvxfer``
  container (the sidecar), each joining the sandbox's network and IPC namespaces, with the
  rendered image, args, environment (``$(VAR)`` and the pod's fields filled in as the kubelet
  does), capabilities and mounts, the Secret's files bind-mounted read-only, and restart policy
  ``always`` as the pod's ``restartPolicy: Always``.

The pods talk over a Docker bridge network of kvxfer's own address pool (198.19.129.0/24). Then:
a transfer P → D in pull and in push, with mutual TLS, every byte checked on D; the prefill
engine's container SIGKILLed: Docker restarts it, its sidecar refuses the new engine until the
old one is provably gone (``--engine-lease-ms``), exits 75, is restarted, and the pod serves
again. Every container, volume and network is removed by name at the end.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from common import (DOCKER, LOCAL, Pki, complete, expect_received, output_ids, prompt, render, run,
                    wait_for)

PREFIX = f"kvxfer-t{os.getpid()}"
RELEASE = "kv"


def docker(*args: str, timeout: float = 120, check: bool = True):
    return run(DOCKER, *args, timeout=timeout, check=check)


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)``: a variable defined earlier in the list, else left as is."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


class DockerPod:
    """One rendered pod: a sandbox, a volume per emptyDir on disk, one container per container."""

    def __init__(self, name: str, spec: dict[str, Any], network: str, secret_dir: Path) -> None:
        self.name, self.spec, self.network, self.secret_dir = name, spec, network, secret_dir
        self.sandbox = f"{PREFIX}-{name}"
        self.containers: dict[str, str] = {}
        self.volumes: list[str] = []
        self.ip = ""

    def start(self) -> None:
        # The sandbox: network and IPC namespaces, /dev/shm of the chart's size (dshm).
        docker("run", "-d", "--name", self.sandbox, "--network", self.network, "--ipc", "shareable",
               "--shm-size", "1g", "kvxfer-pause:local")
        self.ip = docker("inspect", "-f", f"{{{{(index .NetworkSettings.Networks \"{self.network}\").IPAddress}}}}",
                         self.sandbox).stdout.strip()
        assert self.ip.startswith("198.19."), self.ip
        fields = {"metadata.name": self.name, "status.podIP": self.ip}
        volumes: dict[str, list[str]] = {}
        for v in self.spec["volumes"]:
            if "emptyDir" in v and v["emptyDir"].get("medium") == "Memory":
                continue  # the sandbox's /dev/shm, shared through the IPC namespace
            if "emptyDir" in v:
                vol = f"{self.sandbox}-{v['name']}"
                docker("volume", "create", vol)
                self.volumes.append(vol)
                volumes[v["name"]] = ["-v", f"{vol}:{{path}}"]
            elif "secret" in v:
                volumes[v["name"]] = ["-v", f"{self.secret_dir}:{{path}}:ro"]
        for c in self.spec["containers"]:
            env: dict[str, str] = {}
            for e in c.get("env", []):
                if "valueFrom" in e:
                    env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
                else:
                    env[e["name"]] = expand(str(e["value"]), env)
            argv = ["run", "-d", "--name", f"{self.sandbox}-{c['name']}", "--network", f"container:{self.sandbox}",
                    "--ipc", f"container:{self.sandbox}", "--restart", "always"]
            for k, val in env.items():
                argv += ["-e", f"{k}={val}"]
            for m in c.get("volumeMounts", []):
                if m["name"] in volumes:
                    argv += [a.replace("{path}", m["mountPath"]) for a in volumes[m["name"]]]
            for cap in c.get("securityContext", {}).get("capabilities", {}).get("add", []):
                argv += ["--cap-add", cap]
            argv += [c["image"], *[expand(a, env) for a in c.get("args", [])]]
            docker(*argv)
            self.containers[c["name"]] = f"{self.sandbox}-{c['name']}"

    def url(self, port: int) -> str:
        return f"http://{self.ip}:{port}"

    def ready(self) -> bool:
        """What the rendered probes ask: the engine's /health, the sidecar's /ready."""
        try:
            return (requests.get(f"{self.url(8000)}/health", timeout=2).status_code == 200
                    and requests.get(f"{self.url(9400)}/ready", timeout=2).status_code == 200)
        except requests.RequestException:
            return False

    def restarts(self, container: str) -> int:
        return int(docker("inspect", "-f", "{{.RestartCount}}", self.containers[container]).stdout)

    def logs(self, container: str) -> str:
        out = docker("logs", self.containers[container], check=False)
        return out.stdout + out.stderr

    def kill(self, container: str) -> None:
        """SIGKILL of the container's process from the host: a crash, which the restart policy
        answers (``docker kill`` would count as stopping it by hand)."""
        pid = docker("inspect", "-f", "{{.State.Pid}}", self.containers[container]).stdout.strip()
        assert pid not in ("", "0"), f"{container} is not running"
        os.kill(int(pid), 9)

    def remove(self) -> None:
        names = [*self.containers.values(), self.sandbox]
        docker("rm", "-f", "-v", *names, check=False)
        if self.volumes:
            docker("volume", "rm", "-f", *self.volumes, check=False)


@pytest.fixture(scope="module")
def pods(docker_daemon, tmp_path_factory):
    values = [LOCAL / "values.yaml"]
    docs = render(RELEASE, values, "--set", "peerTls.secretName=kvxfer-peer", "--set", "prefill.replicas=1",
                  "--set", "decode.replicas=1")
    sts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    pki = Pki()
    names = {"prefill": f"{RELEASE}-kvxfer-pd-prefill-0", "decode": f"{RELEASE}-kvxfer-pd-decode-0"}
    for n in names.values():
        pki.issue(n, [])
    secret = tmp_path_factory.mktemp("secret")
    for f in pki.secret_files():
        (secret / f.name).write_bytes(f.read_bytes())
        os.chmod(secret / f.name, 0o400)
    network = f"{PREFIX}-net"
    made: list[DockerPod] = []
    docker("network", "create", "--driver", "bridge", network)
    try:
        for role, name in names.items():
            pod = DockerPod(name, sts[f"{RELEASE}-kvxfer-pd-{role}"]["spec"]["template"]["spec"], network, secret)
            made.append(pod)
            pod.start()
        for pod in made:
            wait_for(f"{pod.name} ready", 60, pod.ready)
        yield {"prefill": made[0], "decode": made[1]}
    finally:
        for pod in made:
            pod.remove()
        docker("network", "rm", network, check=False)
        pki.close()
        left = docker("ps", "-a", "--filter", f"name={PREFIX}", "--format", "{{.Names}}").stdout.split()
        assert left == [], f"containers left behind: {left}"
        nets = docker("network", "ls", "--filter", f"name={PREFIX}", "--format", "{{.Name}}").stdout.split()
        assert nets == [], f"networks left behind: {nets}"


def pull(p: DockerPod, d: DockerPod, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """What vllm-router's nixl mode does: P first (one token), then D with P's answer."""
    pr = complete(p.url(8000), tokens, 1, {"do_remote_decode": True})
    assert pr["kvxfer"]["kv"] == "sent", pr["kvxfer"]
    return complete(d.url(8000), tokens, max_tokens, pr["kv_transfer_params"])


def push(p: DockerPod, d: DockerPod, tokens: list[int], max_tokens: int, tid: str) -> dict[str, Any]:
    """D registers its blocks with P's sidecar while P computes (D first here, then P)."""
    out: dict[str, Any] = {}

    def decode() -> None:
        out["d"] = complete(d.url(8000), tokens, max_tokens,
                            {"do_remote_prefill": True, "transfer_id": tid, "remote_host": p.ip, "remote_port": 7600})

    t = threading.Thread(target=decode)
    t.start()
    time.sleep(0.2)
    pr = complete(p.url(8000), tokens, 1, {"do_remote_decode": True, "transfer_id": tid})
    t.join(60)
    assert not t.is_alive(), "D did not answer within 60 s"
    assert pr["kvxfer"]["kv"] == "sent"
    return out["d"]


def test_pod_moves_kv_between_pods_with_mutual_tls_and_recovers_from_an_engine_crash(pods):
    p, d = pods["prefill"], pods["decode"]
    # The sidecars authenticated each other with the Secret's certificates and advertise the pod IP.
    assert f'"sideChannel":"{p.ip}:7600"' in p.logs("kvxfer"), p.logs("kvxfer")[-2000:]
    for n in (17, 16 * 5, 300):
        tokens = prompt(n, seed=n)
        want = output_ids(complete(p.url(8000), tokens, 8))  # one engine alone
        got = pull(p, d, tokens, 8)
        expect_received(got, n)
        assert output_ids(got) == want
        got = push(p, d, tokens, 8, f"push-{n}-{os.getpid()}")
        expect_received(got, n)
        assert output_ids(got) == want

    # The engine crashes. Its container restarts at once; its sidecar refuses the new engine (its
    # old registration's files are still there) until --engine-lease-ms passes, exits 75, and
    # restarts for the new engine; the pod is ready again and moves KV again.
    assert p.restarts("kvxfer") == 0 and p.restarts("vllm") == 0
    t0 = time.monotonic()
    p.kill("vllm")
    wait_for("the engine container restarted", 30, lambda: p.restarts("vllm") == 1)
    wait_for("the sidecar restarted for the new engine", 60, lambda: p.restarts("kvxfer") == 1)
    wait_for("the prefill pod ready again", 60, p.ready)
    recovered = time.monotonic() - t0
    log = p.logs("kvxfer")
    assert '"exitCode":75' in log and "engine gone: stopping for a restart" in log, log[-3000:]
    tokens = prompt(100, seed=7)
    want = output_ids(complete(d.url(8000), tokens, 8))
    got = pull(p, d, tokens, 8)
    expect_received(got, 100)
    assert output_ids(got) == want
    stats = requests.get(f"{d.url(8000)}/kvxfer/stats", timeout=5).json()
    assert stats["freeBlocks"] == stats["totalBlocks"], stats
    print(f"\npod by hand: engine SIGKILLed -> sidecar exit 75 -> both restarted -> pod ready in {recovered:.1f} s "
          f"(engine lease 3 s); restarts: vllm {p.restarts('vllm')}, kvxfer {p.restarts('kvxfer')}")
    # Every block P held came back to P's engine (the new one: the old one's blocks went with it).
    stats = wait_for("P's blocks back", 30, lambda: (s := requests.get(f"{p.url(8000)}/kvxfer/stats", timeout=5)
                                                      .json())["freeBlocks"] == s["totalBlocks"] and s)
    assert stats["freeBlocks"] == stats["totalBlocks"]
