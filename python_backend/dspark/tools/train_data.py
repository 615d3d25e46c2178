"""Drafter training data (docs/architecture.md §8): the target's own continuations of
prompts, stored as token shards with a loss mask, plus the target features every drafter
trains on.

Prompts: for SmolLM2 the train split of the prompt corpus (`dspark corpus`, chat-formatted,
balanced per domain); for the demo target random windows of its corpus token streams.
Sampling: T 0.7 / top-k 20 / top-p 0.8 (the recipe), with a `t1_share` of the prompts at
plain T = 1 (our evaluation and most sampled serving run at T = 1) and a `greedy_share` at
T = 0 (the greedy text the T = 0 evaluation meets); shares are spread evenly over each domain.
Generation is batched on our engine (plain decoding through `SpecEngine`, continuous
batching over the target's slots), chunk by chunk: a chunk's shard is written when it is
done and skipped on a rerun, so an interrupted run resumes where it stopped.

Features are CACHED, not recomputed during training: one causal forward of the target over
each finished sequence gives the taps [L, tap_dim] and the final-normed hidden state [L, d]
of every token (stored in the target's dtype; target logits = lm_head(hidden) are
recomputed per batch, cheaper than storing [L, V]). Cost: (tap_dim + d) · 2 bytes per token
(4.6 KB for SmolLM2, about 2 GB for 450k tokens) and one prefill-shaped pass over the data
(a few minutes); recomputing them would cost a 30-layer target forward per training step.

Layout of a data folder:
    shard_0000.pt   {"tokens": i64 [Ntok] (sequences back to back), "offsets": i64 [n+1],
                     "prompt_len": i64 [n], "domain": i64 [n], "mode": i64 [n] (MODES index),
                     "index": i64 [n] (prompt index in the run)}
    feat_0000.pt    {"taps": [Ntok, tap_dim], "hidden": [Ntok, d]} (same rows as tokens)
    meta.json       how it was made (target, prompts, sampling, counts, seconds)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark.runtime.engine import SpecEngine
from dspark.runtime.sampling import SamplingParams

DOMAINS = ("code", "prose", "math")  # the demo corpus' domains (SmolLM2: corpus.DOMAINS)
MODES = ("recipe", "t1", "greedy")
DATA_SAMPLING = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
T1_SAMPLING = SamplingParams(temperature=1.0)
GREEDY_SAMPLING = SamplingParams(temperature=0.0)
MODE_SAMPLING = {0: DATA_SAMPLING, 1: T1_SAMPLING, 2: GREEDY_SAMPLING}


def hot_rows(n: int, share: float) -> list[bool]:
    """Which of n prompts get a special mode: an evenly spread `share` of them."""
    return [int((i + 1) * share) > int(i * share) for i in range(n)]


def assign_modes(domains: list[int], t1_share: float, greedy_share: float) -> list[int]:
    """Per prompt its MODES index; within each domain an evenly spread t1_share of the
    prompts is T = 1, then greedy_share of the rest is greedy."""
    for name, v in (("t1_share", t1_share), ("greedy_share", greedy_share)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v}")
    if t1_share + greedy_share > 1.0:
        raise ValueError(f"t1_share + greedy_share must be <= 1, got {t1_share + greedy_share}")
    modes = [0] * len(domains)
    for d in sorted(set(domains)):
        rows = [i for i, x in enumerate(domains) if x == d]
        rest = []
        for i, hot in zip(rows, hot_rows(len(rows), t1_share)):
            if hot:
                modes[i] = 1
            else:
                rest.append(i)
        g = greedy_share / (1.0 - t1_share) if t1_share < 1.0 else 0.0
        for i, hot in zip(rest, hot_rows(len(rest), min(1.0, g))):
            modes[i] = 2 if hot else 0
    return modes


def corpus_prompts(token_dir: Path, n_per_domain: int, min_len: int, max_len: int, seed: int,
                   domains: tuple[str, ...] = DOMAINS) -> tuple[list[list[int]], list[int]]:
    """Demo target: random windows of [min_len, max_len] tokens from each `{domain}.train.bin`
    (uint16 stream written by build/demo/tokenizer.py) -> (prompts, domain index per prompt)."""
    rng = np.random.default_rng(seed)
    prompts, dom = [], []
    for d_i, d in enumerate(domains):
        stream = np.fromfile(Path(token_dir) / f"{d}.train.bin", dtype=np.uint16)
        for _ in range(n_per_domain):
            n = int(rng.integers(min_len, max_len + 1))
            s = int(rng.integers(0, stream.size - n))
            prompts.append(stream[s:s + n].astype(np.int64).tolist())
            dom.append(d_i)
    return prompts, dom


def chat_prompts(corpus_file: Path, tokenizer, n_per_domain: int, domains: tuple[str, ...],
                 offset: int = 0, order_seed: int = 0) -> tuple[list[list[int]], list[int], list[str]]:
    """SmolLM2: prompts offset..offset+n_per_domain of each domain of a corpus split file in
    a fixed shuffled order (so a second data folder with offset = the first one's n gets new
    prompts) -> (token ids, domain index, corpus ids)."""
    from dspark.runtime.text import encode

    rows = [json.loads(line) for line in open(corpus_file, encoding="utf-8") if line.strip()]
    prompts, dom, ids = [], [], []
    for d_i, d in enumerate(domains):
        pool = [r for r in rows if r["domain"] == d]
        if len(pool) < offset + n_per_domain:
            raise ValueError(f"{corpus_file}: {len(pool)} {d} prompts, fewer than offset + n_per_domain = "
                             f"{offset + n_per_domain}")
        for j in np.random.default_rng(order_seed).permutation(len(pool))[offset:offset + n_per_domain]:
            prompts.append(encode(tokenizer, pool[j]["prompt"]))
            dom.append(d_i)
            ids.append(pool[j]["id"])
    return prompts, dom, ids


def _params(mode: int, seed: int, index: int) -> SamplingParams:
    sp = MODE_SAMPLING[mode]
    return SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed=seed * 1_000_003 + index)


def generate_chunk(target, prompts: list[list[int]], modes: list[int], first_index: int, max_new: int,
                   seed: int, bar=None) -> list[list[int]]:
    """Continuations of a chunk of prompts, continuous batching over the target's slots
    (plain decoding: the engine with no drafter). Stop tokens are kept."""
    engine = SpecEngine(target)
    reqs = [engine.add_request(p, max_new, _params(m, seed, first_index + i))
            for i, (p, m) in enumerate(zip(prompts, modes))]
    done = 0
    while engine.has_work():
        engine.step()
        now = sum(r.finished for r in reqs)
        if bar is not None and now > done:
            bar.update(now - done)
            bar.set_postfix(tokens=bar.tokens + sum(len(r.output) for r in reqs if r.finished))
        done = now
    if bar is not None:
        bar.tokens += sum(len(r.output) for r in reqs)
    return [r.output for r in reqs]


@torch.no_grad()
def sequence_features(model, seqs: list[torch.Tensor],
                      max_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Target taps [Ntok, tap_dim] and final-normed hidden [Ntok, d] of sequences laid back
    to back, from the plain causal forward (`Transformer.forward_hidden`) over right-padded
    batches of similar length (padding after a sequence never changes its rows)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    taps: list[torch.Tensor | None] = [None] * len(seqs)
    hidden: list[torch.Tensor | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        t = len(seqs[order[i]])
        j = i + 1
        while j < len(order) and len(seqs[order[j]]) * (j + 1 - i) <= max_tokens:
            j += 1
        group = order[i:j]
        t = max(len(seqs[k]) for k in group)
        batch = torch.zeros(len(group), t, dtype=torch.int64)
        for r, k in enumerate(group):
            batch[r, :len(seqs[k])] = seqs[k]
        h, tp = model.forward_hidden(batch.to(model.embed_tokens.weight.device))
        for r, k in enumerate(group):
            n = len(seqs[k])
            taps[k], hidden[k] = tp[r, :n].to("cpu", copy=True), h[r, :n].to("cpu", copy=True)
        i = j
    return torch.cat(taps), torch.cat(hidden)  # type: ignore[arg-type]


def make_data(target, prompts: list[list[int]], domains: list[int], out_dir: Path, max_new: int,
              seed: int = 0, chunk: int = 64, t1_share: float = 0.0, greedy_share: float = 0.0,
              extra_meta: dict | None = None, feature_dtype: torch.dtype | None = None) -> dict:
    """Generate (resumably, shard per chunk), featurise and describe one data folder."""
    modes = assign_modes(domains, t1_share, greedy_share)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, c0 = time.time(), time.process_time()
    n_chunks = (len(prompts) + chunk - 1) // chunk
    with tqdm(total=len(prompts), desc="generate", unit="seq") as bar:
        bar.tokens = 0
        for c in range(n_chunks):
            path = out_dir / f"shard_{c:04d}.pt"
            lo, hi = c * chunk, min(len(prompts), (c + 1) * chunk)
            if path.is_file():
                bar.update(hi - lo)
                continue
            outs = generate_chunk(target, prompts[lo:hi], modes[lo:hi], lo, max_new, seed, bar)
            seqs = [p + o for p, o in zip(prompts[lo:hi], outs)]
            shard = {"tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int64),
                     "offsets": torch.tensor(np.cumsum([0] + [len(s) for s in seqs]), dtype=torch.int64),
                     "prompt_len": torch.tensor([len(p) for p in prompts[lo:hi]]),
                     "domain": torch.tensor(domains[lo:hi]), "mode": torch.tensor(modes[lo:hi]),
                     "index": torch.arange(lo, hi)}
            torch.save(shard, path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
    t_gen = time.time() - t0
    dtype = feature_dtype or next(target.model.parameters()).dtype
    featurise(target.model, out_dir, dtype)
    data = load_data(out_dir, features=False)
    gen = data["loss_mask"].sum(1)
    meta = {"sequences": len(prompts), "max_new": max_new, "max_len": int(data["tokens"].shape[1]),
            "generated_tokens": int(gen.sum()), "prompt_tokens": int(sum(len(p) for p in prompts)),
            "sampling": {"recipe": vars(DATA_SAMPLING) | {"seed": None}, "t1": {"temperature": 1.0},
                         "greedy": {"temperature": 0.0}},
            "t1_share": t1_share, "greedy_share": greedy_share,
            "sequences_by_mode": {m: modes.count(i) for i, m in enumerate(MODES)},
            "generated_by_mode": {m: int(gen[data["mode"] == i].sum()) for i, m in enumerate(MODES)},
            "stopped_before_max_new": int((gen < max_new).sum()),
            "seed": seed, "chunk": chunk, "tap_layers": list(target.tap_layers),
            "feature_dtype": str(dtype).removeprefix("torch."),
            "generate_seconds": round(t_gen, 1), "total_seconds": round(time.time() - t0, 1),
            "cpu_seconds_this_run": round(time.process_time() - c0, 1),
            **(extra_meta or {})}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def featurise(model, data_dir: Path, dtype: torch.dtype) -> None:
    """Write the missing feat_NNNN.pt of a data folder's shards: taps and hidden in `dtype`,
    from `model` wherever it lives (a GPU does SmolLM2's 540k tokens in seconds)."""
    data_dir = Path(data_dir)
    for path in tqdm(sorted(data_dir.glob("shard_*.pt")), desc="features", unit="shard"):
        feat = path.with_name(path.name.replace("shard_", "feat_"))
        if feat.is_file():
            continue
        shard = torch.load(path, weights_only=True)
        seqs = list(shard["tokens"].split(torch.diff(shard["offsets"]).tolist()))
        taps, hidden = sequence_features(model, seqs)
        torch.save({"taps": taps.to(dtype), "hidden": hidden.to(dtype)}, feat.with_suffix(".tmp"))
        feat.with_suffix(".tmp").replace(feat)


def load_data(data_dir: Path, features: bool = True) -> dict:
    """All shards of a data folder: "tokens" i64 [N, T] (0-padded), "loss_mask" bool [N, T]
    (True on generated tokens, the stop token included), "domain" / "mode" [N], and with
    `features` the flat "taps" [Ntok, tap_dim] / "hidden" [Ntok, d] whose rows
    offsets[i]..offsets[i+1] belong to sequence i (see `batch_features`)."""
    data_dir = Path(data_dir)
    paths = sorted(data_dir.glob("shard_*.pt"))
    if not paths:
        raise FileNotFoundError(f"no shard_*.pt in {data_dir} (make it with `dspark train --make-data`)")
    shards = [torch.load(p, weights_only=True) for p in paths]
    lens = torch.cat([torch.diff(s["offsets"]) for s in shards])
    plen = torch.cat([s["prompt_len"] for s in shards])
    t = int(lens.max())
    tokens = torch.zeros(len(lens), t, dtype=torch.int64)
    flat = torch.cat([s["tokens"] for s in shards])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    pos = torch.arange(t)
    valid = pos[None, :] < lens[:, None]
    tokens[valid] = flat
    data = {"tokens": tokens, "loss_mask": valid & (pos[None, :] >= plen[:, None]), "offsets": offsets,
            "lengths": lens, "domain": torch.cat([s["domain"] for s in shards]),
            "mode": torch.cat([s["mode"] for s in shards])}
    if features:
        feats = []
        for p in paths:
            f = p.with_name(p.name.replace("shard_", "feat_"))
            if not f.is_file():
                raise FileNotFoundError(f"{f} missing: rerun `dspark train --make-data` to featurise")
            feats.append(torch.load(f, weights_only=True, mmap=True))
        data["taps"] = torch.cat([f["taps"] for f in feats])
        data["hidden"] = torch.cat([f["hidden"] for f in feats])
    meta = data_dir / "meta.json"
    data["tap_layers"] = json.loads(meta.read_text()).get("tap_layers") if meta.is_file() else None
    return data


def load_data_many(data_dirs: list[Path], features: bool = True) -> dict:
    """Several data folders as one (same target and taps): sequences concatenated."""
    parts = [load_data(d, features) for d in data_dirs]
    if len(parts) == 1:
        return parts[0]
    taps = {tuple(p["tap_layers"] or ()) for p in parts}
    if len(taps) > 1:
        raise ValueError(f"data folders {data_dirs} were made with different tap layers {taps}")
    t = max(p["tokens"].shape[1] for p in parts)
    pad = lambda x, v: torch.nn.functional.pad(x, (0, t - x.shape[1]), value=v)  # noqa: E731
    lens = torch.cat([p["lengths"] for p in parts])
    out = {"tokens": torch.cat([pad(p["tokens"], 0) for p in parts]),
           "loss_mask": torch.cat([pad(p["loss_mask"], False) for p in parts]),
           "lengths": lens, "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
           "domain": torch.cat([p["domain"] for p in parts]), "mode": torch.cat([p["mode"] for p in parts]),
           "tap_layers": parts[0]["tap_layers"]}
    if features:
        out["taps"] = torch.cat([p["taps"] for p in parts])
        out["hidden"] = torch.cat([p["hidden"] for p in parts])
    return out


def batch_features(data: dict, ids: torch.Tensor, t_max: int,
                   taps: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Padded float32 taps [B, t_max, tap_dim] (None when not `taps`) and hidden [B, t_max, d]
    of sequences `ids` (rows past a sequence's end are zero)."""
    b, dev = ids.numel(), data["hidden"].device  # the features' device (cuda when training there)
    out_t = torch.zeros(b, t_max, data["taps"].shape[1], device=dev) if taps else None
    out_h = torch.zeros(b, t_max, data["hidden"].shape[1], device=dev)
    for r, i in enumerate(ids.tolist()):
        lo = int(data["offsets"][i])
        n = min(t_max, int(data["lengths"][i]))
        if out_t is not None:
            out_t[r, :n] = data["taps"][lo:lo + n].float()
        out_h[r, :n] = data["hidden"][lo:lo + n].float()
    return out_t, out_h
