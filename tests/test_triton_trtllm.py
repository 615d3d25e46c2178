"""The TensorRT-LLM target path (architecture §10, §11): the engine loop over TensorRT-LLM's
`tensorrt_llm` contract (whole sequences + draft_input_ids in, generation logits out, prefix KV
reuse instead of slots, no taps) decodes exactly like plain decoding, in process (the client
wired straight to the stand-in's engine) and through tritonserver (the `dspark` BLS model calling
the CPU stand-in model named `tensorrt_llm`)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from serve_helpers import Serve, wait_idle
from test_server import LONG_TOKENS, PROMPT, greedy_texts, server_env

from dspark.paths import REPO_ROOT
from dspark.runtime.drafter.ngram import NGramDrafter
from dspark.runtime.engine import SpecEngine
from dspark.runtime.target import TargetEngine
from dspark.runtime.text import encode
from dspark.serving.trtllm_standin import PrefixCachedTarget, TrtllmTargetClient

sys.path.insert(0, str(REPO_ROOT / "clients"))
import generate_client as client  # noqa: E402


def direct_client(ckpt, capacity: int = 2) -> TrtllmTargetClient:
    """The client's requests go straight to the stand-in's engine (what the BLS call does)."""
    standin = PrefixCachedTarget(TargetEngine.from_pretrained(ckpt, capacity=capacity, max_seq_len=256))

    def send(fields: dict) -> torch.Tensor:
        n = int(fields["input_lengths"].reshape(-1)[0])
        ids = fields["input_ids"].reshape(-1)[:n].tolist()
        drafts = fields.get("draft_input_ids", np.zeros((1, 0), np.int32)).reshape(-1).tolist()
        ((accepted, logits),) = standin.run([(ids, drafts)])
        assert 1 <= len(accepted) <= len(drafts) + 1  # TensorRT-LLM's own output: accepted drafts + 1
        return logits

    return TrtllmTargetClient(send, ckpt, capacity=capacity, max_seq_len=256)


def test_engine_over_the_trtllm_contract_equals_plain(tiny_ckpt):
    plain = TargetEngine.from_pretrained(tiny_ckpt, capacity=2, max_seq_len=256)
    prompts = [encode(plain.tokenizer, p) for p in (PROMPT, "class Stack:\n    def push(self, x):")]
    expected = SpecEngine(plain).generate(prompts, 60)
    target = direct_client(tiny_ckpt)
    assert target.tap_dim == 0
    engine = SpecEngine(target, NGramDrafter(gamma=5), "fixed:3")
    assert engine.generate(prompts, 60) == expected
    assert engine.metrics.verify_budget > 0  # drafts went to the target


def test_own_context_dspark_drafter_needs_no_taps(tiny_ckpt):
    """The DSpark drafter in its own-context mode (context "own": no target hidden states) drafts
    over the TensorRT-LLM contract; the output stays exactly plain (weights random here: the
    trained ones are build/smollm2/drafters/, measured in results/offline_eval_smollm2.json)."""
    from dspark.runtime.drafter.dspark_drafter import DSparkDrafter
    from dspark.runtime.drafter.dspark_model import DSparkConfig, DSparkModel
    from dspark.runtime.drafter.files import shared_weights

    torch.manual_seed(0)
    plain = TargetEngine.from_pretrained(tiny_ckpt, capacity=2, max_seq_len=256)
    prompts = [encode(plain.tokenizer, PROMPT)]
    expected = SpecEngine(plain).generate(prompts, 40)
    embed, lm_head, _ = shared_weights(plain)
    cfg = DSparkConfig(
        vocab_size=embed.shape[0],
        hidden_size=embed.shape[1],
        tap_dim=embed.shape[1],
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        block_size=7,
        context="own",
    )
    engine = SpecEngine(
        direct_client(tiny_ckpt), DSparkDrafter(DSparkModel(cfg), embed, lm_head, gamma=5), "fixed:3"
    )
    assert engine.generate(prompts, 40) == expected
    assert engine.metrics.verify_budget > 0 and engine.metrics.drafter_fallbacks == 0


def test_prefix_reuse_recomputes_only_the_new_tokens(tiny_ckpt):
    standin = PrefixCachedTarget(TargetEngine.from_pretrained(tiny_ckpt, capacity=1, max_seq_len=256))
    ((first, _),) = standin.run([(list(range(5, 25)), [])])
    ((_, logits),) = standin.run([(list(range(5, 25)) + first, [7, 8])])
    assert logits.shape[0] == 3 and standin.target.length(0) == 23  # 20 cached + x0 + 2 drafts
    ((_, again),) = standin.run([(list(range(5, 25)) + first, [7, 8])])  # the rejected tail is recomputed
    assert torch.allclose(logits, again)


@pytest.mark.integration
def test_bls_to_the_tensorrt_llm_stand_in_through_triton(tiny_ckpt, tmp_path):
    env = server_env(tiny_ckpt) | {
        "DSPARK_TRTLLM_STANDIN": "1",
        "DSPARK_TARGET_MODEL": "tensorrt_llm",
        "DSPARK_POLICY": "fixed:3",
    }
    srv = Serve(env=env, log=tmp_path / "serve.log").start()
    try:
        expected = greedy_texts(tiny_ckpt)
        srv.wait_ready(300)
        before = wait_idle(srv.metrics_url)
        assert "".join(client.generate_grpc(srv.grpc_url, PROMPT, LONG_TOKENS)) == expected[LONG_TOKENS]
        after = wait_idle(srv.metrics_url)
        assert after["dspark_verified_tokens_total"] > before["dspark_verified_tokens_total"]
        assert "engine ready (target tensorrt_llm" in srv.log_text()
    finally:
        srv.stop()
