"""Prefix scheduler: how many draft tokens ℓ_r each request sends to verification (docs/architecture.md §7).

Every policy maps the current survival matrix a [R, γ] (a[r,j] = Π_{i≤j} ĉ[r,i], the
calibrated probability that d_{r,1..j} are all accepted) and the requests' remaining
output budgets to ℓ [R]. Candidates (r, j) are ranked ONCE per step by a[r,j] descending,
ties broken by j then r (a stable sort of the j-major flattening). Because a is
non-increasing in j, (r, j) always ranks before (r, j+1), so "admit the first K of the
ranking" is prefix-closed and ℓ_r is simply the number of admitted candidates in row r.

Policies (`make_policy(spec)`):
  none, fixed:k, mtp1 (= fixed:1), threshold:t (stop at the first ĉ < t, ĉ_j = a_j / a_{j-1}),
  dspark-theory (Algorithm 1: walk the ranking while Θ = (R + Σ admitted a)·SPS(R + K)
      strictly improves, stop at the first non-improvement),
  dspark (production: budget K_t = argmax_K (R + Σ top-K a)·SPS(R + K) on the survival
      snapshot of step t−2, no early stop so jagged SPS cliffs are crossed; then, with
      walk = Algorithm 1's early stop on the CURRENT survivals: K = walk when the snapshot
      shows the walk within 1 % of the argmax's Θ (no cliff worth crossing at this load),
      else K = max(K_t, walk); admit the global top-K candidates by CURRENT survival. The
      walk matters at low concurrency on a steep SPS, where one request's t−2 snapshot is
      a noisy guess; `dspark:delayed` is K = K_t alone, docs/architecture.md §7 verbatim).
  retrospective (NOT a production policy: the negative control of the Appendix A harness
      and tests; dspark's global argmax evaluated on the CURRENT survivals).
Caps for all: ℓ_r ≤ γ, ℓ_r ≤ remaining_r − 1 (the corrected/bonus token is always
emitted), and B = Σ(1 + ℓ_r) ≤ max_batch_tokens (excess dropped from the bottom of the
ranking, which keeps prefix-closure).

dspark's argmax takes the LARGEST K among exact ties (flat SPS, zero survivals in the
snapshot: a free token may still be accepted now).

dspark history: after each decide() the admissible survivals are pushed. Step t
uses the snapshot of step t−2; at the second call only t−1 exists and is used; at the
first call (no history) the budget is K = R, i.e. an MTP-1-sized budget spread over the
globally best candidates. If R changed since the snapshot, the snapshot's sorted values
are quantile-resampled to R·γ entries (repetition when R doubled, etc.).

Non-anticipation (docs/architecture.md §6): admission of (r, j) may depend on d_{r,<j} (hence on
a[r,≤j]), on other requests and on older steps, never on a[r,>j] (which is computed from
d_{r,j}). Conclusion for each policy:
- Ranking: the rank of (r, j) counts candidates ranked above it; (r, >j) are always
  ranked below (non-increasing a, ties by j), so the rank of (r, j) and the SET of
  candidates above it never depend on a[r,>j].
- dspark: K_t and the walk-or-max choice come from step t−2 (independent of this step's
  tokens), and (r, j) is admitted iff rank(r, j) < K_t (max branch only) or the walk
  reached it (see dspark-theory below): non-anticipating.
- dspark-theory: (r, j) at rank p is admitted iff Θ improved at every rank ≤ p. Θ at rank
  i uses only the top-i values, all ranked above (r, j) or (r, j) itself, so the early
  stop decision for (r, j) is a function of candidates that do not include a[r,>j]:
  ALSO non-anticipating, despite using current survivals. Changing a[r,>j] may change
  the admission of candidates ranked below (r, j) in OTHER rows (global interaction);
  that is allowed, because another request's tokens act as independent external
  randomness for them. What dspark-theory lacks is production value: it needs the
  current survivals before the batch size is known (no overlap of scheduling with the
  previous step) and its early stop halts at the first jagged SPS cliff.
- retrospective: the argmax over K looks past declines at a[r,>j]: a high a[r,j+1]
  can make admitting (r, j) worthwhile; that is the Appendix A bias.
- Batch-token cap: keeps the admitted candidates with the best ranks, again a function
  of candidates ranked above. threshold/fixed only look at ĉ_{r,≤j}.
tests/test_scheduler.py checks this as a property over random batches.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from dspark.runtime import ranking
from dspark.runtime.sps import SPSTable


def sts_survival(conf_logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Sequential Temperature Scaling (docs/architecture.md §8): ĉ = σ(z / T_k), survival = cumprod over k."""
    temps = torch.as_tensor(temperatures, dtype=conf_logits.dtype, device=conf_logits.device)
    return torch.cumprod(torch.sigmoid(conf_logits / temps), dim=-1)


