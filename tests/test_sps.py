"""SPS table (docs/architecture.md §7): next-bucket lookup (padded), interpolation (unpadded), tail
extrapolation, JSON round trip."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from dspark.bench import cpu_name
from dspark.runtime.sps import SPSTable, smooth_by_tokens


def test_next_bucket_lookup_is_jagged():
    table = SPSTable([4, 1, 16], [80.0, 100.0, 50.0], device="cuda:0", model="m")  # unsorted on purpose
    assert table.padded
    assert table.batch_tokens == [1, 4, 16]
    assert table(1) == 100.0
    assert table(2) == 80.0 and table(4) == 80.0  # padded up to the 4-token bucket
    assert table(5) == 50.0 and table(16) == 50.0
    got = table.lookup(torch.tensor([[0, 1, 3], [4, 9, 16]]))
    assert got.shape == (2, 3)
    assert got.tolist() == [[100.0, 100.0, 80.0], [80.0, 50.0, 50.0]]


def test_unpadded_table_interpolates_step_time():
    """A CPU engine runs exactly B tokens: between profiled sizes the step time is linear, so B = 5
    between 4 (10 ms) and 8 (20 ms) costs 12.5 ms, not the 8-token bucket's 20 (an invented cliff)."""
    table = SPSTable([1, 4, 8], [100.0, 100.0, 50.0], device="cpu:x86_64 threads=1")
    assert table.padded is False
    assert table(5) == pytest.approx(1.0 / 0.0125) and table(6) == pytest.approx(1.0 / 0.015)
    assert table(4) == 100.0 and table(8) == 50.0 and table(2) == 100.0
    assert SPSTable([1, 4, 8], [100.0, 100.0, 50.0], device="cpu", padded=True)(5) == 50.0
    times = table.step_time(torch.arange(1, 9))
    assert bool((times[1:] >= times[:-1]).all())


def test_extrapolates_linearly_in_step_time_beyond_largest_bucket():
    table = SPSTable([8, 16], [100.0, 50.0])  # step time 10 ms -> 20 ms: 1.25 ms per token
    assert table(24) == pytest.approx(1.0 / (0.020 + 8 * 0.00125))
    assert table(1000) < table(100) < table(16)
    flat = SPSTable([8, 16], [50.0, 100.0])  # measured noise: never extrapolate a speed-up
    assert flat(64) == pytest.approx(100.0)
    assert SPSTable([8], [10.0])(100) == 10.0


def test_gpu_shaped_is_flat_to_knee_then_rising_step_time():
    table = SPSTable.gpu_shaped()
    assert table(1) == table(128) == table(192)
    times = table.step_time(torch.tensor(table.batch_tokens))
    assert bool((times[1:] >= times[:-1]).all())
    assert table(512) < 0.6 * table(192)
    assert table.device.startswith("synthetic")


def test_save_load_round_trip(tmp_path):
    table = SPSTable([1, 2, 8], [10.0, 9.0, 5.0], device="cpu", model="tiny")
    path = tmp_path / "sps.json"
    table.save(path)
    fields = {"batch_tokens", "steps_per_second", "device", "model", "padded"}
    assert set(json.loads(path.read_text())) == fields
    again = SPSTable.load(path)
    assert again == table and again.padded is False
    assert again(3) == pytest.approx(1.0 / (5 / 6 / 9.0 + 1 / 6 / 5.0))  # 1/6 of the way from 2 to 8
    path.write_text(json.dumps({"batch_tokens": [1, 2, 8], "steps_per_second": [10.0, 9.0, 5.0],
                                "device": "cuda:0"}))  # a table from before the field: padded on a GPU
    assert SPSTable.load(path)(3) == 5.0


@pytest.mark.parametrize("sizes,speeds", [([], []), ([1, 2], [1.0]), ([0, 2], [1.0, 1.0]),
                                          ([1, 2], [1.0, 0.0]), ([2, 2], [1.0, 1.0])])
def test_rejects_bad_tables(sizes, speeds):
    with pytest.raises(ValueError):
        SPSTable(sizes, speeds)


