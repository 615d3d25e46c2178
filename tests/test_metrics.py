"""dspark.tools.metrics: hand-computed cases and brute-force cross-checks."""

import math

import numpy as np
import pytest
import torch

from dspark.tools.metrics import auroc, conditional_acceptance, ece, reliability, survival, tau


def test_ece_hand_computed():
    # bin [0.10,0.15): conf 0.1,0.1 vs outcomes 0,1 -> gap |0.2-1| = 0.8
    # bin [0.90,0.95): conf 0.9 vs 1 -> 0.1 ; bin 19 holds conf 1.0 vs 0 -> 1.0
    conf = [0.1, 0.1, 0.9, 1.0]
    out = [0, 1, 1, 0]
    assert ece(conf, out) == pytest.approx((0.8 + 0.1 + 1.0) / 4)


def test_ece_calibrated_near_zero_and_miscalibrated_positive():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=200_000)
    y = rng.uniform(size=p.size) < p
    assert ece(p, y) < 0.01
    overconfident = np.clip(p * 1.5, 0, 1)
    assert ece(overconfident, y) > 0.1


def test_reliability_bins():
    r = reliability([0.02, 0.04, 0.97], [0, 1, 1])
    assert len(r["bin_centre"]) == 20 and r["count"][0] == 2 and r["count"][19] == 1
    assert r["mean_conf"][0] == pytest.approx(0.03) and r["frequency"][0] == pytest.approx(0.5)
    assert r["mean_conf"][5] is None and sum(r["count"]) == 3


def test_auroc_hand_computed_with_ties():
    # pairs (pos, neg): (0.8,0.5)=1 (0.8,0.8)=.5 (0.4,0.5)=0 (0.4,0.8)=0 -> 1.5/4
    assert auroc([0.8, 0.4, 0.5, 0.8], [1, 1, 0, 0]) == pytest.approx(0.375)
    assert auroc([0.1, 0.9], [0, 1]) == 1.0
    assert math.isnan(auroc([0.1, 0.9], [1, 1]))


def test_auroc_equals_bruteforce_pairwise_count():
    rng = np.random.default_rng(1)
    for _ in range(5):
        s = rng.integers(0, 10, size=300) / 10.0  # many ties
        y = rng.uniform(size=300) < 0.4
        pos, neg = s[y], s[~y]
        brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
            pos.size * neg.size)
        assert auroc(s, y) == pytest.approx(brute, abs=1e-12)


def test_survival_is_cumulative_product_of_tempered_sigmoids():
    z = torch.tensor([[0.0, 2.0, -1.0]])
    a = survival(z, [1.0, 2.0, 0.5])
    expect = torch.tensor([0.5, 0.5 * torch.sigmoid(torch.tensor(1.0)), 0.0])
    expect[2] = expect[1] * torch.sigmoid(torch.tensor(-2.0))
    assert torch.allclose(a[0].float(), expect, atol=1e-6)
    assert bool((a[..., 1:] <= a[..., :-1]).all())


def test_conditional_acceptance_hand_computed():
    # blocks (n accepted, ℓ verified): (0,3) (1,3) (3,3) (2,2)
    r = conditional_acceptance([0, 1, 3, 2], [3, 3, 3, 2], gamma=3)
    assert r["reached"] == [4, 3, 1] and r["accepted"] == [3, 2, 1]
    assert r["rate"] == pytest.approx([0.75, 2 / 3, 1.0])
    with pytest.raises(ValueError):
        conditional_acceptance([2], [1], gamma=3)


def test_tau_counts_bonus():
    # two verify steps: 3 accepted + bonus, 0 accepted + correction -> 5 tokens / 2 steps
    assert tau(5, 2) == 2.5
    assert math.isnan(tau(0, 0))
