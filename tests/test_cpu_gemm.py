"""The rows kernel (kernels/cpu/rows_gemm.c via dspark.runtime.cpu_gemm) against F.linear, its
batch invariance, its bf16-weight entry against the fp32 one; the bf16 dot-product kernel
(kernels/cpu/bf16_dot_gemm.c, AVX512-BF16 CPUs only) against F.linear and its batch invariance;
and the rule that picks them (`linear.cpu_gemm_choice`)."""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from dspark.bench import cpu_gemm as bench
from dspark.runtime import cpu_gemm, linear

needs_kernel = pytest.mark.skipif(cpu_gemm.library() is None,
                                  reason="no C compiler or no AVX2 + FMA on this machine")


@contextmanager
def torch_threads(n: int):
    """torch's CPU thread count set to n inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


needs_dot_kernel = pytest.mark.skipif(cpu_gemm.dot_library() is None,
                                      reason="no C compiler or no AVX512-BF16 on this machine")


@needs_kernel
@pytest.mark.parametrize("n,k", [(40, 64), (17, 33), (1, 5), (96, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13])
def test_rows_linear_equals_f_linear(n, k, rows):
    """Every shape (N not a multiple of the 16-column block, K odd, rows not a multiple of the
    6-row tile), with and without bias, leading dims kept."""
    g = torch.Generator().manual_seed(n * 1000 + k * 10 + rows)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(rows, 2, k, generator=g)[:, 1]  # not contiguous: the kernel gets a copy
    for bias in (None, b):
        y = cpu_gemm.RowsLinear(w, bias)(x)
        assert y.shape == (rows, n)
        torch.testing.assert_close(y, F.linear(x, w, bias), atol=1e-4 * k ** 0.5, rtol=1e-5)
    assert cpu_gemm.RowsLinear(w)(x[:, None]).shape == (rows, 1, n)
    assert cpu_gemm.RowsLinear(w)(x[:0]).shape == (0, n)


@needs_kernel
def test_rows_linear_is_batch_invariant():
    """A row's output is bit-identical alone and in any batch, and with more threads: what makes
    a speculative verify compute exactly the logits plain decoding computes."""
    torch.manual_seed(0)
    w, x = torch.randn(200, 576), torch.randn(23, 576)
    lin = cpu_gemm.RowsLinear(w)
    full = lin(x)
    for i in (0, 5, 6, 22):
        assert torch.equal(lin(x[i:i + 1])[0], full[i])
        assert torch.equal(lin(x[max(0, i - 3):i + 1])[-1], full[i])
    with torch_threads(2):
        assert torch.equal(lin(x), full)


@needs_kernel
def test_prefetch_changes_no_bit():
    """The kernel's prefetch of the next column blocks moves data, not arithmetic: the build
    without it (`bench-cpu-gemm --without-prefetch`) gives bit-identical outputs, over rows that
    take every tile shape and enough blocks that the prefetch runs to the last one."""
    variant = cpu_gemm.library(("ROWS_GEMM_NO_PREFETCH",))
    assert variant is not None and variant is not cpu_gemm.library()
    torch.manual_seed(1)
    w, b = torch.randn(150, 96), torch.randn(150)
    with_prefetch, without = cpu_gemm.RowsLinear(w, b), cpu_gemm.RowsLinear(w, b, lib=variant)
    for rows in (1, 2, 3, 4, 5, 6, 8, 13):
        x = torch.randn(rows, 96)
        assert torch.equal(with_prefetch(x), without(x))


@needs_kernel
def test_rows_linear_rejects_what_it_cannot_run():
    lin = cpu_gemm.RowsLinear(torch.randn(8, 16))
    with pytest.raises(ValueError, match="fp32"):
        lin(torch.randn(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\]"):
        lin(torch.randn(2, 15))
    with pytest.raises(ValueError, match="fp32 or bf16 CPU weight"):
        cpu_gemm.RowsLinear(torch.randn(8, 16, dtype=torch.float16))


@needs_kernel
@pytest.mark.parametrize("n,k", [(40, 64), (17, 33), (150, 96)])
def test_bf16_weight_computes_the_fp32_kernels_bits(n, k):
    """A bf16 weight streams half the bytes and widens exactly in registers: every output is
    bit-identical to the fp32 kernel over the same values widened to fp32 (so batch invariant
    like it), at every tile shape, with and without bias, and close to F.linear."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    for bias in (None, b):
        half, full = cpu_gemm.RowsLinear(w, bias), cpu_gemm.RowsLinear(w.float(), bias, narrow=False)
        assert half.packed.element_size() == 2 and full.packed.element_size() == 4
        assert cpu_gemm.RowsLinear(w.float()).packed.element_size() == 2  # its values are bf16s
        assert cpu_gemm.RowsLinear(w.float() * 1.001).packed.element_size() == 4
        for rows in (1, 2, 3, 4, 5, 6, 7, 13, 24, 31):  # from 24 rows a block is widened once
            x = torch.randn(rows, k, generator=g)
            y = half(x)
            assert torch.equal(y, full(x))
            torch.testing.assert_close(y, F.linear(x, w.float(), bias), atol=1e-4 * k ** 0.5, rtol=1e-5)


