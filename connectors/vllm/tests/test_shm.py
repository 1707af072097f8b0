"""The KV cache's shared-memory files: where they are made, that the placement catches vLLM's
allocation only, and that they go with the process that made them, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvxfer_vllm.errors import LayoutError
from kvxfer_vllm.shm import MIN_SHARED_BYTES, SharedKvFiles

MAKER = (
    "import sys, time\n"
    "from kvxfer_vllm.shm import SharedKvFiles\n"
    "f = SharedKvFiles(sys.argv[1], 'w0', 0)\n"
    "with f.placement():\n"
    "    import torch; t = torch.zeros(1 << 20, dtype=torch.int8)\n"
    "print(f.files[0].path, flush=True)\n"
    "time.sleep(60)\n"
)


def test_placement_puts_the_flat_kv_allocation_in_an_owner_only_file(shm_dir):
    files = SharedKvFiles(str(shm_dir), "e0", 3)
    try:
        with files.placement():
            kv = torch.zeros(4 << 20, dtype=torch.int8, device="cpu")
            small = torch.zeros(16, dtype=torch.int8)
            other = torch.zeros(4 << 20, dtype=torch.float32)
        (f,) = files.files
        assert f.path.startswith(f"{shm_dir}/kvxfer-e0-r3-") and f.nbytes == 4 << 20
        assert os.stat(f.path).st_mode & 0o777 == 0o600
        assert files.locate(kv[100:]) == (0, 100)
        for t in (small, other):
            with pytest.raises(LayoutError) as e:
                files.locate(t)
            assert e.value.code == "ERR_NOT_SHARED"
        assert small.numel() * 1 < MIN_SHARED_BYTES
        kv[5] = 9
        with open(f.path, "rb") as fh:  # the sidecar sees what the engine writes
            assert fh.read(6)[5] == 9
    finally:
        files.close()
    assert not os.listdir(shm_dir)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_file_goes_with_the_process_however_it_ends(shm_dir, sig):
    p = subprocess.Popen([sys.executable, "-c", MAKER, str(shm_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        path = p.stdout.readline().strip()
        assert os.path.exists(path)
    finally:
        p.send_signal(sig)
        p.wait(10)
    deadline = time.monotonic() + 5
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(path)


def _resident_bytes(start: int, nbytes: int) -> int:
    """Bytes of [start, start + nbytes) in this process's page table (/proc/self/smaps: Rss)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < start + nbytes and hi > start
            elif inside and head == "Rss:":
                rss += int(line.split()[1]) * 1024
    return rss


def test_the_kv_file_is_allocated_and_mapped_in_full_when_made(shm_dir):
    """As vLLM's own torch.zeros KV is: no page of it is first faulted in (or first allocated in
    /dev/shm) during a transfer or a forward pass over KV the sidecar wrote."""
    files = SharedKvFiles(str(shm_dir), "e0", 0)
    try:
        n = 8 << 20
        t = files.allocate(n)
        (f,) = files.files
        assert os.stat(f.path).st_blocks * 512 >= n  # every page allocated: not a sparse file
        assert _resident_bytes(t.data_ptr(), n) >= n  # and in this process's page table
        assert int(t.count_nonzero()) == 0
    finally:
        files.close()
    assert not os.listdir(shm_dir)
