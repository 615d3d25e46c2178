"""`dspark bench-glue`: the target forward's glue kernels against torch's ops on a bf16 CPU.

Between its matmuls a decoder layer runs small ops: the residual adds, the RMSNorms, RoPE and the
K/V cache writes. `dspark.runtime.cpu_norm.add_rms_norm` (each residual add with the norm after
it) and `dspark.runtime.cpu_attention.rope_write_kv` (RoPE with the cache writes) run them as one
C call each where torch runs ~8 and ~7 ATen ops. And the attention kernel
(`dspark.runtime.cpu_attention`) runs a request's tokens and a kv head's query heads through each
block of keys together; `ungrouped` runs each query alone (the same bits). And the bf16 matmul
kernel prefetches weights where the hardware prefetcher falls behind
(kernels/cpu/bf16_dot_gemm.c); `no-prefetch` runs its build without (the same bits). This times
the ways on the model's target: one verify of B new tokens after `--context` cached ones
(`min_rows.verify_ms`), and plain decoding's tokens/s on held-out prompts (our engine, no
drafter). They run interleaved in rounds (`min_rows.time_candidates`); ratios are paired per
round. Writes results/cpu_glue_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dspark import paths, wiring
from dspark.bench import cpu_name
from dspark.bench.min_rows import bf16_plain_setup, time_candidates
from dspark.runtime import cpu_attention, cpu_gemm, cpu_norm

# torch: the glue in torch's ops; kernels: everything ours (the default); ungrouped: the
# attention kernel's queries one at a time; no-prefetch: the bf16 matmuls without their prefetch
WAYS = ("torch", "kernels", "ungrouped", "no-prefetch")


def dot_projections(model: torch.nn.Module) -> list[cpu_gemm.DotBf16Linear]:
    """The model's projections served by the bf16 dot kernel (plain objects held by its modules)."""
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, cpu_gemm.DotBf16Linear)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    wiring.add_arguments(p, capacity=1, max_seq_len=1024, dtype="bf16")
    p.add_argument("--tokens", default="1,2,4,6,8", help="verify sizes B to time")
    p.add_argument("--context", type=int, default=400, help="cached tokens before a timed verify")
    p.add_argument("--prompts-per-round", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=15, help="verifies per size and round")
    p.add_argument("--out", default=None, help="default: results/cpu_glue_<model>.json")


def main(args: argparse.Namespace) -> int:
    if cpu_norm.library() is None:
        raise SystemExit("bench-glue: the glue kernels cannot run here (no AVX512, or no C compiler)")
    sizes = [int(b) for b in args.tokens.split(",")]
    spec, target, engine, prompts, source = bf16_plain_setup(args, "bench-glue", "the bf16 CPU glue kernels")
    default = cpu_norm.USE, cpu_attention.GROUPED
    projections = dot_projections(target.model)
    libs = {"kernels": cpu_gemm.dot_library(), "no-prefetch": cpu_gemm.dot_library(("BF16_DOT_NO_PREFETCH",))}
    ways = [w for w in WAYS if w != "no-prefetch" or (projections and libs["no-prefetch"] is not None)]

    def use(way: str) -> None:
        cpu_norm.USE = way != "torch"
        cpu_attention.GROUPED = way != "ungrouped"
        for proj in projections:
            proj.lib = libs.get(way, libs["kernels"])

    try:
        verify, decode = time_candidates(target, engine, prompts, ways, use, sizes, args, "bench-glue")
    finally:
        use("kernels")
        cpu_norm.USE, cpu_attention.GROUPED = default

    def saved(slow: str) -> dict:
        return {str(b): statistics.median(t - k for t, k in zip(verify[slow][b], verify["kernels"][b]))
                for b in sizes}

    def speedup(slow: str) -> float:
        return statistics.median(k / t for k, t in zip(decode["kernels"], decode[slow]))

    result = {
        "model": spec.model, "cpu": cpu_name(), "threads": torch.get_num_threads(), "prompts": source,
        "context": args.context, "rounds": args.rounds, "prompts_per_round": args.prompts_per_round,
        "max_tokens": args.max_tokens, "load_avg_1min": float(Path("/proc/loadavg").read_text().split()[0]),
        "verify_ms": {w: {str(b): statistics.median(v) for b, v in verify[w].items()} for w in ways},
        "verify_saved_ms": saved("torch"),  # by the glue kernels
        "plain_tokens_per_s": decode,
        "plain_speedup": speedup("torch"),
        "grouped_attention_saved_ms": saved("ungrouped"),
        "grouped_attention_plain_speedup": speedup("ungrouped"),
    }
    if "no-prefetch" in ways:
        result["prefetch_saved_ms"] = saved("no-prefetch")
        result["prefetch_plain_speedup"] = speedup("no-prefetch")
    out = Path(args.out) if args.out else paths.RESULTS / f"cpu_glue_{spec.model_key or 'model'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'way':>11} | " + " | ".join(f"B={b} ms" for b in sizes) + " | plain tok/s")
    for w in ways:
        cells = " | ".join(f"{result['verify_ms'][w][str(b)]:.2f}" for b in sizes)
        print(f"{w:>11} | {cells} | {statistics.median(decode[w]):.1f}")
    print(f"plain decoding, kernels ÷ torch: {result['plain_speedup']:.3f}x; ÷ ungrouped attention: "
          f"{result['grouped_attention_plain_speedup']:.3f}x; ÷ no prefetch: "
          f"{result.get('prefetch_plain_speedup', float('nan')):.3f}x (paired by round)")
    print(f"wrote {paths.relative(out)}")
    return 0
