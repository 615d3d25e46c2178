"""Lossless verification (architecture §6): the emitted tokens follow the target's distribution.

Distribution tests batch 1e5 independent requests as rows of one ragged call, with the draft
probabilities in the flat layout (one row per verified draft). Target and drafter are
first-order Markov chains on a small vocabulary, so the joint of the first two emitted tokens
has a closed form: P(x1, x2) = p_t(x1 | x0) · p_t(x2 | x1). Each test uses a fixed seed and a
chi-square test with p > 1e-3; a negative control shows the test can fail.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dspark.runtime.sampling import (
    SamplingBatch,
    SamplingParams,
    param_tensors,
    philox4x32,
    philox_uniforms,
    sampling_probs,
)
from dspark.runtime.verify import verify_ragged
from dspark_kernels.reference import rejection_sample_ref

V = 6
SAMPLES = 100_000


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of counts against probabilities; cells of probability 0 must be empty."""
    observed, expected_probs = observed.flatten().double(), expected_probs.flatten().double()
    zero = expected_probs <= 0
    assert observed[zero].sum() == 0, "emitted a token of probability 0"
    expected = expected_probs[~zero] / expected_probs[~zero].sum() * observed.sum()
    return float(chisquare(observed[~zero].numpy(), expected.numpy()).pvalue)


def counts(x: torch.Tensor, size: int) -> torch.Tensor:
    return torch.bincount(x, minlength=size)


class MarkovPair:
    """Target and drafter logits: row 0 of each table is the anchor's next-token logits
    (anchor token V), row x the logits after token x; p = sampling_probs of them."""

    def __init__(self, seed: int, params: SamplingParams):
        g = torch.Generator().manual_seed(seed)
        self.target_logits = torch.randn(V + 1, V, generator=g) * 1.2
        self.draft_logits = self.target_logits + torch.randn(V + 1, V, generator=g) * 0.8
        self.params = params
        self.p_t = self.probs(self.target_logits)
        self.p_d = self.probs(self.draft_logits)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        t, k, p = param_tensors([self.params] * logits.shape[0])
        return sampling_probs(logits, t, k, p)

    def step(self, anchors: torch.Tensor, lens: torch.Tensor, gamma: int, g: torch.Generator,
             draft_probs: bool = True):
        """One verify step for M independent requests at `anchors` (V = the prompt's anchor)."""
        m = anchors.numel()
        drafts = torch.empty(m, gamma, dtype=torch.int64)
        prev = anchors
        for j in range(gamma):
            drafts[:, j] = torch.multinomial(self.p_d[prev], 1, generator=g)[:, 0]
            prev = drafts[:, j]
        contexts = torch.cat([anchors[:, None], drafts], dim=1)  # row j predicts after contexts[:, j]
        keep = torch.arange(gamma + 1)[None, :] <= lens[:, None]
        target_logits = self.target_logits[contexts[keep]]
        cu = torch.zeros(m + 1, dtype=torch.int64)
        cu[1:] = (lens + 1).cumsum(0)
        verified = torch.arange(gamma)[None, :] < lens[:, None]
        q = self.p_d[contexts[:, :gamma][verified]] if draft_probs else None  # flat [Σℓ, V]
        uniforms = torch.rand(m, gamma + 1, generator=g)
        return verify_ragged(target_logits, drafts, lens, cu, SamplingBatch.from_params([self.params] * m), q,
                             uniforms)


