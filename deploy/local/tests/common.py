"""What the pod test and the cluster test share: the repository's paths, the chart rendered by the
real ``helm``, a throwaway CA issuing each engine pod's certificate as the chart expects them, and
the simulated engine's HTTP API (vLLM's ``/v1/completions`` with ``kv_transfer_params``).

Every wait is bounded; every helper that starts something has the matching stop.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import requests
import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deploy" / "helm" / "kvxfer-pd"
LOCAL = REPO / "deploy" / "local"
HELM = Path(os.environ.get("KVXFER_HELM", REPO / ".tools" / "bin" / "helm"))
DOCKER = "/usr/bin/docker"

#: The simulated engine's KV shape (deploy/local/values.yaml, sim/vllm-args.ts defaults): 4 layers,
#: K and V, 8 KV heads of 128 bfloat16 values per token.
KV_BYTES_PER_TOKEN = 4 * 2 * 8 * 128 * 2

T = TypeVar("T")


def wait_for(what: str, timeout: float, probe: Callable[[], T | None], every: float = 0.2) -> T:
    """``probe()`` until it returns something truthy, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            got = probe()
            if got:
                return got
        except Exception as err:  # noqa: BLE001 - the probe's failure is the wait's reason
            last = err
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout} s: {what}" + (f" (last error: {last})" if last else ""))
        time.sleep(every)


def run(*argv: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, input=input,
                         env={**os.environ, **(env or {})})
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}... exited {out.returncode}: {out.stderr.strip()[-2000:]}")
    return out


def helm(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    if not HELM.exists():
        raise RuntimeError(f"{HELM} is missing: run scripts/setup-helm.sh (npm run quickstart does)")
    return run(str(HELM), *args, timeout=timeout, env=env)


def render(release: str, values: list[Path], *sets: str, namespace: str = "default") -> list[dict[str, Any]]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    for v in values:
        args += ["-f", str(v)]
    out = helm(*args, *sets)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


class Pki:
    """A throwaway CA and, per engine pod, ``<pod>.crt`` (subject CN = the pod name, which is the
    engine id; DNS names for gRPC's TLS) and ``<pod>.key``, with ``ca.crt``: the files the chart's
    ``peerTls.secretName`` Secret holds."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvxfer-pki-"))
        self._ssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "ca.key")
        self._ssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=kvxfer cluster test CA", "-days", "2",
                  "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
                  "-out", "ca.crt")
        self.names: list[str] = []

    def _ssl(self, *args: str) -> None:
        subprocess.run(["openssl", *args], cwd=self.dir, check=True, capture_output=True, timeout=60)

    def issue(self, name: str, dns: list[str]) -> None:
        sans = ",".join(f"DNS:{d}" for d in [name, *dns])
        (self.dir / f"{name}.ext").write_text(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            f"extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName={sans}\n")
        self._ssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", f"{name}.key")
        self._ssl("req", "-new", "-key", f"{name}.key", "-subj", f"/CN={name}", "-out", f"{name}.csr")
        self._ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial",
                  str(len(self.names) + 1), "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt")
        (self.dir / f"{name}.csr").unlink()
        (self.dir / f"{name}.ext").unlink()
        self.names.append(name)

    def secret_files(self) -> list[Path]:
        """What the Secret holds (never the CA's key)."""
        return [self.dir / "ca.crt"] + [self.dir / f"{n}.{e}" for n in self.names for e in ("crt", "key")]

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids, different for every seed."""
    return [1 + (i * 7919 + seed * 104729) % 31_000 for i in range(n)]


def complete(url: str, tokens: list[int], max_tokens: int, params: dict[str, Any] | None = None,
             timeout: float = 60) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "kvxfer-sim", "prompt": tokens, "max_tokens": max_tokens}
    if params is not None:
        body["kv_transfer_params"] = params
    r = requests.post(f"{url}/v1/completions", data=json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:500]}")
    return r.json()


def output_ids(resp: dict[str, Any]) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def expect_received(resp: dict[str, Any], tokens: int) -> dict[str, Any]:
    """D's answer says its KV came from P and every byte of it checked out."""
    kv = resp["kvxfer"]
    assert kv["role"] == "decode" and kv["kv"] == "received", kv
    assert kv["checkedBytes"] == tokens * KV_BYTES_PER_TOKEN and kv["mismatches"] == 0, kv
    return kv
