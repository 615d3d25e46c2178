"""`dspark calibrate`: Sequential Temperature Scaling of a drafter's confidence head
(docs/architecture.md §8).

The drafter runs against the target with a fixed verify length γ (scheduler off, so
each request's blocks are what batch 1 gives), on held-out prompts. Every drafted block
gives confidence logits z [γ] and the realised prefix survival n (accepted draft tokens).
For k = 1..γ in order, T_k is the grid point minimising the 20-bin ECE of
â_k = Π_{i≤k} σ(z_i/T_i) against 1[n ≥ k], with T_<k already fixed. Temperatures go to
<drafter>/calibration.json; ECE and AUROC per position, before (all T = 1) and after,
are reported and stored beside them."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch

from dspark.runtime.drafter import (  # noqa: F401 (re-exported)
    build_drafter,
    pad_temperatures,
    read_calibration,
    read_sts_shifts,
)
from dspark.runtime.drafter.files import CALIBRATION_FILE, read_calibration_file
from dspark.runtime.sampling import SamplingParams
from dspark.tools.metrics import ECE_BINS, auroc, ece, reliability, sigmoid, survival
from dspark.tools.traces import BlockTrace, read_block_trace  # noqa: F401 (the one trace format)

# Log-spaced temperatures 0.05 .. 20 (ECE is piecewise constant in T, so a grid suffices).
STS_GRID = np.exp(np.linspace(math.log(0.05), math.log(20.0), 241))
MIN_CLASS = 5  # survivors and failures a position needs before its T_k is fitted
CALIBRATION_FRACTION = 4  # one prompt in 4 (by content hash) is held out for calibration


def is_calibration_prompt(text: str) -> bool:
    """Deterministic held-out split by content: calibration prompts never appear in eval."""
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16) % CALIBRATION_FRACTION == 0


def _observed(trace: BlockTrace, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(mask of blocks where position k was verified, survival indicator 1[n ≥ k])."""
    return trace.n_verified >= k, trace.n_accepted >= k