def first_two_tokens(pair: MarkovPair, gamma: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run steps until every request emitted two tokens; ℓ_r is random but independent of drafts."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.full((SAMPLES,), V)
    lens = torch.randint(0, gamma + 1, (SAMPLES,), generator=g)
    out = pair.step(anchors, lens, gamma, g)
    x1 = out.tokens[:, 0]
    x2 = out.tokens[:, 1].clone()
    need = out.num_emitted < 2
    lens2 = torch.randint(0, gamma + 1, (int(need.sum()),), generator=g)
    x2[need] = pair.step(x1[need], lens2, gamma, g).tokens[:, 0]
    return x1, x2


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        pytest.param(SamplingParams(temperature=0.7, top_k=3), marks=pytest.mark.slow),
        pytest.param(SamplingParams(temperature=1.3, top_p=0.8), marks=pytest.mark.slow),
        SamplingParams(temperature=0.9, top_k=4, top_p=0.85),
    ],
    ids=["t1", "t0.7-k3", "t1.3-p0.8", "t0.9-k4-p0.85"],
)
def test_emitted_tokens_follow_target(params: SamplingParams):
    pair = MarkovPair(seed=1, params=params)
    x1, x2 = first_two_tokens(pair, gamma=3, seed=2)
    assert chi_square_p(counts(x1, V), pair.p_t[V]) > 1e-3
    joint = pair.p_t[V][:, None] * pair.p_t[:V]  # P(x1) P(x2 | x1)
    assert chi_square_p(counts(x1 * V + x2, V * V), joint) > 1e-3


def test_negative_control_wrong_acceptance_is_detected():
    """Accepting every draft the target allows (p_d taken as 0) emits the draft's
    distribution: the same chi-square test must reject it."""
    pair = MarkovPair(seed=1, params=SamplingParams(temperature=1.0))
    g = torch.Generator().manual_seed(3)
    m, gamma = SAMPLES, 2
    anchors = torch.full((m,), V)
    drafts = torch.multinomial(pair.p_d[anchors], gamma, replacement=True, generator=g)
    cu = torch.arange(m + 1) * (gamma + 1)
    contexts = torch.cat([anchors[:, None], drafts], dim=1).flatten()
    p_t = pair.p_t[contexts]
    uniforms = torch.rand(m, gamma + 1, generator=g)
    _, wrong = rejection_sample_ref(p_t, drafts, torch.zeros(m * gamma, V), cu, uniforms)
    assert chi_square_p(counts(wrong[:, 0], V), pair.p_t[V]) < 1e-3


def test_deterministic_drafts_one_hot_is_lossless():
    """draft_probs None (n-gram / greedy drafts): treated as one-hot, still exact."""
    pair = MarkovPair(seed=4, params=SamplingParams(temperature=1.0))
    g = torch.Generator().manual_seed(5)
    out = pair.step(torch.full((SAMPLES,), V), torch.full((SAMPLES,), 2), 2, g, draft_probs=False)
    assert chi_square_p(counts(out.tokens[:, 0], V), pair.p_t[V]) > 1e-3


def greedy_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([0, 3, 1, 4, 4, 2])
    r, gamma, vocab = lens.numel(), 4, 50
    cu = torch.zeros(r + 1, dtype=torch.int64)
    cu[1:] = (lens + 1).cumsum(0)
    logits = torch.randn(int(cu[-1]), vocab, generator=g)
    argmax = logits.argmax(-1)
    drafts = torch.randint(0, vocab, (r, gamma), generator=g)
    for i in range(r):  # make a random prefix of each draft agree with the target
        n_match = int(torch.randint(0, int(lens[i]) + 1, (), generator=g))
        drafts[i, :n_match] = argmax[cu[i] : cu[i] + n_match]
    return lens, cu, logits, argmax, drafts


def test_greedy_emits_argmax_exactly():
    lens, cu, logits, argmax, drafts = greedy_case(6)
    r = lens.numel()
    out = verify_ragged(logits, drafts, lens, cu, SamplingBatch.from_params([SamplingParams()] * r), None,
                        torch.rand(r, 5))
    for i in range(r):
        rows = argmax[cu[i] : cu[i + 1]]
        n = 0
        while n < int(lens[i]) and int(drafts[i, n]) == int(rows[n]):
            n += 1
        assert int(out.num_accepted[i]) == n
        assert out.tokens[i, : n + 1].tolist() == drafts[i, :n].tolist() + [int(rows[n])]
        assert (out.tokens[i, n + 1 :] == -1).all()


