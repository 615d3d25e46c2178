"""Held-out perplexity of the shipped demo target vs an interpolated Kneser-Ney 3-gram model
trained on the same train tokens, per domain, plus greedy samples for the README.

Both models score the same tokens: positions [2, n) of the first `--max-tokens` tokens of
each domain's held-out stream (documents joined by EOS). The target reads sliding windows of
`--window` tokens with stride `--stride`, so every scored token sees at least
window - stride tokens of context (the model was trained on 256-token windows).

    python build/demo/eval_target.py   # -> results/target_eval.json, results/target_samples.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dspark.paths import DEMO_TARGET, RESULTS, relative
from dspark.runtime.engine import SpecEngine
from dspark.runtime.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trigram import KneserNeyTrigram  # noqa: E402

HERE = Path(__file__).resolve().parent
DOMAINS = ("code", "prose", "math")
CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size")


@torch.no_grad()
def target_nll(model, tokens: np.ndarray, window: int, stride: int, batch: int = 8) -> np.ndarray:
    """-log p(tokens[j] | up to `window` previous tokens) for j in [2, n). Windows start every
    `stride` tokens (plus one flush with the end); a token is scored by the first window that
    covers it, which is the one giving it the longest context (>= window - stride)."""
    n = tokens.size
    w = min(window, n - 1)
    starts = list(range(0, n - w, stride))
    if starts[-1] != n - 1 - w:
        starts.append(n - 1 - w)
    x = torch.from_numpy(tokens.astype(np.int64))
    nll = np.full(n, np.nan)
    for lo in range(0, len(starts), batch):
        chunk = starts[lo:lo + batch]
        inp = torch.stack([x[s:s + w] for s in chunk])
        tgt = torch.stack([x[s + 1:s + w + 1] for s in chunk])
        lp = F.log_softmax(model.forward_train(inp).float(), -1).gather(-1, tgt[..., None])[..., 0]
        for b, s in enumerate(chunk):
            seg = nll[s + 1:s + w + 1]  # a view: fill only positions no earlier window scored
            fresh = np.isnan(seg)
            seg[fresh] = -lp[b].numpy()[fresh]
    assert not np.isnan(nll[2:]).any(), "some held-out token was not scored"
    return nll[2:]


def greedy_samples(target_dir: Path, n_code: int, max_new: int) -> list[dict]:
    from dspark.runtime.target import TargetEngine
    from dspark.tools.prompts import load_prompt_set

    engine = TargetEngine.from_pretrained(target_dir, capacity=4, max_seq_len=1024)
    tok = engine.tokenizer
    prompts = [("code", p) for p in load_prompt_set("code", n_code)]
    prompts += [("math", p) for p in load_prompt_set("math", 2)]
    prompts += [("prose", p) for p in load_prompt_set("prose", 1)]
    ids = [tok.encode(p).ids for _, p in prompts]
    outs = SpecEngine(engine).generate(ids, max_new)
    return [{"domain": d, "prompt": p, "greedy_continuation": tok.decode(o, skip_special_tokens=True),
             "new_tokens": len(o)} for (d, p), o in zip(prompts, outs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=DEMO_TARGET)
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--max-tokens", type=int, default=40_000, help="held-out tokens per domain (first N)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--stride", type=int, default=192)
    ap.add_argument("--samples", type=int, default=4, help="HumanEval prompts to continue greedily")
    ap.add_argument("--sample-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "target_eval.json")
    ap.add_argument("--samples-out", type=Path, default=RESULTS / "target_samples.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    tokens = args.work / "tokens"
    train = np.concatenate([np.fromfile(tokens / f"{d}.train.bin", dtype=np.uint16) for d in DOMAINS])
    model, cfg = load_model(args.target)
    trigram = KneserNeyTrigram(train, cfg.vocab_size)
    ppl, counts = {}, {}
    for d in DOMAINS:
        held = np.fromfile(tokens / f"{d}.heldout.bin", dtype=np.uint16)[: args.max_tokens]
        t_nll = target_nll(model, held, args.window, args.stride)
        g_nll = trigram.token_nll(held)
        assert t_nll.shape == g_nll.shape
        ppl[d] = {"target": round(float(np.exp(t_nll.mean())), 3),
                  "trigram": round(float(np.exp(g_nll.mean())), 3)}
        counts[d] = int(t_nll.size)
        print(f"{d:6s} target ppl {ppl[d]['target']:8.2f}   3-gram ppl {ppl[d]['trigram']:8.2f}   "
              f"({counts[d]} tokens)")
    info_path = args.work / "train_info.json"
    result = {
        "perplexity": ppl,
        "tokens_evaluated": counts,
        "target_beats_trigram": {d: ppl[d]["target"] < ppl[d]["trigram"] for d in DOMAINS},
        "target": {"path": relative(args.target), "params": sum(p.numel() for p in model.parameters()),
                   "config": {k: getattr(cfg, k) for k in CONFIG_KEYS}},
        "trigram": {"method": "interpolated Kneser-Ney", "discounts": [trigram.d1, trigram.d2, trigram.d3],
                    "train_tokens": int(train.size)},
        "method": {"window": args.window, "stride": args.stride, "max_tokens_per_domain": args.max_tokens,
                   "scored_positions": "[2, n) of each held-out stream"},
        "training": json.loads(info_path.read_text()) if info_path.is_file() else None,
    }
    if result["training"]:
        result["training"].pop("hyperparameters", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.samples > 0:
        samples = greedy_samples(args.target, args.samples, args.sample_tokens)
        args.samples_out.write_text(json.dumps({"decoding": "greedy", "max_new_tokens": args.sample_tokens,
                                                "samples": samples}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
