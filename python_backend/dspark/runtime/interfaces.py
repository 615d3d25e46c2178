"""The two contracts the engine loop talks to (docs/architecture.md §2).

In process the engine is given `dspark.runtime.target.TargetEngine` and a drafter from
`dspark.runtime.drafter`; inside Triton it is given BLS stubs (`dspark.serving`) that send the
same calls to the `target` and `drafter` models. Everything crossing these interfaces is a
tensor, an int, or a list of slots / `SamplingParams`, so every call maps onto Triton tensors.

Devices: tensors returned by either side live on the target's device; an argument documented
as "host" is a CPU tensor the engine already holds (no device sync is needed to build it).

One engine step, in call order (R requests, γ drafts each, ℓ_r = verified drafts of request r):
  1. drafter.propose(slots, anchors, params, uniforms)  -> DraftBlock: tokens [R, γ], conf_logits [R, γ]
  2. the scheduler picks ℓ [R] from the confidences (host)
  3. drafter.draft_probs(slots, ℓ)                     -> p_d of the verified, sampled rows [Σℓ, V] or None
  4. target.verify(batch of [x0_r, d_r1 .. d_rℓ_r])     -> logits [N, V], taps [N, tap_dim]
  5. accept / resample, then target.rollback and
     drafter.extend(slots, batch tokens, taps, cu_seqlens, keep = 1 + accepted)
The engine runs step 1 of the next step right after step 5 of this one, so the drafter's
`extend` inputs may still be on the device (`keep` is a device tensor there).
"""

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
        """-> logits [N, V], taps [N, tap_dim]; appends every new token's K/V to its slot.
        `batch.tokens` may already be on the target's device, the other fields are host."""
        ...


@dataclass
class DraftBlock:
    tokens: torch.Tensor  # [R, γ] i64, the proposed tokens d_1..d_γ
    conf_logits: torch.Tensor  # [R, γ] f32, confidence logits z_k (survival via STS, architecture §7)
    # [R] i64 host or None: which of the drafter's proposers made each row (a hybrid's lookup or
    # trained drafter); the policy recalibrates each source's survivals apart. None: one source.
    sources: torch.Tensor | None = None


def block_width(uniforms: torch.Tensor, gamma: int) -> int:
    """w = uniforms.shape[1], the tokens a `DrafterLike.propose` drafts per request (1 ≤ w ≤ γ)."""
    if uniforms.dim() != 2 or not 1 <= uniforms.shape[1] <= gamma:
        raise ValueError(f"propose: uniforms must be [R, w] with 1 <= w <= gamma={gamma}, "
                         f"got shape {tuple(uniforms.shape)}")
    return int(uniforms.shape[1])


class DrafterLike(Protocol):
    gamma: int

    def start(self, slot: int, prompt: list[int], taps: torch.Tensor) -> None:
        """New request in `slot`: context = the prompt's target taps [L, tap_dim]."""
        ...

    def release(self, slot: int) -> None: ...

    def extend(
        self,
        slots: list[int],  # R
        tokens: torch.Tensor,  # [N] i64, the verified batch: [x0_r, d_r1 .. d_rℓ_r] per request
        taps: torch.Tensor,  # [N, tap_dim], the target's taps of those tokens
        cu_seqlens: torch.Tensor,  # [R+1] i64 host, request r owns rows cu[r] .. cu[r+1]-1
        keep: torch.Tensor,  # [R] i64 (device or host), 1 <= keep[r] <= cu[r+1] - cu[r]
    ) -> None:
        """Slot r's context grows by its first keep[r] rows (the anchor and the accepted drafts).
        Every emitted token reaches it, also when ℓ_r = 0 or drafting was skipped; the rows of
        skipped steps may arrive later, several per slot in one call (all kept), but always
        before the slot's next propose."""
        ...

    def propose(
        self,
        slots: list[int],  # R
        anchors: torch.Tensor,  # [R] i64, last emitted token of each request (not yet in target KV)
        params: list[SamplingParams],  # R, the request's temperature / top-k / top-p (greedy: argmax)
        uniforms: torch.Tensor,  # [R, w ≤ γ] f32 in [0, 1): the inverse-CDF draw of each sampled position
    ) -> DraftBlock:
        """Draft w = uniforms.shape[1] tokens per request, 1 ≤ w ≤ γ (`block_width`): the first w
        of the block it would draft at γ. The engine asks for fewer when the step cannot verify
        more (one draft per request: MTP-1, a uniform step); a drafter may return more columns,
        of which the engine reads the first w. The drafter keeps, per slot, the distribution each
        sampled token was drawn from until the slot's next propose (read back by `draft_probs`)."""
        ...

    def draft_probs(
        self,
        slots: list[int],  # R, a subset of the slots of the latest propose calls, any order
        lengths: torch.Tensor,  # [R] i64 host, ℓ_r: the drafts of slot r that will be verified
    ) -> torch.Tensor | None:
        """The exact distributions d_r1 .. d_rℓ_r were sampled from, flat [Σ ℓ_r, V] f32, rows in
        the order (r, k), counting ONLY slots whose latest block was sampled (T > 0): greedy
        requests contribute no rows. None: this drafter's tokens are deterministic (one-hot)."""
        ...
