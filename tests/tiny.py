"""Tiny real assets for tests: a byte-level BPE tokenizer trained on CPython's stdlib text
and random tiny Hugging Face checkpoints written by transformers itself (random norm weights
and biases too, so a wrong norm or a dropped bias shows in the logits)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|mask|>"]
HF_CONFIG_CLASSES = {"qwen3": "Qwen3Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config"}
HF_MODEL_CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def stdlib_text(max_chars: int = 200_000) -> list[str]:
    """Deterministic training text: sorted CPython stdlib sources."""
    root = Path(os.__file__).parent
    texts, total = [], 0
    for name in ("functools.py", "textwrap.py", "string.py", "heapq.py", "bisect.py", "json/encoder.py",
                 "random.py", "statistics.py"):
        path = root / name
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8"))
            total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


def train_tiny_tokenizer(out_path: str | Path, vocab_size: int = 300) -> Path:
    """Byte-level BPE with the special tokens at ids 0, 1, 2; saves tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(stdlib_text(), trainer=trainer)
    out_path = Path(out_path)
    tok.save(str(out_path))
    return out_path


@torch.no_grad()
def randomize_norms_and_biases(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every RMSNorm weight (layer norms, q/k norms, the final norm) a random value in
    [0.5, 1.5] and every bias a random N(0, 0.1) value. Fresh HF models start with norm
    weights 1 and biases 0, under which a dropped bias or a norm applied after RoPE instead
    of before (rotation keeps the RMS; a constant weight commutes with it) change nothing."""
    g = torch.Generator().manual_seed(10_000 + seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def make_tiny_checkpoint(path: str | Path, model_type: str = "qwen3",
                         tokenizer_path: str | Path | None = None, seed: int = 0,
                         max_shard_size: str | None = None, **overrides) -> Path:
    """A random tiny `model_type` model saved by transformers' save_pretrained into `path`
    (+ tokenizer.json if given). Defaults: hidden 64, 4 layers, 4 heads, 2 kv heads,
    head_dim 16, vocab = tokenizer size (else 300). `overrides` go to the HF config. Norm
    weights and biases are random (`randomize_norms_and_biases`), not HF's 1 and 0."""
    import transformers

    path = Path(path)
    vocab = 300
    if tokenizer_path is not None:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    kwargs = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=0, pad_token_id=1)
    kwargs.update(overrides)
    cfg = getattr(transformers, HF_CONFIG_CLASSES[model_type])(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, HF_MODEL_CLASSES[model_type])(cfg).eval()
    randomize_norms_and_biases(model, seed)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    if tokenizer_path is not None:
        (path / "tokenizer.json").write_bytes(Path(tokenizer_path).read_bytes())
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen.update({"eos_token_id": kwargs["eos_token_id"], "pad_token_id": kwargs["pad_token_id"]})
    gen_path.write_text(json.dumps(gen, indent=2))
    return path


def load_hf(path: str | Path):
    """The same checkpoint through transformers (fp32, eager attention, eval)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()
