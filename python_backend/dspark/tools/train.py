"""`dspark train`: train a drafter on target-generated data (docs/architecture.md §8).

    dspark train --make-data                                  # sample continuations + target features
    dspark train --kind dspark --head markov --name dspark-markov --steps 300
    torchrun --nproc_per_node 2 -m dspark.cli train ...       # DDP (gloo on CPU, NCCL on GPU)

One pipeline trains every drafter kind on the same data with the same budget (steps ×
sequences per step): dspark (head markov | rnn | none = DFlash-style), eagle, draft_lm.
Each step draws `--batch` sequences and, per sequence, `--anchors` random anchors a (valid
if tokens a and a+1 are in the loss mask); block position k = 1..G predicts t_{a+k} and is
supervised while t_{a+1..a+k} stay in the loss mask (the contiguous valid prefix). The
sequential head is teacher-forced (x_{k−1} = t_{a+k−1}). The draft LM is supervised on every
position whose next token is in the loss mask (k = 1). Per supervised row:
    α_ce·CE(p_d, t) + α_tv·TV(p_d, p_t) + α_conf·BCE(σ(z), c*),   c* = 1 − ½‖p_d − p_t‖₁
with p_d, p_t at T = 1, weighted w_k = exp(−(k−1)/λ) (λ = --decay-lambda: a number or "gamma").
The target, its embedding and LM head are frozen; target taps / final hidden states come from
the data folder (computed once), target logits = lm_head(hidden) per batch."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from dspark.paths import DEMO, REPO_ROOT, RESULTS

SMOLLM2_BUILD = REPO_ROOT / "build" / "smollm2"

DEFAULT_DATA = DEMO / "work" / "drafter_data"
KINDS = ("dspark", "eagle", "draft_lm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="target: smollm2 (default), demo (10M demo target) or a Hugging Face folder")
    p.add_argument("--dtype", default="auto", help="target dtype (auto: the serving dtype, dspark.wiring)")
    p.add_argument("--data", type=Path, default=None,
                   help="data folder (default: build/<model>/work/drafter_data)")
    g = p.add_argument_group("data generation (--make-data)")
    g.add_argument("--make-data", action="store_true", help="generate the data folder and exit")
    g.add_argument("--corpus", type=Path, default=None,
                   help="chat prompt corpus split (smollm2 default: build/smollm2/work/corpus/train.jsonl)")
    g.add_argument("--token-dir", type=Path, default=DEMO / "work" / "tokens",
                   help="demo target: corpus token streams {domain}.train.bin")
    g.add_argument("--n-per-domain", type=int, default=100)
    g.add_argument("--max-new", type=int, default=128)
    g.add_argument("--min-prompt", type=int, default=16, help="demo target: prompt window tokens")
    g.add_argument("--max-prompt", type=int, default=64,
                   help="demo target: prompt window tokens; chat corpus: the longest prompt kept")
    g.add_argument("--gen-batch", type=int, default=50, help="requests decoded together (target slots)")
    g.add_argument("--chunk", type=int, default=None, help="prompts per resumable shard (2 x gen-batch)")
    g.add_argument("--t1-share", type=float, default=0.0,
                   help="share of prompts continued at plain T=1 instead of T 0.7/top-p 0.8/top-k 20")
    g.add_argument("--greedy-share", type=float, default=0.0, help="share of prompts continued greedily")
    g.add_argument("--prompt-offset", type=int, default=0,
                   help="chat corpus: skip this many prompts per domain (a second, disjoint data folder)")
    m = p.add_argument_group("model")
    m.add_argument("--kind", choices=KINDS, default="dspark")
    m.add_argument("--head", choices=("markov", "rnn", "none"), default="markov")
    m.add_argument("--name", default=None, help="drafter name (default from kind/head)")
    m.add_argument("--layers", type=int, default=2, help="backbone layers (dspark) / draft LM layers")
    m.add_argument("--intermediate", type=int, default=512, help="MLP width of drafter layers")
    m.add_argument("--head-rank", type=int, default=64)
    m.add_argument("--tap-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="scale each tap channel by 1/RMS over the training data before the drafter's fc "
                        "(fixed, saved with the drafter; SmolLM2 has channels 30-100x larger than the rest)")
    m.add_argument("--norm-init-scale", type=float, default=1.0,
                   help="start the drafter's final norm at this multiple of the target's (smaller = "
                        "softer initial logits)")
    m.add_argument("--context", choices=("taps", "own"), default="taps",
                   help="dspark: context from the target's taps, or the drafter's own token encoder")
    m.add_argument("--context-layers", type=int, default=1, help="layers of the own context encoder")
    m.add_argument("--context-intermediate", type=int, default=None,
                   help="MLP width of the own context encoder (default: --intermediate)")
    m.add_argument("--block-size", type=int, default=15, help="G: trained block / unrolled steps (max γ)")
    m.add_argument("--gamma", type=int, default=7, help="default γ stored with the drafter")
    m.add_argument("--save-dtype", choices=("float32", "float16"), default="float16")
    t = p.add_argument_group("optimisation")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--batch", type=int, default=8, help="sequences per step (global, split over ranks)")
    t.add_argument("--anchors", type=int, default=12, help="random anchors per sequence")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--decay-lambda", default="4", help='position decay λ: a number or "gamma" (= block size)')
    t.add_argument("--alpha-ce", type=float, default=0.1)
    t.add_argument("--alpha-tv", type=float, default=0.9)
    t.add_argument("--alpha-conf", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--device", default="cpu",
                   help="cpu (default), cuda[:N] or auto: where the drafter trains; the data's features "
                        "move there once (about 4.6 KB per token for SmolLM2)")
    t.add_argument("--time-budget", type=float, default=None,
                   help="seconds: stop at whichever of --steps or this comes first; the learning-rate "
                        "cosine follows the larger of the two progress fractions, so it always completes")
    t.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="autocast dtype of the forward (bf16: AMX matmuls on the CPU; master weights fp32)")
    t.add_argument("--exclude-modes", default="",
                   help="comma list of data modes to leave out (recipe, t1, greedy): data ablations")
    t.add_argument("--data-fraction", type=float, default=1.0,
                   help="train on this seeded random share of the sequences (data-size ablations)")
    t.add_argument("--out", type=Path, default=None, help="drafter folder (build/demo/drafters/NAME)")
    t.add_argument("--work", type=Path, default=None, help="checkpoints (build/demo/work/train/NAME)")
    t.add_argument("--ckpt-every", type=int, default=50)
    t.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    t.add_argument("--stop-after", type=int, default=None,
                   help="checkpoint and stop after this many steps of this run (resume later)")
    t.add_argument("--results", type=Path, default=RESULTS)
    t.add_argument("--no-export", action="store_true", help="skip writing the drafter folder")


def default_name(kind: str, head: str) -> str:
    return {"dspark": f"dspark-{head}" if head != "none" else "dflash", "eagle": "eagle",
            "draft_lm": "draft-lm"}[kind]


# ---------------------------------------------------------------- models


def tap_channel_scale(taps: torch.Tensor, rows: int = 100_000, seed: int = 0) -> torch.Tensor:
    """1 / RMS of each tap channel over a sample of training rows [tap_dim], leaving out the
    attention-sink rows (row norm above 20x the median: their few channels reach ~25k)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, taps.shape[0], (min(rows, taps.shape[0]),), generator=g).sort().values
    x = taps[idx].float()
    norm = x.norm(dim=1)
    x = x[norm < 20 * norm.median()]
    return 1.0 / x.pow(2).mean(0).sqrt().clamp_min(1e-3)


