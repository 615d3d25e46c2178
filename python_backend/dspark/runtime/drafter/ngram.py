"""Prompt lookup / n-gram drafter (docs/architecture.md §5 baselines): no model. It proposes the tokens that
followed the most recent earlier occurrence of the longest suffix (n down to min_n tokens)
of the request's own sequence (prompt + accepted tokens + anchor).

Proposals are deterministic, so the exact draft distribution is one-hot on each proposed
token: `draft_probs` returns None, which `dspark.runtime.verify` reads as one-hot (lossless at
any temperature: a rejected token is resampled from p_t with that token removed). It runs on
the host (a baseline, not the device-first hot path). Confidence
logits are high when a match was found (more so for longer matches) and low otherwise,
so threshold / DSpark policies verify lookups and skip guesses. Defaults give ĉ ≈ 0.44 /
0.62 / 0.78 for 1 / 2 / 3-token matches (uncalibrated; `dspark calibrate` fits STS)."""

from __future__ import annotations

import torch

from dspark.runtime.interfaces import DraftBlock
from dspark.runtime.sampling import SamplingParams


class NGramDrafter:
    def __init__(self, gamma: int = 7, n: int = 3, min_n: int = 1, miss_logit: float = -6.0,
                 hit_logit: float = -1.0, hit_logit_per_token: float = 0.75) -> None:
        if gamma < 1 or not 1 <= min_n <= n:
            raise ValueError(f"need gamma >= 1 and 1 <= min_n <= n (got {gamma}, {min_n}, {n})")
        self.gamma, self.n, self.min_n = gamma, n, min_n
        self.miss_logit, self.hit_logit, self.hit_logit_per_token = miss_logit, hit_logit, hit_logit_per_token
        self.contexts: dict[int, list[int]] = {}  # slot -> prompt + accepted tokens

    def start(self, slot: int, prompt: list[int], taps: torch.Tensor) -> None:
        self.contexts[slot] = list(prompt)

    def release(self, slot: int) -> None:
        self.contexts.pop(slot, None)

    def extend(self, slots: list[int], tokens: torch.Tensor, taps: torch.Tensor, cu_seqlens: torch.Tensor,
               keep: torch.Tensor) -> None:
        flat, starts = tokens.tolist(), cu_seqlens[:-1].tolist()
        for slot, start, n in zip(slots, starts, keep.tolist(), strict=True):
            self.contexts[slot].extend(flat[start:start + n])

    def propose(self, slots: list[int], anchors: torch.Tensor, params: list[SamplingParams],
                uniforms: torch.Tensor) -> DraftBlock:
        rows = [self.lookup(self.contexts[s] + [a]) for s, a in zip(slots, anchors.tolist())]
        tokens = torch.tensor([t for t, _ in rows], dtype=torch.int64).reshape(len(rows), self.gamma)
        conf = torch.tensor([z for _, z in rows], dtype=torch.float32)[:, None].expand(-1, self.gamma)
        return DraftBlock(tokens.to(anchors.device), conf.contiguous().to(anchors.device))

    def draft_probs(self, slots: list[int], lengths: torch.Tensor) -> None:
        return None  # deterministic drafts: one-hot

    def lookup(self, seq: list[int]) -> tuple[list[int], float]:
        """-> (γ proposed tokens, confidence logit). A match at i (seq[i:i+k] == the last k tokens,
        i + k < len(seq)) continues with seq[i+k:]; past the end it wraps with period
        len(seq) − i − k, which is what a repeating loop does."""
        t = torch.tensor(seq, dtype=torch.int64)
        for k in range(min(self.n, len(seq) - 1), self.min_n - 1, -1):
            windows = t[:-1].unfold(0, k, 1)  # [len−k, k], every k-window that has a successor
            hits = (windows == t[-k:]).all(-1).nonzero()
            if hits.numel():
                i = int(hits[-1])
                period = len(seq) - i - k
                return [seq[i + k + (j % period)] for j in range(self.gamma)], \
                    self.hit_logit + self.hit_logit_per_token * k
        return [seq[-1]] * self.gamma, self.miss_logit
