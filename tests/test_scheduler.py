"""Scheduler policies (architecture §7): caps, prefix-closure, Algorithm 1, the delayed budget, the
drafting-cost rule, and non-anticipation (architecture §6) as a property test that also catches a
retrospective policy."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from dspark.runtime.scheduler import DSpark, Policy, make_policy, sts_survival
from dspark.runtime.sps import DraftCost, SPSTable

ALL_SPECS = ["none", "mtp1", "fixed:3", "threshold:0.6", "dspark-theory", "dspark"]


def uniform_measured(policy: Policy, num_requests: int, rate: float = 1.0) -> None:
    """Report RATE_MIN_STEPS uniform-shape steps at R delivering `rate` tokens/s, as an engine
    does after the rule's first uniform steps there (`DSpark._pick_shape`): the rule then weighs
    its ranked model against plain decoding, with the uniform side far behind."""
    for _ in range(DraftCost.RATE_MIN_STEPS):
        policy.draft_cost.observe_rate(num_requests, True, rate, 1.0, uniform=True)


def random_batch(gen: torch.Generator, num_requests: int, gamma: int):
    conf = torch.rand(num_requests, gamma, generator=gen) ** 0.5
    remaining = torch.randint(1, 3 * gamma, (num_requests,), generator=gen)
    return conf, remaining


def random_jagged_sps(gen: torch.Generator, max_tokens: int) -> SPSTable:
    """Random non-increasing SPS with cliffs, buckets 1..max_tokens."""
    buckets = sorted(set([1, max_tokens] + torch.randint(1, max_tokens, (6,), generator=gen).tolist()))
    drops = torch.rand(len(buckets), generator=gen) ** 3  # mostly small steps, some cliffs
    sps = torch.cumprod(1.0 - 0.6 * drops, 0) * 100.0
    return SPSTable(buckets, sps.tolist())


def cliff_sps(gen: torch.Generator, num_requests: int, max_tokens: int) -> SPSTable:
    """Appendix-A-like: flat up to a cliff just above B = R, then a gentle decline, so that
    whether drafting pays off hinges on how many confident tokens exist (bait for lookahead)."""
    cliff = num_requests + int(torch.randint(0, 3, (1,), generator=gen))
    after = float(torch.empty(1).uniform_(0.4, 0.8, generator=gen))
    buckets = list(range(1, max_tokens + 1))
    return SPSTable(buckets, [100.0 if b <= cliff else 100.0 * after * 0.99 ** (b - cliff) for b in buckets])


def reference_top_k(survival: torch.Tensor, remaining: torch.Tensor, k: int, gamma: int) -> list[int]:
    """Python reference: rank eligible (r, j) by a desc, then j, then r; admit first k."""
    cands = [(-float(survival[r, j]), j, r) for r in range(survival.shape[0]) for j in range(gamma)
             if j < min(gamma, int(remaining[r]) - 1)]
    lengths = [0] * survival.shape[0]
    for _, _j, r in sorted(cands)[:k]:
        lengths[r] += 1
    return lengths


def test_sts_survival_is_cumulative_product_of_scaled_sigmoids():
    z = torch.tensor([[2.0, 0.0, -1.0], [1.0, 1.0, 1.0]])
    temps = torch.tensor([1.0, 2.0, 0.5])
    c = torch.sigmoid(z / temps)
    expected = torch.stack([c[:, 0], c[:, 0] * c[:, 1], c[:, 0] * c[:, 1] * c[:, 2]], dim=1)
    torch.testing.assert_close(sts_survival(z, temps), expected)
    shifts = torch.tensor([0.5, -1.0, 0.0])  # affine STS: σ(z/T + b)
    c = torch.sigmoid(z / temps + shifts)
    torch.testing.assert_close(sts_survival(z, temps, shifts), torch.cumprod(c, dim=1))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_caps_and_prefix_closure(spec):
    gen = torch.Generator().manual_seed(1)
    gamma = 6
    for _trial in range(40):
        num_requests = int(torch.randint(1, 12, (1,), generator=gen))
        max_tokens = int(torch.randint(num_requests, num_requests * (gamma + 1) + 1, (1,), generator=gen))
        policy = make_policy(spec, sps=random_jagged_sps(gen, 128), gamma=gamma, max_batch_tokens=max_tokens)
        for _step in range(3):
            conf, remaining = random_batch(gen, num_requests, gamma)
            survival = conf.cumprod(1)
            lengths = policy.decide(survival, remaining)
            assert lengths.dtype == torch.int64 and lengths.shape == (num_requests,)
            assert (lengths >= 0).all() and (lengths <= gamma).all()
            assert (lengths <= (remaining - 1).clamp(min=0)).all()
            assert int((1 + lengths).sum()) <= max_tokens
            if spec in ("dspark", "dspark-theory"):
                # the admitted set is exactly the top-K of the tie-broken ranking: prefix-closed
                assert lengths.tolist() == reference_top_k(survival, remaining, policy.last_budget, gamma)


def test_fixed_mtp1_none_threshold_rules():
    # ĉ = (.9, .8, .5, .83) and (.5, .9, .89, .98)
    a = torch.tensor([[0.9, 0.72, 0.36, 0.30], [0.5, 0.45, 0.40, 0.39]])
    rem = torch.tensor([100, 100])
    assert make_policy("none", gamma=4).decide(a, rem).tolist() == [0, 0]
    assert make_policy("mtp1", gamma=4).decide(a, rem).tolist() == [1, 1]
    assert make_policy("fixed:3", gamma=4).decide(a, rem).tolist() == [3, 3]
    assert make_policy("fixed:9", gamma=4).decide(a, rem).tolist() == [4, 4]
    assert make_policy("threshold:0.6", gamma=4).decide(a, rem).tolist() == [2, 0]
    assert make_policy("fixed:3", gamma=4).decide(a, torch.tensor([1, 3])).tolist() == [0, 2]


def test_batch_token_cap_drops_worst_ranked_with_tie_breaks():
    a = torch.full((2, 2), 0.5)
    rem = torch.tensor([10, 10])
    # room = 5 − 2 = 3 draft tokens; ties broken by j then r: (0,1), (1,1), (0,2)
    assert make_policy("fixed:2", gamma=2, max_batch_tokens=5).decide(a, rem).tolist() == [2, 1]
    assert make_policy("fixed:2", gamma=2, max_batch_tokens=1).decide(a, rem).tolist() == [0, 0]


def test_algorithm1_hand_computed():
    a = torch.tensor([[0.9, 0.5], [0.8, 0.2]])
    rem = torch.tensor([50, 50])
    smooth = SPSTable([2, 3, 4, 5, 6], [1.0, 0.9, 0.8, 0.7, 0.6])
    # Θ = 2·1 = 2, 2.9·0.9 = 2.61, 3.7·0.8 = 2.96, 4.2·0.7 = 2.94 (decline: stop) -> K = 2
    theory = make_policy("dspark-theory", sps=smooth, gamma=2)
    assert theory.decide(a, rem).tolist() == [1, 1] and theory.last_budget == 2
    # a cliff right after B = R: Θ = 2, 2.9·0.6 = 1.74 -> Algorithm 1 stops at K = 0, while the
    # global argmax crosses it: 3.7·.58 = 2.146, 4.2·.57 = 2.394, 4.4·.56 = 2.464 -> K = 4
    cliff = SPSTable([2, 3, 4, 5, 6], [1.0, 0.6, 0.58, 0.57, 0.56])
    assert make_policy("dspark-theory", sps=cliff, gamma=2).decide(a, rem).tolist() == [0, 0]
    assert make_policy("retrospective", sps=cliff, gamma=2).decide(a, rem).tolist() == [2, 2]
    dspark = make_policy("dspark", sps=cliff, gamma=2)
    assert dspark.decide(a, rem).tolist() == [1, 1]  # no history: budget K = R
    dspark.decide(a, rem)
    assert dspark.decide(a, rem).tolist() == [2, 2] and dspark.last_budget == 4


def test_dspark_budget_follows_t_minus_2_snapshot_only():
    buckets = list(range(1, 1025))
    sps = SPSTable(buckets, [1000.0 / (1.0 + 0.02 * b) for b in buckets])  # step time linear in B
    gen = torch.Generator().manual_seed(3)
    num_requests, gamma = 64, 7
    rem = torch.full((num_requests,), 1000)
    high = torch.full((num_requests, gamma), 0.97).cumprod(1)
    low = torch.full((num_requests, gamma), 0.2).cumprod(1)

    def budget(t2, t1, now) -> int:
        policy = make_policy("dspark:delayed", sps=sps, gamma=gamma)
        policy.decide(t2, rem)
        policy.decide(t1, rem)
        policy.decide(now, rem)
        return policy.last_budget

    base = budget(high, low, low)
    assert base > 2 * num_requests  # confident snapshot -> large budget
    assert budget(low, low, low) < num_requests // 2  # unconfident snapshot -> small budget
    assert budget(high, high, low) == base  # step t−1 does not matter
    for _ in range(10):  # the current confidences never change K_t
        now = (torch.rand(num_requests, gamma, generator=gen)).cumprod(1)
        assert budget(high, low, now) == base
    # different R now than in the snapshot: the snapshot is resampled, budget scales with R
    policy = make_policy("dspark:delayed", sps=sps, gamma=gamma)
    policy.decide(high[:32], rem[:32])
    policy.decide(high[:32], rem[:32])
    policy.decide(low, rem)
    assert abs(policy.last_budget - base) <= 2


def admitted(policy_spec: str, sps: SPSTable, history: list, survival, remaining, gamma, max_tokens,
             draft_cost: DraftCost | None = None, recal: tuple | None = None):
    """ℓ of the step after `history`. With a drafting cost, the cost rule is asked first, as the
    engine does before drafting (skip: ℓ = 0; its shape: ranked or uniform)."""
    policy = make_policy(policy_spec, sps=sps, gamma=gamma, max_batch_tokens=max_tokens,
                         draft_cost=copy.deepcopy(draft_cost))
    if recal is not None:  # past outcomes: per-level predicted mass and acceptances
        policy._predicted[:], policy._accepted[:] = recal
    for old in history:
        policy.decide(old, remaining)
    if draft_cost is not None and not policy.wants_draft(survival.shape[0]):
        return torch.zeros(survival.shape[0], dtype=torch.int64)
    return policy.decide(survival, remaining)


def random_ragged_grid(gen: torch.Generator) -> dict:
    """A random step-time grid by (R, tokens per request), increasing in both, some steps steep."""
    requests, tpr = [1, 2, 4], [1, 2, 3, 5]
    base = torch.rand(len(requests), generator=gen).cumsum(0) / 50 + 0.01
    steps = (torch.rand(len(requests), len(tpr), generator=gen) ** 3 / 20).cumsum(1)
    return {"requests": requests, "tokens_per_request": tpr, "seconds": (base[:, None] + steps).tolist()}


def count_anticipation_violations(spec: str, trials: int, seed: int = 0, drafting_cost: bool = False,
                                  ragged: bool = False) -> int:
    """Perturb ĉ_{r,j+1..γ} (what a different d_{r,j} would give) and check that whether (r, i)
    is admitted, for every i ≤ j, never changes. Other rows may change (global interaction).
    drafting_cost: Θ counts a random drafting time per step (the cost-aware budget) and a random
    fitted forward (draft rows' price scales), the survivals carry random recalibration
    factors (as if learned from past steps), and the cost rule (draft or skip, ranked or uniform
    shape) runs before the step on random measured plain and uniform rates. ragged: the SPS
    table carries a random (R, tokens per request) grid, so Θ's step time depends on R too."""
    gen = torch.Generator().manual_seed(seed)
    gamma, violations = 4, 0
    for trial in range(trials):
        num_requests = int(torch.randint(1, 5, (1,), generator=gen))
        max_tokens = num_requests * (gamma + 1)
        sps = random_jagged_sps(gen, max_tokens) if trial % 2 else cliff_sps(gen, num_requests, max_tokens)
        if ragged:
            sps = SPSTable(sps.batch_tokens, sps.steps_per_second, ragged=random_ragged_grid(gen))
        cost = DraftCost({num_requests: float(torch.rand(1, generator=gen)) / 50}) if drafting_cost else None
        recal = None
        if drafting_cost:  # past outcomes: predicted mass and acceptances per survival level
            recal = tuple(torch.rand(len(Policy.LEVELS), generator=gen).numpy() * 20 for _ in range(2))
            a, b, c = (0.5 + 2 * torch.rand(3, generator=gen)).tolist()  # past forwards' price scales
            for _ in range(DraftCost.VERIFY_MIN_STEPS):
                base, rows, beyond = 0.02, *(torch.rand(2, generator=gen) / 20).tolist()
                cost.observe_verify(num_requests, a * base + b * rows + c * beyond, base, rows, beyond)
            plain_rate, uniform_rate = (torch.rand(2, generator=gen) * 400).tolist()  # tokens/s
            for _ in range(DraftCost.RATE_MIN_STEPS):
                cost.observe_rate(num_requests, False, plain_rate / 100, 0.01)
                cost.observe_rate(num_requests, True, uniform_rate / 100, 0.01, uniform=True)
        history = [random_batch(gen, num_requests, gamma)[0].cumprod(1) for _ in range(2)]
        conf, remaining = random_batch(gen, num_requests, gamma)
        r = int(torch.randint(0, num_requests, (1,), generator=gen))
        j = int(torch.randint(0, gamma - 1, (1,), generator=gen))  # 0-based: positions ≤ j fixed
        base = admitted(spec, sps, history, conf.cumprod(1), remaining, gamma, max_tokens, cost, recal)
        for _ in range(4):
            other = conf.clone()
            other[r, j + 1:] = torch.rand(gamma - j - 1, generator=gen) ** 0.3
            new = admitted(spec, sps, history, other.cumprod(1), remaining, gamma, max_tokens, cost, recal)
            # (r, i) admitted iff ℓ_r > i; compare for i = 0..j
            if min(int(base[r]), j + 1) != min(int(new[r]), j + 1):
                violations += 1
    return violations


@pytest.mark.parametrize("spec", ["dspark", "dspark:delayed", "dspark-theory", "threshold:0.6", "fixed:2"])
def test_non_anticipation_property(spec):
    assert count_anticipation_violations(spec, trials=200) == 0


def test_dspark_ranked_width_reads_accepted_depths_of_completed_steps():
    """A ranked block is one token wider than the most drafts accepted in the last
    `depth_window` ranked steps of R's class (γ at first, on every `full_width_every`-th and
    where a full propose costs under `narrow_min_share` of a step); a uniform step drafts one.
    Only `observe_acceptance` (a completed step) and measured times move it."""
    sps = SPSTable([1, 8], [100.0, 90.0])  # a one-token step: 10 ms
    policy = make_policy("dspark", sps=sps, gamma=7, draft_cost=DraftCost({1: 0.001, 8: 0.001}))
    assert isinstance(policy, DSpark) and (policy.depth_window, policy.full_width_every) == (8, 8)
    survival, lengths = torch.ones(1, 7), torch.tensor([5])
    widths = []
    for accepted in [2, 3, 0, 0, 0, 0, 0, 0, 0, 0]:
        policy.wants_draft(1)
        widths.append(policy.draft_width())
        policy.observe_acceptance(survival, lengths, torch.tensor([accepted]))
    policy.wants_draft(1)
    widths.append(policy.draft_width())
    # none yet: γ; then 1 + max of the window; the 8th ranked step full; the 2 and 3 leave the window
    assert widths == [7, 3, 4, 4, 4, 4, 4, 4, 7, 4, 1]
    policy.wants_draft(8)  # another class of R: nothing learned there yet
    assert policy.draft_width() == 7
    policy.wants_draft(1)
    policy._next_shape = "uniform"
    assert policy.draft_width() == 1
    twin = make_policy("dspark", sps=sps, gamma=7, draft_cost=DraftCost({1: 0.001, 8: 0.001}))
    twin.warm_from(policy)
    twin.wants_draft(1)
    assert twin.draft_width() == 1
    cheap = make_policy("dspark", sps=sps, gamma=7, draft_cost=DraftCost({1: 0.0002}))  # 2 % of a step
    cheap.warm_from(policy)
    cheap.draft_cost = DraftCost({1: 0.0002})
    cheap.wants_draft(1)
    assert cheap.draft_width() == 7  # prompt lookup's price: narrowing would save nothing
    policy.reset()
    policy.wants_draft(1)
    assert policy.draft_width() == 7


def test_property_catches_retrospective_policy():
    assert count_anticipation_violations("retrospective", trials=200) >= 3


@pytest.mark.parametrize("spec", ["dspark", "dspark:delayed"])
def test_non_anticipation_with_drafting_counted(spec):
    assert count_anticipation_violations(spec, trials=200, seed=1, drafting_cost=True) == 0


@pytest.mark.parametrize("spec", ["dspark", "dspark-theory"])
def test_non_anticipation_with_a_ragged_step_table(spec):
    assert count_anticipation_violations(spec, trials=200, seed=2, drafting_cost=True, ragged=True) == 0


def test_ragged_table_prices_tokens_by_request_count():
    """With a ragged grid, Θ at R reads the step time of R requests: the same survivals earn
    deep drafts where an extra token per request is nearly free (R = 1 on a CPU) and fewer where
    it is expensive (R = 4), which one table by B cannot say."""
    grid = {"requests": [1, 4], "tokens_per_request": [1, 8],
            "seconds": [[0.010, 0.011], [0.020, 0.080]]}
    sps = SPSTable([1, 32], [100.0, 12.5], device="cpu", ragged=grid)
    assert sps.rates_for(1, 8)[8] == pytest.approx(1 / 0.011)
    gamma = 7
    for num_requests, expect_deep in ((1, True), (4, False)):
        policy = make_policy("dspark-theory", sps=sps, gamma=gamma, max_batch_tokens=64)
        survival = torch.full((num_requests, gamma), 0.8).cumprod(1)
        lengths = policy.decide(survival, torch.full((num_requests,), 100))
        assert (int(lengths.max()) == gamma) == expect_deep, (num_requests, lengths)


def test_draft_or_skip_reads_only_step_t_minus_2():
    """The cost rule for step t+1 (asked after step t's decide) reads the snapshots up to step t−1:
    it never changes with the survivals of steps t or t+1, and follows the t−1 snapshot."""
    gen = torch.Generator().manual_seed(4)
    flat = SPSTable([1, 1024], [100.0, 99.0])  # verify costs 10 ms whatever B
    num_requests, gamma = 16, 7
    rem = torch.full((num_requests,), 1000)
    high = torch.full((num_requests, gamma), 0.9).cumprod(1)
    low = torch.full((num_requests, gamma), 0.05).cumprod(1)

    def wants(t_minus_1, now, correction: float | None = None) -> bool:
        policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({num_requests: 0.005}))
        uniform_measured(policy, num_requests)
        for _ in range(DraftCost.RATE_MIN_STEPS if correction is not None else 0):  # past steps
            policy.draft_cost.observe_prediction(num_requests, 1000.0)  # predicted 1000 tokens/s,
            policy.observe_rate(num_requests, True, 20 * correction, 0.02)  # delivered 1000 x correction
            policy.observe_rate(num_requests, False, num_requests, 0.01)
        policy.decide(t_minus_1, rem)
        policy.decide(now, rem)
        return policy.wants_draft(num_requests)

    assert wants(high, low) and not wants(low, high)
    mid = torch.full((num_requests, gamma), 0.45).cumprod(1)  # the model: 1.2x plain's measured rate
    for _ in range(10):
        now = torch.rand(num_requests, gamma, generator=gen).cumprod(1)
        assert wants(high, now) and not wants(low, now)
        # what past steps delivered corrects the model; still nothing of steps t or t+1 counts
        assert wants(mid, now, correction=1.0) and not wants(mid, now, correction=0.5)


