"""Ragged verify (docs/architecture.md §4): a flattened batch of requests with different prefix and
new-token lengths equals running each request alone; rollback leaves exactly the cache of
the accepted tokens; plain generate streams, seeds, waves and releases its slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.runtime.batch import RaggedBatch
from dspark.runtime.engine import SpecEngine
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.target import TargetEngine

GAMMA = 7


@pytest.fixture(scope="module")
def engine(tiny_ckpt) -> TargetEngine:
    return TargetEngine.from_pretrained(tiny_ckpt, capacity=6, max_seq_len=64)


def _seq(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(engine: TargetEngine, prefix: list[int], new: list[int]):
    """Reference: the request by itself in a fresh slot."""
    slot = engine.allocate()
    try:
        engine.prefill([slot], [prefix])
        return engine.verify(RaggedBatch.from_requests([slot], [new], [len(prefix)]))
    finally:
        engine.release(slot)


def _free_all(engine: TargetEngine) -> None:
    for s in range(engine.cache.capacity):
        if engine.cache.in_use[s]:
            engine.release(s)


@pytest.mark.parametrize("slot_order", ["contiguous", "scattered"])
def test_ragged_verify_equals_each_request_alone(engine, slot_order):
    prefix_lens, new_lens = [5, 12, 1, 30], [1, 3, GAMMA + 1, 2]
    prefixes = [_seq(n, seed=i) for i, n in enumerate(prefix_lens)]
    news = [_seq(n, seed=100 + i) for i, n in enumerate(new_lens)]
    refs = [_alone(engine, p, n) for p, n in zip(prefixes, news)]
    slots = [engine.allocate() for _ in range(engine.cache.capacity)]
    if slot_order == "scattered":
        slots = [slots[4], slots[0], slots[5], slots[2]]  # non-contiguous: the gather path
    else:
        slots = slots[1:5]
    for s in set(range(engine.cache.capacity)) - set(slots):
        engine.release(s)
    try:
        last, taps = engine.prefill(slots, prefixes)
        assert [t.shape[0] for t in taps] == prefix_lens
        logits, vtaps = engine.verify(RaggedBatch.from_requests(slots, news, prefix_lens))
        assert logits.shape == (sum(new_lens), engine.vocab_size) and vtaps.shape[1] == engine.tap_dim
        for r, (ref_logits, ref_taps) in enumerate(refs):
            lo, hi = sum(new_lens[:r]), sum(new_lens[:r + 1])
            assert (logits[lo:hi] - ref_logits).abs().max() <= 1e-5, f"request {r}"
            assert (vtaps[lo:hi] - ref_taps).abs().max() <= 1e-5, f"request {r}"
            assert engine.length(slots[r]) == prefix_lens[r] + new_lens[r]
    finally:
        _free_all(engine)


def test_prefill_matches_forward_train(engine):
    prompt = _seq(19, seed=7)
    slot = engine.allocate()
    try:
        last, taps = engine.prefill([slot], [prompt])
    finally:
        engine.release(slot)
    with torch.no_grad():
        hidden, ref_taps = engine.model.forward_hidden(torch.tensor([prompt]))
        ref_logits = engine.model.lm_head(hidden)
    assert (last[0] - ref_logits[0, -1]).abs().max() <= 1e-5
    assert (taps[0] - ref_taps[0]).abs().max() <= 1e-5


def test_rollback_equals_cache_of_accepted_tokens(engine):
    prefix, draft, accepted = _seq(10, seed=1), _seq(GAMMA + 1, seed=2), 3
    a, b = engine.allocate(), engine.allocate()
    try:
        engine.prefill([a], [prefix])
        engine.verify(RaggedBatch.from_requests([a], [draft], [len(prefix)]))
        engine.rollback(a, len(prefix) + accepted)
        engine.prefill([b], [prefix + draft[:accepted]])
        keep = len(prefix) + accepted
        assert engine.length(a) == engine.length(b) == keep
        for k in engine.cache.k + engine.cache.v:
            assert (k[a, :, :keep] - k[b, :, :keep]).abs().max() <= 1e-5
        nxt = _seq(2, seed=3)  # continuing after the rollback overwrites the stale rows
        la, _ = engine.verify(RaggedBatch.from_requests([a, b], [nxt, nxt], [keep, keep]))
        assert (la[:2] - la[2:]).abs().max() <= 1e-5
    finally:
        engine.release(a)
        engine.release(b)


def test_plain_decoding_streams_and_releases(engine):
    """Plain decoding = the engine loop with no drafter; more prompts than slots run as they free up."""
    plain = SpecEngine(engine)
    prompts = [_seq(4, seed=s) for s in range(8)]
    streamed: dict[str, list[int]] = {}
    reqs = [plain.add_request(p, 6, stop_token_ids=[],
                              on_tokens=lambda rid, toks, fin, why: streamed.setdefault(rid, []).extend(toks))
            for p in prompts]
    plain.run_until_done()
    assert all(len(r.output) == 6 for r in reqs)
    assert streamed == {r.request_id: r.output for r in reqs}
    assert engine.num_free_slots() == engine.cache.capacity


def test_plain_seeded_sampling_is_reproducible(engine):
    plain = SpecEngine(engine)
    prompts = [_seq(5, seed=s) for s in range(3)]
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=s) for s in range(3)]
    first = plain.generate(prompts, 6, params, stop_token_ids=[])
    assert first == plain.generate(prompts, 6, params, stop_token_ids=[])
    mixed = plain.generate(prompts, 6, [SamplingParams()] + params[1:], stop_token_ids=[])
    assert mixed[1:] == first[1:]  # a request's tokens depend on its own generator only
    assert mixed[0] == plain.generate(prompts[:1], 6, SamplingParams(), stop_token_ids=[])[0]


def test_plain_stops_at_stop_token_and_at_full_slot(engine):
    plain = SpecEngine(engine)
    prompt = _seq(6, seed=4)
    free_run = plain.generate([prompt], 12, SamplingParams(), stop_token_ids=[])[0]
    stop_tok = free_run[4]
    stopped = plain.generate([prompt], 12, SamplingParams(), stop_token_ids=[stop_tok])[0]
    assert stopped == free_run[:free_run.index(stop_tok) + 1]
    long_prompt = _seq(60, seed=5)  # max_seq_len 64: 4 more cached tokens, so 5 generated
    assert len(plain.generate([long_prompt], 50, SamplingParams(), stop_token_ids=[])[0]) == 5


def test_prefill_groups_bound_padding_and_match(engine, monkeypatch):
    from dspark.runtime import target as target_mod

    assert target_mod._prefill_groups([3, 3, 9, 2, 2], budget=12) == [[0, 1], [2], [3, 4]]
    prompts = [_seq(n, seed=20 + n) for n in (3, 11, 4, 6)]
    slots = [engine.allocate() for _ in prompts]
    try:
        ref_logits, ref_taps = engine.prefill(slots, prompts)
        for s in slots:
            engine.rollback(s, 0)
        monkeypatch.setattr(target_mod, "PREFILL_PADDED_TOKENS", 12)  # -> groups [0], [1], [2, 3]
        logits, taps = engine.prefill(slots, prompts)
    finally:
        _free_all(engine)
    assert (logits - ref_logits).abs().max() <= 1e-5
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(taps, ref_taps))


@pytest.mark.parametrize("prefix_lens", [[9, 9, 9], [4, 17, 9]], ids=["equal-lengths-no-mask", "ragged-mask"])
def test_decode_step_equals_each_request_alone(engine, prefix_lens):
    """One new token per request: the unpadded layouts (with and without a mask)."""
    prefixes = [_seq(n, seed=30 + i) for i, n in enumerate(prefix_lens)]
    news = [[int(t)] for t in _seq(len(prefix_lens), seed=40)]
    refs = [_alone(engine, p, n) for p, n in zip(prefixes, news)]
    slots = [engine.allocate() for _ in prefixes]
    try:
        engine.prefill(slots, prefixes)
        logits, taps = engine.verify(RaggedBatch.from_requests(slots, news, prefix_lens))
    finally:
        _free_all(engine)
    for r, (ref_logits, ref_taps) in enumerate(refs):
        assert (logits[r] - ref_logits[0]).abs().max() <= 1e-5
        assert (taps[r] - ref_taps[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("lens", [[4, 1, 3], [3, 3, 3], [5]])
def test_torch_attention_matches_the_kernel_contract(lens):
    """The CPU path and dspark_kernels.varlen_attention (torch reference on CPU, Triton on
    CUDA) compute the same thing from the same arguments, so the CUDA dispatch is a drop-in:
    ragged (padded query rows), uniform and single-request batches (no padding: no scatter)."""
    from dspark.runtime.attention import _attend_torch, build_attn_meta
    from dspark_kernels.varlen_attention import varlen_attention as varlen

    g = torch.Generator().manual_seed(0)
    n_heads, n_kv, hd, cap, max_len = 6, 2, 16, 5, 40
    k_cache, v_cache = (torch.randn(cap, n_kv, max_len, hd, generator=g) for _ in range(2))
    batch = RaggedBatch.from_requests([3, 0, 4][:len(lens)], [[1] * n for n in lens], [7, 20, 0][:len(lens)])
    q = torch.randn(batch.num_tokens, n_heads, hd, generator=g)
    meta = build_attn_meta(batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots, n_heads // n_kv)
    assert (meta.pad_index is None) == (len(set(lens)) == 1) and meta.mask is not None
    ours = _attend_torch(q, k_cache, v_cache, meta, hd ** -0.5)
    ref = varlen(q, k_cache, v_cache, meta.tok_slot, meta.positions, meta.cu_seqlens, meta.slots, hd ** -0.5,
                 meta.max_new)
    assert (ours - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("lens", [[6], [4, 2], [1, 1, 1]])
def test_flash_per_head_layout_matches_the_grouped_layout(lens, monkeypatch):
    """On the CPU flash path a batch's q goes to SDPA as [R, H, T, hd] with enable_gqa (no copy
    into the grouped [R, Hkv, G·T, hd] rows, a G-times smaller mask): the same attention, and
    chosen exactly where `_sdpa` would run the flash kernel (not its two-matmul path)."""
    from dspark.runtime import attention

    g = torch.Generator().manual_seed(2)
    n_heads, n_kv, hd, cap, max_len = 9, 3, 16, 4, 64
    k_cache, v_cache = (torch.randn(cap, n_kv, max_len, hd, generator=g) for _ in range(2))
    batch = RaggedBatch.from_requests([2, 0, 3][:len(lens)], [[1] * n for n in lens], [30, 9, 17][:len(lens)])
    q = torch.randn(batch.num_tokens, n_heads, hd, generator=g)
    args = (batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots, n_heads // n_kv)
    per_head = attention.build_attn_meta(*args)
    assert per_head.per_head and per_head.mask is not None and per_head.mask.shape[2] == max(lens)
    monkeypatch.setattr(attention, "flash_per_head", lambda *a: False)
    grouped = attention.build_attn_meta(*args)
    assert not grouped.per_head and grouped.mask.shape[2] == n_heads // n_kv * max(lens)
    ours = attention._attend_torch(q, k_cache, v_cache, per_head, hd ** -0.5)
    assert (ours - attention._attend_torch(q, k_cache, v_cache, grouped, hd ** -0.5)).abs().max() <= 1e-5
    monkeypatch.undo()
    cpu = torch.device("cpu")
    assert not attention.flash_per_head(cpu, 32, 300, 12)  # R·S >= 512, few rows: two matmuls
    assert attention.flash_per_head(cpu, 1, 300, 18) and attention.flash_per_head(cpu, 32, 300, 3 * 200)


def test_length_groups_attend_apart_and_match_one_padded_batch():
    """Requests of very different new-token counts are attended in length groups (one request
    verifying 8 tokens must not pad 31 others to 8 rows); the grouped result equals the kernel
    contract's reference and the single padded batch."""
    from dspark.runtime.attention import _attend_torch, build_attn_meta, length_groups
    from dspark_kernels.varlen_attention import varlen_attention as varlen

    assert length_groups([3, 3, 4]) is None  # one class
    assert length_groups([1, 2]) is None  # grouping would save one padded row: not worth a call
    assert length_groups([2] * 6 + [8]) == [[0, 1, 2, 3, 4, 5], [6]]
    assert length_groups([1, 8, 1, 1, 2, 5, 1]) == [[0, 2, 3, 6], [4], [1, 5]]
    g = torch.Generator().manual_seed(1)
    n_heads, n_kv, hd, cap, max_len = 6, 2, 16, 8, 48
    k_cache, v_cache = (torch.randn(cap, n_kv, max_len, hd, generator=g) for _ in range(2))
    lens, starts = [1, 8, 1, 1, 2, 5, 1], [7, 20, 0, 33, 12, 3, 39]
    batch = RaggedBatch.from_requests([5, 0, 7, 1, 2, 6, 3], [[1] * n for n in lens], starts)
    q = torch.randn(batch.num_tokens, n_heads, hd, generator=g)
    grouped = build_attn_meta(batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots, n_heads // n_kv)
    padded = build_attn_meta(batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots, n_heads // n_kv,
                             group=False)
    assert grouped.groups is not None and len(grouped.groups) == 3 and padded.groups is None
    ours = _attend_torch(q, k_cache, v_cache, grouped, hd ** -0.5)
    ref = varlen(q, k_cache, v_cache, grouped.tok_slot, grouped.positions, grouped.cu_seqlens, grouped.slots,
                 hd ** -0.5, grouped.max_new)
    assert (ours - ref).abs().max() <= 1e-5
    assert (ours - _attend_torch(q, k_cache, v_cache, padded, hd ** -0.5)).abs().max() <= 1e-5


@pytest.mark.parametrize("rows, masked", [(3, False), (12, True)])
def test_cpu_matmul_attention_equals_sdpa(rows, masked):
    """`_sdpa`'s matmul path (taken on a CPU from MATH_ATTENTION_FROM requests x keys) computes
    what torch's SDPA does: in f32 to 1e-5, in bf16 within a few bf16 roundings."""
    from dspark.runtime import attention as M

    g = torch.Generator().manual_seed(2)
    r, n_kv, s, hd = 4, 2, 200, 16
    assert r * s >= M.MATH_ATTENTION_FROM  # this shape takes the matmul path
    q = torch.randn(r, n_kv, rows, hd, generator=g)
    k, v = (torch.randn(r, n_kv, s, hd, generator=g) for _ in range(2))
    mask = None
    if masked:  # causal over the last 4 positions, 3 query heads per kv head: (g, t) rows
        q_pos = (s - 4 + torch.arange(4)).repeat(rows // 4)
        mask = (torch.arange(s) <= q_pos[:, None])[None, None].expand(r, 1, rows, s)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd ** -0.5)

    def bias(dtype: torch.dtype) -> torch.Tensor | None:  # `_sdpa` takes the mask as 0 / -inf
        return None if mask is None else M.mask_bias(mask, dtype)

    assert (M._sdpa(q, k, v, bias(torch.float32), hd ** -0.5) - ref).abs().max() <= 1e-5
    bf = [t.bfloat16() for t in (q, k, v)]
    assert (M._sdpa(*bf, bias(torch.bfloat16), hd ** -0.5).float() - ref).abs().max() <= 0.03


def test_verify_of_no_requests_is_empty(engine):
    empty = torch.zeros(0, dtype=torch.int64)
    logits, taps = engine.verify(RaggedBatch(empty, empty, empty, torch.zeros(1, dtype=torch.int64), empty))
    assert logits.shape == (0, engine.vocab_size) and taps.shape == (0, engine.tap_dim)


def test_prepacked_linear_pads_rows_to_few_buckets_and_keeps_each_row():
    """oneDNN caches a primitive per row count: PackedLinear runs bucketed row counts (bounded
    memory over a long serve) and must still give every real row what F.linear gives it."""
    from dspark.runtime.linear import row_bucket, serving_linear

    buckets = {row_bucket(m) for m in range(1, 4097)}
    assert len(buckets) * 5 <= 256  # 5 matmul shapes per model fit oneDNN's bounded cache
    assert all(m <= row_bucket(m) <= max(m + 7, m * 1.25) for m in range(1, 5000))
    assert all(row_bucket(m) == m for m in range(1, 17))
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.0)):
        w, b = torch.randn(48, 32, dtype=dtype), torch.randn(48, dtype=dtype)
        linear = serving_linear(w, b)
        for m in (1, 2, 17, 70, 300):
            x = torch.randn(m, 32, dtype=dtype)
            y = linear(x)
            assert y.shape == (m, 48)
            torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), atol=tol, rtol=tol)