def build_model(args, target_model, target_cfg, tap_layers: list[int],
                tap_scale: torch.Tensor | None = None) -> nn.Module:
    """A fresh drafter of `args.kind` sized from the target; shared weights attached;
    `tap_scale` [tap_dim] sets the per-channel tap normalisation (config tap_norm)."""
    d = target_cfg.hidden_size
    embed = target_model.embed_tokens.weight
    lm_head = embed if target_model.lm_head_proj is None else target_model.lm_head_proj.weight
    mask_id = _mask_token_id(getattr(args, "model_folder", None))
    own = args.kind == "dspark" and getattr(args, "context", "taps") == "own"
    tap_norm = tap_scale is not None and not own and args.kind in ("dspark", "eagle")
    common = dict(vocab_size=target_cfg.vocab_size, hidden_size=d, tap_dim=d if own else len(tap_layers) * d,
                  num_heads=target_cfg.num_attention_heads, num_kv_heads=target_cfg.num_key_value_heads,
                  head_dim=target_cfg.head_dim, intermediate_size=args.intermediate,
                  rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
                  block_size=args.block_size, gamma=min(args.gamma, args.block_size),
                  tap_layers=list(tap_layers), tap_norm=tap_norm)
    if args.kind == "dspark":
        from dspark.runtime.drafter.dspark_model import DSparkConfig, DSparkModel

        own_cfg = {"context": getattr(args, "context", "taps"),
                   "context_layers": getattr(args, "context_layers", 1),
                   "context_intermediate_size": getattr(args, "context_intermediate", None)}
        model = DSparkModel(DSparkConfig(**common, num_layers=args.layers, head=args.head,
                                         head_rank=args.head_rank, **own_cfg))
    elif args.kind == "eagle":
        from dspark.runtime.drafter.eagle import EagleConfig, EagleModel

        model = EagleModel(EagleConfig(**common))
    else:
        from dspark.runtime.drafter.draft_lm import new_draft_lm

        model, cfg = new_draft_lm(target_cfg, args.layers, args.intermediate, embed_weight=embed)
        model.config = cfg
        return model
    model.init_from_target(embed, target_model.norm.weight, mask_id)
    with torch.no_grad():
        model.norm.weight.mul_(getattr(args, "norm_init_scale", 1.0))
    if tap_norm:
        with torch.no_grad():
            model.tap_scale.copy_(tap_scale)
    model.attach_shared(embed, lm_head)
    return model


