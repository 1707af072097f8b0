#!/usr/bin/env python3
"""kvxfer's GPU device check (issue 32). bench/gpu/run.sh runs it on a GPU machine; prepare.sh
runs its dry run here (host memory, no CUDA) so everything up to the first CUDA call is known to
work.

This process owns the memory, as a vLLM worker owns its KV cache: torch allocates it on the GPU
and exports it as CUDA IPC handles. Two kvxfer agents (bench/gpu/agent.mjs, Node processes as
sidecars are) open the handles (Agent.openCudaIpc) and move bytes between them with UCX; this
process checks every byte. Three parts, each isolated (a failure is recorded, the next part runs):

(a) GPU -> GPU WRITE and READ between the two agents, 256 KiB .. 1 GiB, against cudaMemcpy in the
    same run: a third process that opened the same two buffers by IPC (torch.multiprocessing), and
    a copy inside the owning process (no IPC). Also each agent's own memory (allocateCuda), which
    isolates UCX's cuda_ipc from whether memory that was itself opened by IPC can be exported again.
(b) A KV-shaped transfer: Llama-3-8B (32 layers, 8 KV heads, head 128, bf16, blocks of 16 tokens,
    vLLM's FLASH_ATTN page per layer and block), 2048 and 8192 tokens between scattered block ids,
    byte-checked, against the same descriptors as cudaMemcpyAsync calls in one process.
(c) The connector's placement 'device' code on real CUDA tensors: kvxfer_vllm.device exports the
    tensors (TorchCuda, torch's own IPC export), layout.describe lays them out, the agents open the
    regions exactly as the sidecar does (RegionFile's handle, device and offset) and move a
    request's blocks; and host_buffer's stream/event copies, byte-checked and timed.

Writes results.json and results.md into --out.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import platform
import random
import select
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
DRY_SIZES = [256 << 10, 1 << 20, 4 << 20]


class AgentError(RuntimeError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Agent:
    """One agent.mjs process; ``call`` sends a request and returns its reply."""

    def __init__(self, node: str, carry: Path | None, name: str) -> None:
        env = dict(os.environ, KVXFER_AGENT_NAME=name)
        if carry is not None:
            env["KVXFER_NATIVE"] = str(carry / "dist" / "src" / "native" / "index.js")
        self.name = name
        self.proc = subprocess.Popen([node, str(HERE / "agent.mjs")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, bufsize=1)

    def call(self, timeout: float = 90.0, **msg: Any) -> dict[str, Any]:
        """One request; a reply that does not come within ``timeout`` kills the agent (a transfer
        that hangs must cost its part, not the whole run)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            raise AgentError("ERR_TIMEOUT", f"agent {self.name}: no answer to {msg.get('op')} within {timeout:g} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AgentError("ERR_EXITED", f"agent {self.name} exited (status {self.proc.wait(5)})")
        reply = json.loads(line)
        if "error" in reply:
            raise AgentError(reply.get("code", "ERR_INTERNAL"), reply["error"])
        return reply

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call(op="close", timeout=20)
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class GpuMemory:
    """Buffers on CUDA device 0, handed to agents by IPC handle."""

    dry = False

    def __init__(self) -> None:
        self.device = torch.device("cuda", 0)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, agent: Agent, rid: str, t: torch.Tensor) -> None:
        # Exported as the connector exports vLLM's KV (kvxfer_vllm.device.TorchCuda).
        e = connector_device().TorchCuda().export(t)
        agent.call(op="open", id=rid, handle=e.handle.hex(), device=e.device,
                   offset=e.offset + t.storage_offset() * t.element_size(), length=t.numel() * t.element_size())

    def sync(self) -> None:
        torch.cuda.synchronize()

    def close(self) -> None:
        pass


class HostMemory:
    """The dry run: shared-memory files the agents map, standing in for device memory."""

    dry = True

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvxfer-gpu-dry-", dir="/dev/shm")
        self.paths: dict[int, str] = {}

    def alloc(self, nbytes: int) -> torch.Tensor:
        path = os.path.join(self.dir, f"b{len(self.paths)}")
        with open(path, "wb") as f:
            f.truncate(nbytes)
        t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self.paths[t.data_ptr()] = path
        return t

    def give(self, agent: Agent, rid: str, t: torch.Tensor) -> None:
        agent.call(op="map", id=rid, path=self.paths[t.data_ptr()], length=t.numel())

    def sync(self) -> None:
        pass

    def close(self) -> None:
        for p in self.paths.values():
            with contextlib.suppress(OSError):
                os.unlink(p)
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)


