"""Drafters (architecture §5): DSpark (Markov / RNN / none), EAGLE-style and the draft LM behind
`DrafterLike`: shapes, exact draft distributions (flat, verified rows of sampled requests only),
greedy = argmax, the sequential head's dependence on x_{k−1}, confidence never reading x_k,
per-slot isolation, context K/V read in place, save/load, the training forward equal to the
serving path, and lossless greedy speculative decoding."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.runtime.drafter import load_drafter
from dspark.runtime.drafter.draft_lm import DraftLMDrafter, new_draft_lm, save_draft_lm
from dspark.runtime.drafter.dspark_drafter import DSparkDrafter
from dspark.runtime.drafter.dspark_model import DSparkConfig, DSparkModel, save_dspark
from dspark.runtime.drafter.eagle import EagleConfig, EagleDrafter, EagleModel, save_eagle
from dspark.runtime.drafter.files import shared_weights
from dspark.runtime.drafter.hybrid import HybridDrafter
from dspark.runtime.drafter.ngram import NGramDrafter
from dspark.runtime.engine import SpecEngine
from dspark.runtime.sampling import SamplingParams, param_tensors, sampling_probs
from dspark.runtime.target import TargetEngine

torch.set_num_threads(1)
G = 6  # trained block size in these tests
MIXED = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3)]


def uniforms(r: int, gamma: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(r, gamma, generator=torch.Generator().manual_seed(seed))


def extend_rows(d, slot: int, tokens: list[int], taps: torch.Tensor) -> None:
    """extend one slot with all of `tokens` (and their taps)."""
    n = len(tokens)
    d.extend([slot], torch.tensor(tokens), taps, torch.tensor([0, n]), torch.tensor([n]))


@pytest.fixture(scope="module")
def target(tiny_ckpt):
    return TargetEngine.from_pretrained(tiny_ckpt, capacity=4, max_seq_len=160)


def _randomise(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Untrained heads start at B = 0 / z = 0; give every weight a random value instead."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std + (1.0 if p.dim() == 1 else 0.0))


def make_dspark(target, head: str, seed: int = 0, gamma: int = 4) -> DSparkDrafter:
    cfg = target.config
    dc = DSparkConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, tap_dim=target.tap_dim,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64,
                      block_size=G, gamma=gamma, head=head, head_rank=16, tap_layers=list(target.tap_layers))
    model = DSparkModel(dc)
    _randomise(model, seed)
    emb, lm, _ = shared_weights(target)
    return DSparkDrafter(model, emb, lm)


def make_eagle(target, seed: int = 0) -> EagleDrafter:
    cfg = target.config
    ec = EagleConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, tap_dim=target.tap_dim,
                     num_heads=4,
                     num_kv_heads=2, head_dim=16, intermediate_size=64, block_size=G, gamma=4)
    model = EagleModel(ec)
    _randomise(model, seed)
    emb, lm, _ = shared_weights(target)
    return EagleDrafter(model, emb, lm)


def make_draft_lm(target, folder, seed: int = 0) -> DraftLMDrafter:
    torch.manual_seed(seed)
    model, cfg = new_draft_lm(target.config, num_layers=1, intermediate_size=64,
                              embed_weight=shared_weights(target)[0])
    save_draft_lm(model, cfg, folder, None, max_gamma=G)
    return load_drafter(str(folder), target, gamma=4)


def prompts_and_taps(target, lengths=(7, 12), seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, target.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    slots = [target.allocate() for _ in prompts]
    try:
        _, taps = target.prefill(slots, prompts)
    finally:
        for s in slots:
            target.release(s)
    return prompts, taps


def start_all(drafter, prompts, taps, slots):
    for s, p, t in zip(slots, prompts, taps):
        drafter.start(s, p, t)


@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
def test_dspark_block_is_exact_sampling_distribution(target, head):
    d = make_dspark(target, head)
    prompts, taps = prompts_and_taps(target)
    start_all(d, prompts, taps, [0, 1])
    anchors = torch.tensor([5, 9])
    blk = d.propose([0, 1], anchors, MIXED, uniforms(2, 4))
    assert blk.tokens.shape == (2, 4) and blk.tokens.dtype == torch.int64 and blk.conf_logits.shape == (2, 4)
    q = d.draft_probs([0, 1], torch.tensor([4, 4]))  # the greedy request contributes no rows
    assert q.shape == (4, target.vocab_size) and torch.allclose(q.sum(-1), torch.ones(4), atol=1e-5)
    logits, conf = d.score([0, 1], anchors, blk.tokens)
    expect = sampling_probs(logits[1], *param_tensors([MIXED[1]] * 4))
    assert torch.allclose(q, expect, atol=1e-6)
    assert q[torch.arange(4), blk.tokens[1]].min() > 0  # drawn from its own distribution
    assert torch.equal(blk.tokens[0], logits[0].argmax(-1))  # greedy row = argmax
    assert torch.allclose(conf, blk.conf_logits, atol=1e-6)
    # only the rows that will be verified, in (request, position) order
    assert torch.equal(d.draft_probs([1, 0], torch.tensor([2, 3])), q[:2])
    assert d.draft_probs([0, 1], torch.tensor([3, 0])).shape == (0, target.vocab_size)


def test_dspark_sampled_tokens_follow_the_uniforms(target):
    """Same uniforms -> same drafts; the drafter has no randomness of its own."""
    d = make_dspark(target, "markov")
    prompts, taps = prompts_and_taps(target)
    start_all(d, prompts, taps, [0, 1])
    sampled = [MIXED[1], MIXED[1]]
    a = d.propose([0, 1], torch.tensor([5, 9]), sampled, uniforms(2, 4, seed=1))
    b = d.propose([0, 1], torch.tensor([5, 9]), sampled, uniforms(2, 4, seed=1))
    c = d.propose([0, 1], torch.tensor([5, 9]), [SamplingParams(temperature=2.0)] * 2, uniforms(2, 4, seed=2))
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)


def test_dspark_context_is_read_in_place(target):
    """A batch whose slots form a range attends to a view of the slot cache (no per-step copy),
    and extend advances each slot by `keep` rows, however many rows it was given."""
    d = make_dspark(target, "markov")
    prompts, taps = prompts_and_taps(target, lengths=(7, 12, 9))
    start_all(d, prompts, taps, [0, 1, 2])
    slot_t = torch.tensor([1, 2])
    keys, _ = d.kv.read(0, slot_t, 1, 16)
    assert keys.data_ptr() == d.kv.k[0][1:].data_ptr()  # a view, not a gather
    d.extend([0, 2], torch.tensor([5, 6, 7, 9, 9]), torch.cat([taps[0][:3], taps[2][:2]]),
             torch.tensor([0, 3, 5]), torch.tensor([1, 2]))
    assert [d.context_length(s) for s in (0, 1, 2)] == [8, 12, 11]

def test_sequential_head_reads_previous_token_and_confidence_never_reads_x_k(target):
    prompts, taps = prompts_and_taps(target)
    anchors = torch.tensor([5, 9])
    base = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    changed = base.clone()
    changed[:, 1] = torch.tensor([40, 41])  # x_2 differs
    for head in ("markov", "rnn", "none"):
        d = make_dspark(target, head)
        start_all(d, prompts, taps, [0, 1])
        d.kv.check([0, 1])  # `kv` runs the prompts' pending extend: both scores project the same rows
        la, ca = d.score([0, 1], anchors, base)
        lb, cb = d.score([0, 1], anchors, changed)
        # positions 1, 2 read x_0, x_1 only: unchanged; confidence at k = 2 never reads x_2
        assert torch.equal(la[:, :2], lb[:, :2]) and torch.equal(ca[:, :2], cb[:, :2])
        assert not torch.equal(ca[:, 2], cb[:, 2])  # c_3 reads x_2
        if head == "none":
            assert torch.equal(la[:, 2], lb[:, 2])  # DFlash: independent positions
        else:
            assert not torch.allclose(la[:, 2], lb[:, 2])  # p_3 depends on x_2


def test_draft_vocabulary_subset(target, tmp_path):
    """Drafting over a subset of the vocabulary: tokens and p_d stay inside it, p_d is exactly the
    distribution drafts were drawn from, a draft_vocab.json beside the drafters is picked up at
    load time, and greedy speculative decoding is still token-identical to plain."""
    d = make_dspark(target, "markov")
    ids = torch.arange(3, target.vocab_size, 2)
    d.set_vocab(ids)
    prompts, taps = prompts_and_taps(target)
    start_all(d, prompts, taps, [0, 1])
    anchors = torch.tensor([5, 9])
    blk = d.propose([0, 1], anchors, MIXED, uniforms(2, 4))
    assert torch.isin(blk.tokens, ids).all()
    q = d.draft_probs([0, 1], torch.tensor([4, 4]))
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert q.shape == (4, target.vocab_size) and (q[:, outside] == 0).all()
    logits, _ = d.score([0, 1], anchors, blk.tokens)
    assert torch.allclose(q, sampling_probs(logits[1], *param_tensors([MIXED[1]] * 4)), atol=1e-6)
    assert torch.equal(blk.tokens[0], logits[0].argmax(-1))
    (tmp_path / "drafters").mkdir()
    save_dspark(d.model, tmp_path / "drafters" / "sub")
    (tmp_path / "drafters" / "draft_vocab.json").write_text(json.dumps({"ids": ids.tolist()}))
    loaded = load_drafter(str(tmp_path / "drafters" / "sub"), target, gamma=4)
    assert torch.equal(loaded.vocab, ids)
    plain = SpecEngine(target).generate(prompts, 12)
    assert SpecEngine(target, loaded, policy="fixed:3").generate(prompts, 12) == plain


def test_context_cache_grows_and_new_slots_start_after_growth(target):
    """A long prompt grows the slot cache (inside extend, in inference mode); starting another
    slot afterwards (outside it) still works, and both slots draft from their own context."""
    d = make_dspark(target, "markov")
    long_prompt = list(range(3, 300))
    taps = [torch.randn(len(long_prompt), target.tap_dim, generator=torch.Generator().manual_seed(2))]
    d.start(0, long_prompt, taps[0])
    d.start(1, long_prompt[:5], taps[0][:5])
    assert d.context_length(0) == len(long_prompt) and d.context_length(1) == 5
    assert d.kv.capacity[1] >= len(long_prompt) + G
    blk = d.propose([0, 1], torch.tensor([5, 9]), MIXED, uniforms(2, 4))
    assert blk.tokens.shape == (2, 4)


def test_slots_are_isolated(target):
    d = make_dspark(target, "rnn")
    prompts, taps = prompts_and_taps(target, lengths=(7, 12, 9))
    greedy = [SamplingParams()]
    d.start(0, prompts[0], taps[0])
    alone = d.propose([0], torch.tensor([5]), greedy, uniforms(1, 4))
    start_all(d, prompts[1:], taps[1:], [1, 2])
    both = d.propose([1, 0], torch.tensor([8, 5]), greedy * 2, uniforms(2, 4))
    assert torch.equal(both.tokens[1], alone.tokens[0])
    assert torch.allclose(both.conf_logits[1], alone.conf_logits[0], atol=1e-5)
    extend_rows(d, 1, [8, 8], taps[1][:2])  # other slots' contexts grow
    d.release(2)
    d.start(2, prompts[1], taps[1])
    assert d.context_length(1) == 14 and d.context_length(2) == 12 and d.context_length(0) == 7
    again = d.propose([0, 2], torch.tensor([5, 1]), greedy * 2, uniforms(2, 4))
    assert torch.allclose(again.conf_logits[0], alone.conf_logits[0], atol=1e-5)
    extend_rows(d, 0, [5], taps[0][:1])  # extending slot 0 changes its own drafts only
    moved = d.propose([0], torch.tensor([5]), greedy, uniforms(1, 4))
    assert not torch.allclose(moved.conf_logits, alone.conf_logits)
    with pytest.raises(KeyError):
        d.propose([3], torch.tensor([1]), greedy, uniforms(1, 4))


def test_gamma_uses_the_trained_block(target):
    d = make_dspark(target, "markov", gamma=G)
    prompts, taps = prompts_and_taps(target)
    d.start(0, prompts[0], taps[0])
    full = d.propose([0], torch.tensor([5]), [SamplingParams()], uniforms(1, G))
    d.gamma = 3
    short = d.propose([0], torch.tensor([5]), [SamplingParams()], uniforms(1, 3))
    assert short.tokens.shape == (1, 3) and torch.equal(short.tokens, full.tokens[:, :3])
    with pytest.raises(ValueError):
        d.gamma = G + 1


@pytest.mark.parametrize("head,gamma", [("markov", G), ("rnn", G), ("markov", 2)])
def test_training_forward_equals_serving_path(target, head, gamma):
    """Many anchors in one training pass give the same logits as the per-slot serving path; with
    γ < G the serving path runs its last layer on γ queries only, and the γ positions it keeps
    are still the trained block's."""
    d = make_dspark(target, head, gamma=gamma)
    m = d.model
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, target.vocab_size, (1, 24), generator=gen)
    _, taps = target.model.forward_hidden(tokens)
    anchors = torch.tensor([[4, 11, 17]])
    with torch.no_grad():
        h = m.train_hidden(tokens, taps, anchors)
        x_prev = tokens[0, anchors[0, :, None] + torch.arange(G)]
        feats = m.head.teacher(x_prev, h[0])
        logits = m.lm_head(h[0]) + m.head.bias(feats)
    for j, a in enumerate(anchors[0].tolist()):
        d.start(0, tokens[0, :a].tolist(), taps[0, :a])
        served, _ = d.score([0], tokens[0, a:a + 1], tokens[:, a + 1:a + 1 + gamma])
        d.release(0)
        assert served.shape[1] == gamma and torch.allclose(served[0], logits[j, :gamma], atol=1e-4)


