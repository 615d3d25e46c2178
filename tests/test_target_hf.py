"""Our transformer equals transformers on random tiny checkpoints (docs/architecture.md §4): prefill,
token-by-token decode, the training forward, taps, save_pretrained round trips, greedy
generation."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import load_hf, make_tiny_checkpoint

from dspark import wiring
from dspark.runtime.batch import RaggedBatch
from dspark.runtime.config import ModelConfig
from dspark.runtime.engine import SpecEngine
from dspark.runtime.loader import load_model, save_pretrained
from dspark.runtime.model import Transformer, default_tap_layers
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.target import TargetEngine

ATOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500.0}
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}
VARIANTS = {
    "qwen3-sharded": ("qwen3", {}, "60KB"),
    "qwen3-tied-headdim32-bias": ("qwen3", {"tie_word_embeddings": True, "head_dim": 32,
                                            "attention_bias": True}, None),
    "llama-llama3rope-bias": ("llama", {"rope_parameters": LLAMA3_ROPE, "attention_bias": True,
                                        "mlp_bias": True}, None),
    "llama-linear-tied": ("llama", {"rope_parameters": LINEAR_ROPE, "tie_word_embeddings": True,
                                    "num_key_value_heads": 1}, None),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}, None),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def ckpt(request, tmp_path_factory):
    model_type, overrides, shard = VARIANTS[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), model_type, seed=1,
                                max_shard_size=shard, **overrides)
    return path, load_hf(path)


def _tokens(n: int, seed: int = 0, vocab: int = 300) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_variant_files(ckpt):
    path, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    if path.name.startswith("qwen3-sharded"):
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 1
    if cfg.get("tie_word_embeddings"):
        assert ModelConfig.from_hf_dict(cfg).tie_word_embeddings


def test_prefill_and_decode_match_transformers(ckpt):
    path, hf = ckpt
    prompt_len, n_decode = 21, 12
    toks = _tokens(prompt_len + n_decode)
    with torch.no_grad():
        ref = hf(toks[None]).logits[0]
    engine = TargetEngine.from_pretrained(path, capacity=2, max_seq_len=64)
    slot = engine.allocate()
    last, taps = engine.prefill([slot], [toks[:prompt_len].tolist()])
    assert taps[0].shape == (prompt_len, engine.tap_dim)
    assert (last[0] - ref[prompt_len - 1]).abs().max() <= ATOL
    for t in range(prompt_len, prompt_len + n_decode):
        logits, _ = engine.verify(RaggedBatch.from_requests([slot], [[int(toks[t])]], [t]))
        assert (logits[0] - ref[t]).abs().max() <= ATOL, f"decode position {t}"
    assert engine.length(slot) == prompt_len + n_decode


def test_forward_train_and_taps_match_transformers(ckpt):
    path, hf = ckpt
    model, cfg = load_model(path)
    toks = torch.stack([_tokens(17, seed=1), _tokens(17, seed=2)])
    with torch.no_grad():
        out = hf(toks, output_hidden_states=True)
        ours = model.forward_train(toks)
        _, taps = model.forward_hidden(toks)
    assert (ours - out.logits).abs().max() <= ATOL
    d = cfg.hidden_size
    for j, layer in enumerate(model.tap_layers):
        if layer < cfg.num_hidden_layers - 1:  # HF's last entry is after the final norm
            assert (taps[..., j * d:(j + 1) * d] - out.hidden_states[layer + 1]).abs().max() <= ATOL


def test_save_pretrained_round_trip(ckpt, tmp_path):
    path, hf = ckpt
    model, cfg = load_model(path)
    save_pretrained(model, cfg, tmp_path / "copy")
    toks = _tokens(13, seed=3)[None]
    ours_again, _ = load_model(tmp_path / "copy")
    with torch.no_grad():
        ref = hf(toks).logits
        if "tied" in path.name:  # transformers re-reads what we wrote (untied: the from-scratch test)
            assert (load_hf(tmp_path / "copy")(toks).logits - ref).abs().max() <= ATOL
    assert (ours_again.forward_train(toks) - ref).abs().max() <= ATOL


def test_save_pretrained_from_scratch_with_tokenizer(tmp_path, tiny_tokenizer_path):
    """The demo-model trainer's path: build ours, train a step, save, load in both."""
    cfg = ModelConfig("qwen3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, qk_norm=True,
                      tie_word_embeddings=True, eos_token_ids=[0], pad_token_id=1)
    torch.manual_seed(0)
    model = Transformer(cfg)
    toks = _tokens(24)[None]
    loss = torch.nn.functional.cross_entropy(model.forward_train(toks[:, :-1])[0], toks[0, 1:])
    loss.backward()
    assert model.embed_tokens.weight.grad is not None
    assert model.layers[0].self_attn.q_norm.weight.grad is not None
    save_pretrained(model, cfg, tmp_path / "m", tokenizer_path=tiny_tokenizer_path)
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    engine = TargetEngine.from_pretrained(tmp_path / "m")
    assert engine.eos_token_ids == [0] and engine.tokenizer.get_vocab_size() == 300
    with torch.no_grad():
        ref = model.forward_train(toks)
        assert (load_hf(tmp_path / "m")(toks).logits - ref).abs().max() <= ATOL
        assert (engine.model.forward_train(toks) - ref).abs().max() <= ATOL


