"""Varlen attention for ragged verification (architecture §4), as a Triton kernel (reference in
dspark_kernels.reference).

Queries are the flattened new tokens of all requests (cu_seqlens, positions). The new
tokens' K/V are already written into the cache at their positions, so the new token at
position p of request r attends to cache[slot_r, :, 0..p]: that covers the cached prefix
and, causally, the request's own earlier new tokens, never another request. GQA: query
head h reads kv head h // (n_heads // n_kv_heads).

KV cache layout (fixed): per layer K and V of shape [capacity, n_kv_heads, max_seq_len, head_dim].
One program per (request, kv head, block of BLOCK_T new tokens); its rows are the
BLOCK_T tokens × the G query heads sharing that kv head, so K/V are read once per request.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dspark_kernels.dispatch import use_triton
from dspark_kernels.reference import varlen_attention_ref

__all__ = ["varlen_attention", "varlen_attention_triton", "varlen_attention_ref"]


@triton.jit
def _varlen_attention_kernel(
    q_ptr,  # [N, H, D] queries of the new tokens (contiguous)
    k_cache_ptr,  # [C, KVH, S, D] K cache (capacity, kv heads, max_seq_len, head_dim), last dim contiguous
    v_cache_ptr,  # [C, KVH, S, D] V cache, same strides as k_cache
    out_ptr,  # [N, H, D] attention output (contiguous)
    cu_seqlens_ptr,  # [R+1] i64, request r owns new tokens cu[r] .. cu[r+1]-1
    positions_ptr,  # [N] i64, absolute position of each new token
    slots_ptr,  # [R] i64, cache slot of each request
    sm_scale,
    stride_c,
    stride_kvh,
    stride_s,
    H: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,  # query heads per kv head
    BLOCK_G: tl.constexpr,  # next power of two >= G
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    t_block = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + r)
    end = tl.load(cu_seqlens_ptr + r + 1)
    slot = tl.load(slots_ptr + r)

    rows = tl.arange(0, BLOCK_T * BLOCK_G)
    token = start + t_block * BLOCK_T + rows // BLOCK_G
    head = kv_head * G + rows % BLOCK_G
    valid = (token < end) & (rows % BLOCK_G < G)
    pos = tl.load(positions_ptr + token, mask=valid, other=-1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_offs = token[:, None] * (H * D) + head[:, None] * D + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=valid[:, None] & d_ok[None, :], other=0.0)

    kv_base = slot * stride_c + kv_head * stride_kvh
    kv_len = tl.max(pos, 0) + 1  # keys 0..max position of this block's tokens
    m_i = tl.full((BLOCK_T * BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_T * BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_T * BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(0, kv_len, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k_ok = kpos < kv_len
        kv_offs = kv_base + kpos[:, None] * stride_s + d[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * sm_scale
        s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))  # causal over absolute positions
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet (padding)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & d_ok[None, :])


def varlen_attention_triton(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [C, KVH, S, D]
    v_cache: torch.Tensor,  # [C, KVH, S, D]
    cu_seqlens: torch.Tensor,  # [R+1] i64
    positions: torch.Tensor,  # [N] i64
    slots: torch.Tensor,  # [R] i64
    sm_scale: float | None = None,
    max_new_tokens: int | None = None,  # max_r (cu[r+1]-cu[r]); computed (one sync) when None
    block_n: int = 64,
) -> torch.Tensor:  # [N, H, D], dtype of q
    n, h, d = q.shape
    kvh = k_cache.shape[1]
    if h % kvh:
        raise ValueError(f"n_heads {h} must be a multiple of n_kv_heads {kvh}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need equal strides and a contiguous head_dim")
    r = slots.numel()
    q = q.contiguous()
    out = torch.empty_like(q)
    if n == 0 or r == 0:
        return out
    if max_new_tokens is None:
        max_new_tokens = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    g = h // kvh
    block_g = triton.next_power_of_2(g)
    # tl.dot needs >= 16 rows: pad the token block so BLOCK_T * BLOCK_G >= 16.
    block_t = max(min(triton.next_power_of_2(max_new_tokens), 16), triton.cdiv(16, block_g))
    block_d = max(triton.next_power_of_2(d), 16)
    grid = (r, kvh, triton.cdiv(max_new_tokens, block_t))
    _varlen_attention_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens.long().contiguous(), positions.long().contiguous(),
        slots.long().contiguous(), sm_scale if sm_scale is not None else 1.0 / math.sqrt(d),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        H=h, D=d, G=g, BLOCK_G=block_g, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_D=block_d,
    )
    return out


def varlen_attention(
    q: torch.Tensor,  # [N, H, D]
    k_cache: torch.Tensor,  # [C, KVH, S, D]
    v_cache: torch.Tensor,  # [C, KVH, S, D]
    tok_slot: torch.Tensor | None,  # [N] slot of each token (slots[r] suffices)
    positions: torch.Tensor,  # [N] i64
    cu_seqlens: torch.Tensor,  # [R+1] i64
    slots: torch.Tensor,  # [R] i64
    sm_scale: float | None = None,
    max_new_tokens: int | None = None,  # pass AttnMeta.max_new to skip one host sync
) -> torch.Tensor:
    """dspark.runtime.attention's argument order (tok_slot unused: the kernel reads slots[r]); kernel or
    reference as `dspark_kernels.dispatch` decides."""
    if use_triton(q):
        return varlen_attention_triton(q, k_cache, v_cache, cu_seqlens, positions, slots, sm_scale,
                                       max_new_tokens)
    return varlen_attention_ref(q, k_cache, v_cache, cu_seqlens, positions, slots, sm_scale)
