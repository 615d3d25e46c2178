"""`RowsLinear`: fp32 y = x Wᵀ + b on an x86 CPU with AVX2 + FMA through our own small C kernel
(kernels/cpu/rows_gemm.c), built with the system's C compiler on first use and called through
ctypes (which releases the GIL). oneDNN's fp32 kernels on an AVX2-only CPU scale badly with the
few rows a decode or a verify sends; this one reads the weight once per call and applies it to 4
to 6 rows at a time from cache (README "Serving matmuls" has its times by row count). Every
output is one FMA chain over k in order, so a row's result is bit-identical whatever else is in
the batch (a speculative verify and a plain decode compute the same logits). `F.linear` is the
reference (tests/test_cpu_gemm.py). A bf16 weight is streamed as bf16 (half the bytes: a
one-row decode is memory-bound) and widened in registers, with fp32 activations and arithmetic.

`DotBf16Linear`: the same idea for bf16 activations on a CPU with AVX512-BF16
(kernels/cpu/bf16_dot_gemm.c: VDPBF16PS, two bf16 products per fp32 lane and instruction), one
chain per output, so batch invariant too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from dspark import paths

SOURCE = paths.REPO_ROOT / "kernels" / "cpu" / "rows_gemm.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
DOT_SOURCE = paths.REPO_ROOT / "kernels" / "cpu" / "bf16_dot_gemm.c"
DOT_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
log = logging.getLogger(__name__)


def build_dir() -> Path:
    """Where the built library is cached: `DSPARK_KERNEL_CACHE`, else beside the converted
    models (git-ignored). The CPU image builds it into its own folder (build/docker/Dockerfile.cpu)."""
    env = os.environ.get("DSPARK_KERNEL_CACHE")
    return Path(env) if env else paths.MODELS / ".cache" / "cpu_gemm"


def build(defines: tuple[str, ...] = (), source: Path = SOURCE, base_flags: list[str] = FLAGS) -> Path | None:
    """The kernel library for `source` (the rows kernel by default; `DOT_SOURCE` with `DOT_FLAGS`)
    and its flags (plus `-D` `defines`: a variant such as ROWS_GEMM_NO_PREFETCH, for benchmarks):
    cached, else compiled now with `CC` (else cc / gcc); None (with a warning) where no compiler
    is found or the build fails."""
    flags = [*base_flags, *(f"-D{d}" for d in defines)]
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    out = build_dir() / f"{source.stem}-{digest}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: torch (oneDNN) runs what our CPU kernels would")
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        pass
    try:
        subprocess.run([cc, *flags, "-o", tmp.name, str(source)], check=True, capture_output=True, text=True)
        os.replace(tmp.name, out)  # atomic: parallel builders each write their own file
    except (OSError, subprocess.CalledProcessError) as e:
        Path(tmp.name).unlink(missing_ok=True)
        log.warning("building %s failed (%s): torch (oneDNN) runs its part instead", source.name,
                    getattr(e, "stderr", "") or e)
        return None
    return out


PTR, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
PACK = ([PTR, PTR, I64, I64], None)  # (w, packed, n, k)
GEMM = ([PTR, PTR, PTR, PTR, I64, I64, I64, INT], None)  # (x, packed, bias, y, m, n, k, threads)


def load(source: Path, base_flags: list[str], cpu_needs: set[str], signatures: dict[str, tuple[list, object]],
         defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """One of our C kernels as a ctypes library, its functions' `signatures` ({name: (argtypes,
    restype)}) set; None where it cannot run here (the CPU lacks a flag of `cpu_needs`, or no
    build): callers fall back to torch."""
    from dspark.runtime.linear import cpu_flags  # linear imports this module

    if not cpu_needs <= cpu_flags() or not source.exists():
        return None
    path = build(defines, source, base_flags)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = restype
    return lib


@lru_cache(maxsize=4)
def library(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The rows kernel library (`defines` picks a variant), or None where it cannot run here (not
    x86 with AVX2 + FMA, or no build): callers fall back to oneDNN."""
    return load(SOURCE, FLAGS, {"avx2", "fma"}, {"rows_gemm_pack": PACK, "rows_gemm_pack_bf16": PACK,
                                                 "rows_gemm": GEMM, "rows_gemm_bf16": GEMM}, defines)