def _mask_token_id(target_dir) -> int | None:
    """Id of "<|mask|>" in the target's tokenizer (the learned mask embedding starts there)."""
    from dspark.runtime.text import load_tokenizer

    # a weights-only target has no tokenizer, hence no mask id
    tok = load_tokenizer(target_dir, optional=True) if target_dir is not None else None
    return tok.token_to_id("<|mask|>") if tok is not None else None


class CeTv(torch.autograd.Function):
    """Per row: CE(p_d, target) and TV(p_d, p_t) = ½‖p_d − p_t‖₁ with p_d = softmax(logits_d),
    p_t = softmax(logits_t) (no gradient), in float32 with few vocabulary-wide passes and
    buffers: the V = 49152 rows dominate a training step on the CPU. Gradient w.r.t. the
    drafter logits: g_ce·(p_d − onehot) + g_tv·½·p_d ⊙ (s − ⟨p_d, s⟩), s = sign(p_d − p_t)."""

    @staticmethod
    def forward(ctx, logits_d: torch.Tensor, logits_t: torch.Tensor, target: torch.Tensor):
        p_d = torch.softmax(logits_d.float(), -1)  # (the fast CPU kernel; logsumexp is ~5x slower)
        ce = -p_d.gather(-1, target[:, None])[:, 0].clamp_min(torch.finfo(torch.float32).tiny).log()
        diff = torch.softmax(logits_t.float(), -1).neg_().add_(p_d)  # p_d − p_t
        tv = 0.5 * torch.linalg.vector_norm(diff, ord=1, dim=-1)
        ctx.save_for_backward(p_d, diff.sign_(), target)
        ctx.in_dtype = logits_d.dtype
        return ce, tv

    @staticmethod
    def backward(ctx, g_ce: torch.Tensor, g_tv: torch.Tensor):
        p_d, s, target = ctx.saved_tensors
        dot = torch.bmm(p_d[:, None, :], s[:, :, None])[:, :, 0]  # ⟨p_d, s⟩ [R, 1]
        grad = s.sub_(dot).mul_(p_d).mul_(0.5 * g_tv[:, None])
        grad.addcmul_(p_d, g_ce[:, None])
        grad.scatter_add_(-1, target[:, None], -g_ce[:, None])
        return grad.to(ctx.in_dtype), None, None


