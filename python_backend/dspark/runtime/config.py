"""Model configuration parsed from a Hugging Face `config.json` (docs/architecture.md §4).

One flat dataclass covers the three decoder families we serve: Qwen3 (q/k RMSNorm per
head, explicit head_dim), Llama (optional attention / MLP bias, llama3 RoPE scaling) and
Qwen2 (bias on q/k/v only). Both RoPE spellings are read: transformers 5 writes
`rope_parameters` (theta inside), older files write `rope_theta` + `rope_scaling`."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool | None = None  # bias on q/k/v (None: the family's default, True for qwen2 only)
    o_bias: bool = False  # bias on o_proj (llama/qwen3 attention_bias)
    mlp_bias: bool = False  # llama mlp_bias
    qk_norm: bool | None = None  # RMSNorm over head_dim on q and k before RoPE (None: qwen3 only)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(SUPPORTED_MODEL_TYPES)
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {supported}")
        family_qk_norm = self.model_type == "qwen3"  # the architecture fixes it: no free choice
        if self.qk_norm is None:
            self.qk_norm = family_qk_norm
        elif self.qk_norm != family_qk_norm:
            raise ValueError(f"qk_norm={self.qk_norm} does not match model_type {self.model_type!r}")
        if self.qkv_bias is None:
            self.qkv_bias = self.model_type == "qwen2"

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", "default")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict; ValueError on a model or RoPE type we do not implement."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(SUPPORTED_MODEL_TYPES)
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        n_heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // n_heads
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if any(isinstance(v, dict) for v in rope.values()):
            raise ValueError("per-layer-type rope_parameters are not supported")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            supported = ", ".join(SUPPORTED_ROPE_TYPES)
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {supported}")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
        scaling["rope_type"] = rope_type
        if rope_type == "llama3":
            scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 2048))
        attn_bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attn_bias,
            o_bias=False if model_type == "qwen2" else attn_bias,
            mlp_bias=bool(d.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[int(e) for e in eos],
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads(Path(path).read_text()))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers 5 (and we) read back to the same model."""
        if self.model_type == "qwen2" and (self.o_bias or not self.qkv_bias or self.mlp_bias):
            raise ValueError("qwen2 has q/k/v bias only")
        if self.model_type == "qwen3" and (self.qkv_bias != self.o_bias or self.mlp_bias):
            raise ValueError("qwen3 attention_bias covers q/k/v/o together; no mlp bias")
        eos = self.eos_token_ids
        d = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {**self.rope_scaling, "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.o_bias if self.model_type != "qwen2" else False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (eos[0] if len(eos) == 1 else list(eos)) if eos else None,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] f32 after the configured scaling (RoPE, Su et al.;
    'linear' divides all by factor; 'llama3' divides low frequencies by factor, keeps high
    ones, and interpolates smoothly in between)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if cfg.rope_type == "linear":
        inv = inv / float(s["factor"])
    elif cfg.rope_type == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_len = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv
