"""Lossless verification of ragged draft blocks (docs/architecture.md §6).

Layout: request r verified ℓ_r draft tokens in a flattened target forward; its rows are
target_logits[cu[r] : cu[r+1]] with cu[r+1] - cu[r] == ℓ_r + 1. Row cu[r] + j is the
target's prediction for the token after position j of the request (row cu[r] is the anchor
x0 and predicts d_1; row cu[r] + ℓ_r predicts the bonus token).

Rule per request, j = 1..ℓ_r: accept d_j iff u_j · p_d(d_j) < p_t(d_j) (= u_j < min(1, p_t/p_d));
at the first rejection sample from norm(max(0, p_t − p_d)) (p_t when that mass is ~0);
if all ℓ_r are accepted sample the bonus from p_t. Greedy (T = 0) falls out of the same rule
because sampling_probs makes p_t one-hot on the argmax.

Randomness is pre-drawn per request as uniforms [R, γ+1] (γ for the acceptance tests, the
last one for the final inverse-CDF draw) from the request's own generator, so the Triton
kernel (dspark_kernels.rejection) and this torch reference consume identical randomness.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dspark.runtime.sampling import SamplingParams, param_tensors, sampling_probs

# Residual mass at or below this counts as zero: fall back to p_t (docs/architecture.md §6).
ZERO_MASS = 1e-6


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [R] i64, accepted draft tokens n_r (0..ℓ_r)
    tokens: torch.Tensor  # [R, γ+1] i64, d_1..d_n then the corrected/bonus token, padded with -1
    num_emitted: torch.Tensor  # [R] i64, n_r + 1


def use_triton(*tensors: torch.Tensor) -> bool:
    """Kernel or torch reference: DSPARK_KERNELS=triton forces the kernel (tests run it with
    TRITON_INTERPRET=1 on the CPU), =torch forces the reference, otherwise CUDA -> kernel."""
    mode = os.environ.get("DSPARK_KERNELS", "auto")
    if mode == "triton":
        return True
    if mode == "torch":
        return False
    return all(t.is_cuda for t in tensors)


def draw_uniforms(
    generators: list[torch.Generator | None], width: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """[R, width] f32 in [0, 1): row r from generators[r] (seeded requests are reproducible);
    rows without a generator share one draw from torch's default generator."""
    out = torch.empty(len(generators), width, dtype=torch.float32, device=device)
    shared = [r for r, g in enumerate(generators) if g is None]
    if shared:
        out[shared] = torch.rand(len(shared), width, device=device)
    for r, g in enumerate(generators):
        if g is not None:
            out[r] = torch.rand(width, generator=g, device=g.device).to(device)
    return out


