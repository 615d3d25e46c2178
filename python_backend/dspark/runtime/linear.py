"""Serving projections x [..., in] -> [..., out] over weights a model already owns: `Dense`
(F.linear), `PackedLinear` (oneDNN-prepacked, CPU), `dspark.runtime.cpu_gemm.RowsLinear` (our fp32
kernel for AVX2 CPUs), `dspark.runtime.cpu_gemm.DotBf16Linear` (our bf16 kernel for AVX512-BF16
CPUs) and the rule that picks one
(`serving_linear`); `dspark.runtime.quant.Int4Linear` is the int4 drop-in with the same call.
Used by the target's fused layout (`dspark.runtime.model`) and the DSpark drafter.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from dspark.runtime import cpu_gemm


class Projection(Protocol):
    """A serving projection x [..., in] -> [..., out]: `Dense`, `PackedLinear`,
    `dspark.runtime.cpu_gemm.RowsLinear`, `dspark.runtime.cpu_gemm.DotBf16Linear` or
    `dspark.runtime.quant.Int4Linear`."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Dense:
    """y = x Wᵀ + b over weights the model already owns (the fused serving layout). A plain
    object, not a module: it adds nothing to state_dict. `dspark.runtime.quant.Int4Linear` is
    the int4 drop-in with the same call."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear:
    """`Dense` with the weight reordered ONCE into oneDNN's blocked layout (what inductor's
    weight freezing does on CPU). Measured on this CPU (1 thread, all 30 layers' shapes): bf16
    1 row 11.8 ms instead of 22.0 with F.linear, 16 rows 20.8 instead of 29.0; the bf16 LM head
    1.4 ms instead of 3.3; fp32 16 rows 37 instead of 91. bf16 results are bit-identical to
    F.linear, fp32 within ~1e-6 (another summation order)."""

    __slots__ = ("packed", "bias", "out_features", "bf16")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), pack_rows_hint(weight.dtype))
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]
        self.bf16 = weight.dtype == torch.bfloat16  # padded to BF16_MIN_ROWS rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        m = x2d.shape[0]
        padded = row_bucket(m)
        if self.bf16 and padded < BF16_MIN_ROWS:
            padded = BF16_MIN_ROWS
        if padded != m:
            x2d = torch.cat([x2d, x2d.new_zeros(padded - m, x2d.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x2d, self.packed, self.bias, "none", [], "")
        return y[:m].view(*x.shape[:-1], self.out_features)


def row_bucket(m: int) -> int:
    """Rows a prepacked matmul runs with for `m` input rows. oneDNN builds (and caches) one
    primitive per row count, and a ragged verify makes a new count nearly every step: the cache
    churns and the process's memory grows for hours. Exact up to 16 rows (decode and short
    verifies, where a padded row costs most), then a multiple of 8 up to 64, then four sizes
    per octave (<= 25 % padding): about 46 row counts up to 4 096."""
    if m <= 16:
        return m
    if m <= 64:
        return -(-m // 8) * 8
    step = 1 << (m.bit_length() - 3)
    return -(-m // step) * step


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_kind(flags: set[str] | None = None) -> str:
    """The kind of matmul kernels this CPU runs, which sets what a step costs by its rows:
    "amx" (AMX-BF16: the team's Intel machines, where the shipped SPS tables were profiled),
    "avx512bf16" (AVX512-BF16 without AMX, e.g. AMD EPYC), "avx512" (AVX512 without bf16
    instructions), "avx2" (AVX2 only: oneDNN has no bf16 kernels, so `dtype=auto` serves fp32,
    `has_bf16_matmul`) or "" (none of them). `flags` default to this CPU's."""
    f = cpu_flags() if flags is None else flags
    for flag, kind in (("amx_bf16", "amx"), ("avx512_bf16", "avx512bf16"), ("avx512f", "avx512"),
                       ("avx2", "avx2")):
        if flag in f:
            return kind
    return ""


def has_bf16_matmul() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512 or AMX). Without it (an
    AVX2-only CPU) bf16 falls back to slow reference kernels: on an AVX2 AMD EPYC (1 thread,
    SmolLM2) a verify of 8 tokens took 231 ms in bf16 against 99 ms in fp32 and a 256-token
    prefill 5.5 s against 0.8 s (`dspark bench-drafter --dtype bf16|fp32`)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_min_rows(flags: set[str] | None = None) -> int:
    """Fewest rows a bf16 prepacked matmul runs with (real rows first, zero rows after). oneDNN
    picks its kernel by row count, and on an x86 CPU with AVX512-BF16 but no AMX its 1- and
    2-row kernels are slower than its 5-row one: on SmolLM2 (AMD EPYC, 1 thread) a verify of
    1 / 2 tokens took 32.7 / 35.9 ms as they are and 31.1 / 32.0 ms as 5 rows, and plain batch-1
    decoding ran 1.03x as fast (median of 5 paired rounds; `dspark bench-min-rows` ->
    results/min_rows_smollm2.json, README "Small matmuls"). So 5 there; 1 elsewhere (AMX CPUs
    were not measured; fp32 is fastest at 1 row, so it never pads). `DSPARK_BF16_MIN_ROWS`
    overrides; `flags` default to this CPU's."""
    env = os.environ.get("DSPARK_BF16_MIN_ROWS", "")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"DSPARK_BF16_MIN_ROWS must be a positive integer, got {env!r}")
        rows = int(env)
    else:
        rows = 5 if cpu_kind(flags) == "avx512bf16" else 1
    return rows


