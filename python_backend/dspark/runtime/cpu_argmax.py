"""`row_argmax`: the first index of each row's largest value, for bf16 logits on an x86 CPU with
AVX512 through our own small C kernel (kernels/cpu/row_argmax.c, built like the matmul kernels by
`dspark.runtime.cpu_gemm.build`, called through ctypes); torch's `max(-1).indices` elsewhere and as
the reference (tests/test_cpu_argmax.py). Greedy verification takes one argmax per verified row:
torch's bf16 `max` reads about one element a cycle, ~47 µs a SmolLM2 row (49 152 logits) on an
AMD EPYC, a fifth of a millisecond for a 5-token verify.

`bigram_chain`: the DSpark drafter's greedy Markov head over its draft vocabulary, a chain of
such argmaxes over bigram row + base logits, in one call of the same library instead of three
torch ops per drafted position (each ~10–25 µs of dispatch between two target steps)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from dspark import paths
from dspark.runtime import cpu_gemm

SOURCE = paths.REPO_ROOT / "kernels" / "cpu" / "row_argmax.c"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-shared", "-fPIC"]


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot run here (no AVX512, or no build)."""
    ptr, i64 = cpu_gemm.PTR, cpu_gemm.I64
    # row_argmax_bf16(x, x_stride, n, v, out); bigram_chain_bf16(bigram, base, base_r, base_k, r, w, k, idx)
    return cpu_gemm.load(SOURCE, FLAGS, {"avx512f", "avx512bw", "avx512vl"},
                         {"row_argmax_bf16": ([ptr, i64, i64, i64, ptr], None),
                          "bigram_chain_bf16": ([ptr, ptr, i64, i64, i64, i64, i64, ptr], None)})


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] -> [N] int64: the first index of each row's maximum (of its first NaN, if any),
    as `x.max(-1).indices`; through the C kernel for bf16 CPU rows with unit stride."""
    lib = library() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        return x.max(-1).indices
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.row_argmax_bf16(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def bigram_chain_reference(bigram: torch.Tensor, base: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """`bigram_chain` in torch: three ops a position."""
    picks, idx = [first], first
    for k in range(1, base.shape[1]):
        idx = bigram.index_select(0, idx).add_(base[:, k]).max(-1).indices
        picks.append(idx)
    return torch.stack(picks, dim=1)


def bigram_chain(bigram: torch.Tensor, base: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """A greedy Markov chain over a K-token vocabulary: bigram [K, K], base [R, w, K] logits,
    first [R] int64 -> idx [R, w] with idx[:, 0] = first and idx[:, k] the first argmax of
    bigram[idx[:, k−1]] + base[:, k] (the sum rounded to their dtype, as torch adds). One C call
    for bf16 CPU tensors (unit last stride, a contiguous bigram), else `bigram_chain_reference`."""
    lib = library() if bigram.dtype == base.dtype == torch.bfloat16 and base.device.type == "cpu" else None
    r, w, k = base.shape
    if (lib is None or not bigram.is_contiguous() or base.stride(2) != 1 or tuple(bigram.shape) != (k, k)
            or k == 0 or w == 0):
        return bigram_chain_reference(bigram, base, first)
    idx = torch.empty(r, w, dtype=torch.int64)
    idx[:, 0] = first
    lib.bigram_chain_bf16(bigram.data_ptr(), base.data_ptr(), base.stride(0), base.stride(1), r, w, k,
                          idx.data_ptr())
    return idx