def test_profile_sps_on_tiny_checkpoint(tiny_ckpt, tmp_path):
    import argparse

    from dspark.bench import sps as profile_sps

    assert profile_sps.split_tokens(9, 4) == [3, 3, 3]
    assert profile_sps.split_tokens(1, 4) == [1]
    # a grid cell (R, t) holds R·t tokens: mixed as dspark's budgets are, or t each
    assert profile_sps.grid_lengths(4, 3) == [1, 5, 1, 5]
    assert profile_sps.grid_lengths(3, 4) == [1, 7, 4] and profile_sps.grid_lengths(1, 8) == [8]
    assert profile_sps.grid_lengths(5, 1) == [1] * 5 and profile_sps.grid_lengths(2, 3, mixed=False) == [3, 3]
    parser = argparse.ArgumentParser()
    profile_sps.add_arguments(parser)
    out = tmp_path / "sps.json"
    args = parser.parse_args(["--target", str(tiny_ckpt), "--sizes", "1,4,16", "--context", "16",
                              "--repeats", "1", "--ragged-requests", "1,3", "--ragged-tokens", "1,2,4",
                              "--out", str(out)])
    assert profile_sps.main(args) == 0
    table = SPSTable.load(out)
    assert table.batch_tokens == [1, 4, 16]
    assert table.ragged is not None and table.ragged["requests"] == [1, 3]
    assert table.ragged["lengths"] == "mixed"  # the default
    assert all(len(row) == 3 and min(row) > 0 for row in table.ragged["seconds"])
    assert all(s > 0 for s in table.steps_per_second)
    assert table.device.startswith("cpu") and str(tiny_ckpt) in table.model
    assert f"cpu:{cpu_name()} " in table.device  # the CPU kind, not just 'x86_64'
    assert out.with_suffix(".png").stat().st_size > 0
    assert json.loads(out.read_text())["timing"] == "paired"  # the default
    fastest = profile_sps.profile(tiny_ckpt, [1, 4], context=16, repeats=2, show_progress=False,
                                  timing="fastest")
    assert fastest.batch_tokens == [1, 4] and all(s > 0 for s in fastest.steps_per_second)
    with pytest.raises(ValueError, match="timing"):
        profile_sps.profile(tiny_ckpt, [1], context=16, timing="slowest")
    with pytest.raises(ValueError, match="repeats"):
        profile_sps.profile(tiny_ckpt, [1], context=16, repeats=0)


def test_paired_timing_reads_every_size_at_one_machine_speed():
    """A VM whose speed drifts by ±30 % over the profile, a period of 1.3 rounds, plus a burst of
    load on one step: each size's fastest round catches sizes at different speeds and prices a
    bigger step cheaper than a smaller one; timing each step between two reference steps
    recovers the true shape, at the fastest reference's speed."""
    from dspark.bench.sps import paired_seconds

    true = 0.040 + 0.0025 * np.arange(12) ** 1.2  # 12 sizes: a rising, convex cost
    rounds, n = 5, len(true)
    clock = np.linspace(0.0, rounds, rounds * (2 * n + 1), endpoint=False)  # ref, step, ref, ... ref
    speed = (1.0 + 0.3 * np.sin(2 * np.pi * clock / 1.3)).reshape(rounds, 2 * n + 1)
    refs, steps = true[0] * speed[:, 0::2], true * speed[:, 1::2]
    steps[2, 3] *= 1.5  # a burst of load from another process
    fastest = steps.min(axis=0)
    assert not bool(np.all(np.diff(fastest) > 0))  # the failure this timing exists for
    paired = paired_seconds(steps, refs[:, :-1], refs[:, 1:])
    assert bool(np.all(np.diff(paired) > 0))
    np.testing.assert_allclose(paired / paired[0], true / true[0], rtol=0.01)
    assert paired[0] == pytest.approx(refs.min(), rel=0.02)


def test_cpu_name_reads_the_model_and_matmul_flags(tmp_path):
    """Results record the CPU kind (step costs do not carry over between CPU kinds): the model
    name and the matmul instruction sets from /proc/cpuinfo, the machine type without one."""
    import platform

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n"
                    "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n\n"
                    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n")
    assert cpu_name(info) == f"Intel(R) Xeon(R) Platinum 8481C ({platform.machine()}: amx_bf16 avx512f avx2)"
    info.write_text("model name\t: AMD EPYC\nflags\t: fpu sse2\n")
    assert cpu_name(info) == f"AMD EPYC ({platform.machine()})"
    assert cpu_name(tmp_path / "absent") == (platform.processor() or platform.machine())


