"""The DSpark drafter's network (docs/architecture.md §5): a DFlash-style parallel backbone on
projected target taps, a sequential head (Markov / RNN / none) sampled left to right, and a
confidence head. `DSparkModel` is what training updates and `save_dspark` stores; the serving
runtime over it is `dspark_drafter.DSparkDrafter`.

Context (per slot): H_ctx = RMSNorm(W_c [taps]) of every token in the target's KV cache;
each backbone layer keeps the K/V of H_ctx (its own k/v projections), extended with the taps
of every accepted token. Block: inputs [emb(x0), m, …, m] (m = learned mask embedding) at
positions L, …, L+G−1 (L = context length, G = trained block size); queries from the block,
keys/values [ctx ; block], non-causal inside the block. Output h_k at block index k−1
predicts the token at anchor+k; U_k = lm_head(norm(h_k)).

γ at propose time: the backbone always runs the trained block of G inputs (so h_k is
exactly what training saw) and the first γ ≤ G outputs are sampled; one drafter trained
with G = 15 serves γ = 7 and γ = 15.

Embedding and LM head are the target's, frozen and shared (never stored with the drafter)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from dspark.runtime.drafter.files import JsonConfig, SharedHead
from dspark.runtime.drafter.heads import ConfidenceHead, make_head
from dspark.runtime.model import RMSNorm, apply_rope, rope_cos_sin


@dataclass
class DSparkConfig(JsonConfig):
    vocab_size: int
    hidden_size: int  # = the target's (shared embedding / LM head)
    tap_dim: int  # n_taps * target hidden
    num_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    block_size: int = 15  # G: trained block, the largest γ
    gamma: int = 7  # default γ at propose time
    head: str = "markov"  # markov | rnn | none
    head_rank: int = 64
    tap_layers: list[int] | None = None  # the target layers the taps come from (checked at load)
    kind: str = "dspark"
    # "taps": context = the target's taps; "own": the drafter's own causal encoder over token
    # embeddings (own_context.py; for targets without hidden states; tap_dim = hidden_size)
    context: str = "taps"
    context_layers: int = 1
    context_intermediate_size: int | None = None  # MLP width of the own encoder (None: intermediate_size)
    # taps scaled per channel by fixed data statistics (buffer tap_scale) before W_c: SmolLM2's
    # residual stream has a few channels 30-100x larger than the rest (massive activations)
    tap_norm: bool = False


def rope_inv_freq_plain(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def apply_module(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return linear(x)


class DraftLayer(nn.Module):
    """Pre-norm decoder layer whose attention also reads externally supplied context K/V."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           proj=apply_module) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> k, v [B, T, Hkv, hd] (k normed and rotated). Used for ctx and block alike.
        proj(linear, x): how to apply a projection (default: the module itself)."""
        return self.kv_from(proj(self.k_proj, x), proj(self.v_proj, x), cos, sin)

    def kv_from(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k / v projections [B, T, Hkv·hd] -> k, v [B, T, Hkv, hd] (k normed and rotated)."""
        b, t, _ = k.shape
        k = self.k_norm(k.reshape(b, t, self.n_kv, self.head_dim))
        return apply_rope(k, cos, sin), v.reshape(b, t, self.n_kv, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, Q, d] block stream; ctx_k/v [B, C, Hkv, hd]; mask [B, Q, C+Q] bool (True = attend)."""
        b, q_len, _ = x.shape
        h = self.input_norm(x)
        q = apply_rope(self.q_norm(self.q_proj(h).view(b, q_len, self.n_heads, self.head_dim)), cos, sin)
        k, v = self.kv(h, cos, sin)
        k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)
        v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                             enable_gqa=self.n_heads != self.n_kv)
        x = x + self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DSparkModel(SharedHead, nn.Module):
    """Trainable parameters of the drafter. The target's embedding / LM-head weights are
    attached with `attach_shared` as plain tensors (not parameters: frozen, not saved)."""

    inv_freq: torch.Tensor  # buffers, registered in __init__
    tap_scale: torch.Tensor | None  # None unless cfg.tap_norm

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        if not 1 <= cfg.gamma <= cfg.block_size:
            raise ValueError(f"gamma {cfg.gamma} must be in [1, block_size={cfg.block_size}]")
        self.config = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(cfg.tap_dim, d, bias=False)  # W_c
        self.ctx_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.register_buffer("tap_scale", torch.ones(cfg.tap_dim) if cfg.tap_norm else None)
        self.ctx_encoder = None
        if cfg.context == "own":
            from dspark.runtime.drafter.own_context import OwnContextEncoder

            self.ctx_encoder = OwnContextEncoder(cfg, DraftLayer)
        elif cfg.context != "taps":
            raise ValueError(f"DSparkConfig.context: unknown {cfg.context!r} (taps | own)")
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = make_head(cfg.head, cfg.vocab_size, d, cfg.head_rank)
        self.conf = ConfidenceHead(d, cfg.head_rank)
        self.register_buffer("inv_freq", rope_inv_freq_plain(cfg.head_dim, cfg.rope_theta), persistent=False)
        for m in [self.fc, *self.layers]:
            for p in m.modules():
                if isinstance(p, nn.Linear):
                    nn.init.normal_(p.weight, std=0.02)

    def init_from_target(self, embed_weight: torch.Tensor, norm_weight: torch.Tensor,
                         mask_token_id: int | None = None) -> None:
        """Start the mask embedding at the target's <|mask|> row (or the mean row) and the final
        norm at the target's final norm, so U_k starts in the target's logit scale."""
        with torch.no_grad():
            row = embed_weight[mask_token_id] if mask_token_id is not None else embed_weight.mean(0)
            self.mask_embedding.copy_(row.float())
            self.norm.weight.copy_(norm_weight.float())

    @property
    def draft_layers(self) -> Sequence[DraftLayer]:
        """`layers` with its item type (to mypy, nn.ModuleList holds plain nn.Module)."""
        return cast("Sequence[DraftLayer]", self.layers)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.embed_weight is not None, "attach_shared() first"
        return F.embedding(tokens, self.embed_weight).to(self.fc.weight.dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """taps [B, L, tap_dim] at positions [B, L] -> per layer (k, v) [B, L, Hkv, hd]."""
        h_ctx = self.ctx_norm(self.fc(taps.to(self.fc.weight.dtype)))
        cos, sin = self.rope(positions, h_ctx.dtype)
        return [layer.kv(h_ctx, cos, sin) for layer in self.draft_layers]

    def backbone(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv, mask: torch.Tensor) -> torch.Tensor:
        """Block stream x [B, Q, d] at positions [B, Q]; mask [B, Q, C+Q] -> h [B, Q, d]."""
        cos, sin = self.rope(positions, x.dtype)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, ck, cv, mask)
        return x

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [...] -> [..., G, d]: emb(x0) then the mask embedding G−1 times."""
        g = self.config.block_size
        first = self.embed(anchors)[..., None, :]
        rest = self.mask_embedding.expand(*anchors.shape, g - 1, -1)
        return torch.cat([first, rest.to(first.dtype)], dim=-2)

    def scale_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """taps in the drafter's dtype, times the per-channel tap_scale when the config has tap_norm."""
        x = taps.to(self.fc.weight.dtype)
        return x if self.tap_scale is None else x * self.tap_scale.to(x.dtype)

    def context_features(self, tokens: torch.Tensor, taps: torch.Tensor | None,
                         positions: torch.Tensor) -> torch.Tensor:
        """The rows the context is built from: the taps, or (context "own") the own encoder's
        causal features of the tokens [B, T] at positions [B, T] (training / full pass)."""
        if self.ctx_encoder is None:
            if taps is None:
                raise ValueError("context_features: context 'taps' needs the target taps, got None")
            return self.scale_taps(taps)
        x = self.embed(tokens)
        return self.ctx_encoder(x, *self.rope(positions, x.dtype))

    def train_hidden(self, tokens: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Many blocks per sequence in one pass (training). tokens [B, T], taps [B, T, tap_dim]
        (taps of token t at row t), anchors [B, nb] positions a (the block's context is the taps
        of tokens 0..a−1) -> h [B, nb, G, d]. Equals running each block alone at inference."""
        b, t = tokens.shape
        nb, g = anchors.shape[1], self.config.block_size
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        ctx_kv = self.context_kv(self.context_features(tokens, taps, positions), positions)
        x = self.block_inputs(tokens.gather(1, anchors)).reshape(b, nb * g, -1)
        offs = torch.arange(g, device=tokens.device)
        positions = (anchors[..., None] + offs).reshape(b, nb * g)
        q_anchor = anchors[..., None].expand(b, nb, g).reshape(b, nb * g)
        ctx_mask = torch.arange(t, device=tokens.device)[None, None, :] < q_anchor[..., None]
        block_id = torch.arange(nb, device=tokens.device).repeat_interleave(g)
        blk_mask = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
        h = self.backbone(x, positions, ctx_kv, torch.cat([ctx_mask, blk_mask], dim=-1))
        return h.view(b, nb, g, -1)

    def trainable_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def save_dspark(model: DSparkModel, folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """config.json + model.safetensors (trainable weights only, stored as `dtype`; the shared
    embedding / LM head come from the target at load time). Leaves calibration.json alone."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
