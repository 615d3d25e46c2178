"""Attention over the fixed-slot KV cache for a flattened ragged batch (docs/architecture.md
§4): `build_attn_meta` describes the batch once per forward (`AttnMeta`: masks, padding, length
groups), `attention_backend` runs every layer's attention with it: the Triton varlen kernel
(`dspark_kernels`) on CUDA, our C kernel (`dspark.runtime.cpu_attention`) for bf16 decodes and
verifies on an AVX512-BF16 CPU, torch SDPA or two batched matmuls (`_sdpa`) otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dspark.runtime import cpu_attention


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
    # nothing needs masking, and on the CUDA kernel path (the kernel applies the same rule).
    # [R, 1, T_max, kv_len] when `per_head`
    mask: torch.Tensor | None
    # CPU path, requests of very different new-token counts: (token rows [N_g], the group's own
    # meta) per length group, attended apart (`length_groups`); None: one padded batch
    groups: list[tuple[torch.Tensor, AttnMeta]] | None = None
    # q as [R, H, T_max, hd] and GQA inside the flash kernel (`flash_per_head`), not the query
    # heads of a kv head stacked into G*T_max rows
    per_head: bool = False
    # run by `dspark.runtime.cpu_attention` (bf16 CPU, decodes and verifies): only tok_slot and
    # positions are read, so no mask, padding or groups are built
    cpu_kernel: bool = False
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
                    device: torch.device | str | None = None, group: bool = True,
                    cpu_kernel: bool = False) -> AttnMeta:
    """Describe a ragged batch for every layer. The arguments are the batch's HOST tensors (the
    scalars below are read from them, so no device sync); tensors the layers index with are
    moved to `device` (default: where `positions` is). group=False: one padded batch even when
    `length_groups` would split it. cpu_kernel=True (the caller's q and cache are what
    `cpu_attention.enabled` says): batches go to that kernel, prefills included (unless
    `cpu_attention.MAX_NEW_TOKENS` caps the new tokens a request it takes)."""
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
    if cpu_kernel and (cpu_attention.MAX_NEW_TOKENS is None or max_new <= cpu_attention.MAX_NEW_TOKENS):
        return AttnMeta(tok_slot, dev(positions), dev(seq_idx), dev(cu_seqlens), dev(slots), max_new, kv_len,
                        None, None, None, cpu_kernel=True)
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
    per_head = flash_per_head(device, r, kv_len, n_groups * max_new)
    mask = (keys <= q_pos[:, :, None])[:, None]  # [R, 1, T_max, kv_len]
    if not per_head:  # query rows are ordered (group g, new token t) inside each kv head
        mask = mask.expand(r, n_groups, max_new, kv_len).reshape(r, 1, n_groups * max_new, kv_len)
    return AttnMeta(tok_slot, dev(positions), dev(seq_idx), dev(cu_seqlens), dev(slots), max_new, kv_len,
                    slot_list[0] if contiguous else None, None if pad_index is None else dev(pad_index),
                    dev(mask), per_head=per_head)


def flash_per_head(device: torch.device, requests: int, kv_len: int, grouped_rows: int) -> bool:
    """Whether a CPU forward with several new tokens per request hands ATen's flash kernel q as
    [R, H, T, hd] with enable_gqa (what `_sdpa` would run on the flash kernel anyway): no copy of q
    into the grouped layout and a G-times smaller mask. Measured on the AVX2 EPYC (2 threads, one
    request, 6 tokens over 206 keys): 187 µs a layer instead of 229, the same bits; prefills of
    64 / 200 tokens 314 / 2089 µs instead of 382 / 2149."""
    return device.type == "cpu" and not _math_attention(requests, kv_len, grouped_rows)


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
    if m.per_head:
        qh = q.view(r, t, h, hd).transpose(1, 2)  # [R, H, T_max, hd], a view
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=m.bias(q.dtype), scale=scale,
                                             enable_gqa=g > 1)
        out = out.transpose(1, 2).reshape(r * t, h, hd)
        return out if m.pad_index is None else out[m.pad_index]
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
    if q.device.type != "cpu" or not _math_attention(k.shape[0], k.shape[2], q.shape[2]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    k, v = k.contiguous(), v.contiguous()  # a cache view's batched matmul is as slow as SDPA
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if bias is not None:
        scores = scores.add_(bias)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _math_attention(requests: int, keys: int, rows: int) -> bool:
    """`_sdpa`'s rule on a CPU: two matmuls for R·S >= MATH_ATTENTION_FROM keys and at most
    MATH_ATTENTION_ROWS query rows per kv head, else the flash kernel."""
    return requests * keys >= MATH_ATTENTION_FROM and rows <= MATH_ATTENTION_ROWS


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
    if meta.cpu_kernel:
        return cpu_attention.cached_attention(q, k_cache, v_cache, meta.tok_slot, meta.positions, scale)
    if meta.mask is None and meta.pad_index is None and meta.groups is None and _use_varlen_kernel(q.device):
        return _load_varlen_kernel()(q.contiguous(), k_cache, v_cache, meta.tok_slot, meta.positions,
                                     meta.cu_seqlens, meta.slots, scale, meta.max_new)
    return _attend_torch(q, k_cache, v_cache, meta, scale)
