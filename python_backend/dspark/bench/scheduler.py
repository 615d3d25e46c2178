"""`dspark bench-scheduler`: median wall and CPU time of `decide()` per policy on random
survivals (R = 256, γ = 16 by default) -> results/scheduler_bench.json."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from dspark.bench import cpu_name
from dspark.paths import RESULTS
from dspark.runtime.scheduler import make_policy
from dspark.runtime.sps import SPSTable


def bench_decide(num_requests: int = 256, gamma: int = 16, repeats: int = 300, seed: int = 0) -> dict:
    """Median wall time of decide() per policy on random survivals (single thread)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    sps = SPSTable.gpu_shaped()
    conf = torch.rand(repeats, num_requests, gamma, generator=gen) * 0.5 + 0.5
    survival = conf.cumprod(dim=2)
    remaining = torch.randint(1, 512, (repeats, num_requests), generator=gen)
    out = {"num_requests": num_requests, "gamma": gamma, "repeats": repeats,
           "threads": torch.get_num_threads(), "cpu": cpu_name(),
           "load_average_1min": os.getloadavg()[0], "median_ms": {}, "median_cpu_ms": {},
           "note": "median_ms is wall time; median_cpu_ms is this thread's CPU time (robust to other "
                   "processes sharing the cores)"}
    for spec in ("none", "mtp1", "fixed:7", "threshold:0.5", "dspark-theory", "dspark"):
        policy = make_policy(spec, sps=sps, gamma=gamma)
        wall, cpu = [], []
        for i in range(repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            policy.decide(survival[i], remaining[i])
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        out["median_ms"][spec] = statistics.median(wall[10:]) * 1e3
        out["median_cpu_ms"][spec] = statistics.median(cpu[10:]) * 1e3
    # Machine-speed yardstick: one tiny numpy op (x + 1 on R·γ floats); ~1-2 µs on an idle core.
    x = np.zeros(num_requests * gamma, dtype=np.float32)
    ref = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.add(x, 1.0)
        ref.append(time.perf_counter() - t0)
    out["reference_numpy_op_us"] = statistics.median(ref) * 1e6
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--gamma", type=int, default=16)
    p.add_argument("--out", default=str(RESULTS / "scheduler_bench.json"))


def main(args: argparse.Namespace) -> int:
    result = bench_decide(args.requests, args.gamma)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0
