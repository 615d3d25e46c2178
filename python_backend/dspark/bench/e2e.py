"""`dspark bench`: end-to-end speculative decoding benchmark (docs/architecture.md §2, §9), one run, same
target and prompts (code and math, greedy) for every method:
- batch 1 tokens/s: our engine with the drafter + scheduler ("dspark"), our plain decoding
  (the same loop, no drafter), and transformers `generate` plain, with `assistant_model`
  (a standalone draft LM folder, if given / shipped) and with `prompt_lookup_num_tokens`;
- aggregate tokens/s at larger batches: dspark vs our plain batched decoding.
Also τ and the per-step time breakdown (draft, schedule, verify, accept, prefill, other).
Writes results/bench_e2e.json and results/bench_e2e.png. Tokens/s counts generated tokens
(EOS stops a request) over wall time including prefill."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dspark.paths import DEMO_DRAFTERS, DEMO_TARGET, RESULTS
from dspark.runtime.sampling import SamplingParams

FALLBACK_PROMPTS = {
    "code": ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
             "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"],
    "math": ["Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
             "Question: A train travels 60 km per hour for 3 hours. How far does it go?\nAnswer:",
             "Question: What is 12 times 7 plus 5?\nAnswer:"],
}


def load_prompts(domains: list[str], n: int) -> tuple[list[str], str]:
    """n prompt texts per domain from `dspark.tools.prompts` (fallback: a few built-in ones)."""
    try:
        from dspark.tools.prompts import load_prompt_set

        return [t for d in domains for t in load_prompt_set(d, n)], "dspark.tools.prompts"
    except (ImportError, FileNotFoundError, ValueError):
        return [t for d in domains for t in FALLBACK_PROMPTS.get(d, [])[:n]], "builtin"


def find_draft_lm() -> Path | None:
    """The shipped standalone draft LM: a drafter folder whose config.json is a plain HF
    config (no "kind"; see dspark.runtime.drafter.load_drafter_folder)."""
    for folder in sorted(DEMO_DRAFTERS.glob("*/")) if DEMO_DRAFTERS.is_dir() else []:
        cfg = folder / "config.json"
        if cfg.is_file() and json.loads(cfg.read_text()).get("kind", "draft_lm") == "draft_lm":
            return folder
    return None


def best_of(repeats: int, fn, *args, **kwargs) -> dict:
    """The fastest of `repeats` identical runs (greedy: same tokens every time). On a shared
    machine other processes only ever add time, so the minimum is the method's own cost."""
    return max((fn(*args, **kwargs) for _ in range(repeats)), key=lambda r: r["tokens_per_s"])


def run_engine(target, drafter, policy, prompts: list[list[int]], batch: int, max_tokens: int,
               sts_temperatures=None) -> dict:
    """Run `prompts` through SpecEngine, `batch` requests at a time; tokens/s over the whole run."""
    from dspark.runtime.engine import SpecEngine

    engine = SpecEngine(target, drafter, policy if drafter is not None else None, sts_temperatures)
    engine.generate([prompts[0]], 4)  # warm-up (allocator, kernels), not timed
    engine.reset_metrics()
    reqs, t0 = [], time.perf_counter()
    for lo in range(0, len(prompts), batch):
        reqs += [engine.add_request(p, max_tokens, SamplingParams()) for p in prompts[lo:lo + batch]]
        engine.run_until_done()
    wall = time.perf_counter() - t0
    m = engine.metrics
    tokens = sum(len(r.output) for r in reqs)
    steps = max(m.steps, 1)
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "requests": len(reqs),
            "tau": sum(r.verify_emitted for r in reqs) / max(sum(r.verify_steps for r in reqs), 1),
            "steps": m.steps, "mean_verify_tokens_per_step": m.verify_tokens / steps,
            "mean_budget_per_step": m.verify_budget / steps, "drafter_fallbacks": m.drafter_fallbacks,
            "cond_acceptance": [a / v if v else None for a, v in zip(m.accepted, m.verified)],
            "step_ms": {k: 1e3 * v / steps for k, v in m.time_s.items()}}


