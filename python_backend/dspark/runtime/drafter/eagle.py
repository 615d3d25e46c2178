"""EAGLE-3-style baseline drafter (docs/architecture.md §5): one decoder layer on the target's fused
low/mid/high taps, autoregressive over γ steps, feeding its own hidden state back.

Position i of a sequence has input (f_i, emb(t_{i+1})) where f_i = W_f [taps_i] for tokens in
the target's cache and f_i = the drafter's own output h_{i} for drafted positions; its output
h_i gives logits lm_head(norm(h_i)) for token t_{i+2}. Attention is causal over the drafter's
own per-slot K/V. Training unrolls the γ steps ("training-time test"): step s for a chain
rooted at position r attends to the step-1 K/V of positions ≤ r and to its own chain's K/V of
steps 2..s, exactly as at inference. Confidence: z_s = wᵀh_s + b (h_s depends on x_{<s} only)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.runtime.drafter.context import SlotDrafter
from dspark.runtime.drafter.dspark_model import rope_inv_freq_plain
from dspark.runtime.drafter.files import (
    JsonConfig,
    SharedHead,
    read_calibration,
    read_sts_shifts,
    shared_weights,
    to_target_dtype,
)
from dspark.runtime.interfaces import DraftBlock, block_width
from dspark.runtime.model import RMSNorm, apply_rope, rope_cos_sin
from dspark.runtime.sampling import SamplingBatch, SamplingParams


@dataclass
class EagleConfig(JsonConfig):
    vocab_size: int
    hidden_size: int
    tap_dim: int
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    block_size: int = 15  # unrolled steps in training: the largest γ
    gamma: int = 7
    tap_layers: list[int] | None = None
    kind: str = "eagle"
    tap_norm: bool = False  # taps scaled per channel (buffer tap_scale) before fc, as DSparkConfig


class EagleModel(SharedHead, nn.Module):
    inv_freq: torch.Tensor  # buffers, registered in __init__
    tap_scale: torch.Tensor | None  # None unless cfg.tap_norm

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.config = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.fc = nn.Linear(cfg.tap_dim, d, bias=False)  # fuse low/mid/high taps
        self.register_buffer("tap_scale", torch.ones(cfg.tap_dim) if cfg.tap_norm else None)
        self.emb_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.hid_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(2 * d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.conf = nn.Linear(d, 1)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.conf.weight)
        nn.init.zeros_(self.conf.bias)
        self.register_buffer("inv_freq", rope_inv_freq_plain(hd, cfg.rope_theta), persistent=False)

    def init_from_target(self, embed_weight: torch.Tensor, norm_weight: torch.Tensor,
                         mask_token_id: int | None = None) -> None:
        with torch.no_grad():
            self.norm.weight.copy_(norm_weight.float())

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        x = taps.to(self.fc.weight.dtype)
        return self.fc(x if self.tap_scale is None else x * self.tap_scale.to(x.dtype))

    def qkv(self, feat: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """feat [B, Q, d], tokens [B, Q] (the next token of each position), positions [B, Q]
        -> q [B, Q, H, hd], k, v [B, Q, Hkv, hd]."""
        assert self.embed_weight is not None, "attach_shared() first"
        b, q_len, _ = feat.shape
        e = F.embedding(tokens, self.embed_weight).to(feat.dtype)
        x = torch.cat([self.emb_norm(e), self.hid_norm(feat)], dim=-1)
        cos, sin = rope_cos_sin(self.inv_freq, positions, feat.dtype)
        q = apply_rope(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, q_len, self.n_kv, self.head_dim), cos, sin)
        return q, k, self.v_proj(x).view(b, q_len, self.n_kv, self.head_dim)

    def finish(self, feat: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual on the feature stream: attn [B, Q, H, hd] -> h [B, Q, d]."""
        h = feat + self.o_proj(attn.flatten(-2))
        g = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(g)) * self.up_proj(g))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, Q, H, hd], k/v [B, K, Hkv, hd], mask [B, Q, K] -> [B, Q, H, hd]."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask[:, None], enable_gqa=self.n_heads != self.n_kv)
        return out.transpose(1, 2)

    def train_hidden(self, tokens: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training-time test over chains: anchor a (x0 = t_a) roots a chain at r = a−1, whose
        step s output predicts t_{a+s}; teacher-forced tokens. -> h [B, nb, G, d]."""
        b, t = tokens.shape
        nb, g, dev = anchors.shape[1], self.config.block_size, tokens.device
        nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # t_{i+1} at row i (last row unused)
        feat = self.features(taps)
        pos = torch.arange(t, device=dev).expand(b, t)
        q1, k1, v1 = self.qkv(feat, nxt, pos)
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(b, t, t)
        h1 = self.finish(feat, self.attend(q1, k1, v1, causal))
        root = (anchors - 1).clamp(min=0)  # [B, nb]; anchor 0 (no valid anchor) is masked out by the loss
        gather = lambda x: x.gather(1, root.view(b, nb, *([1] * (x.dim() - 2))).expand(b, nb, *x.shape[2:]))
        hs = [gather(h1)]
        ctx_mask = torch.arange(t, device=dev)[None, None, :] <= root[..., None]  # [B, nb, T]
        rep = self.n_heads // self.n_kv  # GQA: expand the context K/V once for all G steps
        k1, v1 = k1.repeat_interleave(rep, dim=2), v1.repeat_interleave(rep, dim=2)
        chain_k, chain_v = [], []
        for s in range(2, g + 1):
            tok = tokens.gather(1, (anchors + s - 1).clamp(max=t - 1))
            q, k, v = self.qkv(hs[-1], tok, root + s - 1)
            chain_k.append(k)
            chain_v.append(v)
            hs.append(self.finish(hs[-1], self._chain_attend(q, k1, v1, ctx_mask, chain_k, chain_v)))
        return torch.stack(hs, dim=2)

    def _chain_attend(self, q, k1e, v1e, ctx_mask, chain_k, chain_v) -> torch.Tensor:
        """q [B, nb, H, hd] against ctx keys k1e [B, T, H, hd] (already expanded to the query
        heads; masked per chain) and the chain's own keys chain_k[j] [B, nb, Hkv, hd] -> [B, nb, H, hd]."""
        rep = self.n_heads // self.n_kv
        ck = torch.stack(chain_k, dim=2).repeat_interleave(rep, dim=3)  # [B, nb, S, H, hd]
        cv = torch.stack(chain_v, dim=2).repeat_interleave(rep, dim=3)
        scale = self.head_dim ** -0.5
        s_ctx = torch.einsum("bnhd,bthd->bnht", q, k1e) * scale
        s_ctx = s_ctx.masked_fill(~ctx_mask[:, :, None, :], float("-inf"))
        s_chain = torch.einsum("bnhd,bnshd->bnhs", q, ck) * scale
        p = torch.softmax(torch.cat([s_ctx, s_chain], dim=-1), dim=-1)
        t = k1e.shape[1]
        out = torch.einsum("bnht,bthd->bnhd", p[..., :t], v1e)
        return out + torch.einsum("bnhs,bnshd->bnhd", p[..., t:], cv)

    def conf_logit(self, h: torch.Tensor) -> torch.Tensor:
        return self.conf(h).squeeze(-1)


class EagleDrafter(SlotDrafter):
    """`DrafterLike` runtime: per slot the fused features and tokens of every cached token,
    and the layer's K/V for positions whose next token is known (committed at propose).
    A baseline driven from the host: extend reads the accepted counts (one sync)."""

    kind = "eagle"

    def start(self, slot: int, prompt: list[int], taps: torch.Tensor) -> None:
        if taps.shape[0] != len(prompt):
            raise ValueError(f"start: {len(prompt)} prompt tokens but {taps.shape[0]} taps rows")
        self.ctx.start(slot)
        self.probs.release(slot)
        n = len(prompt)
        self.extend([slot], torch.tensor(prompt, dtype=torch.int64), taps, torch.tensor([0, n]),
                    torch.tensor([n]))

    @torch.inference_mode()
    def extend(self, slots: list[int], tokens: torch.Tensor, taps: torch.Tensor, cu_seqlens: torch.Tensor,
               keep: torch.Tensor) -> None:
        if taps.shape[0] != tokens.shape[0]:
            raise ValueError(f"extend: {tokens.shape[0]} tokens but {taps.shape[0]} taps rows")
        for slot, start, n in zip(slots, cu_seqlens[:-1].tolist(), keep.tolist(), strict=True):
            if n:
                self.ctx.append(slot, "feat", self.model.features(taps[start:start + n].to(self.device)))
                self.ctx.append(slot, "tok", tokens[start:start + n].to(self.device, torch.int64))

    @torch.inference_mode()
    def _commit(self, slot: int, anchor: int) -> torch.Tensor:
        """Compute K/V of this slot's uncommitted positions (next token known now that the
        anchor is) and return h of the last position (its logits give d_1) -> [d]."""
        m = self.model
        feat, tok = self.ctx.get(slot, "feat"), self.ctx.get(slot, "tok")
        assert feat is not None and tok is not None, f"slot {slot} has no context: start() it first"
        n, done = tok.shape[0], self.ctx.length(slot, "k")
        nxt = torch.cat([tok[1:], torch.tensor([anchor], device=self.device)])
        lo = min(done, n - 1)  # always recompute the last position: we need its h
        q, k, v = m.qkv(feat[None, lo:], nxt[None, lo:], torch.arange(lo, n, device=self.device)[None])
        if done < n:
            self.ctx.append(slot, "k", k[0, done - lo:])
            self.ctx.append(slot, "v", v[0, done - lo:])
        keys, vals = self.ctx.get(slot, "k"), self.ctx.get(slot, "v")
        assert keys is not None and vals is not None  # the first commit of a slot appends (done = 0 < n)
        keys, vals = keys[None], vals[None]
        rows = torch.arange(lo, n, device=self.device)
        mask = torch.arange(n, device=self.device)[None, :] <= rows[:, None]
        h = m.finish(feat[None, lo:], m.attend(q, keys, vals, mask[None]))
        return h[0, -1]

    @torch.inference_mode()
    def propose(self, slots: list[int], anchors: torch.Tensor, params: list[SamplingParams],
                uniforms: torch.Tensor) -> DraftBlock:
        m, cfg, gamma, r = self.model, self.config, block_width(uniforms, self.gamma), len(slots)
        anchors = anchors.to(self.device, torch.int64)
        h = torch.stack([self._commit(s, int(a)) for s, a in zip(slots, anchors.tolist())])  # [R, d]
        like = torch.zeros(1, cfg.num_kv_heads, cfg.head_dim, device=self.device, dtype=h.dtype)
        keys, valid = self.ctx.padded(slots, "k", like)
        vals, _ = self.ctx.padded(slots, "v", like)
        lens = valid.sum(1)
        sampling = SamplingBatch.from_params(params, self.device)
        uniforms = uniforms.to(self.device)
        tokens = torch.empty(r, gamma, dtype=torch.int64, device=self.device)
        conf = torch.empty(r, gamma, device=self.device)
        kept: list[torch.Tensor | None] = []
        for s in range(gamma):
            if s > 0:  # position L−1+s: input (h of the previous step, emb(d_s)); keys: ctx + chain
                q, k, v = m.qkv(h[:, None], tokens[:, s - 1:s], (lens + s - 1)[:, None])
                keys, vals = torch.cat([keys, k], dim=1), torch.cat([vals, v], dim=1)
                valid = torch.cat([valid, torch.ones(r, 1, dtype=torch.bool, device=self.device)], dim=1)
                h = m.finish(h[:, None], m.attend(q, keys, vals, valid[:, None, :]))[:, 0]
            conf[:, s] = m.conf_logit(h).float()
            tokens[:, s], probs = sampling.draw(m.lm_head(h).float(), uniforms[:, s])
            kept.append(probs)
        sampled = [q for q in kept if q is not None]
        self.probs.put(slots, [p.greedy for p in params], torch.stack(sampled, 1) if sampled else None)
        return DraftBlock(tokens, conf)

    def save(self, folder: str | Path) -> Path:
        return save_eagle(self.model, folder)


def save_eagle(model: EagleModel, folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def load_eagle(folder: str | Path, target, gamma: int | None = None) -> EagleDrafter:
    folder = Path(folder)
    cfg = EagleConfig.from_json(json.loads((folder / "config.json").read_text()))
    embed, lm_head, _ = shared_weights(target)
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"drafter {folder} expects embedding {(cfg.vocab_size, cfg.hidden_size)}, "
                         f"target has {tuple(embed.shape)}")
    model = EagleModel(cfg)
    model.load_state_dict({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()})
    # the target's dtype, as load_dspark: in fp32 beside a bf16 target, every lm_head call cast the
    # whole [V, d] head to fp32 (γ times per propose: ~400 ms at batch 1 on SmolLM2)
    to_target_dtype(model, target, embed)
    return EagleDrafter(model, embed, lm_head, gamma=gamma, sts_temperatures=read_calibration(folder),
                        sts_shifts=read_sts_shifts(folder))
