"""Train the demo target: a small Qwen3-architecture LM built with the project's own model
code (`dspark.runtime.model.Transformer.forward_train`), saved as a Hugging Face folder with
`dspark.runtime.loader.save_pretrained` (docs/architecture.md §4).

Schedule: AdamW, linear warmup then cosine decay to 10 % of the peak LR. With a
`--time-budget` (the machine is shared, so throughput varies), the schedule's progress is
elapsed / budget: the run ends on time with a fully decayed LR however the load changes.
The first `--probe-steps` steps measure throughput to estimate the step count, re-estimated
at every held-out eval from the recent rate (shown and recorded).
Resumable: a checkpoint (model, optimizer, step, elapsed time, losses) is written to
`--work` every `--ckpt-minutes` and reloaded on start.

    nice -n 5 python build/demo/train_target.py --time-budget 3600
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from dspark.runtime.config import ModelConfig
from dspark.runtime.loader import save_pretrained
from dspark.runtime.model import Transformer

HERE = Path(__file__).resolve().parent
DOMAINS = ("code", "prose", "math")
EOS_ID, PAD_ID = 0, 1  # fixed by tokenizer.py


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    return ModelConfig(model_type="qwen3", vocab_size=vocab_size, hidden_size=args.hidden,
                       intermediate_size=args.ffn, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       head_dim=args.hidden // args.heads, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=2048, tie_word_embeddings=True, qk_norm=True,
                       bos_token_id=None, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)


def load_tokens(work: Path, split: str) -> dict[str, np.ndarray]:
    return {d: np.fromfile(work / "tokens" / f"{d}.{split}.bin", dtype=np.uint16) for d in DOMAINS}


def parse_weights(spec: str) -> dict[str, float]:
    """'code=0.4,prose=0.45,math=0.15' -> normalised {domain: weight} over DOMAINS."""
    w = {d: 0.0 for d in DOMAINS}
    for part in spec.split(","):
        name, _, val = part.partition("=")
        if name.strip() not in w:
            raise SystemExit(f"--domain-weights: unknown domain {name.strip()!r} (use {', '.join(DOMAINS)})")
        w[name.strip()] = float(val)
    total = sum(w.values())
    if total <= 0:
        raise SystemExit("--domain-weights: weights must sum to a positive number")
    return {d: v / total for d, v in w.items()}


def sample_batch(streams: dict[str, np.ndarray], weights: dict[str, float], batch: int, seq_len: int,
                 step: int, seed: int) -> torch.Tensor:
    """batch random windows of seq_len+1 tokens, each from a domain drawn by `weights`;
    depends only on (seed, step), so resuming is exact."""
    rng = np.random.default_rng([seed, step])
    names = [d for d in DOMAINS if weights[d] > 0]
    picks = rng.choice(len(names), size=batch, p=[weights[d] for d in names])
    rows = []
    for i in picks:
        stream = streams[names[i]]
        s = int(rng.integers(0, stream.size - seq_len - 1))
        rows.append(stream[s:s + seq_len + 1])
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def lr_at(progress: float, warmup_frac: float, peak: float, step: int, warmup_steps: int) -> float:
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    p = min(1.0, max(0.0, (progress - warmup_frac) / max(1e-9, 1 - warmup_frac)))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def heldout_loss(model: Transformer, heldout: dict[str, np.ndarray], seq_len: int,
                 windows: int) -> dict[str, float]:
    """Mean next-token loss on the first `windows` non-overlapping windows of each domain."""
    model.eval()
    out = {}
    for d, stream in heldout.items():
        n = min(windows, (stream.size - 1) // seq_len)
        x = torch.from_numpy(stream[: n * seq_len + 1].astype(np.int64))
        inp = torch.stack([x[i * seq_len:(i + 1) * seq_len] for i in range(n)])
        tgt = torch.stack([x[i * seq_len + 1:(i + 1) * seq_len + 1] for i in range(n)])
        out[d] = F.cross_entropy(model.forward_train(inp).flatten(0, 1), tgt.flatten()).item()
    model.train()
    return out


def plot_losses(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    tr = np.array(history["train"])  # rows: tokens_seen, loss
    if tr.size:
        k = max(1, len(tr) // 100)
        smooth = np.convolve(tr[:, 1], np.ones(k) / k, mode="valid")
        ax.plot(tr[k - 1:, 0] / 1e6, smooth, label="train (smoothed)", color="black", lw=1.2)
    for d in DOMAINS:
        ev = [(t, losses[d]) for t, losses in history["heldout"]]
        if ev:
            ax.plot([t / 1e6 for t, _ in ev], [v for _, v in ev], marker="o", ms=3, label=f"held-out {d}")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Demo target training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=HERE / "work")
    ap.add_argument("--out", type=Path, default=HERE / "target")
    ap.add_argument("--loss-png", type=Path, default=HERE.parents[1] / "results" / "target_loss.png")
    ap.add_argument("--hidden", type=int, default=320)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=5)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--domain-weights", default="code=0.4,prose=0.45,math=0.15",
                    help="share of training windows per domain (math is easy: the 5M run reached "
                         "ppl 2.5 there while prose lagged the 3-gram)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--max-steps", type=int, default=None, help="fixed step count (reproducible schedule)")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds of training; sets max_steps")
    ap.add_argument("--probe-steps", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--eval-windows", type=int, default=3)
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = ap.parse_args()
    if args.max_steps is None and args.time_budget is None:
        ap.error("give --max-steps or --time-budget")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train = load_tokens(args.work, "train")
    weights = parse_weights(args.domain_weights)
    heldout = load_tokens(args.work, "heldout")
    tokenizer_path = args.work / "tokenizer.json"
    from tokenizers import Tokenizer

    cfg = model_config(args, Tokenizer.from_file(str(tokenizer_path)).get_vocab_size())
    model = Transformer(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt_path = args.work / "target_ckpt.pt"
    state = {"step": 0, "elapsed": 0.0, "max_steps": args.max_steps, "history": {"train": [], "heldout": []}}
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        print(f"resumed from step {state['step']} ({state['elapsed'] / 60:.1f} min trained)")
    tokens_per_step = args.batch * args.seq_len
    shares = ", ".join(f"{d} {train[d].size / 1e6:.2f}M (w {weights[d]:.2f})" for d in DOMAINS)
    print(f"model: {n_params / 1e6:.2f}M params, {tokens_per_step} tokens/step, train tokens {shares}")

    def save_ckpt() -> None:
        tmp = ckpt_path.with_suffix(".pt.tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                    "args": vars(args)}, tmp)
        tmp.replace(ckpt_path)

    model.train()
    budget = args.time_budget
    t_start = time.time() - state["elapsed"]
    last_ckpt = time.time()
    probe_t0 = None
    bar = tqdm(total=state["max_steps"], initial=state["step"], unit="step", dynamic_ncols=True)
    while True:
        step = state["step"]
        elapsed = time.time() - t_start
        if budget is not None and probe_t0 is None and step >= args.probe_steps // 4:
            probe_t0 = (time.time(), step)  # skip the first few steps (allocator warm-up)
        if budget is not None and probe_t0 is not None and (
                step == args.probe_steps or (step > args.probe_steps and step % args.eval_every == 0)):
            sec_per_step = (time.time() - probe_t0[0]) / max(1, step - probe_t0[1])
            state["max_steps"] = int(step + max(0.0, budget - elapsed) / sec_per_step)
            state.setdefault("probe_sec_per_step", sec_per_step)
            bar.total = state["max_steps"]
            bar.refresh()
            tqdm.write(f"throughput: {sec_per_step:.2f} s/step "
                       f"({tokens_per_step / sec_per_step:.0f} tokens/s) "
                       f"-> about {state['max_steps']} steps in the budget")
            probe_t0 = (time.time(), step)
        if budget is not None:
            progress = elapsed / budget
            if progress >= 1.0:
                break
        else:
            progress = step / state["max_steps"]
            if step >= state["max_steps"]:
                break
        lr = lr_at(progress, 0.0, args.lr, step, args.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_batch(train, weights, args.batch, args.seq_len, step, args.seed)
        logits = model.forward_train(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] = step + 1
        state["elapsed"] = time.time() - t_start
        state["history"]["train"].append((state["step"] * tokens_per_step, loss.item()))
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}", min=f"{state['elapsed'] / 60:.1f}")
        if state["step"] % args.eval_every == 0:
            ev = heldout_loss(model, heldout, args.seq_len, args.eval_windows)
            state["history"]["heldout"].append((state["step"] * tokens_per_step, ev))
            tqdm.write(f"step {state['step']}: held-out " + " ".join(f"{d} {v:.3f}" for d, v in ev.items()))
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            save_ckpt()
            last_ckpt = time.time()
    bar.close()
    ev = heldout_loss(model, heldout, args.seq_len, args.eval_windows)
    state["history"]["heldout"].append((state["step"] * tokens_per_step, ev))
    save_ckpt()
    save_pretrained(model, cfg, args.out, tokenizer_path=tokenizer_path,
                    dtype=getattr(torch, args.save_dtype))
    plot_losses(state["history"], args.loss_png)
    info = {"params": n_params, "steps": state["step"], "tokens_seen": state["step"] * tokens_per_step,
            "train_minutes": round(state["elapsed"] / 60, 1), "final_heldout_loss": ev,
            "probe_sec_per_step": state.get("probe_sec_per_step"),
            "hyperparameters": {k: v for k, v in vars(args).items() if not isinstance(v, Path)}}
    (args.work / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "hyperparameters"}, indent=1))


if __name__ == "__main__":
    main()
