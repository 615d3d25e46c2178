"""Prefix scheduler: how many draft tokens ℓ_r each request sends to verification.

Every policy maps the survival matrix a [R, γ] (a[r,j] = Π_{i≤j} ĉ[r,i], the calibrated
probability that d_{r,1..j} are all accepted) and the requests' remaining output budgets to
ℓ [R]. `make_policy(spec)` builds one: none, fixed:k, mtp1, threshold:t, dspark-theory
(Algorithm 1), dspark (production; `dspark:delayed` is its t−2 budget alone) and
retrospective (NOT lossless: the negative control of the tests and the Appendix A harness).
The rules, the caps, the t−2 history and why each production policy is lossless
(non-anticipation) are in docs/architecture.md §7; tests/test_scheduler.py checks that
property on random batches.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any

import numpy as np
import torch

from dspark.runtime import policy_kernels, ranking
from dspark.runtime.sps import DraftCost, SPSTable

MIN_STEP_S = 1e-6  # floor of a modelled step time (a negative measured overhead cannot make it ≤ 0)


def sts_survival(conf_logits: torch.Tensor, temperatures: torch.Tensor,
                 shifts: torch.Tensor | None = None) -> torch.Tensor:
    """Sequential Temperature Scaling (docs/architecture.md §8): ĉ = σ(z / T_k [+ b_k]), survival =
    cumprod over k. `shifts` b_k: the affine variant, shipped where temperatures alone leave a bias.
    A narrow block [R, w] (`Policy.draft_width`) reads the first w of each."""
    w = conf_logits.shape[-1]
    temps = torch.as_tensor(temperatures, dtype=conf_logits.dtype, device=conf_logits.device)[..., :w]
    z = conf_logits / temps
    if shifts is not None:
        z = z + torch.as_tensor(shifts, dtype=conf_logits.dtype, device=conf_logits.device)[..., :w]
    return torch.cumprod(torch.sigmoid(z), dim=-1)


class Policy:
    """Base: caps, ranking, history and the batch-token cap. Subclasses pick the admitted set.

    The hot path runs the compiled kernels of `dspark.runtime.ranking` on a γ-major copy a[j, r] of
    the survivals; inputs and outputs are torch tensors."""

    name = "policy"
    uses_ranking_budget = False  # True: admit the first K of the ranking (K from _budget)
    counts_drafting = False  # True: Θ divides by the whole step, drafting included (dspark)
    # drafting-cost rule (policies that count drafting): while it skips drafting, a probe step
    # drafts after `probe_every` skipped steps, then after 2x, 4x, ... up to `probe_max`
    probe_every = 16
    probe_max = 256
    # the shape of the step decide() last scheduled: "ranked" (the policy's own rule) or "uniform"
    # (one draft per request, as MTP-1; chosen by `DSpark.wants_draft` for the step after)
    shape = "ranked"

    def __init__(self, sps: SPSTable | None = None, gamma: int = 7, max_batch_tokens: int = 4096,
                 draft_cost: DraftCost | None = None):
        self.sps = sps
        self.gamma = int(gamma)
        self.max_batch_tokens = int(max_batch_tokens)
        self.draft_cost = draft_cost if draft_cost is not None else DraftCost()
        # SPS at every B in [0, max_batch_tokens] so the hot path is a lookup, not a search.
        self._sps_by_b: np.ndarray | None = None
        self._sps_now: np.ndarray | None = None  # what Θ uses this step: the SPS, or with drafting counted
        self._buckets = np.zeros(0, dtype=np.int64)
        self._sps_by_r: dict[int, np.ndarray] = {}  # the table read at R (`SPSTable.rates_for`)
        if sps is not None:
            self._sps_by_b = sps.lookup(torch.arange(self.max_batch_tokens + 1)).numpy().astype(np.float64)
            # the sizes where SPS can step down: the profiled buckets, or every B when unpadded
            self._buckets = np.asarray(sps.batch_tokens if sps.padded else range(1, sps.batch_tokens[-1] + 1),
                                       dtype=np.int64)
        self._snapshots: deque[np.ndarray] = deque(maxlen=2)  # admissible survivals of t−2, t−1
        self._unabsorbed: np.ndarray | None = None  # step t−1's snapshot, if full-width
        self.last_budget = 0
        self._next_shape = "ranked"  # the shape wants_draft chose for the coming step
        self.uniform_steps = 0  # decides of the uniform shape (for reports)
        # per class of R: [drafted steps since the shape the rates do not favour last ran, steps
        # between such probes]
        self._shape_runs: dict[int, list[int]] = {}
        self._uniform_tries: dict[int, int] = {}  # R -> uniform steps chosen while it was unmeasured
        # cost rule's probe back-off per class of R (R.bit_length()): [skipped steps, interval]
        self._probes: dict[int, list[int]] = {}
        self._profile: np.ndarray | None = None  # cost rule: average sorted survival curve (≤ t−1)
        # online recalibration: per drafter source and survival level, decayed sums of predicted
        # survival and of acceptance
        self._predicted = np.zeros((self.SOURCES, len(self.LEVELS)))
        self._accepted = np.zeros((self.SOURCES, len(self.LEVELS)))
        ranking.warm_up()
        policy_kernels.warm_up()

    def reset(self) -> None:
        self._snapshots.clear()
        self._unabsorbed = None
        self.last_budget = 0
        self.shape = self._next_shape = "ranked"
        self._shape_runs = {}
        self._uniform_tries = {}
        self._probes = {}
        self._profile = None
        self._predicted[:] = 0.0
        self._accepted[:] = 0.0

    def warm_from(self, other: Policy) -> None:
        """Take over what `other` learned from its completed steps: the cost rule's survival
        curve, its probe back-off, its measured drafting and step costs and the recalibration sums
        (not the t−1 / t−2 snapshots of its batch). For benchmarks that build a fresh engine per
        run but stand for one long-running server; still only past steps, so still lossless."""
        self._profile = None if other._profile is None else other._profile.copy()
        if self.draft_cost.learn and other.draft_cost.learn:
            self.draft_cost = copy.deepcopy(other.draft_cost)
        self._probes = {c: list(v) for c, v in other._probes.items()}
        self._shape_runs = {c: list(v) for c, v in other._shape_runs.items()}
        self._uniform_tries = dict(other._uniform_tries)
        self._predicted[:], self._accepted[:] = other._predicted, other._accepted

    RECAL_DECAY = 0.99  # per observed step: the recalibration remembers ~100 steps
    RECAL_MIN = 4.0  # predicted survival mass a level needs before its factor departs from 1
    SOURCES = 4  # drafter sources recalibrated apart (`DraftBlock.sources`; larger ids share the last)
    # survival levels recalibrated apart: left edges of the bins of a[r, j]
    LEVELS = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85])
    # sources the drafter calibrates online itself, uncensored (a hybrid's lookups): taken as they are
    calibrated_sources: frozenset[int] = frozenset()

    def _source_rows(self, sources: torch.Tensor | None, num_requests: int) -> np.ndarray:
        """[R] i64 source index per row (0 when the drafter has one source; the kernels of
        `policy_kernels` let ids ≥ SOURCES share the last)."""
        if sources is None:
            return np.zeros(num_requests, dtype=np.int64)
        return sources.cpu().numpy().astype(np.int64, copy=False)

    def observe_acceptance(self, survival: torch.Tensor, lengths: torch.Tensor,
                           accepted: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """After a step: the survivals the policy was given [R, γ], the ℓ it chose [R], the drafts
        accepted [R] and the drafter's source per row [R] (None: one). Per source and survival
        level, survival a[r, j] predicted 1[n_r > j] for every verified (r, j); the running ratio
        of the two is the recalibration factor (dspark). By level, not by position: which (r, j)
        get verified depends on a[r, j] alone, so the acceptance rate AT a level is learned
        without bias from the verified ones, where a factor per position averages only the
        confident rows that were verified and misjudges the rest (SmolLM2's trained drafter at
        batch 1: positions 4-6 accepted 3-4x their survival uncensored, learned 1.5x). Sources
        apart: a hybrid's lookups and its trained drafter err in different directions."""
        gamma = min(survival.shape[1], self.gamma)
        a = np.ascontiguousarray(survival[:, :gamma].numpy(), dtype=np.float32)
        policy_kernels.recal_observe(a, lengths.numpy().astype(np.int64, copy=False),
                                     accepted.numpy().astype(np.int64, copy=False),
                                     self._source_rows(sources, survival.shape[0]), self.LEVELS,
                                     self._predicted, self._accepted, self.RECAL_DECAY)

    def recalibration(self) -> np.ndarray:
        """Factors [SOURCES, levels]: realised acceptance / predicted survival over past steps (1
        until a source has RECAL_MIN of predicted mass at a level; levels short of it take the
        nearest learned level's factor: low levels are verified only when predicted to pay, so
        with factor 1 an underestimated low level would never be verified and never corrected);
        1 for the drafter's `calibrated_sources`."""
        # +1: a weak prior at 1; per source, every level takes the factor of the nearest learned
        # level (the lower one on a tie; a source with none keeps 1)
        calibrated = np.zeros(self.SOURCES, dtype=np.bool_)
        for c in self.calibrated_sources:
            calibrated[min(c, self.SOURCES - 1)] = True
        return policy_kernels.recal_factors(self._predicted, self._accepted, self.RECAL_MIN, 0.05, 4.0,
                                            calibrated)

    def recalibrated(self, survival: np.ndarray, sources: torch.Tensor | None = None) -> np.ndarray:
        """survival [R, γ] · its source's factor at its level (`recalibration`). From completed
        steps only, and a[r, j] · f(a[r, j]) still depends on d_{r,<j} (and the row's source,
        chosen from its context) alone, so ranking stays non-anticipating."""
        return policy_kernels.recal_apply(np.ascontiguousarray(survival, dtype=np.float32),
                                          self._source_rows(sources, survival.shape[0]), self.LEVELS,
                                          self.recalibration())

    PROFILE_POINTS = 256  # the averaged survival curve, as quantiles of the per-step sorted values
    PROFILE_ALPHA = 0.25  # weight of the newest snapshot in that average

    def _absorb(self, snapshot: np.ndarray) -> None:
        """Fold a past step's snapshot into the average curve the cost rule reads: its admissible
        survivals sorted descending, resampled to PROFILE_POINTS quantiles (any R)."""
        ranked = np.sort(snapshot.reshape(-1))[::-1].astype(np.float64)
        curve = ranked[np.arange(self.PROFILE_POINTS) * ranked.size // self.PROFILE_POINTS]
        if self._profile is None:
            self._profile = curve
        else:
            self._profile += self.PROFILE_ALPHA * (curve - self._profile)

    # -- drafting cost (architecture §7) --------------------------------------------------------
    def observe_draft(self, num_requests: int, seconds: float, width: int | None = None) -> None:
        """The engine reports what drafting a step for R requests took, `width` tokens each (None:
        γ). t_draft(R) prices a ranked step's full block: narrower proposes (uniform steps) are
        measured with their whole steps instead (`DraftCost.nearest_uniform`)."""
        if width is None or width >= self.gamma:
            self.draft_cost.observe(num_requests, seconds)

    def draft_width(self) -> int:
        """Tokens per request the coming drafted step may verify, so the drafter proposes no more
        (`DrafterLike.propose`): γ, or fewer where the policy's rule caps ℓ before drafting.
        Decided before the step's drafts exist, so it reads no draft: lossless."""
        return self.gamma

    def observe_step(self, num_requests: int, batch_tokens: int, drafted: bool, seconds: float,
                     propose_seconds: float, verify_seconds: float | None = None) -> None:
        """The engine reports a whole decode step: R requests, B verified tokens, whether it called
        the drafter, its wall time, the part of it spent in propose and (when known) in the
        target forward. A drafted step's forward teaches the draft rows' price scale
        (`DraftCost.verify_scale`); what the modelled forward and propose do not explain is the
        step's overhead (`DraftCost.overhead`)."""
        if not self.counts_drafting or not 0 < batch_tokens <= self.max_batch_tokens:
            return
        sps = self.sps_for(num_requests)
        if sps is None:
            return
        # the table's price of the anchor rows, the first R draft rows and the rest
        base = 1.0 / sps[min(num_requests, batch_tokens)]
        rows = 1.0 / sps[min(batch_tokens, 2 * num_requests)] - base
        beyond = 1.0 / sps[batch_tokens] - base - rows
        if drafted and verify_seconds is not None:
            self.draft_cost.observe_verify(num_requests, verify_seconds, base, rows, beyond)
        a, b, c = self.draft_cost.verify_scale(num_requests) if drafted else (1.0, 1.0, 1.0)
        overhead = seconds - propose_seconds - a * base - b * rows - c * beyond
        self.draft_cost.observe_overhead(num_requests, drafted, overhead)

    def observe_rate(self, num_requests: int, speculative: bool, tokens: int, seconds: float) -> None:
        """The engine reports what a whole step delivered: `tokens` emitted by R requests in
        `seconds`, speculative (it verified drafts; propose counted) or plain (the cost rule's
        measured side: `DraftCost.plain_rate`, `DraftCost.speculative_correction`)."""
        if self.counts_drafting:
            self.draft_cost.observe_rate(num_requests, speculative, tokens, seconds,
                                         uniform=self.shape == "uniform")

    def sps_for(self, num_requests: int) -> np.ndarray | None:
        """SPS by B = 0..max_batch_tokens for a step of R requests (f64; cached per R): the table's
        ragged grid at R where it has one, else the table by B (None without a table)."""
        if self._sps_by_b is None or self.sps is None or self.sps.ragged is None:
            return self._sps_by_b
        rates = self._sps_by_r.get(num_requests)
        if rates is None:
            rates = self._sps_by_r[num_requests] = self.sps.rates_for(num_requests, self.max_batch_tokens)
        return rates

    def step_rate(self, num_requests: int) -> np.ndarray | None:
        """Steps/second by token batch B for a drafted step of R requests: 1 / (t_draft(R) +
        overhead(R) + a/SPS_R(R) + b·(1/SPS_R(min(B, 2R)) − 1/SPS_R(R)) + c·(1/SPS_R(B) −
        1/SPS_R(min(B, 2R)))), (a, b, c) = verify_scale(R), when this policy counts drafting and
        a cost is known, else SPS_R."""
        sps = self.sps_for(num_requests)
        t_draft = self.draft_cost(num_requests) if self.counts_drafting else None
        if sps is None or not t_draft:
            return sps
        # a step of R requests verifies at most R·(γ + 1) tokens: nothing reads the rates past it
        a, b, c = self.draft_cost.verify_scale(num_requests)
        return policy_kernels.drafted_step_rates(sps, num_requests, self.gamma, a, b, c,
                                                 t_draft + self.draft_cost.overhead(num_requests, True),
                                                 MIN_STEP_S)

    def wants_draft(self, num_requests: int) -> bool:
        """Draft the coming step at all? Decided before drafting, from past steps only."""
        return True

    def probe_state(self, num_requests: int) -> list[int]:
        """[skipped steps, steps between probes] of the cost rule at R: one back-off per
        power-of-two class of R (1, 2–3, 4–7, …), since speculation paying at R = 2 says nothing
        about R = 32 and must not bring back frequent probes there."""
        return self._probes.setdefault(int(num_requests).bit_length(), [0, self.probe_every])

    # -- subclass hooks (a is γ-major [γ, R], cap [R]) -----------------------------------------
    def _admit_lengths(self, a: np.ndarray, cap: np.ndarray) -> np.ndarray:
        """Per-request rule -> ℓ [R] ≤ cap (fixed / threshold)."""
        raise NotImplementedError

    def _budget(self, a: np.ndarray, cap: np.ndarray, room: int) -> int:
        """Ranking rule -> K (how many of the ranked candidates to admit)."""
        raise NotImplementedError

    # -- the step -----------------------------------------------------------------------------
    def decide(self, survival: torch.Tensor, remaining: torch.Tensor,
               sources: torch.Tensor | None = None) -> torch.Tensor:
        """survival [R, γ] f32 (non-increasing in j), remaining [R] i64, the drafter's source per
        row [R] i64 (None: one) -> ℓ [R] i64."""
        num_requests, width = survival.shape
        gamma = min(width, self.gamma)
        if num_requests == 0 or gamma == 0:
            self.last_budget = 0
            return torch.zeros(num_requests, dtype=torch.int64)
        surv = np.ascontiguousarray(survival.detach().cpu().numpy(), dtype=np.float32)
        if self.counts_drafting:
            # prepare() clips to [0, 1], non-increasing
            surv = self.recalibrated(surv[:, :gamma], sources)
        a, cap = ranking.prepare(np.ascontiguousarray(surv, dtype=np.float32),
                                 np.ascontiguousarray(remaining.detach().cpu().numpy(), dtype=np.int64),
                                 gamma)
        self._sps_now = self.step_rate(num_requests)
        room = max(min(self.max_batch_tokens - num_requests, int(cap.sum())), 0)  # B ≤ max tokens
        self.shape = "uniform" if self.uses_ranking_budget and self._next_shape == "uniform" else "ranked"
        self.uniform_steps += self.shape == "uniform"
        if self.shape == "ranked" and self.uses_ranking_budget:
            k = min(max(self._budget(a, cap, room), 0), room) if room > 0 else 0
            lengths = ranking.top_k_lengths(a, cap, k)
        else:  # a uniform step reads no survival: one draft per request, as MTP-1
            lengths = np.minimum(cap, 1) if self.shape == "uniform" else self._admit_lengths(a, cap)
            if int(lengths.sum()) > room:  # batch-token cap: keep the best-ranked admitted ones
                lengths = ranking.top_k_lengths(a, lengths, room)
            k = int(lengths.sum())
        self.last_budget = k
        if self.counts_drafting and self._unabsorbed is not None:
            self._absorb(self._unabsorbed)  # step t−1's snapshot joins the cost rule's average
        snapshot = ranking.zero_capped(a, cap)
        # a narrow block (`draft_width`): its undrafted candidates survive with 0 in the K_t
        # snapshot, and the cost rule's curve of what a full block offers skips it
        self._unabsorbed = snapshot if gamma >= self.gamma else None
        if gamma < self.gamma:
            snapshot = np.concatenate([snapshot, np.zeros((self.gamma - gamma, num_requests), np.float32)])
        self._snapshots.append(snapshot)
        return torch.from_numpy(lengths)

    # -- helpers for budget policies ---------------------------------------------------------------
    def _check_sps(self) -> np.ndarray:
        """The step rates of this decide (raises without an SPS table)."""
        if self._sps_by_b is None or self._sps_now is None:
            raise ValueError(f"policy {self.name!r} needs an SPS table")
        return self._sps_now

    def _walk(self, a: np.ndarray, cap: np.ndarray, room: int) -> int:
        """Algorithm 1 on the CURRENT survivals: the number of leading ranks at which Θ strictly
        improves. Non-anticipating: the walk's verdict at rank p reads only ranks ≤ p."""
        return ranking.walk(a, cap, room, self._check_sps())

    def _theta(self, ranked: np.ndarray, num_requests: int, room: int) -> np.ndarray:
        """Θ(K) = (R + Σ_{i<K} ranked_i) · SPS(R + K) for K = 0..room (f64); ranked descending."""
        rate = self._check_sps()
        gains = np.zeros(room + 1)
        np.cumsum(ranked[:room], dtype=np.float64, out=gains[1:])
        return (num_requests + gains) * rate[num_requests:num_requests + room + 1]


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

    def draft_width(self) -> int:
        return max(min(self.k, self.gamma), 1)


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
    counts_drafting = True

    def __init__(self, floor: bool = True, **kw):
        super().__init__(**kw)
        self.floor = floor
        if not floor:
            self.name = "dspark:delayed"
        self._depths: dict[int, deque[int]] = {}  # class of R -> most drafts accepted, its last ranked steps
        self._ranked_steps: dict[int, int] = {}  # class of R -> ranked steps observed
        self._width_next = self.gamma

    walk_tol = 0.01  # the snapshot's walk within 1 % of its argmax Θ: follow the walk alone
    # while speculation is within 10 % of plain, the cost rule's probes back off to close_call_wait
    close_call = 0.9
    close_call_wait = 64
    # drafting must beat plain decoding by this factor once a side is measured: the rates swing
    # by ±10 % over a few steps (context lengths, the machine), and where the two sides are
    # within that, drafting on a lucky reading costs a propose a step for nothing (at 16 requests
    # on SmolLM2, MTP-1 ran at 0.95-0.97x plain and the rule still drafted a third of the steps)
    draft_margin = 1.03
    # a stale measured plain rate (`DraftCost.plain_stale`) is re-measured by one plain step while
    # speculation leads it by less than this: a lead that staleness could have made
    plain_probe_margin = 1.25
    # the cost rule's last comparison, tokens/s: (model's speculative, corrected, plain), and the
    # measured rate of uniform-shape steps it compared them with (None: not measured at R)
    last_rates: tuple[float, float, float] = (0.0, 0.0, 0.0)
    last_uniform_rate: float | None = None
    # a ranked step drafts one token past the most drafts accepted in the last `depth_window`
    # ranked steps of R's class (`draft_width`), and the full γ on every `full_width_every`-th
    depth_window = 8
    full_width_every = 8
    # ... where a full block's propose costs at least this share of a one-token step at R (the
    # SPS table's): a cheap drafter (prompt lookup) drafts the full γ, narrowing saves it nothing
    narrow_min_share = 0.03

    def reset(self) -> None:
        super().reset()
        self._depths = {}
        self._ranked_steps = {}
        self._width_next = self.gamma

    def warm_from(self, other: Policy) -> None:
        super().warm_from(other)
        if isinstance(other, DSpark):
            self._depths = {c: deque(d, maxlen=self.depth_window) for c, d in other._depths.items()}
            self._ranked_steps = dict(other._ranked_steps)

    def wants_draft(self, num_requests: int) -> bool:
        """The drafting-cost rule (architecture §7): skip drafting the coming step when, on the
        survivals of past steps (the average sorted curve of the snapshots up to step t−2 before
        the step drafted now), the best speculative rate max_K (R + Σ top-K a) / (t_draft(R) +
        o_d(R) + F_R(R + K)) does not beat plain decoding's R / (1/SPS(R) + o_p(R)), with F_R the
        fitted forward of a drafted step (`step_rate`, `DraftCost.verify_scale`) and o_d and o_p
        the measured overheads of whole drafted and plain steps (`DraftCost.overhead`; a plain
        step priced at most as a drafted one without draft rows and propose: `DraftCost.plain_step`).
        The average, not one snapshot: at low concurrency a single step's survivals are a noisy
        guess. Reads only past steps (snapshots and measured times), so it stays lossless.
        While skipping, a probe step drafts anyway so the average keeps learning: after
        `probe_every` skipped steps, then twice as many after each probe that did not pay (up
        to `probe_max`), back to `probe_every` as soon as speculation pays; counted per class of
        R (`probe_state`). Under load that never pays, probes then cost < 1 % of the steps
        instead of 6 %. A close call (the speculative side within `close_call` of plain) backs
        off no further than `close_call_wait`: a measured side's moving average swings with the
        prompts it ran on, and a probe backed off to 256 left dspark decoding plain for 50 steps
        at 8 requests on a uniform rate measured 6 % under plain's in a slow spell, while a wait
        kept at `probe_every` cost ~2 % at 32 requests, where a probe's propose is a quarter of a
        step. Once a side is measured, drafting pays when it beats plain by `draft_margin` (3 %):
        within that the measured sides are within their noise, and plain decoding saves the
        propose. The other way round, while drafting leads by less than `plain_probe_margin`,
        one plain step re-measures plain decoding at R once its rate is stale
        (`DraftCost.plain_stale`): the plain side is otherwise measured only while the rule skips.
        What steps delivered corrects the model once enough have run at this R (`DraftCost`): the
        plain side becomes the measured plain rate, and the speculative side is scaled by the
        ratio of measured to predicted speculative rates. The model prices a ragged step of R
        sequences with a one-sequence SPS table and per-R average overheads, which errs by a
        few per cent where speculation barely pays and by more in a burst's tail of a few hard
        requests; the correction keeps the model's response to the survivals (a new prompt's
        confidence shows within a few steps) but not its bias. Past steps only: lossless.
        The step's shape (`_pick_shape`): the ranked budget (`_budget`) or one draft per request
        (uniform, as MTP-1), whichever delivered more. On a CPU a ragged verify costs 12–15 % more
        than a uniform one of the same size (length groups and padded attention rows:
        results/target_ragged_smollm2.json), which no table by size
        prices, and at 8 requests MTP-1 beat both the ranked budget and plain decoding; the
        uniform side is measured, not modelled (at R or, until then, at the nearest R of its
        class: `_uniform_rate`), and drafting pays when
        either side beats plain."""
        self._next_shape = "ranked"
        t_draft = self.draft_cost(num_requests)
        self._width_next = self._ranked_width(num_requests, t_draft)
        if not t_draft or self._profile is None or self._sps_by_b is None or num_requests < 1:
            return True
        room = min(self.max_batch_tokens - num_requests, num_requests * self.gamma)
        if room < 1:
            return True
        drafted = self.step_rate(num_requests)  # drafted steps/s by B, drafting and overheads counted
        assert drafted is not None  # the SPS table and t_draft are known here
        # the curve at the centres of R·γ equal quantiles (their left edges read one value early)
        predicted = policy_kernels.best_speculative_rate(self._profile, num_requests, self.gamma, room,
                                                         drafted)
        plain = self._plain_rate(num_requests)
        correction = self.draft_cost.speculative_correction(num_requests)
        corrected = predicted * (1.0 if correction is None else correction)
        uniform = self._uniform_rate(num_requests, plain) if self.draft_cost.learn else None
        self.last_rates, self.last_uniform_rate = (predicted, corrected, plain), uniform
        probe = self.probe_state(num_requests)
        best = max(corrected, uniform or 0.0)
        # the margin guards against the measured rates' noise (the model alone has none)
        measured = (uniform is not None or correction is not None
                    or self.draft_cost.plain_rate(num_requests) is not None)
        margin = self.draft_margin if measured else 1.0
        explore = (self.draft_cost.learn and uniform is None and num_requests >= 2
                   and self._uniform_tries.get(num_requests, 0) < DraftCost.RATE_MIN_STEPS)
        if explore:
            pass  # the uniform side is not measured at R yet: draft it (`_pick_shape`)
        elif best > margin * plain:
            probe[0], probe[1] = 0, self.probe_every
            if (self.draft_cost.learn and best < self.plain_probe_margin * plain
                    and self.draft_cost.plain_stale(num_requests)):
                self.draft_cost.plan_plain_probe(num_requests)  # a plain probe
                return False
        elif probe[0] >= probe[1]:  # a close call keeps probing more often: the sides are within noise
            close = best > self.close_call * plain
            probe[0], probe[1] = 0, min(2 * probe[1], self.close_call_wait if close else self.probe_max)
        else:
            probe[0] += 1
            return False
        self._next_shape = self._pick_shape(num_requests, corrected, uniform)
        if self._next_shape == "ranked":
            self.draft_cost.observe_prediction(num_requests, predicted)  # a ranked step follows
        return True

    def _plain_rate(self, num_requests: int) -> float:
        """Plain decoding's tokens/s at R: measured, else the model's (`DraftCost.plain_step`)."""
        plain = self.draft_cost.plain_rate(num_requests)
        if plain is None:
            base_s = 1.0 / float(self.sps_for(num_requests)[num_requests])  # type: ignore[index]
            plain = num_requests / max(self.draft_cost.plain_step(num_requests, base_s), MIN_STEP_S)
        return plain

    def _uniform_rate(self, num_requests: int, plain: float) -> float | None:
        """The uniform shape's tokens/s at R: plain × its paired ratio to plain decoding in R's
        class (`DraftCost.paired_ratio`: uniform and plain steps measured in the same stretch of
        the loop), else measured at R, else the nearest measured R' of R's class at its ratio to
        plain decoding there (uniform(R') ÷ plain(R') × plain(R)), else None (then `wants_draft`
        explores the uniform shape at R). Measured per exact R only, a closed loop at 32
        requests, whose R wanders over 20–32 as requests end and start, spent 4 uniform steps at
        each new R: half its drafted steps where plain decoding was faster. Paired first: at 8
        requests a uniform average read in a slow stretch stood at 268–286 tokens/s for 130
        steps while MTP-1's steps delivered 272–344, and dspark decoded plain."""
        ratio = self.draft_cost.paired_ratio(num_requests, "uniform", "plain")
        if ratio is not None:
            return ratio * plain
        nearest = self.draft_cost.nearest_uniform(num_requests)
        if nearest is None:
            return None
        r, rate = nearest
        return rate if r == num_requests else rate * plain / self._plain_rate(r)

    def draft_width(self) -> int:
        """A uniform step verifies one draft per request, so it drafts one (at 32 requests on
        SmolLM2 a 1-token propose took 9.7 ms against 24.2 ms for γ = 7: the block's keys span
        all G inputs either way, its queries, MLP, LM head and head steps do not). A ranked step
        drafts `_ranked_width`."""
        return 1 if self._next_shape == "uniform" else self._width_next

    def _ranked_width(self, num_requests: int, t_draft: float | None) -> int:
        """One token past the most drafts a request had accepted in the last `depth_window` ranked
        steps of R's class, at most γ; γ before any and on every `full_width_every`-th ranked
        step (the cost rule's survival curve and t_draft(R) learn from full blocks only). The
        drafter's matmuls, attention and head steps scale with the width, and on SmolLM2 at one
        request a width of 5 of γ = 7 lost no accepted token; a block accepted to its edge widens
        the next by one. Only where a full block's propose (`t_draft`, measured) costs at least
        `narrow_min_share` of a one-token step: prompt lookup's nearly free blocks stay full
        (served alone at one request, narrowed blocks ran 0.85x fixed:7). Reads only completed
        steps and measured times: lossless."""
        cls = num_requests.bit_length()
        depths = self._depths.get(cls)
        if not depths or self._ranked_steps.get(cls, 0) % self.full_width_every == 0:
            return self.gamma
        rates = self.sps_for(num_requests)  # SPS(R): a one-token step's rate, as `_plain_rate` reads it
        share = 0.0 if not t_draft or rates is None else t_draft * float(rates[num_requests])
        if share < self.narrow_min_share:
            return self.gamma  # drafting unmeasured, or too cheap for its width to matter
        return min(self.gamma, max(depths) + 1)

    def observe_acceptance(self, survival: torch.Tensor, lengths: torch.Tensor,
                           accepted: torch.Tensor, sources: torch.Tensor | None = None) -> None:
        """The recalibration (`Policy.observe_acceptance`), and a ranked step's most accepted
        drafts for `_ranked_width`."""
        super().observe_acceptance(survival, lengths, accepted, sources)
        if self.shape == "ranked":
            cls = survival.shape[0].bit_length()
            most = int(accepted.max()) if len(accepted) else 0
            self._depths.setdefault(cls, deque(maxlen=self.depth_window)).append(most)
            self._ranked_steps[cls] = self._ranked_steps.get(cls, 0) + 1

    def _pick_shape(self, num_requests: int, ranked: float, uniform: float | None) -> str:
        """The coming drafted step's shape: "uniform" until RATE_MIN_STEPS uniform steps at R
        have been measured (`wants_draft` drafts the first RATE_MIN_STEPS of them whatever the
        other rates say), then whichever of the ranked rate (the model, corrected) and the
        measured uniform one is higher (the ranked one by `draft_margin`: within the rates' noise
        the uniform step proposes one token, not γ; at 8 requests the rule without it ran ranked
        steps on three in four drafted steps at 0.95x MTP-1), but for one step of the other
        shape after `probe_every` drafted steps per class of R, then twice as many after each
        such probe up to `probe_max` (the side not taken keeps being measured at a cost < 1 % of
        the steps once it stays behind). Once the shapes have paired readings in R's class (a
        step of one shape against the run of the other just before it, `DraftCost.paired_ratio`:
        every probe gives one), they decide instead of the rates: the ranked rate is the model
        scaled by its average of measured over predicted, read in another stretch of the loop
        than the uniform one (at 8 requests the rule ran 151 of 221 drafted steps ranked, at
        0.97x MTP-1, while its paired ranked/uniform reading stood at 0.97).
        The wait does not start over when the favoured shape changes: the
        favoured side is measured all along, so a change shows without probes, and the two sides
        are often within noise of each other (at 8 requests resetting it ran a ranked step in
        every ~17).
        Always "ranked" with frozen costs (`DraftCost.learn` False: a schedule that timing does
        not change) and for one request: its verify is never ragged, and ℓ = 1 is a budget the
        ranked rule can pick itself (with it, 27 of 537 batch-1 steps ran uniform at ~0.7x the rate)."""
        if not self.draft_cost.learn or num_requests < 2:
            return "ranked"
        if uniform is None:  # (+1: a step's rate arrives after the next step's shape is chosen)
            tries = self._uniform_tries.get(num_requests, 0)
            if tries > DraftCost.RATE_MIN_STEPS:
                return "ranked"  # no rate was reported for them (a caller outside the engine)
            self._uniform_tries[num_requests] = tries + 1
            return "uniform"
        # in doubt the uniform shape: the ranked one must beat it by the noise margin, paired
        # (each shape's probes give readings) once there are paired readings, else as averaged
        paired = self.draft_cost.paired_ratio(num_requests, "ranked", "uniform")
        ranked_ahead = (paired > self.draft_margin if paired is not None
                        else ranked > self.draft_margin * uniform)
        favoured, other = ("ranked", "uniform") if ranked_ahead else ("uniform", "ranked")
        state = self._shape_runs.setdefault(int(num_requests).bit_length(), [0, self.probe_every])
        state[0] += 1
        if state[0] <= state[1]:
            return favoured
        state[0], state[1] = 0, min(2 * state[1], self.probe_max)
        return other

    def _budget(self, a, cap, room):
        num_requests = a.shape[1]
        if not self._snapshots:
            return num_requests  # no history yet: an MTP-1-sized budget
        self._check_sps()
        values, k = self._delayed_budget(num_requests, a.size, room)
        if not self.floor:
            return k
        if ranking.walk_suffices(values, num_requests, k, room, self._check_sps(), self.walk_tol):
            return self._walk(a, cap, room)
        return k if k >= room else max(k, self._walk(a, cap, room))

    def _delayed_budget(self, num_requests: int, n: int, room: int) -> tuple[np.ndarray, int]:
        """(the t−2 snapshot as n = R·γ flat values, K_t = the largest argmax of Θ over K on it)."""
        snapshot = self._snapshots[0].reshape(-1)  # t−2 when two exist, else t−1
        if snapshot.size == n and num_requests + room <= self._buckets[-1]:
            return snapshot, ranking.delayed_budget(snapshot, num_requests, room, self._buckets,
                                                    self._check_sps())
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
                max_batch_tokens: int = 4096, draft_cost: DraftCost | None = None) -> Policy:
    """'none' | 'fixed:k' | 'mtp1' | 'threshold[:t]' (default t=0.5) | 'dspark-theory' | 'dspark'
    | 'dspark:delayed'
    (| 'retrospective', a deliberately non-lossless control for tests and the Appendix A harness)."""
    kw: dict[str, Any] = dict(sps=sps, gamma=gamma, max_batch_tokens=max_batch_tokens, draft_cost=draft_cost)
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