def test_ragged_grid_reads_step_time_by_requests_and_tokens_per_request(tmp_path):
    """rates_for(R): linear in step time between profiled R and tokens per request, B < R read
    as one token each, linear (never falling) past the last point; saved and loaded with the table."""
    grid = {"requests": [1, 4], "tokens_per_request": [1, 2, 4],
            "seconds": [[0.010, 0.012, 0.016], [0.020, 0.030, 0.050]]}
    table = SPSTable([1, 8], [100.0, 50.0], device="cpu", ragged=grid)
    one = 1.0 / table.rates_for(1, 8)
    assert one[1] == pytest.approx(0.010) and one[0] == pytest.approx(0.010)  # B < R: B = R
    assert one[3] == pytest.approx(0.014) and one[4] == pytest.approx(0.016)
    assert one[6] == pytest.approx(0.020)  # past 4 tokens per request: last slope, 2 ms per token
    four = 1.0 / table.rates_for(4, 16)
    assert four[4] == pytest.approx(0.020) and four[6] == pytest.approx(0.025)  # 1.5 tokens each
    two = 1.0 / table.rates_for(2, 8)  # a third of the way from R = 1 to R = 4
    assert two[4] == pytest.approx(0.012 + (0.030 - 0.012) / 3)
    eight = 1.0 / table.rates_for(8, 8)  # past R = 4: the last slope in R
    assert eight[8] == pytest.approx(0.020 + 4 * (0.020 - 0.010) / 3)
    flat = SPSTable([1, 8], [100.0, 50.0], device="cpu")
    assert flat.rates_for(3, 8) == pytest.approx(flat.lookup(torch.arange(9)).numpy())
    table.save(tmp_path / "sps.json")
    assert SPSTable.load(tmp_path / "sps.json").ragged == grid
    with pytest.raises(ValueError, match="ragged seconds"):
        SPSTable([1], [1.0], ragged={"requests": [1], "tokens_per_request": [1, 2], "seconds": [[0.1]]})


def test_ragged_grid_is_read_smoothed_over_two_or_more_tokens_per_request():
    """A noisy cell must not make a fake cheap segment (R = 32 profiled: the 4th token per request
    at a third of the 3rd's price); a smooth cost is read as measured; t = 1 is kept."""
    tokens = np.array([1, 2, 3, 4, 5, 6, 8], dtype=np.float64)
    line = 0.050 + 0.012 * tokens
    line[0] = 0.040
    assert smooth_by_tokens(tokens, line) == pytest.approx(line)
    noisy = line.copy()
    noisy[2] += 0.010  # t = 3 measured slow: raw, t 3 -> 4 looks almost free
    assert noisy[3] - noisy[2] < 0.3 * (noisy[4] - noisy[3])
    smooth = smooth_by_tokens(tokens, noisy)
    assert smooth[0] == noisy[0] and np.all(np.diff(smooth) >= 0)
    marginal = np.diff(smooth[1:]) / np.diff(tokens[1:])
    assert marginal.min() > 0.5 * marginal.max()
    assert np.abs(smooth - line).max() < 0.8 * 0.010  # closer to the true cost than the noisy cell
    falling = line.copy()
    falling[1:] = falling[1:][::-1]  # a curve that falls is read flat, never below t = 1
    assert np.all(np.diff(smooth_by_tokens(tokens, falling)) >= 0)
    grid = {"requests": [1, 2], "tokens_per_request": tokens.astype(int).tolist(),
            "seconds": [noisy.tolist(), (2 * noisy).tolist()]}
    table = SPSTable([1, 8], [100.0, 50.0], device="cpu", ragged=grid)
    assert 1.0 / table.rates_for(1, 8)[1:] == pytest.approx(np.interp(np.arange(1, 9), tokens, smooth))


def test_grid_smoothing_keeps_an_upward_bend_and_cuts_a_downward_one_by_at_most_the_noise():
    """Profiled curves (ms, R = 32 bf16 and R = 1 q4_1): the bf16 one bends upwards and its t = 2
    cell, the mtp1-sized budget, is read as measured (a least-squares line priced it 20 % low);
    the q4_1 one bends down where the int4 layers switch to dense weights, and no cell is priced
    more than SMOOTH_MAX_CUT under its measurement; both never fall."""
    from dspark.runtime.sps import SMOOTH_MAX_CUT

    tokens = np.array([1, 2, 3, 4, 5, 6, 8, 12, 16], dtype=np.float64)
    bf16 = np.array([74.1, 101.0, 134.1, 163.5, 200.7, 232.2, 288.5, 541.2, 662.2])
    q4 = np.array([13.4, 14.1, 15.8, 16.3, 21.2, 22.6, 24.3, 30.7, 34.1])
    for raw in (bf16, q4):
        smooth = smooth_by_tokens(tokens, raw)
        assert smooth[:2] == pytest.approx(raw[:2]) and smooth[-1] == pytest.approx(raw[-1])
        assert np.all(np.diff(smooth) >= 0) and np.all(smooth >= (1 - SMOOTH_MAX_CUT) * raw - 1e-12)
        assert np.all(smooth <= raw + 1e-12)
    assert smooth_by_tokens(tokens, bf16)[7] < 0.95 * bf16[7]  # the slow t = 12 cell is pooled


