"""`dspark train` (docs/architecture.md §8) on the tiny checkpoint: data generation, the loss, resumable
checkpoints, export of every drafter kind, and DDP (2 processes = 1 process)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.runtime.drafter import load_drafter
from dspark.runtime.engine import SpecEngine
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.target import TargetEngine
from dspark.tools import train
from dspark.tools.train_data import hot_rows, load_data, make_data

torch.set_num_threads(1)
TINY_MODEL = ["--block-size", "5", "--gamma", "4", "--layers", "1", "--intermediate", "32",
              "--head-rank", "8", "--batch", "4", "--anchors", "4", "--threads", "1", "--ckpt-every", "100"]


@pytest.fixture(scope="module")
def data_dir(tiny_ckpt, tmp_path_factory) -> Path:
    """Target-generated data on the tiny checkpoint (prompts from random token streams)."""
    root = tmp_path_factory.mktemp("train_data")
    rng = np.random.default_rng(0)
    for d in ("code", "prose", "math"):
        rng.integers(3, 290, 2000).astype(np.uint16).tofile(root / f"{d}.train.bin")
    target = TargetEngine.from_pretrained(tiny_ckpt, capacity=6, max_seq_len=64)
    make_data(target, root, root / "data", n_per_domain=2, max_new=20, min_prompt=4, max_prompt=10, batch=6)
    return root / "data"


def run_train(tiny_ckpt, data_dir, tmp, *extra: str) -> dict:
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    args = p.parse_args(["--target", str(tiny_ckpt), "--data", str(data_dir), "--work", str(tmp / "work"),
                         "--out", str(tmp / "out"), "--results", str(tmp / "results"), *TINY_MODEL, *extra])
    assert train.main(args) == 0
    name = args.name or train.default_name(args.kind, args.head)
    path = tmp / "results" / f"train_{name}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def test_make_data_is_target_sampled_with_a_loss_mask(tiny_ckpt, data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    data = load_data(data_dir)
    assert data["tokens"].shape[0] == 6 == meta["sequences"]
    assert data["taps"].shape[:2] == data["tokens"].shape and data["hidden"].shape[:2] == data["tokens"].shape
    m = data["loss_mask"]
    # loss mask: a prompt of 4..10 tokens (False) then the generated continuation (True)
    first = m.long().argmax(1)
    assert ((first >= 4) & (first <= 10)).all() and int(m.sum()) == meta["generated_tokens"] > 0
    # the continuation is what the target samples at T 0.7 / top-k 20 / top-p 0.8 with the stored seed
    target = TargetEngine.from_pretrained(tiny_ckpt, capacity=1, max_seq_len=64)
    prompt = data["tokens"][0, :first[0]].tolist()
    gen = data["tokens"][0][m[0]].tolist()
    again = SpecEngine(target).generate([prompt], 20, SamplingParams(0.7, 20, 0.8, seed=0))[0]
    assert again == gen


def test_t1_share_continues_that_share_of_prompts_at_plain_t1(tiny_ckpt, data_dir, tmp_path):
    """`--t1-share`: the chosen rows are sampled at T = 1 (no top-k/top-p), the rest as architecture §8."""
    target = TargetEngine.from_pretrained(tiny_ckpt, capacity=6, max_seq_len=64)
    meta = make_data(target, data_dir.parent, tmp_path / "mixed", n_per_domain=2, max_new=20, min_prompt=4,
                     max_prompt=10, batch=6, t1_share=0.5)
    assert meta["t1_share"] == 0.5 and meta["t1_sequences"] == 3
    data = load_data(tmp_path / "mixed")
    one = TargetEngine.from_pretrained(tiny_ckpt, capacity=1, max_seq_len=64)
    for row, hot in enumerate(hot_rows(6, 0.5)):
        m = data["loss_mask"][row]
        prompt = data["tokens"][row, :int(m.long().argmax())].tolist()
        params = SamplingParams(1.0, seed=row) if hot else SamplingParams(0.7, 20, 0.8, seed=row)
        assert SpecEngine(one).generate([prompt], 20, params)[0] == data["tokens"][row][m].tolist()
    with pytest.raises(ValueError, match="t1_share"):
        make_data(target, data_dir.parent, tmp_path / "bad", n_per_domain=1, max_new=4, min_prompt=4,
                  max_prompt=5, t1_share=1.5)


def test_training_lowers_the_loss_and_exports_every_kind(tiny_ckpt, data_dir, tmp_path):
    target = TargetEngine.from_pretrained(tiny_ckpt, capacity=2, max_seq_len=64)
    for kind, head in (("dspark", "markov"), ("dspark", "rnn"), ("dspark", "none"), ("eagle", "none"),
                       ("draft_lm", "none")):
        steps = 30 if head == "markov" else 2
        res = run_train(tiny_ckpt, data_dir, tmp_path / f"{kind}-{head}", "--kind", kind, "--head", head,
                        "--steps", str(steps), "--lr", "1e-2", "--warmup", "2", "--save-dtype", "float32")
        hist = res["history"]
        assert len(hist) == steps and all(np.isfinite(r["loss"]) for r in hist)
        if steps == 30:  # the DSpark-Markov run is long enough to learn something
            assert np.mean([r["loss"] for r in hist[-5:]]) < np.mean([r["loss"] for r in hist[:5]])
            assert Path(res["drafter_dir"]).is_dir() and res["drafter_bytes"] < 15e6
        drafter = load_drafter(str(tmp_path / f"{kind}-{head}" / "out"), target, gamma=4)
        drafter.start(0, [5, 6, 7], torch.zeros(3, target.tap_dim))
        blk = drafter.propose([0], torch.tensor([8]), [SamplingParams()], [None])
        assert blk.tokens.shape == (1, 4) and torch.allclose(blk.probs.sum(-1), torch.ones(1, 4), atol=1e-5)
        drafter.release(0)
        assert (tmp_path / f"{kind}-{head}" / "results" / f"train_{res['name']}_loss.png").is_file()


def test_resume_continues_exactly(tiny_ckpt, data_dir, tmp_path):
    common = ["--kind", "dspark", "--head", "rnn", "--steps", "4", "--no-export"]
    straight = run_train(tiny_ckpt, data_dir, tmp_path / "a", *common)["history"]
    assert run_train(tiny_ckpt, data_dir, tmp_path / "b", *common, "--stop-after", "2") == {}
    resumed = run_train(tiny_ckpt, data_dir, tmp_path / "b", *common)["history"]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]


def test_rank_split_gradient_equals_full_batch_gradient(tiny_ckpt, data_dir):
    """The DDP normalisation without processes: each rank's loss Σ_rank·world/norm, averaged
    over ranks as DDP does, has the gradient of the full batch's Σ/norm."""
    from dspark.runtime.loader import load_model

    p = argparse.ArgumentParser()
    train.add_arguments(p)
    args = p.parse_args(["--kind", "dspark", "--head", "rnn", *TINY_MODEL])
    target_model, cfg = load_model(tiny_ckpt)
    data = load_data(data_dir)
    torch.manual_seed(0)
    model = train.build_model(args, target_model, cfg, list(target_model.tap_layers))
    loss_mod = train.DrafterLoss(model, "dspark", target_model.embed_tokens.weight, (0.1, 0.9, 1.0), 4.0)
    lengths = data["loss_mask"].long().cumsum(1).argmax(1) + 1
    ids, anchors = train.sample_step(0, 0, lengths, data["loss_mask"], 4, 4)
    norm = train.batch_weight("dspark", ids, anchors, data["loss_mask"], 5, 4.0)

    def grads(rows, scale):
        model.zero_grad()
        i = ids[rows]
        loss, _ = loss_mod(data["tokens"][i], data["loss_mask"][i], data["taps"][i].float(),
                           data["hidden"][i].float(), anchors[rows])
        (loss * scale / norm).backward()
        return [p.grad.clone() for p in model.parameters()]

    full = grads(slice(0, 4), 1)
    halves = [grads(slice(0, 2), 2), grads(slice(2, 4), 2)]
    for f, a, b in zip(full, *halves):
        assert torch.allclose(f, (a + b) / 2, atol=1e-6)
    assert any(f.abs().sum() > 0 for f in full)


@pytest.mark.slow
@pytest.mark.integration
def test_two_processes_reach_the_same_loss_as_one(tiny_ckpt, data_dir, tmp_path):
    common = ["--kind", "dspark", "--head", "markov", "--steps", "3", "--no-export"]
    one = run_train(tiny_ckpt, data_dir, tmp_path / "one", *common)["history"]
    two_dir = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29731",
           "-m", "dspark.cli", "train", "--target", str(tiny_ckpt), "--data", str(data_dir),
           "--work", str(two_dir / "work"), "--results", str(two_dir / "results"), *TINY_MODEL, *common]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((two_dir / "results" / "train_dspark-markov.json").read_text())
    assert two["world_size"] == 2
    for a, b in zip(one, two["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