def _ece_per_row(conf: np.ndarray, outcome: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of each row of conf [G, N] against the same outcomes [N] (= metrics.ece per row)."""
    g, n = conf.shape
    b = np.clip(np.floor(conf * n_bins).astype(np.int64), 0, n_bins - 1) + n_bins * np.arange(g)[:, None]
    sum_c = np.bincount(b.ravel(), weights=conf.ravel(), minlength=g * n_bins)
    sum_y = np.bincount(b.ravel(), weights=np.broadcast_to(outcome, (g, n)).ravel().astype(np.float64),
                        minlength=g * n_bins)
    return np.abs(sum_c - sum_y).reshape(g, n_bins).sum(1) / n


def fit_sts(trace: BlockTrace, grid: np.ndarray = STS_GRID, n_bins: int = ECE_BINS,
            min_class: int = MIN_CLASS) -> list[float]:
    """Sequential Temperature Scaling: T_1..T_γ, each the ECE-minimising grid point given
    T_<k (ties go to the temperature closest to 1). A position with fewer than `min_class`
    survivors or failures among its verified blocks has nothing to fit (the minimiser
    runs to the grid's edge): it keeps the previous position's T (1 for k = 1)."""
    z = trace.conf_logits
    temps: list[float] = []
    prefix = np.ones(len(trace))  # Π_{i<k} σ(z_i/T_i) with the fitted T_i
    tie_order = np.argsort(np.abs(np.log(grid)), kind="stable")
    for k in range(1, trace.gamma + 1):
        mask, alive = _observed(trace, k)
        best_t = temps[-1] if temps else 1.0
        n_alive = int(alive[mask].sum())
        if min(n_alive, int(mask.sum()) - n_alive) >= min_class:
            zk, pre, y = z[mask, k - 1], prefix[mask], alive[mask]
            errors = _ece_per_row(pre * sigmoid(zk[None, :] / grid[:, None]), y, n_bins)
            best_t = float(grid[tie_order[np.argmin(errors[tie_order])]])
        temps.append(best_t)
        prefix = prefix * sigmoid(z[:, k - 1] / best_t)
    return temps


def position_report(trace: BlockTrace, temperatures: list[float] | None) -> dict[str, list]:
    """Per position k: ECE (20 bins) and AUROC of â_k vs 1[n ≥ k] over verified blocks."""
    a = survival(torch.from_numpy(trace.conf_logits), temperatures).numpy()
    ece_k, auroc_k = [], []
    for k in range(1, trace.gamma + 1):
        mask, alive = _observed(trace, k)
        ece_k.append(ece(a[mask, k - 1], alive[mask]))
        auroc_k.append(auroc(a[mask, k - 1], alive[mask]))
    return {"ece": ece_k, "auroc": auroc_k}


def pooled(trace: BlockTrace, temperatures: list[float] | None) -> tuple[np.ndarray, np.ndarray]:
    """All (â_k, 1[n ≥ k]) pairs over positions, for pooled reliability diagrams."""
    a = survival(torch.from_numpy(trace.conf_logits), temperatures).numpy()
    k = np.arange(1, trace.gamma + 1)[None, :]
    mask = trace.n_verified[:, None] >= k
    return a[mask], (trace.n_accepted[:, None] >= k)[mask]


AFFINE_SHIFTS = np.linspace(-3.0, 3.0, 61)


def affine_survival(z: np.ndarray, params: list[tuple[float, float]]) -> np.ndarray:
    """â_k = Π_{i≤k} σ(z_i/T_i + b_i) for z [N, γ] and params [(T_i, b_i)] (γ of them)."""
    t = np.asarray([p[0] for p in params])
    b = np.asarray([p[1] for p in params])
    return np.cumprod(sigmoid(z[:, :len(params)] / t + b), axis=1)


def fit_affine_sts(trace: BlockTrace, grid: np.ndarray = STS_GRID, shifts: np.ndarray = AFFINE_SHIFTS,
                   n_bins: int = ECE_BINS, min_class: int = MIN_CLASS) -> list[tuple[float, float]]:
    """The affine ablation of STS: per position a temperature AND a logit shift,
    ĉ_k = σ(z_k/T_k + b_k), fitted in order like `fit_sts` (joint grid over T and b). A shift
    can remove a bias of the head that a temperature (which keeps z = 0 at ½) cannot."""
    z = trace.conf_logits
    params: list[tuple[float, float]] = []
    prefix = np.ones(len(trace))
    tt, bb = np.meshgrid(grid, shifts, indexing="ij")
    tt, bb = tt.ravel(), bb.ravel()
    tie = np.lexsort((np.abs(bb), np.abs(np.log(tt))))
    for k in range(1, trace.gamma + 1):
        mask, alive = _observed(trace, k)
        best = params[-1] if params else (1.0, 0.0)
        n_alive = int(alive[mask].sum())
        if min(n_alive, int(mask.sum()) - n_alive) >= min_class:
            zk, pre, y = z[mask, k - 1], prefix[mask], alive[mask]
            errors = _ece_per_row(pre * sigmoid(zk[None, :] / tt[:, None] + bb[:, None]), y, n_bins)
            i = tie[np.argmin(errors[tie])]
            best = (float(tt[i]), float(bb[i]))
        params.append(best)
        prefix = prefix * sigmoid(z[:, k - 1] / best[0] + best[1])
    return params


def affine_report(trace: BlockTrace, params: list[tuple[float, float]]) -> list[float]:
    """Per-position ECE of the affine-calibrated survival."""
    a = affine_survival(trace.conf_logits, params)
    return [ece(a[m, k - 1], y[m]) for k in range(1, trace.gamma + 1) for m, y in [_observed(trace, k)]]


def fold_logits(z: np.ndarray, temperatures: list[float] | None, shifts: list[float] | None) -> np.ndarray:
    """Logits [N, γ] → z_k + b_k·T_k, so that temperature-only STS on them equals affine STS
    σ(z_k / T_k + b_k) on z (z itself when there are no shifts)."""
    if not shifts:
        return z
    g = z.shape[1]
    t = np.asarray(pad_temperatures(temperatures, g), dtype=np.float64)
    b = np.asarray((list(shifts) + [0.0] * g)[:g], dtype=np.float64)
    return z + b * t


def fold_shifts(trace: BlockTrace, temperatures: list[float], shifts: list[float] | None) -> BlockTrace:
    """The trace with its logits folded (`fold_logits`): the reports and sweeps take it as is."""
    if not shifts:
        return trace
    return BlockTrace(fold_logits(trace.conf_logits, temperatures, shifts), trace.n_accepted,
                      trace.n_verified, trace.request_ids, dict(trace.meta))


def calibrate_trace(trace: BlockTrace, affine: bool = True, sts: str = "temperature") -> dict:
    """Fit STS and measure before/after: the calibration.json payload. `sts` = "temperature"
    ships σ(z/T_k) (the paper's STS; the affine fit is kept as an ablation when `affine`);
    "affine" ships σ(z/T_k + b_k) ("sts_shifts"), with the temperature-only fit kept beside it."""
    temps = fit_sts(trace)
    before, after = position_report(trace, None), position_report(trace, temps)
    out = {
        "sts": "temperature",
        "sts_temperatures": temps,
        "gamma": trace.gamma,
        "n_blocks": len(trace),
        "ece_before": before["ece"],
        "ece_after": after["ece"],
        "auroc_before": before["auroc"],
        "auroc_after": after["auroc"],
    }
    if sts not in ("temperature", "affine"):
        raise ValueError(f"sts must be temperature or affine, got {sts!r}")
    if affine or sts == "affine":
        params = fit_affine_sts(trace)
        a_temps, a_shifts = [float(t) for t, _ in params], [float(b) for _, b in params]
        a_rep = position_report(fold_shifts(trace, a_temps, a_shifts), a_temps)
        if sts == "affine":
            out |= {"sts": "affine", "sts_temperatures": a_temps, "sts_shifts": a_shifts,
                    "ece_after": a_rep["ece"], "auroc_after": a_rep["auroc"],
                    "temperature_only": {"sts_temperatures": temps, "ece_after": after["ece"],
                                         "auroc_after": after["auroc"],
                                         "note": "σ(z/T) per position; the fit serving does not use"}}
        else:
            out["affine_ablation"] = {"params": [list(p) for p in params], "ece_after": a_rep["ece"],
                                      "note": "σ(z/T + b) per position; not used at serving time"}
    return out


def plot_reliability(trace: BlockTrace, temperatures: list[float], title: str, path: Path) -> None:
    """Pooled reliability diagram before/after STS plus per-position ECE bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4.2))
    ax0.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
    for temps, label, marker in ((None, "before (T=1)", "o"), (temperatures, "after STS", "s")):
        r = reliability(*pooled(trace, temps))
        xs = [c for c, n in zip(r["mean_conf"], r["count"]) if n]
        ys = [f for f, n in zip(r["frequency"], r["count"]) if n]
        ax0.plot(xs, ys, marker=marker, label=f"{label}, pooled ECE {100 * ece(*pooled(trace, temps)):.1f}%")
    ax0.set(xlabel="predicted survival â_k", ylabel="observed 1[n ≥ k]", xlim=(0, 1), ylim=(0, 1),
            title=f"{title}: reliability (all verified k)")
    ax0.legend(fontsize=8)
    before, after = position_report(trace, None), position_report(trace, temperatures)
    ks = np.arange(1, trace.gamma + 1)
    ax1.bar(ks - 0.2, 100 * np.asarray(before["ece"]), 0.4, label="before")
    ax1.bar(ks + 0.2, 100 * np.asarray(after["ece"]), 0.4, label="after STS")
    ax1.axhline(2.0, color="k", ls=":", lw=1)
    ax1.set(xlabel="position k", ylabel="ECE (%)", title="ECE per position (20 bins)")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_affine(folder: str | Path | None) -> list[tuple[float, float]] | None:
    """The affine-STS ablation's (T_k, b_k) stored in a drafter's calibration.json, if any."""
    params = read_calibration_file(folder).get("affine_ablation", {}).get("params")
    return None if not params else [(float(t), float(b)) for t, b in params]


def read_temperature_only(folder: str | Path | None) -> list[float] | None:
    """Where affine STS ships: the temperature-only fit kept beside it ("temperature_only")."""
    temps = read_calibration_file(folder).get("temperature_only", {}).get("sts_temperatures")
    return None if not temps else [float(t) for t in temps]


def write_calibration(drafter_dir: Path, payload: dict) -> Path:
    path = Path(drafter_dir) / CALIBRATION_FILE
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


# ---- recording traces on the real speculative loop ----

class RecordingDrafter:
    """Delegates to a drafter and records, per slot, the confidence logits of the block the
    engine verified in the last step, so the engine loop runs unchanged while we record z per
    drafted block. The engine proposes a step's drafts at the end of the step before, so the
    verified block is the latest proposal when `extend` (right after verification) is called."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gamma = int(inner.gamma)
        self.last_conf: dict[int, list[float]] = {}  # slot -> z [γ] of the block verified last step
        self._proposed: dict[int, list[float]] = {}  # slot -> z [γ] of its latest propose()

    def start(self, slot, prompt, taps):
        return self.inner.start(slot, prompt, taps)

    def release(self, slot):
        self._proposed.pop(slot, None)
        return self.inner.release(slot)

    def extend(self, slots, tokens, taps, cu_seqlens, keep):
        for s in slots:
            if s in self._proposed:
                self.last_conf[s] = self._proposed.pop(s)
        return self.inner.extend(slots, tokens, taps, cu_seqlens, keep)

    def propose(self, slots, anchors, params, uniforms):
        block = self.inner.propose(slots, anchors, params, uniforms)
        z = block.conf_logits.detach().float().cpu()
        self._proposed.update({int(s): [round(float(v), 4) for v in z[i]] for i, s in enumerate(slots)})
        return block

    def draft_probs(self, slots, lengths):
        return self.inner.draft_probs(slots, lengths)


def run_requests(engine, recorder: RecordingDrafter, prompts: list[list[int]], max_tokens: int,
                 params: list[SamplingParams], concurrency: int = 1, on_done=None) -> list[dict]:
    """Run prompts through `engine` (built on `recorder`), at most `concurrency` at a time
    (1 = batch 1). Per request: its blocks [{"conf_logits", "n_accepted", "n_verified"}],
    emitted tokens and verify steps. With policy fixed:γ a request's acceptance does not
    depend on the others in the batch (own generator, own ℓ), so concurrency only buys
    CPU efficiency."""
    pending, live, results = list(range(len(prompts))), {}, [None] * len(prompts)
    while pending or live:
        while pending and len(live) < concurrency:
            i = pending.pop(0)
            live[i] = (engine.add_request(prompts[i], max_tokens, params[i]), [])
        before = {i: (r.verify_steps, sum(r.verified), sum(r.accepted)) for i, (r, _) in live.items()}
        recorder.last_conf = {}
        engine.step()
        for i, (req, blocks) in list(live.items()):
            steps, verified, accepted = before[i]
            if req.verify_steps > steps and req.slot in recorder.last_conf:
                blocks.append({"conf_logits": recorder.last_conf[req.slot],
                               "n_accepted": sum(req.accepted) - accepted,
                               "n_verified": sum(req.verified) - verified})
            if req.finished:
                results[i] = {"blocks": blocks, "emitted": req.verify_emitted,
                              "verify_steps": req.verify_steps, "output_len": len(req.output),
                              "finish_reason": req.finish_reason, "output": list(req.output)}
                del live[i]
                if on_done is not None:
                    on_done()
    return results


# ---- drafters, prompts and trace files shared with `dspark eval` ----

def encode_prompt(target, text: str, max_prompt_tokens: int) -> list[int]:
    """Token ids of a prompt, keeping its last `max_prompt_tokens` (the CPU budget)."""
    from dspark.runtime.text import encode

    ids = encode(target.tokenizer, text)
    return ids[-max_prompt_tokens:] or [0]


def split_prompts(domain: str, n: int, calibration: bool) -> list[str]:
    """Up to n prompts of a domain from one side of the deterministic calibration split."""
    from dspark.tools.prompts import load_prompt_set

    pool = load_prompt_set(domain, n * CALIBRATION_FRACTION * 3)
    texts = [p if isinstance(p, str) else p["prompt"] for p in pool]
    return [t for t in texts if is_calibration_prompt(t) == calibration][:n]


# ---- CLI ----

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True,
                   help="drafter name (the model's shipped drafters), a folder, ngram; comma list; or 'all'")
    p.add_argument("--model", default="smollm2", help="target: smollm2 (default), demo or an HF folder")
    p.add_argument("--dtype", default="auto", help="target dtype (auto: the serving dtype, dspark.wiring)")
    p.add_argument("--traces", default=None,
                   help="fit from a recorded trace JSONL (dspark.tools.traces), not a new run")
    p.add_argument("--gamma", type=int, default=15, help="drafted block length (the largest γ served)")
    p.add_argument("--n-prompts", type=int, default=12, help="held-out calibration prompts per domain")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of the calibration runs")
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=12,
                   help="requests in flight (fixed:γ: per-request statistics as at batch 1)")
    p.add_argument("--results", default=None,
                   help="folder for reliability_<drafter><suffix>.png (default results/)")
    p.add_argument("--traces-dir", default=None,
                   help="where calibration_<drafter>.jsonl goes (default: the model's work folder)")
    p.add_argument("--no-write", action="store_true", help="report only; leave calibration.json alone")
    p.add_argument("--sts", choices=("temperature", "affine"), default="temperature",
                   help="what serving applies: σ(z/T_k) (the paper's STS) or σ(z/T_k + b_k) (affine: for a "
                        "confidence head with a bias that temperatures cannot remove)")


def model_spec(args: argparse.Namespace, capacity: int = 1, max_seq_len: int = 512, drafter: str = "none"):
    """The wiring spec of a tool run (model alias or folder, serving dtype)."""
    from dspark import wiring

    return wiring.resolve(model=args.model, dtype=getattr(args, "dtype", "auto"), capacity=capacity,
                          max_seq_len=max_seq_len, num_threads=args.threads, drafter=drafter)


def results_suffix(spec) -> str:
    """File-name suffix of a model's results: "" for the demo target, "_smollm2", or "_<folder>"."""
    key = spec.model_key
    return "" if key == "demo" else f"_{key}" if key else f"_{Path(spec.model).name}"


def work_dir(spec) -> Path:
    """The model's git-ignored work folder (traces, data)."""
    from dspark.paths import DEMO, REPO_ROOT

    return {"demo": DEMO / "work", "smollm2": REPO_ROOT / "build" / "smollm2" / "work"}.get(
        spec.model_key or "", Path(spec.model).resolve().parent / (Path(spec.model).name + "-work"))


def resolve_drafter(spec, name: str, target, gamma: int):
    """(drafter, folder or None) for a drafter name of this model, a folder, ngram[:N] or a
    hybrid ngram[:N]+<trained> (its folder: the trained drafter's, which holds the calibration)."""
    from dataclasses import replace

    from dspark import wiring

    folder = wiring.drafter_folder(spec, name)
    if "+" in name:
        return wiring.load_drafter(replace(spec, gamma=gamma), target, name), folder
    return build_drafter(name if folder is None else str(folder), target, gamma)


def model_drafters(spec) -> list[str]:
    """The trained drafter names shipped for this model."""
    from dspark import wiring

    root = wiring.DRAFTER_DIRS.get(spec.model_key or "")
    if root is None or not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "model.safetensors").is_file())