def run_hf(model, prompts: list[list[int]], max_tokens: int, eos: list[int], **gen_kwargs) -> dict:
    """transformers `generate` at batch 1, greedy, one prompt after another."""
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, **gen_kwargs)  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, top_p=None,
                             top_k=None, temperature=None, eos_token_id=eos or None,
                             pad_token_id=eos[0] if eos else 0, **gen_kwargs)
        tokens += out.shape[1] - len(p)
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    b1 = {k: v for k, v in result["batch1_tokens_per_s"].items() if v is not None}
    ax1.bar(list(b1), list(b1.values()), color=["C3" if k == "dspark" else "C0" for k in b1])
    ax1.set(ylabel="tokens/s (batch 1)", title="per-user speed, batch 1")
    ax1.tick_params(axis="x", rotation=20)
    agg = result["aggregate_tokens_per_s"]
    xs = list(agg)
    for i, name in enumerate(("plain", "dspark")):
        ax2.bar([j + 0.4 * i for j in range(len(xs))], [agg[b][name] for b in xs], 0.4, label=name,
                color="C3" if name == "dspark" else "C0")
    ax2.set_xticks([j + 0.2 for j in range(len(xs))], [f"batch {b}" for b in xs])
    ax2.set(ylabel="aggregate tokens/s", title="aggregate throughput")
    ax2.legend()
    fig.suptitle(f"{result['config']['drafter']} + {result['config']['policy']} "
                 f"on {result['config']['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=str(DEMO_TARGET), help="target HF folder (default: the demo target)")
    p.add_argument("--drafter", default="ngram", help="ngram[:N], a drafter name under build/demo/drafters "
                   "or a folder")
    p.add_argument("--policy", default="dspark", help="scheduler policy (dspark needs an SPS table)")
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--sps", default="profile", help="sps.json, 'gpu' (synthetic GPU-shaped table) or "
                   "'profile' (measure this target now, a few buckets; the default)")
    p.add_argument("--domains", default="code,math")
    p.add_argument("--n-prompts", type=int, default=4, help="prompts per domain")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--batch-sizes", default="8,32", help="aggregate throughput batch sizes")
    p.add_argument("--assistant", default=None, help="standalone draft LM folder for hf_assisted "
                   "(default: the shipped one under build/demo/drafters, if any)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="runs per method; the fastest is reported")
    p.add_argument("--out", default=str(RESULTS / "bench_e2e.json"))


def main(args: argparse.Namespace) -> int:
    from dspark.runtime.drafter import build_drafter
    from dspark.runtime.scheduler import make_policy
    from dspark.runtime.sps import SPSTable
    from dspark.runtime.target import TargetEngine

    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    max_batch = max(batch_sizes + [1])
    if args.sps == "profile" and args.device == "cpu":  # the scheduler must see THIS machine's step cost
        from dspark.bench.sps import profile

        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= 2 * max_batch * (args.gamma + 1)]
        sps = profile(args.target, sizes, context=64, repeats=3, show_progress=False)
    else:
        sps = SPSTable.gpu_shaped() if args.sps in ("gpu", "profile") else SPSTable.load(args.sps)
    texts, prompt_source = load_prompts(args.domains.split(","), args.n_prompts)
    max_seq_len = args.max_prompt_tokens + args.max_tokens + args.gamma + 8
    target = TargetEngine.from_pretrained(args.target, capacity=max_batch,
                                          max_seq_len=max_seq_len, device=args.device)
    prompts = [target.tokenizer.encode(t).ids[-args.max_prompt_tokens:] or [0] for t in texts]
    drafter, folder = build_drafter(args.drafter, target, args.gamma)  # ngram[:N], name or folder
    gamma = drafter.gamma
    policy = lambda: make_policy(args.policy, sps=sps, gamma=gamma, max_batch_tokens=4096)
    runs: dict[str, dict] = {}
    rep, mt = args.repeats, args.max_tokens
    runs["batch1_plain"] = best_of(rep, run_engine, target, None, None, prompts, 1, mt)
    runs["batch1_dspark"] = best_of(rep, run_engine, target, drafter, policy(), prompts, 1, mt)
    batch1 = {"dspark": runs["batch1_dspark"]["tokens_per_s"], "plain": runs["batch1_plain"]["tokens_per_s"],
              "hf_plain": None, "hf_assisted": None, "hf_prompt_lookup": None}
    if not args.no_hf:
        import transformers

        load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32).to(args.device).eval()
        hf = load(args.target)
        eos = list(target.eos_token_ids)
        runs["hf_plain"] = best_of(rep, run_hf, hf, prompts, mt, eos)
        runs["hf_prompt_lookup"] = best_of(rep, run_hf, hf, prompts, mt, eos,
                                           prompt_lookup_num_tokens=gamma)
        assistant = Path(args.assistant) if args.assistant else find_draft_lm()
        if assistant is not None and (assistant / "config.json").is_file():
            runs["hf_assisted"] = best_of(rep, run_hf, hf, prompts, mt, eos,
                                          assistant_model=load(assistant))
        for k in ("hf_plain", "hf_assisted", "hf_prompt_lookup"):
            batch1[k] = runs.get(k, {}).get("tokens_per_s")
    aggregate = {}
    for b in batch_sizes:
        batch_prompts = (prompts * (b // len(prompts) + 1))[:b]
        bp = batch_prompts
        runs[f"batch{b}_plain"] = best_of(rep, run_engine, target, None, None, bp, b, mt)
        runs[f"batch{b}_dspark"] = best_of(rep, run_engine, target, drafter, policy(), bp, b, mt)
        aggregate[str(b)] = {"dspark": runs[f"batch{b}_dspark"]["tokens_per_s"],
                             "plain": runs[f"batch{b}_plain"]["tokens_per_s"]}
    result = {"batch1_tokens_per_s": batch1, "aggregate_tokens_per_s": aggregate,
              "tau": {k: v["tau"] for k, v in runs.items() if k.endswith("_dspark")},
              "step_time_ms": {k: v["step_ms"] for k, v in runs.items() if "step_ms" in v},
              "runs": runs,
              "config": {"target": str(args.target), "drafter": args.drafter, "policy": args.policy,
                         "gamma": gamma, "sps": args.sps, "sps_table": sps.to_dict(),
                         "prompts": prompt_source, "domains": args.domains, "num_prompts": len(prompts),
                         "max_tokens": args.max_tokens, "greedy": True, "device": args.device,
                         "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    summary = {k: result[k] for k in ("batch1_tokens_per_s", "aggregate_tokens_per_s", "tau")}
    print(json.dumps(summary, indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0
