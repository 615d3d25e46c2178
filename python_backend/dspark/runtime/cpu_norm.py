"""`add_rms_norm`: a decoder layer's residual add and the RMSNorm after it, x <- x + delta, then
RMSNorm(x) · w, for bf16 rows on an x86 CPU with AVX512 through our own small C kernel
(kernels/cpu/rms_norm.c, built like the matmul kernels by `dspark.runtime.cpu_gemm.build`, called
through ctypes); a torch add and `F.rms_norm` elsewhere and as the reference
(tests/test_cpu_norm.py). Torch runs ~8 ATen ops per bf16 norm, ~23 µs a call on an AMD EPYC
between the target's matmuls, 61 norms a SmolLM2 forward: ~1.4 ms of a ~12 ms decode step."""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch
import torch.nn.functional as F

from dspark import paths
from dspark.runtime import cpu_gemm

SOURCE = paths.REPO_ROOT / "kernels" / "cpu" / "rms_norm.c"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-shared", "-fPIC"]
# the target forward's glue kernels (this one and `cpu_attention.rope_write_kv`) run unless
# DSPARK_CPU_GLUE=torch; `dspark bench-glue` switches both to time them against torch's ops
USE = os.environ.get("DSPARK_CPU_GLUE", "kernels") != "torch"


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot run here (no AVX512, or no build)."""
    ptr, i64 = cpu_gemm.PTR, cpu_gemm.I64
    # (x, x_stride, delta, d_stride, w, sum, out, n, d, eps)
    return cpu_gemm.load(SOURCE, FLAGS, {"avx512f", "avx512bw", "avx512vl"},
                         {"add_rms_norm_bf16": ([ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float],
                                                None)})


def enabled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `add_rms_norm` runs the C kernel for these (bf16 CPU rows and weight, unit column
    stride, kernel built, not switched off: `USE`)."""
    return (USE and x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
            and x.stride(1) == 1 and weight.is_contiguous() and library() is not None)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, F.rms_norm of it) in torch (delta None: no add)."""
    if delta is not None:
        x = x + delta
    return x, F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D], delta [N, D] or None, weight [D] -> (x + delta, RMSNorm(x + delta) · weight), both
    [N, D] (new tensors; x and delta are left as they are). The C kernel for bf16 CPU rows
    (`enabled`), else `add_rms_norm_reference`."""
    if not enabled(x, weight) or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1
                                                         or delta.dtype != x.dtype)):
        return add_rms_norm_reference(x, delta, weight, eps)
    n, d = x.shape
    out = torch.empty(n, d, dtype=x.dtype)
    total = x if delta is None else torch.empty(n, d, dtype=x.dtype)
    if n:
        lib = library()
        assert lib is not None  # `enabled`
        lib.add_rms_norm_bf16(x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
                              0 if delta is None else delta.stride(0), weight.data_ptr(),
                              None if delta is None else total.data_ptr(), out.data_ptr(), n, d, eps)
    return total, out