@needs_kernel
def test_bf16_pack_rounds_to_nearest_even():
    """`rows_gemm_pack_bf16` rounds an fp32 weight as torch's bf16 cast does (ties to even), into
    the kernel's column order within each 16-column block (0-3, 8-11, 4-7, 12-15)."""
    torch.manual_seed(2)
    n, k = 35, 9
    w = torch.randn(n, k)
    w[0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -9])  # ties, and below
    packed = torch.empty(-(-n // 16), k, 16, dtype=torch.int16)
    cpu_gemm.library().rows_gemm_pack_bf16(w.data_ptr(), packed.data_ptr(), n, k)
    order = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]  # column j sits at order[j]
    expect = torch.zeros(packed.shape[0] * 16, k, dtype=torch.int16)
    expect[:n] = w.bfloat16().view(torch.int16)
    expect = expect.view(-1, 16, k).transpose(1, 2)  # [blocks, K, 16] in column order
    assert torch.equal(packed[:, :, order], expect)


def test_cpu_gemm_choice_only_where_measured(monkeypatch):
    """fp32 on an AVX2-only CPU runs the rows kernel, bf16 on an AVX512-BF16 CPU without AMX the
    dot-product kernel; the rest keeps oneDNN, unless DSPARK_CPU_GEMM says so (bf16 only where
    the dot kernel can run); serving_linear follows the choice."""
    monkeypatch.delenv("DSPARK_CPU_GEMM", raising=False)
    avx2, bf16_cpu = {"avx2", "fma"}, {"avx2", "fma", "avx512f", "avx512_bf16"}
    amx = bf16_cpu | {"amx_bf16"}
    assert linear.cpu_gemm_choice(torch.float32, avx2) == "rows"
    assert linear.cpu_gemm_choice(torch.bfloat16, avx2) == "onednn"
    assert linear.cpu_gemm_choice(torch.float32, bf16_cpu) == "onednn"
    assert linear.cpu_gemm_choice(torch.bfloat16, bf16_cpu) == "rows"
    assert linear.cpu_gemm_choice(torch.bfloat16, amx) == "onednn"
    monkeypatch.setenv("DSPARK_CPU_GEMM", "rows")
    assert linear.cpu_gemm_choice(torch.float32, bf16_cpu) == "rows"
    assert linear.cpu_gemm_choice(torch.bfloat16, amx) == "rows"
    assert linear.cpu_gemm_choice(torch.bfloat16, avx2) == "onednn"
    if cpu_gemm.library() is not None:
        assert isinstance(linear.serving_linear(torch.randn(8, 16)), cpu_gemm.RowsLinear)
    if cpu_gemm.dot_library() is not None:
        assert isinstance(linear.serving_linear(torch.randn(8, 16).bfloat16()), cpu_gemm.DotBf16Linear)
    monkeypatch.setenv("DSPARK_CPU_GEMM", "onednn")
    assert linear.cpu_gemm_choice(torch.bfloat16, bf16_cpu) == "onednn"
    assert not isinstance(linear.serving_linear(torch.randn(8, 16)), cpu_gemm.RowsLinear)
    assert not isinstance(linear.serving_linear(torch.randn(8, 16).bfloat16()), cpu_gemm.DotBf16Linear)
    monkeypatch.setenv("DSPARK_CPU_GEMM", "blas")
    with pytest.raises(ValueError, match="DSPARK_CPU_GEMM"):
        linear.cpu_gemm_choice(torch.float32, avx2)


def _tiny_bench(tmp_path):
    """A tiny Llama-shaped config.json folder and `dspark bench-cpu-gemm`'s argument parser."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 100}))
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return folder, p


@needs_kernel
def test_bench_cpu_gemm_writes_every_kernel(tmp_path):
    """`dspark bench-cpu-gemm --without-prefetch --bf16-weights` on a tiny Llama-shaped config: all
    four kernels timed at every row count, their paired ratios, and the exactness checks, in the JSON."""
    folder, p = _tiny_bench(tmp_path)
    out = tmp_path / "cg.json"
    args = p.parse_args(["--model", str(folder), "--rows", "1,4", "--rounds", "2", "--without-prefetch",
                         "--bf16-weights", "--out", str(out)])
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert set(result["ms"]) == {"onednn", "rows", "rows_no_prefetch", "rows_bf16"}
    assert all(set(v) == {"1", "4"} and min(v.values()) > 0 for v in result["ms"].values())
    assert set(result["rows_no_prefetch_over_rows_paired"]) == {"1", "4"}
    assert set(result["rows_over_rows_bf16_paired"]) == {"1", "4"}
    assert result["rows_no_prefetch_bit_identical"] and result["rows_batch_invariant"]
    assert result["rows_bf16_bit_identical_to_rows_on_bf16_values"]
    assert out.with_suffix(".png").is_file()


@needs_dot_kernel
def test_dot_prefetch_changes_no_bit():
    """The bf16 kernel's prefetch of the next column group (from 7 rows, two tiles or more) moves
    data, not arithmetic: the build without it (`bench-cpu-gemm --dtype bf16 --without-prefetch`)
    gives bit-identical outputs, over rows of one, two and four tiles and enough groups that the
    prefetch runs to the last one."""
    variant = cpu_gemm.dot_library(("BF16_DOT_NO_PREFETCH",))
    assert variant is not None and variant is not cpu_gemm.dot_library()
    torch.manual_seed(2)
    w, b = torch.randn(200, 96).bfloat16(), torch.randn(200)
    with_prefetch, without = cpu_gemm.DotBf16Linear(w, b), cpu_gemm.DotBf16Linear(w, b, lib=variant)
    for rows in (1, 6, 7, 8, 13, 19):
        x = torch.randn(rows, 96).bfloat16()
        assert torch.equal(with_prefetch(x), without(x))


@needs_dot_kernel
@pytest.mark.parametrize("n,k", [(40, 64), (17, 33), (1, 5), (130, 576), (70, 1536)])
def test_dot_bf16_linear_matches_f_linear(n, k):
    """Every shape (N not a multiple of the 64-column group, K odd, rows not a multiple of the
    6-row tile), with and without bias, leading dims kept: the fp32 sum rounded once to bf16, so
    within one bf16 rounding (2^-8 relative) of the exact product, as F.linear's bf16 output."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    for bias in (None, b):
        lin = cpu_gemm.DotBf16Linear(w, bias)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 31):
            x = torch.randn(rows, 2, k, generator=g).bfloat16()[:, 1]  # not contiguous
            y = lin(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
            exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5 * k).all()
        assert lin(x[:, None]).shape == (rows, 1, n)
        assert lin(x[:0]).shape == (0, n)


