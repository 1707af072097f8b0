"""``kvxfer bench vllm``'s load and intervals (kvxfer_vllm_testing/load.py): the hog really burns
CPU at the niceness it was given and leaves no process behind, and the percentile intervals are
the order statistics the binomial distribution gives (checked against published ranks)."""

from __future__ import annotations

import os
import time

import pytest

from kvxfer_vllm_testing.load import CpuHog, quantile_interval


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_hogs_burn_cpu_at_their_niceness_and_are_gone_after() -> None:
    with CpuHog(2, nice=5) as hog:
        pids = [p.pid for p in hog.procs]
        assert len(pids) == 2
        deadline = time.monotonic() + 10
        burnt = [0.0, 0.0]
        while time.monotonic() < deadline and min(burnt) < 0.3:
            time.sleep(0.1)
            burnt = [_cpu_s(pid) for pid in pids]
        assert min(burnt) >= 0.3, f"the hogs burnt {burnt} CPU-s in 10 s"
        assert [_nice(pid) for pid in pids] == [5, 5]
        assert hog.describe() == {"hogs": 2, "nice": 5, "what": "2 x a Python busy loop at nice 5"}
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"hog {pid} still there"


def test_hogs_stop_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with CpuHog(1) as hog:
            pid = hog.procs[0].pid
            raise RuntimeError("boom")
    assert not os.path.exists(f"/proc/{pid}")


def test_no_hog_and_bad_settings() -> None:
    with CpuHog(0) as hog:
        assert hog.procs == []
        assert hog.describe()["what"] == "none"
    with pytest.raises(ValueError, match="-1 hog processes"):
        CpuHog(-1)
    with pytest.raises(ValueError, match="nice 20"):
        CpuHog(1, nice=20)


@pytest.mark.parametrize(("n", "p", "ranks"), [
    # Distribution-free 95% intervals of the median by order statistics (the ranks of the usual
    # tables: n = 15 -> 4th and 12th, n = 100 -> 40th and 61st); a p90 of 15 samples has no upper
    # end (P(B >= 15) = 0.9^15 = 0.21 > 0.025), of 100 the 84th and 96th.
    (15, 0.5, (4, 12)),
    (100, 0.5, (40, 61)),
    (15, 0.9, (11, None)),
    (100, 0.9, (84, 96)),
    (5, 0.5, (None, None)),  # 0.5^5 = 0.031 > 0.025: 5 samples bound no median at 95%
    (6, 0.5, (1, 6)),
])
def test_quantile_intervals_are_the_binomial_order_statistics(n: int, p: float, ranks: tuple) -> None:
    xs = [float(10 * i) for i in range(1, n + 1)]  # rank r is 10 r
    lo, hi = quantile_interval(xs, p)
    assert (lo, hi) == tuple(None if r is None else 10.0 * r for r in ranks)


def test_quantile_interval_of_nothing() -> None:
    assert quantile_interval([], 0.5) == (None, None)
