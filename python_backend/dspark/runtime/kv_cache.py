"""Fixed-slot KV cache (docs/architecture.md §4): `capacity` slots of `max_seq_len` tokens each.

Layout per layer (fixed: the Triton varlen attention kernel indexes it directly):
    k[layer], v[layer]: [capacity, n_kv_heads, max_seq_len, head_dim]
A slot's tokens 0..length-1 are valid; anything past `length` is stale and never read,
so rollback after verification is just setting the length."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, capacity: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if capacity < 1 or max_seq_len < 1:
            raise ValueError(f"capacity and max_seq_len must be >= 1 (got {capacity}, {max_seq_len})")
        shape = (capacity, n_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.capacity = capacity
        self.max_seq_len = max_seq_len
        self.lengths = [0] * capacity  # tokens cached per slot
        self.in_use = [False] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest slot first

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free KV slot (capacity {self.capacity})")
        slot = self._free.pop()
        self.in_use[slot] = True
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self._check(slot)
        self.in_use[slot] = False
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def length(self, slot: int) -> int:
        self._check(slot)
        return self.lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first `length` tokens of the slot (only shrinks)."""
        self._check(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"rollback of slot {slot} to {length}: must be in [0, {self.lengths[slot]}]")
        self.lengths[slot] = length

    def num_free_slots(self) -> int:
        return len(self._free)

    def check_append(self, slot: int, start: int, n: int) -> None:
        """Validate that slot can take n tokens at positions start..start+n-1."""
        self._check(slot)
        if start != self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} tokens but new tokens start at "
                             f"position {start}")
        if start + n > self.max_seq_len:
            raise ValueError(f"slot {slot}: {start} cached + {n} new tokens = {start + n} exceeds "
                             f"max_seq_len {self.max_seq_len}")

    def _check(self, slot: int) -> None:
        if not (0 <= slot < self.capacity) or not self.in_use[slot]:
            raise ValueError(f"KV slot {slot} is not allocated (capacity {self.capacity})")
