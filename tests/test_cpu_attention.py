"""Our bf16 CPU attention (kernels/cpu/cached_attention.c via dspark.runtime.cpu_attention) against
the exact attention and torch's path (`attention._attend_torch`), its batch invariance over
ragged batches, the meta that routes to it, and where an engine enables it."""

from __future__ import annotations

import pytest
import torch

from dspark.runtime import attention, cpu_attention
from dspark.runtime.batch import RaggedBatch

needs_kernel = pytest.mark.skipif(cpu_attention.library() is None,
                                  reason="no C compiler or no AVX512-BF16 on this machine")


def _exact(q, k_cache, v_cache, slots, positions, scale):
    """float64 reference: token i over keys 0..positions[i] of its slot, query head h on kv head h // G."""
    g = q.shape[1] // k_cache.shape[1]
    out = []
    for i in range(q.shape[0]):
        k = k_cache[slots[i], :, :positions[i] + 1].double().repeat_interleave(g, 0)
        v = v_cache[slots[i], :, :positions[i] + 1].double().repeat_interleave(g, 0)
        scores = torch.einsum("hd,hkd->hk", q[i].double(), k) * scale
        out.append(torch.einsum("hk,hkd->hd", scores.softmax(-1), v))
    return torch.stack(out)


def _case(lens, starts, slots, heads=9, kv=3, hd=64, cap=5, max_len=600, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(cap, kv, max_len, hd, generator=g).bfloat16() for _ in range(2))
    batch = RaggedBatch.from_requests(slots, [[1] * n for n in lens], starts)
    qkv = torch.randn(batch.num_tokens, heads + 2 * kv, hd, generator=g).bfloat16()
    return batch, qkv[:, :heads], k_cache, v_cache  # q strided over tokens, as the model passes it


@needs_kernel
@pytest.mark.parametrize("lens, starts, slots", [([1], [300], [2]), ([6], [17], [0]),
                                                 ([1, 6, 3], [300, 17, 550], [2, 0, 4]),
                                                 ([2] * 4 + [9], [0, 31, 5, 100, 7], [1, 3, 0, 2, 4]),
                                                 ([150, 1, 70], [0, 40, 3], [3, 1, 0])])
@pytest.mark.parametrize("hd", [64, 48, 32])
def test_matches_exact_attention_and_torchs_path(lens, starts, slots, hd):
    """Within one bf16 rounding of the exact attention (torch's bf16 path, which rounds its
    probabilities to bf16 too, is further off) on decodes, verifies, prefills and ragged batches
    (keys not a multiple of 16, slots out of order, position 0)."""
    batch, q, k_cache, v_cache = _case(lens, starts, slots, hd=hd)
    meta = attention.build_attn_meta(batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots, 3,
                                     cpu_kernel=True)
    assert meta.cpu_kernel and meta.mask is None and meta.pad_index is None and meta.groups is None
    scale = hd ** -0.5
    ours = attention.attention_backend(q, k_cache, v_cache, meta, scale)
    exact = _exact(q, k_cache, v_cache, meta.tok_slot, meta.positions, scale)
    torch_path = attention._attend_torch(q, k_cache, v_cache, attention.build_attn_meta(
        batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots, 3), scale)
    ours_err, torch_err = (ours.double() - exact).abs(), (torch_path.double() - exact).abs()
    assert (ours_err <= exact.abs() * 2 ** -8 + 1e-4).all()  # the output's one rounding
    assert ours_err.max() <= torch_err.max()  # torch's bf16 path rounds its probabilities too


