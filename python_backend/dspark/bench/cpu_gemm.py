"""`dspark bench-cpu-gemm`: our fp32 rows kernel (`dspark.runtime.cpu_gemm`) against oneDNN's
prepacked matmul on this CPU (`--dtype bf16`: our bf16 dot-product kernel for AVX512-BF16 CPUs
against oneDNN's bf16 matmul as served, short row counts padded to `linear.BF16_MIN_ROWS`),
over one forward's projections of the model (every layer's qkv, o, gate_up and down, then the
LM head; weights of those shapes) at the row counts a decode,
a verify, a batched step and a prefill send. `--without-prefetch` adds our kernel built without
its prefetch of the next column blocks (what the prefetch buys; with `--dtype bf16` the dot
kernel built without its prefetch of the next column group); `--bf16-weights` our kernel
over the same weights rounded to bf16 (half the bytes to stream; fp32 arithmetic). They run
interleaved in rounds, each round starting with the next one (drift hits all alike); per row
count the median over rounds. Also checks the kernel against F.linear, its batch invariance,
and that the build without prefetch computes the same bits. Writes
results/cpu_gemm_<model>_cpu_<kind>.json (bf16: cpu_gemm_<model>_bf16_cpu_<kind>.json) and a PNG
beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dspark import paths
from dspark.bench import cpu_name
from dspark.runtime import cpu_gemm, linear


def projection_shapes(config: dict) -> list[tuple[str, int, int, int]]:
    """(name, out, in, count) of one forward's projections, from a Llama-style config.json."""
    d, layers = config["hidden_size"], config["num_hidden_layers"]
    hd = config.get("head_dim") or d // config["num_attention_heads"]
    kv = config.get("num_key_value_heads", config["num_attention_heads"])
    inter = config["intermediate_size"]
    return [("qkv", (config["num_attention_heads"] + 2 * kv) * hd, d, layers),
            ("o", d, config["num_attention_heads"] * hd, layers), ("gate_up", 2 * inter, d, layers),
            ("down", d, inter, layers), ("lm_head", config["vocab_size"], d, 1)]


def forward_ms(fns: list[tuple[list, int]], rows: int, dtype: torch.dtype = torch.float32) -> float:
    """Wall time of one pass over every projection at `rows` rows."""
    total = 0.0
    for group, k in fns:
        x = torch.randn(rows, k).to(dtype)
        t0 = time.perf_counter()
        for f in group:
            f(x)
        total += time.perf_counter() - t0
    return 1e3 * total


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 or a Hugging Face folder (its config.json)")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: our AVX512-BF16 dot-product kernel against oneDNN's bf16 matmul")
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8,12,16,32,64,128,256")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--without-prefetch", action="store_true",
                   help="also time the kernel built without its prefetch (-DROWS_GEMM_NO_PREFETCH; "
                        "--dtype bf16: -DBF16_DOT_NO_PREFETCH)")
    p.add_argument("--bf16-weights", action="store_true",
                   help="also time the kernel over the weights rounded to bf16 (`rows_gemm_bf16`)")
    p.add_argument("--out", default=None, help="default: results/cpu_gemm_<model>_cpu_<kind>.json")


