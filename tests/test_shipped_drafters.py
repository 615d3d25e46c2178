"""The SmolLM2 drafters committed under build/smollm2/drafters: each one loads from its folder
(trainable weights only; embedding and LM head attached from the target), decodes greedy
token-identical to plain decoding, and has really been trained: its drafts get accepted, where
a random drafter's almost never are. The own-context drafter also runs over the TensorRT-LLM
target contract (no taps), as it does behind the `tensorrt_llm` model."""

from __future__ import annotations

import pytest
import torch

from dspark import wiring
from dspark.runtime.drafter import load_drafter_folder
from dspark.runtime.engine import SpecEngine

ROOT = wiring.DRAFTER_DIRS["smollm2"]
SHIPPED = sorted(p.name for p in ROOT.iterdir() if (p / "model.safetensors").is_file())
QUESTIONS = ["Write a Python function that returns the square of a number.",
             "A shop sells 12 apples a day. How many apples does it sell in a week?",
             "Give two tips for writing clear emails."]
TOKENS = 24


@pytest.fixture(scope="module")
def smol(smollm2_folder):
    """SmolLM2 in fp32 (greedy equality is exact there), chat prompts, plain greedy outputs."""
    torch.set_num_threads(1)
    target = wiring.load_target(wiring.Spec(model=str(smollm2_folder), dtype="fp32", capacity=4,
                                            max_seq_len=160))
    prompts = [target.tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids
               for q in QUESTIONS]
    return target, prompts, SpecEngine(target).generate(prompts, TOKENS, stop_token_ids=[])


def accepted_share(engine: SpecEngine) -> float:
    m = engine.metrics
    return sum(m.accepted) / max(1, sum(m.verified))


def test_the_default_drafters_are_shipped():
    assert {"dspark-markov", "dflash"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_drafter_is_lossless_and_trained(smol, name):
    target, prompts, reference = smol
    drafter = load_drafter_folder(ROOT / name, target, gamma=4)
    engine = SpecEngine(target, drafter, "fixed:3")
    assert engine.generate(prompts, TOKENS, stop_token_ids=[]) == reference
    assert engine.metrics.drafter_fallbacks == 0 and sum(engine.metrics.verified) > 0
    assert accepted_share(engine) > 0.1, f"{name}: drafts almost never accepted (untrained weights?)"


@pytest.mark.skipif("dspark-own" not in SHIPPED, reason="dspark-own not trained yet")
def test_own_context_drafter_over_the_tensorrt_llm_contract(smol, smollm2_folder):
    """dspark-own behind the TensorRT-LLM contract (whole sequences in, generation logits out,
    no taps): still token-identical to plain, and its drafts still get accepted."""
    from dspark.runtime.loader import SharedWeights
    from dspark.runtime.target import TargetEngine
    from dspark.serving.trtllm_standin import PrefixCachedTarget, TrtllmTargetClient

    target, prompts, reference = smol
    standin = PrefixCachedTarget(TargetEngine.from_pretrained(smollm2_folder, capacity=4, max_seq_len=160,
                                                              dtype=torch.float32))

    def send(fields: dict) -> torch.Tensor:
        n = int(fields["input_lengths"].reshape(-1)[0])
        ids = fields["input_ids"].reshape(-1)[:n].tolist()
        drafts = fields["draft_input_ids"].reshape(-1).tolist() if "draft_input_ids" in fields else []
        ((_, logits),) = standin.run([(ids, drafts)])
        return logits

    client = TrtllmTargetClient(send, smollm2_folder, capacity=4, max_seq_len=160)
    assert client.tap_dim == 0
    # as in the Triton `drafter` model: the target's embedding / LM head / norm alone, no target
    weights = SharedWeights(smollm2_folder, dtype=torch.float32)
    drafter = load_drafter_folder(ROOT / "dspark-own", weights, gamma=4)
    engine = SpecEngine(client, drafter, "fixed:3")
    assert engine.generate(prompts, TOKENS, stop_token_ids=[]) == reference
    assert accepted_share(engine) > 0.1


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_drafter_runs_in_the_targets_dtype(smollm2_folder, name):
    """Beside a bf16 target every drafter runs in bf16: one left in fp32 casts the target's
    [V, d] LM head on every call (EAGLE did: ~400 ms per propose at batch 1 on SmolLM2)."""
    from dspark.runtime.loader import SharedWeights

    drafter = load_drafter_folder(ROOT / name, SharedWeights(smollm2_folder, dtype=torch.bfloat16), gamma=4)
    assert {p.dtype for p in drafter.model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("policy", ["fixed:3", "dspark"])
def test_hybrid_of_lookup_and_shipped_drafter_is_lossless(smol, smollm2_folder, policy):
    """`ngram+dspark-markov` through the wiring (what a server's drafter spec builds): greedy
    output equals plain on SmolLM2, both sources propose, and the policy sees which made each row."""
    from dspark.runtime.drafter.hybrid import HybridDrafter

    target, prompts, reference = smol
    spec = wiring.Spec(model=str(smollm2_folder), dtype="fp32", drafter="ngram+dspark-markov", gamma=4)
    drafter = wiring.load_drafter(spec, target)
    assert isinstance(drafter, HybridDrafter) and drafter.gamma == 4
    engine = SpecEngine(target, drafter, policy, sps=wiring.load_sps(spec, target.device))
    assert engine.generate(prompts + prompts[:1], TOKENS, stop_token_ids=[]) == reference + reference[:1]
    assert 0 < drafter.lookups < drafter.proposals and engine.metrics.drafter_fallbacks == 0
    assert engine.policy.calibrated_sources == frozenset({1})
    with pytest.raises(ValueError, match="hybrid"):
        wiring.load_drafter(wiring.Spec(model=str(smollm2_folder), drafter="dflash+ngram"), target)
