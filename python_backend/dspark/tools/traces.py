"""Drafter traces: what the serving simulator replays (docs/architecture.md §7), and a synthetic generator.

File format (JSONL, one object per line):
  optional first line  {"meta": {"gamma": γ, "temperatures": [T_1..T_γ], "source": "...", ...}}
  then one line per drafted block, in drafting order within each request:
    {"request": <int id>, "conf_logits": [z_1..z_γ], "accepted": n}
  `conf_logits` are the drafter's RAW confidence logits of the block (STS is applied on
  load with meta.temperatures, default all 1); `accepted` is how many leading draft
  tokens the lossless verifier accepted when ALL γ were verified (0..γ).
How to record (the eval / engine side): run the drafter with policy fixed:γ and log, per
request and step, the block's conf_logits and the verifier's accepted count.

Replay rule: with ℓ tokens verified the request gains min(accepted, ℓ) + 1 tokens. This is
exact for the block (coupled uniforms: the accept test of d_j does not depend on ℓ as long
as j ≤ ℓ); later blocks are replayed as recorded, an approximation once ℓ < accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.runtime.scheduler import sts_survival


@dataclass
class TraceSet:
    survival: np.ndarray  # [N, γ] f32, STS survival a[b, j] of every block
    accepted: np.ndarray  # [N] i64, accepted length under full verification
    request_start: np.ndarray  # [M] i64, first block of request m
    request_blocks: np.ndarray  # [M] i64, number of blocks of request m (>= 1)
    source: str = "unknown"

    @property
    def gamma(self) -> int:
        return int(self.survival.shape[1])

    def mean_accepted_length(self) -> float:
        """τ under fixed:γ: accepted + bonus, averaged over blocks."""
        return float(self.accepted.mean() + 1.0)


def _group(conf_logits: np.ndarray, accepted: np.ndarray, request_ids: np.ndarray,
           temperatures: np.ndarray, source: str) -> TraceSet:
    order = np.argsort(request_ids, kind="stable")  # keep drafting order within a request
    ids = request_ids[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    counts = np.diff(np.r_[starts, len(ids)])
    survival = sts_survival(torch.from_numpy(conf_logits[order]).float(),
                            torch.from_numpy(temperatures).float())
    return TraceSet(survival.numpy(), accepted[order].astype(np.int64), starts.astype(np.int64),
                    counts.astype(np.int64), source)


def save_traces(path: str | Path, conf_logits: np.ndarray, accepted: np.ndarray, request_ids: np.ndarray,
                meta: dict | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        if meta:
            f.write(json.dumps({"meta": meta}) + "\n")
        for rid, z, n in zip(request_ids.tolist(), conf_logits.tolist(), accepted.tolist()):
            row = {"request": rid, "conf_logits": [round(v, 5) for v in z], "accepted": n}
            f.write(json.dumps(row) + "\n")


def load_traces(path: str | Path) -> TraceSet:
    meta, logits, accepted, ids = {}, [], [], []
    with Path(path).open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "meta" in row:
                meta = row["meta"]
                continue
            try:
                logits.append(row["conf_logits"])
                accepted.append(int(row["accepted"]))
                ids.append(int(row.get("request", 0)))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{line_no}: bad trace line ({e})") from e
    if not logits:
        raise ValueError(f"{path}: no trace blocks")
    conf = np.asarray(logits, dtype=np.float32)
    gamma = conf.shape[1]
    acc = np.asarray(accepted, dtype=np.int64)
    if acc.min() < 0 or acc.max() > gamma:
        raise ValueError(f"{path}: accepted must be in [0, {gamma}]")
    temps = np.asarray(meta.get("temperatures", [1.0] * gamma), dtype=np.float32)
    return _group(conf, acc, np.asarray(ids, dtype=np.int64), temps, str(meta.get("source", path)))


def synthetic_traces(num_requests: int = 512, blocks_per_request: int = 64, gamma: int = 7, seed: int = 0,
                     domain_logits: tuple[float, ...] = (3.0, 2.2, 1.2), request_sd: float = 0.6,
                     block_sd: float = 1.0, position_decay: float = 0.25, token_sd: float = 0.5,
                     conf_noise_sd: float = 0.6) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Synthetic blocks with per-position decay -> (conf_logits [N,γ], accepted [N], request_ids [N], meta).

    Conditional acceptance of position k in a block: p = σ(μ_domain + u_request + v_block
    − decay·(k−1) + e_k) (domains ≈ math / code / chat, easiest first). The realised
    accepted length is the first failure of Bernoulli(p_k) draws; the confidence head sees
    logit(p_k) plus noise, i.e. it is informative but imperfect and roughly calibrated."""
    rng = np.random.default_rng(seed)
    domain = rng.integers(0, len(domain_logits), num_requests)
    base = np.asarray(domain_logits)[domain] + rng.normal(0, request_sd, num_requests)
    n = num_requests * blocks_per_request
    request_ids = np.repeat(np.arange(num_requests), blocks_per_request)
    true_logit = (base[request_ids, None] + rng.normal(0, block_sd, (n, 1))
                  - position_decay * np.arange(gamma) + rng.normal(0, token_sd, (n, gamma)))
    accept = rng.random((n, gamma)) < 1.0 / (1.0 + np.exp(-true_logit))
    accepted = np.logical_and.accumulate(accept, axis=1).sum(1)
    conf_logits = (true_logit + rng.normal(0, conf_noise_sd, (n, gamma))).astype(np.float32)
    meta = {"gamma": gamma, "temperatures": [1.0] * gamma, "source": f"synthetic(seed={seed})",
            "domain_logits": list(domain_logits), "position_decay": position_decay}
    return conf_logits, accepted.astype(np.int64), request_ids, meta


def synthetic_trace_set(**kw) -> TraceSet:
    conf, acc, ids, meta = synthetic_traces(**kw)
    return _group(conf, acc, ids, np.asarray(meta["temperatures"], dtype=np.float32), meta["source"])