def test_cost_rule_skips_drafting_only_when_it_is_slower_than_plain():
    """Θ_spec = max_K (R + Σ top-K a) / (t_draft + 1/SPS(R+K)) against plain R · SPS(R): with a
    5 ms drafter on a flat 10 ms verify, confident survivals (Σ a ≈ 4.2 per request) pay and
    unconfident ones (0.05) do not; no measured cost yet -> draft; while skipping, probes after 16
    skipped steps, then 32, 64, ... (up to 256), and after 16 again once speculation pays."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    r, gamma = 8, 7
    rem = torch.full((r,), 1000)
    policy = make_policy("dspark", sps=flat, gamma=gamma)
    low = torch.full((r, gamma), 0.05).cumprod(1)
    high = torch.full((r, gamma), 0.9).cumprod(1)
    policy.decide(low, rem)
    policy.decide(low, rem)
    assert policy.wants_draft(r)  # nothing measured: draft
    policy.observe_draft(r, 0.005)
    explore = DraftCost.RATE_MIN_STEPS  # first, the uniform shape's steps at R (`_pick_shape`)
    decisions = [policy.wants_draft(r) for _ in range(explore + 16 + 1 + 32 + 1 + 64 + 1)]
    probes = [i - explore for i, d in enumerate(decisions) if d]
    assert probes == [*range(-explore, 0), 16, 16 + 1 + 32, 16 + 1 + 32 + 1 + 64]  # probes only, backing off
    long_run = [policy.wants_draft(r) for _ in range(3000)]
    assert 3000 // 257 <= long_run.count(True) <= 3000 // 128  # capped at one probe per 256 skips
    for _ in range(8):  # the average curve follows confident steps within a few steps
        policy.decide(high, rem)
    assert policy.wants_draft(r)
    assert policy.probe_state(r) == [0, policy.probe_every]  # speculation paid: probing starts over
    # a free drafter: speculation never loses to plain on a flat SPS
    free = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 1e-9}))
    free.decide(low, rem)
    free.decide(low, rem)
    assert free.wants_draft(r)
    # policies other than dspark always draft
    assert make_policy("fixed:3", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 1.0})).wants_draft(r)



def test_probe_back_off_is_kept_per_class_of_request_count():
    """Speculation that pays at R = 2 resets the probe back-off of R in 2–3 only: at R = 8 the rule
    keeps probing once per 256 skipped steps."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    gamma = 7
    policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({2: 0.001, 8: 0.005}))
    low8, rem8 = torch.full((8, gamma), 0.05).cumprod(1), torch.full((8,), 1000)
    for _ in range(2):
        policy.decide(low8, rem8)
    for _ in range(2000):
        policy.wants_draft(8)
    assert policy.probe_state(8)[1] == policy.probe_max
    high2, rem2 = torch.full((2, gamma), 0.95).cumprod(1), torch.full((2,), 1000)
    for _ in range(8):
        policy.decide(high2, rem2)
    assert policy.wants_draft(2) and policy.probe_state(2) == [0, policy.probe_every]
    assert policy.probe_state(8)[1] == policy.probe_max and policy.probe_state(9) is policy.probe_state(15)
    fresh = make_policy("dspark", sps=flat, gamma=gamma)
    fresh.warm_from(policy)
    assert fresh.probe_state(8) == policy.probe_state(8) and fresh.probe_state(8) is not policy.probe_state(8)