class Policy:
    """Base: caps, ranking, history and the batch-token cap. Subclasses pick the admitted set.

    The hot path runs the compiled kernels of `dspark.runtime.ranking` on a γ-major copy a[j, r] of
    the survivals; inputs and outputs are torch tensors."""

    name = "policy"
    uses_ranking_budget = False  # True: admit the first K of the ranking (K from _budget)

    def __init__(self, sps: SPSTable | None = None, gamma: int = 7, max_batch_tokens: int = 4096):
        self.sps = sps
        self.gamma = int(gamma)
        self.max_batch_tokens = int(max_batch_tokens)
        # SPS at every B in [0, max_batch_tokens] so the hot path is a lookup, not a search.
        self._sps_by_b = None
        self._buckets = np.zeros(0, dtype=np.int64)
        if sps is not None:
            self._sps_by_b = sps.lookup(torch.arange(self.max_batch_tokens + 1)).numpy().astype(np.float64)
            self._buckets = np.asarray(sps.batch_tokens, dtype=np.int64)
        self._snapshots: deque[np.ndarray] = deque(maxlen=2)  # admissible survivals of t−2, t−1
        self.last_budget = 0
        ranking.warm_up()

    def reset(self) -> None:
        self._snapshots.clear()
        self.last_budget = 0

    # -- subclass hooks (a is γ-major [γ, R], cap [R]) -----------------------------------------
    def _admit_lengths(self, a: np.ndarray, cap: np.ndarray) -> np.ndarray:
        """Per-request rule -> ℓ [R] ≤ cap (fixed / threshold)."""
        raise NotImplementedError

    def _budget(self, a: np.ndarray, cap: np.ndarray, room: int) -> int:
        """Ranking rule -> K (how many of the ranked candidates to admit)."""
        raise NotImplementedError

    # -- the step -----------------------------------------------------------------------------
    def decide(self, survival: torch.Tensor, remaining: torch.Tensor) -> torch.Tensor:
        """survival [R, γ] f32 (non-increasing in j), remaining [R] i64 -> ℓ [R] i64."""
        num_requests, width = survival.shape
        gamma = min(width, self.gamma)
        if num_requests == 0 or gamma == 0:
            self.last_budget = 0
            return torch.zeros(num_requests, dtype=torch.int64)
        a, cap = ranking.prepare(np.ascontiguousarray(survival.detach().cpu().numpy(), dtype=np.float32),
                                 np.ascontiguousarray(remaining.detach().cpu().numpy(), dtype=np.int64),
                                 gamma)
        room = max(min(self.max_batch_tokens - num_requests, int(cap.sum())), 0)  # B ≤ max tokens
        if self.uses_ranking_budget:
            k = min(max(self._budget(a, cap, room), 0), room) if room > 0 else 0
            lengths = ranking.top_k_lengths(a, cap, k)
        else:
            lengths = self._admit_lengths(a, cap)
            if int(lengths.sum()) > room:  # batch-token cap: keep the best-ranked admitted ones
                lengths = ranking.top_k_lengths(a, lengths, room)
            k = int(lengths.sum())
        self.last_budget = k
        self._snapshots.append(ranking.zero_capped(a, cap))
        return torch.from_numpy(lengths)

    # -- helpers for budget policies ---------------------------------------------------------------
    def _check_sps(self) -> None:
        if self._sps_by_b is None:
            raise ValueError(f"policy {self.name!r} needs an SPS table")

    def _walk(self, a: np.ndarray, cap: np.ndarray, room: int) -> int:
        """Algorithm 1 on the CURRENT survivals: the number of leading ranks at which Θ strictly
        improves. Non-anticipating: the walk's verdict at rank p reads only ranks ≤ p."""
        self._check_sps()
        return ranking.walk(a, cap, room, self._sps_by_b)

    def _theta(self, ranked: np.ndarray, num_requests: int, room: int) -> np.ndarray:
        """Θ(K) = (R + Σ_{i<K} ranked_i) · SPS(R + K) for K = 0..room (f64); ranked descending."""
        self._check_sps()
        gains = np.zeros(room + 1)
        np.cumsum(ranked[:room], dtype=np.float64, out=gains[1:])
        return (num_requests + gains) * self._sps_by_b[num_requests:num_requests + room + 1]


class NoDraft(Policy):
    name = "none"

    def _admit_lengths(self, a, cap):
        return np.zeros_like(cap)


class Fixed(Policy):
    def __init__(self, k: int, **kw):
        super().__init__(**kw)
        self.k = int(k)
        self.name = f"fixed:{self.k}"

    def _admit_lengths(self, a, cap):
        return np.minimum(cap, self.k)


class Threshold(Policy):
    def __init__(self, t: float, **kw):
        super().__init__(**kw)
        self.t = float(t)
        self.name = f"threshold:{self.t:g}"

    def _admit_lengths(self, a, cap):
        prev = np.concatenate([np.ones_like(a[:1]), a[:-1]], axis=0)
        conf = a / np.maximum(prev, np.float32(1e-30))  # ĉ_j = a_j / a_{j-1} (0 once a hits 0)
        return np.minimum(np.logical_and.accumulate(conf >= self.t, axis=0).sum(0), cap)


