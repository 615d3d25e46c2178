"""Hybrid drafter: prompt lookup where the context repeats itself, the trained drafter elsewhere.

Per request and step it proposes the n-gram lookup's block when the context's suffix matches an
earlier occurrence of at least `min_match` tokens (code that echoes the prompt, lists, loops),
and the trained drafter's block otherwise; only the rows that need it run the trained drafter.
Both keep their context up to date on every step.

Lossless at any temperature: the choice reads only the committed context (prompt, emitted tokens
and the anchor), never a drafted token, so each row's proposal is exactly one drafter's and its
draft distribution is that drafter's: the trained one's p_d, or one-hot for a lookup.

Confidences: a lookup row's ĉ_j is the n-gram drafter's (learned in hindsight per match length),
written as the logit that the trained drafter's STS (which the engine applies to every row) maps
back onto it.
"""

from __future__ import annotations

import torch

from dspark.runtime.drafter.ngram import NGramDrafter
from dspark.runtime.interfaces import DraftBlock, block_width
from dspark.runtime.sampling import SamplingParams


class HybridDrafter:
    # source 1 (lookups) is calibrated online in hindsight by the n-gram drafter: the policy's own
    # recalibration, which sees only the verified prefix of each block, is not applied on top
    calibrated_sources = (1,)

    def __init__(self, ngram: NGramDrafter, neural, vocab_size: int, min_match: int = 2) -> None:
        if ngram.gamma != neural.gamma:
            raise ValueError(f"hybrid drafter: n-gram γ {ngram.gamma} != trained drafter γ {neural.gamma}")
        if not 1 <= min_match <= ngram.n:
            raise ValueError(f"hybrid drafter: min_match {min_match} outside 1..{ngram.n} (the lookup's n)")
        self.ngram, self.neural, self.vocab_size, self.min_match = ngram, neural, vocab_size, min_match
        self.gamma = neural.gamma
        self.sts_temperatures = list(getattr(neural, "sts_temperatures", None) or [])
        self.sts_shifts = list(getattr(neural, "sts_shifts", None) or [])
        g = self.gamma  # the STS the engine applies to every row, padded to γ once
        self._temps = torch.tensor((self.sts_temperatures + [1.0] * g)[:g])
        self._shifts = torch.tensor((self.sts_shifts + [0.0] * g)[:g])
        self.lookup_rows: dict[int, list[int] | None] = {}  # slot -> its last block if a lookup, else None
        self.lookups = self.proposals = 0  # rows proposed by the lookup / in all

    def start(self, slot: int, prompt: list[int], taps: torch.Tensor) -> None:
        self.ngram.start(slot, prompt, taps)
        self.neural.start(slot, prompt, taps)
        self.lookup_rows.pop(slot, None)

    def release(self, slot: int) -> None:
        self.ngram.release(slot)
        self.neural.release(slot)
        self.lookup_rows.pop(slot, None)

    def extend(self, slots: list[int], tokens: torch.Tensor, taps: torch.Tensor, cu_seqlens: torch.Tensor,
               keep: torch.Tensor) -> None:
        self.ngram.extend(slots, tokens, taps, cu_seqlens, keep)
        self.neural.extend(slots, tokens, taps, cu_seqlens, keep)

    def flush(self) -> None:
        """The trained drafter's pending context work, now (`DSparkDrafter.flush`)."""
        flush = getattr(self.neural, "flush", None)
        if flush is not None:
            flush()

    def _lookup_logits(self, k: int) -> torch.Tensor:
        """[γ] logits z with σ(z / T_j + b_j) = the n-gram drafter's ĉ_kj for a k-token match."""
        return self._temps * (self.ngram.confidence_logits(k) - self._shifts)

    def propose(self, slots: list[int], anchors: torch.Tensor, params: list[SamplingParams],
                uniforms: torch.Tensor) -> DraftBlock:
        dev, g = anchors.device, block_width(uniforms, self.gamma)
        matches = self.ngram.lookups(slots, anchors.tolist())
        use = [k >= self.min_match for _, k in matches]
        tokens = torch.empty(len(slots), g, dtype=torch.int64, device=dev)
        conf = torch.empty(len(slots), g, dtype=torch.float32, device=dev)
        rest = [i for i, u in enumerate(use) if not u]
        if rest:
            idx = torch.tensor(rest, device=dev)
            block = self.neural.propose([slots[i] for i in rest], anchors[idx], [params[i] for i in rest],
                                        uniforms[idx.to(uniforms.device)])
            tokens[idx] = block.tokens[:, :g]
            conf[idx] = block.conf_logits[:, :g].float()
        looked = [i for i, u in enumerate(use) if u]
        if looked:
            idx = torch.tensor(looked, device=dev)
            tokens[idx] = torch.tensor([matches[i][0][:g] for i in looked], dtype=torch.int64, device=dev)
            logits = {k: self._lookup_logits(k)[:g] for k in {matches[i][1] for i in looked}}  # once per k
            conf[idx] = torch.stack([logits[matches[i][1]] for i in looked]).to(dev)
        for s, (row, _), u in zip(slots, matches, use, strict=True):
            self.lookup_rows[s] = row if u else None
        self.lookups += len(looked)
        self.proposals += len(slots)
        return DraftBlock(tokens, conf, torch.tensor(use, dtype=torch.int64))  # source 1: lookup

    def draft_probs(self, slots: list[int], lengths: torch.Tensor) -> torch.Tensor | None:
        """Flat [Σℓ, V] in slot order: the trained drafter's rows, one-hot rows for lookups (None
        when every row is a lookup: the engine reads that as one-hot)."""
        lens = lengths.tolist()
        neural = [i for i, s in enumerate(slots) if self.lookup_rows.get(s) is None]
        if not neural:
            return None
        q_neural = self.neural.draft_probs([slots[i] for i in neural], lengths[neural])
        if len(neural) == len(slots):
            return q_neural
        parts, at = [], 0
        for s, n in zip(slots, lens, strict=True):
            row = self.lookup_rows.get(s)
            if row is None:
                parts.append(q_neural[at:at + n])
                at += n
            else:
                one_hot = q_neural.new_zeros(n, self.vocab_size)
                one_hot[torch.arange(n), torch.tensor(row[:n])] = 1.0
                parts.append(one_hot)
        return torch.cat(parts)
