"""SmolLM2-135M-Instruct, the default model (issue 12): our engine equals transformers'
LlamaForCausalLM on the converted folder (fp32 logits, prefill and token-by-token decode,
greedy continuations; bf16 greedy text up to measured logit ties), its chat template renders
like transformers', `dspark generate --chat` answers and stops at <|im_end|>, and the GGUF's
own Q4_1 weights (`--dtype q4_1`) stay within a stated tolerance of the fp32 model.

The model is loaded once per session (tests/conftest.py); everything here skips when
`make setup` has not fetched it."""

from __future__ import annotations

import pytest
import torch
from tiny import stdlib_text

from dspark.runtime.batch import RaggedBatch
from dspark.runtime.engine import SpecEngine
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.target import TargetEngine

ATOL_FP32 = 1e-3
N_DECODE = 6  # token-by-token decode steps checked after each prefill
N_GREEDY = 64
# q4_1 vs the fp32 dequantized model (logits span about ±30), on the prefill row and 3 decode rows of
# each prompt: measured max |Δ| 0.49-0.96, mean 0.11-0.22, against 0.30-0.68 / 0.05-0.16 for our
# plain bf16 engine on the same rows (bf16 activations are most of it; the bf16-held group scales
# add the rest, see test_int4_linear_error); the argmax agrees on every row.
Q4_1_MAX_ABS = 1.5
Q4_1_MEAN_ABS = 0.3


@pytest.fixture(scope="module")
def prompts(smollm2_folder, smollm2_fp32) -> dict[str, list[int]]:
    """Three prompts: plain text, a ChatML chat, and 500 tokens of Python source."""
    from dspark.runtime.chat import ChatTemplate

    tok = smollm2_fp32.tokenizer
    chat = ChatTemplate.from_folder(smollm2_folder).render(
        [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}])
    long = tok.encode("".join(stdlib_text(20_000))).ids[:500]
    assert len(long) == 500
    return {"text": tok.encode("The capital of France is").ids,
            "chat": tok.encode(chat, add_special_tokens=False).ids, "long": long}


