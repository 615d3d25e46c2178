"""Our decoder-only transformer (Qwen3 / Llama / Qwen2 family), docs/architecture.md §4.

Two forwards share the same weights:
- `forward_train(tokens [B,T])`: plain causal, autograd-friendly (demo-model and drafter training).
- `forward_ragged(...)`: the serving forward over a flattened ragged batch that reads and
  writes the fixed-slot KV cache (`dspark.runtime.kv_cache`), returning logits and the taps
  (hidden states after `tap_layers`) the drafter conditions on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dspark.runtime import cpu_attention, cpu_norm
from dspark.runtime.attention import AttnMeta, attention_backend
from dspark.runtime.config import ModelConfig, rope_inv_freq
from dspark.runtime.cpu_norm import add_rms_norm
from dspark.runtime.linear import Projection, serving_linear


def default_tap_layers(num_layers: int, num_taps: int = 3) -> list[int]:
    """DFlash's rule: spread num_taps (0-based) layer ids evenly over [1, L-3]; a tap is the
    residual stream after that layer. Tiny models without room fall back to [0, L-1]."""
    if num_taps < 1:
        raise ValueError(f"num_taps must be >= 1, got {num_taps}")
    start, end = 1, num_layers - 3
    if end - start + 1 < num_taps:
        start, end = 0, num_layers - 1
    if num_taps == 1:
        return [(start + end) // 2]
    return [int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 CPU rows at inference: our C kernel, one call for torch's ~8 ops (`cpu_norm`; the
        # drafter's norms run between target steps, where each torch op starts cold)
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled():
            rows = x.reshape(-1, x.shape[-1])
            if cpu_norm.enabled(rows, self.weight):
                return add_rms_norm(rows, None, self.weight, self.eps)[1].view(x.shape)
        # weight * x / sqrt(mean(x^2) + eps) in one call (bit-equal to the HF formula in f32)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [..., head_dim] for integer positions [...] (computed in f32, like HF)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, hd]; cos/sin [..., T, hd].
    Rotate-half form: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def apply_rope_swapped(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` with the sign folded into a precomputed table (`Transformer.rope_tables`):
    rotate_half(x) * sin == roll(x, hd/2) * [-sin1, sin2], so the same products and roundings
    as HF's formula in one op fewer. x [N, heads, hd]; cos / sin_signed [N, hd]."""
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, -1) * sin_signed[:, None, :]



