"""A small random-weight Llama-shaped model and a word-level tokenizer, made offline.

Tests and the benchmark need a real model and cannot download one, so they make
one: GQA (fewer KV heads than attention heads), a few layers, bfloat16, written
with ``transformers``' ``save_pretrained``. Weights come from a fixed seed, so
every run serves the same model. The tokenizer maps ``w<i>`` to id ``3 + i``;
prompts can also be given as token ids. A chat template (each message's content, then a space)
lets ``/v1/chat/completions`` serve it without ``--chat-template``.

    python -m kvxfer_vllm_testing.tiny_model OUT_DIR [--layers 2] [--kv-heads 2]
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
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out_dir, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(spec.vocab - 3):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        # Larger than the default init so greedy decoding is sensitive to every KV byte.
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    with open(stamp, "w") as f:
        json.dump(made, f)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    args = ap.parse_args()
    make_tiny_model(args.out_dir, TinyModelSpec(layers=args.layers, kv_heads=args.kv_heads))
    print(args.out_dir)


if __name__ == "__main__":
    main()