@needs_dot_kernel
def test_dot_bf16_linear_is_batch_invariant():
    """A row's bf16 output is bit-identical alone, in any batch (every tile shape), and with more
    threads: a speculative verify computes exactly the logits plain decoding computes."""
    torch.manual_seed(3)
    w, x = torch.randn(200, 576).bfloat16(), torch.randn(23, 576).bfloat16()
    lin = cpu_gemm.DotBf16Linear(w, torch.randn(200))
    full = lin(x)
    for m in range(1, 24):
        assert torch.equal(lin(x[:m]), full[:m])
    for i in (0, 5, 6, 22):
        assert torch.equal(lin(x[i:i + 1])[0], full[i])
    with torch_threads(2):
        assert torch.equal(lin(x), full)


@needs_dot_kernel
def test_dot_bf16_linear_rejects_what_it_cannot_run():
    lin = cpu_gemm.DotBf16Linear(torch.randn(8, 16).bfloat16())
    with pytest.raises(ValueError, match="bf16"):
        lin(torch.randn(2, 16))
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\]"):
        lin(torch.randn(2, 15).bfloat16())
    with pytest.raises(ValueError, match="bf16 CPU weight"):
        cpu_gemm.DotBf16Linear(torch.randn(8, 16))


@needs_dot_kernel
def test_bench_cpu_gemm_bf16_writes_both_kernels(tmp_path):
    """`dspark bench-cpu-gemm --dtype bf16` on a tiny Llama-shaped config: oneDNN and the dot
    kernel timed at every row count, their paired ratios and the exactness checks in the JSON;
    the fp32-only options are refused with it."""
    folder, p = _tiny_bench(tmp_path)
    out = tmp_path / "cg.json"
    args = p.parse_args(["--model", str(folder), "--dtype", "bf16", "--rows", "1,7", "--rounds", "2",
                         "--out", str(out)])
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert result["dtype"] == "bf16" and result["rows_kernel"] == "bf16_dot_gemm"
    assert set(result["ms"]) == {"onednn", "rows"} and set(result["onednn_over_rows_paired"]) == {"1", "7"}
    assert result["rows_batch_invariant"] and result["rows_max_abs_err_vs_f_linear"] < 0.1
    with pytest.raises(SystemExit, match="--bf16-weights"):
        bench.main(p.parse_args(["--model", str(folder), "--dtype", "bf16", "--bf16-weights"]))