def test_mixed_batch_equals_its_greedy_and_sampled_parts():
    """Greedy and sampled requests in one call: each part gets exactly what it gets alone; the
    flat draft probabilities hold rows for the sampled requests only."""
    lens, cu, logits, _, drafts = greedy_case(7)
    r, gamma, vocab = lens.numel(), drafts.shape[1], logits.shape[1]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(r)]
    sampled = [i for i in range(r) if i % 2 == 0]
    q_all = torch.softmax(torch.randn(r, gamma, vocab, generator=torch.Generator().manual_seed(8)), -1)
    verified = torch.arange(gamma)[None, :] < lens[:, None]
    q = q_all[sampled][verified[sampled]]
    u = torch.rand(r, gamma + 1, generator=torch.Generator().manual_seed(9))
    out = verify_ragged(logits, drafts, lens, cu, SamplingBatch.from_params(params), q, u)
    for part in (sampled, [i for i in range(r) if i % 2]):
        idx = torch.tensor(part)
        rows = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in part])
        sub_cu = torch.zeros(len(part) + 1, dtype=torch.int64)
        sub_cu[1:] = (lens[idx] + 1).cumsum(0)
        sub_q = q_all[idx][verified[idx]] if part == sampled else None
        alone = verify_ragged(logits[rows], drafts[idx], lens[idx], sub_cu,
                              SamplingBatch.from_params([params[i] for i in part]), sub_q, u[idx])
        assert torch.equal(out.tokens[idx], alone.tokens)
        assert torch.equal(out.num_accepted[idx], alone.num_accepted)


def test_philox_matches_the_reference_vectors_and_is_per_request():
    """Philox-4x32-10 known-answer vectors (Random123), then: a request's uniforms depend on its
    key, counter and stream only (not on the other rows), seeds matter, and they are uniform."""
    t = lambda *v: tuple(torch.tensor([x], dtype=torch.int64) for x in v)
    words = lambda c, k: [int(x) for x in philox4x32(t(*c), t(*k))]
    assert words((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    f = 0xFFFFFFFF
    assert words((f, f, f, f), (f, f)) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    keys = torch.tensor([11, 12, 13], dtype=torch.int64)
    u = philox_uniforms(keys, torch.tensor([0, 5, 7]), 9, stream=1)
    alone = philox_uniforms(keys[1:2], torch.tensor([5]), 9, stream=1)
    assert torch.equal(u[1], alone[0]) and u.shape == (3, 9) and ((u >= 0) & (u < 1)).all()
    assert not torch.equal(u[1], philox_uniforms(keys[1:2], torch.tensor([6]), 9, stream=1)[0])
    assert not torch.equal(u[1], philox_uniforms(keys[1:2], torch.tensor([5]), 9, stream=0)[0])
    assert SamplingParams(seed=3).rng_key() == SamplingParams(seed=3).rng_key() != SamplingParams().rng_key()
    many = philox_uniforms(torch.arange(20_000), torch.zeros(20_000, dtype=torch.int64), 5, stream=0)
    observed = torch.bincount((many * 10).long().flatten(), minlength=10)
    assert chi_square_p(observed, torch.full((10,), 0.1)) > 1e-3


def test_zero_mass_residual_falls_back_to_target():
    """p_t == p_d exactly on the rejected row: residual is 0, the draw comes from p_t."""
    p = torch.tensor([[0.5, 0.5, 0.0]])
    cu, uniforms = torch.tensor([0, 1]), torch.tensor([[0.9, 0.3]])
    n, tokens = rejection_sample_ref(p, torch.tensor([[2]]), p, cu, uniforms)
    # d = 2 has p_t = 0 -> rejected; residual max(0, p_t - p_d) = 0 -> sample p_t with u = 0.3 -> token 0
    assert n.tolist() == [0] and tokens.tolist() == [[0, -1]]


def test_rejects_inconsistent_inputs():
    one = SamplingBatch.from_params([SamplingParams(temperature=1.0)])
    with pytest.raises(ValueError, match="cu_seqlens"):
        verify_ragged(torch.zeros(3, 4), torch.zeros(1, 2, dtype=torch.int64), torch.tensor([1]),
                      torch.tensor([0, 3]), one, None, torch.rand(1, 3))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_ragged(torch.zeros(2, 4), torch.zeros(1, 2, dtype=torch.int64), torch.tensor([1]),
                      torch.tensor([0, 2]), one, torch.zeros(2, 4), torch.rand(1, 3))