class DrafterLoss(nn.Module):
    """Wraps a drafter model so one forward returns the weighted loss sum of its rows
    (what DDP needs: gradients are reduced for parameters used in this forward)."""

    def __init__(self, model: nn.Module, kind: str, lm_head_weight: torch.Tensor,
                 alphas: tuple[float, float, float],
                 decay_lambda: float) -> None:
        super().__init__()
        self.model, self.kind = model, kind
        self.lm_head_weight = lm_head_weight.detach()
        self.alphas, self.decay_lambda = alphas, decay_lambda

    def forward(self, tokens, loss_mask, taps, hidden, anchors):
        """-> (Σ w·loss, stats dict of Σ w·component and Σ w) over this rank's rows."""
        if self.kind == "draft_lm":
            h_all = self.model.forward_hidden(tokens)[0]
            valid = loss_mask[:, 1:]
            rows = valid.nonzero(as_tuple=True)
            logits_d = self.model.lm_head(h_all[:, :-1][rows])
            target_tok = tokens[:, 1:][rows]
            h_t = hidden[:, :-1][rows]
            k0 = torch.zeros_like(target_tok)
            conf = None
        else:
            b, t = tokens.shape
            g = self.model.config.block_size
            offs = torch.arange(1, g + 1, device=tokens.device)
            tgt_pos = anchors[..., None] + offs  # [B, nb, G] position of the predicted token
            inside = tgt_pos < t
            tgt_c = tgt_pos.clamp(max=t - 1)
            in_mask = loss_mask.gather(1, tgt_c.flatten(1)).view_as(tgt_c) & inside
            valid = in_mask.long().cumprod(-1).bool() & (anchors >= 1)[..., None]  # contiguous valid prefix
            h = self.model.train_hidden(tokens, taps, anchors)  # [B, nb, G, d]
            x_prev = tokens.gather(1, (tgt_c - 1).flatten(1)).view_as(tgt_c)
            rows = valid.nonzero(as_tuple=True)
            h_sel, x_sel = h[rows], x_prev[rows]
            target_tok = tokens.gather(1, tgt_c.flatten(1)).view_as(tgt_c)[rows]
            h_t = hidden.gather(1, (tgt_c - 1).flatten(1)[..., None].expand(-1, -1, hidden.shape[-1]))
            h_t = h_t.view(*tgt_c.shape, -1)[rows]
            k0 = (offs - 1).expand_as(tgt_c)[rows]
            logits_d = self.model.lm_head(h_sel)
            if self.kind == "dspark":
                head = self.model.head
                feats = head.teacher(x_prev, h)
                if feats is not None:
                    logits_d = logits_d + head.bias(feats[rows])
                conf = self.model.conf(h_sel, head.token_features(x_sel))
            else:
                conf = self.model.conf_logit(h_sel)
        w = torch.exp(-k0.float() / self.decay_lambda)
        with torch.no_grad():
            logits_t = F.linear(h_t.to(logits_d.dtype), self.lm_head_weight.to(logits_d.dtype))
        ce, tv = CeTv.apply(logits_d, logits_t, target_tok)
        a_ce, a_tv, a_conf = self.alphas
        loss = a_ce * ce + a_tv * tv
        n_pos = 1 if self.kind == "draft_lm" else self.model.config.block_size
        stats = {"ce": (w * ce).sum().detach(), "tv": (w * tv).sum().detach(), "weight": w.sum().detach(),
                 "rows": torch.tensor(float(w.numel()), device=w.device),
                 # per block position
                 "tv_k": torch.zeros(n_pos, device=w.device).index_add_(0, k0, tv.detach().float()),
                 "n_k": torch.bincount(k0, minlength=n_pos).float()}
        if conf is not None:
            c_star = (1 - tv).detach().clamp(0, 1)
            bce = F.binary_cross_entropy_with_logits(conf.float(), c_star, reduction="none")
            loss = loss + a_conf * bce
            stats["bce"] = (w * bce).sum().detach()
        stats["loss"] = (w * loss).sum().detach()
        return (w * loss).sum(), stats


