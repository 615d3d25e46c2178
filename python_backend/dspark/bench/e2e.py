"""`dspark bench`: the end-to-end benchmark (architecture §2, §9): every method side by side in
one run, on the same target and the same prompts (code, math, chat; greedy unless said).

- batch 1 tokens/s: our engine with drafter + dspark scheduler ("dspark"), our plain decoding
  (the same loop, no drafter), transformers `generate` plain (best of fp32 / bf16), with an
  assistant (the best this project can give it: a standalone draft LM among the model's drafters,
  else the target's own first layers, `assistant_early_exit`, best depth) and with prompt lookup;
  llama.cpp (llama-cpp-python, an optional extra: scripts/install_llamacpp.sh) on the model's
  Q4_1 GGUF, on a BF16 GGUF of the same weights, and with its prompt-lookup drafting;
- batch 1 greedy on the GGUF's own Q4_1 weights (`--dtype q4_1`, torch's int4 matmul; the
  weights llama.cpp's Q4_1 column reads): dspark and plain, each with that build's steps/second
  table and decoding that build's plain text, and llama.cpp's Q4_1 decoding as a third arm run
  beside them in every repeat (its other variants run once, after our cells; `--no-q4-1` skips
  the cell);
- batch 1 at T = 1 (sampled): dspark and plain;
- `--also-dtype bf16` (e.g.): a second build of the target in that dtype, its dspark and plain arms
  beside the main build's in every greedy cell (batch 1 and each concurrency), each decoding its
  own build's plain text: the two dtypes side by side (`also_dtype` in the JSON);
- closed-loop concurrency 1..32: aggregate and per-user tokens/s for dspark, plain, mtp1, fixed:7;
- τ, the per-step time split of dspark at batch 1, the drafter's propose time per step, and the
  goals of the speculation issue, met or not.
Greedy runs decode plain decoding's text (`dspark.bench.same_text`: in bf16 a near-tie would
otherwise send each policy's text elsewhere, and a policy that lands in a loop prompt lookup
drafts for free looks faster for it); `--free-text` lets them part.
Tokens/s counts generated tokens over the seconds spent in the engine's own steps, prefill
included. Each of our cells runs `--repeats` times with its policies side by side, one engine step
of each in turn (`--sequential`: one whole run after another, on the wall clock), their order
rotated per repeat (median reported); the cost of
drafting at R, which a running server measures once, is shared by the dspark runs. Writes
results/bench_e2e_<model>.json and a PNG beside it."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dspark import paths, wiring
from dspark.bench import cpu_name
from dspark.bench.same_text import SameTextTarget
from dspark.runtime import linear
from dspark.runtime.sampling import SamplingParams
from dspark.runtime.scheduler import Policy
from dspark.runtime.sps import DraftCost

POLICIES = ("dspark", "plain", "mtp1", "fixed:7")
STEP_PARTS = ("draft", "schedule", "verify", "accept")  # a step's time split the JSON reports
LLAMACPP = ("llamacpp_q4_1", "llamacpp_bf16", "llamacpp_prompt_lookup")  # its batch-1 columns
FALLBACK_PROMPTS = {
    "code": ["Write a Python function that checks whether a number is prime.",
             "Write a Python class for a stack with push, pop and peek."],
    "math": ["Tom has 3 apples and buys 5 more. Then he gives 2 to Ann. How many apples does he have?",
             "A train travels 60 km per hour for 3 hours. How far does it go? Explain step by step."],
    "chat": ["Give me three tips for writing clear emails.", "Explain what a hash table is to a beginner."],
}


# ---------------------------------------------------------------- prompts

def load_prompts(model_key: str | None, domains: list[str], n: int, tokenizer) -> tuple[list[list[int]], str]:
    """n prompts per domain: the model's held-out eval prompts (chat-formatted text, one JSON per
    line with "domain" and "prompt"), else a few built-in questions in the ChatML template."""
    path = paths.REPO_ROOT / "build" / (model_key or "") / "prompts" / "eval.jsonl"
    texts: list[str] = []
    if model_key and path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for d in domains:
            texts += [r["prompt"] for r in rows if r.get("domain") == d][:n]
        source = paths.relative(path)
    else:
        for d in domains:
            texts += [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                      for q in FALLBACK_PROMPTS.get(d, [])[:n]]
        source = "builtin"
    return [tokenizer.encode(t, add_special_tokens=False).ids for t in texts], source


def fit_prompts(prompts: list[list[int]], spec: wiring.Spec, max_tokens: int) -> list[list[int]]:
    """Each prompt's last tokens that leave room in a slot for `max_tokens` and a draft block."""
    return [p[-(spec.max_seq_len - max_tokens - spec.gamma - 2):] for p in prompts]


# ---------------------------------------------------------------- our engine

