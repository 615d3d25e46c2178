"""Our decoder-only transformer (Qwen3 / Llama / Qwen2 family), docs/architecture.md §4.

Two forwards share the same weights:
- `forward_train(tokens [B,T])`: plain causal, autograd-friendly (demo-model and drafter training).
- `forward_ragged(...)`: the serving forward over a flattened ragged batch that reads and
  writes the fixed-slot KV cache (`dspark.runtime.kv_cache`), returning logits and the taps
  (hidden states after `tap_layers`) the drafter conditions on.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from dspark.runtime.config import ModelConfig, rope_inv_freq


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


class Projection(Protocol):
    """A serving projection x [..., in] -> [..., out]: `Dense`, `PackedLinear` or
    `dspark.runtime.quant.Int4Linear`."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Dense:
    """y = x Wᵀ + b over weights the model already owns (the fused serving layout). A plain
    object, not a module: it adds nothing to state_dict. `dspark.runtime.quant.Int4Linear` is
    the int4 drop-in with the same call."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear:
    """`Dense` with the weight reordered ONCE into oneDNN's blocked layout (what inductor's
    weight freezing does on CPU). Measured on this CPU (1 thread, all 30 layers' shapes): bf16
    1 row 11.8 ms instead of 22.0 with F.linear, 16 rows 20.8 instead of 29.0; the bf16 LM head
    1.4 ms instead of 3.3; fp32 16 rows 37 instead of 91. bf16 results are bit-identical to
    F.linear, fp32 within ~1e-6 (another summation order)."""

    __slots__ = ("packed", "bias", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)  # batch-size hint
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        m = x2d.shape[0]
        padded = row_bucket(m)
        if padded != m:
            x2d = torch.cat([x2d, x2d.new_zeros(padded - m, x2d.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x2d, self.packed, self.bias, "none", [], "")
        return y[:m].view(*x.shape[:-1], self.out_features)


def row_bucket(m: int) -> int:
    """Rows a prepacked matmul runs with for `m` input rows. oneDNN builds (and caches) one
    primitive per row count, and a ragged verify makes a new count nearly every step: the cache
    churns and the process's memory grows for hours. Exact up to 16 rows (decode and short
    verifies, where a padded row costs most), then a multiple of 8 up to 64, then four sizes
    per octave (<= 25 % padding): about 46 row counts up to 4 096."""
    if m <= 16:
        return m
    if m <= 64:
        return -(-m // 8) * 8
    step = 1 << (m.bit_length() - 3)
    return -(-m // step) * step


def serving_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                   prepack: bool = True) -> Dense | PackedLinear:
    """The fastest projection for this weight: oneDNN-prepacked on CPU in fp32 / bf16, else Dense
    (also with prepack=False: torch.compile with freezing packs the weights itself)."""
    cpu_packable = (prepack and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
                    and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                                          and torch.ops.mkldnn._is_mkldnn_bf16_supported())))
    return PackedLinear(weight, bias) if cpu_packable else Dense(weight, bias)


@dataclass
class AttnMeta:
    """Per-forward description of a ragged batch, shared by all layers (built once)."""

    tok_slot: torch.Tensor  # [N] cache slot of each token
    positions: torch.Tensor  # [N] absolute position of each token (= its cache row)
    seq_idx: torch.Tensor  # [N] request of each token
    cu_seqlens: torch.Tensor  # [R+1]
    slots: torch.Tensor  # [R]
    max_new: int  # longest request in new tokens (T_max)
    kv_len: int  # keys to read per slot: max position + 1
    slot_start: int | None  # slots == slot_start + arange(R): read the cache as a view
    # [N] row of each token in the [R*T_max] padded layout; None when there is no padding (every
    # request has T_max new tokens: a single request, or a uniform budget)
    pad_index: torch.Tensor | None
    # [R, 1, G*T_max, kv_len] bool, True = attend (key position <= query position); None when
    # nothing needs masking, and on the CUDA kernel path (the kernel applies the same rule)
    mask: torch.Tensor | None
    # CPU path, requests of very different new-token counts: (token rows [N_g], the group's own
    # meta) per length group, attended apart (`length_groups`); None: one padded batch
    groups: list[tuple[torch.Tensor, AttnMeta]] | None = None
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """`mask` as an additive bias (0 where attended, −inf elsewhere) in `dtype`, built by the
        first layer and reused by the others: SDPA turns a bool mask into this on every call,
        two more ops in every layer of every masked verify."""
        if self.mask is None:
            return None
        if dtype not in self._bias:
            self._bias[dtype] = mask_bias(self.mask, dtype)
        return self._bias[dtype]


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as the additive bias `_sdpa` takes: 0 where attended, −inf
    elsewhere, in `dtype`."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


GROUP_MIN_SAVED_ROWS = 4  # padded query rows a length group must save to be attended apart


def length_groups(lens: list[int]) -> list[list[int]] | None:
    """Requests (by index) grouped by new-token count, or None for one batch. The padded CPU
    attention costs every request T_max query rows: one request verifying 8 tokens among 31
    verifying 2 makes the step's attention cost 8 x 32 rows instead of 2 x 31 + 8. Requests go to
    power-of-two classes (1, 2, 3-4, 5-8, ...; padding within a class < 2x); a class joins the
    next longer one unless that saves GROUP_MIN_SAVED_ROWS padded rows (a group costs a few
    tens of µs per layer in calls and copies, a padded row about as much as one such call)."""
    classes: dict[int, list[int]] = {}
    for r, n in enumerate(lens):
        classes.setdefault((max(n, 1) - 1).bit_length(), []).append(r)
    if len(classes) < 2:
        return None
    groups: list[list[int]] = []
    pending: list[int] = []
    order = sorted(classes)
    for i, c in enumerate(order):
        pending += classes[c]
        if i + 1 < len(order):
            longest_here = max(lens[r] for r in pending)
            longest_next = max(lens[r] for r in classes[order[i + 1]])
            if len(pending) * (longest_next - longest_here) < GROUP_MIN_SAVED_ROWS:
                continue  # too little padding saved: attend with the next class
        groups.append(sorted(pending))
        pending = []
    return groups if len(groups) > 1 else None


def build_attn_meta(seq_idx, positions, cu_seqlens, slots, n_groups: int,
                    device: torch.device | str | None = None, group: bool = True) -> AttnMeta:
    """Describe a ragged batch for every layer. The arguments are the batch's HOST tensors (the
    scalars below are read from them, so no device sync); tensors the layers index with are
    moved to `device` (default: where `positions` is). group=False: one padded batch even when
    `length_groups` would split it."""
    device = positions.device if device is None else torch.device(device)
    r = slots.numel()
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    max_new = int(lens.max())
    kv_len = int(positions.max()) + 1
    slot_list = slots.tolist()
    contiguous = slot_list == list(range(slot_list[0], slot_list[0] + r))
    dev = lambda t: t.to(device, non_blocking=True)
    tok_slot = dev(slots[seq_idx])
    if _use_varlen_kernel(device):
        return AttnMeta(tok_slot, dev(positions), dev(seq_idx), dev(cu_seqlens), dev(slots), max_new, kv_len,
                        None, None, None)
    if max_new == 1 and int(positions.min()) == kv_len - 1:
        # one new token per request, all at the same position: every key is visible, no mask
        return AttnMeta(tok_slot, dev(positions), dev(seq_idx), dev(cu_seqlens), dev(slots), max_new, kv_len,
                        slot_list[0] if contiguous else None, None, None)
    groups = length_groups(lens.tolist()) if group and max_new > 1 else None
    if groups is not None:
        parts = []
        for members in groups:
            requests = torch.tensor(members)
            renumber = torch.full((r,), -1, dtype=seq_idx.dtype)
            renumber[requests] = torch.arange(len(members), dtype=seq_idx.dtype)
            rows = torch.nonzero(renumber[seq_idx] >= 0).view(-1)
            sub_cu = torch.zeros(len(members) + 1, dtype=cu_seqlens.dtype)
            torch.cumsum(lens[requests], 0, out=sub_cu[1:])
            parts.append((dev(rows), build_attn_meta(renumber[seq_idx[rows]], positions[rows], sub_cu,
                                                     slots[requests], n_groups, device, group=False)))
        return AttnMeta(tok_slot, dev(positions), dev(seq_idx), dev(cu_seqlens), dev(slots), max_new, kv_len,
                        None, None, None, parts)
    keys = torch.arange(kv_len)
    if positions.numel() == r * max_new:  # no padding: every request has T_max new tokens
        pad_index, q_pos = None, positions.view(r, max_new)
    else:
        local = torch.arange(positions.numel()) - cu_seqlens[seq_idx]
        pad_index = seq_idx * max_new + local
        # padded query rows see every key (never an all-masked row); their output is dropped
        q_pos = torch.full((r * max_new,), kv_len - 1, dtype=positions.dtype)
        q_pos[pad_index] = positions
        q_pos = q_pos.view(r, max_new)
    # query rows are ordered (group g, new token t) inside each kv head, see `_attend_torch`
    mask = (keys <= q_pos[:, :, None])[:, None].expand(r, n_groups, max_new, kv_len)
    mask = mask.reshape(r, 1, n_groups * max_new, kv_len)
    return AttnMeta(tok_slot, dev(positions), dev(seq_idx), dev(cu_seqlens), dev(slots), max_new, kv_len,
                    slot_list[0] if contiguous else None, None if pad_index is None else dev(pad_index),
                    dev(mask))


def _attend_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, m: AttnMeta,
                  scale: float) -> torch.Tensor:
    """q [N, H, hd] against each request's slot (keys 0..its position): -> [N, H, hd].
    GQA without copying K/V: the G query heads sharing a kv head become G*T_max query rows.
    Length groups (`m.groups`) are attended one after the other, each padded to its own T_max."""
    if m.groups is not None:
        out = torch.empty_like(q)
        for rows, sub in m.groups:
            out[rows] = _attend_torch(q[rows], k_cache, v_cache, sub, scale)
        return out
    n, h, hd = q.shape
    r, n_kv = m.slots.numel(), k_cache.shape[1]
    g = h // n_kv
    if m.slot_start is not None:
        k = k_cache[m.slot_start:m.slot_start + r, :, :m.kv_len]
        v = v_cache[m.slot_start:m.slot_start + r, :, :m.kv_len]
    else:  # index_select on the narrowed view: several times faster than advanced indexing on a CPU
        k = k_cache.narrow(2, 0, m.kv_len).index_select(0, m.slots)
        v = v_cache.narrow(2, 0, m.kv_len).index_select(0, m.slots)
    t = m.max_new
    if m.pad_index is not None:  # scatter into the padded [R*T_max] layout
        q = q.new_zeros(r * t, h, hd).index_copy_(0, m.pad_index, q)
    if t == 1:
        qp = q.view(r, n_kv, g, hd)
    else:
        qp = q.view(r, t, n_kv, g, hd).permute(0, 2, 3, 1, 4).reshape(r, n_kv, g * t, hd)
    out = _sdpa(qp, k, v, m.bias(q.dtype), scale)
    if t == 1:
        return out.reshape(n, h, hd)
    out = out.view(r, n_kv, g, t, hd).permute(0, 3, 1, 2, 4).reshape(r * t, h, hd)
    return out if m.pad_index is None else out[m.pad_index]


MATH_ATTENTION_FROM = 512  # requests x keys from which `_sdpa` takes the matmul path on a CPU
MATH_ATTENTION_ROWS = 64  # ... for at most this many query rows per kv head (never a prefill)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale + bias) v for q [R, Hkv, rows, hd], k / v [R, Hkv, S, hd], bias
    [R, 1, rows, S] in q's dtype (0 = attend, −inf = masked: `AttnMeta.bias`) or None. On a
    CPU from R·S >= MATH_ATTENTION_FROM, as two batched matmuls and an f32 softmax
    (transformers' eager formula): ATen's flash kernel is built
    for long query blocks, and with the few query rows of a decode or verify it measured 2-3x
    slower on this CPU (R 32 x 256 keys, 1 token each: 0.90 ms a layer against 0.28 in bf16).
    Prefills keep the flash kernel: their [rows, S] scores would be large."""
    if (q.device.type != "cpu" or k.shape[0] * k.shape[2] < MATH_ATTENTION_FROM
            or q.shape[2] > MATH_ATTENTION_ROWS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    k, v = k.contiguous(), v.contiguous()  # a cache view's batched matmul is as slow as SDPA
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if bias is not None:
        scores = scores.add_(bias)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


@functools.cache
def _load_varlen_kernel():
    try:
        from dspark_kernels import varlen_attention  # written against the KVCache layout
    except ImportError:
        return None
    return getattr(varlen_attention, "varlen_attention", varlen_attention)


def _use_varlen_kernel(device: torch.device) -> bool:
    """dspark_kernels' one dispatcher decides (CUDA, or DSPARK_KERNELS=triton|torch), if Triton is there."""
    from dspark_kernels.dispatch import use_triton_on

    return use_triton_on(device) and _load_varlen_kernel() is not None


def attention_backend(q, k_cache, v_cache, meta: AttnMeta, scale: float) -> torch.Tensor:
    """Dispatch: the Triton varlen kernel on CUDA when it is installed, torch SDPA otherwise.
    Kernel contract: varlen_attention(q [N,H,hd] contiguous, k_cache, v_cache [C,Hkv,S,hd],
    tok_slot [N], positions [N], cu_seqlens [R+1], slots [R], scale, max_new) -> [N,H,hd];
    token i attends to rows 0..positions[i] of slot tok_slot[i]."""
    if meta.mask is None and meta.pad_index is None and meta.groups is None and _use_varlen_kernel(q.device):
        return _load_varlen_kernel()(q.contiguous(), k_cache, v_cache, meta.tok_slot, meta.positions,
                                     meta.cu_seqlens, meta.slots, scale, meta.max_new)
    return _attend_torch(q, k_cache, v_cache, meta, scale)


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
        h, hd = self.n_heads + self.n_kv, self.head_dim
        qkv = self.qkv(x).view(*x.shape[:-1], h + self.n_kv, hd)
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
        qk, v = self.qkv_heads(x)
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
        for i, layer in enumerate(self.blocks):
            attn = layer.self_attn
            x = x + attn.forward_ragged(layer.input_layernorm(x), cos, sin, k_caches[i], v_caches[i], meta)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.tap_layers:
                taps[i] = x
        hidden = self.norm(x)
        logits = self.lm_head(hidden if logits_rows is None else hidden[logits_rows])
        return logits, torch.cat([taps[t] for t in self.tap_layers], dim=-1), hidden