class DSparkTheory(Policy):
    """Algorithm 1: greedy walk down the ranking with an early stop at the first Θ non-improvement."""

    name = "dspark-theory"
    uses_ranking_budget = True

    def _budget(self, a, cap, room):
        return self._walk(a, cap, room)


class DSpark(Policy):
    """Production. K_t: the budget from the step t−2 snapshot (argmax, no early stop, so SPS
    cliffs are crossed). walk: Algorithm 1's early-stop length on the current survivals,
    which adapts to this block's confidences (what one request's t−2 snapshot cannot do at
    low concurrency on a steep SPS). If, on the snapshot, the walk gets within `walk_tol`
    of the argmax's Θ, there is no cliff worth crossing: K = walk; else K = max(K_t, walk).
    Admit the top K by current survival. `dspark:delayed` is K = K_t (docs/architecture.md §7 verbatim).

    Non-anticipation: the branch is chosen on step t−2 data; then (r, j) at rank p is
    admitted iff p < K_t (max branch) or Θ improved at every rank ≤ p (reads ranks ≤ p only,
    never a[r,>j])."""

    name = "dspark"
    uses_ranking_budget = True

    def __init__(self, floor: bool = True, **kw):
        super().__init__(**kw)
        self.floor = floor
        if not floor:
            self.name = "dspark:delayed"

    walk_tol = 0.01  # the snapshot's walk within 1 % of its argmax Θ: follow the walk alone

    def _budget(self, a, cap, room):
        num_requests = a.shape[1]
        if not self._snapshots:
            return num_requests  # no history yet: an MTP-1-sized budget
        self._check_sps()
        values, k = self._delayed_budget(num_requests, a.size, room)
        if not self.floor:
            return k
        if ranking.walk_suffices(values, num_requests, k, room, self._sps_by_b, self.walk_tol):
            return self._walk(a, cap, room)
        return k if k >= room else max(k, self._walk(a, cap, room))

    def _delayed_budget(self, num_requests: int, n: int, room: int) -> tuple[np.ndarray, int]:
        """(the t−2 snapshot as n = R·γ flat values, K_t = the largest argmax of Θ over K on it)."""
        snapshot = self._snapshots[0].reshape(-1)  # t−2 when two exist, else t−1
        if snapshot.size == n and num_requests + room <= self._buckets[-1]:
            return snapshot, ranking.delayed_budget(snapshot, num_requests, room, self._buckets,
                                                    self._sps_by_b)
        ranked = np.sort(snapshot)[::-1]
        if ranked.size != n:  # R changed: quantile-resample the sorted snapshot to R·γ values
            ranked = np.ascontiguousarray(ranked[np.arange(n) * ranked.size // n])
        theta = self._theta(ranked, num_requests, room)
        return ranked, room - int(np.argmax(theta[::-1]))  # largest K among ties: free tokens are free


class Retrospective(Policy):
    """NEGATIVE CONTROL ONLY: the global argmax on current survivals. Not lossless (Appendix A)."""

    name = "retrospective"
    uses_ranking_budget = True

    def _budget(self, a, cap, room):
        ranked = np.sort(ranking.zero_capped(a, cap).reshape(-1))[::-1]
        return int(np.argmax(self._theta(ranked, a.shape[1], room)))


def make_policy(spec: str, sps: SPSTable | None = None, gamma: int = 7,
                max_batch_tokens: int = 4096) -> Policy:
    """'none' | 'fixed:k' | 'mtp1' | 'threshold[:t]' (default t=0.5) | 'dspark-theory' | 'dspark'
    | 'dspark:delayed'
    (| 'retrospective', a deliberately non-lossless control for tests and the Appendix A harness)."""
    kw = dict(sps=sps, gamma=gamma, max_batch_tokens=max_batch_tokens)
    name, _, arg = spec.strip().partition(":")
    if name == "none":
        return NoDraft(**kw)
    if name == "mtp1":
        p = Fixed(1, **kw)
        p.name = "mtp1"
        return p
    if name == "fixed":
        return Fixed(int(arg), **kw)
    if name == "threshold":
        return Threshold(float(arg) if arg else 0.5, **kw)
    if name in ("dspark-theory", "dspark", "retrospective"):
        if sps is None:
            raise ValueError(f"policy {name!r} needs an SPS table (dspark.runtime.sps.SPSTable)")
        if name == "dspark" and arg not in ("", "delayed"):
            raise ValueError(f"unknown dspark variant {spec!r} (use 'dspark' or 'dspark:delayed')")
        if name == "dspark":
            return DSpark(floor=arg != "delayed", **kw)
        return {"dspark-theory": DSparkTheory, "retrospective": Retrospective}[name](**kw)
    raise ValueError(f"unknown policy spec {spec!r}")
