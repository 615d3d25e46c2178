"""Per-slot context cache of a drafter (docs/architecture.md §5).

Each engine slot owns named streams of rows that only grow (e.g. the drafter's per-layer
K/V of the projected target taps, or the tokens of the request). Rows live in buffers that
double when full, so extending is amortised O(new rows). `padded` gathers several slots
into one right-padded batch plus a validity mask, for batched attention."""

from __future__ import annotations

import torch


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
    """slot -> {name -> rows [L, ...]}. Slots are isolated: nothing is shared between them."""

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


class SlotDrafter:
    """Runtime scaffolding shared by the trained drafters: the frozen model with the target's
    embedding / LM head attached, a settable γ (≤ the trained block) and a `SlotContext`."""

    def __init__(self, model, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 gamma: int | None = None, sts_temperatures: list[float] | None = None) -> None:
        self.model = model.eval().requires_grad_(False)
        self.model.attach_shared(embed_weight, lm_head_weight)
        self.config = model.config
        self.block_size = model.config.block_size
        self._gamma = 0
        self.gamma = model.config.gamma if gamma is None else gamma
        self.sts_temperatures = sts_temperatures
        self.ctx = SlotContext()
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