# ---------------------------------------------------------------- batches


def sample_step(step: int, seed: int, lengths: torch.Tensor, loss_mask: torch.Tensor, batch: int,
                n_anchors: int, pool: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (same on every rank): sequence ids [B] (drawn from `pool`,
    default all) and anchors [B, nb] (valid anchors first; a sequence with fewer valid anchors
    repeats them)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    n = lengths.numel() if pool is None else pool.numel()
    ids = torch.randint(0, n, (batch,), generator=gen)
    ids = ids if pool is None else pool[ids]
    m = loss_mask[ids]
    valid = m.clone()
    valid[:, :-1] &= m[:, 1:]
    valid[:, -1] = False
    valid[:, 0] = False
    scores = torch.rand(m.shape, generator=gen) + valid.float()  # valid anchors score in [1, 2)
    top = scores.topk(min(n_anchors, m.shape[1]), dim=-1).indices
    ok = valid.gather(1, top)
    first = top[:, :1].expand_as(top)
    anchors = torch.where(ok, top, first)  # invalid picks -> duplicate of the best (or invalid: masked)
    anchors = torch.where(ok.any(1, keepdim=True), anchors, torch.zeros_like(anchors))
    return ids, anchors


def data_subset(pool: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """A seeded random `fraction` of the sequence ids in `pool` (all of them at 1.0), sorted."""
    if not 0 < fraction <= 1:
        raise SystemExit(f"--data-fraction must be in (0, 1], got {fraction}")
    if fraction == 1:
        return pool
    keep = torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(seed))
    return pool[keep[: max(1, round(pool.numel() * fraction))].sort().values]


def batch_weight(kind: str, ids, anchors, loss_mask, block: int, decay_lambda: float) -> float:
    """Σ w over the global batch's supervised rows (the loss normaliser, identical on all ranks)."""
    m = loss_mask[ids]
    if kind == "draft_lm":
        return float(m[:, 1:].sum())
    t = m.shape[1]
    pos = anchors[..., None] + torch.arange(1, block + 1)
    inside = pos < t
    ok = m.gather(1, pos.clamp(max=t - 1).flatten(1)).view_as(pos) & inside
    ok = ok.long().cumprod(-1).bool() & (anchors >= 1)[..., None]
    w = torch.exp(-torch.arange(block).float() / decay_lambda)
    return float((ok.float() * w).sum())


def lr_at(step: int, steps: int, warmup: int, peak: float, progress: float = 0.0) -> float:
    """Linear warm-up, then a cosine to 0.1·peak over max(step progress, `progress`) (the time
    budget's fraction spent)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = max((step - warmup) / max(1, steps - warmup), progress)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))


def train_device(name: str) -> torch.device:
    """--device: cpu | cuda[:N] | auto (cuda when available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: no CUDA device here")
    return dev


# ---------------------------------------------------------------- main


def _dist_setup() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank() if world > 1 else 0), world


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    from dspark.runtime.loader import load_model

    if args.make_data:
        return _make_data(args)
    rank, world = _dist_setup()
    dev = train_device(args.device)
    if dev.type == "cuda" and world > 1:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    args.device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} processes")
    from dspark import wiring

    name = args.name or default_name(args.kind, args.head)
    drafters_dir, work_root, data_default = model_paths(args.model)
    out = args.out or drafters_dir / name
    work = args.work or work_root / "train" / name
    lam = float(args.block_size) if args.decay_lambda == "gamma" else float(args.decay_lambda)
    torch.manual_seed(args.seed)
    args.model_folder = wiring.model_folder(args.model)
    target_model, target_cfg = load_model(args.model_folder)
    from dspark.tools.train_data import MODES, batch_features, load_data_many

    data_dirs = [Path(p) for p in str(args.data or data_default).split(",")]
    data = load_data_many(data_dirs)
    tap_layers = data.get("tap_layers") or list(target_model.tap_layers)
    if list(tap_layers) != list(target_model.tap_layers):
        raise SystemExit(f"data taps {tap_layers} != target taps {target_model.tap_layers}: regenerate data")
    lengths = data["lengths"]
    excluded = [MODES.index(m) for m in args.exclude_modes.split(",") if m]
    pool = torch.tensor([i for i, m in enumerate(data["mode"].tolist()) if m not in excluded])
    pool = data_subset(pool, args.data_fraction, args.seed)
    own = args.kind == "dspark" and args.context == "own"
    args.data_dirs, args.data_sequences = data_dirs, int(pool.numel())
    args.data_tokens = int(data["loss_mask"][pool].sum())
    scale = tap_channel_scale(data["taps"], seed=args.seed) if args.tap_norm and "taps" in data else None
    model = build_model(args, target_model, target_cfg, tap_layers, scale)
    lm_head = target_model.embed_tokens.weight if target_model.lm_head_proj is None else \
        target_model.lm_head_proj.weight
    if dev.type != "cpu":
        if args.kind == "draft_lm":
            raise SystemExit("--kind draft_lm trains on the CPU only")
        model.to(dev)
        lm_head = lm_head.to(dev)
        model.attach_shared(target_model.embed_tokens.weight.to(dev), lm_head)
        for key in ("taps", "hidden"):
            if key in data:
                data[key] = data[key].to(dev)
    loss_mod = DrafterLoss(model, args.kind, lm_head, (args.alpha_ce, args.alpha_tv, args.alpha_conf), lam)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    history: list[dict] = []
    start, elapsed = 0, 0.0
    ckpt = Path(work) / "ckpt.pt"
    if ckpt.is_file() and not args.fresh:
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, history, elapsed = state["step"], state["history"], state["elapsed"]
    runner = nn.parallel.DistributedDataParallel(loss_mod) if world > 1 else loss_mod
    budget = args.time_budget
    model.train()
    t0 = time.time() - elapsed
    c0 = time.process_time() - (history[-1].get("cpu_s", 0.0) if history else 0.0)  # CPU s, over resumes
    bar = tqdm(range(start, args.steps), desc=f"train {name}", unit="step", disable=rank != 0,
               initial=start, total=args.steps)
    stop_at = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    finished = False
    for step in bar:
        progress = (time.time() - t0) / budget if budget else 0.0
        if budget and world > 1:  # every rank takes the slowest clock: they stop at the same step
            clock = torch.tensor([progress], device=dev)
            dist.all_reduce(clock, op=dist.ReduceOp.MAX)
            progress = float(clock)
        if budget and progress >= 1.0:  # the time budget is spent: this run is complete
            finished = True
            if rank == 0:
                _save_ckpt(ckpt, model, opt, step, history, time.time() - t0)
            break
        if step >= stop_at:
            if rank == 0:
                _save_ckpt(ckpt, model, opt, step, history, time.time() - t0)
            break
        ids, anchors = sample_step(step, args.seed, lengths, data["loss_mask"], args.batch, args.anchors,
                                   pool)
        norm = batch_weight(args.kind, ids, anchors, data["loss_mask"], args.block_size, lam)
        mine = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
        ids, anchors = ids[mine], anchors[mine]
        t_max = int(lengths[ids].max())
        tokens = data["tokens"][ids, :t_max].to(dev)
        taps, hidden = batch_features(data, ids, t_max, taps=not own)
        lmask = data["loss_mask"][ids, :t_max].to(dev)
        anchors = anchors.clamp(max=t_max - 1).to(dev)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, args.steps, args.warmup, args.lr, progress)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss_sum, stats = runner(tokens, lmask, taps, hidden, anchors)
        (loss_sum * world / max(norm, 1e-9)).backward()  # DDP averages over ranks -> Σ / norm
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        keys = sorted(stats)
        vec = torch.cat([stats[k].float().reshape(-1) for k in keys])
        if world > 1:
            dist.all_reduce(vec)
        s = dict(zip(keys, vec.split([stats[k].numel() for k in keys])))
        s = {k: (v.tolist() if v.numel() > 1 or k.endswith("_k") else float(v)) for k, v in s.items()}
        rec = {"step": step + 1, "loss": s["loss"] / max(norm, 1e-9), "ce": s["ce"] / max(s["weight"], 1e-9),
               "tv": s["tv"] / max(s["weight"], 1e-9), "rows": int(s["rows"]), "grad_norm": grad_norm,
               "lr": opt.param_groups[0]["lr"], "time_s": round(time.time() - t0, 2),
               "cpu_s": round(time.process_time() - c0, 2)}
        if "bce" in s:
            rec["bce"] = s["bce"] / max(s["weight"], 1e-9)
        # 1 − mean TV per block position: the expected acceptance of d_k given an accepted prefix
        rec["accept_proxy_k"] = [round(1 - t / n, 4) if n else None for t, n in zip(s["tv_k"], s["n_k"])]
        history.append(rec)
        if rank == 0:
            bar.set_postfix(loss=f"{rec['loss']:.4f}", tv=f"{rec['tv']:.3f}")
            if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
                _save_ckpt(ckpt, model, opt, step + 1, history, time.time() - t0)
    if rank == 0 and (len(history) == args.steps or finished):
        model.to("cpu")
        summary = _summary(args, name, model, history, lam, time.time() - t0, world, tap_layers)
        if not args.no_export:
            _export(args, model, out, summary)
            summary["drafter_dir"] = _rel(out)
            summary["drafter_bytes"] = sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file())
        args.results.mkdir(parents=True, exist_ok=True)
        from dspark.tools.calibrate import results_suffix

        stem = f"train_{name}{results_suffix(wiring.Spec(model=args.model))}"  # _smollm2 for SmolLM2
        (args.results / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
        _plot(history, args.results / f"{stem}_loss.png", name)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def model_paths(model: str) -> tuple[Path, Path, Path]:
    """(drafters folder, work folder, default data folder) of a target name or folder."""
    from dspark import wiring

    key = wiring.Spec(model=model).model_key
    if key == "smollm2":
        root = SMOLLM2_BUILD
    elif key == "demo":
        root = DEMO
    else:  # a folder: its drafters and work data live beside it
        root = Path(model).resolve().parent / (Path(model).name + "-drafters")
    drafters = wiring.DRAFTER_DIRS.get(key or "", root / "drafters")
    return drafters, root / "work", root / "work" / "drafter_data"


def load_target_engine(args, capacity: int, max_seq_len: int):
    """The target as served (dspark.wiring: model alias or folder, serving dtype)."""
    from dspark import wiring

    spec = wiring.resolve(model=args.model, dtype=args.dtype, capacity=capacity, max_seq_len=max_seq_len,
                          num_threads=args.threads, drafter="none")
    return wiring.load_target(spec)


def _make_data(args) -> int:
    from dspark import wiring
    from dspark.tools import corpus
    from dspark.tools.train_data import DOMAINS, chat_prompts, corpus_prompts, make_data

    chat = args.corpus is not None or wiring.Spec(model=args.model).model_key == "smollm2"
    max_prompt = args.max_prompt
    target = load_target_engine(args, args.gen_batch, max_prompt + args.max_new + 1)
    out = args.data or model_paths(args.model)[2]
    if chat:
        path = args.corpus or corpus.CORPUS_DIR / "train.jsonl"
        if not path.is_file():
            raise SystemExit(f"{path} missing: build the prompt corpus first (`dspark corpus`)")
        prompts, dom, ids = chat_prompts(path, target.tokenizer, args.n_per_domain, corpus.DOMAINS,
                                         offset=args.prompt_offset)
        keep = [i for i, p in enumerate(prompts) if len(p) <= max_prompt]
        prompts, dom = [prompts[i] for i in keep], [dom[i] for i in keep]
        extra = {"prompts": _rel(path), "domains": list(corpus.DOMAINS), "n_per_domain": args.n_per_domain,
                 "prompt_offset": args.prompt_offset,
                 "dropped_long_prompts": len(ids) - len(keep), "max_prompt_tokens": max_prompt}
    else:
        prompts, dom = corpus_prompts(args.token_dir, args.n_per_domain, args.min_prompt, max_prompt,
                                      args.seed)
        extra = {"prompts": f"windows of {_rel(args.token_dir)}", "domains": list(DOMAINS),
                 "n_per_domain": args.n_per_domain, "prompt_tokens_range": [args.min_prompt, max_prompt]}
    extra |= {"model": _rel(args.model), "dtype": str(target.dtype).removeprefix("torch."),
              "gen_batch": args.gen_batch}
    meta = make_data(target, prompts, dom, out, args.max_new, seed=args.seed,
                     chunk=args.chunk or 2 * args.gen_batch, t1_share=args.t1_share,
                     greedy_share=args.greedy_share, extra_meta=extra)
    print(json.dumps(meta, indent=2))
    return 0


def _rel(path) -> str:
    """A path relative to the repository when inside it (results never hold machine paths)."""
    p = Path(path)
    for q in (p.absolute(), p.resolve()):
        if q.is_relative_to(REPO_ROOT):
            return str(q.relative_to(REPO_ROOT))
    return str(path)


def _save_ckpt(path: Path, model, opt, step: int, history: list, elapsed: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                "elapsed": elapsed}, tmp)
    os.replace(tmp, path)