class ClosedLoop:
    """One engine's closed loop in `run_closed_loops` (and `dspark bench-rule`): its requests and
    its own clock (the seconds spent inside its own `step()` calls)."""

    def __init__(self, engine, prompts: list[list[int]], concurrency: int, num_requests: int,
                 max_tokens: int | list[int], params: SamplingParams) -> None:
        self.engine, self.prompts, self.num_requests = engine, prompts, num_requests
        self.max_tokens, self.params = max_tokens, params
        self.clock = 0.0
        self.reqs: list = []
        self.start: dict[str, float] = {}
        self.done: dict[str, float] = {}
        engine.generate([prompts[0]], 4, params)  # warm-up (allocator, numba), not timed
        engine.reset_metrics()
        while len(self.reqs) < min(concurrency, num_requests):
            self.submit()

    def submit(self) -> None:
        i = len(self.reqs) % len(self.prompts)
        if isinstance(self.max_tokens, list):
            req = self.engine.add_request(self.prompts[i], self.max_tokens[i], self.params, stop_token_ids=[])
        else:
            req = self.engine.add_request(self.prompts[i], self.max_tokens, self.params)
        self.start[req.request_id] = self.clock
        self.reqs.append(req)

    def step(self) -> None:
        t = time.perf_counter()
        self.engine.step()
        self.clock += time.perf_counter() - t
        for r in self.reqs:
            if r.finished and r.request_id not in self.done:
                self.done[r.request_id] = self.clock
                if len(self.reqs) < self.num_requests:
                    self.submit()

    def result(self) -> dict:
        reqs, m = self.reqs, self.engine.metrics
        tokens = sum(len(r.output) for r in reqs)
        steps = max(m.steps, 1)
        latency = {r.request_id: self.done[r.request_id] - self.start[r.request_id] for r in reqs}
        cost = self.engine.policy.draft_cost if self.engine.policy is not None else None
        by_r = ({"propose": cost.to_dict(), "overhead": cost.overheads(), "scale": cost.verify_scales(),
                 "rate": cost.measured_rates(), "paired": cost.paired_ratios()}
                if cost else dict.fromkeys(("propose", "overhead", "scale", "rate", "paired"), {}))
        return {"aggregate": tokens / self.clock,
                "per_user": sum(len(r.output) / latency[r.request_id] for r in reqs) / len(reqs),
                "tokens": tokens, "wall_s": self.clock, "requests": len(reqs), "steps": m.steps,
                "draft_steps": m.draft_steps,
                # drafted steps of one draft per request (`DSpark._pick_shape`), the rest ranked
                "uniform_steps": self.engine.policy.uniform_steps if self.engine.policy is not None else 0,
                "tau": sum(r.verify_emitted for r in reqs) / max(sum(r.verify_steps for r in reqs), 1),
                "mean_verify_tokens_per_step": m.verify_tokens / steps,
                "drafter_fallbacks": m.drafter_fallbacks,
                "step_ms": {k: 1e3 * v / steps for k, v in m.time_s.items()},
                "propose_ms_by_requests": {str(r): 1e3 * s for r, s in by_r["propose"].items()},
                "step_overhead_ms_by_requests": {
                    kind: {str(r): 1e3 * s for r, s in of.items()} for kind, of in by_r["overhead"].items()},
                "verify_scale_by_requests": {str(r): v for r, v in by_r["scale"].items()},
                "measured_tokens_per_s_by_requests": {
                    kind: {str(r): v for r, v in of.items()} for kind, of in by_r["rate"].items()},
                # mode/against: the rule's paired ratios by class of R (its smallest R)
                "paired_ratio_by_requests": {
                    pair: {str(r): v for r, v in of.items()} for pair, of in by_r["paired"].items()},
                "outputs": [r.output for r in reqs]}


def run_closed_loops(engines: dict[str, object], prompts: list[list[int]], concurrency: int,
                     num_requests: int, max_tokens: int | list[int] | dict[str, int | list[int]],
                     params: SamplingParams,
                     step: Callable[[str, ClosedLoop], None] | None = None) -> dict[str, dict]:
    """One closed loop per engine (a policy each), run side by side: one step of each in turn,
    each timed on its own clock, the seconds inside its own steps. Per engine, `num_requests`
    requests (prompts in turn), `concurrency` in flight at all times (a new one joins when one
    finishes). Aggregate = tokens / its clock; per-user = mean of tokens / latency on that clock.
    max_tokens: one cap for all, stopping at eos; or one length per prompt, generated exactly
    (no stop tokens): every policy then does the same work; or either by engine name (engines
    on different builds of the target, each with its own plain text's lengths).
    Step by step side by side, a slow spell of a shared machine (minutes long on the 2-core VMs:
    one plain run measured 97 and 121 tokens/s two minutes apart) slows every policy alike,
    where runs one after another each meet their own. The engines may share a target and drafter
    (each request holds its own KV slot: the target needs concurrency × engines slots).
    step(name, loop): runs one step of a loop in its place (`loop.step()`), e.g. to record it."""
    caps = max_tokens if isinstance(max_tokens, dict) else dict.fromkeys(engines, max_tokens)
    loops = {name: ClosedLoop(engine, prompts, concurrency, num_requests, caps[name], params)
             for name, engine in engines.items()}
    while any(loop.engine.has_work() for loop in loops.values()):
        for name, loop in loops.items():
            if loop.engine.has_work():
                if step is None:
                    loop.step()
                else:
                    step(name, loop)
    return {name: loop.result() for name, loop in loops.items()}


def run_closed_loop(engine, prompts: list[list[int]], concurrency: int, num_requests: int,
                    max_tokens: int | list[int], params: SamplingParams) -> dict:
    """`run_closed_loops` of one engine."""
    return run_closed_loops({"": engine}, prompts, concurrency, num_requests, max_tokens, params)[""]


