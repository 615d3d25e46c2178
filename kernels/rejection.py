"""Ragged rejection sampling as a Triton kernel (architecture §6).

One program per request r walks its rows cu[r] .. cu[r+1]-1 of the flattened target
probabilities: accept d_j while u_j · p_d(d_j) < p_t(d_j), then draw the corrected token from
norm(max(0, p_t − p_d)) (p_t when that mass is ~0) or the bonus token from p_t, by inverse
CDF over the vocabulary in BLOCK_V chunks (pass 1: mass, pass 2: running cumsum).
Draft probabilities are flat: row cu[r] - r + j holds p_d of d_{r,j+1} (one row per verified
draft, see dspark_kernels.reference). Torch reference: reference.rejection_sample_ref (same
uniforms in, same tokens out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_kernels.reference import ZERO_MASS, rejection_sample_ref

__all__ = ["rejection_sample_triton", "rejection_sample_ref"]


@triton.jit
def _rejection_kernel(
    target_probs_ptr,  # [N, V] f32, p_t of every flattened row
    draft_tokens_ptr,  # [R, GAMMA] i64
    draft_probs_ptr,  # [Σℓ, V] f32 flat, row cu[r] - r + j (not read when HAS_DRAFT_PROBS is False)
    cu_seqlens_ptr,  # [R+1] i64, request r owns rows cu[r] .. cu[r+1]-1 (ℓ_r + 1 rows)
    uniforms_ptr,  # [R, GAMMA+1] f32, GAMMA acceptance uniforms then one for the final draw
    out_tokens_ptr,  # [R, GAMMA+1] i64, accepted drafts, corrected/bonus token, -1 padding
    out_accepted_ptr,  # [R] i64, number of accepted drafts n_r
    V,
    GAMMA: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    ZERO_MASS_EPS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two >= GAMMA + 1
):
    r = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_seqlens_ptr + r)
    verify_len = tl.load(cu_seqlens_ptr + r + 1) - start - 1
    # Accept left to right; stop at the first rejection.
    n = verify_len * 0
    go = verify_len > 0
    while go:
        d = tl.load(draft_tokens_ptr + r * GAMMA + n)
        pt = tl.load(target_probs_ptr + (start + n) * V + d)
        if HAS_DRAFT_PROBS:
            pd = tl.load(draft_probs_ptr + (start - r + n) * V + d)
        else:
            pd = 1.0
        u = tl.load(uniforms_ptr + r * (GAMMA + 1) + n)
        accepted = u * pd < pt
        n = tl.where(accepted, n + 1, n)
        go = accepted & (n < verify_len)

    rejected = n < verify_len
    row = start + n
    jj = tl.minimum(n, GAMMA - 1)
    d_rej = tl.load(draft_tokens_ptr + r * GAMMA + jj, mask=rejected, other=-1)  # -1: nothing to subtract
    pd_end = tl.where(rejected, V, 0)  # p_d is subtracted only after a rejection
    offs0 = tl.arange(0, BLOCK_V)

    # Pass 1: residual mass (and p_t mass for the fallback), last index with positive weight.
    res_mass = tl.zeros((), tl.float32)
    pt_mass = tl.zeros((), tl.float32)
    res_last = tl.full((), -1, tl.int64)
    pt_last = tl.full((), -1, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + offs0
        in_v = offs < V
        pt = tl.load(target_probs_ptr + row * V + offs, mask=in_v, other=0.0)
        if HAS_DRAFT_PROBS:
            pd = tl.load(draft_probs_ptr + (start - r + jj) * V + offs, mask=offs < pd_end, other=0.0)
        else:
            pd = tl.where(offs == d_rej, 1.0, 0.0)
        res = tl.maximum(pt - pd, 0.0)
        res_mass += tl.sum(res, 0)
        pt_mass += tl.sum(pt, 0)
        res_last = tl.maximum(res_last, tl.max(tl.where(res > 0, offs, -1).to(tl.int64), 0))
        pt_last = tl.maximum(pt_last, tl.max(tl.where(pt > 0, offs, -1).to(tl.int64), 0))
    fallback = res_mass <= ZERO_MASS_EPS
    total = tl.where(fallback, pt_mass, res_mass)
    last_positive = tl.where(fallback, pt_last, res_last)
    threshold = tl.load(uniforms_ptr + r * (GAMMA + 1) + GAMMA) * total

    # Pass 2: token = number of v whose inclusive cumsum is <= threshold (first v above it).
    count = tl.zeros((), tl.int64)
    running = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + offs0
        in_v = offs < V
        pt = tl.load(target_probs_ptr + row * V + offs, mask=in_v, other=0.0)
        if HAS_DRAFT_PROBS:
            pd = tl.load(draft_probs_ptr + (start - r + jj) * V + offs, mask=offs < pd_end, other=0.0)
        else:
            pd = tl.where(offs == d_rej, 1.0, 0.0)
        w = tl.where(fallback, pt, tl.maximum(pt - pd, 0.0))
        cdf = running + tl.cumsum(w, 0)
        count += tl.sum(((cdf <= threshold) & in_v).to(tl.int64), 0)
        running += tl.sum(w, 0)
    token = tl.minimum(count, last_positive)

    idx = tl.arange(0, BLOCK_G)
    drafts = tl.load(draft_tokens_ptr + r * GAMMA + idx, mask=idx < GAMMA, other=-1)
    out = tl.where(idx < n, drafts, tl.where(idx == n, token, -1))
    tl.store(out_tokens_ptr + r * (GAMMA + 1) + idx, out, mask=idx < GAMMA + 1)
    tl.store(out_accepted_ptr + r, n)


def rejection_sample_triton(
    target_probs: torch.Tensor,  # [N, V] f32
    draft_tokens: torch.Tensor,  # [R, γ] i64
    draft_probs: torch.Tensor | None,  # [Σℓ, V] f32 flat, or None (one-hot drafts)
    cu_seqlens: torch.Tensor,  # [R+1] i64
    uniforms: torch.Tensor,  # [R, γ+1] f32
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [R] i64, tokens [R, γ+1] i64
    """Launch one program per request; same contract as reference.rejection_sample_ref."""
    r_count, gamma = draft_tokens.shape
    v = target_probs.shape[1]
    dev = target_probs.device
    target_probs = target_probs.float().contiguous()
    draft_tokens = draft_tokens.long().contiguous()
    has_draft_probs = draft_probs is not None and draft_probs.shape[0] > 0
    draft_probs = draft_probs.float().contiguous() if has_draft_probs else target_probs
    out_tokens = torch.empty(r_count, gamma + 1, dtype=torch.int64, device=dev)
    out_accepted = torch.empty(r_count, dtype=torch.int64, device=dev)
    if r_count:
        _rejection_kernel[(r_count,)](
            target_probs, draft_tokens, draft_probs, cu_seqlens.long().contiguous(),
            uniforms.float().contiguous(), out_tokens, out_accepted, v,
            GAMMA=gamma, HAS_DRAFT_PROBS=has_draft_probs, ZERO_MASS_EPS=ZERO_MASS,
            BLOCK_V=min(block_v, triton.next_power_of_2(v)), BLOCK_G=triton.next_power_of_2(gamma + 1),
        )
    return out_accepted, out_tokens