def test_quantized_weights_read_their_own_table_else_the_models(tmp_path, monkeypatch):
    """`--dtype q4_1` schedules with `sps_<model>_q4_1_cpu.json` (int4 steps grow with a verify's
    rows far faster than bf16's) when profiled, else with the model's own table; bf16 / fp32 /
    auto read the model's table; `dspark profile-sps --dtype q4_1` writes the q4_1 one."""
    from dspark import wiring

    bf16, q4 = tmp_path / "sps_m_cpu.json", tmp_path / "sps_m_q4_1_cpu.json"
    monkeypatch.setitem(wiring.SPS_TABLES, "smollm2", bf16)
    assert wiring.sps_table_path("smollm2", "q4_1") == q4
    assert wiring.sps_table_path("smollm2", "bf16") == wiring.sps_table_path("smollm2") == bf16
    assert wiring.sps_table_path(None, "q4_1") is None
    SPSTable([1, 8], [100.0, 50.0], device="cpu").save(bf16)
    spec = wiring.Spec(model="smollm2", dtype="q4_1", device="cpu")
    assert wiring.load_sps(spec).steps_per_second == [100.0, 50.0]  # no q4_1 table yet
    SPSTable([1, 8], [150.0, 60.0], device="cpu").save(q4)
    assert wiring.load_sps(spec).steps_per_second == [150.0, 60.0]
    assert wiring.load_sps(wiring.Spec(model="smollm2", dtype="bf16", device="cpu")).steps_per_second == [
        100.0, 50.0]


def test_auto_reads_the_table_profiled_on_this_kind_of_cpu(tmp_path, monkeypatch):
    """Step costs by rows belong to a CPU kind (`linear.cpu_kind`): `--sps auto` reads
    `sps_<model>_cpu_<kind>.json` when one was profiled on this kind of CPU, else the shipped
    (AMX) table; a quantized dtype's own kind table first, then its shipped one, then the
    unquantized weights' (kind first). `dspark profile-sps` writes the kind's table."""
    from dspark import wiring
    from dspark.runtime.linear import cpu_kind

    assert cpu_kind({"avx512_bf16", "amx_bf16"}) == "amx"
    assert cpu_kind({"avx512f", "avx512_bf16"}) == "avx512bf16"
    assert cpu_kind({"avx512f", "avx2"}) == "avx512"
    assert cpu_kind({"avx2", "fma"}) == "avx2"
    assert cpu_kind(set()) == ""
    shipped = tmp_path / "sps_m_cpu.json"
    monkeypatch.setitem(wiring.SPS_TABLES, "smollm2", shipped)
    amd = tmp_path / "sps_m_cpu_avx512bf16.json"
    assert wiring.sps_table_path("smollm2", "bf16", "avx512bf16") == amd
    q4_amd = tmp_path / "sps_m_q4_1_cpu_avx512bf16.json"
    assert wiring.sps_table_path("smollm2", "q4_1", "avx512bf16") == q4_amd
    assert wiring.sps_table_path("smollm2", "auto", "avx2") == tmp_path / "sps_m_cpu_avx2.json"
    # bf16 there is bf16 weights in the rows kernel (`torch_dtypes`), priced apart from fp32
    assert wiring.sps_table_path("smollm2", "bf16", "avx2") == tmp_path / "sps_m_bf16_cpu_avx2.json"
    for kind in ("amx", ""):  # the shipped tables' kind, and a CPU of neither kind
        assert wiring.sps_table_path("smollm2", "bf16", kind) == shipped
    assert wiring.auto_sps_path("smollm2", "bf16", "avx512bf16") is None  # nothing profiled
    SPSTable([1, 8], [100.0, 50.0], device="cpu").save(shipped)
    SPSTable([1, 8], [90.0, 70.0], device="cpu").save(amd)
    for dtype in ("bf16", "q4_1"):  # no q4_1 table: the unquantized kind table before the shipped one
        assert wiring.auto_sps_path("smollm2", dtype, "avx512bf16") == amd
        for kind in ("amx", ""):
            assert wiring.auto_sps_path("smollm2", dtype, kind) == shipped
    q4 = tmp_path / "sps_m_q4_1_cpu.json"
    SPSTable([1, 8], [150.0, 60.0], device="cpu").save(q4)
    assert wiring.auto_sps_path("smollm2", "q4_1", "avx512bf16") == q4  # the dtype matters more
    monkeypatch.setattr("dspark.runtime.linear.cpu_flags", lambda *a: {"avx512f", "avx512_bf16"})
    assert wiring.load_sps(wiring.Spec(model="smollm2", dtype="bf16", device="cpu")).steps_per_second == [
        90.0, 70.0]
    monkeypatch.setattr("dspark.runtime.linear.cpu_flags", lambda *a: {"amx_bf16"})
    assert wiring.load_sps(wiring.Spec(model="smollm2", dtype="bf16", device="cpu")).steps_per_second == [
        100.0, 50.0]