def pair(node: str, carry: Path | None) -> tuple[Agent, Agent]:
    """Agents P and D, each connected to the other."""
    p, d = Agent(node, carry, "P"), Agent(node, carry, "D")
    pa, da = p.call(op="address")["address"], d.call(op="address")["address"]
    p.call(op="connect", address=da)
    d.call(op="connect", address=pa)
    return p, d


def share(owner: Agent, rid: str, other: Agent, as_id: str) -> None:
    other.call(op="import", id=as_id, key=owner.call(op="rkey", id=rid)["key"])


def iters_for(size: int, dry: bool) -> int:
    if dry:
        return 3
    return max(8, min(2000, (8 << 30) // size))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


# --- the cudaMemcpy reference: a process of its own that opened both buffers by IPC ---------------


def _ref_worker(src: torch.Tensor, dst: torch.Tensor, sizes: list[int], dry: bool, q: Any) -> None:
    out = {}
    try:
        for size in sizes:
            n = iters_for(size, dry)
            s, d = src[:size], dst[:size]
            d.copy_(s)
            if dry:
                t0 = time.perf_counter()
                for _ in range(n):
                    d.copy_(s)
                out[size] = (time.perf_counter() - t0)
            else:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(n):
                    d.copy_(s)
                b.record()
                b.synchronize()
                out[size] = a.elapsed_time(b) / 1000
        q.put(("ok", out))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        q.put(("error", f"{type(err).__name__}: {err}"))


def _spawned(target, args: tuple) -> tuple[str, object]:
    """Runs target(*args, queue) in a spawned process (CUDA tensors travel to it by IPC) and returns
    what it put on the queue: ("ok", value) or ("error", text). Bounded: 180 s for the answer,
    then the process is joined or killed."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q))
    proc.start()
    try:
        return q.get(timeout=180)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def ipc_reference(src: torch.Tensor, dst: torch.Tensor, sizes: list[int], dry: bool) -> dict[int, float]:
    if dry:  # file-backed CPU tensors do not travel to another process; the copy is only timed
        src, dst = src.clone().share_memory_(), torch.empty_like(dst).share_memory_()
    status, value = _spawned(_ref_worker, (src, dst, sizes, dry))
    if status != "ok":
        raise RuntimeError(f"reference process: {value}")
    return value


def local_reference(src: torch.Tensor, dst: torch.Tensor, size: int, dry: bool) -> float:
    n = iters_for(size, dry)
    s, d = src[:size], dst[:size]
    d.copy_(s)
    if dry:
        t0 = time.perf_counter()
        for _ in range(n):
            d.copy_(s)
        return time.perf_counter() - t0
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        d.copy_(s)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1000


# --- (a) bandwidth ----------------------------------------------------------------------------------


def part_a(mem: Any, node: str, carry: Path | None, res: dict[str, Any]) -> None:
    sizes = DRY_SIZES if mem.dry else SIZES
    top = sizes[-1]
    src, dst = mem.alloc(top), mem.alloc(top)
    g = torch.Generator(device=src.device).manual_seed(1)
    src.copy_(torch.randint(0, 256, (top,), dtype=torch.uint8, generator=g, device=src.device))
    mem.sync()
    rows: list[dict[str, Any]] = []
    res["a"] = {"rows": rows}
    try:
        ref = ipc_reference(src, dst, sizes, mem.dry)
    except Exception as err:  # noqa: BLE001 - kvxfer's figures still count without it
        ref = {}
        res["errors"]["a-reference"] = f"{type(err).__name__}: {err}"
    p, d = pair(node, carry)
    try:
        info = res["a"]["agents"] = p.call(op="info")
        if carry is not None:
            for what in ("addon", "libucp"):
                if not str(info[what]).startswith(str(carry)):
                    raise RuntimeError(f"the agent loaded {what} {info[what]}, not the carried one under {carry}")
        mem.give(p, "src", src)
        mem.give(d, "dst", dst)
        share(d, "dst", p, "dst")
        share(p, "src", d, "src")
        for size in sizes:
            n = iters_for(size, mem.dry)
            row: dict[str, Any] = {"size": size, "iters": n}
            for kind, agent, local, remote in (("write", p, "src", "dst"), ("read", d, "dst", "src")):
                dst[:size].zero_()
                mem.sync()
                t = agent.call(op="bench", kind=kind, local=local, remote=remote, size=size, iters=n, window=16, timeout=120)["seconds"]
                mem.sync()
                row[f"{kind}_gbps"] = gbps(size * n, t)
                row[f"{kind}_bytes_ok"] = bool(torch.equal(dst[:size], src[:size]))
            row["memcpy_ipc_gbps"] = gbps(size * n, ref[size]) if size in ref else 0.0
            row["memcpy_local_gbps"] = gbps(size * n, local_reference(src, dst, size, mem.dry))
            rows.append(row)
            print(f"(a) {size >> 10:>8} KiB  write {row['write_gbps']:8.1f}  read {row['read_gbps']:8.1f}  "
                  f"memcpy ipc {row['memcpy_ipc_gbps']:8.1f}  local {row['memcpy_local_gbps']:8.1f} GB/s  "
                  f"bytes {'ok' if row['write_bytes_ok'] and row['read_bytes_ok'] else 'WRONG'}", flush=True)
    except Exception as err:  # noqa: BLE001 - the own-memory figures below still run
        res["errors"]["a-imported"] = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    finally:
        p.close()
        d.close()
    if mem.dry:
        return
    # Each agent's own device memory: UCX's cuda_ipc between two allocations it can export.
    own: list[dict[str, Any]] = []
    res["a"]["own_memory"] = own
    p, d = pair(node, carry)
    try:
        p.call(op="alloc", id="src", length=top, device=0)
        d.call(op="alloc", id="dst", length=top, device=0)
        share(d, "dst", p, "dst")
        share(p, "src", d, "src")
        for size in sizes:
            n = iters_for(size, False)
            w = p.call(op="bench", kind="write", local="src", remote="dst", size=size, iters=n, window=16)["seconds"]
            r = d.call(op="bench", kind="read", local="dst", remote="src", size=size, iters=n, window=16)["seconds"]
            own.append({"size": size, "write_gbps": gbps(size * n, w), "read_gbps": gbps(size * n, r)})
    finally:
        p.close()
        d.close()


# --- (b) KV-shaped ----------------------------------------------------------------------------------

LLAMA3_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2, "block": 16}


def kv_descriptors(model: dict[str, int], num_blocks: int, tokens: int, seed: int) -> tuple[list[int], list[int], bytes, int, int]:
    """P's and D's scattered block ids and the (P offset, D offset, length) triples of vLLM's
    FLASH_ATTN layout, layer-major: one page (block x heads x K|V) per layer and block."""
    page = model["block"] * model["kv_heads"] * 2 * model["head_dim"] * model["dtype_bytes"]
    layer_stride = page * num_blocks
    nb = -(-tokens // model["block"])
    rng = random.Random(seed)
    p_ids = rng.sample(range(num_blocks), nb)
    d_ids = rng.sample(range(num_blocks), nb)
    triples = []
    for layer in range(model["layers"]):
        for pb, db in zip(p_ids, d_ids):
            triples += [layer * layer_stride + pb * page, layer * layer_stride + db * page, page]
    return p_ids, d_ids, struct.pack(f"<{len(triples)}d", *triples), page, layer_stride


def _native_worker(src: torch.Tensor, dst: torch.Tensor, triples: bytes, repeat: int, q: Any) -> None:
    try:
        vals = struct.unpack(f"<{len(triples) // 8}d", triples)
        trip = [(int(vals[i]), int(vals[i + 1]), int(vals[i + 2])) for i in range(0, len(vals), 3)]
        times = []
        try:
            import cupy  # the lighter cudaMemcpyAsync: ~2 us a call against torch's ~5

            copy = lambda s, d, n: cupy.cuda.runtime.memcpyAsync(dst.data_ptr() + d, src.data_ptr() + s, n, 3, 0)  # noqa: E731
            how = "cudaMemcpyAsync (CuPy)"
        except ImportError:
            copy = lambda s, d, n: dst[d:d + n].copy_(src[s:s + n], non_blocking=True)  # noqa: E731
            how = "Tensor.copy_ per descriptor (torch)"
        for _ in range(repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for s, d, n in trip:
                copy(s, d, n)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        q.put(("ok", {"seconds": times, "how": how}))
    except BaseException as err:  # noqa: BLE001
        q.put(("error", f"{type(err).__name__}: {err}"))


def part_b(mem: Any, node: str, carry: Path | None, res: dict[str, Any]) -> None:
    model = dict(LLAMA3_8B)
    token_counts = [2048, 8192]
    num_blocks = 1024
    if mem.dry:
        model.update(layers=2, kv_heads=2, head_dim=16)
        token_counts = [64, 256]
        num_blocks = 32
    page = model["block"] * model["kv_heads"] * 2 * model["head_dim"] * model["dtype_bytes"]
    total = page * num_blocks * model["layers"]
    src, dst = mem.alloc(total), mem.alloc(total)
    g = torch.Generator(device=src.device).manual_seed(2)  # made where the bytes live: 2 GiB
    chunk = 256 << 20
    for off in range(0, total, chunk):
        n = min(chunk, total - off)
        src[off:off + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g, device=src.device))
    mem.sync()
    rows: list[dict[str, Any]] = []
    res["b"] = {"model": model, "num_blocks": num_blocks, "rows": rows}
    p, d = pair(node, carry)
    try:
        mem.give(p, "kv", src)
        mem.give(d, "kv", dst)
        share(d, "kv", p, "dkv")
        for tokens in token_counts:
            p_ids, d_ids, triples, page, layer_stride = kv_descriptors(model, num_blocks, tokens, seed=tokens)
            dst.zero_()
            mem.sync()
            rep = 5 if not mem.dry else 1
            out = p.call(op="xfer", kind="write", local="kv", remote="dkv", descs=base64.b64encode(triples).decode(), repeat=rep)
            mem.sync()
            sv = src.view(model["layers"], num_blocks, page)
            dv = dst.view(model["layers"], num_blocks, page)
            pi, di = torch.tensor(p_ids, device=src.device), torch.tensor(d_ids, device=dst.device)
            ok = bool(torch.equal(dv[:, di], sv[:, pi]))
            rest = torch.ones(num_blocks, dtype=torch.bool, device=dst.device)
            rest[di] = False
            untouched = not bool(dv[:, rest].any())
            nbytes = len(p_ids) * page * model["layers"]
            row = {"tokens": tokens, "bytes": nbytes, "descriptors": out["descriptors"], "kvxfer_s": statistics.median(out["seconds"]),
                   "bytes_ok": ok, "others_untouched": untouched}
            if not mem.dry:
                status, value = _spawned(_native_worker, (src, dst, triples, rep))
                if status == "ok":
                    row["native_s"] = statistics.median(value["seconds"])
                    row["native_how"] = value["how"]
                    row["ratio"] = row["kvxfer_s"] / row["native_s"]
                else:
                    res["errors"][f"b-native-{tokens}"] = value
            rows.append(row)
            print(f"(b) {tokens} tokens, {nbytes / 2**20:.0f} MiB in {row['descriptors']} descriptors: kvxfer "
                  f"{row['kvxfer_s'] * 1e3:.2f} ms ({gbps(nbytes, row['kvxfer_s']):.1f} GB/s)"
                  + (f", native {row['native_s'] * 1e3:.2f} ms" if "native_s" in row else "")
                  + f", bytes {'ok' if ok and untouched else 'WRONG'}", flush=True)
    finally:
        p.close()
        d.close()


# --- (c) the connector's device path ----------------------------------------------------------------


def part_c(mem: Any, node: str, carry: Path | None, res: dict[str, Any]) -> None:
    device = connector_device()
    DeviceKv, TorchCuda = device.DeviceKv, device.TorchCuda  # noqa: N806
    from kvxfer_vllm.layout import describe  # noqa: PLC0415
    from kvxfer_vllm.registration import tensor_views  # noqa: PLC0415

    res["c"] = {}
    layers, heads, head, block, num_blocks = 4, 8, 128, 16, 64
    dev = torch.device("cuda", 0) if not mem.dry else torch.device("cpu")

    def kv_cache() -> dict[str, torch.Tensor]:
        # vLLM's FLASH_ATTN view of one flat allocation: [blocks, heads, tokens, K|V] with tokens outer.
        page = block * heads * 2 * head
        raw = torch.zeros(layers * num_blocks * page * 2, dtype=torch.int8, device=dev)
        flat = raw.view(torch.bfloat16)
        return {f"model.layers.{i}.self_attn.attn": torch.as_strided(
            flat, (num_blocks, heads, block, 2 * head), (page, 2 * head, heads * 2 * head, 1), i * num_blocks * page)
            for i in range(layers)}

    p_kv, d_kv = kv_cache(), kv_cache()
    p_raw = next(iter(p_kv.values()))
    g = torch.Generator(device=dev).manual_seed(3)
    p_flat = torch.as_strided(p_raw.view(torch.uint8), (p_raw.untyped_storage().nbytes(),), (1,), 0)
    p_flat.copy_(torch.randint(0, 256, p_flat.shape, dtype=torch.uint8, generator=g, device=dev))

    class CpuCuda:  # the dry run's boundary: the same calls, on CPU tensors
        def is_device(self, t): return True
        def device_of(self, t): return 0
        def export(self, t):
            from kvxfer_vllm.device import CudaExport  # noqa: PLC0415
            return CudaExport(b"\0" * 64, 0, 0, t.untyped_storage().nbytes())
        def pin(self, t): pass
        def side_stream(self, device): return contextlib.nullcontext()
        def side_waits_for_compute(self, device): pass
        def record_on_side(self, device): return None
        def compute_waits_for(self, device, event): pass
        def host_waits_for(self, event): pass
        def wait_compute(self, device): pass

    cuda = CpuCuda() if mem.dry else TorchCuda()
    layouts, kvs = {}, {}
    for name, kv in (("p", p_kv), ("d", d_kv)):
        dkv = DeviceKv(cuda, visible_devices="")
        dkv.add(kv)
        layouts[name] = describe(tensor_views(kv, dkv), packing="kv_in_cell", head_size=head, total_kv_heads=heads, tp_size=1,
                                 tp_rank=0, block_size=block, region_bytes=[f.nbytes for f in dkv.files]).layout
        kvs[name] = dkv
    L = layouts["p"]
    res["c"]["layout"] = {"slots": len(L.slots), "block_stride": L.block_stride, "head_stride": L.head_stride,
                          "token_stride": L.token_stride, "regions": len(kvs["p"].files)}
    # The request's blocks: P's [5, 9, 2, 11] -> D's [7, 1, 12, 4], every slot (layer x K|V cell) of each.
    p_blocks, d_blocks = [5, 9, 2, 11], [7, 1, 12, 4]
    triples: list[int] = []
    # kv_in_cell: a slot is K or V inside the same page, so whole pages move once per layer.
    layer_offsets = sorted({s.offset - (s.offset % (L.block_stride * L.num_blocks)) for s in L.slots})
    for lo in layer_offsets:
        for pb, db in zip(p_blocks, d_blocks):
            triples += [lo + pb * L.block_stride, lo + db * L.block_stride, L.block_stride]
    descs = struct.pack(f"<{len(triples)}d", *triples)
    p, d = pair(node, carry)
    try:
        if mem.dry:
            pf, df = mem.alloc(p_raw.untyped_storage().nbytes()), mem.alloc(p_raw.untyped_storage().nbytes())
            pf.copy_(p_flat)
            mem.give(p, "kv", pf)
            mem.give(d, "kv", df)
            d_flat = df
        else:
            # Exactly what the sidecar does with RegisterKvCache's regions (sidecar.ts regionOf).
            for agent, dkv in ((p, kvs["p"]), (d, kvs["d"])):
                (path, offset, length, _seg, handle, device) = dkv.regions()[0]
                agent.call(op="open", id="kv", handle=handle.hex(), device=device, offset=offset, length=length)
            # A second region of the same allocation (two KV tensors in one cudaMalloc segment): the
            # process's one mapping is shared, not opened twice.
            (_, offset, length, _, handle, device) = kvs["p"].regions()[0]
            half = length // 2
            p.call(op="open", id="kv-half", handle=handle.hex(), device=device, offset=offset + half, length=half)
            res["c"]["same_handle_twice"] = "ok"
            d_raw = next(iter(d_kv.values()))
            d_flat = torch.as_strided(d_raw.view(torch.uint8), (d_raw.untyped_storage().nbytes(),), (1,), 0)
        share(d, "kv", p, "dkv")
        kvs["p"].before_prefill_done(p_blocks)  # P waits for its compute stream, as before PrefillDone
        out = p.call(op="xfer", kind="write", local="kv", remote="dkv", descs=base64.b64encode(descs).decode(), repeat=1)
        mem.sync()
        pv = p_flat.view(layers, num_blocks, -1)
        dv = d_flat.view(layers, num_blocks, -1)
        ok = bool(torch.equal(dv[:, d_blocks].cpu(), pv[:, p_blocks].cpu()))
        res["c"]["device_placement"] = {"descriptors": out["descriptors"], "seconds": out["seconds"][0], "bytes_ok": ok}
        print(f"(c) placement 'device': {out['descriptors']} descriptors, bytes {'ok' if ok else 'WRONG'}", flush=True)
    finally:
        p.close()
        d.close()
    # host_buffer's copies on a real GPU: streams and events, byte-checked.
    from kvxfer_vllm.shm import HostBuffer, SharedKvFiles  # noqa: PLC0415

    shm_dir = tempfile.mkdtemp(prefix="kvxfer-gpu-hb-", dir="/dev/shm")
    files = SharedKvFiles(shm_dir, "gpu-check", 0)
    try:
        hb = HostBuffer(files, cuda if not mem.dry else None)
        hb.mirror(p_kv)
        t0 = time.perf_counter()
        hb.to_host(p_blocks)
        t_host = time.perf_counter() - t0
        ok_host = all(torch.equal(hb.host[n][p_blocks].view(torch.int16).cpu(), t[p_blocks].view(torch.int16).cpu())
                      for n, t in p_kv.items())
        for n in hb.host:
            hb.host[n][p_blocks[0]].fill_(1.5)
        t0 = time.perf_counter()
        hb.to_device([p_blocks[0]])
        mem.sync()
        t_dev = time.perf_counter() - t0
        ok_dev = all(bool((t[p_blocks[0]] == 1.5).all()) for t in p_kv.values())
        res["c"]["host_buffer"] = {"to_host_s": t_host, "to_device_s": t_dev, "bytes_ok": ok_host and ok_dev}
        print(f"(c) host_buffer: to_host {t_host * 1e3:.2f} ms, to_device {t_dev * 1e3:.2f} ms, bytes "
              f"{'ok' if ok_host and ok_dev else 'WRONG'}", flush=True)
    finally:
        files.close()
        with contextlib.suppress(OSError):
            os.rmdir(shm_dir)


def connector_device() -> Any:
    """kvxfer_vllm.device, the connector's placement 'device' code, from the working tree."""
    if str(REPO / "connectors" / "vllm") not in sys.path:
        sys.path.insert(0, str(REPO / "connectors" / "vllm"))
    _without_zmq()
    import kvxfer_vllm.device  # noqa: PLC0415

    return kvxfer_vllm.device


def _without_zmq() -> None:
    """kvxfer_vllm's shared-memory module imports the engine link (pyzmq), which part (c) never
    uses and the GPU machine does not have (no wheel for its Python is carried): stand-ins let the
    connector's device code import there. Where pyzmq is installed, nothing changes."""
    try:
        import zmq  # noqa: F401, PLC0415
    except ImportError:
        import types  # noqa: PLC0415

        zmq = types.ModuleType("zmq")
        utils = types.ModuleType("zmq.utils")
        monitor = types.ModuleType("zmq.utils.monitor")
        monitor.recv_monitor_message = None  # type: ignore[attr-defined]
        sys.modules.update({"zmq": zmq, "zmq.utils": utils, "zmq.utils.monitor": monitor})


def part_c_sidecars(mem: Any, res: dict[str, Any]) -> None:
    """The connector's device path end to end: P's and D's KV made by torch on the GPU, exported
    by kvxfer_vllm.device, registered by WorkerLogic over the engine link with two real sidecars
    (the carried, bundled CLI: $KVXFER_CLI), one request pulled P -> D, every byte checked. In the
    dry run the KV lives in the connector's shared-memory files instead (placement 'shared')."""
    res.setdefault("c", {})
    if not os.environ.get("KVXFER_CLI"):
        res["c"]["sidecars"] = "skipped: no KVXFER_CLI (run through run.sh or prepare.sh --check)"
        return
    device = connector_device()
    from kvxfer_vllm_testing.harness import SidecarProc  # noqa: PLC0415
    from kvxfer_vllm.layout import describe  # noqa: PLC0415
    from kvxfer_vllm.messages import ExpectMsg, PrefillDoneMsg, StepMessages  # noqa: PLC0415
    from kvxfer_vllm.registration import region_files, registration, tensor_views  # noqa: PLC0415
    from kvxfer_vllm.shm import SharedKvFiles  # noqa: PLC0415
    from kvxfer_vllm.worker import Results, WorkerLogic  # noqa: PLC0415

    layers, heads, head, block, num_blocks = 4, 8, 128, 16, 64
    page = block * heads * 2 * head  # bf16 elements of one layer's block
    nbytes = layers * num_blocks * page * 2
    work = Path(tempfile.mkdtemp(prefix="kvxfer-gpu-sc-"))
    shm_dir = tempfile.mkdtemp(prefix="kvxfer-gpu-sc-", dir="/dev/shm")
    started: list[Any] = []
    workers: list[Any] = []
    held: list[Any] = []
    try:
        engines = {}
        for role in ("prefill", "decode"):
            eid = f"gpu-{role[0]}-{os.getpid()}"
            if mem.dry:
                files = SharedKvFiles(shm_dir, eid, 0)
                held.append(files)
                with files.placement():
                    raw = torch.zeros(nbytes, dtype=torch.int8)
            else:
                files = device.DeviceKv(device.TorchCuda(), visible_devices="")
                raw = torch.zeros(nbytes, dtype=torch.int8, device="cuda")
            flat = raw.view(torch.bfloat16)
            kv = {f"model.layers.{i}.self_attn.attn": torch.as_strided(
                flat, (num_blocks, heads, block, 2 * head), (page, 2 * head, heads * 2 * head, 1), i * num_blocks * page)
                for i in range(layers)}
            if not mem.dry:
                files.add(kv)
            described = describe(tensor_views(kv, files), packing="kv_in_cell", head_size=head, total_kv_heads=heads,
                                 tp_size=1, tp_rank=0, block_size=block, region_bytes=[f.nbytes for f in files.files])
            sock = f"ipc:///tmp/{eid}.sock"
            sc = SidecarProc(eid, role, sock, work, "--insecure-peers", "true", ready_timeout=60.0)
            started.append(sc)
            w = WorkerLogic(engine_id=eid, engine_socket=sock, register_timeout_s=60.0, sidecar_lost_timeout_s=60.0,
                            max_frame_bytes=16 << 20,
                            before_prefill_done=None if mem.dry else files.before_prefill_done)
            workers.append(w)
            w.register(registration(eid, described, [region_files(files)]))
            engines[role] = (raw, w)
        (p_raw, pw), (d_raw, dw) = engines["prefill"], engines["decode"]
        g = torch.Generator(device=p_raw.device).manual_seed(4)
        p_raw.copy_(torch.randint(-128, 128, p_raw.shape, dtype=torch.int8, generator=g, device=p_raw.device))
        p_blocks, d_blocks = [5, 9, 2, 11], [7, 1, 12, 4]
        tokens = len(p_blocks) * block
        tid = f"gpu-check-{os.getpid()}"
        t0 = time.perf_counter()
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("rp", tid, p_blocks, tokens)]))
        dw.on_step(StepMessages(expect=[ExpectMsg("rd", tid, d_blocks, tokens, 0, pw.side_channel, p_blocks)]))
        got, sent = Results(), Results()
        deadline = time.monotonic() + 60
        while "rd" not in got.finished_recving and time.monotonic() < deadline:
            r = dw.take_results(0.05)
            got.finished_recving |= r.finished_recving
            got.failed_recving |= r.failed_recving
        elapsed = time.perf_counter() - t0
        while "rp" not in sent.finished_sending and time.monotonic() < deadline:
            sent.finished_sending |= pw.take_results(0.05).finished_sending
        mem.sync()
        pv, dv = p_raw.view(layers, num_blocks, -1), d_raw.view(layers, num_blocks, -1)
        ok = ("rd" in got.finished_recving and "rd" not in got.failed_recving
              and bool(torch.equal(dv[:, d_blocks].cpu(), pv[:, p_blocks].cpu())))
        rest = [b for b in range(num_blocks) if b not in d_blocks]
        untouched = not bool(dv[:, rest].any())
        res["c"]["sidecars"] = {"ready": "rd" in got.finished_recving, "failed": "rd" in got.failed_recving,
                                "p_released": "rp" in sent.finished_sending, "seconds": elapsed,
                                "bytes_ok": ok, "others_untouched": untouched,
                                "failures": [list(f) for f in dw.failures] + [list(f) for f in pw.failures]}
        print(f"(c) real sidecars ({'shared memory' if mem.dry else 'placement device'}): pull of {len(p_blocks)} blocks "
              f"{'ready' if 'rd' in got.finished_recving else 'NOT READY'} in {elapsed * 1e3:.1f} ms, bytes "
              f"{'ok' if ok and untouched else 'WRONG'}", flush=True)
        if not (ok and untouched):
            raise RuntimeError(f"the pull through real sidecars did not land byte-exact: {res['c']['sidecars']}")
    finally:
        for w in workers:
            with contextlib.suppress(Exception):
                w.close()
        for sc in started:
            with contextlib.suppress(Exception):
                res.setdefault("logs", {})[sc.engine_id] = sc.tail()[-3000:]
            with contextlib.suppress(Exception):
                sc.stop()
        for f in held:
            f.close()
        with contextlib.suppress(OSError):
            os.rmdir(shm_dir)
        # The sidecars' logs: their tails are in res["logs"].
        shutil.rmtree(work, ignore_errors=True)