def collect_calibration_trace(target, spec, name: str,
                              args: argparse.Namespace) -> tuple[BlockTrace, Path | None]:
    """Run a drafter at fixed γ on the held-out calibration prompts of every domain."""
    from tqdm import tqdm

    from dspark.runtime.engine import SpecEngine
    from dspark.tools.prompts import heldout_prompts, model_domains

    drafter, folder = resolve_drafter(spec, name, target, args.gamma)
    recorder = RecordingDrafter(drafter)
    engine = SpecEngine(target, recorder, policy=f"fixed:{drafter.gamma}")  # scheduler off
    texts = [t for d in model_domains(spec.model_key)
             for t in heldout_prompts(spec.model_key, "calibration", d, args.n_prompts)]
    prompts = [encode_prompt(target, text, args.max_prompt_tokens) for text in texts]
    params = [SamplingParams(temperature=args.temperature, seed=args.seed + i) for i in range(len(prompts))]
    with tqdm(total=len(prompts), desc=f"calibrate {Path(name).name}", unit="req") as bar:
        runs = run_requests(engine, recorder, prompts, args.max_tokens, params, args.concurrency,
                            on_done=lambda: bar.update(1))
    rows = [dict(b, request=i) for i, r in enumerate(runs) for b in r["blocks"]]
    return BlockTrace.from_rows(rows), folder


