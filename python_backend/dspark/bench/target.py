"""`dspark bench-target`: plain greedy decoding, our target engine vs transformers on the same
checkpoint and prompts, side by side in one process, plus the latency of one verify forward by
number of tokens. Writes results/target_bench_<model>.json (`--model smollm2` by default).

Engines: ours in each of `--dtypes` (fp32, bf16) and, when the model has its GGUF, `q4_1`
(int4 weights, `dspark.runtime.quant`); transformers' `generate` in fp32 and bf16. Every
repeat runs every engine at every batch size, the order rotating from repeat to repeat, so
load from other processes on a shared machine hits all of them alike; tokens/s are medians
over repeats. `dspark` in the JSON is our faster dtype (what `--dtype auto` should pick; the
choice is written as "dtype"), `transformers` the faster of its two per batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark import paths, wiring
from dspark.bench import cpu_name
from dspark.runtime.batch import RaggedBatch
from dspark.runtime.engine import SpecEngine
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.target import TargetEngine

PROMPT_TEXTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Question: what is the sum of the first ten positive integers? Answer: let us add them step by step.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.",
]
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)
# Verifies of equal size, one draft length per request against the lengths a ranked budget gives
# (ℓ from 0 to 7): what the scheduler's step shape (architecture §7) chooses between.
RAGGED_SHAPES: dict[str, tuple[list[int], list[int]]] = {
    "8x2": ([2] * 8, [1, 1, 3, 1, 2, 4, 1, 3]),
    "8x4": ([4] * 8, [1, 2, 7, 3, 8, 1, 5, 5]),
    "16x2": ([2] * 16, [1, 1, 3, 1, 2, 4, 1, 3] * 2),
}
RAGGED_REQUESTS = max(len(u) for u, _ in RAGGED_SHAPES.values())  # KV slots the shapes need
GOALS = {"batch1_vs_transformers": 1.2, "batch32_vs_transformers": 1.5, "verify16_vs_step": 1.3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 (default), demo, or a Hugging Face folder")
    p.add_argument("--dtypes", default="fp32,bf16", help="our dtypes to measure; the faster is `dtype`")
    p.add_argument("--q4-1", choices=("auto", "on", "off"), default="auto",
                   help="also measure --dtype q4_1 (auto: when the model has its GGUF)")
    p.add_argument("--compile", action="store_true",
                   help="also measure bf16 through torch.compile (minutes of compiling first)")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (all prompts equal length)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="rounds over all engines and batch sizes")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for every engine (see --thread-counts)")
    p.add_argument("--thread-counts", default="1,2",
                   help="also time our dtype at the smallest and largest batch with these thread counts")
    p.add_argument("--verify-context", type=int, default=256, help="cached tokens before the verified block")
    p.add_argument("--out", default=None, help="default: results/target_bench_<model>.json")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
    p.add_argument("--accuracy-only", action="store_true",
                   help="only the logit accuracy of bf16 / q4_1 against fp32 (merged into --out)")
    p.add_argument("--ragged-only", action="store_true",
                   help="only verifies of equal size, uniform against ragged (RAGGED_SHAPES), in our "
                        "first --dtypes dtype; default --out: results/target_ragged_<model>.json")


def make_prompts(engine: TargetEngine, n: int, prompt_len: int) -> list[list[int]]:
    """n prompts of exactly prompt_len tokens: tokenized text when there is a tokenizer,
    else fixed random ids."""
    if engine.tokenizer is not None:
        ids = [engine.tokenizer.encode(t).ids for t in PROMPT_TEXTS]
        stream = [t for i in range(n + prompt_len) for t in ids[i % len(ids)]]
        return [stream[i * 7:i * 7 + prompt_len] for i in range(n)]
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, engine.vocab_size, (n, prompt_len), generator=g).tolist()


def time_ours(engine: TargetEngine, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = SpecEngine(engine).generate(prompts, max_new, SamplingParams(), stop_token_ids=[])
    return time.perf_counter() - t0, out


def time_hf(model, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def verify_ms(engine: TargetEngine, context: list[int], sizes: list[int], repeats: int) -> dict[str, float]:
    """Median ms of one verify forward of n new tokens for ONE request on `context` cached tokens
    (a speculative block: the anchor + n-1 drafts), sizes interleaved in rounds."""
    slot = engine.allocate()
    try:
        engine.prefill([slot], [context])
        start = len(context)
        blocks = {n: [context[i % len(context)] for i in range(n)] for n in sizes}
        batches = {n: RaggedBatch.from_requests([slot], [blocks[n]], [start]) for n in sizes}
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for rep in range(repeats + 1):  # round 0 warms up
            for n in sizes:
                t0 = time.perf_counter()
                engine.verify(batches[n])
                if rep:
                    times[n].append(time.perf_counter() - t0)
                engine.rollback(slot, start)
        return {str(n): round(statistics.median(times[n]) * 1e3, 3) for n in sizes}
    finally:
        engine.release(slot)


def ragged_ms(engine: TargetEngine, context: list[int], repeats: int,
              shapes: dict[str, tuple[list[int], list[int]]] = RAGGED_SHAPES) -> dict[str, dict[str, float]]:
    """Median ms of one verify forward per shape: R requests on `context` cached tokens each, with
    the same number of new tokens laid out uniform (every request alike) or ragged; the two
    interleaved in rounds, so a slow spell of the machine lands on both. ratio = ragged ÷ uniform."""
    most = max(len(u) for u, _ in shapes.values())
    slots = [engine.allocate() for _ in range(most)]
    try:
        engine.prefill(slots, [context] * most)
        start = len(context)
        out: dict[str, dict[str, float]] = {}
        for name, (uniform, ragged) in shapes.items():
            if sum(uniform) != sum(ragged) or len(uniform) != len(ragged):
                raise ValueError(f"ragged shape {name}: {uniform} and {ragged} differ in requests or tokens")
            batches = {kind: RaggedBatch.from_requests(slots[:len(lens)],
                                                       [[context[i % start] for i in range(n)] for n in lens],
                                                       [start] * len(lens))
                       for kind, lens in (("uniform", uniform), ("ragged", ragged))}
            times: dict[str, list[float]] = {k: [] for k in batches}
            for rep in range(repeats + 1):  # round 0 warms up
                for kind, batch in batches.items():
                    t0 = time.perf_counter()
                    engine.verify(batch)
                    if rep:
                        times[kind].append(time.perf_counter() - t0)
                    for s in slots:
                        engine.rollback(s, start)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            out[name] = {"tokens": sum(uniform), "uniform_ms": round(ms["uniform"], 3),
                         "ragged_ms": round(ms["ragged"], 3), "ragged": ragged,
                         "ratio": round(ms["ragged"] / ms["uniform"], 3)}
        return out
    finally:
        for s in slots:
            engine.release(s)


def thread_study(engine: TargetEngine, prompts: list[list[int]], batch_sizes: tuple[int, ...],
                 thread_counts: list[int], max_new: int, repeats: int, busy: bool,
                 ) -> dict[str, dict[str, float]]:
    """Decode tokens/s per torch thread count (alternating), on the machine as it is or with one
    extra process spinning on a core (what a server meets next to other work: its drafter and
    BLS processes, or anything else on a shared machine)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        out: dict[str, dict[str, float]] = {str(t): {} for t in thread_counts}
        for b in batch_sizes:
            samples: dict[int, list[float]] = {t: [] for t in thread_counts}
            for _ in range(repeats):
                for t in thread_counts:
                    torch.set_num_threads(t)
                    samples[t].append(time_ours(engine, prompts[:b], max_new)[0])
            for t in thread_counts:
                out[str(t)][str(b)] = round(b * max_new / statistics.median(samples[t]), 2)
        return out
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def accuracy(engines: dict[str, TargetEngine], prompts: list[list[int]], folder: Path | None = None,
             n_decode: int = 3) -> dict:
    """Logits of each engine against the fp32 one on the same rows (each prompt's prefill row and
    n_decode token-by-token decode rows): max / mean |Δ|, top-1 agreement; for q4_1 also what
    the kernel's bf16 scale / zero do to the weights (in units of a quantization step)."""
    rows: dict[str, torch.Tensor] = {}
    for name, e in engines.items():
        out = []
        for ids in prompts:
            slot = e.allocate()
            try:
                cut = len(ids) - n_decode
                out.append(e.prefill([slot], [ids[:cut]])[0][0])
                out.extend(e.verify(RaggedBatch.from_requests([slot], [[ids[t]]], [t]))[0][0]
                           for t in range(cut, len(ids)))
            finally:
                e.release(slot)
        rows[name] = torch.stack(out).float()
    ref = rows["fp32"]
    result = {}
    for name, r in rows.items():
        if name != "fp32":
            diff = (r - ref).abs()
            result[name] = {"max_abs": round(diff.max().item(), 4), "mean_abs": round(diff.mean().item(), 4),
                            "top1_agree": round((r.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4)}
    result["rows"] = int(ref.shape[0])
    result["logit_range"] = [round(ref.min().item(), 2), round(ref.max().item(), 2)]
    if "q4_1" in engines and folder is not None:
        from dspark.runtime.quant import bf16_scale_errors

        result["q4_1_weight_error_in_steps"] = bf16_scale_errors(folder)
    return result


def accuracy_prompts(engine: TargetEngine, args: argparse.Namespace) -> list[list[int]]:
    """Three bench prompts and one of --verify-context tokens."""
    return make_prompts(engine, 3, args.prompt_len) + make_prompts(engine, 1, args.verify_context)


def accuracy_only(args: argparse.Namespace, folder: Path, q4: bool, max_seq_len: int, out: Path) -> int:
    """`--accuracy-only`: the "accuracy" entry alone, merged into the JSON at `out`."""
    engines = {name: wiring.load_target(wiring.resolve(env={}, model=args.model, dtype=name, capacity=1,
                                                       max_seq_len=max_seq_len, num_threads=args.threads))
               for name in ["fp32", "bf16"] + (["q4_1"] if q4 else [])}
    result = json.loads(out.read_text()) if out.is_file() else {}
    result["accuracy"] = accuracy(engines, accuracy_prompts(engines["fp32"], args), folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["accuracy"]))
    return 0