def test_bf16_min_rows_pads_only_where_measured(monkeypatch):
    """bf16 matmuls of 1-4 rows run as 5 on AVX512-BF16 CPUs without AMX (measured faster
    there), nowhere else unless DSPARK_BF16_MIN_ROWS says so; a padded call keeps every row."""
    from dspark.runtime import linear as linear_module
    from dspark.runtime.linear import bf16_min_rows, serving_linear

    monkeypatch.delenv("DSPARK_BF16_MIN_ROWS", raising=False)
    assert bf16_min_rows({"avx2", "avx512f", "avx512_bf16"}) == 5
    assert bf16_min_rows({"avx512_bf16", "amx_bf16", "amx_tile"}) == 1
    assert bf16_min_rows(set()) == 1
    monkeypatch.setenv("DSPARK_BF16_MIN_ROWS", "5")
    assert bf16_min_rows(set()) == 5
    monkeypatch.setenv("DSPARK_BF16_MIN_ROWS", "0")
    with pytest.raises(ValueError, match="DSPARK_BF16_MIN_ROWS"):
        bf16_min_rows(set())
    torch.manual_seed(0)
    w = torch.randn(40, 64, dtype=torch.bfloat16)
    linear = serving_linear(w)
    monkeypatch.setattr(linear_module, "BF16_MIN_ROWS", 4)
    if isinstance(linear, linear_module.PackedLinear):  # prepacked (oneDNN with bf16 here)
        x = torch.randn(1, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, w), atol=0.0, rtol=0.0)
        assert linear(x[:, None]).shape == (1, 1, 40)