def test_default_tap_layers():
    assert default_tap_layers(36, 3) == [1, 17, 33]  # Qwen3-4B-sized: spread over [1, L-3]
    assert default_tap_layers(6, 3) == [1, 2, 3]
    assert default_tap_layers(4, 3) == [0, 2, 3]  # too small for [1, L-3]: spread over all layers
    assert default_tap_layers(1, 3) == [0, 0, 0]
    assert default_tap_layers(12, 1) == [5]


def test_greedy_generate_batch1_equals_batch4_equals_transformers(tiny_ckpt):
    hf = load_hf(tiny_ckpt)
    engine = TargetEngine.from_pretrained(tiny_ckpt, capacity=4, max_seq_len=96)
    prompts = [_tokens(n, seed=10 + n).tolist() for n in (5, 9, 14, 3)]
    n_new = 12
    batch4 = SpecEngine(engine).generate(prompts, n_new, SamplingParams(), stop_token_ids=[])
    assert engine.num_free_slots() == 4
    for prompt, got in zip(prompts, batch4):
        alone = SpecEngine(engine).generate([prompt], n_new, SamplingParams(), stop_token_ids=[])[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False,
                              eos_token_id=None, pad_token_id=1)
        assert got == alone == ref[0, len(prompt):].tolist()


def test_generate_cli_streams_text(tiny_ckpt, capsys):
    from dspark.cli import main

    assert main(["generate", "--model", str(tiny_ckpt), "--prompt", "def add(a, b):", "--max-tokens", "8",
                 "--temperature", "0.8", "--top-k", "20", "--seed", "1"]) == 0
    out = capsys.readouterr()
    assert "tokens/s" in out.err and out.out.endswith("\n")
    assert main(["generate", "--model", str(tiny_ckpt / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_generate_cli_speculative_equals_plain_greedy(tiny_ckpt, capsys):
    from dspark.cli import main

    texts = []
    for drafter in ("none", "ngram"):
        assert main(["generate", "--model", str(tiny_ckpt), "--prompt", "def add(a, b):", "--max-tokens",
                     "24", "--drafter", drafter, "--policy", "dspark", "--sps", "gpu_shaped"]) == 0
        out = capsys.readouterr()
        assert f"drafter {drafter}" in out.err
        texts.append(out.out)
    assert texts[0] == texts[1] and texts[0].strip()


def test_incremental_detokenizer_never_splits_characters(tiny_tokenizer_path):
    from tokenizers import Tokenizer

    from dspark.tools.generate import IncrementalDetokenizer

    tok = Tokenizer.from_file(str(tiny_tokenizer_path))
    text = "naïve café – 日本語 ok"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_bench_target_ragged_only(tiny_ckpt, tmp_path):
    """--ragged-only: uniform against ragged verifies of equal size, each shape's times measured."""
    from dspark.bench.target import RAGGED_SHAPES, ragged_ms
    from dspark.cli import main

    out = tmp_path / "ragged.json"
    assert main(["bench-target", "--model", str(tiny_ckpt), "--ragged-only", "--quick", "--dtypes", "fp32",
                 "--verify-context", "8", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    cells = res["ragged_vs_uniform_ms"]
    assert set(cells) == set(RAGGED_SHAPES) and res["dtype"] == "fp32"
    for name, cell in cells.items():
        assert cell["tokens"] == sum(RAGGED_SHAPES[name][0]) == sum(cell["ragged"])
        assert cell["uniform_ms"] > 0 and cell["ragged_ms"] > 0
        assert cell["ratio"] == pytest.approx(cell["ragged_ms"] / cell["uniform_ms"], rel=0.01)
    engine = wiring.load_target(wiring.resolve(env={}, model=str(tiny_ckpt), dtype="fp32", capacity=2,
                                               max_seq_len=32))
    with pytest.raises(ValueError, match="differ"):
        ragged_ms(engine, list(range(8)), 1, {"bad": ([2, 2], [1, 2])})
    assert engine.num_free_slots() == 2  # the slots come back


def test_bench_target_writes_json(tiny_ckpt, tmp_path):
    from dspark.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench-target", "--model", str(tiny_ckpt), "--batch-sizes", "1,2", "--max-new-tokens", "3",
                 "--repeats", "1", "--prompt-len", "8", "--verify-context", "8", "--thread-counts", "1",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    tps = res["decode_tokens_per_s"]
    assert set(tps) == {"dspark", "transformers"}  # no GGUF: no q4_1 column
    assert set(tps["dspark"]) == set(tps["transformers"]) == {"1", "2"}
    assert all(v > 0 for v in tps["dspark"].values())
    assert res["dtype"] in ("fp32", "bf16")
    assert tps["dspark"] == res["decode_tokens_per_s_by_dtype"]["dspark"][res["dtype"]]
    assert list(res["verify_ms_by_tokens"]) == ["1", "2", "4", "8", "16", "32", "64"]
    assert res["greedy_fp32_outputs_match_transformers"] == {"1": 1.0, "2": 1.0}
    assert set(res["goals"]) == {"batch1_vs_transformers", "batch32_vs_transformers", "verify16_vs_step"}
    assert set(res["decode_tokens_per_s_by_threads"]) == {"as_is", "one_busy_core"}
    acc = res["accuracy"]  # bf16 against fp32 on the same logit rows
    assert acc["rows"] == 16 and 0 < acc["bf16"]["max_abs"] < 1 and acc["bf16"]["top1_agree"] > 0.5
    assert set(res["decode_tokens_per_s_by_threads"]["one_busy_core"]["1"]) == {"1", "2"}
