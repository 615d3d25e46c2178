"""Bad input fails loudly and names the problem (docs/architecture.md §4): unknown model types, broken
checkpoints (nothing half-loaded), sequences past max_seq_len, full caches, bad batches."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.runtime.batch import RaggedBatch
from dspark.runtime.config import ModelConfig
from dspark.runtime.kv_cache import KVCache
from dspark.runtime.loader import load_model
from dspark.runtime.target import TargetEngine


@pytest.fixture()
def ckpt_copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return TargetEngine.from_pretrained(tiny_ckpt, capacity=2, max_seq_len=16)


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_weights(folder, fn):
    state = load_file(folder / "model.safetensors")
    fn(state)
    save_file(state, folder / "model.safetensors")


def test_unknown_model_type(ckpt_copy):
    _edit_config(ckpt_copy, model_type="gpt_neox")
    with pytest.raises(ValueError, match="gpt_neox"):
        TargetEngine.from_pretrained(ckpt_copy)


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                                  "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "rope_scaling": {"type": "yarn", "factor": 2.0}})


def test_old_style_rope_fields_are_read():
    cfg = ModelConfig.from_hf_dict({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                                    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0},
                                    "eos_token_id": [3, 4]})
    assert (cfg.rope_theta, cfg.rope_type, cfg.rope_scaling["factor"]) == (5e5, "linear", 2.0)
    assert cfg.head_dim == 4
    assert cfg.eos_token_ids == [3, 4]


def test_missing_tensor(ckpt_copy):
    _edit_weights(ckpt_copy, lambda s: s.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(ckpt_copy)


def test_misshaped_tensor(ckpt_copy):
    def shrink(state):
        state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    _edit_weights(ckpt_copy, shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*\(8, 64\)"):
        load_model(ckpt_copy)


def test_missing_lm_head_when_untied(ckpt_copy):
    _edit_weights(ckpt_copy, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(ckpt_copy)


def test_missing_folder_or_shard(tmp_path, ckpt_copy):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nope")
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(ckpt_copy)


def test_no_free_slot():
    cache = KVCache(num_layers=1, capacity=2, n_kv_heads=1, max_seq_len=4, head_dim=2)
    a, b = cache.allocate(), cache.allocate()
    assert (a, b) == (0, 1) and cache.num_free_slots() == 0
    with pytest.raises(RuntimeError, match=r"no free KV slot \(capacity 2\)"):
        cache.allocate()
    cache.release(a)
    assert cache.allocate() == a


def test_past_max_seq_len_changes_nothing(engine):
    slot = engine.allocate()
    try:
        with pytest.raises(ValueError, match=rf"slot {slot}.*17.*max_seq_len 16"):
            engine.prefill([slot], [[5] * 17])
        assert engine.length(slot) == 0
        engine.prefill([slot], [[5] * 14])
        with pytest.raises(ValueError, match=rf"slot {slot}: 14 cached \+ 3 new tokens"):
            engine.verify(RaggedBatch.from_requests([slot], [[6, 7, 8]], [14]))
        assert engine.length(slot) == 14
    finally:
        engine.release(slot)


def test_bad_batches(engine):
    slot = engine.allocate()
    try:
        engine.prefill([slot], [[5, 6, 7]])
        with pytest.raises(ValueError, match="start at position 2"):
            engine.verify(RaggedBatch.from_requests([slot], [[9]], [2]))
        bad = RaggedBatch.from_requests([slot], [[9, 10]], [3])
        bad.positions = torch.tensor([3, 5])
        with pytest.raises(ValueError, match="positions"):
            engine.verify(bad)
        with pytest.raises(ValueError, match="not allocated"):
            engine.verify(RaggedBatch.from_requests([1 - slot], [[9]], [0]))
        with pytest.raises(ValueError, match="tokens"):
            engine.verify(RaggedBatch.from_requests([slot], [[engine.vocab_size]], [3]))
        with pytest.raises(ValueError, match="rollback"):
            engine.rollback(slot, 4)
        assert engine.length(slot) == 3
    finally:
        engine.release(slot)


def _write_gguf(path, arch: str, block_count: int) -> None:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(block_count)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture()
def tiny_llama(tmp_path, tiny_tokenizer_path):
    from tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer_path=tiny_tokenizer_path)


def test_gguf_of_another_architecture(tiny_llama):
    _write_gguf(tiny_llama / "model.gguf", "gpt2", 4)
    with pytest.raises(ValueError, match=r"model\.gguf: general\.architecture is 'gpt2'"):
        TargetEngine.from_pretrained(tiny_llama, dtype=torch.bfloat16, quant="q4_1")


def test_gguf_that_does_not_match_the_config(tiny_llama):
    _write_gguf(tiny_llama / "model.gguf", "llama", 7)
    with pytest.raises(ValueError, match=r"llama\.block_count = 7 but config\.json num_hidden_layers = 4"):
        TargetEngine.from_pretrained(tiny_llama, dtype=torch.bfloat16, quant="q4_1")


def test_q4_1_needs_a_gguf_and_bf16(tiny_llama):
    with pytest.raises(FileNotFoundError, match="GGUF"):
        TargetEngine.from_pretrained(tiny_llama, dtype=torch.bfloat16, quant="q4_1")
    with pytest.raises(ValueError, match="bf16"):
        TargetEngine.from_pretrained(tiny_llama, dtype=torch.float32, quant="q4_1")
    from dspark import wiring

    with pytest.raises(ValueError, match="dtype.*q4_1.*cpu"):
        wiring.load_target(wiring.Spec(model=str(tiny_llama), dtype="q4_1", device="cuda"))


def test_missing_tokenizer_file(ckpt_copy):
    (ckpt_copy / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (ckpt_copy / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json but no tokenizer\.json"):
        TargetEngine.from_pretrained(ckpt_copy)


def test_chat_template_errors(ckpt_copy):
    from dspark.runtime.chat import ChatTemplate

    with pytest.raises(FileNotFoundError, match=r"no tokenizer_config\.json"):
        ChatTemplate.from_folder(ckpt_copy)
    (ckpt_copy / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with pytest.raises(ValueError, match="no field 'chat_template'"):
        ChatTemplate.from_folder(ckpt_copy)
    (ckpt_copy / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "chat_template": "{% for m in messages %}{{ m.role }}:{{ m.content }}"
         "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"}))
    template = ChatTemplate.from_folder(ckpt_copy)
    assert template.render([{"role": "user", "content": "hi"}]) == "user:hi<|endoftext|>assistant:"
    for bad, field in (([], "messages"), ([{"role": "user"}], r"messages\[0\]\.content"),
                       ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]\.role"),
                       ("hi", "messages")):
        with pytest.raises(ValueError, match=field):
            template.render(bad)


def test_prompt_longer_than_the_context(tiny_ckpt, capsys):
    from dspark.cli import main

    assert main(["generate", "--model", str(tiny_ckpt), "--prompt", "def add(a, b): return a + b " * 8,
                 "--max-seq-len", "16", "--drafter", "none"]) == 2
    assert "longer than --max-seq-len 16" in capsys.readouterr().err
