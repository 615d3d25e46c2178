"""Deferred drafter context updates (architecture §7, drafting cost).

While the cost rule keeps drafting off, every step verifies only each request's anchor x0
(ℓ = 0), and calling `drafter.extend` for that one row per request costs a drafter call per
step (a BLS round trip under Triton) that buys nothing until the next draft. The engine
instead keeps those rows here and hands them to the drafter in one `extend` when a request
drafts again, when it is released (then they are dropped), or when `max_steps` steps are
buffered. The drafter's context ends up exactly as with per-step calls: every `DrafterLike`
grows a slot's context by the first `keep` rows of each call, and a deferred step's rows
are all kept (one x0 per request, keep 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DeferredRows:
    """Buffered rows of some requests, flat by request in step order."""

    which: list[int]  # positions (in the ids asked for) of the requests that had rows
    tokens: torch.Tensor  # [N] i64
    taps: torch.Tensor  # [N, tap_dim]
    cu_seqlens: torch.Tensor  # [len(which) + 1] i64 host
    keep: torch.Tensor  # [len(which)] i64 host: every buffered row is kept


class DeferredExtend:
    def __init__(self, max_steps: int = 64) -> None:
        self.max_steps = max_steps
        # one entry per deferred step: request id -> row, tokens [n], taps [n, tap_dim]
        self.steps: list[tuple[dict[str, int], torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def full(self) -> bool:
        return len(self.steps) >= self.max_steps

    def add(self, ids: list[str], tokens: torch.Tensor, taps: torch.Tensor) -> None:
        """One deferred step: row j of tokens [n] / taps [n, tap_dim] is request ids[j]'s x0."""
        if len(ids) != tokens.shape[0] or taps.shape[0] != tokens.shape[0]:
            raise ValueError(f"deferred step: {len(ids)} ids, {tokens.shape[0]} tokens, {taps.shape[0]} taps")
        if ids:
            self.steps.append(({rid: j for j, rid in enumerate(ids)}, tokens, taps))

    def take(self, ids: list[str]) -> DeferredRows | None:
        """Remove and return the buffered rows of `ids` (None when none of them has any)."""
        if not self.steps:
            return None
        offsets, total = [], 0
        for _, tokens, _ in self.steps:
            offsets.append(total)
            total += tokens.shape[0]
        rows: list[int] = []
        counts: list[int] = []
        which: list[int] = []
        for i, rid in enumerate(ids):
            mine = [off + rows_of[rid] for (rows_of, _, _), off in zip(self.steps, offsets) if rid in rows_of]
            if mine:
                rows += mine
                counts.append(len(mine))
                which.append(i)
        if not which:
            return None
        idx = torch.tensor(rows, dtype=torch.int64)
        tokens = torch.cat([t for _, t, _ in self.steps])[idx.to(self.steps[0][1].device)]
        taps = torch.cat([t for _, _, t in self.steps])[idx.to(self.steps[0][2].device)]
        for i in which:
            self.drop(ids[i])
        cu = torch.zeros(len(which) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(counts).cumsum(0)
        return DeferredRows(which, tokens, taps, cu, torch.tensor(counts, dtype=torch.int64))

    def drop(self, rid: str) -> None:
        """Forget a request's rows (released: its drafter slot is gone)."""
        for rows_of, _, _ in self.steps:
            rows_of.pop(rid, None)
        self.steps = [s for s in self.steps if s[0]]
