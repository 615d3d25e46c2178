"""`dspark bench-triton`: what serving through Triton costs against the same engine in process
(architecture §10). Same engine settings on both sides, one run, alternating repeats:
- in_process: `dspark.wiring.build_engine(spec).generate(...)` (the engine owns target and drafter);
- triton: tritonserver on the model repository with the same spec (DSPARK_* overrides), gRPC
  streams to `ensemble`: preprocessing -> dspark (BLS hops to `target`, `drafter`) -> postprocessing.
batch1 = one request at a time; concurrent16 = 16 requests at once (capacity 16); both through
the ensemble, and batch 1 also straight to the `dspark` model (no pre/postprocessing). Tokens/s =
generated tokens / wall time, prefill included; greedy; medians of the repeats. The per-step cost
of the hops = (triton seconds - in-process seconds) / engine steps, at batch 1.
Both sides run with OMP_WAIT_POLICY=PASSIVE (the serving processes need it: OpenMP threads that
spin after each forward starve the other model processes on the same cores), so the comparison
isolates the transport; the command re-executes itself with it when it is not set.
Writes results/triton_overhead.json. Run it under the heavy lock (it loads the CPU for minutes):
    flock /tmp/dspark-heavy.lock dspark bench-triton
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from tqdm import tqdm

from dspark import paths, wiring
from dspark.bench import cpu_name

QUESTIONS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash table is.",
    "Give me three tips for writing clear emails.",
    "What is the capital of France? Answer in one sentence.",
    "Write a Python class for a stack with push, pop and peek.",
    "Explain recursion to a beginner.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "Summarize the water cycle.",
    "Write a haiku about autumn.",
    "What does the `with` statement do in Python?",
    "List three uses of a linked list.",
    "How do I reverse a string in Python?",
    "A train travels 60 km per hour for 3 hours. How far does it go?",
    "What is a closure in Python?",
    "Describe the difference between a list and a tuple.",
    "Write a SQL query that counts rows in a table.",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    wiring.add_arguments(p, drafter="ngram", policy="fixed:3", capacity=16, max_seq_len=512, num_threads=2)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(paths.RESULTS / "triton_overhead.json"))


def prompts(spec: wiring.Spec, tokenizer) -> list[str]:
    from dspark.runtime.chat import ChatTemplate

    try:
        template = ChatTemplate.from_folder(wiring.model_folder(spec.model))
        return [template.render([{"role": "user", "content": q}]) for q in QUESTIONS]
    except (FileNotFoundError, ValueError):
        return QUESTIONS


def in_process(engine, tokenizer, texts: list[str], tokens: int) -> tuple[float, int, int]:
    """-> (seconds, generated tokens, engine steps) for all texts at once."""
    ids = [tokenizer.encode(t).ids for t in texts]
    steps0 = engine.metrics.steps
    start = time.perf_counter()
    outs = engine.generate(ids, tokens)
    return time.perf_counter() - start, sum(len(o) for o in outs), engine.metrics.steps - steps0


def through_triton(url: str, texts: list[str], tokens: int, model: str = "ensemble") -> tuple[float, int]:
    sys.path.insert(0, str(paths.REPO_ROOT / "clients"))
    import generate_client as client

    def one(text: str) -> int:
        stats = client.Stats()
        for _ in client.generate_grpc(url, text, tokens, stream=True, stats=stats, model=model):
            pass
        return stats.output_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        counts = list(pool.map(one, texts))
    return time.perf_counter() - start, sum(counts)


def scrape_steps(metrics_url: str) -> int:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    match = re.search(r"^dspark_steps_total (\S+)$", text, re.M)
    return int(float(match.group(1))) if match else 0


def main(args: argparse.Namespace) -> int:
    from dspark.serving.triton_server import TritonServer

    if os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":  # read once, when OpenMP loads: start afresh
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.execv(sys.executable, [sys.executable, "-m", "dspark.cli", *sys.argv[1:]])
    spec = wiring.from_args(args)
    engine = wiring.build_engine(spec)
    tokenizer = engine.target.tokenizer
    texts = prompts(spec, tokenizer)
    env = {var: str(getattr(spec, name)) for name, var in wiring.ENV_VARS.items()}
    env["DSPARK_MODEL"] = str(wiring.model_folder(spec.model).resolve())
    server = TritonServer(paths.MODEL_REPOSITORY, 0, 0, 0, env=env)
    server.start()
    try:
        server.wait_ready(900)
        through_triton(server.grpc_url, texts[:2], 4)  # warm-up: connects dspark to target / drafter
        in_process(engine, tokenizer, texts[:2], 4)
        runs: dict[str, dict[str, list[float]]] = {
            k: {"triton": [], "in_process": []} for k in ("batch1", "concurrent16")
        }
        runs["batch1"]["triton_direct_bls"] = []
        per_step: list[float] = []
        for _ in tqdm(range(args.repeats), desc="repeats"):
            for key, batch in (("batch1", texts[:1]), ("concurrent16", texts[:16])):
                t_in, n_in, steps = in_process(engine, tokenizer, batch, args.tokens)
                s0 = scrape_steps(server.metrics_url)
                t_tr, n_tr = through_triton(server.grpc_url, batch, args.tokens)
                runs[key]["in_process"].append(n_in / t_in)
                runs[key]["triton"].append(n_tr / t_tr)
                if key == "batch1":
                    time.sleep(0.6)  # the metrics exporter's refresh
                    steps_tr = scrape_steps(server.metrics_url) - s0
                    per_step.append((t_tr - t_in) / max(steps_tr, steps, 1) * 1e3)
                    t_bls, n_bls = through_triton(server.grpc_url, batch, args.tokens, model="dspark")
                    runs[key]["triton_direct_bls"].append(n_bls / t_bls)
    finally:
        server.stop()
    result = {
        key: {side: round(statistics.median(v), 2) for side, v in sides.items()}
        for key, sides in runs.items()
    }
    for key in runs:
        result[key]["ratio"] = round(result[key]["triton"] / result[key]["in_process"], 3)
        result[key]["runs"] = {side: [round(x, 2) for x in v] for side, v in runs[key].items()}
    result |= {
        "per_step_overhead_ms": round(statistics.median(per_step), 2),
        "goal": "triton / in_process >= 0.9 at both",
        "goal_met": all(result[k]["ratio"] >= 0.9 for k in runs),
        "settings": {k: v for k, v in asdict(spec).items()}
        | {"tokens": args.tokens, "repeats": args.repeats},
        "method": "tokens/s = generated tokens / wall time (prefill included), greedy, medians; "
        "triton = gRPC "
        "streams to the ensemble; per-step overhead = (triton - in-process seconds) / steps at batch 1",
        "command": "dspark bench-triton " + " ".join(sys.argv[2:]) + "  (under the shared heavy lock)",
        "load_avg_1min": os.getloadavg()[0],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "machine": cpu_name(),
    }
    out = paths.REPO_ROOT / args.out if not os.path.isabs(args.out) else args.out
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        json.dumps(
            {k: result[k] for k in ("batch1", "concurrent16", "per_step_overhead_ms", "goal_met")}, indent=2
        )
    )
    return 0
