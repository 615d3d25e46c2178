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
from dspark.tools.train_data import (
    assign_modes,
    batch_features,
    corpus_prompts,
    hot_rows,
    load_data,
    load_data_many,
    make_data,
)

torch.set_num_threads(1)
TINY_MODEL = ["--block-size", "5", "--gamma", "4", "--layers", "1", "--intermediate", "32",
              "--head-rank", "8", "--batch", "4", "--anchors", "4", "--threads", "1", "--ckpt-every", "100",
              "--precision", "fp32"]


def tiny_data(tiny_ckpt, root: Path, out: Path, **kw) -> dict:
    """make_data on the tiny checkpoint, prompts = windows of random token streams."""
    target = TargetEngine.from_pretrained(tiny_ckpt, capacity=6, max_seq_len=64)
    prompts, dom = corpus_prompts(root, 2, 4, 10, seed=0)
    return make_data(target, prompts, dom, out, max_new=20, chunk=kw.pop("chunk", 6), **kw)


@pytest.fixture(scope="module")
def data_dir(tiny_ckpt, tmp_path_factory) -> Path:
    """Target-generated data on the tiny checkpoint (prompts from random token streams)."""
    root = tmp_path_factory.mktemp("train_data")
    rng = np.random.default_rng(0)
    for d in ("code", "prose", "math"):
        rng.integers(3, 290, 2000).astype(np.uint16).tofile(root / f"{d}.train.bin")
    tiny_data(tiny_ckpt, root, root / "data", chunk=4)  # two shards (4 + 2 sequences)
    return root / "data"


def run_train(tiny_ckpt, data_dir, tmp, *extra: str) -> dict:
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    args = p.parse_args(["--model", str(tiny_ckpt), "--data", str(data_dir), "--work", str(tmp / "work"),
                         "--out", str(tmp / "out"), "--results", str(tmp / "results"), *TINY_MODEL, *extra])
    assert train.main(args) == 0
    name = args.name or train.default_name(args.kind, args.head)
    path = tmp / "results" / f"train_{name}_{Path(tiny_ckpt).name}.json"  # a folder model: its name
    return json.loads(path.read_text()) if path.is_file() else {}


def test_make_data_is_target_sampled_with_a_loss_mask(tiny_ckpt, data_dir):
    meta = json.loads((data_dir / "meta.json").read_text())
    data = load_data(data_dir)
    assert data["tokens"].shape[0] == 6 == meta["sequences"] and len(list(data_dir.glob("shard_*.pt"))) == 2
    assert data["taps"].shape[0] == data["hidden"].shape[0] == int(data["lengths"].sum())
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
    # cached features are the target's own causal taps / final hidden of each whole sequence
    n = int(data["lengths"][4])
    h, taps = target.model.forward_hidden(data["tokens"][4:5, :n])
    got_taps, got_hidden = batch_features(data, torch.tensor([4]), n)
    assert torch.allclose(got_taps[0], taps[0], atol=1e-5) and torch.allclose(got_hidden[0], h[0], atol=1e-5)


def test_make_data_resumes_from_written_shards(tiny_ckpt, data_dir, tmp_path):
    """A rerun skips finished shards (a deleted one is regenerated identically)."""
    out = tmp_path / "resume"
    tiny_data(tiny_ckpt, data_dir.parent, out, chunk=4)
    first = load_data(out)
    (out / "shard_0001.pt").unlink()
    (out / "feat_0001.pt").unlink()
    stamp = (out / "shard_0000.pt").stat().st_mtime_ns
    tiny_data(tiny_ckpt, data_dir.parent, out, chunk=4)
    again = load_data(out)
    assert (out / "shard_0000.pt").stat().st_mtime_ns == stamp
    assert torch.equal(first["tokens"], again["tokens"]) and torch.equal(first["taps"], again["taps"])
    both = load_data_many([out, data_dir])
    assert both["tokens"].shape[0] == 12 and both["taps"].shape[0] == int(both["lengths"].sum())


def test_assign_modes_spreads_shares_within_each_domain():
    modes = assign_modes([0] * 100 + [1] * 100, t1_share=0.3, greedy_share=0.2)
    for d in (0, 1):
        part = modes[100 * d:100 * (d + 1)]
        assert (part.count(1), part.count(2), part.count(0)) == (30, 20, 50)
    with pytest.raises(ValueError, match="greedy_share"):
        assign_modes([0], 0.2, 1.5)
    with pytest.raises(ValueError, match="<= 1"):
        assign_modes([0], 0.6, 0.6)


