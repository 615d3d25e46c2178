"""`dspark eval` end to end on the tiny random target, and its trace replays."""

import json

import numpy as np
import pytest
import torch

from dspark.cli import main
from dspark.tools import evaluate as ev
from dspark.tools.traces import BlockTrace, load_traces


def write_prompts(path):
    lines = [{"prompt": "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"},
             {"turns": ["The quick brown fox jumps over the lazy dog. The quick brown", "ignored"]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def untrained_drafter(folder, target_path, head: str, block_size: int = 5):
    """A random DSpark drafter for the tiny target (the shipped code path, no training)."""
    from dspark.runtime.drafter.dspark_model import DSparkConfig, DSparkModel, save_dspark
    from dspark.runtime.target import TargetEngine

    target = TargetEngine.from_pretrained(target_path, capacity=1, max_seq_len=64)
    cfg = DSparkConfig(vocab_size=target.vocab_size, hidden_size=target.config.hidden_size,
                       tap_dim=target.tap_dim, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                       block_size=block_size, gamma=block_size, head=head, head_rank=8,
                       tap_layers=list(target.tap_layers))
    torch.manual_seed(0)
    return save_dspark(DSparkModel(cfg), folder)


def test_eval_quick_end_to_end(tiny_ckpt, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    markov = untrained_drafter(tmp_path / "dspark_markov", tiny_ckpt, "markov")
    dflash = untrained_drafter(tmp_path / "dflash", tiny_ckpt, "none")
    out = tmp_path / "res" / "offline_eval.json"
    argv = ["eval", "--quick", "--model", str(tiny_ckpt), "--prompts", str(prompts), "--gammas", "3,5",
            "--drafters", f"ngram,{markov},{dflash}", "--out", str(out), "--threads", "1",
            "--traces-dir", str(out.parent / "traces")]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    for key in ("tau", "ece", "acceptance_by_position", "ratios", "threshold_sweep", "config"):
        assert key in res
    assert set(res["tau"]) == {"ngram", "dspark_markov", "dflash"}
    for by_gamma in res["tau"].values():
        assert set(by_gamma) == {"gamma3", "gamma5"}
        for by_t in by_gamma.values():
            assert set(by_t) == {"T1", "T0"}
            for row in by_t.values():
                assert row["custom"] >= 1.0  # the bonus / corrected token always counts
    assert len(res["ece"]["dspark_markov"]["before"]) == 5
    assert set(res["ratios"]["dspark_markov_vs_dflash"]) == {"gamma3", "gamma5"}
    for name in ("ngram", "dspark_markov", "dflash"):
        sim = load_traces(out.parent / "traces" / f"{name}.jsonl")  # the simulator reads them
        assert sim.gamma == 5 and len(sim.accepted) > 0
        assert (out.parent / "traces" / f"{name}_gamma3_T0.jsonl").is_file()
    suffix = f"_{tiny_ckpt.name}"  # results of a folder model carry its name
    assert (out.parent / f"acceptance_by_position{suffix}.png").is_file()
    assert (out.parent / f"threshold_sweep{suffix}.png").is_file()
    for row in res["tau"]["dspark_markov"].values():
        lo, hi = row["T1"]["mean_ci95"]
        assert lo <= row["T1"]["mean"] <= hi
    # a second run reuses the traces and reproduces the numbers
    assert main(argv + ["--reuse-traces"]) == 0
    assert json.loads(out.read_text())["tau"] == res["tau"]
    # affine STS ships where calibrate chose it: ECE "after" and the simulator traces apply σ(z/T + b)
    sim_before = load_traces(out.parent / "traces" / "dspark_markov.jsonl").survival
    (markov / "calibration.json").write_text(json.dumps({
        "sts": "affine", "sts_temperatures": [1.0] * 5, "sts_shifts": [2.0] * 5,
        "temperature_only": {"sts_temperatures": [1.0] * 5}}))
    assert main(argv + ["--reuse-traces"]) == 0
    ece_row = json.loads(out.read_text())["ece"]["dspark_markov"]
    assert ece_row["sts"] == "affine" and ece_row["temperature_only_after"] == ece_row["before"]
    assert ece_row["after"] != ece_row["before"]
    sim_after = load_traces(out.parent / "traces" / "dspark_markov.jsonl").survival
    assert (sim_after > sim_before).all()  # a positive shift raises every survival
    (markov / "calibration.json").unlink()
    # ablation mode: every drafter ÷ the baseline, and τ gain per extra training CPU-minute
    for folder, cpu_s in ((markov, 600.0), (dflash, 1200.0)):
        (folder / "train.json").write_text(json.dumps({"train_cpu_seconds": cpu_s}))
    abl = out.parent / f"offline_eval{suffix}_ablations.json"
    argv_abl = [a if a != str(out) else str(abl) for a in argv]
    argv_abl += ["--reuse-traces", "--baseline", "dspark_markov"]
    assert main(argv_abl) == 0
    got = json.loads(abl.read_text())
    assert got["tau"] == res["tau"]
    assert set(got["ratios"]) == {"ngram_vs_dspark_markov", "dflash_vs_dspark_markov"}
    cost = got["training_cost"]
    assert set(cost) == {"dspark_markov", "dflash"}  # ngram has no training
    assert cost["dflash"]["extra_cpu_min"] == 10.0
    gain = res["tau"]["dflash"]["gamma5"]["T0"]["mean"] - res["tau"]["dspark_markov"]["gamma5"]["T0"]["mean"]
    assert cost["dflash"]["tau_gain_per_extra_cpu_min"]["gamma5"]["T0"] == pytest.approx(gain / 10, abs=1e-4)
    assert (out.parent / f"acceptance_by_position{suffix}_ablations.png").is_file()
    # GPU-trained folders: their cost is wall minutes on the GPU, kept apart from CPU-minutes
    for folder, wall_s in ((markov, 120.0), (dflash, 240.0)):
        (folder / "train.json").write_text(json.dumps({"device": "NVIDIA H200", "train_seconds": wall_s,
                                                       "train_cpu_seconds": 5000.0}))
    assert main(argv_abl) == 0
    cost = json.loads(abl.read_text())["training_cost"]
    assert cost["dflash"]["extra_gpu_min"] == 2.0 and "extra_cpu_min" not in cost["dflash"]
    assert cost["dflash"]["tau_gain_per_extra_gpu_min"]["gamma5"]["T0"] == pytest.approx(gain / 2, abs=1e-4)
    with pytest.raises(SystemExit, match="--baseline"):
        main(argv_abl[:-1] + ["eagle"])


def hand_trace() -> BlockTrace:
    z = np.array([[2.0, 2.0, -2.0], [2.0, -2.0, 2.0], [-2.0, 2.0, 2.0]])
    return BlockTrace(z, np.array([3, 1, 0]), np.array([3, 3, 3]))


def test_threshold_sweep_replays_prefix_rule():
    rows = ev.threshold_sweep(hand_trace(), None, thresholds=[0.0, 0.5, 0.99])
    # t=0 verifies everything; t=0.5 stops at the first σ(z)<0.5: ℓ = 2, 1, 0
    assert rows[0]["verified_per_block"] == 3 and rows[0]["accepted_per_block"] == pytest.approx(4 / 3)
    assert rows[1]["verified_per_block"] == 1 and rows[1]["accepted_per_block"] == pytest.approx(1)
    assert rows[1]["acceptance_rate"] == pytest.approx(3 / 3)
    assert rows[2]["verified_per_block"] == 0 and rows[2]["acceptance_rate"] is None
    fixed = ev.fixed_sweep(hand_trace())
    assert [r["verified_per_block"] for r in fixed] == [1, 2, 3]
    assert fixed[0]["acceptance_rate"] == pytest.approx(2 / 3)


def test_noise_floor_shrinks_with_more_blocks():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(20_000, 2))
    trace = lambda n: BlockTrace(z[:n], np.zeros(n, dtype=np.int64), np.full(n, 2))
    many = ev.ece_noise_floor(trace(20_000), None, draws=3)
    few = ev.ece_noise_floor(trace(500), None, draws=3)
    assert all(0 < f < 0.02 for f in many)
    assert all(f > 2 * m for f, m in zip(few, many))


def test_where_missed_counts_accepted_drafts_and_corrections(tiny_tokenizer_path):
    """Output = prefill token, then per block its n accepted drafts and the corrected (n < ℓ)
    or bonus (n = ℓ) token: accepted drafts count as got, corrections as missed, bonuses not."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_tokenizer_path))
    ids = [tok.encode(t).ids[0] for t in ("a", "\n", " the", "7", ",", "x")]
    req = {"output": ids, "blocks": [{"n_accepted": 2, "n_verified": 3}, {"n_accepted": 1, "n_verified": 1},
                                     {"n_accepted": 0, "n_verified": 2}]}
    got = ev.where_missed([req], tok)
    assert sum(v["accepted"] for v in got.values()) == 3 and sum(v["missed"] for v in got.values()) == 1
    assert got["newline"]["accepted"] == 1 and got["punct"]["accepted"] == 1
    assert got[ev.token_class(tok.decode([ids[3]]))]["missed"] == 1  # "7": the correction of block 1
    assert ev.token_class("    ") == "indent" and ev.token_class(" the") == "word"
    assert ev.token_class("ing") == "subword"
