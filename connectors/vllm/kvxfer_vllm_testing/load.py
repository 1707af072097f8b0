"""What ``kvxfer bench vllm`` measures beside its figures: a fixed CPU hog for loaded cells
(``--load``) and distribution-free intervals for its percentiles.

Neither needs vLLM, so both are tested on their own (tests/test_bench_load.py).
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import subprocess
import sys
import time
from types import TracebackType

#: What each hog process runs: its niceness set, then one busy loop, nothing else (no I/O, no
#: memory growth). The child sets its own niceness: no code runs between fork and exec.
HOG_CODE = "import os\nos.setpriority(os.PRIO_PROCESS, 0, {nice})\nwhile True:\n    pass\n"


class CpuHog:
    """``count`` processes that each spin one core's worth of CPU at niceness ``nice``, for as
    long as the ``with`` block runs; stopped (SIGKILL, then reaped) when it ends, however it ends.
    Not pinned: they go where the scheduler puts them, as other tenants of a shared machine do."""

    def __init__(self, count: int, nice: int = 0) -> None:
        if count < 0:
            raise ValueError(f"load: {count} hog processes (0 or more)")
        if not -20 <= nice <= 19:
            raise ValueError(f"load nice {nice}: not in -20..19")
        self.count = count
        self.nice = nice
        self.procs: list[subprocess.Popen[bytes]] = []

    def describe(self) -> dict[str, object]:
        return {"hogs": self.count, "nice": self.nice,
                "what": f"{self.count} x a Python busy loop at nice {self.nice}" if self.count else "none"}

    def __enter__(self) -> CpuHog:
        return self.start()

    def start(self) -> CpuHog:
        """Starts the hogs (none when ``count`` is 0); a failure part-way stops those started."""
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", HOG_CODE.format(nice=self.nice)], stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.wait(max(0.1, deadline - time.monotonic()))
        self.procs = []


def quantile_interval(ordered: list[float], p: float, confidence: float = 0.95) -> tuple[float | None, float | None]:
    """A distribution-free ``confidence`` interval for the ``p`` quantile of what ``ordered`` (sorted
    samples) was drawn from, by order statistics: [x_(l), x_(u)] with l the largest rank such that
    P(B < l) <= a/2 and u the smallest such that P(B >= u) <= a/2, B ~ Binomial(n, p), a = 1 -
    confidence. An end that needs a rank outside the samples is None: too few samples to bound
    the quantile on that side (15 samples bound a p90 only from below)."""
    n = len(ordered)
    if n == 0:
        return None, None
    a = (1 - confidence) / 2
    # below[k] = P(B <= k), once: it rises with k, so the ranks with P(B < r) <= a are a prefix
    # of 1..n and those with P(B >= r) <= a a suffix.
    below = list(itertools.accumulate(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(n + 1)))
    lo_rank = max((r for r in range(1, n + 1) if below[r - 1] <= a), default=0)  # 0: none
    hi_rank = min((r for r in range(1, n + 1) if 1 - below[r - 1] <= a), default=n + 1)  # n + 1: none
    return (ordered[lo_rank - 1] if lo_rank >= 1 else None,
            ordered[hi_rank - 1] if hi_rank <= n else None)
