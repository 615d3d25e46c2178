"""The flattened ragged batch the target verifies (docs/architecture.md §2, §4): all requests' new
tokens concatenated, with `seq_idx` marking which request each token belongs to and
`cu_seqlens` giving each request's [start, end) in the flat layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RaggedBatch:
    tokens: torch.Tensor  # [N] i64, new tokens of all requests, concatenated
    seq_idx: torch.Tensor  # [N] i64, request index r in [0, R) of each token
    positions: torch.Tensor  # [N] i64, absolute position of each token in its sequence
    cu_seqlens: torch.Tensor  # [R+1] i64, request r owns tokens[cu_seqlens[r]:cu_seqlens[r+1]]
    slots: torch.Tensor  # [R] i64, KV-cache slot of each request

    @property
    def num_requests(self) -> int:
        return int(self.slots.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @classmethod
    def from_requests(
        cls, slots: list[int], token_lists: list[list[int]], start_positions: list[int], device="cpu"
    ) -> RaggedBatch:
        """Request r contributes token_lists[r] at positions start_positions[r], +1, ..."""
        if not (len(slots) == len(token_lists) == len(start_positions)):
            raise ValueError("slots, token_lists and start_positions must have the same length")
        lens = [len(t) for t in token_lists]
        if any(n < 1 for n in lens):
            raise ValueError("every request needs at least one new token")
        tokens = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.int64)
        seq_idx = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start_positions, lens)])
        cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(lens).cumsum(0)
        return cls(tokens.to(device), seq_idx.to(device), positions.to(device), cu.to(device),
                   torch.tensor(slots, dtype=torch.int64, device=device))

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        n, r = self.num_tokens, self.num_requests
        for name in ("tokens", "seq_idx", "positions", "cu_seqlens", "slots"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise ValueError(f"RaggedBatch.{name} must be a 1-D tensor")
        if self.seq_idx.numel() != n or self.positions.numel() != n:
            raise ValueError(f"RaggedBatch.seq_idx/positions must have {n} entries like tokens")
        if self.cu_seqlens.numel() != r + 1:
            raise ValueError(f"RaggedBatch.cu_seqlens must have R+1 = {r + 1} entries")
        if int(self.cu_seqlens[0]) != 0 or int(self.cu_seqlens[-1]) != n:
            raise ValueError("RaggedBatch.cu_seqlens must start at 0 and end at len(tokens)")
        if r and bool((self.cu_seqlens[1:] <= self.cu_seqlens[:-1]).any()):
            raise ValueError("RaggedBatch.cu_seqlens must be strictly increasing (>= 1 token per request)")