def test_drafting_cost_extrapolates_upwards_in_request_count():
    """t_draft(R) above the largest measured R follows the slope of the two largest (propose grows
    with R), never falling; one measurement, or below the range: the nearest; overheads stay flat."""
    cost = DraftCost({1: 0.003, 2: 0.004})
    assert cost(8) == pytest.approx(0.010) and cost(1) == 0.003 and cost(2) == 0.004
    assert DraftCost({4: 0.006})(32) == 0.006 and DraftCost({4: 0.006})(1) == 0.006
    assert DraftCost({1: 0.005, 2: 0.004})(8) == 0.004  # measured noise: never a falling cost
    cost.observe_overhead(1, True, 0.001)
    cost.observe_overhead(2, True, 0.002)
    assert cost.overhead(8, True) == 0.002


def test_cost_rule_counts_whole_step_overheads():
    """The rule compares whole steps: what a drafted step costs beyond propose and 1/SPS(B) (the
    drafter's extend, acceptance, Triton hops: `observe_step`) and what a plain step costs beyond
    1/SPS(R). On a flat 10 ms verify with a 1 ms drafter, moderately confident survivals pay
    when the overheads are equal, not when a drafted step carries 10 ms more; learned from
    reported steps, with frozen costs ignoring them."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    r, gamma = 1, 7
    rem = torch.full((r,), 1000)
    mid = torch.full((r, gamma), 0.5).cumprod(1)  # ≈ 1 expected accepted token per step

    def wants(drafted_s: float, plain_s: float, learn: bool = True) -> bool:
        policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.001}, learn=learn))
        uniform_measured(policy, r)
        policy.decide(mid, rem)
        policy.decide(mid, rem)
        for _ in range(50):  # steps of 10 ms target + overhead (+ 1 ms propose when drafted)
            policy.observe_step(r, 1 + gamma, True, 0.001 + 1 / flat(1 + gamma) + drafted_s, 0.001)
            policy.observe_step(r, r, False, 1 / flat(r) + plain_s, 0.0)
        return policy.wants_draft(r)

    assert wants(0.0, 0.0) and wants(0.002, 0.002)
    assert not wants(0.010, 0.0)  # the drafted step's extra hops eat the gain: decode plain
    assert wants(0.010, 0.008)  # ... unless plain steps carry them too
    assert wants(0.010, 0.0, learn=False)  # frozen costs: timing never changes the schedule
    cost = DraftCost()
    assert cost.overhead(3, True) == 0.0
    cost.observe_overhead(2, True, 0.004)
    cost.observe_overhead(4, True, 0.008)
    assert cost.overhead(3, True) == pytest.approx(0.006) and cost.overhead(3, False) == 0.0
    assert cost.overheads() == {"drafted": {2: 0.004, 4: 0.008}, "plain": {}}


def test_plain_step_is_priced_at_most_as_a_drafted_step_without_drafts():
    """A plain step does a subset of a drafted step's work: its price 1/SPS(R) + o_p(R) is capped
    by a·1/SPS(R) + o_d(R). In a closed loop the few plain steps a drafting engine runs (slow
    ones) measured o_p 22 ms at 8 requests against o_d ≈ 0, so the rule drafted on
    where plain decoding was faster. Moderately unconfident survivals on a flat 10 ms verify with
    a 2 ms drafter: plain wins once its one slow sample is capped; before drafted steps are
    measured, o_p stands."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    r, gamma = 8, 7
    rem = torch.full((r,), 1000)
    weak = torch.full((r, gamma), 0.1).cumprod(1)  # ≈ 0.11 expected accepted tokens per request

    def policy_after(plain_spike_s: float, drafted_steps: int):
        policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.002}))
        uniform_measured(policy, r, rate=1.0)
        policy.decide(weak, rem)
        policy.decide(weak, rem)
        policy.observe_step(r, r, False, 1 / flat(r) + plain_spike_s, 0.0)  # one slow plain step
        for _ in range(drafted_steps):
            policy.observe_step(r, 2 * r, True, 0.002 + 1 / flat(2 * r), 0.002, 1 / flat(2 * r))
        return policy

    cost = policy_after(0.022, 30).draft_cost
    assert cost.overhead(r, False) == pytest.approx(0.022)
    assert cost.plain_step(r, 1 / flat(r)) == pytest.approx(1 / flat(r), abs=1e-4)  # capped at a·base + o_d
    assert not policy_after(0.022, 30).wants_draft(r)  # plain decoding, priced right, is faster
    assert not policy_after(0.0, 30).wants_draft(r)
    uncapped = policy_after(0.022, 0)  # no drafted step measured: nothing to cap by
    assert uncapped.draft_cost.plain_step(r, 1 / flat(r)) == pytest.approx(1 / flat(r) + 0.022)
    assert uncapped.wants_draft(r)  # a 32 ms plain step loses to drafting


