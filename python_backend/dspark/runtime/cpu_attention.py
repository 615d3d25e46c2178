"""`cached_attention`: a ragged batch's bf16 attention over the fixed-slot KV cache on an x86 CPU
with AVX512-BF16 (the scores by VDPBF16PS), through our own small C kernel
(kernels/cpu/cached_attention.c, built like the matmul kernels by `dspark.runtime.cpu_gemm.build`,
called through ctypes). Each token's heads
read their slot's keys 0..position in order, fp32 softmax, one rounding to bf16: a token's output
is bit-identical whatever else is in the batch (a verify attends exactly as plain decoding
does), and a ragged batch needs no padding, mask or length groups. A request's tokens and the
query heads of a kv head share each block of keys while it is in L1 (loads, not arithmetic).
ATen's CPU flash kernel is built for long query blocks; with the few query rows of a decode or a
verify its per-call cost dominated (README "Attention on an AVX512-BF16 CPU").
`attention._attend_torch` is the reference (tests/test_cpu_attention.py)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from dspark import paths
from dspark.runtime import cpu_gemm, cpu_norm

SOURCE = paths.REPO_ROOT / "kernels" / "cpu" / "cached_attention.c"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
# longest request (new tokens) it runs, None: every one, prefills included (measured faster than
# ATen's flash kernel at every prompt length, `dspark bench-prefill`); an int keeps longer
# requests on the flash kernel (that benchmark's other arm)
MAX_NEW_TOKENS: int | None = None
# a request's tokens and a kv head's query heads share each block of keys (the default); False:
# each query alone, the same bits (the layout before the grouping, for `dspark bench-glue`)
GROUPED = True


@lru_cache(maxsize=4)
def library(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel library (`defines` picks a variant such as ATTN_NO_PREFETCH, for benchmarks), or
    None where it cannot run here (no AVX512-BF16, or no build)."""
    ptr, i64 = cpu_gemm.PTR, cpu_gemm.I64
    # (q, q_stride, k, v, tok_slot, positions, out, n, h, hkv, s_max, hd, scale, threads, grouped) -> status
    args = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, cpu_gemm.INT,
            cpu_gemm.INT]
    # (qkv, qkv_stride, cos, sin, q_out, k, v, tok_slot, positions, n, h, hkv, s_max, hd)
    rope = [ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    return cpu_gemm.load(SOURCE, FLAGS, {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
                         {"cached_attention_bf16": (args, ctypes.c_int), "rope_write_kv_bf16": (rope, None)},
                         defines)


def enabled(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether a target engine sends its decodes and verifies here: bf16 on the CPU where our bf16
    matmul kernel serves too (`linear.serving_cpu_gemm`: an AVX512-BF16 CPU without AMX, unless
    DSPARK_CPU_GEMM=onednn), head_dim a multiple of 16 up to 256, at most 16 query heads per kv
    head, and the kernel built."""
    from dspark.runtime.linear import serving_cpu_gemm

    return (device.type == "cpu" and dtype == torch.bfloat16 and serving_cpu_gemm(dtype) == "rows"
            and head_dim % 16 == 0 and head_dim <= 256 and heads % kv_heads == 0 and heads // kv_heads <= 16
            and library() is not None)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tok_slot: torch.Tensor,
                     positions: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, H, hd] bf16 (heads contiguous; tokens may be strided), k_cache / v_cache [C, Hkv, S, hd]
    bf16 contiguous, tok_slot / positions [N] int64 (CPU) -> [N, H, hd]: token i attends to rows
    0..positions[i] of slot tok_slot[i] (`enabled` says where it runs)."""
    lib = library()
    n, h, hd = q.shape
    if lib is None or q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or q.stride(2) != 1 \
            or q.stride(1) != hd or not (k_cache.is_contiguous() and v_cache.is_contiguous()) \
            or v_cache.shape != k_cache.shape or q.device.type != "cpu":
        raise ValueError(f"cached_attention takes bf16 CPU q [N, H, hd] with contiguous heads and contiguous "
                         f"bf16 caches (kernel built: {lib is not None}), got q {q.dtype} "
                         f"{tuple(q.shape)} stride {q.stride()}, cache {k_cache.dtype} "
                         f"{tuple(k_cache.shape)}")
    out = torch.empty(n, h, hd, dtype=q.dtype)
    if n:
        tok_slot, positions = tok_slot.contiguous(), positions.contiguous()
        rc = lib.cached_attention_bf16(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                       tok_slot.data_ptr(), positions.data_ptr(), out.data_ptr(), n, h,
                                       k_cache.shape[1], k_cache.shape[2], hd, scale, torch.get_num_threads(),
                                       int(GROUPED))
        if rc == -2:
            raise MemoryError(f"cached_attention: no memory for the scores of {k_cache.shape[2]} keys")
        if rc != 0:
            raise ValueError(f"cached_attention: unsupported shape q {tuple(q.shape)}, "
                             f"cache {tuple(k_cache.shape)}")
    return out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, tok_slot: torch.Tensor, positions: torch.Tensor,
                  heads: int) -> torch.Tensor | None:
    """The step before `cached_attention`, in one call: qkv [N, (H + 2·Hkv)·hd] bf16 (a fused
    projection's output: q, k, v heads), cos / sin_signed [N, hd] (`Transformer.rope_tables` rows
    at each token's position) -> q [N, H, hd] rotated; k rotated and v written into row
    positions[i] of slot tok_slot[i] of the caches. Bit-identical to `apply_rope_swapped` and
    torch's indexed writes. None (nothing done) where the kernel does not take these: then the
    caller runs torch's ops."""
    lib = library() if cpu_norm.USE else None  # the glue kernels' switch (DSPARK_CPU_GLUE)
    hkv, s_max, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    n = qkv.shape[0]
    if (lib is None or hd % 32 or qkv.dtype != torch.bfloat16 or cos.dtype != torch.bfloat16
            or k_cache.dtype != torch.bfloat16 or qkv.dim() != 2 or qkv.shape[1] != (heads + 2 * hkv) * hd
            or qkv.stride(1) != 1 or not (cos.is_contiguous() and sin_signed.is_contiguous()
                                          and k_cache.is_contiguous() and v_cache.is_contiguous())
            or tuple(cos.shape) != (n, hd) or tuple(sin_signed.shape) != (n, hd) or qkv.device.type != "cpu"):
        return None
    q = torch.empty(n, heads, hd, dtype=qkv.dtype)
    if n:
        tok_slot, positions = tok_slot.contiguous(), positions.contiguous()
        lib.rope_write_kv_bf16(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin_signed.data_ptr(),
                               q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tok_slot.data_ptr(),
                               positions.data_ptr(), n, heads, hkv, s_max, hd)
    return q
