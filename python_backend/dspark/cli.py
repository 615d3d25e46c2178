"""`dspark` command line. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `main(args) -> int`; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "fetch-model": ("dspark.tools.fetch_model", "fetch + convert the default model (SmolLM2-135M-Instruct)"),
    "generate": ("dspark.tools.generate", "stream a continuation from the shipped (or given) model"),
    "serve": ("dspark.serving.serve", "start tritonserver on the model repository"),
    "bench-target": ("dspark.bench.target", "plain decode tokens/s: ours vs transformers"),
    "bench": ("dspark.bench.e2e", "end-to-end speculative benchmark"),
    "bench-scheduler": ("dspark.bench.scheduler", "scheduler decide() latency per policy"),
    "bench-drafter": ("dspark.bench.drafter", "one drafting step against one target step"),
    "bench-step": ("dspark.bench.step_split", "where a decode step's time goes, call by call"),
    "bench-rule": ("dspark.bench.rule_trace", "the drafting-cost rule step by step in one closed-loop cell"),
    "bench-min-rows": ("dspark.bench.min_rows", "bf16 matmuls padded to a few rows: verify, decode"),
    "bench-cpu-gemm": ("dspark.bench.cpu_gemm", "our CPU matmul kernels vs oneDNN (fp32, --dtype bf16)"),
    "bench-glue": ("dspark.bench.glue",
                   "the target forward's CPU kernel options: glue, grouped attention, matmul prefetch"),
    "bench-prefill": ("dspark.bench.prefill", "a prompt's prefill: our CPU attention kernel vs ATen's flash"),
    "bench-triton": ("dspark.bench.triton_overhead", "serving through Triton vs the same engine in process"),
    "profile-sps": ("dspark.bench.sps", "profile target steps/second vs token batch size"),
    "simulate": ("dspark.tools.simulate", "serving simulator over scheduler policies"),
    "appendix-a": ("dspark.tools.appendix_a", "non-anticipation harness (paper Appendix A)"),
    "corpus": ("dspark.tools.corpus", "build the SmolLM2 drafter prompt corpus"),
    "train": ("dspark.tools.train", "train a drafter"),
    "calibrate": ("dspark.tools.calibrate", "Sequential Temperature Scaling"),
    "eval": ("dspark.tools.evaluate", "offline drafter evaluation"),
    "draft-vocab": ("dspark.tools.draft_vocab", "the draft vocabulary of a model's DSpark drafters"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue  # not built yet
        modules[name] = mod
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text))
        mod.add_arguments(p)
    args = parser.parse_args(argv)
    return int(modules[args.command].main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
