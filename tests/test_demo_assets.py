"""The shipped demo target (build/demo/target) is a valid Hugging Face folder: our loader and
transformers both load it and agree on the logits; its tokenizer has the special tokens
the drafters rely on; it fits the size budget."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.paths import DEMO_TARGET
from dspark.runtime.engine import SpecEngine

pytestmark = pytest.mark.skipif(not (DEMO_TARGET / "model.safetensors").is_file(),
                                reason=f"no demo target at {DEMO_TARGET} (build it with `make demo-assets`)")

PROMPT = "def fibonacci(n):\n    "


def test_folder_layout_and_size():
    cfg = json.loads((DEMO_TARGET / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert cfg["tie_word_embeddings"] is True
    gen = json.loads((DEMO_TARGET / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 0
    total = sum(p.stat().st_size for p in DEMO_TARGET.iterdir() if p.is_file())
    assert total <= 25_000_000, f"demo target is {total / 1e6:.1f} MB"


def test_tokenizer_special_tokens_and_roundtrip():
    from dspark.runtime.text import load_tokenizer

    tok = load_tokenizer(DEMO_TARGET)
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|pad|>", "<|mask|>")] == [0, 1, 2]
    text = "for i in range(10):\n    print(i)  # naïve ✓"
    assert tok.decode(tok.encode(text).ids) == text


def test_our_loader_and_transformers_agree():
    import transformers

    from dspark.runtime.loader import load_model
    from dspark.runtime.text import load_tokenizer

    torch.manual_seed(0)
    ids = torch.tensor([load_tokenizer(DEMO_TARGET).encode(PROMPT).ids])
    ours, _ = load_model(DEMO_TARGET, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO_TARGET), dtype=torch.float32).eval()
    with torch.no_grad():
        ours_logits = ours.forward_train(ids)
        hf_logits = hf(ids).logits
    assert ours_logits.shape == hf_logits.shape == (1, ids.shape[1], ours.config.vocab_size)
    torch.testing.assert_close(ours_logits, hf_logits, atol=2e-4, rtol=1e-4)


def test_target_engine_greedy_matches_full_forward():
    """TargetEngine's cached decoding picks the same greedy tokens as re-running the prefix."""
    from dspark.runtime.target import TargetEngine

    engine = TargetEngine.from_pretrained(DEMO_TARGET, capacity=1, max_seq_len=128)
    ids = engine.tokenizer.encode(PROMPT).ids
    out = SpecEngine(engine).generate([ids], 8, stop_token_ids=[])[0]
    assert len(out) == 8
    seq = list(ids)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(engine.model.forward_train(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(ids):]