class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        qkv_bias = bool(cfg.qkv_bias)  # a bool once ModelConfig.__post_init__ resolved the family default
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=cfg.o_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = hd ** -0.5
        self.eps = cfg.rms_norm_eps
        # serving layout, set by fuse() (or by dspark.runtime.quant for int4 weights)
        self.qkv: Projection | None = None
        self.out: Projection | None = None
        self.qk_norm_weight: torch.Tensor | None = None

    @torch.no_grad()
    def fuse(self, prepack: bool = True) -> None:
        """Serving: one matmul for q/k/v, one norm + RoPE for q and k together. The q/k/v
        weights become row views of the fused matrix (no extra memory; forward_train and
        state_dict still work). Call after the weights are final and on their device."""
        if self.qkv is None:
            sizes = [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim]
            projs = (self.q_proj, self.k_proj, self.v_proj)
            weight = torch.cat([p.weight for p in projs])
            for p, w in zip(projs, weight.split(sizes)):
                p.weight = nn.Parameter(w, requires_grad=False)
            bias = None
            if self.q_proj.bias is not None:
                bias = torch.cat([p.bias for p in projs])
                for p, b in zip(projs, bias.split(sizes)):
                    p.bias = nn.Parameter(b, requires_grad=False)
            self.qkv = serving_linear(weight, bias, prepack)
        if self.out is None:
            self.out = serving_linear(self.o_proj.weight, self.o_proj.bias, prepack)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (cfg.qk_norm)
            hd = self.head_dim
            self.qk_norm_weight = torch.cat([self.q_norm.weight.expand(self.n_heads, hd),
                                             self.k_norm.weight.expand(self.n_kv, hd)])

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused layout: x [..., D] -> (q and k together [..., H + Hkv, hd] normed, v [..., Hkv, hd])."""
        assert self.qkv is not None, "fused layout only: call fuse() first"
        return self._heads(self.qkv(x))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`qkv_heads` of the fused projection's output qkv [..., (H + 2·Hkv)·hd]."""
        h, hd = self.n_heads + self.n_kv, self.head_dim
        qkv = qkv.view(*qkv.shape[:-1], h + self.n_kv, hd)
        qk, v = qkv[..., :h, :], qkv[..., h:, :]
        if self.qk_norm_weight is not None:
            qk = F.rms_norm(qk, (hd,), eps=self.eps) * self.qk_norm_weight
        return qk, v

    def qkv_proj(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, D] -> q [..., T, H, hd], k and v [..., T, Hkv, hd] (q/k normed and rotated)."""
        lead = x.shape[:-1]
        if self.qkv is not None:
            qk, v = self.qkv_heads(x)
            qk = apply_rope(qk, cos, sin)
            return qk[..., :self.n_heads, :], qk[..., self.n_heads:, :], v
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (cfg.qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(x) if self.out is None else self.out(x)

    def forward_train(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = (z.transpose(1, 2) for z in self.qkv_proj(x, cos, sin))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=self.n_heads != self.n_kv)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))

    def forward_ragged(self, x, cos, sin_signed, k_cache, v_cache, meta: AttnMeta):
        """Fused layout only (after `fuse`); cos / sin_signed from `Transformer.rope_tables`."""
        assert self.out is not None, "fused layout only: call fuse() first"
        assert self.qkv is not None  # set with `out`
        qkv, q = self.qkv(x), None
        if meta.cpu_kernel and self.qk_norm_weight is None:  # bf16 CPU decode / verify: one C call
            q = cpu_attention.rope_write_kv(qkv, cos, sin_signed, k_cache, v_cache, meta.tok_slot,
                                            meta.positions, self.n_heads)
        if q is None:
            qk, v = self._heads(qkv)
            qk = apply_rope_swapped(qk, cos, sin_signed)
            q, k = qk[:, :self.n_heads], qk[:, self.n_heads:]
            k_cache[meta.tok_slot, :, meta.positions] = k  # write this step's keys before reading
            v_cache[meta.tok_slot, :, meta.positions] = v
        out = attention_backend(q, k_cache, v_cache, meta, self.scale)
        return self.out(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)
        self.gate_up: Projection | None = None  # serving layout, set by fuse() (or dspark.runtime.quant)
        self.down: Projection | None = None

    @torch.no_grad()
    def fuse(self, prepack: bool = True) -> None:
        """Serving: gate and up in one matmul (their weights become row views of it)."""
        if self.gate_up is None:
            projs = (self.gate_proj, self.up_proj)
            weight = torch.cat([p.weight for p in projs])
            for p, w in zip(projs, weight.chunk(2)):
                p.weight = nn.Parameter(w, requires_grad=False)
            bias = None
            if self.gate_proj.bias is not None:
                bias = torch.cat([p.bias for p in projs])
                for p, b in zip(projs, bias.chunk(2)):
                    p.bias = nn.Parameter(b, requires_grad=False)
            self.gate_up = serving_linear(weight, bias, prepack)
        if self.down is None:
            self.down = serving_linear(self.down_proj.weight, self.down_proj.bias, prepack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        assert self.down is not None  # set together with gate_up (fuse / quant)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Transformer(nn.Module):
    """Parameter names mirror HF's (minus the `model.` prefix) so loading is a rename."""

    inv_freq: torch.Tensor  # buffer (non-persistent), registered in __init__

    def __init__(self, cfg: ModelConfig, tap_layers: list[int] | None = None, num_taps: int = 3) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head_proj = (None if cfg.tie_word_embeddings
                             else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.tap_layers = list(tap_layers) if tap_layers is not None else default_tap_layers(
            cfg.num_hidden_layers, num_taps)
        if any(not 0 <= i < cfg.num_hidden_layers for i in self.tap_layers):
            raise ValueError(f"tap_layers {self.tap_layers} outside [0, {cfg.num_hidden_layers})")
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.head: Projection | None = None  # serving LM head, set by fuse_for_inference()
        self.rope_cos: torch.Tensor | None = None  # set by rope_tables()
        self.rope_sin_signed: torch.Tensor | None = None
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    @property
    def blocks(self) -> Sequence[Block]:
        """`layers` with its item type (to mypy, nn.ModuleList holds plain nn.Module)."""
        return cast("Sequence[Block]", self.layers)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # RoPE frequencies stay f32 whatever dtype the weights are cast to
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    def fuse_for_inference(self, max_positions: int | None = None, prepack: bool = True) -> Transformer:
        """Serving layout, built once (call when the weights are final and on their device):
        fused q/k/v and gate/up matmuls, every projection and the LM head prepacked for oneDNN
        on CPU (`serving_linear`), RoPE tables for `max_positions` positions."""
        for layer in self.blocks:
            layer.self_attn.fuse(prepack)
            layer.mlp.fuse(prepack)
        self.head = serving_linear(self.lm_head_weight, prepack=prepack)
        self.rope_tables(max_positions or self.config.max_position_embeddings)
        return self

    def rope_tables(self, max_positions: int) -> None:
        """cos and sign-folded sin [max_positions, hd] in the model dtype, computed once exactly as
        `rope_cos_sin` (f32, then cast) so a lookup equals computing them per step."""
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(max_positions, device=self.inv_freq.device),
                                self.embed_tokens.weight.dtype)
        half = cos.shape[-1] // 2
        self.rope_cos = cos
        self.rope_sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    @property
    def tap_dim(self) -> int:
        return len(self.tap_layers) * self.config.hidden_size

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head_proj is None else self.lm_head_proj.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from final-normed hidden states (tied: the embedding matrix)."""
        if self.head is None or torch.is_grad_enabled():  # training needs autograd through the weight
            return F.linear(hidden, self.lm_head_weight)
        return self.head(hidden)

    def forward_hidden(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain causal pass over tokens [B, T] -> (final-normed hidden [B,T,D], taps [B,T,n_taps*D])."""
        x = self.embed(tokens)
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(tokens.shape[1], device=tokens.device), x.dtype)
        taps: dict[int, torch.Tensor] = {}  # layer id -> its output (tap_layers checked in __init__)
        for i, layer in enumerate(self.blocks):
            x = x + layer.self_attn.forward_train(layer.input_layernorm(x), cos, sin)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.tap_layers:
                taps[i] = x
        return self.norm(x), torch.cat([taps[t] for t in self.tap_layers], dim=-1)

    def forward_train(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] (causal; supports autograd)."""
        return self.lm_head(self.forward_hidden(tokens)[0])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward_train(tokens)

    def forward_ragged(self, tokens: torch.Tensor, meta: AttnMeta, k_caches: list[torch.Tensor],
                       v_caches: list[torch.Tensor], logits_rows: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cached forward of a flattened ragged batch tokens [N] (writes K/V at `meta` positions);
        needs the serving layout (`fuse_for_inference`) with RoPE tables past the largest position.
        -> (logits [N or len(logits_rows), V], taps [N, n_taps*D], final-normed hidden [N, D])."""
        cos_table, sin_table = self.rope_cos, self.rope_sin_signed
        assert cos_table is not None and sin_table is not None, "call fuse_for_inference() first"
        x = self.embed(tokens)
        cos = cos_table.index_select(0, meta.positions)
        sin = sin_table.index_select(0, meta.positions)
        taps: dict[int, torch.Tensor] = {}  # layer id -> its output (tap_layers checked in __init__)
        blocks = self.blocks
        # each residual add with the norm after it: one call of our kernel on bf16 CPU rows
        x, h = add_rms_norm(x, None, blocks[0].input_layernorm.weight, blocks[0].input_layernorm.eps)
        for i, layer in enumerate(blocks):
            attn = layer.self_attn
            a = attn.forward_ragged(h, cos, sin, k_caches[i], v_caches[i], meta)
            norm = layer.post_attention_layernorm
            x, h = add_rms_norm(x, a, norm.weight, norm.eps)
            after = blocks[i + 1].input_layernorm if i + 1 < len(blocks) else self.norm
            x, h = add_rms_norm(x, layer.mlp(h), after.weight, after.eps)
            if i in self.tap_layers:
                taps[i] = x
        hidden = h
        logits = self.lm_head(hidden if logits_rows is None else hidden[logits_rows])
        return logits, torch.cat([taps[t] for t in self.tap_layers], dim=-1), hidden
