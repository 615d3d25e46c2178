"""Torch references of every kernel in `dspark_kernels`, and the constants they share.

Pure torch (no Triton import), so the CPU path and the tests never need a compiler. The
Triton kernels must reproduce these bit for bit in their integer outputs (same uniforms in,
same tokens out). `dspark.runtime` builds on these functions; nothing here imports dspark.

Flat draft layout (architecture §6): request r verifies ℓ_r drafts, its target rows are
cu[r] .. cu[r+1]-1 (ℓ_r + 1 rows: the anchor, then one per draft) and its draft-probability
rows are cu[r] - r .. cu[r] - r + ℓ_r - 1 of a [Σℓ, V] tensor (one row per verified draft).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Residual mass at or below this counts as zero: fall back to p_t (architecture §6).
ZERO_MASS = 1e-6


def sample_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token v per row of unnormalised weights [R, V] >= 0: the first v whose inclusive cumsum
    exceeds u · total (u [R] in [0, 1)), clamped to the last v with positive weight."""
    cdf = weights.cumsum(-1)
    threshold = (u * cdf[:, -1]).unsqueeze(-1)
    token = (cdf <= threshold).sum(-1)
    v = weights.shape[-1]
    last_positive = v - 1 - (weights > 0).flip(-1).int().argmax(-1)
    return torch.minimum(token, last_positive)


def top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """softmax of scaled logits x [R, V] restricted to the top-k (0 = off), then to the smallest
    top set whose mass reaches top_p (1 = off); ties keep the lower token id (stable sort)."""
    v = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=x.device)
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    keep = rank[None, :] < k[:, None]
    p_sorted = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = p_sorted.cumsum(-1) - p_sorted
    keep &= mass_before < top_p[:, None]
    p_sorted = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.zeros_like(x).scatter_(-1, order, p_sorted)


def sampling_probs_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """[N, V] f32: temperature, then top-k, then top-p, renormalised; greedy rows (T = 0) one-hot
    on the argmax. The definition `dspark.runtime.sampling.sampling_probs` implements."""
    x = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = top_k_top_p(x / t[:, None], top_k, top_p)
    onehot = torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