def test_draft_rows_price_scale_is_fitted_and_shrinks_budgets():
    """Drafted steps report their target forward (`observe_step(..., verify_seconds)`); the rule
    fits forward ≈ a·(anchor rows' price) + b·(first R draft rows' price) + c·(further rows'
    price) per class of R. Draft rows that cost twice their table price (live ragged budgets the
    grid underprices) make every draft token dearer, so the budget shrinks, and rows past the
    first R that cost 3x (compute-bound on a CPU) shrink it further; a forward that is slower as
    a whole (a busier machine) is read as a = b = c, not as costly draft rows; nothing is fitted
    before VERIFY_MIN_STEPS."""
    table = SPSTable([1, 4, 8, 16, 32], [100.0, 95.0, 80.0, 50.0, 28.0])
    r, gamma = 4, 7
    rem = torch.full((r,), 1000)
    surv = torch.full((r, gamma), 0.8).cumprod(1)

    def run(a: float, b: float, c: float | None = None, steps: int = 40):
        """-> (fitted scales, the budget, the fitted forward ÷ the true one at B = R + 1 .. R + 19)"""
        policy = make_policy("dspark", sps=table, gamma=gamma, draft_cost=DraftCost({r: 0.001}))
        sps = policy.sps_for(r)

        def forward(batch: int, a: float, b: float, c: float) -> float:
            base, knee = 1 / sps[r], 1 / sps[min(batch, 2 * r)]
            return a * base + b * (knee - base) + c * (1 / sps[batch] - knee)

        c = b if c is None else c
        for i in range(steps):
            batch = r + i % 20
            policy.observe_step(r, batch, True, 0.001 + forward(batch, a, b, c) + 0.0005, 0.001,
                                forward(batch, a, b, c))
        for _ in range(3):
            policy.decide(surv, rem)
        scales = policy.draft_cost.verify_scale(r)
        ratio = [forward(bt, *scales) / forward(bt, a, b, c) for bt in range(r + 1, r + 20)]
        return scales, policy.last_budget, np.array(ratio)

    scales, priced, fit = run(1.0, 1.0)
    assert scales == pytest.approx((1.0, 1.0, 1.0), abs=0.01)
    # the first R rows are told apart from the anchors only by steps with fewer draft rows: the
    # ridge shares their price, and the forward comes out right
    scales, dear, fit = run(1.0, 2.0)
    assert scales[2] == pytest.approx(2.0, abs=0.1) and fit == pytest.approx(1.0, abs=0.03) and dear < priced
    scales, dearer, fit = run(1.0, 1.0, 3.0)  # only the rows past the first R dearer
    assert scales[2] == pytest.approx(3.0, abs=0.15) and fit == pytest.approx(1.0, abs=0.05)
    assert dear <= dearer < priced
    scales, _, fit = run(1.3, 1.3)
    assert scales == pytest.approx((1.3, 1.3, 1.3), abs=0.05)
    assert run(1.0, 2.0, steps=DraftCost.VERIFY_MIN_STEPS - 1)[0] == (1.0, 1.0, 1.0)
    rng = np.random.default_rng(0)  # noisy steps with little spread in the budget: a ≈ b
    cost = DraftCost()
    for _ in range(300):
        rows = 0.027 + rng.normal(0, 0.001)
        cost.observe_verify(32, 1.3 * (0.074 + rows) + rng.normal(0, 0.005), 0.074, rows)
    assert cost.verify_scale(32) == pytest.approx((1.3, 1.3, 1.3), abs=0.06)
    assert list(cost.verify_scales()) == [32]


