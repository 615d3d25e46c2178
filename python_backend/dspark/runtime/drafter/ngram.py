"""Prompt lookup / n-gram drafter (docs/architecture.md §5 baselines): no model. It proposes the tokens that
followed the most recent earlier occurrence of the longest suffix (n down to min_n tokens)
of the request's own sequence (prompt + accepted tokens + anchor).

Proposals are deterministic, so the exact draft distribution is one-hot on each proposed
token: `draft_probs` returns None, which `dspark.runtime.verify` reads as one-hot (lossless at
any temperature: a rejected token is resampled from p_t with that token removed). It runs on
the host (a baseline, not the device-first hot path).

Confidences are learned in hindsight: once the γ tokens after a position where a block was
proposed are emitted, the drafter knows how many of its lookups there matched them. Per match
length k and draft position j it keeps decayed counts of lookups alive at j and surviving it:
ĉ_kj = (survived + w·c0_k) / (alive + w), with the static prior c0_k = σ(hit_logit +
k·hit_logit_per_token) ≈ 0.44 / 0.62 / 0.78 for 1 / 2 / 3-token matches (σ(miss_logit) without
one). Exact at any temperature: a one-hot draft x is accepted with probability p_t(x), the
chance that the target's own sample is x. Only the positions where blocks were proposed count
(not every position: steps start where the last block stopped, inside or after a copied run,
not uniformly), whatever ℓ the scheduler then verified, so truncation hides nothing. It reads
emitted tokens only, never this step's drafts, so no token influences its own admission.
Copied text runs long: a 3-token match's ĉ rises with j, which one constant per k cannot say."""

from __future__ import annotations

import math

import torch

from dspark.runtime.interfaces import DraftBlock, block_width
from dspark.runtime.sampling import SamplingParams