@needs_kernel
def test_a_tokens_output_is_the_same_in_any_batch():
    """Bit-identical alone, inside a ragged batch, and with two threads."""
    batch, q, k_cache, v_cache = _case([1, 6, 3], [300, 17, 550], [2, 0, 4])
    meta = attention.build_attn_meta(batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots, 3,
                                     cpu_kernel=True)
    full = cpu_attention.cached_attention(q, k_cache, v_cache, meta.tok_slot, meta.positions, 0.125)
    for i in range(q.shape[0]):
        alone = cpu_attention.cached_attention(q[i:i + 1], k_cache, v_cache, meta.tok_slot[i:i + 1],
                                               meta.positions[i:i + 1], 0.125)
        assert torch.equal(alone[0], full[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(cpu_attention.cached_attention(q, k_cache, v_cache, meta.tok_slot, meta.positions,
                                                          0.125), full)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("heads, kv, hd", [(9, 3, 64), (8, 2, 64), (4, 4, 32), (16, 1, 48), (4, 2, 128)])
def test_grouped_queries_give_each_query_alone_bits(monkeypatch, heads, kv, hd):
    """The default layout (a request's tokens and a kv head's query heads through each key block
    together, runs longer than MAX_RUN cut) writes the same bits as each (token, head) alone, on
    one and two threads: grouping shares loads, never arithmetic."""
    batch, q, k_cache, v_cache = _case([1, 11, 3, 6, 17], [300, 17, 550, 0, 200], [2, 0, 4, 1, 3],
                                       heads=heads, kv=kv, hd=hd, seed=heads + hd)
    meta = attention.build_attn_meta(batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots, 3,
                                     cpu_kernel=True)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = {}
            for grouped in (True, False):
                monkeypatch.setattr(cpu_attention, "GROUPED", grouped)
                out[grouped] = cpu_attention.cached_attention(q, k_cache, v_cache, meta.tok_slot,
                                                              meta.positions, hd ** -0.5)
            assert torch.equal(out[True], out[False])
    finally:
        torch.set_num_threads(threads)


def test_meta_routes_requests_to_the_kernel(monkeypatch):
    """cpu_kernel=True builds the mask-free meta for every batch, a long prefill's included (the
    default, MAX_NEW_TOKENS None); with a cap, a request over it keeps torch's path and its mask."""
    short = RaggedBatch.from_requests([0, 1], [[1] * 64, [1]], [0, 5])
    long = RaggedBatch.from_requests([0], [[1] * 1500], [0])
    ragged = RaggedBatch.from_requests([0, 1], [[1] * 1500, [1] * 3], [0, 9])
    for batch in (short, long, ragged):
        meta = attention.build_attn_meta(batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots, 3,
                                         cpu_kernel=True)
        assert meta.cpu_kernel and meta.mask is None
    monkeypatch.setattr(cpu_attention, "MAX_NEW_TOKENS", 64)
    meta = attention.build_attn_meta(short.seq_idx, short.positions, short.cu_seqlens, short.slots, 3,
                                     cpu_kernel=True)
    assert meta.cpu_kernel and meta.mask is None
    meta = attention.build_attn_meta(long.seq_idx, long.positions, long.cu_seqlens, long.slots, 3,
                                     cpu_kernel=True)
    assert not meta.cpu_kernel and meta.mask is not None
    plain = attention.build_attn_meta(short.seq_idx, short.positions, short.cu_seqlens, short.slots, 3)
    assert not plain.cpu_kernel


@needs_kernel
def test_rejects_what_it_cannot_run():
    batch, q, k_cache, v_cache = _case([2], [4], [0])
    pos, slot = batch.positions, batch.slots[batch.seq_idx]
    with pytest.raises(ValueError, match="bf16"):
        cpu_attention.cached_attention(q.float(), k_cache, v_cache, slot, pos, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_attention.cached_attention(q, k_cache.transpose(2, 3), v_cache, slot, pos, 0.125)
    odd = torch.zeros(2, 9, 24, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported shape"):
        narrow_k, narrow_v = k_cache[..., :24].contiguous(), v_cache[..., :24].contiguous()
        cpu_attention.cached_attention(odd, narrow_k, narrow_v, slot, pos, 0.125)


def test_enabled_only_for_bf16_where_our_matmul_kernel_serves(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr("dspark.runtime.linear.serving_cpu_gemm", lambda dtype: "rows")
    monkeypatch.setattr(cpu_attention, "library", lambda: object())
    assert cpu_attention.enabled(cpu, torch.bfloat16, 9, 3, 64)
    assert not cpu_attention.enabled(cpu, torch.float32, 9, 3, 64)
    assert not cpu_attention.enabled(cpu, torch.bfloat16, 9, 3, 72)  # head_dim not a multiple of 16
    assert not cpu_attention.enabled(cpu, torch.bfloat16, 40, 2, 64)  # 20 query heads a kv head
    assert not cpu_attention.enabled(torch.device("meta"), torch.bfloat16, 9, 3, 64)
    monkeypatch.setattr("dspark.runtime.linear.serving_cpu_gemm", lambda dtype: "onednn")
    assert not cpu_attention.enabled(cpu, torch.bfloat16, 9, 3, 64)


@needs_kernel
@pytest.mark.parametrize("hd, heads, kv", [(64, 9, 3), (128, 4, 2), (32, 2, 2)])
def test_rope_and_cache_writes_equal_torchs(hd, heads, kv):
    """`rope_write_kv` (RoPE on q and k, k and v into the caches, one call) is bit-identical to the
    model's torch path: `apply_rope_swapped` on the fused projection's heads, then indexed writes;
    a row it does not write is untouched. A head size it does not take returns None."""
    from dspark.runtime.model import apply_rope_swapped

    g = torch.Generator().manual_seed(hd)
    n, cap, max_len = 7, 3, 50
    qkv = (torch.randn(n, (heads + 2 * kv) * hd, generator=g) * 4).bfloat16()
    cos, sin = torch.randn(n, hd, generator=g).bfloat16(), torch.randn(n, hd, generator=g).bfloat16()
    slots, positions = torch.tensor([0, 0, 2, 1, 1, 1, 2]), torch.tensor([3, 4, 40, 0, 1, 2, 41])
    k0, v0 = (torch.randn(cap, kv, max_len, hd, generator=g).bfloat16() for _ in range(2))
    k_got, v_got, k_want, v_want = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    q = cpu_attention.rope_write_kv(qkv, cos, sin, k_got, v_got, slots, positions, heads)
    heads_all = qkv.view(n, heads + 2 * kv, hd)
    qk = apply_rope_swapped(heads_all[:, :heads + kv], cos, sin)
    k_want[slots, :, positions] = qk[:, heads:]
    v_want[slots, :, positions] = heads_all[:, heads + kv:]
    assert torch.equal(q, qk[:, :heads]) and torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    odd = torch.zeros(1, 1, 4, 48, dtype=torch.bfloat16)  # hd 48: not a multiple of 32
    zero, row = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 48).bfloat16()
    qkv48 = torch.zeros(1, 3 * 48, dtype=torch.bfloat16)
    assert cpu_attention.rope_write_kv(qkv48, row, row, odd, odd.clone(), zero, zero, 1) is None


@needs_kernel
def test_bench_prefill_times_both_ways_and_restores_the_cap(tiny_ckpt, tmp_path):
    """`dspark bench-prefill` on the tiny checkpoint in bf16: each length and the benchmark
    prompts through our kernel and through ATen's flash kernel, round by round, close logits
    both ways, and `cpu_attention.MAX_NEW_TOKENS` as it was after."""
    import json

    from dspark.cli import main

    out = tmp_path / "prefill.json"
    before = cpu_attention.MAX_NEW_TOKENS
    assert main(["bench-prefill", "--model", str(tiny_ckpt), "--lengths", "8,100", "--rounds", "2",
                 "--n-prompts", "1", "--num-threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["by_case"]) == {"8", "100", "bench_prompts"}
    assert result["by_case"]["100"]["tokens"] == 100
    assert all(row["kernel_ms"] > 0 and row["flash_ms"] > 0 and row["speedup"] > 0
               for row in result["by_case"].values())
    # a different summation order: logits within bf16 roundings (the next token may tie-break apart)
    assert isinstance(result["same_next_token"], bool) and result["last_logits_max_abs_diff"] < 1.0
    assert cpu_attention.MAX_NEW_TOKENS == before