def _summary(args, name, model, history, lam, seconds, world, tap_layers) -> dict:
    last = history[-10:]
    mean = lambda k: sum(r[k] for r in last if k in r) / max(1, sum(k in r for r in last))
    cfg = model.config
    return {"name": name, "kind": args.kind, "head": args.head if args.kind == "dspark" else None,
            "steps": len(history), "planned_steps": args.steps, "time_budget_s": args.time_budget,
            "device": getattr(args, "device_name", "cpu"), "batch_sequences": args.batch,
            "anchors_per_sequence": args.anchors,
            "block_size": args.block_size, "decay_lambda": lam, "alphas": [args.alpha_ce, args.alpha_tv,
                                                                          args.alpha_conf],
            "lr": args.lr, "seed": args.seed, "world_size": world, "target": _rel(args.model),
            "data": [_rel(p) for p in args.data_dirs], "exclude_modes": args.exclude_modes or None,
            "data_fraction": args.data_fraction,
            "data_sequences": args.data_sequences, "data_generated_tokens": args.data_tokens,
            "precision": args.precision, "threads": args.threads, "tap_layers": list(tap_layers),
            "trainable_params": sum(p.numel() for p in model.parameters()),
            "config": cfg.to_json() if hasattr(cfg, "to_json") else cfg.to_dict(),
            "final": {k: mean(k) for k in ("loss", "ce", "tv", "bce") if any(k in r for r in last)},
            "final_accept_proxy_k": _mean_lists([r["accept_proxy_k"] for r in last]),
            "train_seconds": round(seconds, 1),
            "train_cpu_seconds": history[-1].get("cpu_s") if history else None,
            "history": history}