def test_t1_share_continues_that_share_of_prompts_at_plain_t1(tiny_ckpt, data_dir, tmp_path):
    """`--t1-share`: the chosen rows are sampled at T = 1 (no top-k/top-p), the rest as architecture §8."""
    meta = tiny_data(tiny_ckpt, data_dir.parent, tmp_path / "mixed", t1_share=0.5, greedy_share=0.5)
    assert meta["t1_share"] == 0.5 and meta["sequences_by_mode"] == {"recipe": 0, "t1": 3, "greedy": 3}
    data = load_data(tmp_path / "mixed")
    one = TargetEngine.from_pretrained(tiny_ckpt, capacity=1, max_seq_len=64)
    for row in range(6):
        m = data["loss_mask"][row]
        prompt = data["tokens"][row, :int(m.long().argmax())].tolist()
        mode = int(data["mode"][row])
        assert mode == (1 if hot_rows(2, 0.5)[row % 2] else 2)
        params = SamplingParams(1.0, seed=row) if mode == 1 else SamplingParams(0.0, seed=row)
        assert SpecEngine(one).generate([prompt], 20, params)[0] == data["tokens"][row][m].tolist()
    with pytest.raises(ValueError, match="t1_share"):
        tiny_data(tiny_ckpt, data_dir.parent, tmp_path / "bad", t1_share=1.5)


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
        blk = drafter.propose([0], torch.tensor([8]), [SamplingParams(temperature=1.0)], torch.rand(1, 4))
        q = drafter.draft_probs([0], torch.tensor([4]))
        assert blk.tokens.shape == (1, 4) and torch.allclose(q.sum(-1), torch.ones(4), atol=1e-5)
        drafter.release(0)
        loss_png = f"train_{res['name']}_{tiny_ckpt.name}_loss.png"
        assert (tmp_path / f"{kind}-{head}" / "results" / loss_png).is_file()


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
    ids, anchors = train.sample_step(0, 0, data["lengths"], data["loss_mask"], 4, 4)
    norm = train.batch_weight("dspark", ids, anchors, data["loss_mask"], 5, 4.0)

    def grads(rows, scale):
        model.zero_grad()
        i = ids[rows]
        taps, hidden = batch_features(data, i, data["tokens"].shape[1])
        loss, _ = loss_mod(data["tokens"][i], data["loss_mask"][i], taps, hidden, anchors[rows])
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
           "-m", "dspark.cli", "train", "--model", str(tiny_ckpt), "--data", str(data_dir),
           "--work", str(two_dir / "work"), "--results", str(two_dir / "results"), *TINY_MODEL, *common]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((two_dir / "results" / f"train_dspark-markov_{tiny_ckpt.name}.json").read_text())
    assert two["world_size"] == 2
    for a, b in zip(one, two["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # a time budget under DDP: the ranks agree on the last step (else one would wait forever)
    swap = {"3": "100000", "29731": "29732"}  # --steps, --master_port
    budget = [swap.get(a, a) for a in cmd] + ["--time-budget", "3"]
    budget[budget.index("--work") + 1] = str(two_dir / "work_budget")
    proc = subprocess.run(budget, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((two_dir / "results" / f"train_dspark-markov_{tiny_ckpt.name}.json").read_text())
    assert res["time_budget_s"] == 3 and 0 < res["steps"] < 100000


# ---- the own-context drafter (config context = "own": no target taps) ----


def own_context_model(tiny_ckpt, head: str = "markov"):
    from dspark.runtime.drafter.dspark_model import DSparkConfig, DSparkModel
    from dspark.runtime.loader import load_model

    target_model, cfg = load_model(tiny_ckpt)
    torch.manual_seed(3)
    model = DSparkModel(DSparkConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                     tap_dim=cfg.hidden_size, num_heads=4, num_kv_heads=2, head_dim=16,
                                     intermediate_size=32, block_size=5, gamma=5, head=head, head_rank=8,
                                     context="own", context_layers=2))
    with torch.no_grad():  # random everywhere (zero-initialised heads would hide a wrong path)
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    embed = target_model.embed_tokens.weight
    model.attach_shared(embed, embed)
    return model.eval(), embed


def test_own_context_serving_equals_training_pass(tiny_ckpt):
    """The drafter's incremental own-context encoder (start + extend with rejected rows
    dropped) gives exactly the block logits of the trainer's full causal pass."""
    from dspark.runtime.drafter.dspark_drafter import DSparkDrafter

    model, embed = own_context_model(tiny_ckpt)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 290, (24,), generator=g)
    a = 15  # anchor position: context = tokens[:a], x0 = tokens[a]
    with torch.no_grad():
        h = model.train_hidden(tokens[None], None, torch.tensor([[a]]))[0, 0]  # [G, d]
        prev = tokens[a:a + 5]
        want = model.lm_head(h) + model.head.bias(model.head.teacher(prev[None], h[None])[0])
        want_conf = model.conf(h, model.head.token_features(prev))
    drafter = DSparkDrafter(model, embed, embed, gamma=5)
    no_taps = torch.zeros(0, 0)
    drafter.start(0, tokens[:9].tolist(), no_taps.new_zeros(9, 0))
    # one verify step: [x0, d1, d2, d3] of which x0 and d1 are kept (d2, d3 rejected scratch rows)
    step = torch.cat([tokens[9:11], torch.tensor([7, 8])])
    drafter.extend([0], step, no_taps.new_zeros(4, 0), torch.tensor([0, 4]), torch.tensor([2]))
    drafter.extend([0], tokens[11:a], no_taps.new_zeros(a - 11, 0), torch.tensor([0, a - 11]),
                   torch.tensor([a - 11]))
    assert drafter.context_length(0) == a
    logits, conf = drafter.score([0], tokens[a:a + 1], tokens[None, a + 1:a + 6])
    assert torch.allclose(logits[0].float(), want.float(), atol=1e-4, rtol=1e-4)
    assert torch.allclose(conf[0].float(), want_conf.float(), atol=1e-4)


def test_own_context_training_needs_no_taps_and_exports(tiny_ckpt, data_dir, tmp_path):
    res = run_train(tiny_ckpt, data_dir, tmp_path, "--kind", "dspark", "--head", "markov", "--context", "own",
                    "--context-layers", "1", "--name", "dspark-own", "--steps", "20", "--lr", "1e-2",
                    "--warmup", "2", "--save-dtype", "float32")
    assert res["config"]["context"] == "own" and res["config"]["tap_dim"] == res["config"]["hidden_size"]
    hist = res["history"]
    assert np.mean([r["loss"] for r in hist[-4:]]) < np.mean([r["loss"] for r in hist[:4]])
    target = TargetEngine.from_pretrained(tiny_ckpt, capacity=2, max_seq_len=64)
    drafter = load_drafter(str(tmp_path / "out"), target, gamma=4)
    assert drafter.model.ctx_encoder is not None
    engine_out = SpecEngine(target, drafter, "fixed:4").generate([[5, 6, 7, 8]], 12, SamplingParams())[0]
    assert engine_out == SpecEngine(target).generate([[5, 6, 7, 8]], 12, SamplingParams())[0]  # lossless


def test_tap_norm_scales_channels_the_same_in_training_and_serving(tiny_ckpt, tmp_path):
    """config tap_norm: the per-channel tap scale is applied before fc in the trainer's pass
    and in the drafter's extend alike, and is saved with the drafter."""
    from dspark.runtime.drafter.dspark_drafter import DSparkDrafter, load_dspark
    from dspark.runtime.drafter.dspark_model import DSparkConfig, DSparkModel, save_dspark
    from dspark.runtime.loader import load_model

    target_model, cfg = load_model(tiny_ckpt)
    tap_dim = len(target_model.tap_layers) * cfg.hidden_size
    torch.manual_seed(5)
    model = DSparkModel(DSparkConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, tap_dim=tap_dim,
                                     num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=32,
                                     block_size=4, gamma=4, head_rank=8, tap_norm=True,
                                     tap_layers=list(target_model.tap_layers)))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
        model.tap_scale.copy_(torch.rand(tap_dim) * 5)
    embed = target_model.embed_tokens.weight
    model.attach_shared(embed, embed)
    tokens = torch.randint(3, 290, (12,))
    with torch.no_grad():
        h, taps = target_model.forward_hidden(tokens[None])
        h = model.eval().train_hidden(tokens[None], taps, torch.tensor([[7]]))[0, 0]
        want = model.lm_head(h) + model.head.bias(model.head.teacher(tokens[None, 7:11], h[None])[0])
    drafter = DSparkDrafter(model, embed, embed, gamma=4)
    drafter.start(0, tokens[:7].tolist(), taps[0, :7])
    assert torch.allclose(drafter.score([0], tokens[7:8], tokens[None, 8:12])[0][0].float(), want, atol=1e-4)
    folder = save_dspark(model, tmp_path / "d", torch.float32)
    target = TargetEngine.from_pretrained(tiny_ckpt, capacity=1, max_seq_len=32)
    assert torch.equal(load_dspark(folder, target).model.tap_scale, model.tap_scale)
    # the trainer's scale: 1 / per-channel RMS with the attention-sink rows left out
    x = torch.randn(4000, 6) * torch.tensor([1.0, 2, 3, 4, 5, 100])
    x[::500] *= 1000  # sink rows
    assert torch.allclose(train.tap_channel_scale(x), 1 / torch.tensor([1.0, 2, 3, 4, 5, 100]), rtol=0.08)


