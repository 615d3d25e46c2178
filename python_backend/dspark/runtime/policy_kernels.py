"""Compiled per-step bookkeeping of the production policy (docs/architecture.md §7): the online
recalibration's sums and factors and the drafting-cost rule's rate model, as numba kernels.

Why compiled, when each is a handful of numpy calls: the policy runs right after the target's
forward has streamed every weight through the caches, so its code and data start cold. As numpy
(a dozen calls each, every one its own stretch of library code) the policy's calls took 0.71 ms a
step at 8 requests on SmolLM2 when run after a 300 MB sweep, against 0.15 ms warm; one compiled
loop per call touches a few KB of machine code. Same arithmetic as the numpy it replaces, in the
same order (`tests/test_scheduler.py` checks them against it).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _level(levels: np.ndarray, v: float) -> int:
    """Index of the bin of `levels` (ascending left edges, levels[0] = 0) that holds v."""
    i = int(np.searchsorted(levels, v, side="right")) - 1
    return 0 if i < 0 else i


@njit(cache=True)
def recal_observe(a: np.ndarray, lengths: np.ndarray, accepted: np.ndarray, sources: np.ndarray,
                  levels: np.ndarray, predicted: np.ndarray, hits: np.ndarray, decay: float) -> None:
    """One step into the decayed sums (in place): a [R, γ] f32 survivals given to the policy,
    lengths [R] ℓ verified, accepted [R], sources [R] i64 (larger ids share the last row), levels
    [L] f64; predicted / hits [sources, L] f64. The decayed sums plus the step's own: per
    (source, level) cell, a[r, j] summed over its verified (r, j) in (r, j) order, and
    1[accepted_r > j]"""
    step_predicted, step_hits = np.zeros_like(predicted), np.zeros_like(hits)
    for r in range(a.shape[0]):
        s = min(max(sources[r], 0), predicted.shape[0] - 1)
        for j in range(min(lengths[r], a.shape[1])):
            v = float(a[r, j])
            cell = _level(levels, v)
            step_predicted[s, cell] += v
            if j < accepted[r]:
                step_hits[s, cell] += 1.0
    predicted *= decay
    hits *= decay
    predicted += step_predicted
    hits += step_hits


@njit(cache=True)
def recal_factors(predicted: np.ndarray, hits: np.ndarray, min_mass: float, lo: float, hi: float,
                  calibrated: np.ndarray) -> np.ndarray:
    """Factors [sources, L]: (hits + 1) / (predicted + 1) within [lo, hi] where a level has
    `min_mass` of predicted survival, else the nearest such level's (the lower one on a tie; 1
    where the source has none); 1 for the sources flagged in `calibrated` [sources] bool."""
    sources, num_levels = predicted.shape
    out = np.ones((sources, num_levels))
    for s in range(sources):
        if calibrated[s]:
            continue
        for level in range(num_levels):
            best, dist = -1, num_levels + 1
            for other in range(num_levels):
                if predicted[s, other] >= min_mass and abs(level - other) < dist:
                    best, dist = other, abs(level - other)
            if best >= 0 and predicted[s, best] > 0.0:
                ratio = (hits[s, best] + 1.0) / (predicted[s, best] + 1.0)
                out[s, level] = min(max(ratio, lo), hi)
    return out


@njit(cache=True)
def recal_apply(survival: np.ndarray, sources: np.ndarray, levels: np.ndarray,
                factors: np.ndarray) -> np.ndarray:
    """survival [R, γ] f32 · its row's source's factor at its level -> [R, γ] f32 (sources [R]
    i64: larger ids share the last row of factors)."""
    out = np.empty_like(survival)
    for r in range(survival.shape[0]):
        s = int(min(max(sources[r], 0), factors.shape[0] - 1))
        for j in range(survival.shape[1]):
            v = survival[r, j]
            out[r, j] = v * np.float32(factors[s, _level(levels, float(v))])
    return out


@njit(cache=True)
def drafted_step_rates(sps: np.ndarray, num_requests: int, gamma: int, a: float, b: float, c: float,
                       fixed_s: float, min_step_s: float) -> np.ndarray:
    """Steps/second by token batch B = 0..R·(γ+1) (at most len(sps) − 1) of a drafted step of R
    requests: 1 / (fixed_s + a·p(R) + b·(p(min(B, 2R)) − p(R)) + c·(p(B) − p(min(B, 2R)))),
    p = 1 / sps (`Policy.step_rate`), each time at least min_step_s."""
    n = min(num_requests * (gamma + 1) + 1, sps.shape[0])
    base = 1.0 / sps[min(num_requests, n - 1)]
    knee_at = 1.0 / sps[min(2 * num_requests, n - 1)]
    out = np.empty(n)
    for i in range(n):
        price = 1.0 / sps[i]
        knee = price if i <= 2 * num_requests else knee_at
        t = fixed_s + (a * base + b * (knee - base) + c * (price - knee))
        out[i] = 1.0 / max(t, min_step_s)
    return out


@njit(cache=True)
def best_speculative_rate(profile: np.ndarray, num_requests: int, gamma: int, room: int,
                          rates: np.ndarray) -> float:
    """max over K = 1..room of (R + Σ_{i<K} ranked_i) · rates[R + K], tokens/s: ranked = the
    average survival curve `profile` [P] read at the centres of R·γ equal quantiles (descending),
    rates by B (`drafted_step_rates`)."""
    n = num_requests * gamma
    points = profile.shape[0]
    gains, best = 0.0, -np.inf
    for k in range(room):
        gains += profile[(2 * k + 1) * points // (2 * n)]
        best = max(best, (num_requests + gains) * rates[num_requests + k + 1])
    return best


_warm = False


def warm_up() -> None:
    """Compile (or load from the cache) every kernel once per process, outside any timed path."""
    global _warm
    if _warm:
        return
    levels = np.array([0.0, 0.5])
    a = np.full((1, 2), 0.6, np.float32)
    one = np.ones(1, np.int64)
    sums = np.zeros((1, 2))
    recal_observe(a, one, one, np.zeros(1, np.int64), levels, sums, sums.copy(), 0.9)
    factors = recal_factors(sums, sums, 1.0, 0.05, 4.0, np.zeros(1, np.bool_))
    recal_apply(a, np.zeros(1, np.int64), levels, factors)
    rates = drafted_step_rates(np.linspace(2.0, 1.0, 8), 1, 2, 1.0, 1.0, 1.0, 0.001, 1e-6)
    best_speculative_rate(np.linspace(1.0, 0.0, 4), 1, 2, 2, rates)
    _warm = True
