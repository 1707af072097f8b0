"""Real bytes through real sidecars: KV laid out by vLLM's own allocation code, described by the
connector, registered through the engine link, moved over UCX, and compared byte for byte."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from conftest import unique, wait_for
from kvengine import KvEngine

from kvxfer_vllm.errors import LayoutError, RegistrationError
from kvxfer_vllm.messages import ExpectMsg, PrefillDoneMsg, StepMessages
from kvxfer_vllm.shm import SharedKvSegments, _segment_info
from kvxfer_vllm.worker import Results


class Collector:
    """Accumulates a worker's results across polls."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.r = Results()

    def poll(self) -> Results:
        got = self.worker.take_results()
        self.r.finished_sending |= got.finished_sending
        self.r.finished_recving |= got.finished_recving
        self.r.failed_recving |= got.failed_recving
        return self.r


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes make NaNs, which never compare equal as floats)."""
    return torch.equal(a.contiguous().view(torch.int8), b.contiguous().view(torch.int8))


def heads_of(tp: int, total: int, rank: int) -> list[int]:
    per = max(1, total // tp)
    return [rank * per + i for i in range(per)] if tp <= total else [rank * total // tp]


def locate(engine: KvEngine, head: int) -> tuple[int, int]:
    """(rank, local head index) holding global KV head ``head`` (first rank that has it)."""
    tp = len(engine.ranks)
    for r in range(tp):
        hs = heads_of(tp, 2, r) if engine.packing != "latent" else [0]
        if head in hs:
            return r, hs.index(head)
    raise AssertionError(head)


@contextlib.contextmanager
def transfer(sidecars, shm_dir, **kw):
    """``run_transfer``, with both engines closed afterwards."""
    p, d, pb, db, r = run_transfer(sidecars, shm_dir, **kw)
    try:
        yield p, d, pb, db, r
    finally:
        p.close()
        d.close()


def run_transfer(sidecars, shm_dir, *, backend, p_tp, d_tp, p_block, d_block, tokens, prefix, mode,
                 p_flags=(), d_flags=(), host_buffer=False, d_backend=None, kv_memory="file",
                 after_forward=False):
    p_sc = sidecars("prefill", *p_flags)
    d_sc = sidecars("decode", *d_flags)
    p = KvEngine(str(shm_dir), p_sc.engine_id, backend=backend, tp=p_tp, block_size=p_block, num_blocks=16,
                 host_buffer=host_buffer, kv_memory=kv_memory, socket=p_sc.socket)
    try:
        d = KvEngine(str(shm_dir), d_sc.engine_id, backend=d_backend or backend, tp=d_tp, block_size=d_block,
                     num_blocks=16, host_buffer=host_buffer, kv_memory=kv_memory, socket=d_sc.socket)
    except BaseException:
        p.close()
        raise
    try:
        pw, dw = p.connect(p_sc.socket), d.connect(d_sc.socket)
        p.fill_random(1)
        # D's "cached" prefix blocks hold a sentinel that must survive the transfer.
        for rank in d.ranks:
            for t in rank.values():
                t.view(torch.int8).zero_()
        p_blocks = [5, 9, 2, 11, 3][: -(-tokens // p_block)]
        d_blocks = [7, 1, 12, 4, 8][: -(-tokens // d_block)]
        for rank in d.ranks:
            for t in rank.values():
                for b in d_blocks[: prefix // d_block]:
                    t[b].view(torch.int8).fill_(7)
        tid = unique("t")
        step_d = StepMessages(expect=[ExpectMsg("rd", tid, d_blocks, tokens, prefix, pw.side_channel,
                                                p_blocks if mode == "pull" else None)])
        done = [PrefillDoneMsg("rp", tid, p_blocks, tokens)]
        # after_forward: P's PrefillDone rides the step whose forward completes the prompt, and goes
        # when the forward has run (the worker's after_forward), not when the step is bound.
        step_p = StepMessages(prefill_done_after_forward=done) if after_forward else StepMessages(prefill_done=done)
        pc, dc = Collector(pw), Collector(dw)
        if mode == "push":
            dw.on_step(step_d)
            pw.on_step(step_p)
        else:
            pw.on_step(step_p)
            dw.on_step(step_d)
        if after_forward:
            with pytest.raises(pytest.fail.Exception, match="timed out"):
                wait_for(lambda: "rd" in dc.poll().finished_recving, 0.5, "D's KV before P's forward ended")
            pw.after_forward(step_p)
        wait_for(lambda: "rd" in dc.poll().finished_recving, 20, "D's KV")
        wait_for(lambda: "rp" in pc.poll().finished_sending, 20, "P's blocks back")
        return p, d, p_blocks, d_blocks, dc.r
    except BaseException:
        p.close()
        d.close()
        raise


def check_cpu_blocks(p, d, p_blocks, d_blocks, tokens, prefix, block):
    """Opaque blocks: every moved (layer, block, head) run equal; prefix and other blocks untouched."""
    moved = range(prefix // block, -(-tokens // block))
    for dr, rank in enumerate(d.ranks):
        for name, dt in rank.items():
            for lh, head in enumerate(heads_of(len(d.ranks), 2, dr)):
                pr, ph = locate(p, head)
                pt = p.ranks[pr][name]
                for i in moved:
                    assert same(dt[d_blocks[i], lh], pt[p_blocks[i], ph]), (name, i, head)
            for i in range(prefix // block):
                assert bool((dt[d_blocks[i]].view(torch.int8) == 7).all()), "prefix block overwritten"
            others = [b for b in range(dt.shape[0]) if b not in d_blocks]
            assert not bool(dt[others].view(torch.int8).any()), "bytes landed outside the request's blocks"


@pytest.mark.parametrize("after_forward", [False, True], ids=["at-bind", "after-forward"])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_cpu_layout_whole_blocks_tp1(sidecars, shm_dir, mode, after_forward):
    with transfer(sidecars, shm_dir, backend="CPU_ATTN", p_tp=1, d_tp=1, p_block=32, d_block=32, tokens=70,
                  prefix=0, mode=mode, after_forward=after_forward) as (p, d, pb, db, r):
        assert p.described.layout.opaque_blocks and p.described.layout.head_stride == 2 * 32 * 64
        assert not r.failed_recving
        check_cpu_blocks(p, d, pb, db, 70, 0, 32)


def test_cpu_layout_head_split_and_prefix(sidecars, shm_dir):
    """P TP 1 -> D TP 2 (each D rank one of the two KV heads), D holds the first block already."""
    with transfer(sidecars, shm_dir, backend="CPU_ATTN", p_tp=1, d_tp=2, p_block=32,
                                   d_block=32, tokens=100, prefix=32, mode="push") as (p, d, pb, db, r):
        assert not r.failed_recving
        check_cpu_blocks(p, d, pb, db, 100, 32, 32)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_kv_in_segments_the_sidecars_allocate(sidecars, shm_dir, mode):
    """kv_memory 'segment': each rank's KV in one owner-only segment its sidecar allocated, moved
    byte for byte (P TP 1 -> D TP 2, D holding the first block already)."""
    with transfer(sidecars, shm_dir, backend="CPU_ATTN", p_tp=1, d_tp=2, p_block=32, d_block=32, tokens=100,
                  prefix=32, mode=mode, kv_memory="segment") as (p, d, pb, db, r):
        assert not r.failed_recving
        for engine in (p, d):
            for rank in engine.files:
                [region] = rank.files
                assert region.path == "" and region.segment is not None
                perms, size, uid = _segment_info(region.segment)
                assert (perms & 0o777, uid) == (0o600, os.geteuid()) and size >= region.nbytes
        assert not list(shm_dir.iterdir()), "segments need no files"
        check_cpu_blocks(p, d, pb, db, 100, 32, 32)


def test_segment_allocation_refusals_name_their_cause(sidecars):
    """A refused allocation, a second allocation for one rank, and no sidecar at all: each is a
    clear error, and the sidecar still allocates afterwards."""
    sc = sidecars("prefill", "--max-kv-bytes", "1048576")
    big = SharedKvSegments(sc.socket, sc.engine_id, 0, 1, timeout_s=20.0)
    try:
        with pytest.raises(RegistrationError) as refused:
            big.allocate(2 << 20)
        assert refused.value.code == "ERR_ALLOCATE_REFUSED"
        assert "ERR_REGION_TOO_LARGE" in refused.value.message
        assert not big.files
    finally:
        big.close()
    ok = SharedKvSegments(sc.socket, sc.engine_id, 0, 1, timeout_s=20.0)
    try:
        t = ok.allocate(1 << 16)
        assert t.numel() == 1 << 16 and not bool(t.any()), "a new segment is zeroed"
        t.fill_(3)
        assert int(t.sum()) == 3 << 16
        with pytest.raises(LayoutError) as second:
            ok.allocate(1 << 16)
        assert second.value.code == "ERR_LAYOUT_UNSUPPORTED" and "use kv_memory 'file'" in second.value.message
    finally:
        ok.detach()
    nobody = SharedKvSegments(f"ipc:///tmp/{unique('kvxfer-none')}.sock", "nobody", 0, 1, timeout_s=0.3)
    try:
        with pytest.raises(RegistrationError) as timeout:
            nobody.allocate(1 << 16)
        assert timeout.value.code == "ERR_ALLOCATE_TIMEOUT" and "0.3 s" in timeout.value.message
    finally:
        nobody.close()


@pytest.mark.parametrize("p_backend", ["FLASH_ATTN", "FLASH_ATTN/cross-layer"])
def test_fused_cells_token_exact_with_block_sizes_and_unaligned_prefix(sidecars, shm_dir, p_backend):
    """FLASH_ATTN's layout (K|V per cell, tokens outer), P also cross-layer (every layer's page in
    one block): P TP 2 block 16 -> D TP 1 block 32, tokens 20..49 move; every cell of a moved token
    equal, every other cell untouched."""
    tokens, prefix = 50, 20
    with transfer(sidecars, shm_dir, backend=p_backend, p_tp=2, d_tp=1, p_block=16,
                                   d_block=32, tokens=tokens, prefix=prefix, mode="pull", d_backend="FLASH_ATTN") as (p, d, pb, db, r):
        assert not r.failed_recving and not p.described.layout.opaque_blocks
        for name, dt in d.ranks[0].items():
            for t in range(tokens):
                dcell = dt[db[t // 32], :, t % 32]
                for head in range(2):
                    pr, ph = locate(p, head)
                    pcell = p.ranks[pr][name][pb[t // 16], ph, t % 16]
                    if t >= prefix:
                        assert same(dcell[head], pcell), (name, t, head)
                    else:  # D's own prefix tokens: untouched (block 0 is only partly prefix: zeros)
                        assert not bool(dcell[head].view(torch.int8).any()), (name, t, head)
            # Token slots past the last token in D's last block stay as they were (zero).
            assert not bool(dt[db[1], :, tokens - 32 :].view(torch.int8).any())


def test_mla_latent_replicated(sidecars, shm_dir):
    """MLA: one latent per layer, every D rank takes a full copy."""
    with transfer(sidecars, shm_dir, backend="FLASHMLA", p_tp=1, d_tp=2, p_block=32,
                                   d_block=32, tokens=40, prefix=0, mode="push") as (p, d, pb, db, r):
        assert p.described.layout.mla and not r.failed_recving
        for rank in d.ranks:
            for name, dt in rank.items():
                pt = p.ranks[0][name]
                for i in range(2):
                    n = 32 if i == 0 else 40 - 32
                    assert same(dt[db[i], :, :n], pt[pb[i], :, :n])


def test_cpu_block_sizes_differ_is_refused_and_nothing_stays_held(sidecars, shm_dir):
    """vLLM CPU blocks are opaque: P block 32 -> D block 64 cannot map. D fails the load (vLLM
    recomputes); P's lease runs out and its blocks come back."""
    p_sc = sidecars("prefill", "--lease-ms", "1000")
    d_sc = sidecars("decode")
    p = KvEngine(str(shm_dir), p_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    d = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=64, num_blocks=8)
    try:
        pw, dw = p.connect(p_sc.socket), d.connect(d_sc.socket)
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("rp", "t-bs", [1, 2], 64)]))
        dw.on_step(StepMessages(expect=[ExpectMsg("rd", "t-bs", [3], 64, 0, pw.side_channel, [1, 2])]))
        pc, dc = Collector(pw), Collector(dw)
        wait_for(lambda: "rd" in dc.poll().failed_recving, 20, "D's load failure")
        assert "rd" in dc.r.finished_recving
        wait_for(lambda: "rp" in pc.poll().finished_sending, 20, "P's lease expiry")
        tid, reason, message = dw.failures[-1]
        assert (tid, reason) == ("t-bs", "FAILURE_REASON_INCOMPATIBLE") and "blockSize" in message, message
        assert not bool(d.ranks[0]["model.layers.0.self_attn.attn"].view(torch.int8).any()), "D was written"
    finally:
        p.close()
        d.close()


def test_host_buffer_placement_copies_through_shared_memory(sidecars, shm_dir):
    """host_buffer placement (GPU engines): the engine's KV stays in its own memory; P copies the
    request's blocks into the shared mirror before PrefillDone, D copies them out on KvReady."""
    with transfer(sidecars, shm_dir, backend="CPU_ATTN", p_tp=1, d_tp=2, p_block=32,
                                   d_block=32, tokens=70, prefix=0, mode="push", host_buffer=True) as (p, d, pb, db, r):
        assert not r.failed_recving
        # The engine's own memory is not shared: the sidecars only ever saw the mirrors.
        assert all(f.tensor.data_ptr() != next(iter(rank.values())).data_ptr() for f, rank in
                   ((fs.files[0], rk) for fs, rk in zip(d.files, d.ranks)))
        check_cpu_blocks(p, d, pb, db, 70, 0, 32)


@pytest.mark.parametrize("d_registers", ["before-the-forward", "mid-forward"])
def test_layer_wise_push_moves_each_layer_once_it_is_saved(sidecars, shm_dir, d_registers):
    """Layer-wise push through real sidecars (vLLM's CPU layout, every layer in one file): P's
    PrefillDone (layer_wise) goes before the "forward", which then saves one layer at a time;
    until a layer is saved P's memory holds other bytes there, so a write posted early lands
    the wrong bytes at D. D is ready only after the last layer, with P's final KV, byte for byte;
    the LayersSaved of two layers at once (one reported late) still moves both."""
    p_sc, d_sc = sidecars("prefill"), sidecars("decode")
    block, tokens = 32, 70
    p = KvEngine(str(shm_dir), p_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=block, num_blocks=16)
    d = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=block, num_blocks=16)
    try:
        pw, dw = p.connect(p_sc.socket, layer_wise=True), d.connect(d_sc.socket)
        p.fill_random(1)
        final = {n: t.clone() for n, t in p.ranks[0].items()}
        for t in p.ranks[0].values():
            t.view(torch.int8).fill_(-1)  # not computed yet
        p_blocks, d_blocks = [5, 9, 2], [7, 1, 12]
        tid = unique("lw")
        step_d = StepMessages(expect=[ExpectMsg("rd", tid, d_blocks, tokens, 0, pw.side_channel, None)])
        step_p = StepMessages(prefill_done_layer_wise=[PrefillDoneMsg("rp", tid, p_blocks, tokens)])
        pc, dc = Collector(pw), Collector(dw)
        if d_registers == "before-the-forward":
            dw.on_step(step_d)
        pw.on_step(step_p)
        names = p.described.layers
        assert len(names) == 2
        # Layer 1 saved first: nothing may move for it until layer 0 is saved too.
        p.ranks[0][names[1]].copy_(final[names[1]])
        pw.layer_saved(names[1])
        if d_registers == "mid-forward":
            dw.on_step(step_d)
        with pytest.raises(pytest.fail.Exception, match="timed out"):
            wait_for(lambda: "rd" in dc.poll().finished_recving, 0.5, "D's KV before every layer was saved")
        p.ranks[0][names[0]].copy_(final[names[0]])
        pw.layer_saved(names[0])
        pw.after_forward(step_p)
        wait_for(lambda: "rd" in dc.poll().finished_recving, 20, "D's KV")
        wait_for(lambda: "rp" in pc.poll().finished_sending, 20, "P's blocks back")
        assert "rd" not in dc.r.failed_recving
        check_cpu_blocks(p, d, p_blocks, d_blocks, tokens, 0, block)
    finally:
        p.close()
        d.close()
