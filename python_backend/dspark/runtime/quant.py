"""Int4 weights straight from the GGUF (`--dtype q4_1`, architecture §4).

SmolLM2 ships as a GGUF whose linear layers are Q4_1: each row is cut into groups of 32
weights, and a group stores one fp16 scale d, one fp16 minimum m and 32 4-bit codes q,
w = d·q + m. This module keeps those groups as they are and runs them with torch's CPU
int4 weight-only matmul (`aten._weight_int4pack_mm_for_cpu`), which computes
w = (q − 8)·scale + zero per group of `GROUP` along the input dimension. So
scale = d, zero = m + 8·d reproduces Q4_1 exactly, up to the dtype the kernel holds
scale and zero in:
- bf16 activations (the fast kernel): scale and zero are rounded to bf16 (8 significant bits
  instead of fp16's 11): each weight moves by at most ~8·2⁻⁹·d + 2⁻⁹·|m + 8d|, i.e. about 2 % of
  one quantization step d (Q4_1's own rounding is ±d/2). `tests/test_smollm2.py` measures what
  that and the bf16 activations do to the logits;
- fp32 activations: exact, but torch 2.13 runs that path ~40x slower (a reference loop), so
  the engine does not use it.
The embedding (Q8_0 in this file) and the norms are dequantized with the `gguf` package and
run in bf16 like the rest of the model. The file is read with `gguf.GGUFReader`; tensor names
come from gguf's own HF-name map, and llama.cpp's Q/K row permutation is undone with
transformers' GGUF loader's inverse (`LlamaTensorProcessor`), applied to the row order so
the quantized blocks move with their rows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dspark.runtime.config import ModelConfig, rope_inv_freq
from dspark.runtime.linear import Projection, serving_linear
from dspark.runtime.loader import load_config, ours_to_hf
from dspark.runtime.model import Transformer

GROUP = 32  # Q4_1 block size = the int4 kernel's group size
# From this many rows a matmul runs the same weights dense (bf16, oneDNN-prepacked): torch's int4
# kernel reads a quarter of the bytes, which wins at a few rows, but slows with rows far faster
# (results/sps_smollm2_q4_1_cpu.json: 8 rows cost the same either way, 10 rows 17 % more in
# int4), so prefills, verifies and decodes of 10+ rows take the dense copy
DENSE_FROM_ROWS = 10
LINEARS = {  # fused serving projection -> the HF weights it concatenates (rows in this order)
    ("self_attn", "qkv"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn", "out"): ("self_attn.o_proj",),
    ("mlp", "gate_up"): ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp", "down"): ("mlp.down_proj",),
}
# GGUF metadata that must agree with config.json: (GGUF key without the arch prefix, config field)
SHAPE_FIELDS = (("block_count", "num_hidden_layers"), ("embedding_length", "hidden_size"),
                ("feed_forward_length", "intermediate_size"), ("attention.head_count", "num_attention_heads"),
                ("attention.head_count_kv", "num_key_value_heads"))


@dataclass
class Q4_1Tensor:
    """One Q4_1 matrix [rows, cols]: codes q in 0..15 (uint8), per-group d and m (fp32, exactly
    the file's fp16 values), groups of GROUP along cols."""

    q: np.ndarray  # [rows, cols] uint8
    d: np.ndarray  # [rows, cols / GROUP] f32
    m: np.ndarray  # [rows, cols / GROUP] f32

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.q.shape
        return rows, cols

    def rows(self, order: np.ndarray) -> Q4_1Tensor:
        return Q4_1Tensor(self.q[order], self.d[order], self.m[order])

    def dequantize(self) -> torch.Tensor:
        """w = d·q + m in fp32 (what the fp32 folder holds)."""
        r, c = self.q.shape
        w = self.q.reshape(r, c // GROUP, GROUP).astype(np.float32) * self.d[..., None] + self.m[..., None]
        return torch.from_numpy(w.reshape(r, c))

    @staticmethod
    def cat(parts: list[Q4_1Tensor]) -> Q4_1Tensor:
        return Q4_1Tensor(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))


def read_q4_1(tensor) -> Q4_1Tensor:
    """Split a GGUFReader tensor's raw Q4_1 blocks (per block: fp16 d, fp16 m, 16 bytes holding
    codes 0-15 in the low nibbles and 16-31 in the high ones: gguf.quants.Q4_1's layout)."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_1]
    raw = np.asarray(tensor.data, dtype=np.uint8)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, type_size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    assert q.shape[1] == blocks.shape[1] * block_size
    return Q4_1Tensor(q, d, m)


def bf16_scale_error(w: Q4_1Tensor) -> tuple[float, float]:
    """(max, mean) over the weights of |w as the kernel computes it − d·q − m| / d: what holding
    scale and zero in bf16 moves each weight, in units of its group's quantization step."""
    d, m = torch.from_numpy(w.d), torch.from_numpy(w.m)
    q = torch.from_numpy(w.q.astype(np.float32)).view(*w.d.shape, GROUP)
    scale, zero = d.to(torch.bfloat16).float(), (m + 8 * d).to(torch.bfloat16).float()
    err = ((q - 8) * scale[..., None] + zero[..., None] - (q * d[..., None] + m[..., None])).abs()
    steps = err / d[..., None].clamp_min(torch.finfo(torch.float32).tiny)
    return steps.max().item(), steps.mean().item()


class Int4Linear:
    """y = x Wᵀ with W in torch's CPU int4 pack (groups of GROUP along the input), bf16 scale and
    zero per group. Same call as `dspark.runtime.linear.Dense`; bf16 in, bf16 out. With `dense`
    (default), inputs of DENSE_FROM_ROWS rows or more run a bf16 copy of the same weights, as the
    kernel computes them ((q − 8)·scale + zero with the bf16 scale and zero, rounded to bf16):
    one more copy of the weights in memory for a prefill several times faster."""

    __slots__ = ("packed", "scales_and_zeros", "out_features", "in_features", "dense")

    def __init__(self, w: Q4_1Tensor, dense: bool = True) -> None:
        n, k = w.shape
        if k % GROUP:
            raise ValueError(f"int4 weights need in_features divisible by {GROUP}, got {k}")
        self.out_features, self.in_features = n, k
        codes = torch.from_numpy(w.q.astype(np.int32))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        d, m = torch.from_numpy(w.d), torch.from_numpy(w.m)
        # kernel: w = (q - 8)·scale + zero; Q4_1: w = d·q + m  =>  scale = d, zero = m + 8d
        sz = torch.stack([d, m + 8 * d], dim=-1)  # [N, K/GROUP, 2] -> the kernel's [K/GROUP, N, 2]
        self.scales_and_zeros = sz.transpose(0, 1).contiguous().to(torch.bfloat16)
        self.dense: Projection | None = None
        if dense:
            scale, zero = self.scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, K/GROUP] each
            weight = (codes.float().view(n, k // GROUP, GROUP) - 8) * scale[..., None] + zero[..., None]
            self.dense = serving_linear(weight.view(n, k).to(torch.bfloat16))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if self.dense is not None and x2d.shape[0] >= DENSE_FROM_ROWS:
            return self.dense(x2d).view(*lead, self.out_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, GROUP, self.scales_and_zeros)
        return y.view(*lead, self.out_features)


def find_gguf(folder: str | Path) -> Path:
    """The GGUF a converted folder came from: one *.gguf inside it, else the file named by
    `dspark fetch-model`'s stamp (dspark_source.json), checked against its sha256."""
    folder = Path(folder)
    inside = sorted(folder.glob("*.gguf"))
    if len(inside) == 1:
        return inside[0]
    if len(inside) > 1:
        raise ValueError(f"{folder} holds several GGUF files ({', '.join(p.name for p in inside)}); keep one")
    stamp = folder / "dspark_source.json"
    if not stamp.is_file():
        raise FileNotFoundError(f"q4_1 needs the model's GGUF: no *.gguf and no dspark_source.json "
                                f"in {folder}")
    from dspark.tools.fetch_model import gguf_path

    info = json.loads(stamp.read_text())
    path = gguf_path(folder.parent)
    if Path(info.get("gguf", "")).name != path.name or not path.is_file():
        raise FileNotFoundError(f"q4_1: {stamp.name} names {info.get('gguf')!r}, not found at {path}; "
                                "run `dspark fetch-model`")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    if h.hexdigest() != info.get("gguf_sha256"):
        raise ValueError(f"{path} does not match the sha256 in {stamp} (corrupt or replaced); "
                         "run `dspark fetch-model`")
    return path


def _field(reader, key: str):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def check_gguf(reader, path: Path, cfg: ModelConfig) -> None:
    """The GGUF is a llama model of exactly the shape config.json describes (else ValueError
    naming the file and the field)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: general.architecture is {arch!r}; q4_1 loading supports 'llama' "
                         "(the Q/K un-permutation is llama's)")
    if cfg.model_type != "llama":
        raise ValueError(f"q4_1: config.json model_type is {cfg.model_type!r}, the GGUF is 'llama'")
    for key, attr in SHAPE_FIELDS:
        value = _field(reader, f"llama.{key}")
        if value is not None and int(value) != getattr(cfg, attr):
            raise ValueError(f"{path.name}: llama.{key} = {value} but config.json "
                             f"{attr} = {getattr(cfg, attr)}")


class GGUFModel:
    """A GGUF opened with gguf.GGUFReader and checked against config.json; tensors by HF name."""

    def __init__(self, folder: str | Path, gguf_file: str | Path | None = None) -> None:
        import gguf

        self.cfg = load_config(folder)
        self.path = Path(gguf_file) if gguf_file is not None else find_gguf(folder)
        self.reader = gguf.GGUFReader(str(self.path))
        check_gguf(self.reader, self.path, self.cfg)
        self.by_name = {t.name: t for t in self.reader.tensors}
        self.names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, self.cfg.num_hidden_layers)

    def tensor(self, hf_name: str):
        gname = self.names.get_name(hf_name.removesuffix(".weight"))
        if gname is None or gname + ".weight" not in self.by_name:
            raise ValueError(f"{self.path.name}: no tensor for {hf_name} (GGUF name {gname}.weight)")
        return self.by_name[gname + ".weight"]

    def dense(self, hf_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Any tensor dequantized to fp32 by the gguf package."""
        import gguf

        t = self.tensor(hf_name)
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if w.size != int(np.prod(shape)):
            raise ValueError(f"{self.path.name}: {t.name} has {w.size} values, {hf_name} needs shape {shape}")
        return torch.from_numpy(w.reshape(shape).copy())

    def q4_1(self, hf_name: str, shape: tuple[int, int]) -> Q4_1Tensor:
        """A Q4_1 linear weight in HF's row order (llama.cpp's Q/K permutation undone)."""
        import gguf
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

        t = self.tensor(hf_name)
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            raise ValueError(f"{self.path.name}: {t.name} is {t.tensor_type.name}; "
                             "q4_1 needs Q4_1 linear weights")
        w = read_q4_1(t)
        if w.shape != tuple(shape):
            raise ValueError(f"{self.path.name}: {t.name} has shape {w.shape}, "
                             f"config.json implies {tuple(shape)}")
        if ".attn_q." in t.name or ".attn_k." in t.name:  # permute whole rows: the blocks move along
            permuter = LlamaTensorProcessor({"num_attention_heads": self.cfg.num_attention_heads,
                                             "num_key_value_heads": self.cfg.num_key_value_heads})
            w = w.rows(np.asarray(permuter.process(np.arange(shape[0]), t.name).weights))
        return w


def load_q4_1_model(folder: str | Path, gguf_file: str | Path | None = None, num_taps: int = 3,
                    tap_layers: list[int] | None = None) -> tuple[Transformer, ModelConfig]:
    """Our Transformer with int4 linear layers from the GGUF and everything else (norms,
    embedding) dequantized. Every tensor is read and checked before the model is built."""
    src = GGUFModel(folder, gguf_file)
    cfg = src.cfg
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise ValueError("q4_1: linear biases are not supported")
    with torch.device("meta"):
        model = Transformer(cfg, tap_layers=tap_layers, num_taps=num_taps)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    linear_names = {f"layers.{i}.{p}.weight" for i in range(cfg.num_hidden_layers)
                    for parts in LINEARS.values() for p in parts}
    dense = {name: src.dense(ours_to_hf(name), shape) for name, shape in expected.items()
             if name not in linear_names}
    quantized = {(i, sub, attr): Q4_1Tensor.cat([src.q4_1(f"model.layers.{i}.{p}.weight",
                                                         expected[f"layers.{i}.{p}.weight"]) for p in parts])
                 for i in range(cfg.num_hidden_layers) for (sub, attr), parts in LINEARS.items()}
    # everything read and checked: build
    for i, layer in enumerate(model.layers):
        for (sub, attr), parts in LINEARS.items():
            module = getattr(layer, sub)
            setattr(module, attr, Int4Linear(quantized.pop((i, sub, attr))))
            for p in parts:
                delattr(module, p.split(".")[1])  # no dense copy of a quantized weight
    model.load_state_dict(dense, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    return model.eval().requires_grad_(False), cfg


def bf16_scale_errors(folder: str | Path, gguf_file: str | Path | None = None) -> dict[str, float]:
    """`bf16_scale_error` over every Q4_1 linear layer: {"max", "mean"} in quantization steps."""
    src = GGUFModel(folder, gguf_file)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(src.cfg).state_dict().items()}
    errs = [bf16_scale_error(src.q4_1(ours_to_hf(f"layers.{i}.{p}.weight"), shapes[f"layers.{i}.{p}.weight"]))
            for i in range(src.cfg.num_hidden_layers) for parts in LINEARS.values() for p in parts]
    return {"max": round(max(e[0] for e in errs), 4), "mean": round(sum(e[1] for e in errs) / len(errs), 5)}


def dequantized_linears(folder: str | Path, gguf_file: str | Path | None = None) -> dict[str, torch.Tensor]:
    """HF name -> fp32 weight (d·q + m) of every Q4_1 linear layer, as `load_q4_1_model` reads it."""
    src = GGUFModel(folder, gguf_file)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(src.cfg).state_dict().items()}
    return {ours_to_hf(f"layers.{i}.{p}.weight"): src.q4_1(ours_to_hf(f"layers.{i}.{p}.weight"),
                                                           shapes[f"layers.{i}.{p}.weight"]).dequantize()
            for i in range(src.cfg.num_hidden_layers) for parts in LINEARS.values() for p in parts}
