"""`dspark bench-prefill`: a prompt's prefill through our CPU attention kernel against ATen's flash
kernel, on a bf16 target where the kernel serves (an AVX512-BF16 CPU without AMX).

Our kernel (`dspark.runtime.cpu_attention`) attends a prefill's tokens like a verify's: runs of 8
consecutive tokens times a kv head's query heads over the slot's keys in order, no mask. ATen's
flash kernel gets the prefill as one padded block with a causal mask. The two arms differ in the
attention only (and in the RoPE / cache writes fused with it); `flash` sets
`cpu_attention.MAX_NEW_TOKENS` to 64, the cap the engine had before prefills moved to the kernel.
Prompts: the tokens of a CPython standard-library file cut to each `--lengths`, and the held-out
benchmark prompts of `dspark bench` (code, math, chat: their total). The arms alternate in
rounds, starting with the other one each round; ratios are paired per round (median reported).
Writes results/prefill_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from dspark import paths, wiring
from dspark.bench import cpu_name
from dspark.runtime import cpu_attention
from dspark.runtime.text import encode, load_tokenizer

ARMS = {"kernel": None, "flash": 64}  # arm -> cpu_attention.MAX_NEW_TOKENS
SOURCE_FILE = "argparse.py"  # long English-and-code text, on every machine with Python


def add_arguments(p: argparse.ArgumentParser) -> None:
    wiring.add_arguments(p, capacity=1, max_seq_len=2048, dtype="bf16")
    p.add_argument("--lengths", default="64,128,256,512,1024,2000", help="prompt lengths (tokens) to time")
    p.add_argument("--n-prompts", type=int, default=4, help="benchmark prompts per domain (code, math, chat)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="default: results/prefill_<model>.json")


def prefill_ms(target, prompt: list[int]) -> tuple[float, torch.Tensor]:
    """Wall time of one prefill of `prompt` into a fresh slot, and its last-token logits."""
    slot = target.allocate()
    try:
        t0 = time.perf_counter()
        logits, _ = target.prefill([slot], [prompt])
        return 1e3 * (time.perf_counter() - t0), logits[0].float()
    finally:
        target.release(slot)


def main(args: argparse.Namespace) -> int:
    from dspark.bench.e2e import fit_prompts, load_prompts

    spec = replace(wiring.from_args(args), drafter="none", policy="plain")
    target = wiring.load_target(spec, activations=wiring.DTYPES.get(spec.dtype))
    if not getattr(target, "cpu_attention", False):
        raise SystemExit("bench-prefill times our CPU attention kernel, which does not serve this "
                         f"target ({target.dtype} on {target.device}; it needs bf16 on an AVX512-BF16 "
                         "CPU without AMX)")
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if not lengths or max(lengths) > target.max_seq_len or min(lengths) < 1:
        raise SystemExit(f"--lengths {args.lengths}: each in 1..{target.max_seq_len} (--max-seq-len)")
    tok = load_tokenizer(wiring.model_folder(spec.model))
    text = (Path(sysconfig.get_paths()["stdlib"]) / SOURCE_FILE).read_text()
    ids = encode(tok, text)
    if len(ids) < max(lengths):
        raise SystemExit(f"--lengths: {SOURCE_FILE} has {len(ids)} tokens, fewer than {max(lengths)}")
    prompts, source = load_prompts(spec.model_key, ["code", "math", "chat"], args.n_prompts, tok)
    prompts = fit_prompts(prompts, spec, 1)
    cases = {str(n): [ids[:n]] for n in lengths} | {"bench_prompts": prompts}
    times: dict[str, dict[str, list[float]]] = {arm: {c: [] for c in cases} for arm in ARMS}
    last: dict[str, dict[str, torch.Tensor]] = {arm: {} for arm in ARMS}
    default = cpu_attention.MAX_NEW_TOKENS
    arms = list(ARMS)
    try:
        for p in prompts[:2]:  # warm-up (allocator, kernels), both ways
            for cap in ARMS.values():
                cpu_attention.MAX_NEW_TOKENS = cap
                prefill_ms(target, p)
        for rnd in tqdm(range(args.rounds), desc="bench-prefill", unit="round"):
            for arm in arms[rnd % 2:] + arms[:rnd % 2]:
                cpu_attention.MAX_NEW_TOKENS = ARMS[arm]
                for case, ps in cases.items():
                    total = 0.0
                    for i, p in enumerate(ps):
                        ms, logits = prefill_ms(target, p)
                        total += ms
                        last[arm][f"{case}/{i}"] = logits
                    times[arm][case].append(total)
    finally:
        cpu_attention.MAX_NEW_TOKENS = default
    diffs = [float((last["kernel"][k] - last["flash"][k]).abs().max()) for k in last["kernel"]]
    same = [int(last["kernel"][k].argmax()) == int(last["flash"][k].argmax()) for k in last["kernel"]]
    by_case = {c: {"tokens": sum(len(p) for p in ps),
                   **{f"{arm}_ms": statistics.median(times[arm][c]) for arm in ARMS},
                   "speedup": statistics.median(f / k for f, k in zip(times["flash"][c], times["kernel"][c]))}
               for c, ps in cases.items()}
    result = {"model": spec.model, "cpu": cpu_name(), "threads": torch.get_num_threads(),
              "rounds": args.rounds, "text": f"stdlib {SOURCE_FILE}", "bench_prompts": source,
              "arms": {"kernel": "our attention kernel (the default)",
                       "flash": "ATen's flash kernel for requests over 64 new tokens (before)"},
              "by_case": by_case,
              "last_logits_max_abs_diff": max(diffs), "same_next_token": all(same),
              "load_avg_1min": float(Path("/proc/loadavg").read_text().split()[0])}
    out = Path(args.out) if args.out else paths.RESULTS / f"prefill_{spec.model_key or 'model'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'prompt':>13} | tokens | kernel ms | flash ms | flash / kernel")
    for c, row in by_case.items():
        print(f"{c:>13} | {row['tokens']:6d} | {row['kernel_ms']:9.1f} | {row['flash_ms']:8.1f} | "
              f"{row['speedup']:.2f}x")
    print(f"last-token logits: largest difference {max(diffs):.3g}, same next token: {all(same)}")
    print(f"wrote {paths.relative(out)}")
    return 0