def test_dspark_save_load_roundtrip(target, tmp_path):
    d = make_dspark(target, "rnn")
    save_dspark(d.model, tmp_path / "dsp")
    (tmp_path / "dsp" / "calibration.json").write_text(json.dumps({"sts_temperatures": [1.5] * 4,
                                                                   "sts_shifts": [0.5, 0.0, -0.5, 1.0]}))
    loaded = load_drafter(str(tmp_path / "dsp"), target, gamma=4)
    assert isinstance(loaded, DSparkDrafter) and loaded.sts_temperatures == [1.5] * 4
    assert loaded.sts_shifts == [0.5, 0.0, -0.5, 1.0]  # affine STS reaches the engine
    assert SpecEngine(target, loaded, "fixed:3").sts_shifts.tolist() == [0.5, 0.0, -0.5, 1.0]
    prompts, taps = prompts_and_taps(target)
    outs, probs = [], []
    for drafter in (d.pack_for_inference(), loaded):  # a loaded drafter serves packed weights
        start_all(drafter, prompts, taps, [0, 1])
        outs.append(drafter.propose([0, 1], torch.tensor([5, 9]), MIXED, uniforms(2, 4)))
        probs.append(drafter.draft_probs([0, 1], torch.tensor([4, 4])))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(probs[0], probs[1]) and torch.equal(outs[0].conf_logits, outs[1].conf_logits)
    stored = sum(p.stat().st_size for p in (tmp_path / "dsp").iterdir())
    assert stored < d.model.trainable_bytes() + 20_000  # the shared embedding / LM head are not stored