def test_pack_rows_hint_only_where_measured(monkeypatch):
    """fp32 weights on an AVX2-only CPU are packed for 8 rows (packed for 1, oneDNN runs 2+ rows
    in a slow kernel there), everything else for 1 as before, unless DSPARK_PACK_ROWS_HINT says
    so; whatever the hint, a packed weight gives every row what F.linear gives it."""
    from dspark.runtime.linear import PackedLinear, pack_rows_hint

    monkeypatch.delenv("DSPARK_PACK_ROWS_HINT", raising=False)
    assert pack_rows_hint(torch.float32, {"avx2", "fma"}) == 8
    assert pack_rows_hint(torch.bfloat16, {"avx2", "fma"}) == 1
    assert pack_rows_hint(torch.float32, {"avx2", "avx512f", "avx512_bf16"}) == 1
    assert pack_rows_hint(torch.float32, {"avx512_bf16", "amx_bf16", "amx_tile"}) == 1
    monkeypatch.setenv("DSPARK_PACK_ROWS_HINT", "4")
    assert pack_rows_hint(torch.bfloat16, set()) == 4
    monkeypatch.setenv("DSPARK_PACK_ROWS_HINT", "eight")
    with pytest.raises(ValueError, match="DSPARK_PACK_ROWS_HINT"):
        pack_rows_hint(torch.float32, set())
    if not torch.backends.mkldnn.is_available():
        return
    torch.manual_seed(0)
    w, b = torch.randn(40, 64), torch.randn(40)
    x = torch.randn(9, 64)
    for hint in ("1", "8"):
        monkeypatch.setenv("DSPARK_PACK_ROWS_HINT", hint)
        linear = PackedLinear(w, b)
        for m in (1, 2, 5, 9):
            torch.testing.assert_close(linear(x[:m]), F.linear(x[:m], w, b), atol=1e-5, rtol=1e-5)


def test_bench_min_rows_smoke(tiny_ckpt, tmp_path):
    """`dspark bench-min-rows` end to end on the tiny checkpoint in bf16: every candidate timed,
    the paired ratio of the first candidate to itself is 1, and the CPU's default comes back."""
    import json

    from dspark.cli import main
    from dspark.runtime import linear

    before = linear.BF16_MIN_ROWS
    out = tmp_path / "min_rows.json"
    assert main(["bench-min-rows", "--model", str(tiny_ckpt), "--rows", "1,3", "--tokens", "1,2",
                 "--context", "8", "--rounds", "1", "--prompts-per-round", "1", "--max-tokens", "4",
                 "--repeats", "1", "--num-threads", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["verify_ms"]) == {"1", "3"} and all(v > 0 for v in result["verify_ms"]["3"].values())
    assert result["plain_speedup_vs_1_rows"]["1"] == 1.0 and result["plain_tokens_per_s"]["3"][0] > 0
    assert linear.BF16_MIN_ROWS == before
