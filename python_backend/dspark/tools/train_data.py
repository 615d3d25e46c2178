"""Drafter training data (docs/architecture.md §8): prompts cut from the demo corpus train split by
domain, continuations sampled from the target (T 0.7, top-p 0.8, top-k 20; a `t1_share` of
them at plain T = 1), stored as token shards with a loss mask (True on generated tokens),
plus the target features every drafter
trains on: the taps [T, tap_dim] and the final-normed hidden state [T, d] of each token
(target logits are lm_head(hidden), recomputed per batch: cheaper than storing [T, V]).

Layout of a data folder:
    shard_000.pt      {"tokens": i64 [N, T] (pad-filled), "loss_mask": bool [N, T], "domain": i64 [N]}
    features.pt       {"taps": f16 [N, T, tap_dim], "hidden": f16 [N, T, d], "tap_layers": [...]}
    meta.json         how it was made (target, sampling, counts, seconds)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark.runtime.engine import SpecEngine
from dspark.runtime.sampling import SamplingParams

DOMAINS = ("code", "prose", "math")
DATA_SAMPLING = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
# The share of prompts continued at plain T = 1 instead (`--t1-share`): our evaluation and most
# sampled serving run at T = 1, and a 10M target's T = 1 text is far noisier than its T = 0.7
# text, so drafters (and their confidence heads) trained on T = 0.7 text alone meet contexts
# at T = 1 that they never saw.  0 keeps docs/architecture.md §8's recipe exactly.
T1_SAMPLING = SamplingParams(temperature=1.0)


def hot_rows(n: int, share: float) -> list[bool]:
    """Which of n prompts are continued at T = 1: an evenly spread `share` of them (prompts come
    grouped by domain, so every domain gets the same share)."""
    return [int((i + 1) * share) > int(i * share) for i in range(n)]


def corpus_prompts(token_dir: Path, n_per_domain: int, min_len: int, max_len: int, seed: int,
                   domains: tuple[str, ...] = DOMAINS) -> tuple[list[list[int]], list[int]]:
    """Random windows of [min_len, max_len] tokens from each `{domain}.train.bin` (uint16 stream
    written by build/demo/tokenizer.py) -> (prompts, domain index per prompt)."""
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


def generate_sequences(target, prompts: list[list[int]], max_new: int, seed: int, batch: int = 32,
                       pad_id: int = 1, t1_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample a continuation of each prompt from the target -> tokens [N, T] i64 (pad-filled),
    loss_mask [N, T] bool (True on generated tokens, the stop token included)."""
    seqs, masks = [], []
    hot = hot_rows(len(prompts), t1_share)
    for lo in tqdm(range(0, len(prompts), batch), desc="generate", unit="batch"):
        chunk = prompts[lo:lo + batch]
        params = []
        for i in range(len(chunk)):
            sp = T1_SAMPLING if hot[lo + i] else DATA_SAMPLING
            params.append(SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed=seed * 1_000_003 + lo + i))
        outs = SpecEngine(target).generate(chunk, max_new, params)
        for p, o in zip(chunk, outs):
            seqs.append(p + o)
            masks.append([False] * len(p) + [True] * len(o))
    t = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), t), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        tokens[i, :len(s)] = torch.tensor(s)
        loss_mask[i, :len(m)] = torch.tensor(m)
    return tokens, loss_mask


@torch.no_grad()
def compute_features(model, tokens: torch.Tensor, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Target taps [N, T, tap_dim] and final-normed hidden [N, T, d] (f16) from the plain causal
    forward (`Transformer.forward_hidden`); rows past a sequence's end are ignored downstream."""
    taps, hidden = [], []
    for lo in range(0, tokens.shape[0], batch):
        h, tp = model.forward_hidden(tokens[lo:lo + batch])
        taps.append(tp.to(torch.float16))
        hidden.append(h.to(torch.float16))
    return torch.cat(taps), torch.cat(hidden)


def make_data(target, token_dir: Path, out_dir: Path, n_per_domain: int, max_new: int, min_prompt: int,
              max_prompt: int, seed: int = 0, batch: int = 32, t1_share: float = 0.0) -> dict:
    """Generate, featurise and store one data folder; returns its meta dict."""
    if not 0.0 <= t1_share <= 1.0:
        raise ValueError(f"t1_share must be in [0, 1], got {t1_share}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    prompts, dom = corpus_prompts(Path(token_dir), n_per_domain, min_prompt, max_prompt, seed)
    pad_id = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    tokens, loss_mask = generate_sequences(target, prompts, max_new, seed, batch, pad_id, t1_share)
    t_gen = time.time() - t0
    taps, hidden = compute_features(target.model, tokens)
    torch.save({"tokens": tokens, "loss_mask": loss_mask, "domain": torch.tensor(dom)},
               out_dir / "shard_000.pt")
    torch.save({"taps": taps, "hidden": hidden, "tap_layers": list(target.tap_layers)},
               out_dir / "features.pt")
    meta = {"sequences": len(prompts), "domains": list(DOMAINS), "n_per_domain": n_per_domain,
            "max_len": int(tokens.shape[1]), "generated_tokens": int(loss_mask.sum()),
            "prompt_tokens": [min_prompt, max_prompt], "max_new": max_new,
            "sampling": {"temperature": DATA_SAMPLING.temperature, "top_k": DATA_SAMPLING.top_k,
                         "top_p": DATA_SAMPLING.top_p},
            "t1_share": t1_share, "t1_sequences": sum(hot_rows(len(prompts), t1_share)), "seed": seed,
            "tap_layers": list(target.tap_layers),
            "generate_seconds": round(t_gen, 1), "total_seconds": round(time.time() - t0, 1)}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_data(data_dir: Path, target_model=None) -> dict[str, torch.Tensor]:
    """All shards concatenated + features (computed with `target_model` if not stored)."""
    data_dir = Path(data_dir)
    shards = [torch.load(p, weights_only=True) for p in sorted(data_dir.glob("shard_*.pt"))]
    if not shards:
        raise FileNotFoundError(f"no shard_*.pt in {data_dir} (make it with `dspark train --make-data`)")
    t = max(s["tokens"].shape[1] for s in shards)
    pad = lambda x, v: torch.nn.functional.pad(x, (0, t - x.shape[1]), value=v)
    data = {"tokens": torch.cat([pad(s["tokens"], 0) for s in shards]),
            "loss_mask": torch.cat([pad(s["loss_mask"], False) for s in shards])}
    feat_path = data_dir / "features.pt"
    if feat_path.is_file():
        feats = torch.load(feat_path, weights_only=True)
        data["taps"], data["hidden"] = feats["taps"], feats["hidden"]
        data["tap_layers"] = feats.get("tap_layers")
    elif target_model is not None:
        data["taps"], data["hidden"] = compute_features(target_model, data["tokens"])
        data["tap_layers"] = list(target_model.tap_layers)
    else:
        raise FileNotFoundError(f"{feat_path} missing and no target to compute features with")
    return data
