"""`dspark eval`: offline drafter evaluation on the real speculative loop (docs/architecture.md §9).

For every drafter × temperature × γ × domain it runs `SpecEngine` with the scheduler off
(policy fixed:γ: every request verifies its own γ drafts with its own generator, so its
blocks are exactly what batch 1 gives; `--concurrency` only packs requests into one
forward for CPU efficiency) and measures τ (bonus included), per-position conditional
acceptance, calibration (ECE / AUROC of the STS survival, before and after the drafter's
stored temperatures) and a threshold sweep replayed from the recorded blocks. Prompts are
the model's held-out eval split (`dspark.tools.prompts.heldout_prompts`; never the
calibration split, never a source document the drafters were trained on for SmolLM2).
Target and drafters are built through `dspark.wiring` (`--model smollm2 | demo | FOLDER`,
drafter names of that model). Writes results/offline_eval<suffix>.json,
results/acceptance_by_position<suffix>.png, results/threshold_sweep<suffix>.png (suffix
"_smollm2" for SmolLM2, none for the demo target) and the acceptance traces
(dspark.tools.traces format) under the model's git-ignored work folder."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from dspark import paths
from dspark.paths import RESULTS
from dspark.runtime.sampling import SamplingParams
from dspark.tools import calibrate as cal
from dspark.tools.metrics import conditional_acceptance, ece, sigmoid, survival, tau

THRESHOLDS = [round(0.05 * i, 2) for i in range(20)] + [0.97, 0.99]
# Names of the compared drafters (the ratio keys of offline_eval.json): a drafter of exactly
# that name, else the first whose name contains the tag.
RATIO_PAIRS = {"dspark_markov_vs_dflash": ("dspark-markov", "dflash"),
               "dspark_markov_vs_eagle": ("dspark-markov", "eagle"),
               "dspark_own_context_vs_taps": ("dspark-own", "dspark-markov")}


def temp_key(t: float) -> str:
    return f"T{t:g}"


def pick(results: dict, tag: str) -> str | None:
    """The drafter named `tag`, else the first whose name contains it ("_" reads as "-")."""
    norm, tag = {n: n.replace("_", "-") for n in results}, tag.replace("_", "-")
    exact = next((n for n in results if n == tag or norm[n] == tag), None)
    return exact or next((n for n in results if tag in norm[n]), None)


def threshold_sweep(trace: cal.BlockTrace, temperatures: list[float] | None,
                    thresholds: list[float] = THRESHOLDS) -> list[dict]:
    """Replay fixed-γ blocks under `threshold:t`: verify the prefix up to the first
    ĉ_k = σ(z_k/T_k) < t; accepted = min(n, ℓ) (a longer verified prefix would have been
    accepted exactly as far: the accept test of d_j does not depend on ℓ for j ≤ ℓ)."""
    g = trace.gamma
    temps = np.ones(g) if temperatures is None else np.asarray(temperatures[:g], dtype=np.float64)
    c = sigmoid(trace.conf_logits / temps)
    rows = []
    for t in thresholds:
        ell = np.cumprod(c >= t, axis=1).sum(1)
        ell = np.minimum(ell, trace.n_verified)
        acc = np.minimum(trace.n_accepted, ell)
        rows.append({"threshold": t, "verified_per_block": float(ell.mean()),
                     "accepted_per_block": float(acc.mean()),
                     "acceptance_rate": float(acc.sum() / ell.sum()) if ell.sum() else None,
                     "tau": float((acc + 1).mean())})
    return rows


def fixed_sweep(trace: cal.BlockTrace) -> list[dict]:
    """The fixed:k reference points of the sweep plot, k = 1..γ."""
    rows = []
    for k in range(1, trace.gamma + 1):
        ell = np.minimum(k, trace.n_verified)
        acc = np.minimum(trace.n_accepted, ell)
        rows.append({"k": k, "verified_per_block": float(ell.mean()), "accepted_per_block": float(acc.mean()),
                     "acceptance_rate": float(acc.sum() / ell.sum()) if ell.sum() else None})
    return rows


def ece_noise_floor(trace: cal.BlockTrace, temperatures: list[float] | None, draws: int = 20,
                    seed: int = 0) -> list[float]:
    """Per position, the mean ECE a perfectly calibrated head would show on this many blocks
    (outcomes redrawn as Bernoulli(â_k)): the sampling noise below which ECE cannot be read."""
    rng = np.random.default_rng(seed)
    a = survival(torch.from_numpy(trace.conf_logits), temperatures).numpy()
    out = []
    for k in range(1, trace.gamma + 1):
        p = a[trace.n_verified >= k, k - 1]
        out.append(float(np.mean([ece(p, rng.uniform(size=p.size) < p) for _ in range(draws)]))
                   if p.size else math.nan)
    return out


def load_eval_prompts(model_key: str | None, n: int, prompts_file: str | None) -> dict[str, list[str]]:
    """Domain -> the model's held-out eval prompts, or {"custom": file prompts}."""
    from dspark.tools import prompts as prompt_sets

    if prompts_file:
        return {"custom": list(prompt_sets.load_prompts_jsonl(prompts_file))[:n]}
    return {d: prompt_sets.heldout_prompts(model_key, "eval", d, n)
            for d in prompt_sets.model_domains(model_key)}