def test_packed_drafter_drafts_like_its_modules(target):
    """pack_for_inference serves every projection from prepacked weights: context, backbone, LM
    head and sequential head give what the nn.Linear modules give (fp32: another summation
    order), with the full vocabulary and with a draft vocabulary set before or after packing."""
    plain, packed = make_dspark(target, "markov"), make_dspark(target, "markov").pack_for_inference()
    prompts, taps = prompts_and_taps(target)
    tokens = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    for vocab in (None, torch.arange(40, 200)):
        for d in (plain, packed):
            d.set_vocab(vocab)
            start_all(d, prompts, taps, [0, 1])
        (la, ca), (lb, cb) = (d.score([0, 1], torch.tensor([5, 9]), tokens) for d in (plain, packed))
        torch.testing.assert_close(lb, la, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cb, ca, atol=1e-4, rtol=1e-4)
        blocks = [d.propose([0, 1], torch.tensor([5, 9]), MIXED, uniforms(2, 4)) for d in (plain, packed)]
        assert torch.equal(blocks[0].tokens, blocks[1].tokens)
    assert packed._packed and not plain._packed


def test_greedy_bigram_table_drafts_like_the_sequential_head(target):
    """A Markov head over a draft vocabulary drafts greedy blocks from its bigram table
    (`_greedy_bigram`): the same tokens and confidences as the step-by-step head, and each token
    is the argmax of the logits `score` gives for that block."""
    ids = torch.arange(3, target.vocab_size, 3)
    d = make_dspark(target, "markov").pack_for_inference()
    d.set_vocab(ids)
    assert d._bigram is not None and d._bigram.shape == (len(ids), len(ids))
    prompts, taps = prompts_and_taps(target)
    start_all(d, prompts, taps, [0, 1])
    anchors, greedy = torch.tensor([4, 9]), [SamplingParams()] * 2  # anchor 4 is outside the vocabulary
    fast = d.propose([0, 1], anchors, greedy, uniforms(2, 4))
    table, d._bigram = d._bigram, None
    slow = d.propose([0, 1], anchors, greedy, uniforms(2, 4))
    d._bigram = table
    assert torch.equal(fast.tokens, slow.tokens) and torch.isin(fast.tokens, ids).all()
    torch.testing.assert_close(fast.conf_logits, slow.conf_logits)
    logits, _ = d.score([0, 1], anchors, fast.tokens)
    assert torch.equal(fast.tokens, logits.argmax(-1))
    assert make_dspark(target, "rnn").pack_for_inference()._bigram is None  # Markov heads only