@lru_cache(maxsize=4)
def dot_library(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The bf16 dot-product kernel library (kernels/cpu/bf16_dot_gemm.c; `defines` picks a variant
    such as BF16_DOT_NO_PREFETCH, for benchmarks), or None where it cannot run here (no
    AVX512-BF16, or no build): callers fall back to oneDNN."""
    return load(DOT_SOURCE, DOT_FLAGS, {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
                {"bf16_dot_pack": PACK, "bf16_dot_gemm": GEMM}, defines)


def holds_bf16(weight: torch.Tensor) -> bool:
    """Whether every value of an fp32 tensor is a bf16 (its low 16 bits are zero): then it widens
    back from bf16 exactly."""
    return not bool((weight.detach().contiguous().view(torch.int32) & 0xFFFF).any())


class RowsLinear:
    """y = x Wᵀ + b (fp32 x, CPU) through `rows_gemm`: the weight is copied ONCE into [N/16, K, 16]
    column blocks (the kernel's layout; the model's own weight is not kept), in its own dtype:
    fp32, or bf16 (`rows_gemm_bf16`: the same fp32 products, bit-identical to an fp32 weight
    holding the same values, from half the bytes). An fp32 weight whose every value is a bf16
    (a bf16 checkpoint served in fp32, `TargetEngine`'s `weights_dtype`) is kept as bf16 too,
    unless `narrow=False`: the same bits either way. A plain object like
    `dspark.runtime.linear.Dense`, with the same call. `lib` runs another build of the kernel
    (`library(defines)`: benchmarks compare variants)."""

    __slots__ = ("packed", "bias", "out_features", "in_features", "lib", "gemm")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 lib: ctypes.CDLL | None = None, narrow: bool = True) -> None:
        lib = lib if lib is not None else library()
        if lib is None:
            raise RuntimeError("the rows_gemm kernel is not available on this machine")
        bf16 = weight.dtype == torch.bfloat16 or (narrow and weight.dtype == torch.float32
                                                  and holds_bf16(weight))
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu" \
                or weight.dim() != 2:
            raise ValueError(f"RowsLinear takes a 2-D fp32 or bf16 CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        n, k = weight.shape
        w = weight.detach().float().contiguous()  # a bf16 weight widens exactly, and packs back exactly
        self.packed = torch.empty(-(-n // 16), k, 16, dtype=torch.int16 if bf16 else torch.float32)
        (lib.rows_gemm_pack_bf16 if bf16 else lib.rows_gemm_pack)(w.data_ptr(), self.packed.data_ptr(), n, k)
        self.gemm = lib.rows_gemm_bf16 if bf16 else lib.rows_gemm
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.out_features, self.in_features, self.lib = n, k, lib

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features:
            raise ValueError(f"RowsLinear expects fp32 [..., {self.in_features}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        x2d = x.reshape(-1, self.in_features).contiguous()
        m = x2d.shape[0]
        y = torch.empty(m, self.out_features)
        if m:
            bias = None if self.bias is None else self.bias.data_ptr()
            self.gemm(x2d.data_ptr(), self.packed.data_ptr(), bias, y.data_ptr(), m, self.out_features,
                      self.in_features, torch.get_num_threads())
        return y.view(*x.shape[:-1], self.out_features)


class DotBf16Linear:
    """y = x Wᵀ + b (bf16 x, W and y; CPU with AVX512-BF16) through `bf16_dot_gemm`: the weight is
    copied ONCE into [N/64, K/2, 64, 2] column groups (the kernel's layout; an odd K gets a zero
    column, and x a zero column with it), the bias kept in fp32. Every output is one fp32 chain of
    bf16 pair products over k in order, rounded to bf16 once: bit-identical alone and in any
    batch. On SmolLM2's shapes (AMD EPYC, 1 thread) it streams the weights at ~1.7x oneDNN's pace
    from 1 to 6 rows (`dspark bench-cpu-gemm --dtype bf16`, README "Serving matmuls"). A plain
    object like `dspark.runtime.linear.Dense`, with the same call."""

    __slots__ = ("packed", "bias", "out_features", "in_features", "lib")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 lib: ctypes.CDLL | None = None) -> None:
        lib = lib if lib is not None else dot_library()
        if lib is None:
            raise RuntimeError("the bf16_dot_gemm kernel is not available on this machine "
                               "(needs AVX512-BF16)")
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"DotBf16Linear takes a 2-D bf16 CPU weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        n, k = weight.shape
        w = weight.detach().contiguous()
        if k % 2:
            w = torch.cat([w, w.new_zeros(n, 1)], 1)
        self.packed = torch.empty(-(-n // 64), w.shape[1] // 2, 64, 2, dtype=torch.bfloat16)
        lib.bf16_dot_pack(w.data_ptr(), self.packed.data_ptr(), n, w.shape[1])
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.out_features, self.in_features, self.lib = n, k, lib

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features:
            raise ValueError(f"DotBf16Linear expects bf16 [..., {self.in_features}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        x2d = x.reshape(-1, self.in_features).contiguous()
        if self.in_features % 2:
            x2d = torch.cat([x2d, x2d.new_zeros(x2d.shape[0], 1)], 1)
        m = x2d.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.bfloat16)
        if m:
            bias = None if self.bias is None else self.bias.data_ptr()
            self.lib.bf16_dot_gemm(x2d.data_ptr(), self.packed.data_ptr(), bias, y.data_ptr(), m,
                                   self.out_features, x2d.shape[1], torch.get_num_threads())
        return y.view(*x.shape[:-1], self.out_features)
