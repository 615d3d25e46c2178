"""Non-anticipation harness on the paper's Appendix A setup (docs/architecture.md §6).

Setup (one request per step, γ = 2, vocabulary {a, b} = {0, 1}):
  target p_t = (0.7, 0.3) and drafter p_d = (0.5, 0.5) at every position;
  SPS(1, 2, 3) = (1, 0.5, 0.45) steps/second at token batch size B = 1 + ℓ.
The tiny drafter's confidence head sees the previous token, like docs/architecture.md §5's
c_k = σ(wᵀ[h_k; W1[x_{k−1}]] + b): c_1 = 0.8 = Σ_v min(p_t, p_d) (from the anchor) and
c_{k+1} = CONF_AFTER[d_k] = (1.0, 0.5): after an `a` (accepted w.p. 1) it is confident, after
a `b` (accepted w.p. 0.6) it is not. Survival a_j = Π_{i≤j} c_i, so a_2 is computed from d_1.

Derivation of the bias. Θ(ℓ) = (1 + Σ_{j≤ℓ} a_j) · SPS(1 + ℓ): Θ(0) = 1, Θ(1) = 0.9 < 1, so
verifying d_1 alone never pays; Θ(2) = 0.45 · (1.8 + 0.8 · c_2) is 1.17 after `a` and 0.99
after `b`. The retrospective policy (argmax over ℓ after seeing all confidences) therefore
verifies d_1 exactly when d_1 = a, which is then always accepted; after d_1 = b it verifies
nothing and the target samples (0.7, 0.3). First token: P(a) = 0.5 · 1 + 0.5 · 0.7 = 0.85,
i.e. (0.85, 0.15) instead of (0.7, 0.3). Policies that decide on d_j from d_{<j} only (fixed
lengths, threshold, dspark-theory's early stop, dspark's t−2 budget) emit (0.7, 0.3).

Drafting cost (architecture §7): "dspark+cost:X" is dspark with a drafting step of X seconds
(a verify step costs 1 / SPS). Before each step it decides, from the survivals of steps up to
t−2 only (their average curve: a_1 = 0.8, a_2 ≈ 0.6), whether drafting pays at all: for X = 0.05
Θ(2) = (1 + 0.8 + 0.6) / (0.05 + 1/0.45) ≈ 1.06 > 1 = plain, so it drafts; for X = 0.3 it is
0.95 < 1 and it runs plain steps, drafting every 16th step to keep the average fresh. Whether a
step drafts depends on old tokens only, so the output stays (0.7, 0.3) either way.
"dspark+cost:X+rates" also reports each step's outcome back to the rule (`Policy.observe_rate`:
tokens emitted, and X + 1/SPS(1 + ℓ) seconds drafted or 1/SPS(1) plain), whose measured rates
then correct its model (architecture §7): the steps run one at a time, each verified before the
next decides, so the rule reads what past steps' tokens were, never the current step's. Here the
drafted steps deliver about plain's rate (ℓ = 2 gains what ℓ = 0 and 1 lose), so it learns to
draft far less than the model alone; the output stays (0.7, 0.3).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from dspark.runtime.sampling import SamplingBatch, SamplingParams
from dspark.runtime.verify import verify_ragged

P_TARGET = (0.7, 0.3)
P_DRAFT = (0.5, 0.5)
SPS_TABLE = {1: 1.0, 2: 0.5, 3: 0.45}
GAMMA = 2
CONF_FIRST = 0.8
CONF_AFTER = (1.0, 0.5)
BUILTIN = ("retrospective", "none", "fixed:1", "fixed:2")
SCHEDULER = ("mtp1", "threshold:0.7", "dspark-theory", "dspark", "dspark+cost:0.05", "dspark+cost:0.3",
             "dspark+cost:0.05+rates", "dspark+cost:0.3+rates")


def draft(num: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """num independent steps of the tiny drafter -> tokens [num, γ], survival [num, γ]."""
    tokens = torch.multinomial(torch.tensor(P_DRAFT), num * GAMMA, replacement=True, generator=g)
    tokens = tokens.view(num, GAMMA)
    conf = torch.empty(num, GAMMA)
    conf[:, 0] = CONF_FIRST
    conf[:, 1:] = torch.tensor(CONF_AFTER)[tokens[:, :-1]]  # c_{k+1} is computed from d_k
    return tokens, conf.cumprod(1)


def retrospective_lengths(survival: torch.Tensor) -> torch.Tensor:
    """NEGATIVE CONTROL: ℓ = argmax_ℓ Θ(ℓ) after seeing all confidences, so the decision on
    d_j uses a_{j+1}, computed from d_j. Vectorised over independent single-request steps."""
    gains = torch.cat([torch.zeros(survival.shape[0], 1), survival.cumsum(1)], dim=1)  # Σ_{j≤ℓ} a_j
    sps = torch.tensor([SPS_TABLE[1 + l] for l in range(GAMMA + 1)])
    return ((1 + gains) * sps).argmax(1)


def make_scheduler_policy(spec: str):
    """A dspark.runtime.scheduler policy for a spec ("dspark+cost:X[+rates]": drafting costs X s)."""
    from dspark.runtime.scheduler import make_policy
    from dspark.runtime.sps import DraftCost, SPSTable

    sps = SPSTable(list(SPS_TABLE), list(SPS_TABLE.values()), device="appendix-a", model="appendix-a")
    name, _, cost = spec.removesuffix("+rates").partition("+cost:")
    return make_policy(name, sps=sps, gamma=GAMMA, max_batch_tokens=1 + GAMMA,
                       draft_cost=DraftCost({1: float(cost)}) if cost else None)


def run_with_rates(spec: str, tokens: torch.Tensor, survival: torch.Tensor,
                   g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """"dspark+cost:X+rates": one step at a time, verified before the next decides, its emitted
    tokens and modelled time reported to the rule. -> (ℓ [num], first emitted tokens [num])."""
    policy = make_scheduler_policy(spec)
    x = policy.draft_cost(1)  # the spec's drafting cost (the harness never reports a propose)
    remaining = torch.tensor([1 << 20])
    lengths = torch.zeros(tokens.shape[0], dtype=torch.int64)
    first = torch.zeros_like(lengths)
    for i in range(tokens.shape[0]):
        drafted = policy.wants_draft(1)
        ell = policy.decide(survival[i : i + 1], remaining) if drafted else torch.zeros(1, dtype=torch.int64)
        out = verify_step(tokens[i : i + 1], ell, g)
        lengths[i], first[i] = ell[0], out.tokens[0, 0]
        seconds = x + 1.0 / SPS_TABLE[1 + int(ell[0])] if drafted else 1.0 / SPS_TABLE[1]
        policy.observe_rate(1, drafted, int(out.num_accepted[0]) + 1, seconds)
    return lengths, first


def policy_lengths(spec: str, survival: torch.Tensor) -> torch.Tensor:
    """ℓ per step for a built-in spec or a dspark.runtime.scheduler policy (one request per step, run
    in order so history-based policies see steps t−1, t−2 as in serving)."""
    num = survival.shape[0]
    if spec == "retrospective":
        return retrospective_lengths(survival)
    if spec == "none":
        return torch.zeros(num, dtype=torch.int64)
    if spec.startswith("fixed:"):
        return torch.full((num,), min(int(spec.split(":")[1]), GAMMA), dtype=torch.int64)
    policy = make_scheduler_policy(spec)
    remaining = torch.tensor([1 << 20])
    skip = torch.zeros(1, dtype=torch.int64)  # a plain step: the cost rule said drafting does not pay
    return torch.cat([policy.decide(survival[i : i + 1], remaining) if policy.wants_draft(1) else skip
                      for i in range(num)])


def first_tokens(tokens: torch.Tensor, lengths: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Verify every step (one ragged call, docs/architecture.md §6) and return the first emitted token."""
    return verify_step(tokens, lengths, g).tokens[:, 0]


