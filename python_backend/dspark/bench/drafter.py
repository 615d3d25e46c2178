"""`dspark bench-drafter`: what one drafting step costs next to one target step (architecture §5).

For R requests on a cached context: the target's verify of one token per request (a plain
decoding step) and of 1 + γ tokens per request, against the DSpark drafter's propose (greedy and
sampled, full vocabulary and a draft vocabulary of K tokens) and its extend; and per request,
opening the drafter's context for a prompt (`start`) next to the target's prefill of it. Every quantity is
measured in interleaved rounds in one process and the fastest round is kept (on a shared machine
other processes only add time). The drafter is the model's trained one (`--drafter`: any
trained kind; the draft-vocabulary sweep and extend are measured for DSpark drafters), or with
`--random` (or when none ships) a randomly initialised DSpark-Markov of the shipped shape, which
costs the same.
Writes results/drafter_step_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from dspark import paths, wiring
from dspark.runtime.batch import RaggedBatch
from dspark.runtime.drafter.ngram import NGramDrafter
from dspark.runtime.sampling import SamplingParams


def random_drafter(target, gamma: int, layers: int = 1, intermediate: int = 1536, rank: int = 64):
    """A DSpark-Markov drafter of the shipped SmolLM2 shape with random weights (same cost)."""
    from dspark.runtime.drafter.dspark_drafter import DSparkDrafter
    from dspark.runtime.drafter.dspark_model import DSparkConfig, DSparkModel
    from dspark.runtime.drafter.files import shared_weights

    cfg = target.config
    torch.manual_seed(0)
    model = DSparkModel(DSparkConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, tap_dim=target.tap_dim, num_layers=layers,
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        intermediate_size=intermediate, block_size=15, gamma=gamma, head="markov", head_rank=rank,
        tap_layers=list(target.tap_layers)))
    emb, lm, _ = shared_weights(target)
    return DSparkDrafter(model.to(emb.device, emb.dtype), emb, lm, gamma=gamma).pack_for_inference()


def fastest(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def measure(target, drafter, num_requests: int, context: int, vocabs: list[int], rounds: int,
            repeats: int, all_block_rows: bool = False) -> dict:
    gamma = drafter.gamma
    slots = [target.allocate() for _ in range(num_requests)]
    prompt = [5 + i % 100 for i in range(context)]
    try:
        _, taps = target.prefill(slots, [prompt] * num_requests)
        for s, tp in zip(slots, taps):
            drafter.start(s, prompt, tp)
        anchors = torch.full((num_requests,), 42)
        u = torch.rand(num_requests, gamma)
        greedy, sampled = [SamplingParams()] * num_requests, [SamplingParams(temperature=1.0)] * num_requests

        def verify(n: int):
            batch = RaggedBatch.from_requests(slots, [[7] * n] * num_requests, [context] * num_requests)

            def run():
                target.verify(batch)
                for s in slots:
                    target.rollback(s, context)
            return run

        def extend():
            n = 1 + gamma // 2  # a typical accepted length
            cu = torch.arange(num_requests + 1) * n
            drafter.extend(slots, torch.full((n * num_requests,), 7), torch.cat([tp[:n] for tp in taps]), cu,
                           torch.full((num_requests,), n))
            drafter.kv.advance(torch.tensor(slots), torch.full((num_requests,), -n))  # same context again
            for s in slots:
                drafter.kv.bound[s] -= n

        def prefill():  # one request's prompt, as admission runs it (slot 0 refilled in place)
            target.rollback(slots[0], 0)
            target.prefill(slots[:1], [prompt])

        cases = {"verify_1_token_ms": verify(1), f"verify_{1 + gamma}_tokens_ms": verify(1 + gamma),
                 "target_prefill_ms": prefill,
                 "drafter_start_ms": lambda: drafter.start(slots[0], prompt, taps[0])}
        if hasattr(drafter, "kv"):  # a DSpark drafter: its context extend can be rewound
            cases["extend_ms"] = extend
        propose = {"greedy": lambda: drafter.propose(slots, anchors, greedy, u),
                   "sampled": lambda: drafter.propose(slots, anchors, sampled, u)}
        if all_block_rows and hasattr(drafter, "project_distinct_rows"):
            propose["greedy_all_block_rows"] = lambda: all_rows(drafter, propose["greedy"])
        for k in vocabs:
            for mode, fn in propose.items():
                cases[f"propose_{mode}_ms@{k or 'all'}"] = (k, fn)
        best: dict[str, float] = {}
        for _ in range(rounds):  # interleaved: every case sees the same machine state
            for name, case in cases.items():
                if isinstance(case, tuple):
                    if hasattr(drafter, "set_vocab"):
                        drafter.set_vocab(None if not case[0] else torch.arange(case[0]))
                    case = case[1]
                best[name] = min(best.get(name, float("inf")), fastest(case, repeats))
        step = best["verify_1_token_ms"]
        best["start_share_of_prefill"] = best["drafter_start_ms"] / best["target_prefill_ms"]
        best.update({f"share_of_plain_step@{k or 'all'}": best[f"propose_greedy_ms@{k or 'all'}"] / step
                     for k in vocabs})
        if "greedy_all_block_rows" in propose:
            for k in [str(k or "all") for k in vocabs]:
                best[f"all_block_rows_over_distinct@{k}"] = (best[f"propose_greedy_all_block_rows_ms@{k}"]
                                                             / best[f"propose_greedy_ms@{k}"])
        return best
    finally:
        for s in slots:
            target.release(s)
            drafter.release(s)


def all_rows(drafter, fn):
    """fn() with the drafter's layer 0 projecting all R·G block rows (`project_distinct_rows` off)."""
    drafter.project_distinct_rows = False
    try:
        return fn()
    finally:
        drafter.project_distinct_rows = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    wiring.add_arguments(p, capacity=32, max_seq_len=512)
    p.add_argument("--requests", default="1,32", help="R values to measure")
    p.add_argument("--vocab", default="0,4096", help="draft vocabulary sizes (0 = all tokens)")
    p.add_argument("--context", type=int, default=256, help="cached tokens per request")
    p.add_argument("--random", action="store_true", help="a random drafter of the shipped shape")
    p.add_argument("--all-block-rows", action="store_true",
                   help="also time the greedy propose with layer 0 projecting all R·G block rows (the "
                        "layout before it projected the R + 1 distinct ones)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None, help="default: results/drafter_step_<model>.json")


def main(args: argparse.Namespace) -> int:
    spec = wiring.from_args(args)
    requests = [int(r) for r in args.requests.split(",")]
    spec = replace(spec, capacity=max(spec.capacity, *requests))
    target = wiring.load_target(spec)
    drafter = None if args.random else wiring.load_drafter(spec, target)
    folder = wiring.drafter_folder(spec)
    name = folder.name if folder is not None else spec.drafter
    if drafter is None or isinstance(drafter, NGramDrafter):  # no model to time: a stand-in
        drafter, name = random_drafter(target, spec.gamma), "random DSpark-Markov (shipped shape)"
    vocabs = [int(v) for v in args.vocab.split(",")]
    if not hasattr(drafter, "set_vocab") and vocabs != [0]:
        raise SystemExit(f"--vocab: the {name} drafter has no draft vocabulary; pass --vocab 0")
    rows = {str(r): measure(target, drafter, r, args.context, vocabs, args.rounds, args.repeats,
                            args.all_block_rows)
            for r in tqdm(requests, desc="bench-drafter", unit="R")}
    result = {"model": spec.model, "dtype": str(target.dtype).replace("torch.", ""), "drafter": name,
              "gamma": drafter.gamma, "context": args.context, "threads": torch.get_num_threads(),
              "load_avg_1min": float(Path("/proc/loadavg").read_text().split()[0]), "by_requests": rows}
    out = Path(args.out) if args.out else paths.RESULTS / f"drafter_step_{spec.model_key or 'model'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows, indent=1))
    print(f"wrote {paths.relative(out)}")
    return 0