def ragged_only(args: argparse.Namespace, dtype: str, out: Path) -> int:
    """`--ragged-only`: `ragged_ms` alone in one dtype, written to `out` with the CPU it ran on."""
    longest = max(max(r) for _, r in RAGGED_SHAPES.values())
    engine = wiring.load_target(wiring.resolve(env={}, model=args.model, dtype=dtype,
                                               capacity=RAGGED_REQUESTS,
                                               max_seq_len=args.verify_context + longest + 8,
                                               num_threads=args.threads))
    repeats = max(args.repeats, 3) if not args.quick else 1
    context = make_prompts(engine, 1, args.verify_context)[0]
    result = {"model": args.model, "dtype": dtype, "verify_context": args.verify_context, "repeats": repeats,
              "ragged_vs_uniform_ms": ragged_ms(engine, context, repeats), "cpu": cpu_name(),
              "threads": args.threads, "torch": torch.__version__,
              "load_average_1min": round(os.getloadavg()[0], 2),
              "note": "median ms of one verify forward of R requests with verify_context cached tokens "
                      "each, the same new tokens laid out uniform or ragged, interleaved in rounds; "
                      "ratio = ragged / uniform"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ragged_vs_uniform_ms"]))
    return 0


def _has_gguf(folder: Path) -> bool:
    from dspark.runtime.quant import find_gguf

    try:
        find_gguf(folder)
        return True
    except (FileNotFoundError, ValueError):
        return False


def main(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    try:
        folder = wiring.model_folder(args.model)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [d for d in dtypes if d not in ("fp32", "bf16")]
    if unknown:
        print(f"error: --dtypes: {unknown} (fp32, bf16; q4_1 has its own flag)", file=sys.stderr)
        return 2
    max_new, repeats, sizes = args.max_new_tokens, args.repeats, list(VERIFY_SIZES)
    thread_counts = [int(t) for t in args.thread_counts.split(",") if t]
    if args.quick:
        batch_sizes, max_new, repeats, sizes, thread_counts = [1, 8], 8, 1, [1, 2, 4], []
    q4 = args.q4_1 == "on" or (args.q4_1 == "auto" and _has_gguf(folder))
    capacity = max(batch_sizes)
    max_seq_len = max(args.prompt_len + max_new, args.verify_context + max(sizes)) + 8
    key = wiring.Spec(model=args.model).model_key or folder.name
    if args.ragged_only:
        return ragged_only(args, dtypes[0], Path(args.out or paths.RESULTS / f"target_ragged_{key}.json"))
    out = Path(args.out or paths.RESULTS / f"target_bench_{key}.json")
    if args.accuracy_only:
        return accuracy_only(args, folder, q4, max_seq_len, out)

    ours: dict[str, TargetEngine] = {}
    for name in dtypes + (["q4_1"] if q4 else []) + (["bf16_compiled"] if args.compile else []):
        spec = wiring.resolve(env={}, model=args.model, dtype=name.removesuffix("_compiled"),
                              capacity=capacity, max_seq_len=max_seq_len, num_threads=args.threads)
        ours[name] = wiring.load_target(spec, compile=name.endswith("_compiled"))
    hf = {name: AutoModelForCausalLM.from_pretrained(str(folder), dtype=wiring.DTYPES[name]).eval()
          for name in ("fp32", "bf16")}
    any_engine = next(iter(ours.values()))
    prompts = make_prompts(any_engine, capacity, args.prompt_len)
    runs = [("dspark", n, e) for n, e in ours.items()] + [("transformers", n, m) for n, m in hf.items()]

    times = {(kind, name, b): [] for kind, name, _ in runs for b in batch_sizes}
    outputs: dict[tuple[str, str, int], list[list[int]]] = {}
    t_warm = time.perf_counter()
    for kind, _, m in runs:  # warm-up at every size (and compile, with --compile)
        for b in batch_sizes:
            (time_ours if kind == "dspark" else time_hf)(m, prompts[:b], 2)
    if args.compile:  # the verify shapes too
        verify_ms(ours["bf16_compiled"], make_prompts(any_engine, 1, args.verify_context)[0], sizes, 1)
    warmup_s = time.perf_counter() - t_warm
    total = repeats * len(batch_sizes) * len(runs)
    with tqdm(total=total, desc="bench-target", file=sys.stderr) as bar:
        for rep in range(repeats):
            for b in batch_sizes:
                shift = rep % len(runs)
                for kind, name, m in runs[shift:] + runs[:shift]:  # rotate who goes first
                    dt, outputs[(kind, name, b)] = (time_ours if kind == "dspark" else time_hf)(
                        m, prompts[:b], max_new)
                    times[(kind, name, b)].append(dt)
                    bar.update()

    def tps(kind: str, name: str, b: int) -> float:
        return round(b * max_new / statistics.median(times[(kind, name, b)]), 2)

    by_dtype = {kind: {name: {str(b): tps(kind, name, b) for b in batch_sizes}
                       for k, name, _ in runs if k == kind} for kind in ("dspark", "transformers")}
    # our dtype: the faster at most batch sizes (ties: the larger batch decides)
    score = {d: sum(by_dtype["dspark"][d][str(b)] >= max(by_dtype["dspark"][o][str(b)] for o in dtypes)
                    for b in batch_sizes) for d in dtypes}
    best = max(dtypes, key=lambda d: (score[d], by_dtype["dspark"][d][str(batch_sizes[-1])]))
    hf_best = {str(b): max(by_dtype["transformers"][n][str(b)] for n in hf) for b in batch_sizes}
    decode = {"dspark": by_dtype["dspark"][best], "transformers": hf_best}
    if q4:
        decode["dspark_q4_1"] = by_dtype["dspark"]["q4_1"]
    if args.compile:
        decode["dspark_bf16_compiled"] = by_dtype["dspark"]["bf16_compiled"]

    context = make_prompts(any_engine, 1, args.verify_context)[0]
    verify = verify_ms(ours[best], context, sizes, max(repeats, 3))
    verify_q4 = verify_ms(ours["q4_1"], context, sizes, max(repeats, 3)) if q4 else None
    ragged = ragged_ms(ours[best], context, max(repeats, 3)) if capacity >= RAGGED_REQUESTS else None
    verify_compiled = (verify_ms(ours["bf16_compiled"], context, sizes, max(repeats, 3))
                       if args.compile else None)

    threads = {}
    for condition in ("as_is", "one_busy_core") if thread_counts else ():
        threads[condition] = thread_study(ours[best], prompts, (batch_sizes[0], batch_sizes[-1]),
                                          thread_counts, max_new, max(repeats // 2, 2),
                                          busy=condition == "one_busy_core")
    torch.set_num_threads(args.threads)

    ratio = {b: decode["dspark"][b] / decode["transformers"][b] for b in decode["dspark"]}
    b_lo, b_hi = str(batch_sizes[0]), str(batch_sizes[-1])
    verify_ratio = verify["16"] / verify["1"] if "16" in verify else None
    measured = {"batch1_vs_transformers": ratio[b_lo], "batch32_vs_transformers": ratio[b_hi],
                "verify16_vs_step": verify_ratio}
    goals = {k: {"goal": g, "measured": None if measured[k] is None else round(measured[k], 3)}
             for k, g in GOALS.items()}
    for g in goals.values():
        lower_is_better = g is goals["verify16_vs_step"]
        g["met"] = None if g["measured"] is None else (
            g["measured"] <= g["goal"] if lower_is_better else g["measured"] >= g["goal"])
    match = None
    if "fp32" in ours:  # greedy texts, ours vs transformers, both fp32
        pairs = {b: zip(outputs[("dspark", "fp32", b)], outputs[("transformers", "fp32", b)])
                 for b in batch_sizes}
        match = {str(b): sum(o == h for o, h in pairs[b]) / b for b in batch_sizes}
    result = {
        "model": key,
        "dtype": best,
        "decode_tokens_per_s": decode,
        "verify_ms_by_tokens": verify,
        "verify_ms_by_tokens_q4_1": verify_q4,
        "ragged_vs_uniform_ms": ragged,
        "accuracy": accuracy({n: e for n, e in ours.items() if n in ("fp32", "bf16", "q4_1")},
                             accuracy_prompts(any_engine, args), folder) if "fp32" in ours else None,
        "verify_ms_by_tokens_bf16_compiled": verify_compiled,
        "warmup_s": round(warmup_s, 1),
        "decode_tokens_per_s_by_dtype": by_dtype,
        "ratio_vs_transformers": {b: round(r, 3) for b, r in ratio.items()},
        "goals": goals,
        "decode_tokens_per_s_by_threads": threads or None,
        "greedy_fp32_outputs_match_transformers": match,
        "model_config": {k: getattr(any_engine.config, k) for k in
                         ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")},
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "max_new_tokens": max_new,
        "verify_context": args.verify_context,
        "repeats": repeats,
        "device": "cpu",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "note": "tokens/s = batch * max_new_tokens / median wall time of a whole greedy generate call "
                "(prefill included); engines and batch sizes interleaved, order rotating per repeat; "
                "dspark = our faster dtype (`dtype`), transformers = the faster of fp32 / bf16 per batch "
                "size; verify = median ms of one forward of n tokens of one request on verify_context "
                "cached tokens",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"dtype": best, "decode_tokens_per_s": decode, "goals": goals}))
    print(f"wrote {out}", file=sys.stderr)
    return 0
