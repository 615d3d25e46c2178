"""Block sampling for the drafter's sequential head (architecture §5): Triton kernel + torch reference.

Left to right over k = 1..γ, every request draws x_k from
    p_k = sampling_probs(U_k + W1[x_{k−1}] W2ᵀ)  (temperature, then top-k, then top-p)
with x_0 the anchor. Per position the launcher computes the low-rank bias of all requests as
one GEMM (W2 is read once per position, not once per request), then one Triton program
per request filters its row and samples it; the token stays on the device and feeds the
next position, so the loop never syncs with the host.

Filtering inside the kernel: logits are mapped to order-preserving int32 keys (negative
floats get their magnitude bits flipped; inlined, the interpreter is slow on nested calls); the top-k
threshold (k-th largest key) and the top-p threshold (smallest key t whose mass strictly
above t is < top_p, architecture §6 uses the same rule) are found by exact
32-step bisection over the key space, each step one pass over the row. Rows without top-k /
top-p skip those passes. Ties between equal logits may keep a few extra tokens where
sampling_probs' stable sort keeps exactly k (measure zero for real logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_kernels.reference import block_sample_ref

__all__ = ["block_sample_triton", "block_sample_ref"]


@triton.jit
def _sample_rows_kernel(
    logits_ptr,  # [R, V] f32/bf16/f16, row r at logits_ptr + r * logits_stride
    temperature_ptr,  # [R] f32, 0 = greedy
    top_k_ptr,  # [R] i64, 0 = off
    top_p_ptr,  # [R] f32, 1 = off
    uniforms_ptr,  # [R] f32 in [0, 1), row r at uniforms_ptr + r * uniforms_stride
    out_tokens_ptr,  # [R] i64, row r at out_tokens_ptr + r * tokens_stride
    out_probs_ptr,  # [R, V] f32, the distribution sampled from (also scratch for scaled logits)
    logits_stride,
    uniforms_stride,
    tokens_stride,
    probs_stride,
    V,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + r)
    greedy = temperature <= 0
    t_eff = tl.where(greedy, 1.0, temperature)
    top_k = tl.load(top_k_ptr + r)
    k_eff = tl.where(top_k > 0, tl.minimum(top_k, V), V)
    top_p = tl.load(top_p_ptr + r)
    row_in = logits_ptr + r * logits_stride
    row_out = out_probs_ptr + r * probs_stride
    offs0 = tl.arange(0, BLOCK_V)

    # Pass 1: z = logits / T into the output row (scratch), row max and its first index.
    z_max = tl.full((), float("-inf"), tl.float32)
    arg_max = tl.zeros((), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + offs0
        ok = offs < V
        z = tl.load(row_in + offs, mask=ok, other=float("-inf")).to(tl.float32) / t_eff
        tl.store(row_out + offs, z, mask=ok)
        block_max = tl.max(z, 0)
        block_arg = tl.argmax(z, 0).to(tl.int64) + v0
        arg_max = tl.where(block_max > z_max, block_arg, arg_max)
        z_max = tl.maximum(z_max, block_max)
    tl.debug_barrier()

    # Top-k: the largest key t with count(key >= t) >= k (32 exact bisection steps, 0 if off).
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    k_steps = tl.where((k_eff < V) & ~greedy, 32, 0)
    for _ in range(0, k_steps):
        mid = lo + (hi - lo + 1) // 2
        count = tl.zeros((), tl.int64)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + offs0
            ok = offs < V
            bits = tl.load(row_out + offs, mask=ok, other=float("-inf")).to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order-preserving int key
            count += tl.sum((ok & (key >= mid)).to(tl.int64), 0)
        lo = tl.where(count >= k_eff, mid, lo)
        hi = tl.where(count >= k_eff, hi, mid - 1)
    kth = lo

    # Mass of the top-k set (softmax denominator relative to the row max).
    z_sum = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + offs0
        ok = offs < V
        z = tl.load(row_out + offs, mask=ok, other=float("-inf"))
        bits = z.to(tl.int32, bitcast=True)
        kept = ok & (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) >= kth)
        z_sum += tl.sum(tl.where(kept, tl.exp(z - z_max), 0.0), 0)

    # Top-p: the smallest key t with mass(key > t) < top_p; keep keys >= t.
    lo = kth
    hi = tl.full((), 2147483647, tl.int64)
    p_steps = tl.where((top_p < 1.0) & ~greedy, 32, 0)
    for _ in range(0, p_steps):
        mid = lo + (hi - lo) // 2
        mass = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + offs0
            ok = offs < V
            z = tl.load(row_out + offs, mask=ok, other=float("-inf"))
            bits = z.to(tl.int32, bitcast=True)
            above = ok & (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) > mid)
            mass += tl.sum(tl.where(above, tl.exp(z - z_max), 0.0), 0)
        small = mass / z_sum < top_p
        hi = tl.where(small, mid, hi)
        lo = tl.where(small, lo, mid + 1)
    threshold_key = lo

    # Final distribution (one-hot on the argmax when greedy), its mass and last positive index.
    kept_sum = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + offs0
        ok = offs < V
        z = tl.load(row_out + offs, mask=ok, other=float("-inf"))
        bits = z.to(tl.int32, bitcast=True)
        kept = ok & (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) >= threshold_key)
        kept_sum += tl.sum(tl.where(kept, tl.exp(z - z_max), 0.0), 0)
    tl.debug_barrier()
    total = tl.zeros((), tl.float32)
    last_positive = tl.zeros((), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + offs0
        ok = offs < V
        z = tl.load(row_out + offs, mask=ok, other=float("-inf"))
        bits = z.to(tl.int32, bitcast=True)
        kept = ok & (tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) >= threshold_key)
        p = tl.where(kept, tl.exp(z - z_max) / kept_sum, 0.0)
        p = tl.where(greedy, tl.where(offs == arg_max, 1.0, 0.0), p)
        tl.store(row_out + offs, p, mask=ok)
        total += tl.sum(p, 0)
        last_positive = tl.maximum(last_positive, tl.max(tl.where(p > 0, offs, 0).to(tl.int64), 0))
    tl.debug_barrier()

    # Inverse CDF: token = number of v whose inclusive cumsum is <= u * total.
    threshold = tl.load(uniforms_ptr + r * uniforms_stride) * total
    count = tl.zeros((), tl.int64)
    running = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + offs0
        ok = offs < V
        p = tl.load(row_out + offs, mask=ok, other=0.0)
        cdf = running + tl.cumsum(p, 0)
        count += tl.sum((ok & (cdf <= threshold)).to(tl.int64), 0)
        running += tl.sum(p, 0)
    token = tl.where(greedy, arg_max, tl.minimum(count, last_positive))
    tl.store(out_tokens_ptr + r * tokens_stride, token)


def block_sample_triton(
    base_logits: torch.Tensor,  # [R, γ, V] U_k
    anchors: torch.Tensor,  # [R] i64, x_0
    w1: torch.Tensor | None,  # [V, rank] (None: no sequential head, DFlash baseline)
    w2: torch.Tensor | None,  # [V, rank], the weight of Linear(rank, V)
    temperature: torch.Tensor,  # [R] f32
    top_k: torch.Tensor,  # [R] i64
    top_p: torch.Tensor,  # [R] f32
    uniforms: torch.Tensor,  # [R, γ] f32
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R, γ] i64, probs [R, γ, V] f32
    r, gamma, v = base_logits.shape
    dev = base_logits.device
    tokens = torch.empty(r, gamma, dtype=torch.int64, device=dev)
    probs = torch.empty(r, gamma, v, dtype=torch.float32, device=dev)
    if r == 0:
        return tokens, probs
    temperature, top_p = temperature.float().contiguous(), top_p.float().contiguous()
    top_k, uniforms = top_k.long().contiguous(), uniforms.float().contiguous()
    prev = anchors.long()
    for k in range(gamma):
        logits = base_logits[:, k].float()
        if w1 is not None:
            logits = logits + w1[prev].float() @ w2.float().T  # one GEMM for all requests
        logits = logits.contiguous()
        _sample_rows_kernel[(r,)](
            logits, temperature, top_k, top_p, uniforms[:, k], tokens[:, k], probs[:, k],
            logits.stride(0), uniforms.stride(0), tokens.stride(0), probs.stride(0), v,
            BLOCK_V=min(block_v, triton.next_power_of_2(v)),
        )
        prev = tokens[:, k]
    return tokens, probs
