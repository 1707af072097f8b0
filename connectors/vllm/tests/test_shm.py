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