def main(args: argparse.Namespace) -> int:
    bf16 = args.dtype == "bf16"
    if bf16 and cpu_gemm.dot_library() is None:
        raise SystemExit("dspark bench-cpu-gemm --dtype bf16: the bf16 dot-product kernel cannot be built "
                         "here (needs a C compiler and an x86 CPU with AVX512-BF16)")
    if bf16 and args.bf16_weights:
        raise SystemExit("dspark bench-cpu-gemm: --bf16-weights times the fp32 kernel; leave it out "
                         "with --dtype bf16")
    if not bf16 and cpu_gemm.library() is None:
        raise SystemExit("dspark bench-cpu-gemm: the rows kernel cannot be built here "
                         "(needs a C compiler and an x86 CPU with AVX2 + FMA)")
    torch.set_num_threads(args.num_threads)
    folder = paths.SMOLLM2 if args.model == "smollm2" else Path(args.model)
    config = json.loads((folder / "config.json").read_text())
    shapes = projection_shapes(config)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    weights = [([(torch.randn(n, k) * 0.02).to(dtype) for _ in range(count)], k) for _, n, k, count in shapes]
    kernels: dict[str, Callable[[torch.Tensor], object]] = {
        "onednn": linear.PackedLinear, "rows": cpu_gemm.DotBf16Linear if bf16 else cpu_gemm.RowsLinear}
    if args.without_prefetch:
        variant = (cpu_gemm.dot_library(("BF16_DOT_NO_PREFETCH",)) if bf16
                   else cpu_gemm.library(("ROWS_GEMM_NO_PREFETCH",)))
        if variant is None:
            raise SystemExit("dspark bench-cpu-gemm: the kernel without prefetch failed to build")
        kernels["rows_no_prefetch"] = partial(kernels["rows"], lib=variant)
    if args.bf16_weights:
        kernels["rows_bf16"] = lambda w: cpu_gemm.RowsLinear(w.bfloat16())
    fns = {name: [([make(w) for w in group], k) for group, k in weights] for name, make in kernels.items()}
    w, x = weights[3][0][0], torch.randn(13, weights[3][1]).to(dtype)  # one down_proj: the longest K
    rows_lin = kernels["rows"](w)
    max_err = float((rows_lin(x).float() - F.linear(x, w).float()).abs().max())
    invariant = all(torch.equal(rows_lin(x[i:i + 1])[0], rows_lin(x)[i]) for i in range(13))
    counts = [int(r) for r in args.rows.split(",") if r]
    times: dict[str, dict[int, list[float]]] = {name: {r: [] for r in counts} for name in kernels}
    for rnd in tqdm(range(args.rounds), desc="rounds", unit="round"):
        names = list(kernels)
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for r in counts:
            for name in order:
                forward_ms(fns[name], r, dtype)  # warm: oneDNN builds a primitive per row count
                times[name][r].append(forward_ms(fns[name], r, dtype))
    ms = {name: {str(r): statistics.median(v) for r, v in t.items()} for name, t in times.items()}

    def paired(slow: str, fast: str) -> dict[str, float]:
        """Per row count, the median over rounds of `slow`'s time ÷ `fast`'s in the same round."""
        return {str(r): statistics.median(a / b for a, b in zip(times[slow][r], times[fast][r]))
                for r in counts}

    ratio = paired("onednn", "rows")
    extra = {}
    if args.without_prefetch:
        extra["rows_no_prefetch_over_rows_paired"] = paired("rows_no_prefetch", "rows")
        extra["rows_no_prefetch_bit_identical"] = torch.equal(kernels["rows_no_prefetch"](w)(x), rows_lin(x))
    if args.bf16_weights:
        extra["rows_over_rows_bf16_paired"] = paired("rows", "rows_bf16")
        extra["rows_bf16_bit_identical_to_rows_on_bf16_values"] = torch.equal(
            cpu_gemm.RowsLinear(w.bfloat16())(x), cpu_gemm.RowsLinear(w.bfloat16().float(), narrow=False)(x))
    key = "smollm2" if args.model == "smollm2" else folder.name
    result = {
        "what": "one forward's projections (every layer's qkv, o, gate_up, down, then the LM head), "
                f"{args.dtype} weights and activations of the model's shapes (rows_bf16: fp32 weights "
                "rounded to bf16), ms per pass; median over interleaved rounds",
        "dtype": args.dtype, "rows_kernel": "bf16_dot_gemm" if bf16 else "rows_gemm",
        "bf16_min_rows": linear.BF16_MIN_ROWS if bf16 else None,
        "model": key, "shapes": [{"name": s[0], "out": s[1], "in": s[2], "count": s[3]} for s in shapes],
        "cpu": cpu_name(), "cpu_kind": linear.THIS_CPU_KIND, "threads": args.num_threads,
        "pack_rows_hint": linear.pack_rows_hint(dtype), "rounds": args.rounds,
        "ms": ms, "onednn_over_rows_paired": ratio,
        "rows_max_abs_err_vs_f_linear": max_err, "rows_batch_invariant": invariant, **extra,
        "torch": torch.__version__,
    }
    kind = linear.THIS_CPU_KIND or "other"
    tag = "_bf16" if bf16 else ""
    out = Path(args.out) if args.out else paths.RESULTS / f"cpu_gemm_{key}{tag}_cpu_{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for r in counts:
        line = (f"{r:4d} rows: oneDNN {ms['onednn'][str(r)]:7.1f} ms  rows {ms['rows'][str(r)]:7.1f} ms  "
                f"x{ratio[str(r)]:.2f}")
        if args.without_prefetch:
            line += (f"  without prefetch {ms['rows_no_prefetch'][str(r)]:7.1f} ms  "
                     f"x{extra['rows_no_prefetch_over_rows_paired'][str(r)]:.2f}")
        if args.bf16_weights:
            line += (f"  bf16 weights {ms['rows_bf16'][str(r)]:7.1f} ms  "
                     f"x{extra['rows_over_rows_bf16_paired'][str(r)]:.2f}")
        print(line)
    print(f"wrote {paths.relative(out)}")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ours = f"ours ({result.get('rows_kernel', 'rows_gemm')})"
    for name, label in (("onednn", "oneDNN prepacked"), ("rows", ours),
                        ("rows_no_prefetch", "rows kernel without prefetch"),
                        ("rows_bf16", "rows kernel, bf16 weights")):
        if name not in result["ms"]:
            continue
        rows = [int(r) for r in result["ms"][name]]
        ax.plot(rows, list(result["ms"][name].values()), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows (tokens in the step)")
    ax.set_ylabel("ms per forward's projections")
    ax.set_title(f"{result.get('dtype', 'fp32')} projections, {result['model']}, {result['cpu_kind']} CPU, "
                 f"{result['threads']} thread(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

