"""Hybrid models' KV through real sidecars, byte for byte: an engine whose KV cache groups
(full attention, a sliding window, a Mamba state) overlay one allocation as vLLM's hybrid KV
cache manager lays them out (``HybridKvEngine``, vLLM's own ``allocate_kv_cache``), per-group
lists made by the connector's own rules (``groups.transfer_lists``: the window's tail, the state's
slot, null blocks dropped), registered with their groups, moved over UCX in pull and push.

After each transfer D's whole allocation is compared with what it must hold: the moved pages of
every attention layer equal P's, the state slot's state bytes equal P's, and every other byte of
D (blocks outside the window, the state page's padding, other blocks) is still zero.
"""

from __future__ import annotations

import pytest
import torch
from conftest import unique, wait_for
from kvengine import HybridKvEngine
from test_transfer import Collector

from kvxfer_vllm.groups import NULL_BLOCK, flat_ids, transfer_lists
from kvxfer_vllm.messages import ExpectMsg, PrefillDoneMsg, StepMessages

NUM_BLOCKS = 32


def tables(engine: HybridKvEngine, tokens: int, ids: list[int], state_slot: int) -> list[list[int]]:
    """vLLM's tables for a request of ``tokens`` tokens: the full group's blocks, the sliding
    group's with null blocks where the window has passed (vLLM keeps the last
    ``window - 1`` tokens' blocks), and the state group's one slot."""
    out = []
    bs = engine.groups[0].block_size
    n = -(-tokens // bs)
    for g, spec in enumerate(engine.groups):
        if spec.kind == "state":
            out.append([NULL_BLOCK, state_slot])  # a superseded slot, nulled, then the live one
            continue
        mine = ids[g * n:(g + 1) * n]
        if spec.kind == "sliding":
            skipped = max(0, tokens - spec.sliding_window + 1) // bs
            mine = [NULL_BLOCK] * skipped + mine[skipped:]
        out.append(mine)
    return out


def expected_d(p: HybridKvEngine, d: HybridKvEngine, p_lists, d_lists, tokens: int) -> torch.Tensor:
    """D's allocation as it must be after the transfer (both TP 1, one block size)."""
    want = torch.zeros_like(d.raw(0))
    src = p.raw(0)
    page = p.raw(0).numel() // (NUM_BLOCKS * max(len(l) for l in p.group_layers))
    for g, spec in enumerate(p.groups):
        pl, dl = p_lists[g], d_lists[g]
        for j in range(len(p.group_layers[g])):
            base = j * page * NUM_BLOCKS
            if spec.kind == "state":
                ps, ds = base + pl.ids[0] * page, base + dl.ids[0] * page
                want[ds:ds + p.state_bytes] = src[ps:ps + p.state_bytes]
                continue
            first = max(pl.first, dl.first)
            for i in range(first, -(-tokens // spec.block_size)):
                ps, ds = base + pl.ids[i - pl.first] * page, base + dl.ids[i - dl.first] * page
                want[ds:ds + page] = src[ps:ps + page]  # CPU attention: whole blocks move
    return want


@pytest.fixture
def hybrid(sidecars, shm_dir):
    made = []

    def make(role: str, tp: int = 1, block: int = 32, groups=None, backend: str = "CPU_ATTN"):
        sc = sidecars(role)
        kw = {"groups": groups} if groups is not None else {}
        e = HybridKvEngine(str(shm_dir), sc.engine_id, backend=backend, tp=tp, block_size=block,
                           num_blocks=NUM_BLOCKS, **kw)
        made.append(e)
        return sc, e

    yield make
    for e in made:
        e.close()


def run(p_w, d_w, p_lists, d_lists, p_flat, d_flat, tokens, mode, *, expect_ok=True):
    tid = unique("g")
    expect = ExpectMsg("rd", tid, d_flat, tokens, 0, p_w.side_channel,
                       p_flat if mode == "pull" else None, groups=d_lists,
                       source_groups=p_lists if mode == "pull" else None)
    done = PrefillDoneMsg("rp", tid, p_flat, tokens, groups=p_lists)
    pc, dc = Collector(p_w), Collector(d_w)
    first, second = ((d_w, StepMessages(expect=[expect])), (p_w, StepMessages(prefill_done=[done])))
    if mode == "pull":
        first, second = second, first
    first[0].on_step(first[1])
    second[0].on_step(second[1])
    wait_for(lambda: "rd" in dc.poll().finished_recving, 20, "D's KV")
    assert ("rd" not in dc.r.failed_recving) is expect_ok
    if expect_ok:
        wait_for(lambda: "rp" in pc.poll().finished_sending, 20, "P's blocks back")
    # (Refused at the handshake, D cannot tell P: P's blocks come back at its lease.)
    return tid


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("tokens", [20, 70, 200], ids=["one-block", "window-covers-all", "window-passed"])
def test_every_group_moves_exactly_what_it_holds(hybrid, mode, tokens):
    p_sc, p = hybrid("prefill")
    d_sc, d = hybrid("decode")
    p_w, d_w = p.connect(p_sc.socket), d.connect(d_sc.socket)
    p.fill_random(3)
    n = -(-tokens // 32)
    p_lists = transfer_lists(p.groups, tables(p, tokens, list(range(1, 1 + 2 * n)), 30), tokens)
    d_lists = transfer_lists(d.groups, tables(d, tokens, list(range(2 + 2 * n, 2 + 4 * n)), 31), tokens)
    # The sliding group names only the window's tail; the state group its one slot.
    assert len(p_lists[1].ids) == min(n, 3) and p_lists[1].first == n - min(n, 3)
    assert p_lists[2].ids == [30] and d_lists[2].ids == [31]
    before = p_sc.status()["bytesMoved"]
    run(p_w, d_w, p_lists, d_lists, flat_ids(p_lists), flat_ids(d_lists), tokens, mode)
    assert torch.equal(d.raw(0), expected_d(p, d, p_lists, d_lists, tokens))
    page = 8192
    moved_blocks = n + min(n, 3) * 2  # full: every block of 1 layer; sliding: the tail of 2 layers
    assert p_sc.status()["bytesMoved"] - before == moved_blocks * page + p.state_bytes


def test_pairings_that_cannot_be_mapped_are_refused_naming_the_group(hybrid, sidecars):
    """The state is split over TP ranks in the engine's own way: P TP 1, D TP 2 is refused at the
    handshake, naming the state group; D's engine recomputes."""
    p_sc, p = hybrid("prefill", tp=1)
    d_sc, d = hybrid("decode", tp=2)
    p_w, d_w = p.connect(p_sc.socket), d.connect(d_sc.socket)
    lists = transfer_lists(p.groups, tables(p, 40, [1, 2, 3, 4], 30), 40)
    d_lists = transfer_lists(d.groups, tables(d, 40, [5, 6, 7, 8], 29), 40)
    run(p_w, d_w, lists, d_lists, flat_ids(lists), flat_ids(d_lists), 40, "push", expect_ok=False)
    assert [t.reason for t in d_sc.transfers()] == ["ERR_LAYOUT_INCOMPATIBLE"]
    errors = " ".join(p_sc.status()["lastErrors"])
    assert "groups[2].tpSize: group 2 (state): P has TP 1, D has TP 2" in errors, errors


def test_mismatched_groups_are_refused_naming_them(hybrid):
    p_sc, p = hybrid("prefill", groups=(("full", 1), ("sliding", 2)))
    d_sc, d = hybrid("decode", groups=(("full", 1), ("state", 1)))
    p_w, d_w = p.connect(p_sc.socket), d.connect(d_sc.socket)
    pl = transfer_lists(p.groups, [[1, 2], [3, 4]], 40)
    dl = transfer_lists(d.groups, [[5, 6], [7]], 40)
    run(p_w, d_w, pl, dl, flat_ids(pl), flat_ids(dl), 40, "pull", expect_ok=False)
    assert [t.reason for t in d_sc.transfers()] == ["ERR_LAYOUT_INCOMPATIBLE"]
    errors = " ".join(p_sc.status()["lastErrors"])
    assert "groups[1].kind: group 1 is sliding on P, state on D" in errors, errors


@pytest.mark.parametrize("d_tp", [1, 2])
def test_block_sizes_and_tp_differ_per_group(hybrid, d_tp):
    """P's blocks of 32 into D's of 64, P TP 1 into D TP 1 or 2 (each D rank one of the two KV
    heads), full and sliding groups: D's window tail starts earlier (bigger blocks); only tokens
    both sides hold move, and D's blocks before them stay empty."""
    groups = (("full", 1), ("sliding", 1))
    # Plain rows (fused K|V cells), so a token's bytes can be read back token by token.
    p_sc, p = hybrid("prefill", block=32, groups=groups, backend="FLASH_ATTN")
    d_sc, d = hybrid("decode", block=64, groups=groups, backend="FLASH_ATTN", tp=d_tp)
    p_w, d_w = p.connect(p_sc.socket), d.connect(d_sc.socket)
    p.fill_random(5)
    tokens = 300
    pn, dn = -(-tokens // 32), -(-tokens // 64)
    p_lists = transfer_lists(p.groups, tables(p, tokens, list(range(1, 1 + 2 * pn)), 0), tokens)
    d_lists = transfer_lists(d.groups, tables(d, tokens, list(range(1, 1 + 2 * dn)), 0), tokens)
    assert p_lists[1].first * 32 > d_lists[1].first * 64  # D's tail starts earlier
    run(p_w, d_w, p_lists, d_lists, flat_ids(p_lists), flat_ids(d_lists), tokens, "pull")
    # Token by token, K and V of every head: D's block b holds tokens 64 b .. 64 b + 63.
    pv = p.ranks[0]
    heads = 2 // d_tp
    for g in range(len(p.groups)):
        pl, dl = p_lists[g], d_lists[g]
        start = max(pl.first * 32, dl.first * 64)
        for name in p.group_layers[g]:
            for r in range(d_tp):
                dv = d.ranks[r][name]
                for t in range(dl.first * 64, tokens):
                    got = dv[dl.ids[t // 64 - dl.first], :, t % 64].view(torch.int16)
                    if t < start:
                        assert not bool(got.any()), (name, r, t)
                        continue
                    want = pv[name][pl.ids[t // 32 - pl.first], r * heads:(r + 1) * heads, t % 32]
                    assert torch.equal(got, want.view(torch.int16)), (name, r, t)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_an_engine_whose_only_group_is_a_sliding_window(hybrid, mode):
    """Mistral-style: every layer slides. Its one list starts past block 0 (the window passed), in
    a registration, a PushReg and P's answer alike."""
    groups = (("sliding", 2),)
    p_sc, p = hybrid("prefill", groups=groups)
    d_sc, d = hybrid("decode", groups=groups)
    p_w, d_w = p.connect(p_sc.socket), d.connect(d_sc.socket)
    p.fill_random(9)
    tokens = 200
    p_lists = transfer_lists(p.groups, tables(p, tokens, list(range(1, 8)), 0), tokens)
    d_lists = transfer_lists(d.groups, tables(d, tokens, list(range(10, 17)), 0), tokens)
    assert p_lists[0].first == 4 and d_lists[0].first == 4
    run(p_w, d_w, p_lists, d_lists, flat_ids(p_lists), flat_ids(d_lists), tokens, mode)
    assert torch.equal(d.raw(0), expected_d(p, d, p_lists, d_lists, tokens))
