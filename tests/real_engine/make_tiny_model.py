"""Build a tiny random-weights Llama model and a byte-level tokenizer, offline.

Run with the vLLM venv's interpreter (it has transformers and tokenizers):
    python tests/real_engine/make_tiny_model.py OUT_DIR

Model: hidden 64, 2 layers, 2 heads x 32 (the CPU backend needs head size >= 32), vocab 512.
Tokenizer: one token per byte (ids 0..255) plus a few specials, so a prompt of N ASCII characters
is N tokens - the tests reason about block boundaries in characters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE without merges: every byte is its own token.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<s>", "</s>", "<unk>", "<pad>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(out)
    # Never prepend BOS: prompts are exactly their bytes.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg["model_max_length"] = 1024
    cfg_path.write_text(json.dumps(cfg, indent=2))


def build_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=259,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out)
    print(f"tiny model written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
