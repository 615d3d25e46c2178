"""Every Triton kernel equals its torch reference on random ragged inputs (architecture §6), and
`dspark_kernels` stands alone: it imports nothing from `dspark`, one dispatcher picks the kernels.

Kernels run on the CPU under TRITON_INTERPRET=1. Triton picks interpreter or compiler when
a kernel is decorated (module import), so the fixture sets the variable and (re)imports
the kernel modules. The interpreter is slow: sizes are small, edge cases are explicit
(ℓ_r = 0, single-token requests, long rows, vocabulary not a multiple of the block).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from dspark.runtime.verify import rejection_sample
from dspark_kernels import dispatch, reference
from dspark_kernels.reference import rejection_sample_ref


@pytest.fixture(scope="module")
def kernels():
    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "DSPARK_KERNELS")}
    os.environ["TRITON_INTERPRET"] = "1"
    mods = {}
    for name in ("rejection", "varlen_attention", "block_sample"):
        mods[name] = importlib.reload(importlib.import_module(f"dspark_kernels.{name}"))
    yield mods
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def ragged_case(seed: int, lens: list[int], gamma: int, vocab: int, closeness: float):
    """Random p_t rows and drafts; closeness in [0, 1] pulls p_t towards p_d so many drafts pass."""
    g = torch.Generator().manual_seed(seed)
    r = len(lens)
    lens_t = torch.tensor(lens)
    cu = torch.zeros(r + 1, dtype=torch.int64)
    cu[1:] = (lens_t + 1).cumsum(0)
    p_d = torch.softmax(torch.randn(r, gamma, vocab, generator=g) * 2, -1)
    drafts = torch.multinomial(p_d.view(-1, vocab), 1, generator=g).view(r, gamma)
    own = torch.softmax(torch.randn(int(cu[-1]), vocab, generator=g) * 2, -1)
    rows_r = torch.repeat_interleave(torch.arange(r), lens_t + 1)
    rows_j = (torch.arange(int(cu[-1])) - cu[rows_r]).clamp(max=gamma - 1)
    p_t = closeness * p_d[rows_r, rows_j] + (1 - closeness) * own
    uniforms = torch.rand(r, gamma + 1, generator=g)
    flat = p_d[torch.arange(gamma)[None, :] < lens_t[:, None]]  # [Σℓ, V]: verified drafts only
    return p_t, drafts, flat, cu, uniforms


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rejection_kernel_equals_reference(kernels, with_draft_probs):
    lens = [0, 1, 8, 3, 0, 8, 5, 2]  # ℓ = 0, single-token, long rows (ℓ = γ)
    accepted_total = 0
    for seed, closeness in ((0, 0.9), (1, 0.5)):
        p_t, drafts, p_d, cu, u = ragged_case(seed, lens, gamma=8, vocab=37, closeness=closeness)
        q = p_d if with_draft_probs else None
        ref_n, ref_tokens = rejection_sample_ref(p_t, drafts, q, cu, u)
        got_n, got_tokens = kernels["rejection"].rejection_sample_triton(p_t, drafts, q, cu, u, block_v=16)
        assert torch.equal(got_n, ref_n) and torch.equal(got_tokens, ref_tokens)
        accepted_total += int(ref_n.sum())
    assert accepted_total > 0  # the case exercises acceptance, rejection and bonus paths


def test_rejection_zero_mass_fallback_and_dispatch(kernels, monkeypatch):
    """Rejected row with p_t == p_d (zero residual) samples p_t; forced dispatch hits the kernel."""
    p = torch.tensor([[0.25, 0.25, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0]])
    drafts, q = torch.tensor([[3]]), p[:1]
    cu, u = torch.tensor([0, 2]), torch.tensor([[0.5, 0.6]])
    monkeypatch.setenv("DSPARK_KERNELS", "triton")
    assert dispatch.kernel("rejection_sample", p) is kernels["rejection"].rejection_sample_triton
    got = rejection_sample(p, drafts, q, cu, u)
    _, ref_tokens = rejection_sample_ref(p, drafts, q, cu, u)
    assert got.tokens.tolist() == ref_tokens.tolist() == [[2, -1]]  # 0.6 · 1.0 falls in token 2's mass
    monkeypatch.setenv("DSPARK_KERNELS", "torch")
    assert dispatch.kernel("rejection_sample", p) is reference.rejection_sample_ref
    monkeypatch.setenv("DSPARK_KERNELS", "auto")
    assert not dispatch.use_triton(p)  # CPU tensors: the reference
    monkeypatch.setenv("DSPARK_KERNELS", "fast")
    with pytest.raises(ValueError, match="DSPARK_KERNELS"):
        dispatch.use_triton(p)


def test_varlen_attention_kernel_equals_reference(kernels):
    mod = kernels["varlen_attention"]
    g = torch.Generator().manual_seed(0)
    capacity, n_kv, max_len, head_dim, n_heads = 4, 2, 40, 20, 6  # GQA group 3, head_dim not a power of 2
    k_cache = torch.randn(capacity, n_kv, max_len, head_dim, generator=g)
    v_cache = torch.randn(capacity, n_kv, max_len, head_dim, generator=g)
    lens, starts = [1, 5, 3, 17], [0, 7, 30, 12]  # single token at position 0, long row
    slots = torch.tensor([2, 0, 3, 1])
    cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lens).cumsum(0)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    q = torch.randn(int(cu[-1]), n_heads, head_dim, generator=g)
    ref = reference.varlen_attention_ref(q, k_cache, v_cache, cu, positions, slots)
    got = mod.varlen_attention_triton(q, k_cache, v_cache, cu, positions, slots, block_n=16)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # The reference really is causal and per slot: the first token of request 1 sees keys 0..7 only.
    manual = torch.softmax(q[1, 0] @ k_cache[0, 0, :8].T / head_dim**0.5, -1) @ v_cache[0, 0, :8]
    torch.testing.assert_close(ref[1, 0], manual, atol=1e-5, rtol=1e-5)


def test_block_sample_kernel_equals_reference(kernels):
    mod = kernels["block_sample"]
    g = torch.Generator().manual_seed(0)
    r, gamma, rank = 4, 2, 8
    for vocab, block_v in ((37, 64), (50, 16)):  # one block; several blocks with a ragged tail
        base = torch.randn(r, gamma, vocab, generator=g) * 2
        w1, w2 = torch.randn(vocab, rank, generator=g) * 0.3, torch.randn(vocab, rank, generator=g) * 0.3
        anchors = torch.randint(0, vocab, (r,), generator=g)
        if vocab == 37:  # greedy, plain, top-k, top-k + top-p
            t, k, p = [0.0, 1.0, 0.7, 0.9], [0, 0, 5, 3], [1.0, 1.0, 1.0, 0.8]
        else:  # top-p alone over several blocks
            t, k, p = [1.3, 0.0, 1.0, 1.0], [0, 0, 0, 0], [0.7, 1.0, 1.0, 1.0]
        t, k, p = torch.tensor(t), torch.tensor(k), torch.tensor(p)
        u = torch.rand(r, gamma, generator=g)
        ref_tokens, ref_probs = reference.block_sample_ref(base, anchors, w1, w2, t, k, p, u)
        tokens, probs = mod.block_sample_triton(base, anchors, w1, w2, t, k, p, u, block_v=block_v)
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=1e-5)
        assert torch.equal(probs > 0, ref_probs > 0)  # same top-k / top-p support


def test_varlen_attention_dispatch_matches_model_contract(kernels, monkeypatch):
    """dspark.runtime.attention calls varlen_attention(q, k, v, tok_slot, positions, cu_seqlens, slots,
    scale)."""
    mod = kernels["varlen_attention"]
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 1, 8, 16, generator=g), torch.randn(2, 1, 8, 16, generator=g)
    cu, slots = torch.tensor([0, 2, 3]), torch.tensor([1, 0])
    positions, tok_slot = torch.tensor([3, 4, 0]), torch.tensor([1, 1, 0])
    q = torch.randn(3, 2, 16, generator=g)
    ref = reference.varlen_attention_ref(q, k_cache, v_cache, cu, positions, slots, 0.3)
    monkeypatch.setenv("DSPARK_KERNELS", "torch")
    cpu = mod.varlen_attention(q, k_cache, v_cache, tok_slot, positions, cu, slots, 0.3)
    torch.testing.assert_close(cpu, ref)
    monkeypatch.setenv("DSPARK_KERNELS", "triton")
    got = mod.varlen_attention(q, k_cache, v_cache, tok_slot, positions, cu, slots, 0.3)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_kernels_package_imports_nothing_from_dspark():
    """dspark_kernels stands alone (torch and Triton only): a fresh interpreter that imports every
    module of it never loads a `dspark` module."""
    import subprocess
    import sys

    code = ("import sys, importlib; [importlib.import_module('dspark_kernels.' + m) for m in "
            "('reference', 'dispatch', 'rejection', 'block_sample', 'varlen_attention', 'bench')]; "
            "print(sorted(m for m in sys.modules if m == 'dspark' or m.startswith('dspark.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.stdout.strip() == "[]"