def main(args: argparse.Namespace) -> int:
    from dspark import paths, wiring
    from dspark.paths import RESULTS

    torch.set_num_threads(args.threads)
    max_seq_len = args.max_prompt_tokens + args.max_tokens + args.gamma + 8
    spec = model_spec(args, args.concurrency, max_seq_len)
    suffix = results_suffix(spec)
    results = Path(args.results) if args.results else RESULTS
    traces_dir = Path(args.traces_dir) if args.traces_dir else work_dir(spec) / "traces"
    specs = args.drafter.split(",")
    if specs == ["all"]:
        specs = model_drafters(spec)
    target = None
    for name in specs:
        if args.traces:
            trace = read_block_trace(args.traces)
            folder = wiring.drafter_folder(spec, name)
        else:
            if target is None:
                target = wiring.load_target(spec)
            trace, folder = collect_calibration_trace(target, spec, name, args)
        key = Path(name).name
        payload = calibrate_trace(trace, sts=args.sts)
        payload.update({"ece_bins": ECE_BINS, "min_class": MIN_CLASS, "model": spec.model})
        if args.traces:
            payload["source_traces"] = paths.relative(args.traces)
        else:
            trace_path = traces_dir / f"calibration_{key}.jsonl"
            trace.save(trace_path, {"gamma": trace.gamma, "drafter": key, "model": spec.model,
                                    "sampling_temperature": args.temperature,
                                    "temperatures": [1.0] * trace.gamma,
                                    "source": f"dspark calibrate: {key}, fixed:{trace.gamma}, calibration"})
            payload.update({"sampling_temperature": args.temperature, "n_prompts_per_domain": args.n_prompts,
                            "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens,
                            "split": "held-out calibration prompts (dspark.tools.prompts.heldout_prompts)",
                            "source_traces": paths.relative(trace_path)})
        print(f"{key}: STS on {len(trace)} blocks, γ = {trace.gamma}")
        other = payload.get("affine_ablation") or payload["temperature_only"]
        shifts = payload.get("sts_shifts") or [0.0] * trace.gamma
        print(f" k     T_k     b_k   ECE before  ECE after  AUROC before  AUROC after  "
              f"ECE {'affine' if payload['sts'] == 'temperature' else 'T only'} (not served)")
        for k in range(trace.gamma):
            print(f"{k + 1:2d} {payload['sts_temperatures'][k]:7.3f} {shifts[k]:7.2f}"
                  f"  {100 * payload['ece_before'][k]:9.2f}%"
                  f"  {100 * payload['ece_after'][k]:8.2f}%  {payload['auroc_before'][k]:12.3f}"
                  f"  {payload['auroc_after'][k]:11.3f}  {100 * other['ece_after'][k]:9.2f}%")
        plot_reliability(fold_shifts(trace, payload["sts_temperatures"], payload.get("sts_shifts")),
                         payload["sts_temperatures"], key, results / f"reliability_{key}{suffix}.png")
        if folder is not None and not args.no_write:
            print(f"wrote {write_calibration(folder, payload)}")
    return 0