def test_bf16_drafter_attends_through_the_cpu_kernel_like_sdpa(target, monkeypatch):
    """On a CPU where our bf16 attention kernel serves, a bf16 drafter's block attends through it
    (each block query over its slot's rows 0..L+G−1, the mask SDPA is given): the same logits and
    confidences as SDPA's path within bf16 roundings, across two slots of different lengths."""
    from dspark.runtime import cpu_attention

    if not cpu_attention.enabled(torch.device("cpu"), torch.bfloat16, 4, 2, 16):
        pytest.skip("our bf16 CPU attention kernel does not serve on this machine")
    emb, lm, _ = shared_weights(target)
    prompts, taps = prompts_and_taps(target)
    tokens = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    calls: list[int] = []
    attend = cpu_attention.cached_attention
    monkeypatch.setattr(cpu_attention, "cached_attention", lambda *a: calls.append(1) or attend(*a))
    out = {}
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(cpu_attention, "enabled", lambda *a: False)
        d = make_dspark(target, "markov")
        d = DSparkDrafter(d.model.to(torch.bfloat16), emb.bfloat16(), lm.bfloat16()).pack_for_inference()
        start_all(d, prompts, [t.bfloat16() for t in taps], [0, 1])
        out[kernel] = d.score([0, 1], torch.tensor([5, 9]), tokens)
        assert bool(calls) == kernel
        calls.clear()
    for got, want in zip(out[True], out[False]):
        torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)


