"""Drafter traces: THE block-trace format (recorded by `dspark eval` / `dspark calibrate`, fitted
by STS, replayed by the serving simulator, docs/architecture.md §7), and a synthetic generator.

File format (JSONL, one object per line):
  optional first line  {"meta": {"gamma": γ, "temperatures": [T_1..T_γ], "source": "...", ...}}
  then one line per drafted block, in drafting order within each request:
    {"request": <int id>, "conf_logits": [z_1..z_γ], "accepted": n, "verified": ℓ}
  `conf_logits` are the drafter's RAW confidence logits of the block (STS is applied on
  load with meta.temperatures, default all 1); `accepted` is how many leading draft tokens
  the lossless verifier accepted (0..ℓ); `verified` is how many drafts the target verified
  (ℓ ≤ γ; omitted = γ, e.g. fixed:γ away from the end of a request).
In memory: `BlockTrace` (every block, for calibration and acceptance statistics) and
`TraceSet` (the simulator's view: STS survival of the fully verified blocks, per request).
How to record (the eval / engine side): run the drafter with policy fixed:γ and log, per
request and step, the block's conf_logits and the verifier's accepted / verified counts.

Replay rule: with ℓ tokens verified the request gains min(accepted, ℓ) + 1 tokens. This is
exact for the block (coupled uniforms: the accept test of d_j does not depend on ℓ as long
as j ≤ ℓ); later blocks are replayed as recorded, an approximation once ℓ < accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dspark.runtime.scheduler import sts_survival


@dataclass
class BlockTrace:
    """Per drafted block (one verify step of one request) at fixed γ."""

    conf_logits: np.ndarray  # [N, γ] f64, confidence logits z_k
    n_accepted: np.ndarray  # [N] i64, accepted draft tokens (prefix survival)
    n_verified: np.ndarray  # [N] i64, draft tokens the target verified (γ unless capped near the end)
    request_ids: np.ndarray | None = None  # [N] i64, the request each block belongs to
    meta: dict = field(default_factory=dict)

    @property
    def gamma(self) -> int:
        return int(self.conf_logits.shape[1])

    def __len__(self) -> int:
        return int(self.conf_logits.shape[0])

    @classmethod
    def from_rows(cls, rows: list[dict], meta: dict | None = None) -> BlockTrace:
        """Block rows {"conf_logits": [γ], "accepted" | "n_accepted": n, "verified" | "n_verified": ℓ,
        "request": id} (all the same γ; ℓ defaults to γ). ValueError on an empty trace."""
        if not rows:
            raise ValueError("empty trace")
        z = np.asarray([r["conf_logits"] for r in rows], dtype=np.float64)
        n = np.asarray([r.get("accepted", r.get("n_accepted")) for r in rows], dtype=np.int64)
        ell = np.asarray([r.get("verified", r.get("n_verified", z.shape[1])) for r in rows], dtype=np.int64)
        ids = np.asarray([r.get("request", 0) for r in rows], dtype=np.int64)
        return cls(z, n, ell, ids, dict(meta or {}))

    def save(self, path: str | Path, meta: dict | None = None) -> Path:
        """Write the trace in the file format above (meta: merged over self.meta)."""
        ids = self.request_ids if self.request_ids is not None else np.zeros(len(self), dtype=np.int64)
        return save_traces(path, self.conf_logits, self.n_accepted, ids, {**self.meta, **(meta or {})},
                           verified=self.n_verified)

    def full(self) -> BlockTrace:
        """The blocks whose γ drafts were all verified (what the simulator can replay)."""
        keep = self.n_verified == self.gamma
        ids = None if self.request_ids is None else self.request_ids[keep]
        return BlockTrace(self.conf_logits[keep], self.n_accepted[keep], self.n_verified[keep], ids,
                          self.meta)


def read_block_trace(path: str | Path) -> BlockTrace:
    """Every block of a trace file (the format above). Also reads request rows
    {"blocks": [...]} (`dspark eval`'s runs files). ValueError names a bad line."""
    meta, rows, request = {}, [], 0
    with Path(path).open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "meta" in row:
                meta = row["meta"]
                continue
            blocks = [dict(b, request=request) for b in row["blocks"]] if "blocks" in row else [row]
            request += "blocks" in row
            for b in blocks:
                if "conf_logits" not in b or ("accepted" not in b and "n_accepted" not in b):
                    raise ValueError(f"{path}:{line_no}: bad trace line (needs conf_logits and accepted)")
            rows += blocks
    if not rows:
        raise ValueError(f"{path}: no trace blocks")
    trace = BlockTrace.from_rows(rows, meta)
    if trace.n_accepted.min() < 0 or (trace.n_accepted > trace.n_verified).any() or \
            trace.n_verified.max() > trace.gamma:
        raise ValueError(f"{path}: accepted must be in [0, verified] and verified in [0, {trace.gamma}]")
    return trace


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
                meta: dict | None = None, verified: np.ndarray | None = None) -> Path:
    """Write blocks in the trace format (verified omitted where it equals γ)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    gamma = int(np.asarray(conf_logits).shape[1])
    ver = np.full(len(accepted), gamma) if verified is None else np.asarray(verified)
    with path.open("w") as f:
        if meta:
            f.write(json.dumps({"meta": meta}) + "\n")
        for rid, z, n, ell in zip(np.asarray(request_ids).tolist(), np.asarray(conf_logits).tolist(),
                                  np.asarray(accepted).tolist(), ver.tolist()):
            row = {"request": rid, "conf_logits": [round(v, 5) for v in z], "accepted": n}
            if ell != gamma:
                row["verified"] = ell
            f.write(json.dumps(row) + "\n")
    return path


def load_traces(path: str | Path) -> TraceSet:
    """The simulator's view of a trace file: the fully verified blocks, STS applied with the
    file's meta.temperatures (default 1)."""
    if not Path(path).is_file():  # traces are not in git: regenerate them
        raise FileNotFoundError(f"no trace file {path}: `dspark eval` writes results/traces/<drafter>.jsonl")
    trace = read_block_trace(path).full()
    if not len(trace):
        raise ValueError(f"{path}: no fully verified blocks to replay")
    temps = np.asarray(trace.meta.get("temperatures", [1.0] * trace.gamma), dtype=np.float32)
    return _group(trace.conf_logits.astype(np.float32), trace.n_accepted, trace.request_ids, temps,
                  str(trace.meta.get("source", path)))


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
