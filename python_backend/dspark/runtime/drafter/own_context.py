"""The DSpark drafter's own context encoder (config `context = "own"`): for targets that
expose no hidden states (a stock TensorRT-LLM engine returns logits only), the drafter builds
its context features from the tokens alone.

A small causal transformer over the target's (frozen, shared) token embeddings,
`context_layers` pre-norm layers of the drafter's own shape, gives one feature row per
context token; the backbone then projects those rows exactly as it projects target taps
(`fc`, `ctx_norm`, per-layer K/V). Row t depends on tokens 0..t only, so the rows of a
growing context never change: at serving time each layer keeps the K/V of the tokens seen
so far (per slot) and new tokens are encoded incrementally, equal to the full causal pass
the trainer runs (`forward`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from dspark.runtime.model import RMSNorm


class OwnContextEncoder(nn.Module):
    """Causal token encoder: emb(tokens) [B, T, d] -> features [B, T, d]."""

    def __init__(self, cfg, layer_cls) -> None:
        super().__init__()
        width = getattr(cfg, "context_intermediate_size", None) or cfg.intermediate_size
        layer_cfg = replace(cfg, intermediate_size=width)
        self.layers = nn.ModuleList(layer_cls(layer_cfg) for _ in range(cfg.context_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.n_kv, self.head_dim = int(cfg.num_kv_heads), int(cfg.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Full causal pass (training): x [B, T, d], rope cos/sin of positions 0..T−1."""
        b, t, _ = x.shape
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril().expand(b, t, t)
        empty = x.new_zeros(b, 0, self.n_kv, self.head_dim)
        for layer in self.layers:
            x = layer(x, cos, sin, empty, empty, mask)
        return self.norm(x)

    def extend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list]:
        """Incremental pass for ONE slot: new tokens x [1, n, d] at positions after the cached
        ones, cache = per layer (k, v) [1, C, Hkv, hd] of the C earlier tokens (empty at
        start) -> (features [1, n, d], the cache with the n new rows appended)."""
        n, c = x.shape[1], cache[0][0].shape[1] if cache else 0
        mask = torch.cat([torch.ones(n, c, dtype=torch.bool, device=x.device),
                          torch.ones(n, n, dtype=torch.bool, device=x.device).tril()], dim=1)[None]
        new_cache = []
        layer: Any
        for layer, (ck, cv) in zip(self.layers, cache):
            k, v = layer.kv(layer.input_norm(x), cos, sin)
            x = layer(x, cos, sin, ck, cv, mask)
            new_cache.append((torch.cat([ck, k], dim=1), torch.cat([cv, v], dim=1)))
        return self.norm(x), new_cache

    def empty_cache(self, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer an empty (k, v) [1, 0, Hkv, hd] in the dtype/device of `like`."""
        return [(like.new_zeros(1, 0, self.n_kv, self.head_dim),) * 2 for _ in self.layers]