def same_text_share(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Share of the generated tokens that come before a request's first difference from the same
    request decoded plainly (greedy; requests take the prompts in turn, so request i is the same
    prompt in every run). In bf16 a near-tie can send a policy's
    text elsewhere (the verify batch's shape changes the rounding): past that point it decodes
    another, easier or harder, text, and its speed is not comparable token for token."""
    same = total = 0
    for i, out in enumerate(outputs):
        ref = reference[i]
        same += next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        total += len(out)
    return same / max(total, 1)


def divergence(target, prompts: list[list[int]], plain: list[list[int]], spec: list[list[int]]) -> list[dict]:
    """Where greedy speculative and plain outputs part (if they do), with the target's top-2 logit
    gap there as a one-pass prefill computes it: in bf16 the logits of a token depend slightly on
    the batch shape it was computed in, so outputs can part at (near-)ties of the top two."""
    out = []
    for i, (p, a, b) in enumerate(zip(prompts, plain, spec)):
        j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), None)
        if j is None:
            continue
        slot = target.allocate()
        try:
            logits, _ = target.prefill([slot], [p + a[:j]])
        finally:
            target.release(slot)
        top = logits[0].float().topk(2)
        out.append({"prompt": i, "token": j, "plain": a[j], "speculative": b[j],
                    "top2_logits": [round(float(v), 4) for v in top.values],
                    "top2_ids": top.indices.tolist()})
    return out


def quick_sps(target, sizes: list[int], context: int = 128, repeats: int = 3):
    """Steps/second of this target's verify at token batch B (requests of ≤ 4 tokens on a cached
    context), fastest of `repeats`: the table the scheduler needs when the model ships none."""
    from dspark.runtime.batch import RaggedBatch
    from dspark.runtime.sps import SPSTable

    best = {b: math.inf for b in sizes}
    for _ in range(repeats):
        for b in sizes:
            r = min(math.ceil(b / 4), target.num_free_slots())
            lens = [b // r + (1 if i < b % r else 0) for i in range(r)]
            slots = [target.allocate() for _ in range(r)]
            try:
                target.prefill(slots, [[5] * context] * r)
                batch = RaggedBatch.from_requests(slots, [[7] * n for n in lens], [context] * r)
                t0 = time.perf_counter()
                target.verify(batch)
                best[b] = min(best[b], time.perf_counter() - t0)
            finally:
                for s in slots:
                    target.release(s)
    cpu = target.device.type == "cpu"
    return SPSTable(sizes, [1.0 / best[b] for b in sizes],
                    device=f"cpu:{cpu_name()}" if cpu else str(target.device),
                    model="profiled by dspark bench", padded=not cpu)


# ---------------------------------------------------------------- baselines

def find_draft_lm(model_key: str | None) -> Path | None:
    """A standalone draft LM among the model's drafters (a Hugging Face folder transformers can
    load as `assistant_model`: config.json without "kind", or kind "draft_lm"), if one ships."""
    root = wiring.DRAFTER_DIRS.get(model_key or "")
    for folder in sorted(root.glob("*/")) if root is not None and root.is_dir() else []:
        cfg = folder / "config.json"
        if cfg.is_file() and json.loads(cfg.read_text()).get("kind", "draft_lm") == "draft_lm":
            return folder
    return None


def run_hf(model, prompts: list[list[int]], max_tokens: int, eos: list[int], **gen_kwargs) -> dict:
    """transformers `generate` at batch 1, greedy, one prompt after another."""
    kw = dict(do_sample=False, top_p=None, top_k=None, temperature=None, eos_token_id=eos or None,
              pad_token_id=eos[0] if eos else 0, **gen_kwargs)
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, **kw)  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, **kw)
        tokens += out.shape[1] - len(p)
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall}


def hf_baselines(folder: Path, prompts, max_tokens: int, eos: list[int], gamma: int,
                 draft_lm: Path | None) -> dict:
    """transformers plain (fp32 and bf16), prompt lookup and assisted generation (best assistant)."""
    import transformers

    runs: dict[str, dict] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
        runs[f"hf_plain_{name}"] = run_hf(model, prompts, max_tokens, eos)
        runs[f"hf_prompt_lookup_{name}"] = run_hf(model, prompts, max_tokens, eos,
                                                  prompt_lookup_num_tokens=gamma)
        if draft_lm is not None:
            assistant = transformers.AutoModelForCausalLM.from_pretrained(str(draft_lm), dtype=dtype).eval()
            runs[f"hf_assisted_{name}_draft_lm"] = run_hf(model, prompts, max_tokens, eos,
                                                          assistant_model=assistant)
        else:  # the target's own first layers as the assistant (no draft LM ships with this model)
            for depth in (4, 8, 12):
                runs[f"hf_assisted_{name}_early_exit{depth}"] = run_hf(model, prompts, max_tokens, eos,
                                                                       assistant_early_exit=depth)
    best = lambda prefix: max((v["tokens_per_s"], k) for k, v in runs.items() if k.startswith(prefix))
    return {"runs": runs, **{k: best(k)[0] for k in ("hf_plain", "hf_prompt_lookup", "hf_assisted")},
            "best": {k: best(k)[1] for k in ("hf_plain", "hf_prompt_lookup", "hf_assisted")}}


def bf16_gguf(q4_1: Path, out: Path) -> Path:
    """The same weights in a BF16 GGUF (every tensor dequantized from the Q4_1 file, metadata
    copied), for llama.cpp's bf16 column. Written once into the git-ignored models cache."""
    import gguf
    import numpy as np

    if out.is_file():
        return out
    reader = gguf.GGUFReader(str(q4_1))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if data.ndim >= 2:
            writer.add_tensor(t.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


class LlamaCpp:
    """One llama.cpp model (llama-cpp-python) decoding greedy at batch 1 on its own text: each
    prompt until eos or `max_tokens`, one after the other, the model loaded once (not timed)."""

    def __init__(self, path: Path, threads: int, eos: list[int], draft=None) -> None:
        import llama_cpp

        self.path, self.eos = path, set(eos)
        self.llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False,
                                   draft_model=draft, logits_all=draft is not None)

    def _one(self, prompt: list[int], n: int) -> list[int]:
        out: list[int] = []
        for tok in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if tok in self.eos or len(out) >= n:
                break
        return out

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Aggregate and per-user tokens/s like `run_closed_loop` at concurrency 1, and the texts."""
        self._one(prompts[0], 4)  # warm-up
        outputs, latency, t0 = [], [], time.perf_counter()
        for p in prompts:
            t1 = time.perf_counter()
            outputs.append(self._one(p, max_tokens))
            latency.append(time.perf_counter() - t1)
        wall = time.perf_counter() - t0
        tokens = sum(map(len, outputs))
        return {"aggregate": tokens / wall, "tokens": tokens, "wall_s": wall,
                "per_user": sum(len(o) / t for o, t in zip(outputs, latency)) / len(outputs),
                "gguf": paths.relative(self.path), "outputs": outputs}


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llamacpp_baselines(gguf_q4: Path, prompts, max_tokens: int, eos: list[int], threads: int,
                       gamma: int, q4_1: bool = True) -> dict:
    """llama.cpp greedy at batch 1 on the Q4_1 GGUF (q4_1=False: left to the paired cell), a BF16
    GGUF of the same weights, and Q4_1 with its prompt-lookup drafting, one run each. {} with a
    note when llama-cpp-python is not installed."""
    if not llamacpp_available():
        return {"note": "llama-cpp-python not installed (optional: scripts/install_llamacpp.sh)"}
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def run(path: Path, draft=None) -> dict:
        result = LlamaCpp(path, threads, eos, draft).run(prompts, max_tokens)
        return {"tokens_per_s": result["aggregate"], **{k: result[k] for k in ("tokens", "wall_s", "gguf")}}

    bf16 = bf16_gguf(gguf_q4, gguf_q4.with_name(gguf_q4.stem.replace("Q4_1", "BF16") + ".gguf"))
    runs = {"llamacpp_q4_1": run(gguf_q4)} if q4_1 else {}
    runs.update(llamacpp_bf16=run(bf16),
                llamacpp_prompt_lookup=run(gguf_q4, LlamaPromptLookupDecoding(num_pred_tokens=gamma)))
    runs["version"] = llama_cpp.__version__
    return runs


# ---------------------------------------------------------------- the run

def paired_ratios(runs: dict, mine: str, others: list[str]) -> list[float]:
    """Per repeat: run `mine`'s aggregate ÷ the best of `others` in the same repeat. A repeat runs
    a cell's policies back to back (minutes apart), so a slow spell of the shared machine, which
    moves one cell's runs by up to half, mostly cancels in the ratio, where a ratio of medians
    taken over the repeats apart keeps it. With several `others` the per-repeat max picks each
    repeat's luckiest run: biased low (`best_policy_ratios`)."""
    return [m / max(runs[o]["aggregate_runs"][i] for o in others)
            for i, m in enumerate(runs[mine]["aggregate_runs"])]


