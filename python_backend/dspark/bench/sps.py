"""`dspark profile-sps`: measure target steps/second vs token batch size B (docs/architecture.md §7).

One engine step = `TargetEngine.verify` of a ragged batch of R = ceil(B / tokens_per_request)
requests holding B new tokens in total (what a speculative step sends: anchor + drafts),
each request sitting on a cached context of `--context` tokens. After every timed step
the slots are rolled back, so every repeat sees the same context lengths. Repeats run in
rounds over all sizes. A VM's speed drifts by tens of percent over minutes, so by default
(`--timing paired`) every step is timed between two reference steps (the smallest B, a plain
decoding step) and priced as the median over rounds of its time ÷ theirs, times the fastest
reference step: every size is then read at one machine speed. `--timing fastest` keeps each
size's fastest round instead (other processes only ever add time), which on a drifting VM
catches sizes at different speeds (a 4-token step priced dearer than a 6-token one). Writes
sps.json (device, model, batch_tokens, steps_per_second) and a PNG of SPS and step time.
`--model` (default smollm2, in `--dtype auto`: what the server runs) goes through
`dspark.wiring` like every entry point; the default output is the table wiring looks up for
that model on this kind of CPU (results/sps_smollm2_cpu.json, results/sps_cpu.json for demo;
with `--dtype q4_1` results/sps_smollm2_q4_1_cpu.json; on a CPU with AVX512-BF16 but no AMX
the `_cpu_avx512bf16.json` beside each: `wiring.sps_table_path`). `--model random`
profiles a random Qwen3 checkpoint (hidden 384, 6 layers, vocab 8192) created under /tmp.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark import paths, wiring
from dspark.bench import cpu_name
from dspark.paths import RESULTS
from dspark.runtime.batch import RaggedBatch
from dspark.runtime.linear import cpu_kind, pack_rows_hint, serving_cpu_gemm
from dspark.runtime.sps import SPSTable

DEFAULT_SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512]
RANDOM_TARGET = Path("/tmp/dspark_random_qwen3_h384_l6_v8192")


def make_random_target(path: Path = RANDOM_TARGET) -> Path:
    """A random Qwen3 HF folder (hidden 384, 6 layers, 6 heads / 2 KV heads, vocab 8192)."""
    if (path / "config.json").is_file():
        return path
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=8192, hidden_size=384, intermediate_size=1024,
                                   num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                                   head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
                                   bos_token_id=None, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(path)
    return path


def split_tokens(batch_tokens: int, tokens_per_request: int) -> list[int]:
    """B tokens over R = ceil(B / tpr) requests, as evenly as possible (each >= 1)."""
    num_requests = math.ceil(batch_tokens / tokens_per_request)
    base, extra = divmod(batch_tokens, num_requests)
    return [base + (1 if r < extra else 0) for r in range(num_requests)]


def grid_lengths(num_requests: int, tokens: int, mixed: bool = True) -> list[int]:
    """New tokens per request of the grid cell (R, t): R·t in all. Uniform: t each. Mixed (the
    default): alternately 1 and 2t − 1 (an odd R's last request t), the spread of a dspark
    budget, where some requests verify their whole block and others only the bonus token. On
    a CPU a ragged step costs more than a uniform one of the same size (length groups and
    padded query rows in attention), and a grid of uniform cells priced dspark's steps 33 %
    under what they took at 8 requests."""
    if not mixed or tokens == 1:
        return [tokens] * num_requests
    pairs = [n for _ in range(num_requests // 2) for n in (1, 2 * tokens - 1)]
    return pairs + [tokens] * (num_requests % 2)


def paired_seconds(elapsed: np.ndarray, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """One step time per batch from [rounds, batches] wall times, each timed between two
    reference steps (`before`, `after`, same shape): the median over rounds of elapsed ÷ the
    mean of its two references, times the fastest reference step of the run. The references
    cancel the machine's drift to first order (a VM's speed moves by tens of percent over a
    profile), the median drops a round a burst of load hit, and the one scale prices every size
    at the same, fastest, machine speed."""
    elapsed, before, after = (np.asarray(a, dtype=np.float64) for a in (elapsed, before, after))
    ratios = np.median(2.0 * elapsed / (before + after), axis=0)
    return ratios * float(min(before.min(), after.min()))


def profile(target_path: str | Path, sizes: list[int], context: int = 256, tokens_per_request: int = 4,
            repeats: int = 5, warmup: int = 1, seed: int = 0, show_progress: bool = True,
            dtype: str = "auto", ragged_requests: list[int] | None = None,
            ragged_tokens: list[int] | None = None, mixed: bool = True,
            timing: str = "paired") -> SPSTable:
    """verify() wall time per B over `repeats` rounds -> SPSTable. `timing`: "paired" (each step
    between two reference steps of the smallest B, `paired_seconds`) or "fastest" (each size's
    fastest round: on a shared machine other processes only ever add time). `target_path`: a
    model name or folder, loaded through `dspark.wiring` in `dtype` (auto, fp32, bf16, q4_1).
    With `ragged_requests` and `ragged_tokens`, also the table's ragged grid: R requests of t
    new tokens each on average (`grid_lengths`: mixed unless mixed=False), for every R and t,
    on contexts staggered from `context` down to half of it and in slots out of order, as a live
    batch sits (masked attention, K/V gathered per slot)."""
    if timing not in ("paired", "fastest"):
        raise ValueError(f"timing must be 'paired' or 'fastest', not {timing!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, not {repeats}")
    ragged_requests, ragged_tokens = ragged_requests or [], ragged_tokens or []
    grid = [(r, t) for r in ragged_requests for t in ragged_tokens]
    flat_requests = max(len(split_tokens(b, tokens_per_request)) for b in sizes)
    grid_requests = max([r for r, _ in grid], default=0)
    longest = max([max(split_tokens(b, tokens_per_request)) for b in sizes]
                  + [max(grid_lengths(r, t, mixed)) for r, t in grid])
    spec = wiring.resolve(env={}, model=str(target_path), dtype=dtype, device="cpu",
                          capacity=flat_requests + grid_requests, max_seq_len=context + longest + 8,
                          num_threads=torch.get_num_threads())
    engine = wiring.load_target(spec)
    gen = torch.Generator().manual_seed(seed)
    slots = [engine.allocate() for _ in range(flat_requests + grid_requests)]
    # the table by B: equal contexts; the grid: slots out of order with cached lengths
    # from `context` down to half of it, as a live batch sits (masked attention, K/V gathered per slot)
    flat_slots, grid_slots = slots[:flat_requests], slots[flat_requests:][::-1]
    cached = {s: context for s in flat_slots} | {s: context - context // 2 * (i % 8) // 7
                                                 for i, s in enumerate(grid_slots)}
    for start in range(0, len(slots), 16):  # cache a context in every slot, 16 prompts at a time
        chunk = slots[start:start + 16]
        engine.prefill(chunk, [torch.randint(0, engine.vocab_size, (cached[s],), generator=gen).tolist()
                               for s in chunk])
    batches = []
    for b in sizes:
        lens = split_tokens(b, tokens_per_request)
        chosen = flat_slots[:len(lens)]
        tokens = [torch.randint(0, engine.vocab_size, (n,), generator=gen).tolist() for n in lens]
        batches.append(RaggedBatch.from_requests(chosen, tokens, [cached[s] for s in chosen]))
    for r, t in grid:
        chosen = grid_slots[:r]
        tokens = [torch.randint(0, engine.vocab_size, (n,), generator=gen).tolist()
                  for n in grid_lengths(r, t, mixed)]
        batches.append(RaggedBatch.from_requests(chosen, tokens, [cached[s] for s in chosen]))

    def timed(batch: RaggedBatch) -> float:
        t0 = time.perf_counter()
        engine.verify(batch)
        elapsed = time.perf_counter() - t0
        for slot in batch.slots.tolist():
            engine.rollback(slot, cached[slot])
        return elapsed

    reference = batches[min(range(len(sizes)), key=lambda i: sizes[i])]  # a plain decoding step at B = 1
    elapsed = np.zeros((repeats, len(batches)))
    refs = np.zeros((repeats, len(batches) + 1))  # refs[k, i], refs[k, i + 1]: around step i of round k
    # Rounds over ALL sizes (not all repeats of one size in a row): a burst of load from
    # other processes then slows every size a little instead of one size a lot.
    for round_no in tqdm(range(warmup + repeats), desc="profile-sps rounds", disable=not show_progress):
        k = round_no - warmup
        ref = timed(reference) if timing == "paired" else 0.0
        for i, batch in enumerate(batches):
            step = timed(batch)
            after = timed(reference) if timing == "paired" else 0.0
            if k >= 0:
                elapsed[k, i], refs[k, i], refs[k, i + 1] = step, ref, after
            ref = after
    if timing == "paired":
        best = paired_seconds(elapsed, refs[:, :-1], refs[:, 1:]).tolist()
    else:
        best = elapsed.min(axis=0).tolist()
    speeds = [1.0 / t for t in best[:len(sizes)]]
    ragged = None
    if grid:
        cells = dict(zip(grid, best[len(sizes):]))
        ragged = {"requests": list(ragged_requests), "tokens_per_request": list(ragged_tokens),
                  "seconds": [[cells[r, t] for t in ragged_tokens] for r in ragged_requests],
                  "lengths": "mixed" if mixed else "uniform"}
    dtype_name = spec.dtype if spec.dtype != "auto" else str(engine.dtype).removeprefix("torch.")
    device = (f"cpu:{cpu_name()} threads={torch.get_num_threads()} dtype={dtype_name} "
              f"pack_rows_hint={pack_rows_hint(engine.dtype)} cpu_gemm={serving_cpu_gemm(engine.dtype)}")
    return SPSTable(sizes, speeds, device=device, model=paths.relative(target_path), padded=False,
                    ragged=ragged)


def plot(tables: dict[str, SPSTable], out_png: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = [t.ragged for t in tables.values() if t.ragged]
    fig, axes = plt.subplots(1, 3 if grids else 2, figsize=(15 if grids else 10, 4))
    ax_sps, ax_time = axes[0], axes[1]
    for grid in grids:
        for r, row in zip(grid["requests"], grid["seconds"]):
            axes[2].plot(grid["tokens_per_request"], [1e3 * s for s in row], marker=".", label=f"R={r}")
        axes[2].set_xlabel("new tokens per request (1 + ℓ)")
        axes[2].set_ylabel("step time (ms)")
        axes[2].set_yscale("log")
        axes[2].set_title("ragged grid: R requests", fontsize=9)
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize=7)
    for name, table in tables.items():
        b = table.batch_tokens
        ax_sps.step(b, table.steps_per_second, where="pre", marker=".", label=name)
        ax_time.step(b, [1e3 / s for s in table.steps_per_second], where="pre", marker=".", label=name)
    for ax, ylabel in ((ax_sps, "steps / second"), (ax_time, "step time (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token batch size B = Σ(1 + ℓ_r)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(tables) > 1:  # one table: its name is the title (a device string is too long for a legend)
            ax.legend(fontsize=8)
    names = "" if len(tables) > 1 else f"\n{next(iter(tables))}"
    fig.suptitle(f"target engine step speed (next-bucket lookup){names}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default), demo, random (a random Qwen3 under /tmp) or an HF folder")
    p.add_argument("--target", default=None, help="same as --model (older spelling)")
    p.add_argument("--dtype", default="auto", help="auto (what the server runs), fp32, bf16, q4_1")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated B values")
    p.add_argument("--context", type=int, default=256, help="cached tokens per request")
    p.add_argument("--tokens-per-request", type=int, default=4, help="new tokens per request (1 + ℓ)")
    p.add_argument("--ragged-requests", default="1,2,4,8,16,32",
                   help="R of the ragged grid (step time by requests and tokens per request); '' for none")
    p.add_argument("--ragged-tokens", default="1,2,3,4,5,6,8,12,16", help="tokens per request of the grid")
    p.add_argument("--grid-lengths", choices=["mixed", "uniform"], default="mixed",
                   help="a grid cell's requests: alternately 1 and 2t-1 tokens (mixed, as dspark's "
                        "budgets are) or t each")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timing", choices=["paired", "fastest"], default="paired",
                   help="paired: every step between two B=1 reference steps, median ratio x the fastest "
                        "reference (robust to a drifting VM); fastest: each size's fastest round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default=None,
                   help="default: the table dspark.wiring reads for this model and dtype")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")


def _ints(text: str) -> list[int]:
    return sorted({int(v) for v in text.split(",") if v.strip()})


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    target = args.target or args.model
    if target == "random":
        target = make_random_target()
    key = wiring.Spec(model=str(target)).model_key
    out = args.out or str(wiring.sps_table_path(key, args.dtype, cpu_kind(), args.threads)
                          or RESULTS / "sps_cpu.json")
    sizes = _ints(args.sizes)
    try:
        table = profile(target, sizes, args.context, args.tokens_per_request, args.repeats, args.warmup,
                        dtype=args.dtype, ragged_requests=_ints(args.ragged_requests) or None,
                        ragged_tokens=_ints(args.ragged_tokens) or None,
                        mixed=args.grid_lengths == "mixed", timing=args.timing)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if Path(target) == RANDOM_TARGET:
        table.model = f"random Qwen3 (hidden 384, 6 layers, vocab 8192) at {target}"
    elif key is not None:
        table.model = key  # a repo-relative name, not this machine's path
    table.save(out)
    record = json.loads(Path(out).read_text())  # the table plus how it was measured
    record.update({"context": args.context, "tokens_per_request": args.tokens_per_request,
                   "repeats": args.repeats, "timing": args.timing, "torch": torch.__version__,
                   "load_average_1min": round(os.getloadavg()[0], 2)})
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    plot({f"{table.device}": table}, args.plot or str(Path(out).with_suffix(".png")))
    for b, s in zip(table.batch_tokens, table.steps_per_second):
        print(f"B={b:5d}  {s:9.2f} steps/s  {1e3 / s:8.2f} ms")
    print(f"wrote {out}")
    return 0