def test_pending_extends_join_the_next_propose(target):
    """extend is checked at once and run with the next propose, inside the backbone's own
    projections; several pending extends of one slot (the first leaving scratch rows where the
    second writes) give the context, lengths and drafts of running each extend on its own."""
    prompts, taps = prompts_and_taps(target, lengths=(7, 12))
    lazy, eager = (make_dspark(target, "markov").pack_for_inference() for _ in range(2))
    for d in (lazy, eager):
        start_all(d, prompts, taps, [0, 1])
    steps = [([0, 1], [5, 6, 7, 8, 9], torch.tensor([0, 3, 5]), torch.tensor([1, 2])),
             ([0], [10, 11], torch.tensor([0, 2]), torch.tensor([2]))]
    for slots, tokens, cu, keep in steps:
        rows = torch.cat([taps[s][:int(cu[i + 1] - cu[i])] for i, s in enumerate(slots)])
        for d in (lazy, eager):
            d.extend(slots, torch.tensor(tokens), rows, cu, keep)
        eager._flush()
    assert len(lazy._pending) == 3 and not eager._pending  # slot 1's prompt waits too
    with pytest.raises(ValueError, match="taps rows"):  # checked when called, not when run
        lazy.extend([0], torch.tensor([1, 2]), taps[0][:1], torch.tensor([0, 2]), torch.tensor([2]))
    blocks = [d.propose([0, 1], torch.tensor([5, 9]), [SamplingParams()] * 2, uniforms(2, 4))
              for d in (lazy, eager)]
    assert not lazy._pending
    assert torch.equal(blocks[0].tokens, blocks[1].tokens)
    torch.testing.assert_close(blocks[0].conf_logits, blocks[1].conf_logits, atol=1e-4, rtol=1e-4)
    assert [lazy.context_length(s) for s in (0, 1)] == [eager.context_length(s) for s in (0, 1)] == [10, 14]
    for layer in range(2):
        for s, n in ((0, 10), (1, 14)):
            for cache in ("k", "v"):
                got, want = (getattr(d.kv, cache)[layer][s, :, :n] for d in (lazy, eager))
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_drafter_loads_from_shared_weights_alone(target, tiny_ckpt, tmp_path):
    """The Triton `drafter` model loads the target's embedding / LM head / final norm from the
    checkpoint (SharedWeights), not a second target: same tensors, same tap layers, same drafts."""
    from dspark.runtime.loader import SharedWeights

    shared = SharedWeights(tiny_ckpt)
    assert shared.tap_layers == target.tap_layers
    for a, b in zip(shared_weights(shared), shared_weights(target)):
        assert torch.equal(a, b)
    d = make_dspark(target, "markov")
    save_dspark(d.model, tmp_path / "dsp")
    prompts, taps = prompts_and_taps(target)
    outs = []
    for owner in (target, shared):
        drafter = load_drafter(str(tmp_path / "dsp"), owner, gamma=4)
        start_all(drafter, prompts, taps, [0, 1])
        outs.append(drafter.propose([0, 1], torch.tensor([5, 9]), MIXED, uniforms(2, 4)))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(outs[0].conf_logits, outs[1].conf_logits)


