"""`dspark bench-step`: where a decode step's time goes, call by call (architecture §2, §9).

`dspark bench` splits a step by the engine's own clock (prefill share, draft, schedule, verify,
accept); this names the calls inside each: the engine's, the policy's, the drafter's and the
target's methods and the loop's module functions, each wrapped with a wall-clock timer for the
run (a timer adds about a microsecond a call). Times are inclusive: a call's time contains the
calls made inside it (`within` names the one a part runs inside; a just-admitted request's first
drafts are proposed inside `engine._drafts` instead). A dspark engine (the spec's drafter and
policy) and a plain one decode the same prompts greedily, R at a time, one group of prompts each
in turn on the shared target, so a busy spell of the machine lands on both alike.
Writes results/step_split_<model>.json (+ .png: milliseconds per step by part, dspark beside plain).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from dspark import paths, wiring
from dspark.bench.e2e import fit_prompts, load_prompts
from dspark.runtime import engine as engine_module
from dspark.runtime.engine import SpecEngine
from dspark.runtime.sampling import SamplingParams

# (part, owner, attribute, the part it runs inside): owner "engine", "policy", "drafter",
# "drafter.<attr>" (a hybrid's parts), "target" or "loop" (a function of dspark.runtime.engine)
PARTS: list[tuple[str, str, str, str | None]] = [
    ("target.prefill", "target", "prefill", None),
    ("drafter.start", "drafter", "start", None),
    ("engine._drafts", "engine", "_drafts", None),
    ("engine._flat_batch", "engine", "_flat_batch", None),
    ("policy.decide", "policy", "decide", None),
    ("target.verify", "target", "verify", None),
    ("verify_ragged", "loop", "verify_ragged", None),
    ("policy.wants_draft", "policy", "wants_draft", None),
    ("engine._extend", "engine", "_extend", None),
    ("drafter.extend", "drafter", "extend", "engine._extend"),
    ("engine._propose_next", "engine", "_propose_next", None),
    ("drafter.propose", "drafter", "propose", "engine._propose_next"),
    ("drafter.ngram.lookups", "drafter.ngram", "lookups", "drafter.propose"),
    ("drafter.neural.propose", "drafter.neural", "propose", "drafter.propose"),
    ("sts_survival", "loop", "sts_survival", "engine._propose_next"),
    ("policy.observe_acceptance", "policy", "observe_acceptance", None),
    ("policy.observe_step", "policy", "observe_step", None),
    ("policy.observe_rate", "policy", "observe_rate", None),
    ("target.rollback", "target", "rollback", None),
    ("engine._emit", "engine", "_emit", None),
]
WITHIN = {part: parent for part, _, _, parent in PARTS}


class PartTimers:
    """Wall-clock timers around named callables, installed for a block and removed after it."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    def _wrap(self, fn: Callable, part: str) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self.calls[part] += 1
        return timed

    @contextmanager
    def installed(self, engine: SpecEngine) -> Iterator[None]:
        """Time `PARTS` of this engine while the block runs (the owners an engine lacks, e.g. a
        plain engine's policy and drafter, are skipped); everything is restored after."""
        owners = {"engine": engine, "policy": engine.policy, "drafter": engine.drafter,
                  "target": engine.target, "loop": engine_module}
        for name in ("ngram", "neural"):
            owners[f"drafter.{name}"] = getattr(engine.drafter, name, None)
        undo: list[tuple[object, str, object]] = []
        try:
            for part, owner_name, attr, _ in PARTS:
                owner = owners[owner_name]
                if owner is None or not hasattr(owner, attr):
                    continue
                own = getattr(owner, "__dict__", {}).get(attr)  # a module function or an instance attribute
                undo.append((owner, attr, own))
                setattr(owner, attr, self._wrap(getattr(owner, attr), part))
            yield
        finally:
            for owner, attr, own in reversed(undo):
                if own is None:
                    delattr(owner, attr)  # the class's method shows through again
                else:
                    setattr(owner, attr, own)