def test_data_subset_is_a_seeded_sorted_share_of_the_pool():
    """The data-size ablation trains on a fixed seeded share of the sequences: same seed, same
    subset; the full fraction is the pool itself; out-of-range fractions are refused."""
    pool = torch.arange(10, 30)
    half = train.data_subset(pool, 0.5, seed=0)
    assert half.numel() == 10 and torch.equal(half, half.sort().values)
    assert set(half.tolist()) <= set(pool.tolist())
    assert torch.equal(half, train.data_subset(pool, 0.5, seed=0))
    assert not torch.equal(half, train.data_subset(pool, 0.5, seed=1))
    assert train.data_subset(pool, 1.0, seed=0) is pool
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(SystemExit, match="--data-fraction"):
            train.data_subset(pool, bad, seed=0)


def test_lr_follows_the_larger_progress_fraction():
    assert train.lr_at(0, 100, 10, 1.0, progress=0.9) == pytest.approx(0.1)  # warm-up is by step
    assert train.lr_at(50, 100, 0, 1.0) == pytest.approx(0.55)
    assert train.lr_at(50, 100, 0, 1.0, progress=1.0) == pytest.approx(0.1)
    assert train.lr_at(50, 100, 0, 1.0, progress=0.2) == pytest.approx(0.55)