def best_policy_ratios(runs: dict, mine: str, others: list[str]) -> tuple[str, list[float]]:
    """(the best of `others`, per repeat `mine`'s aggregate ÷ that policy's run in the same
    repeat). The best policy is the one with the highest median over the repeats, chosen once
    per cell: the goal compares dspark with the best policy, not with each repeat's luckiest run.
    The per-repeat max of three policies that are equally fast picks up their noise: with 6 %
    run-to-run noise an arm exactly as fast as the best scores 0.95 on it on average, 0.99 here
    (tests/test_engine.py simulates both)."""
    best = max(others, key=lambda o: float(np.median(runs[o]["aggregate_runs"])))
    return best, paired_ratios(runs, mine, [best])


def per_user_at_matched_aggregate(by_concurrency: dict, mine: str = "dspark",
                                  other: str = "mtp1") -> list[float]:
    """At each point of `mine`'s curve (aggregate, per-user tokens/s) whose aggregate lies within
    `other`'s range: its per-user ÷ `other`'s per-user at the same aggregate, read off `other`'s
    curve linearly between its concurrencies (the issue's "per-user at matched aggregate")."""
    rows = [row for row in by_concurrency.values() if mine in row and other in row]
    if not rows:
        return []
    curve = sorted((row[other]["aggregate"], row[other]["per_user"]) for row in rows)
    xs, ys = np.array([a for a, _ in curve]), np.array([u for _, u in curve])
    return [row[mine]["per_user"] / float(np.interp(row[mine]["aggregate"], xs, ys)) for row in rows
            if xs[0] <= row[mine]["aggregate"] <= xs[-1]]


def goals(result: dict) -> dict:
    """The speculation issue's goals on this run's numbers: our engine's ratios are the median of
    the per-repeat paired ratios against the best other policy of the cell (`best_policy_ratios`),
    the baselines' (one run each) dspark's median over theirs. Kept beside them: the ratios
    against each repeat's best run (`paired_ratios`), against each policy (paired; their minimum
    is the strictest reading of "never slower") and the ratios of the medians."""
    b1, runs = result["batch1_tokens_per_s"], result["runs"]
    hf = [b1[k] for k in ("hf_plain", "hf_assisted", "hf_prompt_lookup") if b1.get(k)]
    lc = [b1[k] for k in LLAMACPP if b1.get(k)]
    ours = [b1[k] for k in ("dspark", "dspark_q4_1") if b1.get(k)]  # our best speculative build
    moonshot = max(ours) / max(lc) if lc else None
    paired_lc = None  # dspark on Q4_1 ÷ llama.cpp Q4_1, paired per repeat (when it ran as an arm)
    if "batch1_q4_1_llamacpp" in runs and "batch1_q4_1_dspark" in runs:
        paired_lc = float(np.median(paired_ratios(runs, "batch1_q4_1_dspark", ["batch1_q4_1_llamacpp"])))
        rest = [b1[k] for k in LLAMACPP if k != "llamacpp_q4_1" and b1.get(k)]
        # against Q4_1 the paired reading (or bf16 dspark's, if faster); the others run once
        moonshot = min([max(paired_lc, b1["dspark"] / b1["llamacpp_q4_1"])]
                       + [max(ours) / r for r in rest])
    others = {c: [f"c{c}_{p}" for p in row if p != "dspark"] for c, row in result["by_concurrency"].items()}
    best = {c: best_policy_ratios(runs, f"c{c}_dspark", o) for c, o in others.items()}
    never_slower = {c: float(np.median(r)) for c, (_, r) in best.items()}
    per_repeat_max = {c: float(np.median(paired_ratios(runs, f"c{c}_dspark", o))) for c, o in others.items()}
    each = {c: {name.split("_", 1)[1]: float(np.median(paired_ratios(runs, f"c{c}_dspark", [name])))
                for name in o} for c, o in others.items()}
    of_medians = {c: row["dspark"]["aggregate"] / max(row[p]["aggregate"] for p in row if p != "dspark")
                  for c, row in result["by_concurrency"].items()}
    per_user = per_user_at_matched_aggregate(result["by_concurrency"])
    out = {"batch1_vs_plain": float(np.median(paired_ratios(runs, "batch1_dspark", ["batch1_plain"]))),
           "batch1_vs_plain_of_medians": b1["dspark"] / b1["plain"], "batch1_vs_best_transformers":
           b1["dspark"] / max(hf) if hf else None, "aggregate_vs_best_other_by_concurrency": never_slower,
           "best_other_policy_by_concurrency": {c: name.split("_", 1)[1] for c, (name, _) in best.items()},
           "aggregate_vs_best_other_by_concurrency_runs": {c: r for c, (_, r) in best.items()},
           "aggregate_vs_best_other_by_concurrency_per_repeat_max": per_repeat_max,
           "aggregate_vs_each_policy_by_concurrency": each,
           "aggregate_vs_best_other_by_concurrency_of_medians": of_medians,
           "best_per_user_vs_mtp1": max(per_user) if per_user else None,
           "batch1_vs_best_llamacpp": b1["dspark"] / max(lc) if lc else None,
           "batch1_q4_1_vs_best_llamacpp":
           b1["dspark_q4_1"] / max(lc) if lc and b1.get("dspark_q4_1") else None,
           "batch1_best_dspark_vs_best_llamacpp": moonshot,
           "batch1_q4_1_vs_llamacpp_q4_1_paired": paired_lc,
           "batch1_q4_1_vs_plain_q4_1": float(np.median(paired_ratios(runs, "batch1_q4_1_dspark",
                                                                      ["batch1_q4_1_plain"])))
           if "batch1_q4_1_dspark" in runs else None,
           "propose_share_of_plain_step_batch1": result["propose_share_of_plain_step_batch1"]}
    out["met"] = {"batch1_2x_plain": out["batch1_vs_plain"] >= 2.0,
                  "batch1_1.5x_transformers": None if not hf else out["batch1_vs_best_transformers"] >= 1.5,
                  "never_slower_0.98": min(never_slower.values()) >= 0.98,
                  "per_user_1.5x_mtp1": None if not per_user else max(per_user) >= 1.5,
                  "moonshot_llamacpp": None if not lc else out["batch1_best_dspark_vs_best_llamacpp"] >= 1.0,
                  "propose_le_15pct": None if out["propose_share_of_plain_step_batch1"] is None
                  else out["propose_share_of_plain_step_batch1"] <= 0.15}
    return out