def _nan_to_none(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x


def weights_id(*folders: str | Path | None) -> str:
    """Short content hash of the weights and configs in these folders (which model made a trace)."""
    h = hashlib.sha1()
    for folder in folders:
        if folder is None:
            h.update(b"none")
            continue
        for name in ("config.json", "model.safetensors"):
            path = Path(folder) / name
            if path.is_file():
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def run_matches(run: dict | None, plist: list[list[int]], max_tokens: int, seed: int, models: str) -> bool:
    """Whether a recorded run is exactly the one these models / prompts / settings would make."""
    if run is None or len(run["requests"]) != len(plist) or run.get("models") != models:
        return False
    return all(q.get("max_tokens") == max_tokens and q.get("prompt_tokens") == len(p)
               and q.get("seed") == seed + i for i, (q, p) in enumerate(zip(run["requests"], plist)))


def evaluate_drafter(target, name: str, prompts: dict[str, list[list[int]]], gammas: list[int],
                     temperatures: list[float], max_tokens: int, seed: int, progress=None,
                     concurrency: int = 1, existing: dict | None = None, on_run=None,
                     target_id: str = "", spec=None) -> dict:
    """Every (γ, T, domain) run of one drafter, policy fixed:γ (scheduler off). Runs found
    in `existing` (recorded traces) with the same models and settings are kept, not rerun
    (target_id names the target's weights, see weights_id); on_run(out) is called after
    each new run. -> {"folder", "runs": {(γ, T, domain): {"gamma_effective", "requests":
    [per-request blocks], "wall_s", "models"}}} (existing runs of other settings kept too)."""
    from dspark import wiring
    from dspark.runtime.engine import SpecEngine

    out: dict = {"folder": None, "runs": dict(existing["runs"]) if existing else {}}
    for temp in temperatures:
        for gamma in gammas:
            drafter, folder = cal.resolve_drafter(spec or wiring.Spec(), name, target, gamma)
            models = f"{target_id}/{weights_id(folder)}"
            todo = {d: p for d, p in prompts.items()
                    if not run_matches(out["runs"].get((gamma, temp, d)), p, max_tokens, seed, models)}
            out["folder"] = None if folder is None else str(folder)
            if progress is not None:
                progress.update(sum(len(p) for d, p in prompts.items() if d not in todo))
            g_eff = drafter.gamma  # drafts γ tokens (fewer if its trained block is shorter)
            sts = cal.pad_temperatures(cal.read_calibration(folder), g_eff)  # unused by fixed:γ
            # all domains' prompts share one engine (requests never interact under fixed:γ)
            flat = [(d, i, ids) for d, plist in todo.items() for i, ids in enumerate(plist)]
            if not flat:
                continue
            recorder = cal.RecordingDrafter(drafter)
            engine = SpecEngine(target, recorder, policy=f"fixed:{g_eff}", sts_temperatures=sts,
                                max_batch_tokens=max(4096, target.max_seq_len))
            t0 = time.perf_counter()
            params = [SamplingParams(temperature=temp, seed=seed + i) for _, i, _ in flat]
            tick = None if progress is None else (lambda: progress.update(1))
            done = cal.run_requests(engine, recorder, [ids for _, _, ids in flat], max_tokens, params,
                                    concurrency, on_done=tick)
            wall = (time.perf_counter() - t0) / len(todo)
            for domain in todo:
                requests = [{"prompt_index": i, "prompt_tokens": len(ids), "max_tokens": max_tokens,
                             "seed": seed + i, "emitted": r["emitted"], "verify_steps": r["verify_steps"],
                             "finish_reason": r["finish_reason"], "blocks": r["blocks"],
                             "output": r.get("output")}
                            for (d, i, ids), r in zip(flat, done) if d == domain]
                out["runs"][(gamma, temp, domain)] = {"gamma_effective": g_eff, "requests": requests,
                                                      "wall_s": wall, "models": models,
                                                      "drafter_fallbacks": engine.metrics.drafter_fallbacks}
            if engine.metrics.drafter_fallbacks:
                print(f"warning: {name} failed {engine.metrics.drafter_fallbacks} times (plain steps)")
            if on_run is not None:
                on_run(out)
    return out


def pad_block(block: dict, width: int) -> dict:
    """A block of γ < width positions as a width-γ one (extra positions: not verified)."""
    z = block["conf_logits"]
    return {**block, "conf_logits": list(z) + [0.0] * (width - len(z))}


def run_stats(runs: list[dict]) -> dict:
    """τ, conditional acceptance and all blocks over one or more runs (same γ)."""
    reqs = [q for r in runs for q in r["requests"]]
    blocks = [b for q in reqs for b in q["blocks"]]
    g = runs[0]["gamma_effective"]
    ca = conditional_acceptance([b["n_accepted"] for b in blocks], [b["n_verified"] for b in blocks], g)
    emitted, steps = sum(q["emitted"] for q in reqs), sum(q["verify_steps"] for q in reqs)
    return {"tau": tau(emitted, steps), "emitted": emitted, "verify_steps": steps, "blocks": blocks,
            "cond_acceptance": ca["rate"], "requests": len(reqs), "gamma_effective": g,
            "wall_s": round(sum(r.get("wall_s", 0.0) for r in runs), 2)}


def bootstrap_mean_tau(domain_runs: list[dict], draws: int = 1000, seed: int = 0) -> np.ndarray:
    """Bootstrap draws of the domain-mean τ, resampling requests within each domain. The
    fixed seed makes two drafters' draws paired (same prompts drawn) when their runs hold
    the same prompts, so their ratio's interval is a paired bootstrap."""
    rng = np.random.default_rng(seed)
    total = np.zeros(draws)
    for run in domain_runs:
        emitted = np.array([q["emitted"] for q in run["requests"]], dtype=np.float64)
        steps = np.array([q["verify_steps"] for q in run["requests"]], dtype=np.float64)
        idx = rng.integers(0, len(emitted), size=(draws, len(emitted)))
        total += emitted[idx].sum(1) / np.maximum(steps[idx].sum(1), 1)
    return total / len(domain_runs)


TOKEN_CLASSES = ("newline", "indent", "space", "punct", "digit", "word", "subword", "special")


def token_class(text: str, special: bool = False) -> str:
    """A coarse class of a token's text, for `where_missed`."""
    if special:
        return "special"
    if "\n" in text:
        return "newline"
    if text and not text.strip():
        return "indent" if len(text) > 1 else "space"
    core = text.strip()
    if core.isdigit():
        return "digit"
    if core and all(not c.isalnum() for c in core):
        return "punct"
    return "word" if text[:1] == " " or core[:1].isupper() else "subword"


def where_missed(requests: list[dict], tokenizer) -> dict:
    """Which target tokens the drafter got (accepted drafts) and which it missed (the token
    the target emitted at a rejection: a correction), by token class. Each block of n
    accepted drafts emits output tokens n accepted + 1 corrected-or-bonus; the bonus (all ℓ
    accepted) is neither. -> {class: {"accepted", "missed", "rate"}} (rate = accepted share)."""
    specials = {i for i in range(tokenizer.get_vocab_size()) if (t := tokenizer.id_to_token(i)) and
                t.startswith("<|") and t.endswith("|>")} if tokenizer is not None else set()
    counts = {c: [0, 0] for c in TOKEN_CLASSES}
    for q in requests:
        out = q.get("output")
        if not out:
            continue
        pos = 1  # output[0] came from the prefill
        for b in q["blocks"]:
            n, ell = b["n_accepted"], b["n_verified"]
            toks = out[pos:pos + n + 1]
            for j, tok in enumerate(toks):
                if j < n:
                    counts[token_class(tokenizer.decode([tok]), tok in specials)][0] += 1
                elif n < ell:  # the corrected token: the drafter's d_{n+1} was rejected here
                    counts[token_class(tokenizer.decode([tok]), tok in specials)][1] += 1
            pos += n + 1
    return {c: {"accepted": a, "missed": m, "rate": a / (a + m) if a + m else None}
            for c, (a, m) in counts.items()}


def summarise(results: dict[str, dict], gammas: list[int], temperatures: list[float],
              domains: list[str], tokenizer=None,
              pairs: dict[str, tuple[str, str]] | None = None) -> dict:
    """The offline_eval.json payload from per-drafter runs; STS temperatures are read from
    each drafter folder now (τ at fixed γ does not depend on them, ECE and sweeps do).
    `pairs` names the τ ratios to report (default RATIO_PAIRS)."""
    summary: dict = {"tau": {}, "ece": {}, "acceptance_by_position": {}, "threshold_sweep": {},
                     "fixed_sweep": {}, "ratios": {}, "ratios_detail": {}, "runs": {}, "where_missed": {}}
    g_cal, t_cal = max(gammas), (1.0 if 1.0 in temperatures else temperatures[0])
    for name, res in results.items():
        runs = res["runs"]
        tau_d, acc_d, run_d = {}, {}, {}
        for gamma in gammas:
            gk = f"gamma{gamma}"
            tau_d[gk], acc_d[gk], run_d[gk] = {}, {}, {}
            for temp in temperatures:
                tk = temp_key(temp)
                stats = {d: run_stats([runs[(gamma, temp, d)]]) for d in domains}
                tau_d[gk][tk] = {d: s["tau"] for d, s in stats.items()}
                tau_d[gk][tk]["mean"] = float(np.mean([s["tau"] for s in stats.values()]))
                draws = bootstrap_mean_tau([runs[(gamma, temp, d)] for d in domains])
                tau_d[gk][tk]["mean_ci95"] = np.percentile(draws, [2.5, 97.5]).tolist()
                pooled = run_stats([runs[(gamma, temp, d)] for d in domains])
                acc_d[gk][tk] = {"all": pooled["cond_acceptance"],
                                 **{d: s["cond_acceptance"] for d, s in stats.items()}}
                run_d[gk][tk] = {d: {k: s[k] for k in ("emitted", "verify_steps", "requests", "wall_s",
                                                       "gamma_effective")} | {"blocks": len(s["blocks"])}
                                 for d, s in stats.items()}
        summary["tau"][name], summary["acceptance_by_position"][name] = tau_d, acc_d
        summary["runs"][name] = run_d
        sts = cal.read_calibration(res.get("folder"))
        shifts = cal.read_sts_shifts(res.get("folder"))  # affine STS (None: temperature-only)
        # calibration on every T = t_cal block (all γ): position k counts where it was verified
        width = max(runs[(g, t_cal, domains[0])]["gamma_effective"] for g in gammas)
        blocks = [pad_block(b, width) for g in gammas
                  for b in run_stats([runs[(g, t_cal, d)] for d in domains])["blocks"]]
        if blocks:
            trace = cal.BlockTrace.from_rows(blocks)
            temps = cal.pad_temperatures(sts, trace.gamma)
            shipped = cal.fold_shifts(trace, temps, shifts)
            before, after = cal.position_report(trace, None), cal.position_report(shipped, temps)
            summary["ece"][name] = {
                "gammas": gammas, "temperature": t_cal, "n_blocks": len(trace),
                "n_per_position": [int((trace.n_verified >= k).sum()) for k in range(1, trace.gamma + 1)],
                "sts": "affine" if shifts else "temperature", "sts_temperatures": sts, "sts_shifts": shifts,
                "before": before["ece"], "after": after["ece"],
                "auroc_before": before["auroc"], "auroc_after": after["auroc"],
                "noise_floor_after": ece_noise_floor(shipped, temps)}
            affine = cal.read_affine(res.get("folder"))
            if affine is not None:  # the affine-STS ablation, parameters fitted by `dspark calibrate`
                params = (affine + [affine[-1]] * trace.gamma)[:trace.gamma]
                summary["ece"][name]["affine_ablation_after"] = cal.affine_report(trace, params)
            t_only = cal.read_temperature_only(res.get("folder"))
            if t_only is not None:  # affine ships: the temperature-only fit beside it
                summary["ece"][name]["temperature_only_after"] = cal.position_report(
                    trace, cal.pad_temperatures(t_only, trace.gamma))["ece"]
        if tokenizer is not None:  # γ = min(gammas), T = 0: where the greedy drafts go wrong
            g0, t0 = min(gammas), (0.0 if 0.0 in temperatures else temperatures[-1])
            summary["where_missed"][name] = {"gamma": g0, "temperature": t0, **{
                d: where_missed(runs[(g0, t0, d)]["requests"], tokenizer) for d in domains}}
        sweep_blocks = run_stats([runs[(g_cal, t_cal, d)] for d in domains])["blocks"]
        if sweep_blocks:
            trace = cal.BlockTrace.from_rows(sweep_blocks)
            temps = cal.pad_temperatures(sts, trace.gamma)
            summary["threshold_sweep"][name] = threshold_sweep(cal.fold_shifts(trace, temps, shifts), temps)
            summary["fixed_sweep"][name] = fixed_sweep(trace)
    for key, (num_tag, den_tag) in (RATIO_PAIRS if pairs is None else pairs).items():
        num, den = pick(results, num_tag), pick(results, den_tag)
        if num is None or den is None or num == den:
            continue
        summary["ratios"][key] = {}
        summary["ratios_detail"][key] = {"numerator": num, "denominator": den}
        for gamma in gammas:
            gk = f"gamma{gamma}"
            for temp in temperatures:
                tk = temp_key(temp)
                a, b = summary["tau"][num][gk][tk], summary["tau"][den][gk][tk]
                detail = {d: a[d] / b[d] for d in a if not isinstance(a[d], list) and b.get(d)}
                draws = [bootstrap_mean_tau([results[n]["runs"][(gamma, temp, d)] for d in domains])
                         for n in (num, den)]
                detail["mean_ci95"] = np.percentile(draws[0] / draws[1], [2.5, 97.5]).tolist()
                summary["ratios_detail"][key].setdefault(gk, {})[tk] = detail
                if temp == t_cal:
                    summary["ratios"][key][gk] = detail["mean"]
    return summary


def training_cost(results: dict[str, dict], baseline: str, summary: dict) -> dict:
    """Per drafter: training minutes (its folder's train.json: CPU-minutes for a CPU run, wall
    minutes on the GPU for a GPU run, keys named `cpu` / `gpu`), the extra minutes over the
    baseline, and the τ gain (macro mean, every γ and T) per extra minute: where a bigger
    training budget pays most. A drafter without train.json (ngram) is left out."""
    def cost(name: str) -> tuple[str, float] | None:
        folder = results[name].get("folder")
        f = Path(folder) / "train.json" if folder else None
        if f is None or not f.is_file():
            return None
        info = json.loads(f.read_text())
        if info.get("device", "cpu") != "cpu":
            return "gpu", round(info["train_seconds"] / 60, 2)
        return ("cpu", round(info["train_cpu_seconds"] / 60, 2)) if info.get("train_cpu_seconds") else None

    base, out = cost(baseline), {}
    for name in results:
        c = cost(name)
        if c is None:
            continue
        unit, minutes = c
        row: dict = {f"train_{unit}_min": minutes}
        if base is not None and base[0] == unit and name != baseline:
            extra = round(minutes - base[1], 2)
            row[f"extra_{unit}_min"] = extra
            for gk, by_t in summary["tau"][name].items():
                for tk, tau_row in by_t.items():
                    gain = tau_row["mean"] - summary["tau"][baseline][gk][tk]["mean"]
                    row.setdefault("tau_gain", {}).setdefault(gk, {})[tk] = round(gain, 4)
                    if abs(extra) > 1:  # per-minute only where the budgets differ noticeably
                        row.setdefault(f"tau_gain_per_extra_{unit}_min", {}).setdefault(gk, {})[tk] = \
                            round(gain / extra, 5)
        out[name] = row
    return out


def write_runs(path: Path, drafter: str, result: dict) -> None:
    """Every recorded run of a drafter, one JSON line per request (all blocks, with how many
    positions were verified): what `--reuse-traces` reads back."""
    with open(path, "w") as f:
        for (gamma, temp, domain), run in result["runs"].items():
            for req in run["requests"]:
                f.write(json.dumps({"drafter": drafter, "folder": result.get("folder"), "gamma": gamma,
                                    "gamma_effective": run["gamma_effective"], "temperature": temp,
                                    "domain": domain, "models": run.get("models"), **req}) + "\n")


RUN_KEYS = ("drafter", "folder", "gamma", "gamma_effective", "temperature", "domain", "models")


def read_runs(path: Path) -> dict:
    """Inverse of write_runs (wall times are not kept)."""
    out: dict = {"folder": None, "runs": {}}
    for line in open(path):
        if not line.strip():
            continue
        row = json.loads(line)
        out["folder"] = row.get("folder")
        run = out["runs"].setdefault((int(row["gamma"]), float(row["temperature"]), row["domain"]),
                                     {"gamma_effective": int(row["gamma_effective"]), "requests": [],
                                      "models": row.get("models")})
        run["requests"].append({k: v for k, v in row.items() if k not in RUN_KEYS})
    return out


def write_sim_traces(traces_dir: Path, drafter: str, result: dict, domains: list[str],
                     target: str) -> list[Path]:
    """Acceptance traces in the simulator's format (dspark.tools.traces): per (γ, T) a file
    <drafter>_gamma<γ>_T<T>.jsonl, and <drafter>.jsonl for the largest γ at T = 1. Only
    blocks whose γ positions were all verified are written (the format's `accepted` is
    the accepted length under full verification; a request's last block may be capped)."""
    from dspark.tools.traces import save_traces

    sts = cal.read_calibration(result.get("folder"))
    shifts = cal.read_sts_shifts(result.get("folder"))  # affine STS: folded into the logits
    configs = sorted({(g, t) for (g, t, d) in result["runs"] if d in domains})
    written = []
    for gamma, temp in configs:
        z, acc, ids, request = [], [], [], 0
        g_eff = gamma
        for domain in domains:
            run = result["runs"].get((gamma, temp, domain))
            if run is None:
                continue
            g_eff = run["gamma_effective"]
            for req in run["requests"]:
                for b in req["blocks"]:
                    if b["n_verified"] == g_eff:
                        z.append(b["conf_logits"])
                        acc.append(b["n_accepted"])
                        ids.append(request)
                request += 1
        if not z:
            continue
        temps = cal.pad_temperatures(sts, g_eff)
        z = cal.fold_logits(np.asarray(z), temps, shifts)  # the simulator's format is temperature-only
        meta = {"gamma": g_eff, "temperatures": temps, "drafter": drafter,
                "sampling_temperature": temp, "domains": domains, "target": target, "requests": request,
                "source": f"dspark eval: {drafter}, fixed:{g_eff}, T={temp:g}, eval prompts"}
        path = traces_dir / f"{drafter}_gamma{gamma}_{temp_key(temp)}.jsonl"
        save_traces(path, np.asarray(z), np.asarray(acc), np.asarray(ids), meta)
        written.append(path)
    main = [(g, t) for g, t in configs if t == 1.0] or configs
    if main:
        gamma, temp = max(main)
        src = traces_dir / f"{drafter}_gamma{gamma}_{temp_key(temp)}.jsonl"
        if src.is_file():
            (traces_dir / f"{drafter}.jsonl").write_text(src.read_text())
    return written


def plot_acceptance(summary: dict, path: Path, gamma: int, temperatures: list[float]) -> None:
    """Per-position conditional acceptance per drafter (like the paper's Figure 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(temperatures), figsize=(5.5 * len(temperatures), 4), squeeze=False)
    for ax, temp in zip(axes[0], temperatures):
        for name, acc in summary["acceptance_by_position"].items():
            rate = acc[f"gamma{gamma}"][temp_key(temp)]["all"]
            ks = [k + 1 for k, r in enumerate(rate) if r is not None]
            ax.plot(ks, [r for r in rate if r is not None], marker="o", ms=3, label=name)
        ax.set(xlabel="draft position k", ylabel="P(d_k accepted | d_<k accepted)", ylim=(0, 1.02),
               title=f"conditional acceptance, γ={gamma}, T={temp:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_threshold_sweep(summary: dict, path: Path) -> None:
    """Acceptance rate vs verified tokens per block: threshold policy vs fixed k (Figure 5)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, (name, rows) in enumerate(summary["threshold_sweep"].items()):
        color = f"C{i}"
        pts = [(r["verified_per_block"], r["acceptance_rate"]) for r in rows
               if r["acceptance_rate"] is not None]
        ax.plot(*zip(*pts), marker="o", ms=3, color=color, label=f"{name} threshold")
        fixed = [(r["verified_per_block"], r["acceptance_rate"]) for r in summary["fixed_sweep"][name]
                 if r["acceptance_rate"] is not None]
        ax.plot(*zip(*fixed), ls="--", color=color, alpha=0.6, label=f"{name} fixed k")
    ax.set(xlabel="verified draft tokens per block", ylabel="acceptance rate (accepted / verified)",
           ylim=(0, 1.02), title="threshold sweep (STS-calibrated ĉ)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="target: smollm2 (default), demo (10M demo target) or a Hugging Face folder")
    p.add_argument("--dtype", default="auto", help="target dtype (auto: the serving dtype, dspark.wiring)")
    p.add_argument("--drafters", default=None,
                   help="comma list of the model's drafter names, folders, 'ngram' (default: all + ngram)")
    p.add_argument("--prompts", default=None, help="FILE.jsonl of {'turns': [...]} or {'prompt': ...} lines")
    # Defaults sized for the shared 2-core CPU: 6 drafters x 2 T x 2 γ x 3 domains took 7.5 min
    # on the demo target at load ~2 (expect ~20 min when the machine is busy).
    p.add_argument("--n-prompts", type=int, default=8, help="eval prompts per domain")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="keep the last N prompt tokens")
    p.add_argument("--gammas", default="7,15", help="comma list of fixed verify lengths γ")
    p.add_argument("--temperatures", default="1,0", help="comma list of sampling temperatures")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 prompt per domain, 12 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--concurrency", type=int, default=12,
                   help="requests in flight (1 = literal batch 1). Under fixed:γ each request keeps its own "
                        "ℓ, generator and acceptance, so this changes CPU efficiency, not the statistics")
    p.add_argument("--out", default=None, help="default: results/offline_eval<suffix>.json")
    p.add_argument("--traces-dir", default=None, help="default: the model's work folder /traces")
    p.add_argument("--baseline", default=None,
                   help="ablations: report every drafter's τ ÷ this one's (paired bootstrap) and its "
                        "τ gain per extra training CPU-minute (from each folder's train.json)")
    p.add_argument("--reuse-traces", action="store_true",
                   help="take a drafter's runs from its trace file when it holds exactly this config")


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dspark import wiring

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.quick:
        args.n_prompts, args.max_tokens = 1, 12
    gammas = [int(g) for g in args.gammas.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    max_seq_len = args.max_prompt_tokens + args.max_tokens + max(gammas) + 8
    spec = cal.model_spec(args, args.concurrency, max_seq_len)
    suffix = cal.results_suffix(spec)
    names = args.drafters.split(",") if args.drafters else cal.model_drafters(spec) + ["ngram"]
    keys = [Path(n).name for n in names]
    if args.baseline and args.baseline not in keys:  # before the (long) runs, not after them
        raise SystemExit(f"--baseline {args.baseline!r} is not among --drafters ({', '.join(keys)})")
    out_path = Path(args.out) if args.out else RESULTS / f"offline_eval{suffix}.json"
    traces_dir = Path(args.traces_dir) if args.traces_dir else cal.work_dir(spec) / "traces"
    target = wiring.load_target(spec)
    target_id = weights_id(wiring.model_folder(spec.model))
    texts = load_eval_prompts(spec.model_key, args.n_prompts, args.prompts)
    prompts = {d: [cal.encode_prompt(target, t, args.max_prompt_tokens) for t in ts]
               for d, ts in texts.items()}
    total = len(names) * len(gammas) * len(temperatures) * sum(len(v) for v in prompts.values())
    results, t0 = {}, time.perf_counter()
    with tqdm(total=total, desc="dspark eval", unit="req") as bar:
        for name in names:
            key = Path(name).name
            bar.set_postfix_str(key)
            runs_path = traces_dir / f"{key}.runs.jsonl"
            old = read_runs(runs_path) if args.reuse_traces and runs_path.is_file() else None
            traces_dir.mkdir(parents=True, exist_ok=True)
            results[key] = evaluate_drafter(target, name, prompts, gammas, temperatures, args.max_tokens,
                                            args.seed, bar, args.concurrency, existing=old,
                                            on_run=lambda res, p=runs_path, k=key: write_runs(p, k, res),
                                            target_id=target_id, spec=spec)
            write_runs(runs_path, key, results[key])
    pairs = None if not args.baseline else \
        {f"{n}_vs_{args.baseline}": (n, args.baseline) for n in results if n != args.baseline}
    summary = summarise(results, gammas, temperatures, list(prompts), target.tokenizer, pairs)
    if args.baseline:
        summary["training_cost"] = training_cost(results, args.baseline, summary)
    summary["config"] = {"model": spec.model, "dtype": str(target.dtype).removeprefix("torch."),
                         "drafters": list(results), "gammas": gammas,
                         "temperatures": temperatures, "n_prompts_per_domain": args.n_prompts,
                         "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens,
                         "prompts": args.prompts or "the model's held-out eval split (dspark.tools.prompts)",
                         "domains": list(prompts), "policy": "fixed:γ (scheduler off)",
                         "concurrency": args.concurrency, "traces": paths.relative(traces_dir),
                         "seed": args.seed, "threads": args.threads,
                         "wall_s": round(time.perf_counter() - t0, 1)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(_nan_to_none(summary), indent=1) + "\n")
    for key, res in results.items():
        write_sim_traces(traces_dir, key, res, list(prompts), spec.model)
    # plots follow the JSON's name: offline_eval_smollm2_ablations.json -> *_smollm2_ablations.png
    stem, base = out_path.stem, f"offline_eval{suffix}"
    plot_suffix = suffix + (stem.removeprefix(base) if stem.startswith(base)
                            else "" if stem == "offline_eval" else f"_{stem}")
    plot_acceptance(summary, out_path.parent / f"acceptance_by_position{plot_suffix}.png", max(gammas),
                    temperatures)
    plot_threshold_sweep(summary, out_path.parent / f"threshold_sweep{plot_suffix}.png")
    print_table(summary, gammas, temperatures)
    print(f"wrote {out_path}, plots, and traces in {traces_dir} ({summary['config']['wall_s']} s)")
    return 0


def print_table(summary: dict, gammas: list[int], temperatures: list[float]) -> None:
    for name, by_gamma in summary["tau"].items():
        for gk, by_t in by_gamma.items():
            for tk, row in by_t.items():
                cells = " ".join(f"{d}={v:.2f}" for d, v in row.items() if not isinstance(v, list))
                if "mean_ci95" in row:
                    cells += " (95% CI {:.2f}-{:.2f})".format(*row["mean_ci95"])
                print(f"tau {name:>16} {gk:>8} {tk:>3}: {cells}")
    for key, r in summary["ratios"].items():
        print(f"{key}: " + " ".join(f"{g}={v:.3f}" for g, v in r.items()))