def verify_step(tokens: torch.Tensor, lengths: torch.Tensor, g: torch.Generator):
    """verify_ragged on independent single-request steps -> its VerifyResult."""
    num = tokens.shape[0]
    cu = torch.zeros(num + 1, dtype=torch.int64)
    cu[1:] = (lengths + 1).cumsum(0)
    logits = torch.tensor(P_TARGET).log().expand(int(cu[-1]), 2)
    draft_probs = torch.tensor(P_DRAFT).expand(int(lengths.sum()), 2)  # flat: one row per verified draft
    uniforms = torch.rand(num, GAMMA + 1, generator=g)
    sampling = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * num)
    return verify_ragged(logits, tokens, lengths, cu, sampling, draft_probs, uniforms)


def run(samples: int, seed: int, policies: list[str]) -> dict:
    """Output distribution of the first token per policy, with 95% normal intervals."""
    g = torch.Generator().manual_seed(seed)
    tokens, survival = draft(samples, g)
    result = {"samples": samples, "seed": seed, "expected": list(P_TARGET),
              "setup": {"p_target": P_TARGET, "p_draft": P_DRAFT, "sps": SPS_TABLE, "gamma": GAMMA,
                        "conf_first": CONF_FIRST, "conf_after_token": CONF_AFTER},
              "output_distribution": {}, "ci95": {}, "mean_verify_len": {}, "z_vs_target": {}}
    for spec in policies:
        if spec.endswith("+rates"):
            lengths, first = run_with_rates(spec, tokens, survival, g)
        else:
            lengths = policy_lengths(spec, survival)
            first = first_tokens(tokens, lengths, g)
        p_a = float((first == 0).float().mean())
        half = 1.96 * math.sqrt(max(p_a * (1 - p_a), 1e-12) / samples)
        result["output_distribution"][spec] = [p_a, 1 - p_a]
        result["ci95"][spec] = [[p_a - half, p_a + half], [1 - p_a - half, 1 - p_a + half]]
        result["mean_verify_len"][spec] = float(lengths.float().mean())
        result["z_vs_target"][spec] = (p_a - P_TARGET[0]) / math.sqrt(P_TARGET[0] * P_TARGET[1] / samples)
    return result


def available_policies() -> list[str]:
    try:
        import dspark.runtime.scheduler  # noqa: F401
    except ModuleNotFoundError:
        return list(BUILTIN)  # hook: scheduler policies join once dspark.runtime.scheduler exists
    return list(BUILTIN) + list(SCHEDULER)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dspark.paths import RESULTS

    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=None, help="comma list (default: built-ins + scheduler policies)")
    p.add_argument("--out", default=str(RESULTS / "appendix_a.json"))


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    policies = args.policies.split(",") if args.policies else available_policies()
    result = run(args.samples, args.seed, policies)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for spec in policies:
        lo, hi = result["ci95"][spec][0]
        print(f"{spec:>16}: P(first = a) = {result['output_distribution'][spec][0]:.4f} "
              f"[{lo:.4f}, {hi:.4f}]  mean ℓ = {result['mean_verify_len'][spec]:.3f}  "
              f"z = {result['z_vs_target'][spec]:+.1f}")
    print(f"wrote {args.out}")
    return 0