def step_split(run: dict) -> dict[str, float]:
    """A run's mean ms per step in each part the JSON reports (`STEP_PARTS`)."""
    return {k: run["step_ms"][k] for k in STEP_PARTS}


def cell_row(run: dict) -> dict:
    """A closed-loop run as a `by_concurrency` entry: aggregate and per-user tokens/s, same text."""
    return {"aggregate": run["aggregate"], "per_user": run["per_user"],
            "same_as_plain": run.get("same_as_plain")}


def check_also_dtype(spec: wiring.Spec, also: str | None) -> str | None:
    """`--also-dtype`, checked before anything loads: a non-quantized dtype whose (activations,
    weights) differ from the main build's."""
    if also is None:
        return None
    if also not in wiring.DTYPES or also in wiring.QUANTIZED:
        raise SystemExit(f"--also-dtype {also!r}: one of "
                         f"{', '.join(d for d in wiring.DTYPES if d not in wiring.QUANTIZED)}")
    if wiring.torch_dtypes(replace(spec, dtype=also)) == wiring.torch_dtypes(spec):
        raise SystemExit(f"--also-dtype {also}: the main build (--dtype {spec.dtype}) already runs "
                         f"{wiring.torch_dtypes(spec)}")
    return also


def also_dtype_section(build: BenchBuild, runs: dict, concurrency: list[int], free: list[list[int]]) -> dict:
    """The `--also-dtype` build's own numbers (its arms are named `<cell>_<dtype>_<policy>`)."""
    d, target = build.spec.dtype, build.target
    arm = lambda cell, policy: runs[f"{cell}_{d}_{policy}"]
    return {"dtype": d, "activations": str(target.dtype).replace("torch.", ""),
            "weights": str(target.weights_dtype).replace("torch.", ""), "sps": build.sps_source,
            "batch1_tokens_per_s": {p: arm("batch1", p)["aggregate"] for p in ("dspark", "plain")},
            "tau": arm("batch1", "dspark")["tau"],
            "step_ms": step_split(arm("batch1", "dspark")),
            "plain_step_ms_batch1": arm("c1", "plain")["step_ms"]["verify"],
            "by_concurrency": {str(c): {p: cell_row(arm(f"c{c}", p)) for p in ("dspark", "plain")}
                               for c in concurrency},
            "greedy_lengths": build.matched,
            "greedy_dspark_equals_plain_batch1": free == build.reference,
            "free_text_same_as_plain_batch1": same_text_share(free, build.reference)}