def test_cost_rule_corrects_its_model_with_what_steps_delivered():
    """Steps report what they delivered (`observe_rate`). On a flat 10 ms verify with a 2 ms drafter
    the model predicts 1.14x plain's rate at survivals 0.27^j and 0.98x at 0.15^j; where steps
    deliver 0.75x (resp. 1.25x) of the prediction, the rule learns to decode plain but for its
    probes (resp. to draft). The correction is clipped to CORRECTION_RANGE and scales the model,
    which still follows the survivals; frozen costs ignore it."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    r, gamma = 4, 7
    rem = torch.full((r,), 1000)
    powers = lambda p: torch.full((r, gamma), p).cumprod(1)  # noqa: E731
    spec_s, plain_s = 0.002 + 1 / flat(r + 1), 1 / flat(r)

    def simulate(p: float, delivered: float, steps: int = 64, learn: bool = True, policy=None):
        """Steps at survivals p^j: plain ones emit R tokens, speculative ones `delivered` x the
        model's prediction."""
        policy = policy or make_policy("dspark", sps=flat, gamma=gamma,
                                       draft_cost=DraftCost({r: 0.002}, learn=learn))
        for _ in range(2):  # two past steps: the model has a survival curve from the first step on
            policy.decide(powers(p), rem)
        decisions = []
        drafted = policy.wants_draft(r)
        for _ in range(steps):  # the engine's order: decide, verify, the rule for the next step, rates
            policy.decide(powers(p), rem)
            tokens = delivered * policy.last_rates[0] * spec_s if drafted else r
            decisions.append(drafted)
            drafted, was_drafted = policy.wants_draft(r), drafted
            policy.observe_rate(r, was_drafted, tokens, spec_s if was_drafted else plain_s)
        return decisions[steps // 2:], policy

    late, policy = simulate(0.27, 1.0)
    assert all(late) and policy.last_rates[0] / policy.last_rates[2] == pytest.approx(1.14, abs=0.01)
    late, policy = simulate(0.27, 0.75)  # the model says pay, speculative steps deliver less
    assert sum(late) <= 2  # plain, but for the probes
    assert policy.draft_cost.speculative_correction(r) == DraftCost.CORRECTION_RANGE[0]
    assert policy.draft_cost.plain_rate(r) == pytest.approx(r / plain_s)
    assert all(simulate(0.27, 0.75, learn=False)[0])  # frozen costs: timing never changes the schedule
    assert sum(simulate(0.15, 1.0)[0]) <= 2  # the model alone: these survivals do not pay
    assert sum(simulate(0.15, 1.25, steps=400)[0]) >= 150  # ... but its probes deliver more
    # the model still follows the survivals: survivals of 1 pay at once (2645 tokens/s predicted,
    # 0.8x that after the correction, against 396 plain), 0.27^j again do not
    for _ in range(16):  # the average survival curve moves to the new survivals; nothing measured
        policy.decide(torch.ones(r, gamma), rem)
    assert policy.wants_draft(r)
    for _ in range(16):
        policy.decide(powers(0.27), rem)
    assert not policy.wants_draft(r)
    # the measured rates: a plain mean over the first 1/α steps (the first weighs no more than the
    # others), then a moving average; tokens and seconds averaged apart
    cost = DraftCost()
    for tokens, seconds in ((6, 0.02), (2, 0.02), (4, 0.05)):
        cost.observe_rate(2, True, tokens, seconds)
    cost.observe_rate(3, True, 6, 0.02, uniform=True)  # a uniform-shape step counts apart
    assert cost.measured_rates() == {"speculative": {2: pytest.approx(4 / 0.03)}, "plain": {},
                                     "uniform": {3: pytest.approx(300.0)}}


def test_uniform_shape_is_measured_once_per_class_of_request_count():
    """The uniform shape's rate is measured per exact R; until it is, the nearest measured R' of
    R's class stands in at its ratio to plain decoding there (uniform(R') ÷ plain(R') ×
    plain(R)), so a closed loop whose R wanders within a class explores the uniform shape once,
    not 4 steps at every R. Uniform steps that ran at 0.8x plain at R = 20: at R = 24 the rule
    decodes plain at once; at R = 40 (another class) and without any measurement, it explores."""
    table = SPSTable([1, 16, 32, 64, 128], [100.0, 90.0, 70.0, 45.0, 25.0])

    def policy_with(measured_at: int | None):
        cost = DraftCost({20: 0.002, 24: 0.002, 40: 0.002})
        policy = make_policy("dspark", sps=table, gamma=7, draft_cost=cost)
        for r in (20, 24, 40):  # unconfident survivals: the ranked model does not pay either
            weak = torch.full((r, 7), 0.05).cumprod(1)
            policy.decide(weak, torch.full((r,), 1000))
        if measured_at is not None:
            plain = measured_at * table(measured_at)
            for _ in range(DraftCost.RATE_MIN_STEPS):
                policy.draft_cost.observe_rate(measured_at, True, 0.8 * plain, 1.0, uniform=True)
                policy.draft_cost.observe_rate(measured_at, False, plain, 1.0)
        return policy

    policy = policy_with(20)
    assert not policy.wants_draft(24)  # no uniform step explored at 24
    assert policy.last_uniform_rate == pytest.approx(0.8 * policy.last_rates[2], rel=1e-6)
    assert policy.wants_draft(40) and policy._next_shape == "uniform"  # another class: explore
    fresh = policy_with(None)
    assert fresh.wants_draft(24) and fresh._next_shape == "uniform" and fresh.last_uniform_rate is None


def test_paired_ratio_compares_a_step_with_the_run_of_steps_before_it():
    """A step whose mode differs from the run of steps at R before it gives one paired reading,
    its rate over that run's (the run's last PAIR_RUN steps, at least PAIR_RUN_MIN), for both
    orders of the pair; readings average in log space per class of R; a run too short to
    compare with, another class of R or frozen costs give none."""
    cost = DraftCost({8: 0.002})

    def steps(mode: str, rates: list[float], r: int = 8) -> None:
        for rate in rates:
            cost.observe_rate(r, mode != "plain", rate, 1.0, uniform=mode == "uniform")

    steps("plain", [100.0] * 5)
    steps("uniform", [110.0, 120.0, 120.0, 120.0, 120.0])  # reading 1: 110 over 100
    assert cost.paired_ratio(8, "uniform", "plain") is None  # PAIR_MIN readings first
    steps("plain", [100.0])  # reading 2: 100 over the uniform run's 118 (ratio of sums)
    both = math.sqrt(1.1 * 1.18)  # the readings' geometric mean (two readings: equal weights)
    assert cost.paired_ratio(8, "uniform", "plain") == pytest.approx(both)
    assert cost.paired_ratio(8, "plain", "uniform") == pytest.approx(1 / both)
    assert cost.paired_ratio(12, "uniform", "plain") == pytest.approx(both)  # R's class: 8–15
    assert cost.paired_ratio(16, "uniform", "plain") is None
    assert cost.paired_ratio(8, "ranked", "plain") is None
    assert cost.paired_ratios() == {"uniform/plain": {8: pytest.approx(both)},
                                    "plain/uniform": {8: pytest.approx(1 / both)}}
    steps("ranked", [90.0])  # after a 1-step plain run: too short to compare with
    steps("plain", [100.0] * 3)
    assert cost.paired_ratio(8, "ranked", "plain") is None
    frozen = DraftCost({8: 0.002}, learn=False)
    for mode, rate in [("plain", 100.0)] * 4 + [("uniform", 150.0)] * 4 + [("plain", 100.0)]:
        frozen.observe_rate(8, mode != "plain", rate, 1.0, uniform=mode == "uniform")
    assert frozen.paired_ratio(8, "uniform", "plain") is None


def test_cost_rule_weighs_the_uniform_shape_by_its_paired_ratio():
    """The uniform side is plain's rate times the paired ratio once there is one: a uniform average
    read in a slow stretch of the loop (640 tokens/s, plain then 560) against plain's average of
    a fast one (800) says skip, its steps against the plain steps around them say 1.13x plain: the
    rule drafts the uniform shape. Without paired readings it weighs the averages and skips."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    r, gamma = 8, 7

    def policy_after(stretches: list[tuple[str, float, int]]):
        policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.002}))
        weak = torch.full((r, gamma), 0.05).cumprod(1)  # the ranked model does not pay
        for _ in range(2):
            policy.decide(weak, torch.full((r,), 1000))
        for mode, rate, n in stretches:
            for _ in range(n):
                policy.draft_cost.observe_rate(r, mode == "uniform", rate, 1.0, uniform=True)
        return policy

    # tokens/s ~ what the table models for plain decoding at R (100 steps/s x 8)
    slow_then_fast = [("plain", 560.0, 4), ("uniform", 640.0, 4), ("plain", 576.0, 4), ("plain", 800.0, 8)]
    policy = policy_after(slow_then_fast)
    ratio = policy.draft_cost.paired_ratio(r, "uniform", "plain")
    assert ratio == pytest.approx(math.sqrt(640 / 560 * 640 / 576))
    assert policy.wants_draft(r) and policy._next_shape == "uniform"
    assert policy.last_uniform_rate == pytest.approx(ratio * policy.last_rates[2])
    assert policy.last_rates[1] < policy.last_rates[2]  # the ranked model does not pay
    unpaired = policy_after([("uniform", 640.0, 4), ("plain", 800.0, 12)])  # one reading only
    assert unpaired.draft_cost.paired_ratio(r, "uniform", "plain") is None
    assert not unpaired.wants_draft(r)
    assert unpaired.last_uniform_rate == pytest.approx(640.0)


def test_step_shape_follows_paired_readings_of_the_two_shapes():
    """Once ranked and uniform steps have paired readings (each a step against the run of the
    other shape just before it), they pick the shape: ranked steps delivered 0.9x the uniform
    steps around them, then ran in a fast stretch (900 tokens/s), so the model times its
    measured/predicted average says ranked while the readings say uniform. Without two readings
    the averages decide (ranked)."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    r, gamma = 8, 7

    def policy_after(stretches: list[tuple[str, float, int]]):
        policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.002}))
        fair = torch.full((r, gamma), 0.2).cumprod(1)
        for _ in range(2):
            policy.decide(fair, torch.full((r,), 1000))
        policy.wants_draft(r)
        predicted = policy.last_rates[0]
        for mode, rate, n in stretches:
            for _ in range(n):
                if mode == "ranked":  # what the rule records before a ranked step
                    policy.draft_cost.observe_prediction(r, predicted)
                policy.draft_cost.observe_rate(r, True, rate, 1.0, uniform=mode == "uniform")
        return policy

    policy = policy_after([("uniform", 700.0, 4), ("ranked", 630.0, 4), ("uniform", 700.0, 4),
                           ("ranked", 630.0, 1), ("ranked", 900.0, 8)])
    assert policy.draft_cost.paired_ratio(r, "ranked", "uniform") == pytest.approx(0.9)
    assert policy.wants_draft(r) and policy._next_shape == "uniform"
    assert policy.last_rates[1] > policy.draft_margin * policy.last_uniform_rate  # the averages: ranked
    unpaired = policy_after([("uniform", 700.0, 4), ("ranked", 900.0, 8)])  # one reading
    assert unpaired.draft_cost.paired_ratio(r, "ranked", "uniform") is None
    assert unpaired.wants_draft(r) and unpaired._next_shape == "ranked"