def _greedy(engine: TargetEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    return SpecEngine(engine).generate(prompts, n, SamplingParams(), stop_token_ids=[])


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_config_and_tokenizer(smollm2_fp32):
    cfg = smollm2_fp32.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert cfg.intermediate_size == 1536
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1e5 and cfg.vocab_size == 49152
    tok = smollm2_fp32.tokenizer
    assert smollm2_fp32.eos_token_ids == [2] and tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(1) == "<|im_start|>"


def test_logits_equal_transformers_fp32_prefill_and_decode(smollm2_fp32, smollm2_hf_fp32, prompts):
    """Prefill all but the last N_DECODE tokens, then feed those one at a time: every logit row
    within ATOL_FP32 of transformers' full forward over the same tokens."""
    engine = smollm2_fp32
    for name, ids in prompts.items():
        with torch.no_grad():
            ref = smollm2_hf_fp32(torch.tensor([ids])).logits[0]
        cut = max(len(ids) - N_DECODE, 1)
        slot = engine.allocate()
        try:
            last, _ = engine.prefill([slot], [ids[:cut]])
            worst = (last[0] - ref[cut - 1]).abs().max().item()
            assert worst <= ATOL_FP32, f"{name}: prefill max |Δ| {worst}"
            for t in range(cut, len(ids)):
                logits, _ = engine.verify(RaggedBatch.from_requests([slot], [[ids[t]]], [t]))
                worst = (logits[0] - ref[t]).abs().max().item()
                assert worst <= ATOL_FP32, f"{name}: decode position {t} max |Δ| {worst}"
        finally:
            engine.release(slot)


def test_greedy_64_tokens_equal_transformers_fp32(smollm2_fp32, smollm2_hf_fp32, prompts):
    ours = _greedy(smollm2_fp32, list(prompts.values()), N_GREEDY)  # the three decoded together
    for (name, ids), got in zip(prompts.items(), ours):
        assert got == _hf_greedy(smollm2_hf_fp32, ids, N_GREEDY), name
    text = smollm2_fp32.tokenizer.decode(ours[0])
    assert text.startswith(" Paris"), text


def test_bf16_greedy_equals_transformers_bf16_or_diverges_at_a_measured_tie(smollm2_folder,
                                                                            smollm2_hf_fp32, prompts):
    """Both bf16 runs round differently (fused vs separate norms, matmul blocking), so a greedy
    pick may flip where two logits are nearly equal. At the first divergence (if any) the two
    picks must be a tie: their fp32 logit gap no larger than the two bf16 runs' measured logit
    errors at that position together."""
    from transformers import LlamaForCausalLM

    n = 32
    ours_engine = TargetEngine.from_pretrained(smollm2_folder, capacity=3, max_seq_len=640,
                                               dtype=torch.bfloat16)
    hf16 = LlamaForCausalLM.from_pretrained(str(smollm2_folder), dtype=torch.bfloat16).eval()
    ours = _greedy(ours_engine, list(prompts.values()), n)
    report = {}
    for (name, ids), got in zip(prompts.items(), ours):
        ref = _hf_greedy(hf16, ids, n)
        if got == ref:
            report[name] = "identical"
            continue
        p = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        prefix = torch.tensor([ids + got[:p]])
        with torch.no_grad():
            z32 = smollm2_hf_fp32(prefix).logits[0, -1]
            z_hf = hf16(prefix).logits[0, -1].float()
            z_ours = ours_engine.model.forward_train(prefix)[0, -1].float()
        a, b = got[p], ref[p]
        gap = (z32[a] - z32[b]).abs().item()
        err = (z_ours - z32).abs().max().item() + (z_hf - z32).abs().max().item()
        report[name] = f"diverges at {p}: fp32 gap {gap:.4f} <= bf16 errors {err:.4f}"
        # Each pick came from a cached decode, which rounds differently from this full forward
        # (on CPUs without bf16 kernels the two can swap a near-tie), so each pick need only be
        # within the measured bf16 errors of the full forward's best logit.
        for z, pick in ((z_ours, a), (z_hf, b)):
            assert (z.max() - z[pick]).item() <= err, f"{name}: pick {pick} is not near the top"
        assert gap <= err, f"{name}: divergence at {p} is no tie: fp32 gap {gap} > bf16 errors {err}"
    print(report)


def test_bf16_verify_computes_plain_decodings_logits_bit_for_bit(smollm2_folder, prompts):
    """Where our CPU kernels serve bf16 (an AVX512-BF16 CPU: `DotBf16Linear` matmuls and
    `cpu_attention`, each row computed alone), verifying a 12-token continuation in one forward
    gives exactly the logits that decoding it token by token gives: a speculative verify and
    plain decoding agree bit for bit, not just up to ties. The continuation is plain greedy's."""
    from dspark.runtime import cpu_attention

    engine = TargetEngine.from_pretrained(smollm2_folder, capacity=2, max_seq_len=640, dtype=torch.bfloat16)
    if not engine.cpu_attention:
        pytest.skip("our bf16 CPU kernels do not serve here (they need AVX512-BF16 without AMX)")
    assert cpu_attention.library() is not None
    prompt, n = prompts["chat"], 12
    plain, verify = engine.allocate(), engine.allocate()
    logits, _ = engine.prefill([plain, verify], [prompt, prompt])
    tokens, rows = [int(logits[0].argmax())], []
    for _ in range(n - 1):
        step, _ = engine.verify(RaggedBatch.from_requests([plain], [tokens[-1:]], [engine.length(plain)]))
        rows.append(step[0])
        tokens.append(int(step[0].argmax()))
    block, _ = engine.verify(RaggedBatch.from_requests([verify], [tokens[:-1]], [engine.length(verify)]))
    assert torch.equal(block, torch.stack(rows))
    # and inside a ragged batch beside another request's single token
    engine.rollback(verify, len(prompt))
    engine.rollback(plain, len(prompt) + 3)
    mixed, _ = engine.verify(RaggedBatch.from_requests([plain, verify], [tokens[3:4], tokens[:6]],
                                                       [engine.length(plain), engine.length(verify)]))
    assert torch.equal(mixed[1:], torch.stack(rows[:6])) and torch.equal(mixed[0], rows[3])


def test_chat_template_renders_like_transformers(smollm2_folder):
    from transformers import AutoTokenizer

    from dspark.runtime.chat import ChatTemplate

    hf_tok = AutoTokenizer.from_pretrained(str(smollm2_folder))
    ours = ChatTemplate.from_folder(smollm2_folder)
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "4"},
         {"role": "user", "content": "naïve ✓ 日本語 {{ not jinja }}"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    ]
    for conv in conversations:
        for gen in (True, False):
            assert ours.render(conv, add_generation_prompt=gen) == hf_tok.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=gen)
    text = ours.render(conversations[0])
    assert text.endswith("<|im_start|>assistant\n") and "You are a helpful AI assistant named SmolLM" in text