def compare_dtypes(result: dict) -> dict:
    """The `--also-dtype` build against the main one, each ratio the median over repeats of the
    paired per-repeat ratio (the arms ran side by side in one cell): its dspark over the main
    dspark, its plain over the main plain, its dspark over the main build's best policy of the
    cell (what serving that dtype instead would give), and its own dspark over its own plain."""
    runs, d = result["runs"], result["also_dtype"]["dtype"]
    med = lambda mine, others: float(np.median(paired_ratios(runs, mine, others)))
    cells = {"batch1": ["batch1_dspark", "batch1_plain"]}
    cells |= {f"c{c}": [f"c{c}_{p}" for p in row] for c, row in result["by_concurrency"].items()}
    return {cell: {"dspark": med(f"{cell}_{d}_dspark", [f"{cell}_dspark"]),
                   "plain": med(f"{cell}_{d}_plain", [f"{cell}_plain"]),
                   "dspark_vs_main_best": float(np.median(best_policy_ratios(runs, f"{cell}_{d}_dspark",
                                                                             main)[1])),
                   "own_dspark_vs_own_plain": med(f"{cell}_{d}_dspark", [f"{cell}_{d}_plain"])}
            for cell, main in cells.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    wiring.add_arguments(p, capacity=32, max_seq_len=1024)
    p.add_argument("--domains", default="code,math,chat")
    p.add_argument("--n-prompts", type=int, default=4,
                   help="prompts per domain (τ depends on the text drawn: one prompt whose text falls "
                        "into a loop moves a batch-1 run of few prompts a long way)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="closed-loop concurrencies")
    p.add_argument("--waves", type=int, default=3,
                   help="requests per slot in a closed-loop run (c x waves requests, at least one per "
                        "prompt): with one wave a run is one batch, and its wall time is its slowest "
                        "request's")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per batch-1 / concurrency cell (policy order rotated); median reported")
    p.add_argument("--sequential", action="store_true",
                   help="run a cell's policies one after another, each on the wall clock (default: side "
                        "by side, one engine step of each in turn, each timed on its own clock, so a "
                        "slow spell of a shared machine slows them alike)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp baselines")
    p.add_argument("--no-t1", action="store_true", help="skip the T = 1 runs")
    p.add_argument("--no-q4-1", action="store_true",
                   help="skip the batch-1 dspark / plain cells on the Q4_1 int4 target (`--dtype q4_1`, "
                        "the GGUF's own 4-bit weights: what llama.cpp's Q4_1 column runs)")
    p.add_argument("--also-dtype", default=None, metavar="DTYPE",
                   help="a second build of the target in this dtype (fp32, bf16, fp16; not the main "
                        "build's): its dspark and plain arms run beside the main build's in every greedy "
                        "cell, batch 1 and each concurrency (`also_dtype` in the JSON)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="greedy requests stop at eos (default: each generates exactly as many tokens as "
                        "plain decoding does for its prompt, so every policy does the same work; in "
                        "bf16 a near-tie can make a speculative run stop elsewhere)")
    p.add_argument("--free-text", action="store_true",
                   help="greedy runs decode their own text (in bf16 a near-tie can send a policy's text "
                        "elsewhere) instead of plain decoding's (default: every policy decodes the same "
                        "text, dspark.bench.same_text)")
    p.add_argument("--out", default=None, help="default: results/bench_e2e_<model>.json")
    p.add_argument("--rescore", default=None, metavar="JSON",
                   help="run nothing: recompute the goals (and the plot) of a bench JSON from its "
                        "measured runs with this version's statistics, in place")


def rescore(path: Path) -> dict:
    """Recompute a bench JSON's goals from its measured runs (`goals`), rewrite it and its plot."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--rescore {path}: not a readable bench JSON ({e})") from e
    missing = [k for k in ("batch1_tokens_per_s", "runs", "by_concurrency") if k not in result]
    if missing:
        raise SystemExit(f"--rescore {path}: not a `dspark bench` result (no {', '.join(missing)})")
    result["goals"] = goals(result)
    if result.get("also_dtype"):
        result["also_dtype"]["vs_main"] = compare_dtypes(result)
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, path.with_suffix(".png"))
    return result


@dataclass
class BenchBuild:
    """One target build the bench times (the spec's dtype, or the Q4_1 int4 weights): its engine
    parts, the steps/second table its scheduler reads, plain decoding's greedy text and lengths
    on it, and the drafting cost its dspark runs share."""

    spec: wiring.Spec
    target: object
    drafter: object
    sps_source: str
    reference: list[list[int]]
    matched: int | list[int]
    same_text: SameTextTarget | None
    draft_cost: DraftCost


def bench_build(spec: wiring.Spec, target, drafter, prompts: list[list[int]], args: argparse.Namespace,
                sizes: list[int], greedy: SamplingParams) -> BenchBuild:
    """The scheduler's table (what `--sps auto` reads for this model, dtype and kind of CPU; else
    profiled now over `sizes`, since the scheduler must see THIS machine's step cost) and plain
    decoding's greedy
    text: each prompt's text and length as plain decoding stops it at eos, decoded alone (an
    untimed pass), then generated exactly by every policy (T = 1 cells stop at eos: their
    lengths are random anyway), and decoded as that same text unless --free-text (`SameTextTarget`)."""
    table = wiring.auto_sps_path(spec.model_key, spec.dtype, threads=wiring.cpu_threads(spec))
    sps_source = spec.sps
    if spec.sps == "profile" or (spec.sps == "auto" and target.device.type == "cpu" and table is None):
        name = "_".join(filter(None, [spec.model_key or "model", wiring.QUANTIZED.get(spec.dtype)]))
        sps_path = paths.MODELS / ".cache" / f"sps_bench_{name}.json"
        quick_sps(target, sorted(set(sizes))).save(sps_path)
        spec, sps_source = replace(spec, sps=str(sps_path)), "profiled now by dspark bench"
    elif spec.sps == "auto" and table is not None:
        sps_source = f"auto: {paths.relative(table)}"
    plain_engine = wiring.build_engine(replace(spec, policy="plain"), target=target, drafter=None)
    # one prompt at a time: the text a request decoded alone gets (a batched pass can part from
    # it at a bf16 near-tie, and the batch-1 cells would then decode a text no batch-1 run gets)
    reference = [plain_engine.generate([p], args.max_tokens, greedy)[0]
                 for p in tqdm(prompts, desc="plain reference text", unit="prompt", leave=False)]
    matched: int | list[int] = args.max_tokens if args.stop_at_eos else [len(o) for o in reference]
    same_text = None if args.free_text else SameTextTarget(target, dict(zip(map(tuple, prompts), reference)))
    return BenchBuild(spec, target, drafter, sps_source, reference, matched, same_text, DraftCost())


def main(args: argparse.Namespace) -> int:
    if args.rescore:
        result = rescore(Path(args.rescore))
        print(json.dumps(result["goals"], indent=1))
        print(f"rescored {paths.relative(Path(args.rescore))} and its .png")
        return 0
    spec = wiring.from_args(args)
    if spec.num_threads > 0:
        torch.set_num_threads(spec.num_threads)
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if 1 not in concurrency:
        raise SystemExit(f"--concurrency {args.concurrency}: include 1 (the batch-1 columns come from it)")
    # side by side, a cell's engines share the target: each needs its own slots
    side_by_side = 1 if args.sequential else len(POLICIES)
    spec = replace(spec, capacity=max(spec.capacity, max(concurrency) * side_by_side))
    also = check_also_dtype(spec, args.also_dtype)
    target = wiring.load_target(spec)
    drafter = wiring.load_drafter(spec, target)
    if drafter is None:
        raise SystemExit(f"dspark bench: no drafter for model {spec.model!r} (drafter {spec.drafter!r}); "
                         "train one or pass --drafter ngram / a folder")
    prompts, prompt_source = load_prompts(spec.model_key, args.domains.split(","), args.n_prompts,
                                          target.tokenizer)
    prompts = fit_prompts(prompts, spec, args.max_tokens)
    greedy, t1 = SamplingParams(), SamplingParams(temperature=1.0, seed=0)
    b_max = max(concurrency) * (spec.gamma + 1)  # the largest step this run sends
    sizes = sorted({b for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
                    if b <= b_max} | {b_max})
    main_build = bench_build(spec, target, drafter, prompts, args, sizes, greedy)
    builds = {"": main_build}
    if not args.no_q4_1 and spec.dtype not in wiring.QUANTIZED and target.device.type == "cpu":
        q4_spec = replace(spec, dtype="q4_1")
        try:
            q4_target = wiring.load_target(q4_spec)
        except (FileNotFoundError, ValueError) as e:
            print(f"dspark bench: no Q4_1 cells ({e})")
        else:  # batch 1 only: the int4 verify's cost by rows up to one full block
            builds["q4_1"] = bench_build(q4_spec, q4_target, wiring.load_drafter(q4_spec, q4_target),
                                         prompts, args, [b for b in sizes if b <= spec.gamma + 1]
                                         + [spec.gamma + 1], greedy)
    if also is not None:  # its dspark and plain arms in every greedy cell: two slots per request
        also_spec = replace(spec, dtype=also, capacity=max(concurrency) * (1 if args.sequential else 2))
        also_target = wiring.load_target(also_spec)
        builds[also] = bench_build(also_spec, also_target, wiring.load_drafter(also_spec, also_target),
                                   prompts, args, sizes, greedy)
    spec, sps_source, reference, matched = (main_build.spec, main_build.sps_source, main_build.reference,
                                            main_build.matched)
    sps_table = wiring.load_sps(spec, target.device)
    # a running server has long since measured what drafting and its steps cost on this machine
    # and learned its survival curve: runs of a policy stand for one warm server, not cold starts
    # (the cold start is in the live frontier's warm-up)
    warm: dict[tuple[str, bool, str], Policy] = {}  # (policy, greedy, build) -> its last run's policy

    def engine(policy: str, params: SamplingParams, build: str = "", free_text: bool = False):
        b = builds[build]
        on = b.same_text if b.same_text is not None and params.greedy and not free_text else b.target
        eng = wiring.build_engine(replace(b.spec, policy=policy), target=on,
                                  drafter=None if policy == "plain" else b.drafter)
        if eng.policy is not None and eng.policy.counts_drafting:
            eng.policy.draft_cost = b.draft_cost
            if (policy, params.greedy, build) in warm:
                eng.policy.warm_from(warm[policy, params.greedy, build])
            warm[policy, params.greedy, build] = eng.policy
        return eng

    n_b1 = len(prompts)
    eos = list(target.eos_token_ids)
    gguf_q4 = paths.MODELS / ".cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    want_llamacpp = not args.no_llamacpp and spec.model_key == "smollm2" and gguf_q4.is_file()
    # llama.cpp on the same Q4_1 weights as a third arm of the Q4_1 cell: paired with ours per
    # repeat like every policy (its other variants run once, after our cells)
    llama_q4 = (LlamaCpp(gguf_q4, spec.num_threads or torch.get_num_threads(), eos)
                if want_llamacpp and "q4_1" in builds and llamacpp_available() else None)
    beside = [(also, p) for p in ("dspark", "plain")] if also is not None else []  # (build, policy)
    cells = [[("batch1_dspark", "dspark", 1, greedy, ""), ("batch1_plain", "plain", 1, greedy, "")]
             + [(f"batch1_{b}_{p}", p, 1, greedy, b) for b, p in beside]]
    if "q4_1" in builds:
        cells += [[("batch1_q4_1_dspark", "dspark", 1, greedy, "q4_1"),
                   ("batch1_q4_1_plain", "plain", 1, greedy, "q4_1")]
                  + ([("batch1_q4_1_llamacpp", "llamacpp", 1, greedy, "q4_1")] if llama_q4 else [])]
    if not args.no_t1:
        cells += [[("batch1_T1_dspark", "dspark", 1, t1, ""), ("batch1_T1_plain", "plain", 1, t1, "")]]
    cells += [[(f"c{c}_{p}", p, c, greedy, "") for p in POLICIES]
              + [(f"c{c}_{b}_{p}", p, c, greedy, b) for b, p in beside] for c in concurrency]
    # every cell `repeats` times, its policies side by side (`run_closed_loops`: one engine step of
    # each in turn; with --sequential one run after another), their order rotated per repeat; the
    # median run is reported. llama.cpp's arm runs on its own, after ours.
    groups = []
    for i in range(args.repeats):
        for cell in cells:
            arms = [cell[(i + k) % len(cell)] for k in range(len(cell))]
            ours = [arm for arm in arms if arm[1] != "llamacpp"]
            groups += [[arm] for arm in ours] if args.sequential else [ours]
            groups += [[arm] for arm in arms if arm[1] == "llamacpp"]
    tries: dict[str, list[dict]] = {}
    for group in tqdm(groups, desc="dspark bench", unit="cell run"):
        name, policy, c, params, build = group[0]  # a cell's arms share c and params
        if policy == "llamacpp":
            assert llama_q4 is not None  # the arm exists only with it
            tries.setdefault(name, []).append(llama_q4.run(prompts, args.max_tokens))
            continue
        engines = {arm[0]: engine(arm[1], params, arm[4]) for arm in group}
        caps = {arm[0]: builds[arm[4]].matched if params.greedy else args.max_tokens for arm in group}
        measured = run_closed_loops(engines, prompts, c, max(c * args.waves, n_b1), caps, params)
        for arm_name, run in measured.items():
            tries.setdefault(arm_name, []).append(run)
    runs: dict[str, dict] = {}
    for name, rs in tries.items():
        runs[name] = sorted(rs, key=lambda r: r["aggregate"])[len(rs) // 2]
        runs[name]["aggregate_runs"] = [r["aggregate"] for r in rs]
    for name, run in runs.items():  # greedy cells: the text against plain's in the same cell
        plain = runs.get(name.rsplit("_", 1)[0] + "_plain")
        if plain is not None and "_T1_" not in name:
            run["same_as_plain"] = same_text_share(run["outputs"], plain["outputs"])
    # what a free greedy run decodes (untimed, batch 1): where and why its bf16 text parts from plain's
    free: dict[str, list[list[int]]] = {}
    for build, b in builds.items():
        free[build] = run_closed_loop(engine("dspark", greedy, build, free_text=True), prompts, 1, n_b1,
                                      b.matched, greedy)["outputs"]
    same = free[""] == reference
    parted = divergence(target, prompts, reference, free[""])
    batch1 = {"dspark": runs["batch1_dspark"]["aggregate"], "plain": runs["batch1_plain"]["aggregate"],
              "hf_plain": None, "hf_assisted": None, "hf_prompt_lookup": None,
              **dict.fromkeys(LLAMACPP)}
    q4_1 = None
    if "q4_1" in builds:
        b = builds["q4_1"]
        batch1.update(dspark_q4_1=runs["batch1_q4_1_dspark"]["aggregate"],
                      plain_q4_1=runs["batch1_q4_1_plain"]["aggregate"])
        q4_1 = {"tau": runs["batch1_q4_1_dspark"]["tau"],
                "step_ms": step_split(runs["batch1_q4_1_dspark"]),
                "plain_step_ms": runs["batch1_q4_1_plain"]["step_ms"]["verify"],
                "sps": b.sps_source, "sps_table": wiring.load_sps(b.spec, b.target.device).to_dict(),
                "greedy_lengths": b.matched,
                "greedy_dspark_equals_plain": free["q4_1"] == b.reference,
                "free_text_same_as_plain": same_text_share(free["q4_1"], b.reference),
                "greedy_divergence": divergence(b.target, prompts, b.reference, free["q4_1"])}
    if also is not None:
        batch1.update({f"{p}_{also}": runs[f"batch1_{also}_{p}"]["aggregate"] for p in ("dspark", "plain")})
    baselines: dict[str, dict] = {}
    if not args.no_hf:
        baselines["transformers"] = hf_baselines(wiring.model_folder(spec.model), prompts, args.max_tokens,
                                                 eos, spec.gamma, find_draft_lm(spec.model_key))
        for k in ("hf_plain", "hf_assisted", "hf_prompt_lookup"):
            batch1[k] = baselines["transformers"][k]
    if want_llamacpp:
        baselines["llamacpp"] = llamacpp_baselines(gguf_q4, prompts, args.max_tokens, eos,
                                                   spec.num_threads or torch.get_num_threads(), spec.gamma,
                                                   q4_1=llama_q4 is None)
        for k in LLAMACPP:
            batch1[k] = baselines["llamacpp"].get(k, {}).get("tokens_per_s")
        if llama_q4 is not None:  # the paired arm's median run
            batch1["llamacpp_q4_1"] = runs["batch1_q4_1_llamacpp"]["aggregate"]
    propose = runs["c1_dspark"]["propose_ms_by_requests"].get("1")
    plain_step = runs["c1_plain"]["step_ms"]["verify"]
    result = {
        "batch1_tokens_per_s": batch1,
        "batch1_tokens_per_s_T1": None if args.no_t1 else {
            "dspark": runs["batch1_T1_dspark"]["aggregate"], "plain": runs["batch1_T1_plain"]["aggregate"]},
        "tau": runs["batch1_dspark"]["tau"],
        "by_concurrency": {str(c): {p: cell_row(runs[f"c{c}_{p}"]) for p in POLICIES} for c in concurrency},
        "step_ms": step_split(runs["batch1_dspark"]),
        "propose_ms_by_requests": {c: runs[f"c{c}_dspark"]["propose_ms_by_requests"].get(str(c))
                                   for c in map(str, concurrency)},
        "plain_step_ms_batch1": plain_step,
        "propose_share_of_plain_step_batch1": None if propose is None else propose / plain_step,
        "greedy_dspark_equals_plain_batch1": same,
        "greedy_divergence_batch1": parted,
        "free_text_same_as_plain_batch1": same_text_share(free[""], reference),
        "q4_1": q4_1,
        "also_dtype": None if also is None else also_dtype_section(builds[also], runs, concurrency,
                                                                   free[also]),
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in runs.items()},
        "baselines": baselines,
        "config": {"model": spec.model, "dtype": str(target.dtype).replace("torch.", ""),
                   "weights_dtype": str(target.weights_dtype).replace("torch.", ""),
                   "drafter": spec.drafter, "gamma": spec.gamma, "sps": sps_source,
                   "sps_table": sps_table.to_dict(),
                   "prompts": prompt_source, "domains": args.domains, "num_prompts": n_b1,
                   "max_tokens": args.max_tokens, "repeats": args.repeats, "waves": args.waves,
                   "cells": "one after another" if args.sequential else "side by side, step by step",
                   "device": str(target.device),
                   "greedy_lengths": "stop at eos" if args.stop_at_eos else matched,
                   "same_text": main_build.same_text is not None,
                   "reference_text": "plain decoding, each prompt alone (batch 1)",
                   "cpu": cpu_name(), "threads": torch.get_num_threads(),
                   "bf16_min_rows": linear.BF16_MIN_ROWS,
                   "pack_rows_hint": linear.pack_rows_hint(target.dtype),
                   "cpu_gemm": linear.serving_cpu_gemm(target.dtype),
                   "torch": torch.__version__, "load_avg_1min": _load_avg()},
    }
    result["goals"] = goals(result)
    if result["also_dtype"] is not None:
        result["also_dtype"]["vs_main"] = compare_dtypes(result)
    out = Path(args.out) if args.out else paths.RESULTS / f"bench_e2e_{spec.model_key or 'model'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("batch1_tokens_per_s", "tau", "step_ms", "goals")}, indent=1))
    print(f"wrote {paths.relative(out)} and its .png")
    return 0


def _load_avg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return None


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    b1 = {k: v for k, v in result["batch1_tokens_per_s"].items() if v is not None}
    ax1.bar(list(b1), list(b1.values()), color=["C3" if k.startswith("dspark") else "C0" for k in b1])
    ax1.set(ylabel="tokens/s", title="batch 1, greedy")
    ax1.tick_params(axis="x", rotation=30, labelsize=7)
    colours = {"dspark": "C3", "plain": "C1", "mtp1": "C2", "fixed:7": "C0"}  # dspark red, as in the bars
    for i, policy in enumerate(POLICIES):
        rows = result["by_concurrency"]
        xs = [rows[c][policy]["aggregate"] for c in rows]
        ys = [rows[c][policy]["per_user"] for c in rows]
        ax2.plot(xs, ys, marker="o", color=colours.get(policy, f"C{4 + i}"), label=policy)
        for c, x, y in zip(rows, xs, ys):
            ax2.annotate(c, (x, y), fontsize=6)
    also = result.get("also_dtype")
    for policy in ("dspark", "plain") if also else ():
        rows = also["by_concurrency"]
        ax2.plot([rows[c][policy]["aggregate"] for c in rows], [rows[c][policy]["per_user"] for c in rows],
                 marker="x", linestyle="--", color=colours[policy],
                 label=f"{policy}, {also['weights']} weights / {also['activations']} activations")
    ax2.set(xlabel="aggregate tokens/s", ylabel="per-user tokens/s",
            title=f"closed-loop concurrency {', '.join(result['by_concurrency'])}")
    ax2.legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"{cfg['model']} ({cfg['dtype']}), drafter {cfg['drafter']}, γ {cfg['gamma']}, "
                 f"{cfg['threads']} thread{'s' if cfg['threads'] != 1 else ''}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