# --- report -----------------------------------------------------------------------------------------


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# kvxfer GPU device check ({'DRY RUN, host memory' if res['dry_run'] else res.get('gpu', '?')})", "",
             f"{res['when']}; torch {res['torch']}; UCX {res.get('a', {}).get('agents', {}).get('ucx', '?')}", ""]
    a = res.get("a", {})
    if a.get("rows"):
        lines += ["## (a) GPU -> GPU between two processes (GB/s)", "",
                  "| size | kvxfer WRITE | kvxfer READ | cudaMemcpy over IPC | cudaMemcpy in-process | WRITE / IPC | bytes |",
                  "|---:|---:|---:|---:|---:|---:|---|"]
        for r in a["rows"]:
            ratio = r["write_gbps"] / r["memcpy_ipc_gbps"] if r["memcpy_ipc_gbps"] else 0
            lines.append(f"| {r['size'] >> 10} KiB | {r['write_gbps']:.1f} | {r['read_gbps']:.1f} | {r['memcpy_ipc_gbps']:.1f} | "
                         f"{r['memcpy_local_gbps']:.1f} | {ratio:.2f} | {'ok' if r['write_bytes_ok'] and r['read_bytes_ok'] else 'WRONG'} |")
        if a.get("own_memory"):
            lines += ["", "Each agent's own memory (allocateCuda):", "", "| size | WRITE | READ |", "|---:|---:|---:|"]
            lines += [f"| {r['size'] >> 10} KiB | {r['write_gbps']:.1f} | {r['read_gbps']:.1f} |" for r in a["own_memory"]]
        lines.append("")
    b = res.get("b", {})
    if b.get("rows"):
        lines += ["## (b) KV-shaped WRITE (Llama-3-8B pages, scattered blocks)", "",
                  "| tokens | MiB | descriptors | kvxfer ms | native ms | kvxfer / native | bytes |", "|---:|---:|---:|---:|---:|---:|---|"]
        for r in b["rows"]:
            nat = f"{r['native_s'] * 1e3:.2f}" if "native_s" in r else "-"
            ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
            lines.append(f"| {r['tokens']} | {r['bytes'] / 2**20:.0f} | {r['descriptors']} | {r['kvxfer_s'] * 1e3:.2f} | {nat} | {ratio} | "
                         f"{'ok' if r['bytes_ok'] and r['others_untouched'] else 'WRONG'} |")
        lines.append("")
    c = res.get("c", {})
    if c:
        lines += ["## (c) the connector's device path", "", "```", json.dumps(c, indent=1), "```", ""]
    for part, err in res.get("errors", {}).items():
        lines += [f"**({part}) failed:** `{err}`", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node", required=True, help="the node binary that runs the agents")
    ap.add_argument("--carry", default=None, help="the staged folder (bench/gpu/carry): its dist/ is what the agents import")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="host memory, no CUDA: everything up to the first CUDA call")
    ap.add_argument("--parts", default="a,b,c,c-sidecars")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    carry = Path(args.carry).resolve() if args.carry else None
    res: dict[str, Any] = {"dry_run": args.dry_run, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "torch": torch.__version__, "python": platform.python_version(), "errors": {}}
    if not args.dry_run:
        if not torch.cuda.is_available():
            print("harness: torch sees no GPU; use --dry-run on a machine without one", file=sys.stderr)
            return 2
        res["gpu"] = torch.cuda.get_device_name(0)
    mem = HostMemory() if args.dry_run else GpuMemory()
    parts = {"a": part_a, "b": part_b, "c": part_c, "c-sidecars": lambda m, n, c, r: part_c_sidecars(m, r)}
    try:
        for name in args.parts.split(","):
            t0 = time.perf_counter()
            try:
                parts[name](mem, args.node, carry, res)
            except Exception as err:  # noqa: BLE001 - one part's failure must not hide the others
                res["errors"][name] = f"{type(err).__name__}: {err}"
                traceback.print_exc()
            print(f"part ({name}): {time.perf_counter() - t0:.1f} s", flush=True)
            if not args.dry_run:
                torch.cuda.empty_cache()  # each part starts from the driver's memory, not the last part's
    finally:
        mem.close()
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(markdown(res))
    print(markdown(res))
    wrong = [k for k in ("a", "b", "c") if "WRONG" in json.dumps(res.get(k, {}))]
    checks_failed = any(
        not r.get(f) for part in ("a", "b") for r in res.get(part, {}).get("rows", [])
        for f in ("write_bytes_ok", "read_bytes_ok", "bytes_ok", "others_untouched") if f in r)
    return 1 if res["errors"] or wrong or checks_failed else 0


if __name__ == "__main__":
    sys.exit(main())
