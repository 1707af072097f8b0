"""Two "hosts" for a real P/D deployment across a link the test impairs: network namespaces P and
D joined by one data veth (the sidecars' side channel and UCX over TCP go there), each also joined
to the test's namespace by a management veth (gRPC only, never impaired). The vLLM engines stay in
the test's namespace: they reach their sidecars over ipc:// files, which every namespace sees.

Faults act on the data link alone: a bandwidth cap (``tbf`` on both ends' egress) and a partition
(iptables DROP of everything arriving on the data veth, both ends). The same layout and naming as
the TypeScript harness (bench/net/faults.ts: ``kx52`` names, addresses inside 198.18.0.0/15), so
a run of either leaves nothing the other trips on; ``destroy`` removes everything and is safe to
call twice. Needs root, iproute2, tc and iptables: ``missing()`` says why not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, timeout=15)


def missing() -> str | None:
    """Why no pair of namespaces can be made here, or None."""
    if os.geteuid() != 0:
        return "not root (ip netns needs it)"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"no {tool} (apt-get install {pkg})"
    return None


@dataclass
class Host:
    ns: str
    dev: str
    address: str
    mgmt_address: str

    @property
    def prefix(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns)


class NetPair:
    """``tag``: 1-4 of [a-z0-9]; ``octet``: the /24s used (198.18.<octet>.0 data, 198.19.<octet>.0
    management). Tests running at once pass different tags and octets."""

    def __init__(self, tag: str, octet: int) -> None:
        self.hosts = {
            side: Host(f"kx52-{tag}-{side}", f"kx52{tag}{side}", f"198.18.{octet}.{n}",
                       f"198.19.{octet}.{4 * n - 2}")
            for side, n in (("p", 1), ("d", 2))
        }
        self.octet = octet
        self._mgmt = [f"kx52{tag}pm", f"kx52{tag}dm"]
        self._destroyed = False
        self._remove()
        try:
            self._make()
        except BaseException:
            self._remove()
            raise

    def _make(self) -> None:
        p, d = self.hosts["p"], self.hosts["d"]
        _run("ip", "netns", "add", p.ns)
        _run("ip", "netns", "add", d.ns)
        _run("ip", "link", "add", p.dev, "type", "veth", "peer", "name", d.dev)
        for h in (p, d):
            _run("ip", "link", "set", h.dev, "netns", h.ns)
            _run("ip", "-n", h.ns, "addr", "add", f"{h.address}/24", "dev", h.dev)
            _run("ip", "-n", h.ns, "link", "set", h.dev, "up")
            _run("ip", "-n", h.ns, "link", "set", "lo", "up")
        for h, here, addr_here in ((p, self._mgmt[0], f"198.19.{self.octet}.1"),
                                   (d, self._mgmt[1], f"198.19.{self.octet}.5")):
            there = f"{here}x"
            _run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
            _run("ip", "link", "set", there, "netns", h.ns)
            _run("ip", "addr", "add", f"{addr_here}/30", "dev", here)
            _run("ip", "link", "set", here, "up")
            _run("ip", "-n", h.ns, "addr", "add", f"{h.mgmt_address}/30", "dev", there)
            _run("ip", "-n", h.ns, "link", "set", there, "up")

    def cap(self, mbit: int) -> None:
        """Caps both directions of the data link at ``mbit`` (tbf, a queue of at most 50 ms)."""
        burst = max(16_000, round(mbit * 1e6 / 8 / 250))
        for h in self.hosts.values():
            _run("tc", "-n", h.ns, "qdisc", "replace", "dev", h.dev, "root", "tbf", "rate", f"{mbit}mbit",
                 "burst", str(burst), "latency", "50ms")

    def uncap(self) -> None:
        for h in self.hosts.values():
            subprocess.run(["tc", "-n", h.ns, "qdisc", "del", "dev", h.dev, "root"], capture_output=True, timeout=15)

    def sent_bytes(self) -> int:
        """Bytes both ends of the data link have sent so far (the kernel's counters)."""
        total = 0
        for h in self.hosts.values():
            out = subprocess.run(["ip", "netns", "exec", h.ns, "cat", f"/sys/class/net/{h.dev}/statistics/tx_bytes"],
                                 capture_output=True, text=True, check=True, timeout=15)
            total += int(out.stdout)
        return total

    def partition(self) -> None:
        """Every packet arriving on either end of the data link dropped (both directions cut)."""
        for h in self.hosts.values():
            _run("ip", "netns", "exec", h.ns, "iptables", "-w", "5", "-I", "INPUT", "1", "-i", h.dev, "-j", "DROP")

    def heal(self) -> None:
        for h in self.hosts.values():
            subprocess.run(["ip", "netns", "exec", h.ns, "iptables", "-w", "5", "-D", "INPUT", "-i", h.dev, "-j", "DROP"],
                           capture_output=True, timeout=15)

    def _remove(self) -> None:
        for h in self.hosts.values():
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True, timeout=15)
        for dev in self._mgmt:
            subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=15)

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        self._remove()
