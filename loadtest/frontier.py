"""The live serving frontier (issue 14 item 2; docs/architecture.md §9): per-user vs aggregate
output tokens/s of the real server across concurrency, one scheduler policy at a time, the
server restarted per policy within one run, closed-loop Locust users (loadtest/locustfile.py).

For each policy: start tritonserver (`none` = plain decoding: no drafter at all), warm up,
then per concurrency C run C users for --warmup + --duration seconds and measure over the
last --duration seconds only:
- per_user_tokens_per_s: mean over requests of AIPerf's output tokens/s per user (1 / ITL);
- aggregate_tokens_per_s: output tokens in the window / window (a request's tokens are
  spread evenly over its lifetime, so requests straddling the edges count pro rata);
- ttft_ms_p50, itl_ms_p50 (AIPerf), verified_per_request = draft tokens sent to the target
  per request per step, from the server's counters (Δverified / Δrequest-steps; Figure 8).

Writes results/live_frontier.json = {"by_policy": {POLICY: {C: {...}}}, "goals": ...,
"simulator": ...} and two plots. The simulator (`dspark simulate`'s model, same SPS table)
predicts the same points, so the JSON says how far off it is.

    flock /tmp/dspark-heavy.lock python loadtest/frontier.py            # SmolLM2, ~50 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RequestRecord, locust_command, metric_sum, percentile, read_records, scrape  # noqa: E402

from dspark import wiring  # noqa: E402
from dspark.paths import MODEL_REPOSITORY, REPO_ROOT, RESULTS  # noqa: E402
from dspark.serving.triton_server import TritonServer  # noqa: E402

HERE = Path(__file__).resolve().parent
POLICIES = ["none", "mtp1", "fixed:7", "dspark"]
CONCURRENCY = [1, 2, 4, 8, 16, 32]


def window_point(records: list[RequestRecord], t0: float, t1: float) -> dict:
    """Frontier metrics of the requests that overlap the measuring window [t0, t1] (epoch s)."""
    done = [r for r in records if r.kind == "ok" and r.latency_s]
    tokens = 0.0
    for r in done:
        start, end = r.start, r.start + r.latency_s
        overlap = max(0.0, min(end, t1) - max(start, t0))
        tokens += r.output_tokens * overlap / max(end - start, 1e-9)
    inside = [r for r in done if r.start >= t0 and r.start + r.latency_s <= t1]
    per_user = [r.tokens_per_s_user for r in inside if r.tokens_per_s_user]
    return {
        "per_user_tokens_per_s": float(np.mean(per_user)) if per_user else None,
        "per_user_tokens_per_s_p50": percentile(per_user, 50),
        "aggregate_tokens_per_s": tokens / (t1 - t0),
        "ttft_ms_p50": percentile([r.ttft_s * 1e3 for r in inside if r.ttft_s is not None], 50),
        "itl_ms_p50": percentile([r.itl_s * 1e3 for r in inside if r.itl_s is not None], 50),
        "requests": len(inside),
        "errors": sum(1 for r in records if r.error),
    }


def server_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    def d(name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    request_steps = d("dspark_acceptance_length_count")
    return {
        "verified_per_request": d("dspark_verified_tokens_total") / request_steps if request_steps else 0.0,
        "tau": 1 + d("dspark_accepted_tokens_total") / request_steps if request_steps else None,
        "steps": d("dspark_steps_total"),
        "server_emitted_tokens": d("dspark_emitted_tokens_total"),
    }


def measure(args, server: TritonServer, users: int, work: Path) -> dict:
    """One concurrency level: Locust for warmup + duration, server counters over the window."""
    out = work / f"c{users}"
    cmd = locust_command(HERE / "locustfile.py", users, args.warmup + args.duration, f"http://{server.http_url}",
                         server.grpc_url, out, args, ["--seed", str(args.seed), args.user_class])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)
    time.sleep(args.warmup)
    t0, before = time.time(), scrape(server.metrics_url)
    time.sleep(args.duration)
    t1, after = time.time(), scrape(server.metrics_url)
    log, _ = proc.communicate(timeout=args.duration + 600)
    if not Path(f"{out}_records.csv").is_file():
        raise RuntimeError(f"locust wrote no records (exit {proc.returncode}):\n{log[-3000:]}")
    point = window_point(read_records(f"{out}_records.csv"), t0, t1)
    point.update(server_delta(before, after))
    point["concurrency"] = users
    return point


def serve(args, policy: str) -> TritonServer:
    settings = {
        "model": args.model,
        "policy": policy,
        "drafter": "none" if policy == "none" else args.drafter,
        "capacity": str(args.capacity or max(args.concurrency)),
        "gamma": str(args.gamma),
    }
    settings.update(
        {
            k: v
            for k, v in (
                ("dtype", args.dtype),
                ("sps", args.sps),
                ("num_threads", args.num_threads),
                ("device", "cpu"),
            )
            if v
        }
    )
    env = {wiring.ENV_VARS[k]: str(v) for k, v in settings.items() if v is not None}
    srv = TritonServer(
        args.model_repository, http_port=0, grpc_port=0, metrics_port=0, host="127.0.0.1", env=env
    )
    srv.start()
    try:
        srv.wait_ready(args.ready_timeout)
    except BaseException:
        srv.stop()
        raise
    return srv


def goals(by_policy: dict[str, dict[int, dict]], tolerance: float = 0.02) -> dict:
    """Issue 14 item 2: at every concurrency dspark's per-user tokens/s >= 0.98x the best other
    policy that serves >= 98 % of dspark's aggregate, and >= 1.0x none; >= 1.5x mtp1 per user at
    matched aggregate somewhere (the simulator's matched_speedup on these live points)."""
    if "dspark" not in by_policy:
        return {}
    out: dict = {"per_concurrency": []}
    for c, ours in sorted(by_policy["dspark"].items()):
        others = {n: pts[c] for n, pts in by_policy.items() if n != "dspark" and c in pts}
        peers = {
            n: p
            for n, p in others.items()
            if p["aggregate_tokens_per_s"] >= (1 - tolerance) * ours["aggregate_tokens_per_s"]
        }
        best = max(peers.items(), key=lambda kv: kv[1]["per_user_tokens_per_s"] or 0, default=(None, None))
        entry = {
            "concurrency": c,
            "best_peer": best[0],
            "over_best_peer": (ours["per_user_tokens_per_s"] / best[1]["per_user_tokens_per_s"])
            if best[1]
            else None,
        }
        if "none" in others:
            entry["over_none"] = ours["per_user_tokens_per_s"] / others["none"]["per_user_tokens_per_s"]
        entry["ok"] = (
            entry["over_best_peer"] is None or entry["over_best_peer"] >= 1 - tolerance
        ) and entry.get("over_none", 1.0) >= 1.0
        out["per_concurrency"].append(entry)
    out["dspark_on_frontier_everywhere"] = all(e["ok"] for e in out["per_concurrency"])
    if "mtp1" in by_policy:
        from dspark.tools.simulate import matched_speedup

        def curve(points):
            return [
                {
                    "concurrency": c,
                    "aggregate_tps": p["aggregate_tokens_per_s"],
                    "per_user_tps": p["per_user_tokens_per_s"],
                }
                for c, p in sorted(points.items())
                if p["per_user_tokens_per_s"] and p["aggregate_tokens_per_s"] > 0
            ]

        matched = matched_speedup(curve(by_policy["dspark"]), curve(by_policy["mtp1"]))
        out["speedup_over_mtp1_matched_aggregate"] = matched
        out["max_speedup_over_mtp1"] = max((m["speedup"] for m in matched), default=None)
        out["mtp1_goal_1_5x_met"] = (out["max_speedup_over_mtp1"] or 0) >= 1.5
    return out


def simulate(args, policies: list[str]) -> dict:
    """The simulator's prediction for the same policies, concurrency levels, SPS table and
    request length (synthetic drafter traces unless --traces)."""
    import torch

    from dspark.tools.simulate import run
    from dspark.tools.traces import load_traces, synthetic_trace_set

    spec = wiring.resolve(model=args.model, sps=args.sps or None)
    sps = wiring.load_sps(spec, torch.device("cpu"))  # the table the server's dspark policy uses
    table = wiring.SPS_TABLES.get(spec.model_key or "") if spec.sps == "auto" else None
    table_name = os.path.relpath(table, REPO_ROOT) if table and Path(table).is_file() else spec.sps
    traces = load_traces(args.traces) if args.traces else synthetic_trace_set()
    out = {
        "sps_table": table_name,
        "traces": args.traces or "synthetic",
        "by_policy": {},
    }
    for policy in policies:
        out["by_policy"][policy] = {
            c: run(policy, sps, traces, concurrency=c, mean_len=args.max_tokens, seed=args.seed)
            for c in args.concurrency
        }
    return out


def compare(live: dict, sim: dict) -> dict:
    """live / simulated per-user and aggregate tokens/s, point by point."""
    out = {}
    for policy, points in live.items():
        predicted = sim["by_policy"].get(policy, {})
        out[policy] = {
            c: {
                "per_user_live_over_sim": p["per_user_tokens_per_s"] / predicted[c]["per_user_tps"]
                if p["per_user_tokens_per_s"] and predicted.get(c)
                else None,
                "aggregate_live_over_sim": p["aggregate_tokens_per_s"] / predicted[c]["aggregate_tps"]
                if predicted.get(c)
                else None,
                "verified_per_request_sim": predicted[c]["verified_per_request"]
                if predicted.get(c)
                else None,
            }
            for c, p in points.items()
        }
    return out


def plot(by_policy: dict[str, dict[int, dict]], out_prefix: Path, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for policy, points in by_policy.items():
        pts = [p for _, p in sorted(points.items()) if p["per_user_tokens_per_s"]]
        ax.plot(
            [p["aggregate_tokens_per_s"] for p in pts],
            [p["per_user_tokens_per_s"] for p in pts],
            "o-",
            label=policy,
        )
        for p in pts:
            ax.annotate(
                str(p["concurrency"]),
                (p["aggregate_tokens_per_s"], p["per_user_tokens_per_s"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    ax.set(xlabel="aggregate output tokens/s", ylabel="per-user output tokens/s (1 / ITL)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    path = out_prefix.with_name(out_prefix.name + "_frontier.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    paths.append(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for policy, points in by_policy.items():
        cs = sorted(points)
        ax.plot(cs, [points[c]["verified_per_request"] for c in cs], "o-", label=policy)
    ax.set(
        xscale="log",
        xlabel="concurrency",
        ylabel="verified draft tokens per request per step",
        title="Verify budget per request vs concurrency (server counters)",
    )
    ax.set_xticks(sorted({c for pts in by_policy.values() for c in pts}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.grid(alpha=0.3)
    ax.legend()
    path = out_prefix.with_name(out_prefix.name + "_verified.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    paths.append(path)
    plt.close("all")
    return [os.path.relpath(p, REPO_ROOT) for p in paths]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--drafter", default=None,
                   help="drafter of the speculative policies (default: the served one, config.pbtxt)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    p.add_argument("--capacity", type=int, default=0, help="KV slots (default: the largest concurrency)")
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--dtype", default="")
    p.add_argument("--sps", default="", help="SPS table of the dspark policy (default: the server's)")
    p.add_argument("--num-threads", default="")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds per point before measuring")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompt-chars", type=int, default=1500)
    p.add_argument("--prompts", default="code,math,prose")
    p.add_argument("--tokenizer", default=None, help="default: the served model's folder")
    p.add_argument("--user-class", default="GrpcStreamUser")
    p.add_argument("--traces", default=None, help="drafter traces for the simulator (default: synthetic)")
    p.add_argument("--no-simulator", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=RESULTS / "live_frontier.json")
    p.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY)
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    policies = [x for x in args.policies.split(",") if x]
    args.tokenizer = args.tokenizer or str(wiring.model_folder(wiring.resolve(model=args.model).model))
    work = Path(tempfile.mkdtemp(prefix="dspark-frontier-"))
    by_policy: dict[str, dict[int, dict]] = {}
    t_start = time.time()
    for policy in policies:
        print(f"[frontier] policy {policy}: starting the server", flush=True)
        server = serve(args, policy)
        try:
            by_policy[policy] = {}
            for users in args.concurrency:
                point = measure(args, server, users, work / policy.replace(":", "_"))
                by_policy[policy][users] = point
                print(
                    f"[frontier] {policy} c={users}: per-user "
                    f"{point['per_user_tokens_per_s'] or 0:.1f} tok/s, "
                    f"aggregate {point['aggregate_tokens_per_s']:.1f} tok/s, verified/request "
                    f"{point['verified_per_request']:.2f}, {point['requests']} requests",
                    flush=True,
                )
        finally:
            server.stop()
    result = {
        "by_policy": {pol: {str(c): pt for c, pt in pts.items()} for pol, pts in by_policy.items()},
        "goals": goals(by_policy),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "model_repository")},
        "seconds": round(time.time() - t_start, 1),
    }
    result["settings"]["tokenizer"] = os.path.relpath(args.tokenizer, REPO_ROOT)
    if not args.no_simulator:
        try:
            sim = simulate(args, policies)
            result["simulator"] = {
                "sps_table": sim["sps_table"],
                "traces": sim["traces"],
                "live_over_simulated": {
                    pol: {str(c): v for c, v in pts.items()} for pol, pts in compare(by_policy, sim).items()
                },
            }
        except Exception as e:  # the comparison is a report, not a gate
            result["simulator"] = {"error": f"{type(e).__name__}: {e}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot(by_policy, args.out.with_suffix(""), f"Live frontier: {args.model}")
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"[frontier] wrote {os.path.relpath(args.out, REPO_ROOT)} and {', '.join(result['plots'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