def pack_rows_hint(dtype: torch.dtype, flags: set[str] | None = None) -> int:
    """Rows oneDNN is told to expect when it reorders a weight (its batch-size hint): the packed
    layout it picks sets which kernel each row count runs. On an AVX2-only CPU, fp32 packed for 1
    row runs 2+ rows in a slow kernel: one SmolLM2 verify (AVX2 AMD EPYC, 1 thread) of 1 / 2 / 8
    tokens took 56.0 / 93.0 / 114.1 ms with hint 1 and 55.9 / 58.6 / 84.8 ms with hint 8
    (`dspark profile-sps` with `DSPARK_PACK_ROWS_HINT=1` and without, README "The SPS table the
    scheduler uses"; hints 2, 4 and 16 ran alike in a matmul-only timing).
    So 8 for fp32 there; 1 elsewhere, where the shipped tables were profiled with it (other hints
    not measured there). `DSPARK_PACK_ROWS_HINT` overrides; `flags` default to this CPU's."""
    env = os.environ.get("DSPARK_PACK_ROWS_HINT", "")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"DSPARK_PACK_ROWS_HINT must be a positive integer, got {env!r}")
        return int(env)
    kind = THIS_CPU_KIND if flags is None else cpu_kind(flags)
    return 8 if dtype == torch.float32 and kind == "avx2" else 1


THIS_CPU_KIND = cpu_kind()  # read once: every PackedLinear asks (`pack_rows_hint`)
BF16_MIN_ROWS = bf16_min_rows()  # read by every bf16 PackedLinear call (`dspark bench-min-rows` sets it)


def cpu_gemm_choice(dtype: torch.dtype, flags: set[str] | None = None) -> str:
    """Which kernels run a CPU weight of `dtype`: "rows" (our `dspark.runtime.cpu_gemm` kernels)
    - for fp32 on an AVX2-only CPU, where oneDNN's fp32 kernels scale badly with rows: all 30
      SmolLM2 layers' matmuls and the LM head (AVX2 AMD EPYC, 1 thread) took 22.6 / 32.7 / 44.9 ms
      at 1 / 4 / 8 rows against oneDNN's 38.6 / 50.8 / 63.5, and 772.8 against 898.7 ms at 256
      rows (`dspark bench-cpu-gemm`, README "Serving matmuls");
    - for bf16 on an AVX512-BF16 CPU without AMX, where oneDNN streams a few rows' weights at
      ~60 % of the memory's pace: the same projections (AMD EPYC, 1 thread) in bf16 took about
      11-12 ms from 1 to 6 rows against oneDNN's 18-21 (`dspark bench-cpu-gemm --dtype bf16`);
    "onednn" elsewhere (AMX CPUs were not measured). `DSPARK_CPU_GEMM=rows|onednn` overrides
    (rows: fp32 where the AVX2 kernel runs, bf16 where the AVX512-BF16 one does); `flags` default
    to this CPU's."""
    env = os.environ.get("DSPARK_CPU_GEMM", "")
    kind = THIS_CPU_KIND if flags is None else cpu_kind(flags)
    if env:
        if env not in ("rows", "onednn"):
            raise ValueError(f"DSPARK_CPU_GEMM must be rows or onednn, got {env!r}")
        if dtype == torch.bfloat16 and kind not in ("avx512bf16", "amx"):
            return "onednn"
        return env if dtype in (torch.float32, torch.bfloat16) else "onednn"
    if dtype == torch.float32 and kind == "avx2" or dtype == torch.bfloat16 and kind == "avx512bf16":
        return "rows"
    return "onednn"


def serving_cpu_gemm(dtype: torch.dtype) -> str:
    """What runs this process's CPU weights of `dtype`: `cpu_gemm_choice`, or "onednn" where our
    kernel for it cannot be built (recorded in SPS tables and bench results)."""
    choice = cpu_gemm_choice(dtype)
    if choice != "rows":
        return choice
    lib = cpu_gemm.dot_library() if dtype == torch.bfloat16 else cpu_gemm.library()
    return "rows" if lib is not None else "onednn"


def serving_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                   prepack: bool = True) -> Projection:
    """The fastest projection for this weight on CPU: our kernels (`cpu_gemm_choice`) or
    oneDNN-prepacked in fp32 / bf16; else Dense (also with prepack=False: torch.compile with
    freezing packs the weights itself)."""
    on_cpu = prepack and weight.device.type == "cpu"
    if on_cpu and serving_cpu_gemm(weight.dtype) == "rows":
        if weight.dtype == torch.bfloat16:
            return cpu_gemm.DotBf16Linear(weight, bias)
        return cpu_gemm.RowsLinear(weight, bias)
    cpu_packable = (on_cpu and (weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
                                or weight.dtype == torch.bfloat16 and has_bf16_matmul()))
    return PackedLinear(weight, bias) if cpu_packable else Dense(weight, bias)
