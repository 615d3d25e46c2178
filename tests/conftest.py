"""Session fixtures shared by every test file: a tiny real tokenizer and a tiny random
Qwen3 checkpoint in Hugging Face format (see tests/tiny.py), and the default model
SmolLM2-135M-Instruct (fetched by `make setup`) loaded once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# No GPU in CI: Triton kernels run under the interpreter. This must be set before anything
# imports triton, so it lives here rather than in the kernel tests (set it to 0 on a GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")
# The target's full batch validation (a pass over every field, off in serving) runs in the tests.
os.environ.setdefault("DSPARK_DEBUG_CHECKS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
# One intra-op thread: on a small shared machine, OpenMP threads contending for cores make
# tiny-model tests 10-80x slower (measured), and results do not depend on the thread count.
torch.set_num_threads(1)

from tiny import make_tiny_checkpoint, train_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory) -> Path:
    """tokenizer.json of a ~300-token byte-level BPE; specials <|endoftext|>=0, <|pad|>=1, <|mask|>=2."""
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_tokenizer_path) -> Path:
    """A random tiny Qwen3 HF folder (hidden 64, 4 layers, 4 heads, 2 kv heads, head_dim 16,
    random norm weights) with tokenizer.json and generation_config.json (eos 0, pad 1).
    Seed 3, because some server tests depend on how this random model behaves: its greedy
    text repeats enough for the n-gram drafter to get drafts accepted (11 in 100 tokens from
    test_server's prompt; seed 0: 1) and it does not end the load test's prompts at once
    (seed 1 emits EOS first for some)."""
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    return make_tiny_checkpoint(folder, "qwen3", tokenizer_path=tiny_tokenizer_path, seed=3)


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """The converted SmolLM2-135M-Instruct folder; the tests that need it skip without it."""
    from dspark.paths import SMOLLM2

    if not (SMOLLM2 / "model.safetensors").is_file():
        pytest.skip(f"no SmolLM2 at {SMOLLM2} (run `make setup` or `dspark fetch-model`)")
    return SMOLLM2


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_folder):
    """Our engine on SmolLM2 in fp32 (4 slots of 640 tokens), loaded once per session."""
    from dspark.runtime.target import TargetEngine

    return TargetEngine.from_pretrained(smollm2_folder, capacity=4, max_seq_len=640, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_hf_fp32(smollm2_folder):
    """transformers' LlamaForCausalLM on the same folder, fp32, eval, loaded once per session."""
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(str(smollm2_folder), dtype=torch.float32).eval()
