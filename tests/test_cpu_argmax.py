"""Our bf16 CPU row argmax (kernels/cpu/row_argmax.c via dspark.runtime.cpu_argmax) against torch's
`max(-1).indices`: random rows of every tail length, ties (the first maximum), NaN (the first NaN),
all -inf, and the layouts and dtypes that take torch's path (greedy verification calls it:
tests/test_verify.py); and the drafter's greedy bigram chain against its torch reference."""

from __future__ import annotations

import pytest
import torch

from dspark.runtime import cpu_argmax

needs_kernel = pytest.mark.skipif(cpu_argmax.library() is None,
                                  reason="no C compiler or no AVX512 on this machine")


@needs_kernel
@pytest.mark.parametrize("v", [1, 5, 15, 16, 17, 31, 33, 1000, 49152, 49153])
def test_matches_torch_on_random_rows_and_ties(v):
    g = torch.Generator().manual_seed(v)
    for x in (torch.randn(3, v, generator=g), torch.randint(-2, 2, (3, v), generator=g).float()):
        x = x.bfloat16()
        assert torch.equal(cpu_argmax.row_argmax(x), x.max(-1).indices)


@needs_kernel
def test_special_values_follow_torch():
    x = torch.randn(4, 100).bfloat16()
    x[0, 37] = x[0, 50] = float("nan")  # the first NaN
    x[1, 99] = float("nan")  # a NaN in the tail
    x[2, 3] = x[2, 5] = float("inf")  # the first of two maxima
    x[3] = float("-inf")  # every value -inf: index 0
    assert torch.equal(cpu_argmax.row_argmax(x), x.max(-1).indices)
    assert cpu_argmax.row_argmax(x).tolist()[:3] == [37, 99, 3]


def test_other_layouts_and_dtypes_take_torchs_path():
    x = torch.randn(6, 40)
    assert torch.equal(cpu_argmax.row_argmax(x), x.max(-1).indices)  # fp32
    b = x.bfloat16()
    assert torch.equal(cpu_argmax.row_argmax(b[:, ::2]), b[:, ::2].max(-1).indices)  # strided
    assert torch.equal(cpu_argmax.row_argmax(b[::2]), b[::2].max(-1).indices)  # row stride only
    assert cpu_argmax.row_argmax(b[:0]).shape == (0,)


@needs_kernel
@pytest.mark.parametrize("k", [1, 17, 100, 4096])
def test_bigram_chain_matches_torch(k):
    """The drafter's greedy Markov chain in one call: the same indices as torch's index_select,
    bf16 add and max per position, on random logits and on small integers (ties: the first
    maximum), for a block read at its first w positions (a strided view)."""
    g = torch.Generator().manual_seed(k)
    for make in (lambda *s: torch.randn(*s, generator=g),
                 lambda *s: torch.randint(-2, 2, s, generator=g).float()):
        bigram = make(k, k).bfloat16()
        full = make(3, 9, k).bfloat16()
        for base in (full, full[:, :5]):
            first = torch.randint(0, k, (3,), generator=g)
            out = cpu_argmax.bigram_chain(bigram, base, first)
            assert torch.equal(out, cpu_argmax.bigram_chain_reference(bigram, base, first))
            assert out.shape == base.shape[:2] and torch.equal(out[:, 0], first)


def test_bigram_chain_other_dtypes_take_torchs_path():
    bigram, base, first = torch.randn(7, 7), torch.randn(2, 3, 7), torch.tensor([1, 4])
    assert torch.equal(cpu_argmax.bigram_chain(bigram, base, first),
                       cpu_argmax.bigram_chain_reference(bigram, base, first))