def test_time_budget_ends_the_run_complete_and_exports(tiny_ckpt, data_dir, tmp_path):
    res = run_train(tiny_ckpt, data_dir, tmp_path, "--steps", "100000", "--time-budget", "2",
                    "--warmup", "2", "--save-dtype", "float32")
    hist = res["history"]
    assert 2 < len(hist) < 100000 and res["steps"] == len(hist) and res["planned_steps"] == 100000
    assert res["time_budget_s"] == 2 and hist[-1]["time_s"] < 2 + 1
    assert hist[-1]["lr"] < 0.3 * max(r["lr"] for r in hist)  # the cosine ran to (near) its end
    assert Path(res["drafter_dir"]).is_dir() and res["device"] == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_data_and_training_on_cuda(tiny_ckpt, tmp_path):
    """make_data (generation + features) and a DSpark-Markov / EAGLE training step on CUDA: the
    same first loss as on the CPU (fp32), the drafter exported and served back on the CPU."""
    rng = np.random.default_rng(0)
    for d in ("code", "prose", "math"):
        rng.integers(3, 290, 2000).astype(np.uint16).tofile(tmp_path / f"{d}.train.bin")
    target = TargetEngine.from_pretrained(tiny_ckpt, capacity=6, max_seq_len=64, device="cuda")
    prompts, dom = corpus_prompts(tmp_path, 2, 4, 10, seed=0)
    make_data(target, prompts, dom, tmp_path / "data", max_new=20, chunk=4)
    data = load_data(tmp_path / "data")
    assert data["taps"].device.type == "cpu" and data["taps"].shape[0] == int(data["lengths"].sum())
    cpu_target = TargetEngine.from_pretrained(tiny_ckpt, capacity=2, max_seq_len=64)
    for kind in ("dspark", "eagle"):
        runs = {dev: run_train(tiny_ckpt, tmp_path / "data", tmp_path / f"{kind}-{dev}", "--kind", kind,
                               "--steps", "3", "--device", dev, "--save-dtype", "float32")
                for dev in ("cpu", "cuda")}
        assert runs["cuda"]["device"] != "cpu"
        first = {dev: run["history"][0]["loss"] for dev, run in runs.items()}
        assert first["cuda"] == pytest.approx(first["cpu"], rel=1e-3)
        drafter = load_drafter(str(tmp_path / f"{kind}-cuda" / "out"), cpu_target, gamma=4)
        drafter.start(0, [5, 6, 7], torch.zeros(3, cpu_target.tap_dim))
        blk = drafter.propose([0], torch.tensor([8]), [SamplingParams(temperature=1.0)], torch.rand(1, 4))
        assert blk.tokens.shape == (1, 4)