def test_generate_chat_cli_answers_and_stops_at_im_end(smollm2_folder, capsys):
    from dspark.tools import generate

    parser = __import__("argparse").ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(["--chat", "What is the capital of France?", "--drafter", "none",
                              "--dtype", "fp32", "--max-tokens", "24", "--max-seq-len", "128"])
    assert generate.main(args) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "The capital of France is Paris."
    assert "[8 tokens" in out.err  # 7 text tokens + <|im_end|>, well under --max-tokens


def test_q4_1_weights_are_the_gguf_blocks_exactly(smollm2_folder):
    """d·q + m of every Q4_1 block, rows un-permuted, equals the fp32 folder that transformers'
    GGUF loader wrote (bit for bit)."""
    from safetensors import safe_open

    from dspark.runtime.quant import dequantized_linears

    weights = dequantized_linears(smollm2_folder)
    assert len(weights) == 30 * 7
    with safe_open(str(smollm2_folder / "model.safetensors"), framework="pt") as f:
        for name, w in weights.items():
            assert torch.equal(w, f.get_tensor(name)), name


def test_int4_linear_error(smollm2_folder):
    """One layer's int4 matmul vs the same weights dense: only the bf16 rounding of the group
    scale and zero (and of x) differs; measured relative error well under 1 %."""
    from dspark.runtime.quant import GGUFModel, Int4Linear

    src = GGUFModel(smollm2_folder)
    w = src.q4_1("model.layers.3.mlp.down_proj.weight", (576, 1536))
    x = torch.randn(8, 1536, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = Int4Linear(w)(x).float()
    ref = x.float() @ w.dequantize().t()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 5e-3, rel
    # from DENSE_FROM_ROWS rows the same weights run dense in bf16: the int4 kernel's result up
    # to the bf16 rounding of each weight
    from dspark.runtime.quant import DENSE_FROM_ROWS

    layer = Int4Linear(w)
    wide = torch.randn(DENSE_FROM_ROWS, 1536, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    dense = layer(wide).float()
    layer.dense = None  # the int4 kernel alone
    int4 = layer(wide).float()
    assert not torch.equal(dense, int4)  # two paths were taken
    assert ((dense - int4).norm() / int4.norm()).item() < 5e-3
    assert torch.equal(layer(x), Int4Linear(w)(x))  # below the threshold: the int4 kernel either way


def test_q4_1_logits_within_tolerance_of_fp32(smollm2_folder, smollm2_fp32, prompts):
    engine = TargetEngine.from_pretrained(smollm2_folder, capacity=1, max_seq_len=640,
                                          dtype=torch.bfloat16, quant="q4_1")
    assert engine.model.layers[0].self_attn.qkv.__class__.__name__ == "Int4Linear"
    assert not hasattr(engine.model.layers[0].mlp, "up_proj")  # no dense copy kept
    for name, ids in prompts.items():
        rows = {}
        for label, e in (("q4", engine), ("fp32", smollm2_fp32)):
            slot = e.allocate()
            try:
                last, _ = e.prefill([slot], [ids[:-3]])
                steps = [e.verify(RaggedBatch.from_requests([slot], [[ids[t]]], [t]))[0][0]
                         for t in range(len(ids) - 3, len(ids))]
                rows[label] = torch.stack([last[0]] + steps).float()
            finally:
                e.release(slot)
        diff = (rows["q4"] - rows["fp32"]).abs()
        assert diff.max().item() <= Q4_1_MAX_ABS, f"{name}: max |Δ| {diff.max().item()}"
        assert diff.mean().item() <= Q4_1_MEAN_ABS, f"{name}: mean |Δ| {diff.mean().item()}"
        assert torch.equal(rows["q4"].argmax(-1), rows["fp32"].argmax(-1)), name
    out = _greedy(engine, [prompts["text"]], 4)[0]
    assert engine.tokenizer.decode(out).startswith(" Paris")