class NGramDrafter:
    def __init__(self, gamma: int = 7, n: int = 3, min_n: int = 1, miss_logit: float = -6.0,
                 hit_logit: float = -1.0, hit_logit_per_token: float = 0.75, learn: bool = True,
                 prior_weight: float = 4.0, decay: float = 0.998) -> None:
        """learn: hindsight confidences (module doc); prior_weight w: pseudo-counts of the static
        prior; decay: the counts' factor per scored block (memory ≈ 1 / (1 − decay) blocks)."""
        if gamma < 1 or not 1 <= min_n <= n:
            raise ValueError(f"need gamma >= 1 and 1 <= min_n <= n (got {gamma}, {min_n}, {n})")
        self.gamma, self.n, self.min_n = gamma, n, min_n
        self.miss_logit, self.hit_logit, self.hit_logit_per_token = miss_logit, hit_logit, hit_logit_per_token
        self.learn, self.prior_weight, self.decay = learn, prior_weight, decay
        self.contexts: dict[int, list[int]] = {}  # slot -> prompt + accepted tokens
        # slot -> (its context list, positions indexed, per k = 1..n: k-gram -> end position of
        # its latest occurrence): `match` on a context incrementally (`_match_context`)
        self._index: dict[int, tuple[list[int], int, list[dict[tuple[int, ...], int]]]] = {}
        # slot -> {anchor position q: (proposed tokens, k)}: blocks awaiting their γ successors
        self.pending: dict[int, dict[int, tuple[list[int], int]]] = {}
        # [k, j, 0]: decayed count of k-match lookups alive at draft position j; [k, j, 1]: surviving it
        self.counts = torch.zeros(n + 1, gamma, 2, dtype=torch.float64)

    def start(self, slot: int, prompt: list[int], taps: torch.Tensor) -> None:
        self.contexts[slot] = list(prompt)
        self.pending[slot] = {}

    def release(self, slot: int) -> None:
        if slot in self.contexts:
            self._score(slot, final=True)  # blocks near the end: what is known of their successors
        self.contexts.pop(slot, None)
        self.pending.pop(slot, None)
        self._index.pop(slot, None)

    def extend(self, slots: list[int], tokens: torch.Tensor, taps: torch.Tensor, cu_seqlens: torch.Tensor,
               keep: torch.Tensor) -> None:
        flat, starts = tokens.tolist(), cu_seqlens[:-1].tolist()
        for slot, start, n in zip(slots, starts, keep.tolist(), strict=True):
            self.contexts[slot].extend(flat[start:start + n])
            self._score(slot)

    def _score(self, slot: int, final: bool = False) -> None:
        """Hindsight: the slot's proposed blocks whose γ successors are emitted (`final`: all of
        them, each counted as far as its successors are known)."""
        ctx, pending = self.contexts[slot], self.pending.get(slot)
        if not pending:
            return
        for q in [q for q in pending if final or q + self.gamma < len(ctx)]:
            drafts, k = pending.pop(q)
            truth = ctx[q + 1:q + 1 + self.gamma]
            accepted = next((j for j, (d, t) in enumerate(zip(drafts, truth)) if d != t), len(truth))
            self.counts *= self.decay
            self.counts[k, :min(accepted + 1, len(truth)), 0] += 1.0  # alive where known
            self.counts[k, :accepted, 1] += 1.0

    def prior_logit(self, k: int) -> float:
        """The static confidence logit of a k-token match (k = 0: no match)."""
        return self.hit_logit + self.hit_logit_per_token * k if k else self.miss_logit

    def prior(self, k: int) -> float:
        """The static ĉ of a k-token match."""
        return 1.0 / (1.0 + math.exp(-self.prior_logit(k)))

    def confidence_logits(self, k: int) -> torch.Tensor:
        """[γ] f32 logits of ĉ_kj, j = 0..γ−1 (the static prior's when not learning)."""
        if not self.learn:
            return torch.full((self.gamma,), self.prior_logit(k), dtype=torch.float32)
        c0, w = self.prior(k), self.prior_weight
        alive, survived = self.counts[k, :, 0], self.counts[k, :, 1]
        c = ((survived + w * c0) / (alive + w)).clamp(1e-4, 1.0 - 1e-4)
        return torch.log(c / (1.0 - c)).float()

    def lookups(self, slots: list[int], anchors: list[int]) -> list[tuple[list[int], int]]:
        """`match` for each slot's context + anchor; remembers each block for hindsight scoring."""
        rows = []
        for s, a in zip(slots, anchors, strict=True):
            ctx = self.contexts[s]
            row = self._match_context(s, ctx, a)
            if self.learn:
                self.pending[s][len(ctx)] = row  # the anchor's position once it joins the context
            rows.append(row)
        return rows

    def propose(self, slots: list[int], anchors: torch.Tensor, params: list[SamplingParams],
                uniforms: torch.Tensor) -> DraftBlock:
        w = block_width(uniforms, self.gamma)
        rows = self.lookups(slots, anchors.tolist())
        tokens = torch.tensor([t[:w] for t, _ in rows], dtype=torch.int64).reshape(len(rows), w)
        logits = {k: self.confidence_logits(k)[:w] for k in {k for _, k in rows}}
        conf = torch.stack([logits[k] for _, k in rows]) if rows else torch.zeros(0, w)
        return DraftBlock(tokens.to(anchors.device), conf.to(anchors.device))

    def draft_probs(self, slots: list[int], lengths: torch.Tensor) -> None:
        return None  # deterministic drafts: one-hot

    def lookup(self, seq: list[int]) -> tuple[list[int], float]:
        """-> (γ proposed tokens, the static prior's confidence logit): `match`."""
        tokens, k = self.match(seq)
        return tokens, self.prior_logit(k)

    def _match_context(self, slot: int, ctx: list[int], anchor: int) -> tuple[list[int], int]:
        """`match(ctx + [anchor])` from the slot's index of its context's k-grams, brought up to
        date first (a context only grows; a new list starts a new index): O(n) dict lookups a step
        instead of a scan of the whole context per k."""
        entry = self._index.get(slot)
        if entry is None or entry[0] is not ctx or entry[1] > len(ctx):
            entry = (ctx, 0, [{} for _ in range(self.n + 1)])
        _, done, grams = entry
        for end in range(done, len(ctx)):  # later occurrences overwrite: the latest wins
            for k in range(1, min(self.n, end + 1) + 1):
                grams[k][tuple(ctx[end - k + 1:end + 1])] = end
        self._index[slot] = (ctx, len(ctx), grams)
        size = len(ctx) + 1  # seq = ctx + [anchor]; an occurrence inside ctx has a successor
        for k in range(min(self.n, size - 1), self.min_n - 1, -1):
            last = grams[k].get(tuple(ctx[len(ctx) - k + 1:]) + (anchor,))  # the last k of seq
            if last is not None:
                i = last - k + 1
                period = size - i - k
                at = [i + k + (j % period) for j in range(self.gamma)]
                return [ctx[t] if t < len(ctx) else anchor for t in at], k
        return [anchor] * self.gamma, 0

    def match(self, seq: list[int]) -> tuple[list[int], int]:
        """-> (γ proposed tokens, matched suffix length k; 0 = no match, the tokens repeat the last
        one). A match at i (seq[i:i+k] == the last k tokens, i + k < len(seq)) continues with
        seq[i+k:]; past the end it wraps with period len(seq) − i − k, which is what a repeating
        loop does."""
        t = torch.tensor(seq, dtype=torch.int64)
        for k in range(min(self.n, len(seq) - 1), self.min_n - 1, -1):
            windows = t[:-1].unfold(0, k, 1)  # [len−k, k], every k-window that has a successor
            hits = (windows == t[-k:]).all(-1).nonzero()
            if hits.numel():
                i = int(hits[-1])
                period = len(seq) - i - k
                return [seq[i + k + (j % period)] for j in range(self.gamma)], k
        return [seq[-1]] * self.gamma, 0
