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


def test_vllm_versions():
    check_vllm_version("0.32.0+cpu")
    check_vllm_version("0.33.1")
    with pytest.raises(ConfigError) as e:
        check_vllm_version("0.31.2")
    assert e.value.code == "ERR_VLLM_VERSION" and "0.31.2" in e.value.message and "0.32.x" in e.value.message