def test_cost_rule_refreshes_a_stale_plain_rate():
    """A measured plain rate is refreshed only by plain steps, which the rule stops running once
    drafting pays: after PLAIN_STALE_STEPS steps without one at R, a plain probe runs where
    speculation leads by less than `plain_probe_margin`, and its rate replaces the stale average
    (a plain rate measured low in another benchmark cell kept the rule drafting at 0.96x plain);
    no probe where the lead is wide. From past steps only: lossless."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    r, gamma = 4, 7
    stale_plain = 400.0  # tokens/s, what the SPS table models (the ranked model: ~350)

    def policy_drafting(uniform_rate: float):
        policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.002}))
        weak = torch.full((r, gamma), 0.05).cumprod(1)  # the ranked model does not pay
        for _ in range(2):
            policy.decide(weak, torch.full((r,), 1000))
        uniform_measured(policy, r, uniform_rate)
        for _ in range(DraftCost.RATE_MIN_STEPS):
            policy.draft_cost.observe_rate(r, False, stale_plain, 1.0)
        return policy

    def drafted_steps(policy, n: int, uniform_rate: float) -> list[bool]:
        decisions = []
        for _ in range(n):
            decisions.append(policy.wants_draft(r))
            policy.draft_cost.observe_rate(r, decisions[-1], uniform_rate if decisions[-1] else stale_plain,
                                           1.0, uniform=True)
        return decisions

    policy = policy_drafting(1.1 * stale_plain)
    stale = DraftCost.PLAIN_STALE_STEPS
    decisions = drafted_steps(policy, stale, 1.1 * stale_plain)
    assert all(decisions) and not policy.wants_draft(r)  # stale: one plain probe
    assert policy.wants_draft(r)  # the probe's rate not reported yet: R is not stale meanwhile
    policy.draft_cost.observe_rate(r, False, 1.3 * stale_plain, 1.0)  # plain is faster by now
    assert policy.draft_cost.plain_rate(r) == pytest.approx(1.3 * stale_plain)  # replaced, not averaged
    assert not policy.wants_draft(r)
    # a probe that measures plain as before: drafting goes on, the next probe after as many steps
    policy = policy_drafting(1.1 * stale_plain)
    decisions = drafted_steps(policy, 3 * (stale + 1), 1.1 * stale_plain)
    assert [i for i, d in enumerate(decisions) if not d] == [stale, 2 * stale + 1, 3 * stale + 2]
    # a wide lead: no plain probe
    wide = policy_drafting(2.0 * stale_plain)
    assert all(drafted_steps(wide, 4 * stale, 2.0 * stale_plain))


def test_cost_rule_drafts_only_on_a_margin_and_keeps_close_probes_within_a_wait():
    """Drafting must beat plain by `draft_margin`: measured sides within a few per cent of each
    other are within their noise, and plain decoding saves the propose. While the speculative
    side stays within `close_call` of plain, probes back off to `close_call_wait` at most (not
    to probe_max: the sides may swap; not kept at probe_every: a probe costs a propose)."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    r, gamma = 4, 7
    plain = r * flat(r)  # tokens/s: what the table models

    def policy_at(uniform_ratio: float):
        policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.002}))
        weak = torch.full((r, gamma), 0.05).cumprod(1)  # the ranked model does not pay
        for _ in range(2):
            policy.decide(weak, torch.full((r,), 1000))
        uniform_measured(policy, r, uniform_ratio * plain)
        for _ in range(DraftCost.RATE_MIN_STEPS):
            policy.draft_cost.observe_rate(r, False, plain, 1.0)
        return policy

    assert policy_at(1.02 * DSpark.draft_margin).wants_draft(r)
    assert not policy_at(0.99 * DSpark.draft_margin).wants_draft(r)
    for ratio, longest in ((0.95, DSpark.close_call_wait), (0.5, DSpark.probe_max)):
        policy = policy_at(ratio)
        decisions = [policy.wants_draft(r) for _ in range(2000)]
        probes = [i for i, d in enumerate(decisions) if d]
        waits = [b - a - 1 for a, b in zip([-1, *probes], probes)]
        assert waits[:3] == [16, 32, 64] and max(waits) == longest