def test_auto_dtype_is_fp32_where_the_cpu_has_no_bf16_matmul(monkeypatch):
    """`dtype=auto` serves SmolLM2 in bf16 only where oneDNN has bf16 kernels: on an AVX2-only
    CPU bf16 falls back to reference kernels (a verify of 8 tokens 2.3x fp32's), so fp32 there.
    An explicit bf16 there keeps bf16 weights with fp32 activations where the rows kernel runs
    (`torch_dtypes`), real bf16 where it does not; q4_1 keeps its bf16 activations."""
    import torch

    from dspark import wiring

    bf16, fp32 = torch.bfloat16, torch.float32
    spec, explicit = wiring.Spec(model="smollm2", device="cpu"), wiring.Spec(model="smollm2", device="cpu",
                                                                             dtype="bf16")
    monkeypatch.setattr("dspark.runtime.linear.has_bf16_matmul", lambda: True)
    assert wiring.torch_dtypes(spec) == wiring.torch_dtypes(explicit) == (bf16, bf16)
    monkeypatch.setattr("dspark.runtime.linear.has_bf16_matmul", lambda: False)
    assert wiring.torch_dtypes(spec) == (fp32, fp32) and wiring.torch_dtype(spec) == fp32
    monkeypatch.setattr("dspark.runtime.linear.serving_cpu_gemm", lambda dtype: "rows")
    assert wiring.torch_dtypes(explicit) == (fp32, bf16) and wiring.torch_dtype(explicit) == fp32
    assert wiring.torch_dtypes(wiring.Spec(model="smollm2", device="cpu", dtype="q4_1")) == (bf16, bf16)
    monkeypatch.setattr("dspark.runtime.linear.serving_cpu_gemm", lambda dtype: "onednn")
    assert wiring.torch_dtypes(explicit) == (bf16, bf16)
    assert wiring.torch_dtype(wiring.Spec(model="demo", device="cpu")) == fp32


def test_a_table_profiled_at_more_threads_is_read_at_that_thread_count(tmp_path, monkeypatch):
    """A verify's cost by rows depends on the thread count (AVX2, 5 tokens: ~1.35x one token on
    1 thread, ~1.2x on 2): `--num-threads 2` reads `..._t2.json` when profiled, else the
    1-thread table of the same dtype and kind before any other kind's; 1 thread never reads a
    `_t2` table; `dspark profile-sps --threads 2` writes it."""
    from dspark import wiring

    shipped = tmp_path / "sps_m_cpu.json"
    monkeypatch.setitem(wiring.SPS_TABLES, "smollm2", shipped)
    avx2, avx2_t2 = tmp_path / "sps_m_cpu_avx2.json", tmp_path / "sps_m_cpu_avx2_t2.json"
    assert wiring.sps_table_path("smollm2", "auto", "avx2", 2) == avx2_t2
    assert wiring.sps_table_path("smollm2", "auto", "avx2", 1) == avx2
    assert wiring.sps_table_path("smollm2", "q4_1", "", 4) == tmp_path / "sps_m_q4_1_cpu_t4.json"
    SPSTable([1, 8], [100.0, 50.0], device="cpu").save(shipped)
    SPSTable([1, 8], [90.0, 70.0], device="cpu").save(avx2)
    assert wiring.auto_sps_path("smollm2", "fp32", "avx2", threads=2) == avx2  # the kind first
    SPSTable([1, 8], [95.0, 80.0], device="cpu").save(avx2_t2)
    assert wiring.auto_sps_path("smollm2", "fp32", "avx2", threads=2) == avx2_t2
    assert wiring.auto_sps_path("smollm2", "fp32", "avx2", threads=1) == avx2
    assert wiring.auto_sps_path("smollm2", "fp32", "avx2") == avx2
    monkeypatch.setattr("dspark.runtime.linear.cpu_flags", lambda *a: {"avx2", "fma"})
    spec = wiring.Spec(model="smollm2", dtype="fp32", device="cpu")
    assert wiring.load_sps(spec).steps_per_second == [90.0, 70.0]  # num_threads 0: 1 thread
    assert wiring.load_sps(replace(spec, num_threads=2)).steps_per_second == [95.0, 80.0]
