"""`dspark generate`: stream a continuation of --prompt through the speculative engine loop
(default model SmolLM2-135M-Instruct with its shipped drafter, if any); prints τ and tokens/s
on stderr. With --drafter none it is plain decoding through the same loop."""

from __future__ import annotations

import argparse
import sys
import time

from dspark import wiring
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.text import IncrementalDetokenizer, encode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="Once upon a time", help="text to continue")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    wiring.add_arguments(p, capacity=1, max_seq_len=4096)


def main(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        spec = wiring.from_args(args)
        engine = wiring.build_engine(spec)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = engine.target
    if target.tokenizer is None:
        print(f"error: model {spec.model} has no tokenizer.json", file=sys.stderr)
        return 2
    prompt = encode(target.tokenizer, args.prompt)
    if not prompt:
        print("error: --prompt is empty", file=sys.stderr)
        return 2
    detok = IncrementalDetokenizer(target.tokenizer, prompt_ids=prompt)

    def stream(_rid: str, ids: list[int], finished: bool, _reason: str | None) -> None:
        sys.stdout.write(detok.push(ids) + (detok.finish() if finished else ""))
        sys.stdout.flush()

    t0 = time.perf_counter()
    req = engine.add_request(prompt, args.max_tokens, params, on_tokens=stream)
    engine.run_until_done()
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    n = len(req.output)
    policy = engine.policy.name if engine.policy is not None else "none"
    drafter = "none" if engine.drafter is None else (
        spec.drafter if spec.drafter != "auto" else str(wiring.drafter_folder(spec).name))
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s, τ={req.tau:.2f}, drafter {drafter}, "
          f"policy {policy}, prompt {len(prompt)} tokens]", file=sys.stderr)
    return 0