def _mean_lists(rows: list[list[float | None]]) -> list[float | None]:
    cols = list(zip(*rows))
    return [round(sum(v for v in c if v is not None) / max(1, sum(v is not None for v in c)), 4)
            if any(v is not None for v in c) else None for c in cols]


def _export(args, model, out: Path, summary: dict) -> None:
    dtype = getattr(torch, args.save_dtype)
    if args.kind == "dspark":
        from dspark.runtime.drafter.dspark_model import save_dspark

        save_dspark(model, out, dtype)
    elif args.kind == "eagle":
        from dspark.runtime.drafter.eagle import save_eagle

        save_eagle(model, out, dtype)
    else:
        from dspark.runtime.drafter.draft_lm import save_draft_lm

        tok = Path(args.model_folder) / "tokenizer.json"
        save_draft_lm(model, model.config, out, tok if tok.is_file() else None, dtype, args.block_size)
    (Path(out) / "train.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "history"},
                                                     indent=2) + "\n")


def _plot(history: list[dict], path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("loss", "tv", "ce", "bce"):
        ys = [r.get(key) for r in history]
        if all(y is not None for y in ys) and ys:
            k = max(1, len(ys) // 50)
            sm = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
            ax.plot(steps, sm, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("weighted mean per supervised row")
    ax.set_yscale("log")
    ax.set_title(f"drafter training: {name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
