"""Lossless verification of ragged draft blocks (architecture §6).

Layout: request r verified ℓ_r draft tokens in a flattened target forward; its rows are
target_logits[cu[r] : cu[r+1]] with cu[r+1] - cu[r] == ℓ_r + 1. Row cu[r] + j is the
target's prediction for the token after position j of the request (row cu[r] is the anchor
x0 and predicts d_1; row cu[r] + ℓ_r predicts the bonus token).

Greedy requests (T = 0): accept d_j while it equals the argmax of row cu[r] + j − 1; the
emitted token is the argmax at the first mismatch (or of the bonus row). One argmax per row:
no one-hot [N, V] tensor, no draft probabilities.

Sampled requests: accept d_j iff u_j · p_d(d_j) < p_t(d_j) (= u_j < min(1, p_t/p_d)); at the
first rejection sample from norm(max(0, p_t − p_d)) (p_t when that mass is ~0); if all ℓ_r are
accepted sample the bonus from p_t. p_d comes flat, one row per verified draft of a sampled
request ([Σℓ, V]; None = deterministic drafts, one-hot), and p_t is computed for the sampled
requests' rows only. The kernel is dspark_kernels' rejection sampler (Triton on CUDA, its torch
reference elsewhere), chosen by dspark_kernels.dispatch.

Randomness comes in as uniforms [R, γ+1] (γ for the acceptance tests, the last one for the
final inverse-CDF draw), drawn by the caller from each request's counter-based stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.runtime.cpu_argmax import row_argmax
from dspark.runtime.sampling import SamplingBatch
from dspark_kernels.dispatch import kernel


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [R] i64, accepted draft tokens n_r (0..ℓ_r)
    tokens: torch.Tensor  # [R, γ+1] i64, d_1..d_n then the corrected/bonus token, padded with -1
    num_emitted: torch.Tensor  # [R] i64, n_r + 1


def rejection_sample(
    target_probs: torch.Tensor,  # [N, V] f32
    draft_tokens: torch.Tensor,  # [R, γ] i64
    draft_probs: torch.Tensor | None,  # [Σℓ, V] f32 flat (row cu[r] - r + j), None = one-hot drafts
    cu_seqlens: torch.Tensor,  # [R+1] i64
    uniforms: torch.Tensor,  # [R, γ+1] f32
) -> VerifyResult:
    """The ragged rejection sampler on sampled requests (kernel or reference, see dispatch)."""
    n, tokens = kernel("rejection_sample", target_probs)(target_probs, draft_tokens, draft_probs,
                                                         cu_seqlens.to(target_probs.device), uniforms)
    return VerifyResult(n, tokens, n + 1)


def greedy_accept(
    target_argmax: torch.Tensor,  # [N] i64, argmax of every flattened target row
    draft_tokens: torch.Tensor,  # [R, γ] i64
    verify_lens: torch.Tensor,  # [R] i64 host, ℓ_r
    cu_seqlens: torch.Tensor,  # [R+1] i64 host
) -> VerifyResult:
    """Greedy verification: accept the longest prefix equal to the target's argmax, then emit
    the argmax at the first mismatch (or the bonus row). An accepted draft equals the argmax of
    its row, so the emitted tokens are the argmaxes of rows 0..n."""
    r, gamma = draft_tokens.shape
    dev = target_argmax.device
    j = torch.arange(gamma + 1)
    rows = cu_seqlens[:-1, None] + torch.minimum(j, verify_lens[:, None])
    best = target_argmax[rows.to(dev)]  # [R, γ+1]: row j predicts the token after position j
    live = (j[:gamma] < verify_lens[:, None]).to(dev)
    n = ((draft_tokens == best[:, :gamma]) & live).long().cumprod(-1).sum(-1)
    tokens = torch.where(j.to(dev) <= n[:, None], best, -1)
    return VerifyResult(n, tokens, n + 1)


def verify_ragged(
    target_logits: torch.Tensor,  # [N, V]
    draft_tokens: torch.Tensor,  # [R, γ] i64
    verify_lens: torch.Tensor,  # [R] i64 host, ℓ_r
    cu_seqlens: torch.Tensor,  # [R+1] i64 host, cu[r+1] - cu[r] == ℓ_r + 1
    sampling: SamplingBatch,  # R rows: temperature / top-k / top-p, host greedy mask
    draft_probs: torch.Tensor | None,  # [Σ ℓ_r over sampled r, V] f32, None = one-hot drafts
    uniforms: torch.Tensor,  # [R, γ+1] f32 (any device; only sampled rows are read)
) -> VerifyResult:
    """Accept a prefix of each request's draft plus one corrected/bonus token (architecture §6).
    p_t = sampling_probs(target logits) with the request's temperature/top-k/top-p — the
    same filter the drafter applied to produce draft_probs. No host sync: every size and
    index is computed from the host tensors."""
    r_count, gamma = draft_tokens.shape
    verify_lens, cu_seqlens = verify_lens.cpu(), cu_seqlens.cpu()
    lens, cu = verify_lens.tolist(), cu_seqlens.tolist()  # checked on the host, as lists (a few µs)
    if len(sampling) != r_count or len(lens) != r_count or len(cu) != r_count + 1:
        raise ValueError(f"verify_ragged: need {r_count} sampling rows, verify_lens and {r_count + 1} "
                         f"cu_seqlens, got {len(sampling)}, {len(lens)}, {len(cu)}")
    if any(cu[i + 1] - cu[i] != n + 1 for i, n in enumerate(lens)):
        raise ValueError("verify_ragged: cu_seqlens[r+1] - cu_seqlens[r] must equal verify_lens[r] + 1")
    if lens and (max(lens) > gamma or min(lens) < 0):
        raise ValueError(f"verify_ragged: verify_lens must be in [0, γ = {gamma}]")
    if cu[-1] != target_logits.shape[0]:
        raise ValueError(f"verify_ragged: cu_seqlens ends at {cu[-1]}, "
                         f"target_logits has {target_logits.shape[0]} rows")
    greedy_rows = sampling.greedy.tolist()
    n_draft_rows = sum(n for n, greedy in zip(lens, greedy_rows) if not greedy)
    if draft_probs is not None and tuple(draft_probs.shape) != (n_draft_rows, target_logits.shape[1]):
        raise ValueError(f"verify_ragged: draft_probs must be [Σℓ over sampled requests = {n_draft_rows}, "
                         f"{target_logits.shape[1]}], got {tuple(draft_probs.shape)}")
    if all(greedy_rows):
        return greedy_accept(_argmax(target_logits), draft_tokens, verify_lens, cu_seqlens)
    sampled = (~sampling.greedy).nonzero().squeeze(-1)
    dev = target_logits.device
    if sampled.numel() == r_count:
        return _sampled(target_logits, draft_tokens, verify_lens, cu_seqlens, sampling, draft_probs,
                        uniforms.to(dev))
    greedy = sampling.greedy.nonzero().squeeze(-1)
    g_lens, s_lens = verify_lens[greedy], verify_lens[sampled]
    rows_g, rows_s = _rows(cu_seqlens, greedy), _rows(cu_seqlens, sampled)
    out_g = greedy_accept(_argmax(target_logits[rows_g.to(dev)]), draft_tokens[greedy.to(dev)], g_lens,
                          _cu(g_lens))
    out_s = _sampled(target_logits[rows_s.to(dev)], draft_tokens[sampled.to(dev)], s_lens, _cu(s_lens),
                     sampling.select(sampled), draft_probs, uniforms[sampled.to(uniforms.device)].to(dev))
    n = torch.empty(r_count, dtype=torch.int64, device=dev)
    tokens = torch.empty(r_count, gamma + 1, dtype=torch.int64, device=dev)
    for part, idx in ((out_g, greedy), (out_s, sampled)):
        n.index_copy_(0, idx.to(dev), part.num_accepted)
        tokens.index_copy_(0, idx.to(dev), part.tokens)
    return VerifyResult(n, tokens, n + 1)


def _sampled(logits, drafts, lens, cu, sampling: SamplingBatch, draft_probs, uniforms) -> VerifyResult:
    target_probs = sampling.repeat(lens + 1).probs(logits)
    return rejection_sample(target_probs, drafts, draft_probs, cu, uniforms)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax (first maximum, like argmax): our C kernel on bf16 CPU rows (`cpu_argmax`, ~8x
    torch's `max` there), else `max`, ~5x faster than argmax on bf16 CPU rows."""
    return row_argmax(logits)


def _cu(lens: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    cu[1:] = (lens + 1).cumsum(0)
    return cu


def _rows(cu: torch.Tensor, requests: torch.Tensor) -> torch.Tensor:
    """Flat row indices of `requests` (host) in the layout cu (host), request by request."""
    starts, lens = cu[:-1][requests], (cu[1:] - cu[:-1])[requests]
    total = int(lens.sum())
    first = torch.zeros(requests.numel(), dtype=torch.int64)
    first[1:] = lens.cumsum(0)[:-1]
    offsets = torch.arange(total) - first.repeat_interleave(lens, output_size=total)
    return starts.repeat_interleave(lens, output_size=total) + offsets