def test_eagle_interface_and_unrolled_training_equals_serving(target, tmp_path):
    d = make_eagle(target)
    d.gamma = G
    prompts, taps = prompts_and_taps(target)
    start_all(d, prompts, taps, [0, 1])
    blk = d.propose([0, 1], torch.tensor([5, 9]), MIXED, uniforms(2, G))
    q = d.draft_probs([0, 1], torch.tensor([G, G]))
    assert blk.tokens.shape == (2, G) and q.shape == (G, target.vocab_size)
    assert torch.allclose(q.sum(-1), torch.ones(G), atol=1e-5)
    assert q[torch.arange(G), blk.tokens[1]].min() > 0
    # the greedy chain, replayed teacher-forced through the training-time test, gives the same steps
    seq = torch.tensor([prompts[0] + [5] + blk.tokens[0].tolist() + [0]])
    _, seq_taps = target.model.forward_hidden(seq)
    with torch.no_grad():
        h = d.model.train_hidden(seq, seq_taps, torch.tensor([[len(prompts[0])]]))
        logits = d.model.lm_head(h)[0, 0]
    assert torch.equal(logits.argmax(-1), blk.tokens[0])
    assert torch.allclose(d.model.conf_logit(h)[0, 0], blk.conf_logits[0], atol=1e-4)
    extend_rows(d, 0, [5, int(blk.tokens[0, 0])], taps[0][:2])
    assert d.propose([0], torch.tensor([7]), MIXED[:1], uniforms(1, G)).tokens.shape == (1, G)
    save_eagle(d.model, tmp_path / "eagle")
    loaded = load_drafter(str(tmp_path / "eagle"), target, gamma=G)
    start_all(loaded, prompts, taps, [0, 1])
    again = loaded.propose([0, 1], torch.tensor([5, 9]), MIXED, uniforms(2, G))
    assert torch.equal(again.tokens, blk.tokens)
    assert torch.allclose(loaded.draft_probs([0, 1], torch.tensor([G, G])), q, atol=1e-6)


def test_draft_lm_interface_matches_its_own_greedy_decoding(target, tmp_path):
    d = make_draft_lm(target, tmp_path / "dlm")
    prompts, taps = prompts_and_taps(target)
    start_all(d, prompts, taps, [0, 1])
    blk = d.propose([0, 1], torch.tensor([5, 9]), MIXED, uniforms(2, 4))
    q = d.draft_probs([0, 1], torch.tensor([4, 4]))
    assert blk.tokens.shape == (2, 4) and torch.allclose(q.sum(-1), torch.ones(4), atol=1e-5)
    plain = SpecEngine(d.engine).generate([prompts[0] + [5]], 4)[0]  # greedy row = the draft LM's greedy
    assert blk.tokens[0].tolist() == plain
    d.extend([0], torch.tensor([5, plain[0]]), None, torch.tensor([0, 2]), torch.tensor([2]))
    nxt = d.propose([0], torch.tensor([plain[1]]), MIXED[:1], uniforms(1, 4))
    more = SpecEngine(d.engine).generate([prompts[0] + [5] + plain[:4]], 2)[0]
    assert nxt.tokens[0].tolist() == plain[2:4] + more
    d.release(0)
    d.release(1)
    assert d.engine.num_free_slots() == 4


def test_draft_lm_folder_loads_in_transformers(target, tmp_path):
    import transformers

    d = make_draft_lm(target, tmp_path / "dlm")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dlm"), dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 17, 42, 9, 3]])
    with torch.no_grad():
        ours = d.engine.model.forward_train(tokens)
        theirs = hf(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-4)


@pytest.mark.parametrize("kind", ["dspark-markov", "dspark-none", "eagle", "draft_lm"])
def test_greedy_speculative_output_equals_plain_decoding(target, tmp_path, kind):
    if kind == "eagle":
        drafter = make_eagle(target)
    elif kind == "draft_lm":
        drafter = make_draft_lm(target, tmp_path / "dlm")
    else:
        drafter = make_dspark(target, kind.split("-")[1])
    prompts, _ = prompts_and_taps(target)
    plain = SpecEngine(target).generate(prompts, 20)
    eng = SpecEngine(target, drafter, policy="fixed:3")
    spec = eng.generate(prompts, 20)
    assert eng.metrics.drafter_fallbacks == 0
    assert spec == plain
    assert sum(eng.metrics.drafted) > 0 and eng.metrics.steps < 2 * 20
    # sampled requests run the same loop with draft probabilities (drafter failures would show here)
    eng = SpecEngine(target, drafter, policy="fixed:3")
    eng.generate(prompts, 12, SamplingParams(temperature=0.9, top_k=30, seed=1))
    assert eng.metrics.drafter_fallbacks == 0 and sum(eng.metrics.verified) > 0


