"""Per-slot state of the drafters (architecture §5).

- `SlotKV`: the DSpark drafter's context K/V in fixed slots on the device, laid out like the
  target's KV cache ([slots, kv heads, rows, head dim] per layer). Lengths live on the device,
  so `extend` with device-side accepted counts never waits for the host; the host keeps an upper
  bound per slot (what it has written) to size attention and the buffers. Nothing is copied per
  step: new rows are scattered in place, and a batch whose slots form a range reads a view.
- `DraftProbStore`: per slot, the distributions its latest block was sampled from, for
  `draft_probs` (sampled requests only).
- `SlotContext`: growing per-slot row streams (host-driven baselines: EAGLE).
- `SlotDrafter`: the scaffolding the trained drafters share.
"""

from __future__ import annotations

import torch


class SlotKV:
    def __init__(self, num_layers: int, n_kv_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype, rows: int = 256) -> None:
        self.num_layers, self.n_kv, self.head_dim = num_layers, n_kv_heads, head_dim
        self.device, self.dtype = device, dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.int64, device=device)  # [slots] rows in context (advance()
        # and every other update run in inference mode: the buffers are inference tensors)
        self.bound: list[int] = []  # host upper bound of lengths (rows written since start)
        self.active: set[int] = set()  # started and not released
        self._alloc(1, rows)

    @property
    def capacity(self) -> tuple[int, int]:
        return self.k[0].shape[0], self.k[0].shape[2]

    @torch.inference_mode()  # the buffers are inference tensors: every update happens in this mode
    def _alloc(self, slots: int, rows: int) -> None:
        old = (self.k, self.v, self.lengths)
        shape = (slots, self.n_kv, rows, self.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_layers)]
        self.lengths = torch.zeros(slots, dtype=torch.int64, device=self.device)
        if old[0]:
            s, r = old[0][0].shape[0], min(old[0][0].shape[2], rows)
            for new, prev in zip(self.k + self.v, old[0] + old[1]):
                new[:s, :, :r] = prev[:, :, :r]
            self.lengths[:s] = old[2]
        self.bound += [0] * (slots - len(self.bound))

    def reserve(self, slots: list[int], rows: list[int]) -> None:
        """Room for `rows[i]` rows in slot slots[i] (grows by doubling; rare)."""
        have_s, have_r = self.capacity
        need_s, need_r = max(slots) + 1, max(rows)
        if need_r > have_r:  # the host bound over-counts rejected drafts: learn the true lengths once
            true = self.lengths.tolist()
            self.bound = [min(b, t) for b, t in zip(self.bound, true)]
        if need_s > have_s or need_r > have_r:
            self._alloc(max(need_s, have_s), max(need_r, 2 * have_r) if need_r > have_r else have_r)

    @torch.inference_mode()
    def start(self, slot: int) -> None:
        self.reserve([slot], [1])
        self.lengths[slot] = 0
        self.bound[slot] = 0
        self.active.add(slot)

    def release(self, slot: int) -> None:
        self.active.discard(slot)

    @torch.inference_mode()
    def advance(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """lengths[slots] += rows (device tensors; slots distinct)."""
        self.lengths[slots] += rows.to(self.lengths.device)

    def check(self, slots: list[int]) -> None:
        missing = [s for s in slots if s not in self.active]
        if missing:
            raise KeyError(f"drafter slots {missing} were not started (call start() first)")

    @torch.inference_mode()
    def write(self, layer: int, slot_idx: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """cache[layer][slot_idx[i], :, rows[i]] = k[i], v[i] (all on the device; k, v [M, Hkv, hd])."""
        self.k[layer][slot_idx, :, rows] = k.to(self.dtype)
        self.v[layer][slot_idx, :, rows] = v.to(self.dtype)

    def read(self, layer: int, slot_idx: torch.Tensor, first_slot: int | None,
             rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [R, Hkv, rows, hd] of the slots: a view when they are first_slot + arange(R)."""
        k, v = self.k[layer][:, :, :rows], self.v[layer][:, :, :rows]
        if first_slot is not None:
            return k[first_slot:first_slot + slot_idx.numel()], v[first_slot:first_slot + slot_idx.numel()]
        return k.index_select(0, slot_idx), v.index_select(0, slot_idx)


class DraftProbStore:
    """slot -> the distributions [γ, V] its latest block's tokens were drawn from (sampled blocks)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None  # [slots, γ, V] f32
        self.sampled: dict[int, bool] = {}

    @torch.inference_mode()
    def put(self, slots: list[int], greedy: list[bool], probs: torch.Tensor | None) -> None:
        """probs [R_s, γ, V]: the rows of the non-greedy slots, in order (None when all greedy)."""
        self.sampled.update((s, not g) for s, g in zip(slots, greedy))
        sampled = [s for s, g in zip(slots, greedy) if not g]
        if not sampled:
            return
        assert probs is not None, "sampled slots need their distributions"
        need = (max(sampled) + 1, probs.shape[1], probs.shape[2])
        buf = self.buf
        if buf is None or buf.device != probs.device or buf.shape[2] != need[2]:
            buf = probs.new_zeros(need)
        elif any(n > h for n, h in zip(need, buf.shape)):
            grown = probs.new_zeros(tuple(max(n, h) for n, h in zip(need, buf.shape)))
            grown[:buf.shape[0], :buf.shape[1]] = buf
            buf = grown
        buf[torch.tensor(sampled, device=probs.device), :probs.shape[1]] = probs
        self.buf = buf

    def take(self, slots: list[int], lengths: torch.Tensor) -> torch.Tensor:
        """Flat [Σ ℓ over sampled slots, V]: rows 0..ℓ_r − 1 of each sampled slot, in order."""
        lens = lengths.tolist()
        keep = [(s, n) for s, n in zip(slots, lens, strict=True) if n > 0 and self.sampled.get(s, False)]
        if not keep or self.buf is None:
            v = 0 if self.buf is None else self.buf.shape[2]
            return torch.zeros(0, v, device=None if self.buf is None else self.buf.device)
        counts = torch.tensor([n for _, n in keep])
        total = int(counts.sum())
        slot_rows = torch.tensor([s for s, _ in keep]).repeat_interleave(counts, output_size=total)
        first = torch.zeros(len(keep), dtype=torch.int64)
        first[1:] = counts.cumsum(0)[:-1]
        pos = torch.arange(total) - first.repeat_interleave(counts, output_size=total)
        dev = self.buf.device
        return self.buf[slot_rows.to(dev), pos.to(dev)]

    def release(self, slot: int) -> None:
        self.sampled.pop(slot, None)


class _Stream:
    def __init__(self, first: torch.Tensor) -> None:
        self.buf = first.new_empty((max(16, 2 * first.shape[0]),) + tuple(first.shape[1:]))
        self.len = 0
        self.append(first)

    def append(self, rows: torch.Tensor) -> None:
        need = self.len + rows.shape[0]
        if need > self.buf.shape[0]:
            grown = self.buf.new_empty((max(need, 2 * self.buf.shape[0]),) + tuple(self.buf.shape[1:]))
            grown[: self.len] = self.buf[: self.len]
            self.buf = grown
        self.buf[self.len : need] = rows
        self.len = need

    def view(self) -> torch.Tensor:
        return self.buf[: self.len]


class SlotContext:
    """slot -> {name -> rows [L, ...]} in buffers that double when full (host-driven drafters)."""

    def __init__(self) -> None:
        self._slots: dict[int, dict[str, _Stream]] = {}

    def start(self, slot: int) -> None:
        self._slots[slot] = {}

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def active(self, slot: int) -> bool:
        return slot in self._slots

    def _get(self, slot: int) -> dict[str, _Stream]:
        if slot not in self._slots:
            raise KeyError(f"drafter slot {slot} was not started (call start() first)")
        return self._slots[slot]

    def append(self, slot: int, name: str, rows: torch.Tensor) -> None:
        streams = self._get(slot)
        if name in streams:
            streams[name].append(rows)
        else:
            streams[name] = _Stream(rows)

    def get(self, slot: int, name: str) -> torch.Tensor | None:
        stream = self._get(slot).get(name)
        return None if stream is None else stream.view()

    def length(self, slot: int, name: str) -> int:
        stream = self._get(slot).get(name)
        return 0 if stream is None else stream.len

    def padded(self, slots: list[int], name: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> rows [R, Lmax, ...] (zeros past each slot's length), valid [R, Lmax] bool.
        `like` [1, ...] gives dtype, device and row shape for slots that have no rows yet."""
        views = [self.get(s, name) for s in slots]
        lens = [0 if v is None else v.shape[0] for v in views]
        lmax = max(lens, default=0)
        out = like.new_zeros((len(slots), lmax) + tuple(like.shape[1:]))
        for i, v in enumerate(views):
            if v is not None:
                out[i, : v.shape[0]] = v
        lens_t = torch.tensor(lens, device=like.device)
        valid = torch.arange(lmax, device=like.device)[None, :] < lens_t[:, None]
        return out, valid


def segments(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a host cu [R+1]: (request index [N], offset inside its segment [N]) of every flat row."""
    cu = cu_seqlens.cpu()
    rows = torch.arange(int(cu[-1]))
    seq = torch.searchsorted(cu[1:], rows, right=True)  # (empty segments hold no row)
    return seq, rows - cu.index_select(0, seq)


class SlotDrafter:
    """Runtime scaffolding shared by the trained drafters: the frozen model with the target's
    embedding / LM head attached, a settable γ (≤ the trained block), per-slot draft probs."""

    def __init__(self, model, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 gamma: int | None = None, sts_temperatures: list[float] | None = None,
                 sts_shifts: list[float] | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        self.model.attach_shared(embed_weight, lm_head_weight)
        self.config = model.config
        self.block_size = model.config.block_size
        self._gamma = 0
        self.gamma = model.config.gamma if gamma is None else gamma
        self.sts_temperatures, self.sts_shifts = sts_temperatures, sts_shifts
        self.ctx = SlotContext()
        self.probs = DraftProbStore()
        self.device = next(model.parameters()).device

    @property
    def gamma(self) -> int:
        return self._gamma

    @gamma.setter
    def gamma(self, value: int) -> None:
        if not 1 <= int(value) <= self.block_size:
            raise ValueError(f"gamma {value} must be in [1, trained block size {self.block_size}]")
        self._gamma = int(value)

    def release(self, slot: int) -> None:
        self.ctx.release(slot)
        self.probs.release(slot)

    def draft_probs(self, slots: list[int], lengths: torch.Tensor) -> torch.Tensor:
        return self.probs.take(slots, lengths)
