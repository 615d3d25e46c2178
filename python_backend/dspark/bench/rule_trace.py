"""`dspark bench-rule`: the drafting-cost rule step by step in one closed-loop cell (architecture §7).

`dspark bench` reports what a cell delivered; this shows why. dspark, plain decoding and MTP-1
run one closed loop each, side by side (one engine step of each in turn, as in `dspark bench`),
and every step of every engine is recorded: requests decoded, tokens emitted, decode seconds
(prefill apart) and, for dspark, whether it drafted and in which shape, with the three rates
its rule compared when it chose the next step (measured plain, the ranked model as corrected,
the measured uniform shape: `DSpark.last_rates`, `DSpark.last_uniform_rate`). The engines
start cold, as a freshly started server does. Plotted beside each engine's own delivered rate,
the rule's estimates show how far a moving average measured earlier in the loop is from what
a mode delivers now. Writes results/rule_trace_<model>_c<C>.json (+ .png).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark import paths, wiring
from dspark.bench.e2e import ClosedLoop, fit_prompts, load_prompts, run_closed_loops
from dspark.runtime.sampling import SamplingParams

ENGINES = ("dspark", "plain", "mtp1")


def _totals(engine) -> tuple[int, int, int, float, float]:
    m = engine.metrics
    prefill = m.time_s["prefill"]
    uniform = engine.policy.uniform_steps if engine.policy is not None else 0
    return m.emitted, m.draft_steps, uniform, sum(m.time_s.values()) - prefill, prefill


def trace_loops(engines: dict, prompts: list[list[int]], concurrency: int, num_requests: int,
                max_tokens: int) -> dict[str, dict]:
    """`run_closed_loops` with every step recorded -> per engine: aggregate tokens/s and its
    steps [{R, tokens, seconds (decode), prefill_s, mode ("plain" | "uniform" | "ranked"),
    and for a policy that counts drafting its rule's rates after the step}]."""
    steps: dict[str, list[dict]] = {name: [] for name in engines}
    bar = tqdm(desc="bench-rule", unit="engine step")

    def recorded(name: str, loop: ClosedLoop) -> None:
        e = loop.engine
        r = sum(not q.finished for q in loop.reqs)
        before = _totals(e)
        loop.step()
        after = _totals(e)
        drafted, uniform = after[1] > before[1], after[2] > before[2]
        row = {"R": r, "tokens": after[0] - before[0], "seconds": after[3] - before[3],
               "prefill_s": after[4] - before[4],
               "mode": ("uniform" if uniform else "ranked") if drafted else "plain"}
        p = e.policy
        if p is not None and p.counts_drafting:
            row["rule"] = {"plain": p.last_rates[2], "ranked": p.last_rates[1],
                           "uniform": p.last_uniform_rate}
        steps[name].append(row)
        bar.update()

    lengths = [max_tokens] * len(prompts)  # every request generates exactly max_tokens (no stop)
    with bar:
        runs = run_closed_loops(engines, prompts, concurrency, num_requests, lengths, SamplingParams(),
                                step=recorded)
    return {name: {"aggregate": run["aggregate"], "steps": steps[name]} for name, run in runs.items()}


def summarize(engines: dict[str, dict]) -> dict:
    """Ratios of aggregates, dspark's steps by mode and, per mode, the mean decode rate its steps
    delivered (tokens / seconds over the steps at the cell's most common R)."""
    out: dict = {f"dspark_over_{n}": engines["dspark"]["aggregate"] / engines[n]["aggregate"]
                 for n in engines if n != "dspark"}
    steps = engines["dspark"]["steps"]
    modes = ("plain", "uniform", "ranked")
    out["dspark_steps_by_mode"] = {m: sum(s["mode"] == m for s in steps) for m in modes}
    rs = [s["R"] for s in steps]
    top = max(set(rs), key=rs.count)
    out["most_common_R"] = top
    rates = {}
    for name, e in engines.items():
        for mode in modes:
            sel = [s for s in e["steps"] if s["R"] == top and s["mode"] == mode and s["seconds"] > 0]
            if sel:
                rates[f"{name}_{mode}"] = sum(s["tokens"] for s in sel) / sum(s["seconds"] for s in sel)
    out["delivered_tokens_per_s_at_most_common_R"] = rates
    return out


def _rolling(x: np.ndarray, n: int) -> np.ndarray:
    return np.convolve(x, np.ones(n) / n, mode="valid") if len(x) >= n else x


def plot(result: dict, path: Path, window: int = 8) -> None:
    """Per engine, the decode rate its steps delivered (rolling mean over `window` steps) against
    its step index; dspark's steps marked by mode, and the rule's three estimates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(13, 6))
    colors = {"dspark": "C0", "plain": "C1", "mtp1": "C2"}
    for name, e in result["engines"].items():
        s = e["steps"]
        rate = np.array([x["tokens"] / x["seconds"] if x["seconds"] > 0 else np.nan for x in s])
        ax.plot(np.arange(len(_rolling(rate, window))) + window // 2, _rolling(rate, window),
                color=colors.get(name), label=f"{name}: delivered (rolling {window} steps), "
                                              f"{e['aggregate']:.1f} tokens/s in all")
    s = result["engines"]["dspark"]["steps"]
    for key, style in (("plain", ":"), ("ranked", "--"), ("uniform", "-.")):
        y = [np.nan if x.get("rule", {}).get(key) is None else x["rule"][key] for x in s]
        ax.plot(y, style, color="k", alpha=0.6, lw=1, label=f"dspark rule's {key} rate")
    for mode, marker in (("uniform", "|"), ("ranked", "x")):
        idx = [i for i, x in enumerate(s) if x["mode"] == mode]
        ax.plot(idx, [ax.get_ylim()[0]] * len(idx), marker, color="C3" if mode == "ranked" else "C4",
                ls="", label=f"dspark {mode} step ({len(idx)})")
    ax.set_xlabel("engine step")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Cost rule step by step: {result['model']}, {result['concurrency']} requests in flight, "
                 f"{result['num_requests']} requests, {result['threads']} thread(s)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    wiring.add_arguments(p, capacity=32, max_seq_len=1024)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--waves", type=int, default=3, help="requests per client (concurrency × waves in all)")
    p.add_argument("--domains", default="code,math,chat")
    p.add_argument("--n-prompts", type=int, default=4, help="prompts per domain")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--out", default=None, help="default: results/rule_trace_<model>_c<C>.json")


def main(args: argparse.Namespace) -> int:
    spec = wiring.from_args(args)
    c = args.concurrency
    spec = replace(spec, capacity=max(spec.capacity, c * len(ENGINES)))  # the engines share the target
    target = wiring.load_target(spec)
    wiring.set_threads(spec, target.device)
    drafter = wiring.load_drafter(spec, target)
    if drafter is None:
        raise SystemExit(f"dspark bench-rule: no drafter for model {spec.model!r} (drafter {spec.drafter!r})")
    engines = {p: wiring.build_engine(replace(spec, policy=p), target=target,
                                      drafter=None if p == "plain" else drafter) for p in ENGINES}
    prompts, source = load_prompts(spec.model_key, args.domains.split(","), args.n_prompts, target.tokenizer)
    prompts = fit_prompts(prompts, spec, args.max_tokens)
    n = c * args.waves
    result = {"model": spec.model, "dtype": str(target.dtype).replace("torch.", ""), "drafter": spec.drafter,
              "concurrency": c, "num_requests": n, "max_tokens": args.max_tokens, "prompts": source,
              "threads": torch.get_num_threads(),
              "engines": trace_loops(engines, prompts, c, n, args.max_tokens)}
    result["summary"] = summarize(result["engines"])
    out = Path(args.out) if args.out else paths.RESULTS / f"rule_trace_{spec.model_key or 'model'}_c{c}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out} and its .png")
    return 0