def sample_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token v per row of unnormalised weights [R, V] >= 0: the first v whose inclusive cumsum
    exceeds u · total (u [R] in [0, 1)), clamped to the last v with positive weight."""
    cdf = weights.cumsum(-1)
    threshold = (u * cdf[:, -1]).unsqueeze(-1)
    token = (cdf <= threshold).sum(-1)
    v = weights.shape[-1]
    last_positive = v - 1 - (weights > 0).flip(-1).int().argmax(-1)
    return torch.minimum(token, last_positive)


def rejection_sample_ref(
    target_probs: torch.Tensor,  # [N, V] f32, p_t per flattened row
    draft_tokens: torch.Tensor,  # [R, γ] i64
    draft_probs: torch.Tensor | None,  # [R, γ, V] f32, or None = one-hot on the draft token
    cu_seqlens: torch.Tensor,  # [R+1] i64
    uniforms: torch.Tensor,  # [R, γ+1] f32
) -> VerifyResult:
    """Torch reference of the ragged rejection sampler, vectorised over requests."""
    n_rows, v = target_probs.shape
    r_count, gamma = draft_tokens.shape
    dev = target_probs.device
    starts = cu_seqlens[:-1]
    lens = cu_seqlens[1:] - starts - 1  # ℓ_r
    rows_r = torch.arange(r_count, device=dev)
    accepted_so_far = torch.ones(r_count, dtype=torch.bool, device=dev)
    num_accepted = torch.zeros(r_count, dtype=torch.int64, device=dev)
    for j in range(gamma):
        d = draft_tokens[:, j]
        row = (starts + j).clamp(max=n_rows - 1)
        pt = target_probs[row, d]
        pd = draft_probs[rows_r, j, d] if draft_probs is not None else torch.ones_like(pt)
        accepted_so_far &= (j < lens) & (uniforms[:, j] * pd < pt)
        num_accepted += accepted_so_far.long()
    final_row = starts + num_accepted
    p_t = target_probs[final_row].float()
    rejected = num_accepted < lens
    jj = num_accepted.clamp(max=max(gamma - 1, 0))
    if gamma == 0:
        p_d = torch.zeros_like(p_t)
    elif draft_probs is not None:
        p_d = draft_probs[rows_r, jj].float()
    else:
        p_d = torch.zeros_like(p_t).scatter_(-1, draft_tokens[rows_r, jj].unsqueeze(-1), 1.0)
    residual = (p_t - p_d * rejected[:, None].float()).clamp(min=0)
    zero_mass = residual.sum(-1) <= ZERO_MASS
    weights = torch.where(zero_mass[:, None], p_t, residual)
    last = sample_inverse_cdf(weights, uniforms[:, gamma])
    tokens = torch.full((r_count, gamma + 1), -1, dtype=torch.int64, device=dev)
    idx = torch.arange(gamma + 1, device=dev)[None, :]
    padded = torch.cat([draft_tokens, torch.zeros_like(last)[:, None]], dim=1)
    tokens = torch.where(idx < num_accepted[:, None], padded, tokens)
    tokens = torch.where(idx == num_accepted[:, None], last[:, None], tokens)
    return VerifyResult(num_accepted, tokens, num_accepted + 1)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    uniforms: torch.Tensor,
) -> VerifyResult:
    """Dispatch: Triton kernel on CUDA (or when forced, see use_triton), else the torch reference."""
    if use_triton(target_probs):
        from dspark_kernels.rejection import rejection_sample_triton

        return rejection_sample_triton(target_probs, draft_tokens, draft_probs, cu_seqlens, uniforms)
    return rejection_sample_ref(target_probs, draft_tokens, draft_probs, cu_seqlens, uniforms)


def verify_ragged(
    target_logits: torch.Tensor,  # [N, V]
    draft_tokens: torch.Tensor,  # [R, γ] i64
    draft_probs: torch.Tensor | None,  # [R, γ, V] f32 (None: deterministic drafts, one-hot)
    verify_lens: torch.Tensor,  # [R] i64, ℓ_r
    cu_seqlens: torch.Tensor,  # [R+1] i64, cu[r+1] - cu[r] == ℓ_r + 1
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    uniforms: torch.Tensor | None = None,  # [R, γ+1] f32: pre-drawn randomness (overrides generators)
) -> VerifyResult:
    """Accept a prefix of each request's draft plus one corrected/bonus token (docs/architecture.md §6).
    p_t = sampling_probs(target logits) with the request's temperature/top-k/top-p — the
    same filter the drafter applied to produce draft_probs."""
    r_count, gamma = draft_tokens.shape
    if len(params) != r_count or len(generators) != r_count:
        raise ValueError(f"need {r_count} params and generators, got {len(params)} and {len(generators)}")
    if not torch.equal((cu_seqlens[1:] - cu_seqlens[:-1]).cpu(), (verify_lens + 1).cpu()):
        raise ValueError("cu_seqlens[r+1] - cu_seqlens[r] must equal verify_lens[r] + 1")
    if verify_lens.numel() and int(verify_lens.max()) > gamma:
        raise ValueError(f"verify_lens must be <= γ = {gamma}")
    dev = target_logits.device
    lens_rows = cu_seqlens[1:] - cu_seqlens[:-1]
    t, k, p = (x.repeat_interleave(lens_rows) for x in param_tensors(params, dev))
    target_probs = sampling_probs(target_logits, t, k, p)
    if uniforms is None:
        uniforms = draw_uniforms(generators, gamma + 1, dev)
    return rejection_sample(target_probs, draft_tokens, draft_probs, cu_seqlens, uniforms)