def test_cost_rule_picks_the_shape_that_delivered_more():
    """Drafted steps take one of two shapes (`DSpark._pick_shape`): the ranked budget or one draft
    per request (uniform, as MTP-1). The first RATE_MIN_STEPS drafted steps at R are uniform (to
    measure it; the rates of a step arrive after the next step's shape is chosen: one more), then
    the shape whose rate is higher (uniform: measured; ranked: the model,
    corrected), with a step of the other after probe_every, 2x, 4x ... drafted steps. The shape is
    fixed before the step's survivals are seen: a uniform step's ℓ = min(cap, 1) whatever they
    are (non-anticipating, so lossless). Frozen costs: always ranked."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    r, gamma = 4, 7
    gen = torch.Generator().manual_seed(5)
    rem = torch.tensor([1000, 1000, 1000, 1])  # the last request may emit one token: cap 0
    spec_s, plain_s = 0.002 + 1 / flat(r + 1), 1 / flat(r)

    def run(uniform_gain: float, steps: int = 120, learn: bool = True):
        """Steps at random survivals; ranked steps deliver what the model predicts, uniform ones
        `uniform_gain` x that. -> (shape of each drafted step, policy)."""
        policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.002}, learn=learn))
        high = torch.full((r, gamma), 0.9).cumprod(1)
        for _ in range(2):
            policy.decide(high, rem)
        shapes, drafted = [], policy.wants_draft(r)
        for _ in range(steps):
            now = torch.rand(r, gamma, generator=gen).cumprod(1) ** 0.3
            lengths = policy.decide(now, rem)
            if policy.shape == "uniform":
                assert lengths.tolist() == [1, 1, 1, 0]
            gain = uniform_gain if policy.shape == "uniform" else 1.0
            tokens = policy.last_rates[0] * spec_s * gain if drafted else r
            if drafted:
                shapes.append(policy.shape)
            drafted, was = policy.wants_draft(r), drafted
            policy.observe_rate(r, was, tokens, spec_s if was else plain_s)
        return shapes, policy

    # a step's rate is reported after the rule chose the next step's shape: one more uniform step
    explore = DraftCost.RATE_MIN_STEPS + 1
    shapes, policy = run(1.5)
    assert shapes[:explore] == ["uniform"] * explore
    probes = [i for i, s in enumerate(shapes) if s == "ranked"]
    first = explore + policy.probe_every
    assert probes[:2] == [first, first + 1 + 2 * policy.probe_every]  # backing off
    assert policy.last_uniform_rate > policy.last_rates[1]
    shapes, policy = run(0.6)
    assert shapes[:explore] == ["uniform"] * explore
    later = shapes[explore:]
    assert later.count("uniform") <= 3 and len(later) > 100  # ranked, but for the probes
    assert policy.draft_cost.measured_rates()["uniform"][r] < policy.last_rates[1]
    # in doubt (the ranked rate within `draft_margin` of the uniform one), the uniform shape
    policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.002}))
    assert policy._pick_shape(r, 1.02 * 300.0, 300.0) == "uniform"
    assert policy._pick_shape(r, 1.05 * 300.0, 300.0) == "ranked"
    shapes, _ = run(1.5, learn=False)
    assert set(shapes) == {"ranked"}
    # no rate ever reported for the uniform steps: after its tries, ranked
    policy = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.002}))
    for _ in range(2):
        policy.decide(torch.full((r, gamma), 0.9).cumprod(1), rem)
    picked = []
    for _ in range(12):
        assert policy.wants_draft(r)
        policy.decide(torch.full((r, gamma), 0.9).cumprod(1), rem)
        picked.append(policy.shape)
    assert picked == ["uniform"] * explore + ["ranked"] * (12 - explore)


def test_warm_from_carries_the_learned_state_not_the_batch():
    """warm_from: a fresh policy takes over the survival curve, probe back-off and recalibration
    of a used one (so it decides like it at once), but not its t−1 / t−2 snapshots."""
    flat = SPSTable([1, 1024], [100.0, 99.0])
    r, gamma = 4, 5
    rem = torch.full((r,), 1000)
    low = torch.full((r, gamma), 0.05).cumprod(1)
    used = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.005}))
    uniform_measured(used, r)
    for _ in range(3):
        ells = used.decide(low, rem)
        used.observe_acceptance(low, ells, torch.zeros(r, dtype=torch.int64))
    assert not used.wants_draft(r)
    fresh = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=used.draft_cost)
    assert fresh.wants_draft(r)  # cold: no survival curve yet, so it drafts
    fresh.warm_from(used)
    assert not fresh.wants_draft(r) and not fresh._snapshots
    assert (fresh.recalibration() == used.recalibration()).all()
    fresh._profile[:] = 1.0  # a copy: the used policy's curve is untouched
    assert not used.wants_draft(r)
    # the measured drafting cost comes along too (a copy), unless a policy keeps fixed costs
    cold = make_policy("dspark", sps=flat, gamma=gamma)
    assert cold.draft_cost(r) is None
    cold.warm_from(used)
    assert cold.draft_cost(r) == 0.005 and cold.draft_cost is not used.draft_cost
    fixed = make_policy("dspark", sps=flat, gamma=gamma, draft_cost=DraftCost({r: 0.001}, learn=False))
    fixed.warm_from(used)
    assert fixed.draft_cost(r) == 0.001


def test_budget_with_drafting_counted_is_the_brute_force_argmax():
    """K_t maximises (R + S(K)) / (t_draft(R) + 1/SPS(R + K)) on the t−2 snapshot."""
    gen = torch.Generator().manual_seed(12)
    gamma = 5
    for trial in range(40):
        num_requests = int(torch.randint(1, 16, (1,), generator=gen))
        sps = random_jagged_sps(gen, num_requests * (gamma + 1))
        t_draft = float(torch.rand(1, generator=gen)) * 3 / sps.steps_per_second[0]
        snapshot = (torch.rand(num_requests, gamma, generator=gen) ** 0.5).cumprod(1)
        rem = torch.full((num_requests,), 100)
        policy = make_policy("dspark:delayed", sps=sps, gamma=gamma, max_batch_tokens=10_000,
                             draft_cost=DraftCost({num_requests: t_draft}))
        for survival in (snapshot, torch.rand(num_requests, gamma, generator=gen),
                         torch.rand(num_requests, gamma, generator=gen)):
            policy.decide(survival, rem)
        values = sorted(snapshot.reshape(-1).tolist(), reverse=True)
        theta = [(num_requests + sum(values[:k])) / (t_draft + 1 / sps(num_requests + k))
                 for k in range(len(values) + 1)]
        want = max(k for k, t in enumerate(theta) if t >= max(theta) * (1 - 1e-12))
        assert policy.last_budget == want, trial


def test_recalibration_follows_realised_acceptance():
    """dspark scales survivals by realised acceptance / predicted survival per survival level,
    learned from completed steps: a drafter that claims 0.9 but is never accepted loses its
    budget; one that is accepted as predicted keeps factors near 1."""
    buckets = list(range(1, 257))
    sps = SPSTable(buckets, [1000.0 / (1.0 + 0.05 * b) for b in buckets])
    r, gamma = 16, 4
    rem = torch.full((r,), 1000)
    claimed = torch.full((r, gamma), 0.9).cumprod(1)
    naive = make_policy("dspark:delayed", sps=sps, gamma=gamma)
    learned = make_policy("dspark:delayed", sps=sps, gamma=gamma)
    for _ in range(20):
        ells = learned.decide(claimed, rem)
        naive.decide(claimed, rem)
        learned.observe_acceptance(claimed, ells, torch.zeros(r, dtype=torch.int64))  # nothing accepted
    assert (learned.recalibration()[0] < 0.3).all() and learned.last_budget < naive.last_budget // 2
    honest = make_policy("dspark:delayed", sps=sps, gamma=gamma)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        ells = honest.decide(claimed, rem)
        n = (torch.rand(r, gamma, generator=gen) < 0.9).long().cumprod(1).sum(1)  # accepted as claimed
        honest.observe_acceptance(claimed, ells, torch.minimum(n, ells))
    assert abs(honest.recalibration()[0, -1] - 1.0) < 0.1  # 0.9 is in the top level


def test_recalibration_by_level_is_unbiased_under_censoring():
    """Drafts accepted 1.6x as often as their survival says (capped at 1), with weak rows verified
    only at their first two positions (censored, as a budget does): the factor at each verified
    level comes out ~1.6 whichever rows reached it, and the weak rows' unverified low levels take
    the nearest learned one, so their deep drafts are priced up too (not left at 1)."""
    gen = torch.Generator().manual_seed(3)
    policy = make_policy("dspark", sps=SPSTable([1, 64], [100.0, 50.0], device="cpu"), gamma=4)
    confident, weak = [0.8, 0.6, 0.45, 0.3], [0.3, 0.15, 0.08, 0.04]
    survival = torch.tensor([confident, weak] * 4)
    truth = (1.6 * survival).clamp(max=1.0)
    conditional = truth / torch.cat([torch.ones(8, 1), truth[:, :-1]], 1)
    lengths = torch.tensor([4, 2] * 4)
    for _ in range(400):
        accepted = (torch.rand(8, 4, generator=gen) < conditional).long().cumprod(1).sum(1)
        policy.observe_acceptance(survival, lengths, torch.minimum(accepted, lengths))
    f = policy.recalibrated(survival.numpy()) / survival.numpy()
    assert f[1, 0] == pytest.approx(1.6, abs=0.2) and f[1, 1] == pytest.approx(1.6, abs=0.2)  # 0.3, 0.15
    assert f[0, 2] == pytest.approx(1.6, abs=0.2)  # 0.45
    assert f[1, 2] == f[1, 3] == f[1, 1]  # 0.08, 0.04 never verified: the nearest learned level


def test_recalibration_per_source_and_tail():
    """Two drafter sources (a hybrid's trained drafter and lookups) err in opposite directions:
    each gets its own factors. A calibrated source keeps factor 1, and survival levels a source
    has not verified enough take its nearest learned level's factor (not 1)."""
    buckets = list(range(1, 257))
    sps = SPSTable(buckets, [1000.0 / (1.0 + 0.05 * b) for b in buckets])
    r, gamma = 8, 4
    claimed = torch.full((r, gamma), 0.5).cumprod(1)
    sources = torch.tensor([0, 1] * (r // 2))
    policy = make_policy("dspark", sps=sps, gamma=gamma)
    ells = torch.tensor([2, 4] * (r // 2))  # source 0 verified at positions 0..1 only
    accepted = torch.tensor([2, 0] * (r // 2))  # source 0 always accepted, source 1 never
    for _ in range(30):
        policy.observe_acceptance(claimed, ells, accepted, sources)
    a = claimed.numpy()
    f = policy.recalibrated(a, sources) / a
    assert f.shape == (r, gamma)
    assert (f[0, :2] > 1.5).all() and (f[1] < 0.2).all()
    assert f[0, 2] == f[0, 3] == f[0, 1]  # unverified levels (0.125, 0.0625): the nearest learned (0.25)
    assert (policy.recalibrated(a) / a == f[0]).all()  # no sources: source 0's
    policy.calibrated_sources = frozenset({1})
    assert (policy.recalibrated(a, sources)[1] == a[1]).all()


def test_draft_cost_interpolates_and_learns():
    cost = DraftCost({1: 0.002, 9: 0.010})
    assert cost(5) == pytest.approx(0.006) and cost(32) == pytest.approx(0.033) and cost(1) == 0.002
    cost.observe(1, 0.004)
    assert 0.002 < cost(1) < 0.004
    assert DraftCost()(4) is None
    frozen = DraftCost({1: 0.002}, learn=False)
    frozen.observe(1, 0.5)
    assert frozen(1) == 0.002


def test_step_costs_shrug_off_one_off_spikes():
    """The first step at a new R builds matmul primitives (tens of ms once): the first warm
    steps count by their minimum, later spikes by at most a few deviations above the average,
    while a lasting change still moves the estimate."""
    cost = DraftCost()
    for seconds in (0.040, 0.010, 0.011):  # a one-off 30 ms on the first step at R = 16
        cost.observe_overhead(16, True, seconds)
    assert cost.overhead(16, True) == pytest.approx(0.010)
    cost.observe_overhead(16, True, 0.500)  # a later spike
    assert cost.overhead(16, True) < 0.011
    for _ in range(60):  # the cost really went up
        cost.observe_overhead(16, True, 0.030)
    assert cost.overhead(16, True) > 0.028


def test_appendix_a_example_retrospective_admits_only_when_future_is_confident():
    """SPS(1, 2, 3) = (1, 0.5, 0.45), R = 1, γ = 2 (docs/architecture.md §6): Algorithm 1 never drafts,
    the retrospective search drafts both tokens exactly when a1 + a2 > 1/0.45 − 1."""
    sps = SPSTable([1, 2, 3], [1.0, 0.5, 0.45])
    rem = torch.tensor([10])
    for c1, c2 in [(0.9, 0.9), (0.9, 0.2), (0.6, 0.99), (1.0, 1.0)]:
        a = torch.tensor([[c1, c1 * c2]])
        assert make_policy("dspark-theory", sps=sps, gamma=2).decide(a, rem).tolist() == [0]
        want = 2 if c1 + c1 * c2 > 1 / 0.45 - 1 + 1e-9 else 0
        assert make_policy("retrospective", sps=sps, gamma=2).decide(a, rem).tolist() == [want]
    assert math.isclose(1 / 0.45 - 1, 1.2222, rel_tol=1e-4)


def test_empty_batch_and_reset():
    policy = make_policy("dspark:delayed", sps=SPSTable.gpu_shaped())
    assert policy.decide(torch.zeros(0, 7), torch.zeros(0, dtype=torch.int64)).numel() == 0
    policy.decide(torch.ones(2, 7), torch.tensor([100, 100]))
    policy.reset()
    assert policy.last_budget == 0
    assert policy.decide(torch.ones(2, 7), torch.tensor([100, 100])).tolist() == [1, 1]  # K = R again


def test_unknown_spec_and_missing_sps():
    with pytest.raises(ValueError, match="dspark variant"):
        make_policy("dspark:bogus", sps=SPSTable.gpu_shaped())
    with pytest.raises(ValueError):
        make_policy("fastest")
    with pytest.raises(ValueError):
        make_policy("dspark")


def test_dspark_budget_is_the_largest_global_argmax():
    """The bucket-top shortcut and the resampling path agree with a brute-force argmax."""
    gen = torch.Generator().manual_seed(7)
    gamma = 5
    for trial in range(60):
        num_requests = int(torch.randint(1, 20, (1,), generator=gen))
        sps = random_jagged_sps(gen, num_requests * (gamma + 1) + (0 if trial % 2 else -3))
        snapshot = (torch.rand(num_requests, gamma, generator=gen) ** 0.5).cumprod(1)
        snapshot[0, -1] = 0.0  # exact ties in Θ: the largest K wins
        rem = torch.full((num_requests,), 100)
        policy = make_policy("dspark:delayed", sps=sps, gamma=gamma, max_batch_tokens=10_000)
        policy.decide(snapshot, rem)
        policy.decide(torch.rand(num_requests, gamma, generator=gen), rem)
        policy.decide(torch.rand(num_requests, gamma, generator=gen), rem)
        values = sorted(snapshot.reshape(-1).tolist(), reverse=True)
        theta = [(num_requests + sum(values[:k])) * sps(num_requests + k) for k in range(len(values) + 1)]
        best = max(theta)
        want = max(k for k, t in enumerate(theta) if t >= best * (1 - 1e-12))
        assert policy.last_budget == want, trial


def _brute_theta(values: list[float], num_requests: int, sps: SPSTable) -> list[float]:
    ranked = sorted(values, reverse=True)
    return [(num_requests + sum(ranked[:k])) * sps(num_requests + k) for k in range(len(ranked) + 1)]


def _brute_walk(theta: list[float]) -> int:
    k = 0
    while k + 1 < len(theta) and theta[k + 1] > theta[k]:
        k += 1
    return k


def test_dspark_budget_rule_against_brute_force():
    """dspark's K: the walk on current survivals alone when, on the t−2 snapshot, the walk gets
    within 1 % of the global argmax's Θ; else max(K_t, walk). Brute force over all K."""
    gen = torch.Generator().manual_seed(11)
    gamma = 6
    seen = {"walk only": 0, "raised by walk": 0, "delayed": 0}
    for trial in range(120):
        num_requests = int(torch.randint(1, 30, (1,), generator=gen))
        sps = random_jagged_sps(gen, num_requests * (gamma + 1)) if trial % 2 else cliff_sps(
            gen, num_requests, num_requests * (gamma + 1))
        rem = torch.full((num_requests,), 100)
        powers = (2.0, 0.4, 0.05) if trial % 3 == 0 else (0.4, 0.4, 0.4)  # some: unconfident t−2
        steps = [(torch.rand(num_requests, gamma, generator=gen) ** p).cumprod(1) for p in powers]
        policy = make_policy("dspark", sps=sps, gamma=gamma, max_batch_tokens=10_000)
        for survival in steps:
            out = policy.decide(survival, rem)
        snap = _brute_theta(steps[0].reshape(-1).tolist(), num_requests, sps)
        best = max(snap)
        k_t = max(k for k, t in enumerate(snap) if t >= best * (1 - 1e-12))
        k_w_snap = _brute_walk(snap)
        walk_now = _brute_walk(_brute_theta(steps[2].reshape(-1).tolist(), num_requests, sps))
        if k_w_snap >= k_t or snap[k_w_snap] >= 0.99 * snap[k_t]:
            want, case = walk_now, "walk only"
        else:
            want = max(k_t, walk_now)
            case = "raised by walk" if walk_now > k_t else "delayed"
        assert policy.last_budget == want, trial
        assert int(out.sum()) == want
        seen[case] += 1
    assert all(n > 0 for n in seen.values()), seen  # every branch is exercised


def test_walk_on_partial_sorts_matches_full_walk():
    """Algorithm 1's incremental walk (top-m sorts, m growing) equals the walk on a full sort."""
    gen = torch.Generator().manual_seed(5)
    flat = SPSTable([1, 4096], [100.0, 99.99])  # near-flat: the walk goes far (several m rounds)
    for trial in range(20):
        num_requests = int(torch.randint(20, 200, (1,), generator=gen))
        a = (torch.rand(num_requests, 8, generator=gen) ** 0.2).cumprod(1)
        a[a < 0.05] = 0.0
        rem = torch.full((num_requests,), 100)
        policy = make_policy("dspark-theory", sps=flat, gamma=8)
        policy.decide(a, rem)
        values = sorted(a.reshape(-1).tolist(), reverse=True)
        theta = [(num_requests + sum(values[:k])) * flat(num_requests + k) for k in range(len(values) + 1)]
        k = 0
        while k < len(values) and theta[k + 1] > theta[k]:
            k += 1
        assert policy.last_budget == k, trial


def test_top_sums_binned_equals_sorted_prefix_sums():
    """The O(n) binned top-K sums (dspark's delayed budget) equal sorted prefix sums, including
    values packed in one bin (partial-bin partitions) and exact ties."""
    import numpy as np

    from dspark.runtime.ranking import _top_sums

    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 300))
        values = rng.random(n).astype(np.float32)
        if trial % 3 == 0:
            values = (np.round(values * 4) / 4).astype(np.float32)
        if trial % 5 == 0:
            values = (np.float32(0.9999) + rng.random(n) * 1e-4).astype(np.float32)
        ks = np.unique(rng.integers(1, n + 1, size=5)).astype(np.int64)
        want = np.cumsum(np.sort(values.astype(np.float64))[::-1])[ks - 1]
        np.testing.assert_allclose(_top_sums(values, ks), want, rtol=1e-12, atol=1e-12)


def test_policy_kernels_equal_their_numpy_reference():
    """`dspark.runtime.policy_kernels` compute what the numpy they replaced computed, bit for bit
    (recalibration sums and factors, the drafted step's rate model, the rule's best rate), and
    `sps.solve3` what numpy's solve does."""
    from dspark.runtime import policy_kernels as pk
    from dspark.runtime.sps import solve3

    rng = np.random.default_rng(7)
    levels = Policy.LEVELS
    for trial in range(30):
        r, gamma, sources_n = int(rng.integers(1, 20)), int(rng.integers(1, 9)), 4
        a = np.sort(rng.random((r, gamma)).astype(np.float32), axis=1)[:, ::-1].copy()
        a[rng.random((r, gamma)) < 0.1] = 0.0
        lengths = rng.integers(0, gamma + 2, r).astype(np.int64)
        accepted = rng.integers(0, gamma + 1, r).astype(np.int64)
        sources = rng.integers(0, 6, r).astype(np.int64)
        predicted, hits = rng.random((sources_n, len(levels))) * 8, rng.random((sources_n, len(levels))) * 4
        want_p, want_h = predicted * 0.99, hits * 0.99
        # reference: the numpy observe_acceptance
        a64, j = a.astype(np.float64), np.arange(gamma)[None, :]
        verified = j < lengths[:, None]
        hit = verified & (j < accepted[:, None])
        rows = np.broadcast_to(np.clip(sources, 0, sources_n - 1)[:, None], a.shape)
        cell = (rows * len(levels) + np.searchsorted(levels, a64, side="right") - 1)[verified]
        want_p += np.bincount(cell, a64[verified], want_p.size).reshape(want_p.shape)
        want_h += np.bincount(cell, hit[verified], want_h.size).reshape(want_h.shape)
        pk.recal_observe(a, lengths, accepted, sources, levels, predicted, hits, 0.99)
        assert np.array_equal(predicted, want_p) and np.array_equal(hits, want_h), trial
        # reference: the numpy recalibration (factors) and recalibrated (applied)
        calibrated = rng.random(sources_n) < 0.3
        ratio = np.divide(hits + 1.0, predicted + 1.0, out=np.ones_like(predicted), where=predicted > 0)
        learned = predicted >= 4.0
        factors = np.where(learned, np.clip(ratio, 0.05, 4.0), 1.0)
        distance = np.abs(np.arange(len(levels))[:, None] - np.arange(len(levels))[None, :]).astype(float)
        distance = np.where(learned[:, None, :], distance[None], np.inf)
        factors = np.take_along_axis(factors, distance.argmin(-1), axis=1)
        factors[calibrated] = 1.0
        got = pk.recal_factors(predicted, hits, 4.0, 0.05, 4.0, calibrated)
        assert np.array_equal(got, factors), trial
        applied = a * factors[rows, np.searchsorted(levels, a64, side="right") - 1].astype(np.float32)
        assert np.array_equal(pk.recal_apply(a, sources, levels, got), applied), trial
        # reference: the numpy Policy.step_rate and the rule's best speculative rate
        sps = np.sort(rng.random(int(rng.integers(2, 200))) * 100 + 1)[::-1].copy()
        k_a, k_b, k_c, fixed = rng.random(4) * 2
        price = 1.0 / sps[:r * (gamma + 1) + 1]
        base = price[min(r, len(price) - 1)]
        knee = price.copy()
        knee[2 * r + 1:] = price[min(2 * r, len(price) - 1)]
        want_rates = 1.0 / np.maximum(fixed + (k_a * base + k_b * (knee - base) + k_c * (price - knee)), 1e-6)
        rates = pk.drafted_step_rates(sps, r, gamma, k_a, k_b, k_c, fixed, 1e-6)
        assert np.array_equal(rates, want_rates), trial
        profile = np.sort(rng.random(256))[::-1].copy()
        room = min(len(rates) - 1 - r, r * gamma)
        if room >= 1:
            n = r * gamma
            ranked = profile[(2 * np.arange(n) + 1) * 256 // (2 * n)]
            gains = np.cumsum(ranked[:room], dtype=np.float64)
            want = float(np.max((r + gains) * rates[r + 1:r + room + 1]))
            assert pk.best_speculative_rate(profile, r, gamma, room, rates) == want, trial
        m = rng.normal(size=(3, 3))
        m, y = m @ m.T + np.eye(3) * rng.random(), rng.normal(size=3)
        assert np.allclose(solve3(m.tolist(), y.tolist()), np.linalg.solve(m, y), rtol=1e-9, atol=1e-12)
