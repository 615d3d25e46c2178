"""`dspark bench-min-rows`: what padding small bf16 matmuls to a few rows does on this CPU.

oneDNN picks its matmul kernel by row count, and on some CPUs its 1- and 2-row kernels are
slower than those for a few rows more, so `dspark.runtime.linear` runs bf16 matmuls of fewer
rows than `BF16_MIN_ROWS` padded to it (zero rows appended; every real row keeps its value).
This bench measures the choice on the model's target at batch 1, for each candidate minimum:
one verify of B = 1..8 tokens on a cached context, and plain decoding's tokens/s on held-out
prompts (our engine, no drafter). Candidates run interleaved in rounds, each round on its own
prompts and starting one candidate later than the round before (drift over a round hits every
candidate alike); ratios are paired per round. Writes results/min_rows_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from dspark import paths, wiring
from dspark.bench import cpu_name
from dspark.runtime import linear
from dspark.runtime.batch import RaggedBatch
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.text import load_tokenizer


def verify_ms(target, tokens: int, context: int, repeats: int) -> float:
    """Median wall time of one verify of `tokens` new tokens after `context` cached ones."""
    slot = target.allocate()
    try:
        target.prefill([slot], [[5 + i % 100 for i in range(context)]])
        times = []
        for _ in range(repeats):
            batch = RaggedBatch.from_requests([slot], [[7] * tokens], [context])
            t0 = time.perf_counter()
            target.verify(batch)
            times.append(time.perf_counter() - t0)
            target.rollback(slot, context)
        return 1e3 * statistics.median(times)
    finally:
        target.release(slot)


def bf16_plain_setup(args: argparse.Namespace, command: str, what: str):
    """The model's target in bf16 on the CPU (else exit naming `command` and `what` it times), a
    plain engine on it and `args.rounds` × `args.prompts_per_round` held-out prompts ->
    (spec, target, engine, prompts, their source)."""
    from dspark.bench.e2e import load_prompts

    spec = replace(wiring.from_args(args), drafter="none", policy="plain")
    target = wiring.load_target(spec, activations=wiring.DTYPES.get(spec.dtype))  # bf16 activations too
    if target.dtype != torch.bfloat16 or target.device.type != "cpu":
        raise SystemExit(f"{command} times {what}; the target is {target.dtype} "
                         f"on {target.device} (pass --dtype bf16 --device cpu)")
    tok = load_tokenizer(wiring.model_folder(spec.model))
    prompts, source = load_prompts(spec.model_key, ["code", "math", "chat"],
                                   args.rounds * args.prompts_per_round, tok)
    return spec, target, wiring.build_engine(spec, target=target, drafter=None), prompts, source


def time_candidates(target, engine, prompts: list[list[int]], candidates: list, use, sizes: list[int],
                    args: argparse.Namespace, desc: str) -> tuple[dict, dict]:
    """Candidates interleaved over `args.rounds` rounds, each round on its own
    `args.prompts_per_round` prompts and starting one candidate later than the round before
    (drift over a round hits every candidate alike): `use(candidate)` switches to it, then one
    verify per size of `sizes` (`verify_ms`, after `args.context` cached tokens, `args.repeats`
    times) and plain decoding of the round's prompts (`engine`, up to `args.max_tokens` each).
    -> ({candidate: {B: [ms per round]}}, {candidate: [tokens/s per round]})."""
    greedy = SamplingParams()
    engine.generate(prompts[:1], 8, greedy)  # warm-up
    verify: dict = {c: {b: [] for b in sizes} for c in candidates}
    decode: dict = {c: [] for c in candidates}
    for rnd in tqdm(range(args.rounds), desc=desc, unit="round"):
        mine = prompts[rnd * args.prompts_per_round:(rnd + 1) * args.prompts_per_round]
        for c in candidates[rnd % len(candidates):] + candidates[:rnd % len(candidates)]:
            use(c)
            for b in sizes:
                verify[c][b].append(verify_ms(target, b, args.context, args.repeats))
            t0, n = time.perf_counter(), 0
            for p in mine:
                n += len(engine.generate([p], args.max_tokens, greedy)[0])
            decode[c].append(n / (time.perf_counter() - t0))
    return verify, decode


def add_arguments(p: argparse.ArgumentParser) -> None:
    wiring.add_arguments(p, capacity=1, max_seq_len=1024, dtype="bf16")
    p.add_argument("--rows", default="1,2,3,4,5", help="candidate minimum row counts")
    p.add_argument("--tokens", default="1,2,3,4,5,6,7,8", help="verify sizes B to time")
    p.add_argument("--context", type=int, default=300, help="cached tokens before a timed verify")
    p.add_argument("--prompts-per-round", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="one per candidate: each leads one round")
    p.add_argument("--repeats", type=int, default=5, help="verifies per size and round")
    p.add_argument("--out", default=None, help="default: results/min_rows_<model>.json")


def main(args: argparse.Namespace) -> int:
    rows = [int(r) for r in args.rows.split(",")]
    sizes = [int(b) for b in args.tokens.split(",")]
    if min(rows) < 1 or min(sizes) < 1:
        raise SystemExit("--rows and --tokens take positive integers")
    spec, target, engine, prompts, source = bf16_plain_setup(args, "bench-min-rows",
                                                             "bf16 matmuls on the CPU")
    default = linear.BF16_MIN_ROWS

    def use(r: int) -> None:
        linear.BF16_MIN_ROWS = r

    try:
        verify, decode = time_candidates(target, engine, prompts, rows, use, sizes, args, "bench-min-rows")
    finally:
        linear.BF16_MIN_ROWS = default
    base = rows[0]
    result = {
        "model": spec.model, "cpu": cpu_name(), "threads": torch.get_num_threads(),
        "default_min_rows_here": default, "prompts": source, "context": args.context,
        "rounds": args.rounds, "prompts_per_round": args.prompts_per_round, "max_tokens": args.max_tokens,
        "load_avg_1min": float(Path("/proc/loadavg").read_text().split()[0]),
        "verify_ms": {str(r): {str(b): statistics.median(v) for b, v in verify[r].items()} for r in rows},
        "plain_tokens_per_s": {str(r): decode[r] for r in rows},
        f"plain_speedup_vs_{base}_rows": {
            str(r): statistics.median(a / b for a, b in zip(decode[r], decode[base])) for r in rows},
    }
    out = Path(args.out) if args.out else paths.RESULTS / f"min_rows_{spec.model_key or 'model'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'min rows':>8} | " + " | ".join(f"B={b}" for b in sizes) + f" | plain tok/s | ÷ {base} rows")
    for r in rows:
        cells = " | ".join(f"{result['verify_ms'][str(r)][str(b)]:.1f}" for b in sizes)
        speed = statistics.median(decode[r])
        print(f"{r:>8} | {cells} | {speed:.1f} | {result[f'plain_speedup_vs_{base}_rows'][str(r)]:.3f}")
    print(f"wrote {paths.relative(out)} (this CPU's default: {default} rows)")
    return 0
