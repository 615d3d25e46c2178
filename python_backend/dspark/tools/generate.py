"""`dspark generate`: stream a continuation of --prompt from a checkpoint (default: the
shipped demo target) through the speculative engine loop; prints τ and tokens/s on stderr.
With --drafter none it is plain decoding through the same loop."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dspark import paths
from dspark.runtime.engine import SpecEngine
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.sps import SPSTable
from dspark.runtime.target import TargetEngine
from dspark.runtime.text import IncrementalDetokenizer, encode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(paths.DEMO_TARGET),
                   help="HF checkpoint folder (default: the demo target)")
    p.add_argument("--prompt", default="Once upon a time", help="text to continue")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--drafter", default="auto",
                   help="none, ngram[:N], a name under build/demo/drafters, or a folder "
                        "(auto: the shipped dspark-markov drafter with the demo target, else none)")
    p.add_argument("--policy", default="dspark", help="scheduler policy (none, fixed:k, mtp1, threshold:t, "
                                                      "dspark-theory, dspark)")
    p.add_argument("--gamma", type=int, default=7, help="draft block size γ")
    p.add_argument("--sps", default=None,
                   help="SPS table json or gpu_shaped (default: results/sps_cpu.json, else gpu_shaped)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def _sps(spec: str | None) -> SPSTable:
    if spec == "gpu_shaped":
        return SPSTable.gpu_shaped()
    path = Path(spec) if spec else paths.RESULTS / "sps_cpu.json"
    return SPSTable.load(path) if path.is_file() else SPSTable.gpu_shaped()


def main(args: argparse.Namespace) -> int:
    from dspark.runtime.drafter import build_drafter, pad_temperatures, read_temperatures

    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        print(f"error: no model at {folder}. Build the demo model first with `make demo-assets` "
              "(build/demo/build.sh), or pass --model PATH to a Hugging Face checkpoint folder.",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = TargetEngine.from_pretrained(folder, capacity=1, max_seq_len=4096)
    if target.tokenizer is None:
        print(f"error: {folder} has no tokenizer.json", file=sys.stderr)
        return 2
    prompt = encode(target.tokenizer, args.prompt)
    if not prompt:
        print("error: --prompt is empty", file=sys.stderr)
        return 2
    spec = args.drafter
    if spec == "auto":
        shipped = (paths.DEMO_DRAFTERS / "dspark-markov" / "config.json").is_file()
        demo = folder.resolve() == paths.DEMO_TARGET.resolve()
        spec = "dspark-markov" if shipped and demo else "none"
    drafter, temps = None, None
    if spec != "none":
        drafter, drafter_dir = build_drafter(spec, target, args.gamma)
        temps = pad_temperatures(read_temperatures(drafter_dir), drafter.gamma)
    engine = SpecEngine(target, drafter, args.policy if drafter else "none", sts_temperatures=temps,
                        sps=_sps(args.sps))
    detok = IncrementalDetokenizer(target.tokenizer, prompt_ids=prompt)

    def stream(_rid: str, ids: list[int], finished: bool, _reason: str | None) -> None:
        sys.stdout.write(detok.push(ids) + (detok.finish() if finished else ""))
        sys.stdout.flush()

    t0 = time.perf_counter()
    req = engine.add_request(prompt, args.max_tokens, params, stop_token_ids=target.eos_token_ids,
                             on_tokens=stream)
    engine.run_until_done()
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    n = len(req.output)
    policy = engine.policy.name if engine.policy is not None else "none"
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s, τ={req.tau:.2f}, drafter {spec}, "
          f"policy {policy}, prompt {len(prompt)} tokens]", file=sys.stderr)
    return 0