def rejection_sample_ref(
    target_probs: torch.Tensor,  # [N, V] f32, p_t per flattened row
    draft_tokens: torch.Tensor,  # [R, γ] i64
    draft_probs: torch.Tensor | None,  # [Σℓ, V] f32 flat (see module docstring), or None = one-hot drafts
    cu_seqlens: torch.Tensor,  # [R+1] i64 (device of target_probs)
    uniforms: torch.Tensor,  # [R, γ+1] f32: γ acceptance draws, then the final draw
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [R] i64, tokens [R, γ+1] i64 (-1 padded)
    """Ragged rejection sampling, vectorised over requests and positions: accept d_j while
    u_j · p_d(d_j) < p_t(d_j); at the first rejection draw from norm(max(0, p_t − p_d)) (p_t when
    that mass is <= ZERO_MASS), after ℓ_r acceptances draw the bonus from p_t."""
    n_rows = target_probs.shape[0]
    r_count, gamma = draft_tokens.shape
    dev = target_probs.device
    rows = torch.arange(r_count, device=dev)
    starts = cu_seqlens[:-1]
    lens = cu_seqlens[1:] - starts - 1  # ℓ_r
    j = torch.arange(gamma, device=dev)
    live = j[None, :] < lens[:, None]
    pt = target_probs[(starts[:, None] + j).clamp(max=max(n_rows - 1, 0)), draft_tokens] if n_rows else \
        torch.zeros(r_count, gamma, device=dev)
    n_draft = 0 if draft_probs is None else draft_probs.shape[0]
    draft_row = (starts - rows)[:, None] + j  # flat p_d row of (r, j), valid where live
    if n_draft:
        pd = draft_probs[draft_row.clamp(max=n_draft - 1), draft_tokens]
    else:
        pd = torch.ones_like(pt)
    ok = live & (uniforms[:, :gamma] * pd < pt)
    num_accepted = ok.long().cumprod(-1).sum(-1)
    p_t = target_probs[starts + num_accepted].float() if n_rows else torch.zeros(r_count, 1, device=dev)
    rejected = num_accepted < lens
    jj = num_accepted.clamp(max=max(gamma - 1, 0))
    if gamma == 0:
        p_d = torch.zeros_like(p_t)
    elif n_draft:
        p_d = draft_probs[(starts - rows + jj).clamp(max=n_draft - 1)].float()
    else:
        p_d = torch.zeros_like(p_t).scatter_(-1, draft_tokens[rows, jj].unsqueeze(-1), 1.0)
    residual = (p_t - p_d * rejected[:, None].float()).clamp(min=0)
    zero_mass = residual.sum(-1) <= ZERO_MASS
    last = sample_inverse_cdf(torch.where(zero_mass[:, None], p_t, residual), uniforms[:, gamma])
    idx = torch.arange(gamma + 1, device=dev)[None, :]
    padded = torch.cat([draft_tokens, torch.zeros_like(last)[:, None]], dim=1)
    tokens = torch.where(idx < num_accepted[:, None], padded, torch.full_like(padded, -1))
    tokens = torch.where(idx == num_accepted[:, None], last[:, None], tokens)
    return num_accepted, tokens


def block_sample_ref(
    base_logits: torch.Tensor,  # [R, γ, V] U_k
    anchors: torch.Tensor,  # [R] i64, x_0
    w1: torch.Tensor | None,  # [V, rank] (None: no sequential head)
    w2: torch.Tensor | None,  # [V, rank], the weight of Linear(rank, V)
    temperature: torch.Tensor,  # [R] f32
    top_k: torch.Tensor,  # [R] i64
    top_p: torch.Tensor,  # [R] f32
    uniforms: torch.Tensor,  # [R, γ] f32
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R, γ] i64, probs [R, γ, V] f32
    """The Markov sequential head sampled left to right: p_k = sampling_probs(U_k + W1[x_{k−1}] W2ᵀ),
    x_k by inverse CDF with uniforms[:, k]."""
    r, gamma, v = base_logits.shape
    tokens = torch.empty(r, gamma, dtype=torch.int64, device=base_logits.device)
    probs = torch.empty(r, gamma, v, dtype=torch.float32, device=base_logits.device)
    prev = anchors.long()
    for k in range(gamma):
        logits = base_logits[:, k].float()
        if w1 is not None:
            logits = logits + w1[prev].float() @ w2.float().T
        probs[:, k] = sampling_probs_ref(logits, temperature, top_k, top_p)
        tokens[:, k] = sample_inverse_cdf(probs[:, k], uniforms[:, k])
        prev = tokens[:, k]
    return tokens, probs


def varlen_attention_ref(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [C, KVH, S, D]
    v_cache: torch.Tensor,  # [C, KVH, S, D]
    cu_seqlens: torch.Tensor,  # [R+1] i64
    positions: torch.Tensor,  # [N] i64
    slots: torch.Tensor,  # [R] i64
    sm_scale: float | None = None,
) -> torch.Tensor:  # [N, H, D]
    """Per request, SDPA of its new tokens over cache[slot, :, 0..p] (GQA: head h reads kv head
    h // (H / KVH)). A reference for tests: it loops over requests."""
    n, h, d = q.shape
    g = h // k_cache.shape[1]
    out = torch.empty_like(q)
    for r in range(slots.numel()):
        s, e = int(cu_seqlens[r]), int(cu_seqlens[r + 1])
        if e == s:
            continue
        pos = positions[s:e]
        kv_len = int(pos.max()) + 1
        k = k_cache[slots[r], :, :kv_len].repeat_interleave(g, dim=0)  # [H, L, D]
        v = v_cache[slots[r], :, :kv_len].repeat_interleave(g, dim=0)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= pos[:, None]  # [T, L]
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k, v, attn_mask=mask, scale=sm_scale)
        out[s:e] = o.transpose(0, 1)
    return out