@pytest.mark.parametrize("kind", ["dspark-markov", "dspark-markov-bigram", "dspark-rnn", "eagle", "draft_lm",
                                  "ngram", "hybrid"])
def test_narrow_block_is_the_full_blocks_prefix(target, tmp_path, kind):
    """propose with uniforms [R, w] drafts the first w tokens of the γ-block, with the same
    confidences and (sampled rows) draft probabilities: the engine asks for w = 1 on a uniform
    or MTP-1 step. A width outside 1..γ is refused."""
    def make(tag: str):
        if kind == "eagle":
            return make_eagle(target)
        if kind == "draft_lm":
            return make_draft_lm(target, tmp_path / tag)
        if kind in ("ngram", "hybrid"):
            lookup = NGramDrafter(gamma=4, n=2)
            if kind == "ngram":
                return lookup
            return HybridDrafter(lookup, make_dspark(target, "markov"), target.vocab_size, min_match=1)
        d = make_dspark(target, kind.split("-")[1])
        if kind.endswith("bigram"):
            d.pack_for_inference().set_vocab(torch.arange(3, target.vocab_size, 3))
        return d

    prompts, taps = prompts_and_taps(target)
    prompts = [prompts[0], prompts[1][:4] + prompts[1][:4]]  # the second repeats itself: a lookup row
    taps = [t[:len(p)] for t, p in zip(taps, prompts)]
    params = [SamplingParams()] * 2 if kind.endswith("bigram") else MIXED
    anchors, u = torch.tensor([5, prompts[1][4]]), uniforms(2, 4)
    blocks, probs = [], []
    for w in (4, 2, 1):
        d = make(f"d{w}")
        start_all(d, prompts, taps, [0, 1])
        blocks.append(d.propose([0, 1], anchors, params, u[:, :w]))
        probs.append(None if params[1].greedy else d.draft_probs([1], torch.tensor([w])))  # the sampled row
    for b, q in zip(blocks[1:], probs[1:]):
        w = b.tokens.shape[1]
        assert b.tokens.shape == b.conf_logits.shape == (2, w)
        assert torch.equal(b.tokens, blocks[0].tokens[:, :w])
        torch.testing.assert_close(b.conf_logits, blocks[0].conf_logits[:, :w])
        if probs[0] is not None:
            torch.testing.assert_close(q, probs[0][:w])
    if kind == "hybrid":
        assert d.lookup_rows[1] is not None and d.lookup_rows[0] is None  # both sources were narrowed
    for bad in (0, 5):
        with pytest.raises(ValueError, match="uniforms"):
            d.propose([0, 1], anchors, params, torch.rand(2, bad))


def test_load_rejects_a_drafter_trained_on_other_taps(target, tmp_path):
    d = make_dspark(target, "markov")
    d.model.config.tap_layers = [0, 1, 1]
    save_dspark(d.model, tmp_path / "other")
    with pytest.raises(ValueError, match="taps"):
        load_drafter(str(tmp_path / "other"), target)
    with pytest.raises(ValueError, match="unknown drafter"):
        load_drafter(str(tmp_path / "missing"), target)


