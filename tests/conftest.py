"""Session fixtures shared by every test file: a tiny real tokenizer and a tiny random
Qwen3 checkpoint in Hugging Face format (see tests/tiny.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# No GPU in CI: Triton kernels run under the interpreter. This must be set before anything
# imports triton, so it lives here rather than in the kernel tests (set it to 0 on a GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

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
    """A random tiny Qwen3 HF folder (hidden 64, 4 layers, 4 heads, 2 kv heads, head_dim 16)
    with tokenizer.json and generation_config.json (eos 0, pad 1)."""
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    return make_tiny_checkpoint(folder, "qwen3", tokenizer_path=tiny_tokenizer_path)
