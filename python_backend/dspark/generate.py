"""`dspark generate`: stream a continuation of --prompt from a checkpoint (default: the
shipped demo target) with plain decoding; prints tokens/s on stderr when done."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dspark import paths
from dspark.loader import load_model, load_tokenizer
from dspark.sampling import SamplingParams
from dspark.target import TargetEngine


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without splitting a multi-byte
    character: text is only released once it no longer ends in a replacement char."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # wait for the rest of the character
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else text
        self.emitted = text
        return delta


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(paths.DEMO_TARGET),
                   help="HF checkpoint folder (default: the demo target)")
    p.add_argument("--prompt", default="Once upon a time", help="text to continue")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def main(args: argparse.Namespace) -> int:
    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        print(f"error: no model at {folder}. Build the demo model first with `make demo-assets` "
              "(build/demo/build.sh), or pass --model PATH to a Hugging Face checkpoint folder.",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        print(f"error: {folder} has no tokenizer.json", file=sys.stderr)
        return 2
    prompt = tokenizer.encode(args.prompt).ids
    if not prompt:
        print("error: empty prompt", file=sys.stderr)
        return 2
    model, cfg = load_model(folder)
    engine = TargetEngine(model, cfg, tokenizer, capacity=1, max_seq_len=len(prompt) + args.max_tokens)
    detok = IncrementalDetokenizer(engine.tokenizer)

    def stream(_: int, ids: list[int]) -> None:
        sys.stdout.write(detok.push(ids))
        sys.stdout.flush()

    t0 = time.perf_counter()
    out = engine.generate([prompt], args.max_tokens, params, on_tokens=stream)[0]
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    print(f"[{len(out)} tokens in {dt:.2f} s: {len(out) / dt:.1f} tokens/s, prompt {len(prompt)} tokens]",
          file=sys.stderr)
    return 0