def test_training_forward_accepts_masked_anchor_zero(target):
    """A sequence without valid anchors gets anchor 0 (masked by the loss): forwards must not fail."""
    tokens = torch.randint(3, target.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    _, taps = target.model.forward_hidden(tokens)
    anchors = torch.tensor([[0, 5]])
    for drafter in (make_eagle(target), make_dspark(target, "rnn")):
        with torch.no_grad():
            h = drafter.model.train_hidden(tokens, taps, anchors)
        assert h.shape == (1, 2, G, target.config.hidden_size) and torch.isfinite(h).all()


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_layer0_projects_the_distinct_block_rows_like_all_of_them(target, head):
    """Layer 0 sees emb(x0) and G−1 copies of the mask embedding: norming and projecting the
    R + 1 distinct rows and expanding them gives the blocks, confidences and K/V that projecting
    all R·G rows gives, with and without a pending extend's context rows in the same GEMM."""
    prompts, taps = prompts_and_taps(target, lengths=(7, 12, 9))
    drafters = [make_dspark(target, head) for _ in range(2)]
    drafters[1].project_distinct_rows = False
    anchors, params, u = torch.tensor([5, 9, 3]), [SamplingParams()] * 3, uniforms(3, 4, seed=3)
    blocks = []
    for d in drafters:
        start_all(d, prompts, taps, [0, 1, 2])
        first = d.propose([0, 1, 2], anchors, params, u)  # the prompts' extend runs inside it
        d.extend([0, 2], torch.tensor([5, 6, 9]), torch.cat([taps[0][:2], taps[2][:1]]),
                 torch.tensor([0, 2, 3]), torch.tensor([2, 1]))
        blocks.append((first, d.propose([0, 1, 2], anchors, params, u)))
    for a, b in zip(*blocks):
        assert torch.equal(a.tokens, b.tokens)
        assert (a.conf_logits - b.conf_logits).abs().max() <= 1e-5
    for layer in range(len(drafters[0].kv.k)):
        for cache in ("k", "v"):
            ours, ref = (getattr(d.kv, cache)[layer][:3, :, :20] for d in drafters)
            assert (ours - ref).abs().max() <= 1e-5


def test_bench_drafter_smoke(tiny_ckpt, tmp_path):
    """`dspark bench-drafter` end to end on the tiny checkpoint with a random drafter."""
    from dspark.cli import main

    out = tmp_path / "drafter_step.json"
    assert main(["bench-drafter", "--model", str(tiny_ckpt), "--random", "--requests", "1,2",
                 "--vocab", "0,64", "--context", "8", "--rounds", "1", "--repeats", "1", "--gamma", "4",
                 "--num-threads", "1", "--all-block-rows", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["by_requests"]
    assert set(rows) == {"1", "2"}
    assert rows["2"]["propose_greedy_all_block_rows_ms@64"] > 0
    assert rows["2"]["all_block_rows_over_distinct@all"] > 0
    assert rows["2"]["propose_greedy_ms@64"] > 0 and rows["1"]["share_of_plain_step@all"] > 0
    assert rows["1"]["target_prefill_ms"] > 0 and 0 < rows["2"]["start_share_of_prefill"]


def test_draft_vocab_tool_counts_responses_only(tmp_path, target):
    """`dspark draft-vocab`: counts the tokens after each prompt in training shards, keeps the K
    most frequent (plus the eos ids), writes draft_vocab.json that the loader reads."""
    from dspark.runtime.drafter.files import read_draft_vocab
    from dspark.tools.draft_vocab import count_shards, top_ids, write_vocab

    seqs = [[1, 2, 3, 9, 9, 9, 8], [1, 2, 4, 4, 8]]  # prompts [1, 2, 3] and [1, 2]
    shard = {"tokens": torch.tensor(sum(seqs, [])), "offsets": torch.tensor([0, 7, 12]),
             "prompt_len": torch.tensor([3, 2]), "domain": torch.tensor([0, 1])}
    torch.save(shard, tmp_path / "shard_0000.pt")
    counts, total = count_shards(tmp_path, 16)
    assert total == 7 and counts[9] == 3 and counts[4] == 2 and counts[8] == 2 and counts[1] == 0
    ids = top_ids(counts, 2, always=[0])
    assert ids.tolist() == [0, 4, 9]  # 9 (3), then 4 and 8 tie at 2: the lower id wins
    write_vocab(tmp_path / "drafters", ids, counts, "test", total)
    (tmp_path / "drafters" / "x").mkdir()
    assert read_draft_vocab(tmp_path / "drafters" / "x").tolist() == [0, 4, 9]
    assert read_draft_vocab(tmp_path / "nowhere") is None


def test_ngram_incremental_index_equals_the_scan():
    """The n-gram drafter's per-slot k-gram index (`_match_context`) proposes what `match` finds
    scanning the whole sequence, as the context grows step by step, for every n / min_n, on
    sequences with many repeats (small vocabulary) and after a slot restarts."""
    gen = torch.Generator().manual_seed(11)
    for n, min_n, vocab in ((3, 1, 4), (4, 2, 6), (2, 2, 3), (1, 1, 5)):
        d = NGramDrafter(gamma=5, n=n, min_n=min_n, learn=False)
        for _ in range(2):  # the slot restarts: a new context, a new index
            size = int(torch.randint(1, 6, (1,), generator=gen))
            prompt = torch.randint(vocab, (size,), generator=gen).tolist()
            d.start(0, prompt, torch.zeros(len(prompt), 1))
            for _ in range(40):
                anchor = int(torch.randint(vocab, (1,), generator=gen))
                assert d._match_context(0, d.contexts[0], anchor) == d.match(d.contexts[0] + [anchor])
                grow = torch.randint(vocab, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen)
                d.extend([0], grow, torch.zeros(len(grow), 1), torch.tensor([0, len(grow)]),
                         torch.tensor([len(grow)]))
