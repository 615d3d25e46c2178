"""Compiled hot path of the scheduler (docs/architecture.md §7): caps, the candidate ranking, top-K
admission and the Θ budgets, as numba kernels over a γ-major survival matrix a [γ, R].

Why compiled: one `decide` for R = 256, γ = 16 touches 4096 candidates a few times; as
numpy it is ~30 small ops of 4–15 µs each on this CPU, compiled it is a few tight loops.
`cache=True` keeps the machine code in __pycache__, so only the first process on a machine
pays the compile (a few seconds).

Ranking (every policy): candidates (r, j) by a[j, r] descending, ties by j, then r. The
key (bits(1) − bits(a)) << 32 | j << 16 | r is unique and ascending in that order (for
a ∈ [0, 1] the IEEE-754 bits are monotone in a), so "the first K of the ranking" is the K
smallest keys. Because a is non-increasing in j, (r, j) ranks before (r, j+1): the first K
are prefix-closed per request and ℓ_r = how many of them are in row r."""

from __future__ import annotations

import numpy as np
from numba import njit

ONE_BITS = 0x3F800000  # IEEE-754 bits of 1.0f


@njit(cache=True)
def prepare(survival: np.ndarray, remaining: np.ndarray, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """survival [R, ≥γ] f32, remaining [R] i64 -> (a [γ, R] f32 in [0, 1] and non-increasing
    in j (NaN -> 0), cap [R] i64 = min(γ, remaining − 1) clipped at 0: ℓ_r ≤ cap_r)."""
    num_requests = survival.shape[0]
    a = np.empty((gamma, num_requests), np.float32)
    cap = np.empty(num_requests, np.int64)
    for r in range(num_requests):
        prev = np.float32(1.0)
        for j in range(gamma):
            v = survival[r, j]
            if not v > 0.0:  # negative, -0.0 or NaN
                v = np.float32(0.0)
            if v > prev:
                v = prev
            a[j, r] = v
            prev = v
        c = remaining[r] - 1
        cap[r] = 0 if c < 0 else min(c, gamma)
    return a, cap


@njit(cache=True)
def zero_capped(a: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Copy of a [γ, R] with capped-out candidates (j ≥ cap_r) set to 0: the step's snapshot."""
    out = a.copy()
    for j in range(a.shape[0]):
        for r in range(a.shape[1]):
            if j >= cap[r]:
                out[j, r] = 0.0
    return out


@njit(cache=True)
def _keys(a: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Rank keys of the candidates j < lengths[r] (see module docstring)."""
    gamma, num_requests = a.shape
    bits = a.view(np.int32)
    n = 0
    for r in range(num_requests):
        n += min(lengths[r], gamma)
    keys = np.empty(n, np.int64)
    i = 0
    for j in range(gamma):
        for r in range(num_requests):
            if j < lengths[r]:
                keys[i] = (np.int64(ONE_BITS - bits[j, r]) << 32) | (j << 16) | r
                i += 1
    return keys


@njit(cache=True)
def top_k_lengths(a: np.ndarray, lengths: np.ndarray, k: int) -> np.ndarray:
    """ℓ [R]: the first k of the ranking among candidates j < lengths[r] (prefix-closed)."""
    num_requests = a.shape[1]
    out = np.zeros(num_requests, np.int64)
    if k <= 0:
        return out
    keys = _keys(a, lengths)
    if k < keys.size:
        kth = np.partition(keys, k - 1)[k - 1]
    else:
        kth = keys.max() if keys.size else np.int64(-1)
    for key in keys:
        if key <= kth:
            out[key & 0xFFFF] += 1
    return out


@njit(cache=True)
def _top_sums(values: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """S(K) = Σ of the K largest values in [0, 1] (f64), for each K of ks (ascending, 1 ≤ K ≤ n).

    O(n): a counting sort into 1024 value bins (largest first) gives whole-bin sums; only
    the bin where the K-th value falls is partitioned, to take its top few exactly."""
    n, nb = values.size, 1024
    bins = np.empty(n, np.int64)
    count = np.zeros(nb + 1, np.int64)
    total = np.zeros(nb)
    for i in range(n):
        b = nb - 1 - min(int(values[i] * nb), nb - 1)  # bin 0 holds the largest values
        bins[i] = b
        count[b + 1] += 1
        total[b] += values[i]
    start = np.cumsum(count)  # bin b occupies grouped[start[b]:start[b+1]]
    fill = start[:nb].copy()
    grouped = np.empty(n, np.float64)
    for i in range(n):
        grouped[fill[bins[i]]] = -values[i]
        fill[bins[i]] += 1
    out = np.empty(ks.size)
    ki, above = 0, 0.0
    for b in range(nb):
        while ki < ks.size and ks[ki] <= start[b + 1]:
            m = ks[ki] - start[b]  # the top m values of bin b complete the K largest
            if m == start[b + 1] - start[b]:
                out[ki] = above + total[b]
            else:
                part = np.partition(grouped[start[b]:start[b + 1]], m - 1)
                out[ki] = above - part[:m].sum()
            ki += 1
        above += total[b]
    return out


@njit(cache=True)
def delayed_budget(values: np.ndarray, num_requests: int, room: int, buckets: np.ndarray,
                   sps_by_b: np.ndarray) -> int:
    """dspark's K_t: the LARGEST argmax over K ≤ room of Θ(K) = (R + S(K))·SPS(R + K), S on
    `values` (the t−2 snapshot, flat). SPS is constant inside a bucket and S is
    non-decreasing, so the largest maximiser is a bucket top (or room): only those are
    evaluated. Requires R + room ≤ buckets[-1]."""
    cands = np.empty(buckets.size + 1, np.int64)
    m = 0
    for b in buckets:
        if b >= num_requests:
            k = min(b, num_requests + room) - num_requests
            if m == 0 or k != cands[m - 1]:
                cands[m] = k
                m += 1
    cands = cands[:m]
    first = 1 if cands[0] == 0 else 0
    sums = np.zeros(m)
    if m > first:
        sums[first:] = _top_sums(values, cands[first:])
    best_k, best = 0, -1.0
    for i in range(m):
        theta = (num_requests + sums[i]) * sps_by_b[num_requests + cands[i]]
        if theta >= best:  # >=: the largest K among ties (free tokens are free)
            best, best_k = theta, cands[i]
    return best_k


@njit(cache=True)
def walk(a: np.ndarray, cap: np.ndarray, room: int, sps_by_b: np.ndarray) -> int:
    """Algorithm 1 on the current survivals a [γ, R] (candidates j < cap[r]): how many leading
    ranks strictly improve Θ(K) = (R + Σ top-K a)·SPS(R + K)."""
    num_requests = a.shape[1]
    values = np.empty(a.size, np.float32)
    n = 0
    for j in range(a.shape[0]):
        for r in range(num_requests):
            if j < cap[r]:
                values[n] = a[j, r]
                n += 1
    return walk_values(values[:n], num_requests, room, sps_by_b)


@njit(cache=True)
def walk_values(values: np.ndarray, num_requests: int, room: int, sps_by_b: np.ndarray) -> int:
    """Algorithm 1 over a flat set of candidate survivals. Sorts only the top m values (m ×4
    while the walk goes on): walks usually stop early."""
    n = values.size
    room = min(room, n)
    if room <= 0:
        return 0
    neg = np.empty(n, np.float64)  # ascending = descending survival
    top = 0.0
    for i in range(n):
        neg[i] = -values[i]
        top = max(top, values[i])
    base = num_requests * sps_by_b[num_requests]
    if (num_requests + top) * sps_by_b[num_requests + 1] <= base:
        return 0  # even the best candidate does not pay
    m = min(room, 64)
    while True:
        ranked = np.sort(np.partition(neg, m - 1)[:m]) if m < n else np.sort(neg)
        prev, gain, k = base, 0.0, 0
        while k < m:
            gain -= ranked[k]
            theta = (num_requests + gain) * sps_by_b[num_requests + k + 1]
            if not theta > prev:
                return k
            prev = theta
            k += 1
        if m == room:
            return m
        m = min(room, 4 * m)


@njit(cache=True)
def walk_suffices(values: np.ndarray, num_requests: int, k_t: int, room: int, sps_by_b: np.ndarray,
                  tol: float) -> bool:
    """On the step t−2 snapshot (flat survivals `values`, R requests): does Algorithm 1's walk
    get within `tol` of the Θ of the global argmax k_t? If so the SPS curve has no cliff worth
    crossing at this load, and the current step can follow the walk alone."""
    k_w = walk_values(values, num_requests, room, sps_by_b)
    if k_w >= k_t:
        return True
    if k_w > 0:
        sums = _top_sums(values, np.array([k_w, k_t], np.int64))
        s_w, s_t = sums[0], sums[1]
    else:
        s_w, s_t = 0.0, _top_sums(values, np.array([k_t], np.int64))[0]
    theta_w = (num_requests + s_w) * sps_by_b[num_requests + k_w]
    theta_t = (num_requests + s_t) * sps_by_b[num_requests + k_t]
    return theta_w >= (1.0 - tol) * theta_t


_warm = False


def warm_up() -> None:
    """Compile (or load from cache) every kernel once per process, outside any timed path."""
    global _warm
    if _warm:
        return
    surv = np.ones((2, 3), np.float32)
    a, cap = prepare(surv, np.array([5, 1], np.int64), 3)
    zero_capped(a, cap)
    top_k_lengths(a, cap, 2)
    sps = np.linspace(2.0, 1.0, 16)
    delayed_budget(a.reshape(-1), 2, 3, np.array([1, 4, 8, 15], np.int64), sps)
    walk(a, cap, 3, sps)
    walk_suffices(a.reshape(-1), 2, 2, 3, sps, 0.01)
    _warm = True
