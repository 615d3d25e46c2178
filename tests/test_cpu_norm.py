"""Our bf16 CPU residual add + RMSNorm (kernels/cpu/rms_norm.c via dspark.runtime.cpu_norm) against
torch's add and `F.rms_norm`: the sum bit-identical, the norm within one bf16 step of torch's (it
sums the squares in another order) and bit-identical on most values, a row's result the same alone
and in any batch, SmolLM2's massive activations, and the layouts and dtypes that take torch's path
(the target's forward calls it: tests/test_target.py compares that forward with transformers)."""

from __future__ import annotations

import pytest
import torch

from dspark.runtime import cpu_norm

needs_kernel = pytest.mark.skipif(cpu_norm.library() is None,
                                  reason="no C compiler or no AVX512 on this machine")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between same-signed bf16 values."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@needs_kernel
@pytest.mark.parametrize("d", [16, 17, 64, 576, 1000])
def test_matches_torch_add_and_rms_norm(d):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(37, d, generator=g) * 3).bfloat16()
    x[0, 0] = 400.0  # a massive activation (SmolLM2's residual stream has them)
    delta = torch.randn(37, d, generator=g).bfloat16()
    weight = (torch.rand(d, generator=g) + 0.5).bfloat16()
    before = x.clone()
    for dl in (delta, None):
        got_x, got = cpu_norm.add_rms_norm(x, dl, weight, 1e-5)
        want_x, want = cpu_norm.add_rms_norm_reference(x, dl, weight, 1e-5)
        assert torch.equal(got_x, want_x)  # the residual add rounds exactly as torch's
        assert ulps(got, want).max() <= 1 and (got != want).float().mean() < 1e-3
    assert torch.equal(x, before)  # the inputs are left as they are


@needs_kernel
def test_a_row_is_the_same_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(9, 576, generator=g).bfloat16(), torch.randn(9, 576, generator=g).bfloat16()
    weight = torch.rand(576, generator=g).bfloat16()
    _, batch = cpu_norm.add_rms_norm(x, delta, weight, 1e-5)
    for i in range(9):
        _, alone = cpu_norm.add_rms_norm(x[i:i + 1].clone(), delta[i:i + 1].clone(), weight, 1e-5)
        assert torch.equal(alone[0], batch[i])


@needs_kernel
def test_strided_rows_and_empty_batch():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 1152, generator=g).bfloat16()
    x, weight = wide[:, :576], torch.rand(576, generator=g).bfloat16()  # row stride 1152
    assert cpu_norm.enabled(x, weight)
    got_x, got = cpu_norm.add_rms_norm(x, None, weight, 1e-6)
    want = cpu_norm.add_rms_norm_reference(x.contiguous(), None, weight, 1e-6)[1]
    assert got_x is x and ulps(got, want).max() <= 1
    empty = torch.empty(0, 576, dtype=torch.bfloat16)
    assert cpu_norm.add_rms_norm(empty, empty, weight, 1e-6)[1].shape == (0, 576)


def test_other_dtypes_take_torchs_path():
    g = torch.Generator().manual_seed(2)
    x, delta = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    weight = torch.rand(32, generator=g)
    assert not cpu_norm.enabled(x, weight)
    got_x, got = cpu_norm.add_rms_norm(x, delta, weight, 1e-5)
    want_x, want = cpu_norm.add_rms_norm_reference(x, delta, weight, 1e-5)
    assert torch.equal(got_x, want_x) and torch.equal(got, want)


@needs_kernel
def test_rms_norm_module_runs_the_kernel_at_bf16_inference_and_torch_under_autograd(monkeypatch):
    """`model.RMSNorm` on bf16 CPU rows of any leading shape runs the kernel when no gradient is
    recorded (the drafter's norms at serving time: [R, T, H, hd] q/k norms too), F.rms_norm when
    autograd records (training) and for fp32."""
    from dspark.runtime.model import RMSNorm

    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 4, 64, generator=torch.Generator().manual_seed(0)).bfloat16() * 4
    calls: list[int] = []
    kernel = cpu_norm.add_rms_norm
    monkeypatch.setattr("dspark.runtime.model.add_rms_norm", lambda *a: calls.append(1) or kernel(*a))
    with torch.inference_mode():
        got = norm(x)
    want = torch.nn.functional.rms_norm(x, (64,), norm.weight.detach(), 1e-6)
    assert calls and got.shape == x.shape and ulps(got, want).max() <= 1
    calls.clear()
    y = norm(x.requires_grad_())
    y.float().sum().backward()
    assert not calls and norm.weight.grad is not None
    with torch.no_grad():
        norm.float()(x.detach().float())
    assert not calls


@needs_kernel
def test_bench_glue_times_every_way_and_restores_the_switches(tiny_ckpt, tmp_path):
    """`dspark bench-glue` on the tiny checkpoint in bf16: verify times and plain tokens/s for
    torch's ops, the kernels, ungrouped attention and the matmuls without their prefetch, round
    by round, and the switches
    (`cpu_norm.USE`, `cpu_attention.GROUPED`) as they were after."""
    import json

    from dspark.cli import main
    from dspark.runtime import cpu_attention

    out = tmp_path / "glue.json"
    before = cpu_norm.USE, cpu_attention.GROUPED
    assert main(["bench-glue", "--model", str(tiny_ckpt), "--rounds", "2", "--repeats", "2",
                 "--tokens", "1,3", "--context", "8", "--max-tokens", "4", "--prompts-per-round", "1",
                 "--num-threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["verify_ms"]) == {"torch", "kernels", "ungrouped", "no-prefetch"}
    assert result["prefetch_plain_speedup"] > 0
    assert set(result["verify_ms"]["torch"]) == {"1", "3"} == set(result["grouped_attention_saved_ms"])
    assert all(len(v) == 2 and min(v) > 0 for v in result["plain_tokens_per_s"].values())
    assert result["plain_speedup"] > 0 and result["grouped_attention_plain_speedup"] > 0
    assert (cpu_norm.USE, cpu_attention.GROUPED) == before
