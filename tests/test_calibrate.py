"""Sequential Temperature Scaling on synthetic traces with known miscalibration."""

import json

import numpy as np
import pytest

from dspark.tools.calibrate import (
    BlockTrace,
    affine_report,
    calibrate_trace,
    fit_sts,
    fold_shifts,
    is_calibration_prompt,
    plot_reliability,
    position_report,
    read_calibration,
    read_sts_shifts,
    read_temperature_only,
    write_calibration,
)
from dspark.tools.traces import read_block_trace


def synthetic_trace(scales: list[float], n: int = 20_000, seed: int = 0,
                    cap_last: bool = False) -> BlockTrace:
    """Position k is accepted (given k−1 survived) with prob σ(u_k); the head reports
    z_k = scales[k]·u_k, so the true STS temperature of position k is scales[k]."""
    rng = np.random.default_rng(seed)
    g = len(scales)
    u = rng.normal(1.0, 1.5, size=(n, g))
    accept = rng.uniform(size=(n, g)) < 1 / (1 + np.exp(-u))
    n_acc = np.where(accept.all(1), g, np.argmin(accept, axis=1))
    n_ver = np.full(n, g)
    if cap_last:  # some blocks verified fewer positions (end of a request)
        n_ver[: n // 10] = g - 2
        n_acc = np.minimum(n_acc, n_ver)
    return BlockTrace(u * np.asarray(scales), n_acc.astype(np.int64), n_ver.astype(np.int64))


def test_sts_recovers_known_temperatures_and_lowers_ece():
    truth = [3.0, 3.0, 0.5, 2.0, 3.0]
    trace = synthetic_trace(truth, cap_last=True)
    temps = fit_sts(trace)
    assert np.allclose(temps, truth, rtol=0.2), temps
    rep = calibrate_trace(trace)
    assert rep["sts_temperatures"] == temps
    for before, after in zip(rep["ece_before"], rep["ece_after"]):
        assert after < before and after < 0.02
    # position 1 ranking is unchanged by a monotone rescaling
    assert rep["auroc_after"][0] == pytest.approx(rep["auroc_before"][0])


def test_grid_ece_matches_metrics_ece():
    from dspark.tools.calibrate import _ece_per_row
    from dspark.tools.metrics import ece

    rng = np.random.default_rng(3)
    conf, y = rng.uniform(size=(4, 500)), rng.uniform(size=500) < 0.5
    conf[0, :3] = [0.0, 1.0, 0.05]  # bin edges
    assert np.allclose(_ece_per_row(conf, y, 20), [ece(c, y) for c in conf])


def test_sts_keeps_calibrated_head_near_one():
    temps = fit_sts(synthetic_trace([1.0, 1.0, 1.0], seed=1))
    assert np.allclose(temps, 1.0, rtol=0.2), temps


def test_from_rows_and_calibration_file_roundtrip(tmp_path):
    rows = [{"conf_logits": [2.0, -1.0], "n_accepted": 1, "n_verified": 2},
            {"conf_logits": [0.5, 0.5], "n_accepted": 0}]
    t = BlockTrace.from_rows(rows)
    assert t.gamma == 2 and len(t) == 2 and t.n_verified.tolist() == [2, 2]
    assert read_calibration(tmp_path) is None
    write_calibration(tmp_path, {"sts_temperatures": [1.5, 2.5]})
    assert read_calibration(tmp_path) == [1.5, 2.5]
    assert json.loads((tmp_path / "calibration.json").read_text())["sts_temperatures"] == [1.5, 2.5]


def test_reliability_plot_written(tmp_path):
    trace = synthetic_trace([3.0, 3.0], n=2000)
    plot_reliability(trace, fit_sts(trace), "synthetic", tmp_path / "rel.png")
    assert (tmp_path / "rel.png").stat().st_size > 1000


def test_calibration_split_is_deterministic_and_partial():
    texts = [f"prompt number {i}" for i in range(400)]
    held = [t for t in texts if is_calibration_prompt(t)]
    assert held == [t for t in texts if is_calibration_prompt(t)]
    assert 50 < len(held) < 150


def test_calibrate_cli_from_trace_file(tmp_path):
    from dspark.cli import main

    trace = synthetic_trace([3.0, 2.0, 3.0], n=5000, seed=2)
    path = tmp_path / "trace.jsonl"
    with open(path, "w") as f:
        for z, n, ell in zip(trace.conf_logits, trace.n_accepted, trace.n_verified):
            row = {"conf_logits": z.tolist(), "n_accepted": int(n), "n_verified": int(ell)}
            f.write(json.dumps(row) + "\n")
    folder = tmp_path / "my_drafter"
    folder.mkdir()
    argv = ["calibrate", "--model", "demo", "--drafter", str(folder), "--traces", str(path),
            "--results", str(tmp_path)]
    assert main(argv) == 0
    payload = json.loads((folder / "calibration.json").read_text())
    assert np.allclose(payload["sts_temperatures"], [3.0, 2.0, 3.0], rtol=0.25)
    assert all(a < b for a, b in zip(payload["ece_after"], payload["ece_before"]))
    assert (tmp_path / "reliability_my_drafter.png").is_file()


def test_calibrate_cli_runs_drafter_on_heldout_prompts(tiny_ckpt, tmp_path):
    """Real traces: an untrained DSpark drafter against the tiny target, held-out prompts."""
    from test_evaluate import untrained_drafter

    from dspark.cli import main

    folder = untrained_drafter(tmp_path / "markov_tiny", tiny_ckpt, "markov", block_size=4)
    argv = ["calibrate", "--drafter", str(folder), "--model", str(tiny_ckpt), "--gamma", "4",
            "--n-prompts", "1", "--max-tokens", "16", "--max-prompt-tokens", "48", "--threads", "1",
            "--results", str(tmp_path), "--traces-dir", str(tmp_path / "traces")]
    assert main(argv) == 0
    payload = json.loads((folder / "calibration.json").read_text())
    assert len(payload["sts_temperatures"]) == 4 and payload["n_blocks"] >= 3
    assert all(0.05 <= t <= 20 for t in payload["sts_temperatures"])
    assert (tmp_path / f"reliability_markov_tiny_{tiny_ckpt.name}.png").is_file()
    # the recorded trace is in the one trace format, and refitting from it gives the same T
    trace = read_block_trace(tmp_path / "traces" / "calibration_markov_tiny.jsonl")
    assert len(trace) == payload["n_blocks"] and trace.meta["drafter"] == "markov_tiny"
    assert fit_sts(trace) == payload["sts_temperatures"]


def test_sts_positions_without_survivors_keep_previous_temperature():
    trace = synthetic_trace([3.0, 3.0, 3.0], n=4000, seed=4)
    trace.n_accepted = np.minimum(trace.n_accepted, 1)  # nobody survives past position 1
    temps = fit_sts(trace)
    assert temps[1] == temps[2] == temps[0]


def test_affine_sts_removes_a_bias_temperature_cannot():
    """A head whose logits are shifted (z = true logit + 1.5): no temperature maps the shifted
    logits back at every confidence level, a temperature plus a shift does."""
    from dspark.tools.calibrate import affine_report, fit_affine_sts, position_report

    rng = np.random.default_rng(7)
    n, g = 6000, 3
    true = rng.normal(0.5, 1.5, (n, g))
    alive = rng.random((n, g)) < 1 / (1 + np.exp(-true))
    acc = np.logical_and.accumulate(alive, axis=1).sum(1)
    trace = BlockTrace(true + 1.5, acc, np.full(n, g))
    temp_only = position_report(trace, fit_sts(trace))["ece"]
    params = fit_affine_sts(trace)
    affine = affine_report(trace, params)
    assert max(affine) < 0.03 < 0.05 < min(temp_only)
    assert abs(params[0][1] + 1.5) < 0.3 and abs(params[0][0] - 1.0) < 0.25


def biased_trace(n: int = 20_000, seed: int = 5) -> BlockTrace:
    """Position k accepted with prob σ(u_k − 1) but the head reports z_k = u_k: a bias no
    temperature removes (the confidence of every block is too high)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(1.0, 1.5, size=(n, 3))
    accept = rng.uniform(size=(n, 3)) < 1 / (1 + np.exp(-(u - 1.0)))
    n_acc = np.where(accept.all(1), 3, np.argmin(accept, axis=1))
    return BlockTrace(u, n_acc, np.full(n, 3))


def test_affine_sts_ships_shifts_and_removes_a_bias_temperatures_cannot(tmp_path):
    trace = biased_trace()
    t_only = calibrate_trace(trace)
    aff = calibrate_trace(trace, sts="affine")
    assert t_only["sts"] == "temperature" and "sts_shifts" not in t_only
    assert aff["sts"] == "affine" and len(aff["sts_shifts"]) == 3
    assert aff["sts_shifts"][0] == pytest.approx(-1.0, abs=0.25)  # the planted bias
    assert max(aff["ece_after"]) < 0.02 < t_only["ece_after"][0]
    assert aff["temperature_only"]["ece_after"] == t_only["ece_after"]
    # folding b·T into the logits turns temperature-only reports into the affine ones
    params = list(zip(aff["sts_temperatures"], aff["sts_shifts"]))
    folded = fold_shifts(trace, aff["sts_temperatures"], aff["sts_shifts"])
    folded_ece = position_report(folded, aff["sts_temperatures"])["ece"]
    assert folded_ece == pytest.approx(affine_report(trace, params))
    write_calibration(tmp_path, aff)
    assert read_sts_shifts(tmp_path) == aff["sts_shifts"]
    assert read_temperature_only(tmp_path) == t_only["sts_temperatures"]
    write_calibration(tmp_path, t_only)
    assert read_sts_shifts(tmp_path) is None and read_temperature_only(tmp_path) is None