def run_split(engines: dict[str, SpecEngine], groups: list[list[list[int]]], max_tokens: int) -> dict:
    """Every engine decodes every group of prompts (greedy), the engines in turn per group, each
    under its own `PartTimers`. -> per engine: steps, tokens, tokens/s, ms per step (whole step
    and the engine clock's split) and per part ms and calls per step."""
    timers = {name: PartTimers() for name in engines}
    wall = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    for e in engines.values():
        e.reset_metrics()
    for group in tqdm(groups, desc="bench-step", unit="group"):
        for name, e in engines.items():
            with timers[name].installed(e):
                t0 = time.perf_counter()
                outputs = e.generate(group, max_tokens, SamplingParams())
                wall[name] += time.perf_counter() - t0
            tokens[name] += sum(len(o) for o in outputs)
    result = {}
    for name, e in engines.items():
        steps = max(e.metrics.steps, 1)
        result[name] = {
            "steps": e.metrics.steps, "tokens": tokens[name], "tokens_per_step": tokens[name] / steps,
            "tokens_per_s": tokens[name] / wall[name], "step_ms": 1e3 * wall[name] / steps,
            "clock_ms": {k: 1e3 * v / steps for k, v in e.metrics.time_s.items()},
            "parts": {part: {"ms_per_step": 1e3 * s / steps, "within": WITHIN[part],
                             "calls_per_step": timers[name].calls[part] / steps}
                      for part, s in sorted(timers[name].seconds.items(), key=lambda kv: -kv[1])}}
    return result


def plot(result: dict, path: Path) -> None:
    """Milliseconds per step by part (host parts apart from the target's forwards), engines side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = result["engines"]
    parts = [p for p, *_ in PARTS if any(p in e["parts"] for e in engines.values())]
    big = [p for p in parts if p.startswith("target.") and p != "target.rollback"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 6), gridspec_kw={"width_ratios": [1, 3]})
    for ax, shown in zip(axes, (big, [p for p in parts if p not in big])):
        y = range(len(shown))
        for k, (name, e) in enumerate(engines.items()):
            ms = [e["parts"].get(p, {}).get("ms_per_step", 0.0) for p in shown]
            ax.barh([i + 0.4 * k for i in y], ms, height=0.4,
                    label=f"{name} ({e['step_ms']:.1f} ms, {e['tokens_per_step']:.2f} tokens a step)")
        ax.set_yticks([i + 0.2 for i in y], [("└ " if WITHIN[p] else "") + p for p in shown])  # └ inside
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (inclusive)")
    axes[1].legend(loc="lower right")
    fig.suptitle(f"Where a step's time goes: {result['model']}, {result['requests']} request(s) at a time, "
                 f"{result['threads']} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    wiring.add_arguments(p, capacity=2, max_seq_len=1024)
    p.add_argument("--requests", type=int, default=1, help="requests decoded together (a group of prompts)")
    p.add_argument("--domains", default="code,math,chat")
    p.add_argument("--n-prompts", type=int, default=2, help="prompts per domain")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts (after one warm-up group)")
    p.add_argument("--out", default=None, help="default: results/step_split_<model>.json")


def main(args: argparse.Namespace) -> int:
    spec = wiring.from_args(args)
    spec = replace(spec, capacity=max(spec.capacity, args.requests))
    target = wiring.load_target(spec)
    wiring.set_threads(spec, target.device)
    engines = {"dspark": wiring.build_engine(spec, target=target),
               "plain": wiring.build_engine(spec, target=target, drafter=None)}
    if engines["dspark"].policy is None:
        raise SystemExit(f"dspark bench-step: no drafter for model {spec.model!r} (drafter {spec.drafter!r})")
    prompts, source = load_prompts(spec.model_key, args.domains.split(","), args.n_prompts, target.tokenizer)
    prompts = fit_prompts(prompts, spec, args.max_tokens)
    r = args.requests
    groups = [prompts[i:i + r] for i in range(0, len(prompts), r)]
    run_split(engines, groups[:1], args.max_tokens)  # warm-up, not reported (the policy keeps its learning)
    result = {"model": spec.model, "dtype": str(target.dtype).replace("torch.", ""), "drafter": spec.drafter,
              "policy": spec.policy, "requests": r, "max_tokens": args.max_tokens, "prompts": source,
              "n_prompts": len(prompts), "rounds": args.rounds, "threads": torch.get_num_threads(),
              "load_avg_1min": float(Path("/proc/loadavg").read_text().split()[0]),
              "engines": run_split(engines, groups * args.rounds, args.max_tokens)}
    d, p = result["engines"]["dspark"], result["engines"]["plain"]
    result["dspark_over_plain_tokens_per_s"] = d["tokens_per_s"] / p["tokens_per_s"]
    out = Path(args.out) if args.out else paths.RESULTS / f"step_split_{spec.model_key or 'model'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for name, e in result["engines"].items():
        print(f"{name}: {e['tokens_per_s']:.1f} tokens/s, {e['step_ms']:.2f} ms and "
              f"{e['tokens_per_step']:.2f} tokens a step")
        for part, v in e["parts"].items():
            print(f"  {part:28s} {v['ms_per_step']:7.3f} ms/step  {v['calls_per_step']:.2f} calls/step")
    print(f"wrote {paths.relative(out)} and its .png")
    return 0
