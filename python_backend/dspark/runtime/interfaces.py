"""The two contracts the engine loop talks to (docs/architecture.md §2). The in-process engine passes
`dspark.runtime.target.TargetEngine` and a drafter from `dspark.runtime.drafter`; inside Triton the BLS
model passes thin stubs that forward the same calls to the `target` / `drafter` models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dspark.runtime.batch import RaggedBatch
from dspark.runtime.sampling import SamplingParams


class TargetLike(Protocol):
    vocab_size: int
    max_seq_len: int
    tap_dim: int  # n_taps * hidden_size: width of the taps rows returned below

    def allocate(self) -> int: ...  # a free KV slot; RuntimeError when none is free
    def release(self, slot: int) -> None: ...
    def length(self, slot: int) -> int: ...  # tokens cached in the slot
    def rollback(self, slot: int, length: int) -> None: ...  # keep the first `length` tokens
    def num_free_slots(self) -> int: ...

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> last-token logits [R, V], taps per prompt [L_r, tap_dim]; caches the prompts."""
        ...

    def verify(self, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> logits [N, V], taps [N, tap_dim]; appends every new token's K/V to its slot."""
        ...


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # [R, γ] i64, the proposed tokens d_1..d_γ
    probs: torch.Tensor  # [R, γ, V] f32, the exact distribution each d_k was sampled from
    conf_logits: torch.Tensor  # [R, γ] f32, confidence logits z_k (survival via STS, docs/architecture.md §7)


class DrafterLike(Protocol):
    gamma: int

    def start(self, slot: int, prompt: list[int], taps: torch.Tensor) -> None:
        """New request in `slot`: context = the prompt's target taps [L, tap_dim]."""
        ...

    def release(self, slot: int) -> None: ...

    def extend(self, slots: list[int], tokens: list[torch.Tensor], taps: list[torch.Tensor]) -> None:
        """Append the accepted tokens [n_r] and their target taps [n_r, tap_dim] to each slot's context."""
        ...

    def propose(
        self,
        slots: list[int],
        anchors: torch.Tensor,  # [R] i64, last emitted token of each request (not yet in target KV)
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> DraftBlock: ...
