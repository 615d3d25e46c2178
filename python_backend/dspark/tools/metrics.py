"""Offline drafter metrics (docs/architecture.md §9): calibration (ECE, reliability data), ranking
quality (AUROC), per-position conditional acceptance and mean accepted length τ.

Everything takes plain sequences / numpy arrays / tensors and returns Python floats or
lists, so results serialise straight to JSON."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ECE_BINS = 20  # docs/architecture.md §9: 20 equal-width bins


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double().numpy().reshape(-1)
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _bin_index(conf: np.ndarray, n_bins: int) -> np.ndarray:
    """Bin b covers [b/n, (b+1)/n); the last bin also holds conf == 1."""
    return np.clip(np.floor(conf * n_bins).astype(np.int64), 0, n_bins - 1)


def ece(conf, outcome, n_bins: int = ECE_BINS) -> float:
    """Expected calibration error: Σ_b |B_b|/N · |mean conf_b − mean outcome_b|.
    conf in [0, 1], outcome in {0, 1} (or a probability); nan when empty."""
    c, y = _np(conf), _np(outcome)
    if c.shape != y.shape:
        raise ValueError(f"conf and outcome differ in size: {c.shape} vs {y.shape}")
    if c.size == 0:
        return float("nan")
    b = _bin_index(c, n_bins)
    gap = np.abs(np.bincount(b, weights=c, minlength=n_bins) - np.bincount(b, weights=y, minlength=n_bins))
    # Σ_b |B_b|/N · |mean c − mean y| = Σ_b |Σ_{i∈b} c_i − Σ_{i∈b} y_i| / N
    return float(gap.sum() / c.size)


def reliability(conf, outcome, n_bins: int = ECE_BINS) -> dict[str, list]:
    """Reliability-diagram data per equal-width bin: centre, count, mean confidence and
    observed frequency (None for empty bins)."""
    c, y = _np(conf), _np(outcome)
    b = _bin_index(c, n_bins)
    count = np.bincount(b, minlength=n_bins)
    sum_c = np.bincount(b, weights=c, minlength=n_bins)
    sum_y = np.bincount(b, weights=y, minlength=n_bins)
    mean_c = [float(s / n) if n else None for s, n in zip(sum_c, count)]
    freq = [float(s / n) if n else None for s, n in zip(sum_y, count)]
    centres = [(i + 0.5) / n_bins for i in range(n_bins)]
    return {"bin_centre": centres, "count": count.tolist(), "mean_conf": mean_c, "frequency": freq}


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x with ties given their average rank."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    ranks = np.empty(x.size, dtype=np.float64)
    # boundaries of runs of equal values in the sorted order
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], x.size]
    avg = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def auroc(scores, labels) -> float:
    """Area under the ROC curve = P(score_pos > score_neg) + ½ P(tie), via the
    Mann-Whitney rank sum with average ranks for ties; nan if a class is missing."""
    s, y = _np(scores), _np(labels) > 0.5
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    r = _average_ranks(s)
    return float((r[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x) without overflow for large |x|."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def survival(conf_logits: torch.Tensor,
             temperatures: Sequence[float] | torch.Tensor | None = None) -> torch.Tensor:
    """STS survival â_k = Π_{i≤k} σ(z_i / T_i) (docs/architecture.md §2, §8) for logits [..., γ];
    temperatures [≥γ] (None = all 1)."""
    z = conf_logits.double()
    g = z.shape[-1]
    if temperatures is None:
        t = torch.ones(g, dtype=torch.float64)
    else:
        t = torch.as_tensor(temperatures, dtype=torch.float64)[:g]
        if t.numel() < g:
            raise ValueError(f"{t.numel()} temperatures for {g} positions")
    return torch.sigmoid(z / t).cumprod(-1)


def conditional_acceptance(n_accepted, n_verified, gamma: int) -> dict[str, list]:
    """Per position k = 1..γ: P(d_k accepted | d_<k accepted) over drafted blocks.
    A block with ℓ verified and n accepted (n ≤ ℓ) reaches position k if k ≤ ℓ and
    n ≥ k−1, and accepts it if n ≥ k. Returns rates (None where unreached) and counts."""
    n = _np(n_accepted).astype(np.int64)
    ell = _np(n_verified).astype(np.int64)
    if n.shape != ell.shape:
        raise ValueError("n_accepted and n_verified differ in size")
    if (n > ell).any():
        raise ValueError("a block accepted more tokens than it verified")
    k = np.arange(1, gamma + 1)[:, None]
    reached = ((ell[None, :] >= k) & (n[None, :] >= k - 1)).sum(1)
    accepted = (n[None, :] >= k).sum(1)
    rate = [float(a / r) if r else None for a, r in zip(accepted, reached)]
    return {"rate": rate, "reached": reached.tolist(), "accepted": accepted.tolist()}


def tau(tokens_emitted: int | float, verify_steps: int | float) -> float:
    """Mean accepted length τ = emitted tokens / target verify steps, the bonus (or
    corrected) token included (docs/architecture.md §9); nan with no steps."""
    return float(tokens_emitted) / float(verify_steps) if verify_steps else float("nan")
