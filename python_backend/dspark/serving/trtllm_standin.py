"""Both sides of the TensorRT-LLM target path (architecture §10, §11), testable without Triton.

`PrefixCachedTarget` is the CPU stand-in's engine (model_repository/tensorrt_llm): TensorRT-LLM
knows sequences, not slots, and reuses the KV cache of a shared prefix. Each request here is a
whole sequence plus drafts; it continues the cached sequence with the longest common prefix (the
least recently used one is evicted when none shares one), and all requests run as one ragged
verify. It returns the greedy acceptance TensorRT-LLM would (accepted drafts + one token) and the
logits at the last input token and at each draft.

`TrtllmTargetClient` is `TargetLike` over that contract for the `dspark` BLS model: it keeps each
slot's token history (prefill = the prompt; verify sends history + x0 as `input_ids` and the drafts
as `draft_input_ids`) and calls the model once per request, concurrently. No taps cross (tap_dim 0).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dspark.runtime.batch import RaggedBatch


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCachedTarget:
    def __init__(self, target):
        self.target = target
        self.cached: dict[int, list[int]] = {}  # slot -> the tokens its KV holds
        self.clock = 0
        self.used: dict[int, int] = {}  # slot -> last use

    def _slot_for(self, tokens: list[int], taken: set[int]) -> tuple[int, int]:
        """(slot, reusable prefix length): the cached sequence this one continues (it holds a
        prefix of it, up to the drafts the last step rejected), else a free slot, else the
        least recently used sequence (its shared prefix is kept)."""
        shared = {s: common_prefix(c, tokens) for s, c in self.cached.items() if s not in taken}
        continuing = [s for s, n in shared.items() if n > 0 and n >= len(self.cached[s]) - 16]
        if continuing:
            slot = max(continuing, key=lambda s: shared[s])
            return slot, shared[slot]
        if self.target.num_free_slots() > 0:
            slot = self.target.allocate()
            self.cached[slot] = []
            return slot, 0
        if not shared:
            raise RuntimeError(f"more sequences in one batch than KV slots ({self.target.cache.capacity})")
        slot = min(shared, key=lambda s: self.used.get(s, 0))
        return slot, shared[slot]

    def run(self, jobs: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], torch.Tensor]]:
        """jobs: (input_ids, draft_ids) -> per job (accepted drafts + next token, logits [ℓ+1, V])."""
        slots, starts, news, taken = [], [], [], set()
        for ids, drafts in jobs:
            if not ids:
                raise ValueError("input_ids must be non-empty")
            tokens = list(ids) + list(drafts)
            slot, keep = self._slot_for(tokens, taken)
            keep = min(keep, len(ids) - 1)  # the last input token is always computed: its logits are needed
            if self.target.length(slot) > keep:
                self.target.rollback(slot, keep)
            taken.add(slot)
            slots.append(slot)
            starts.append(keep)
            news.append(tokens[keep:])
            self.cached[slot] = tokens
            self.clock += 1
            self.used[slot] = self.clock
        batch = RaggedBatch.from_requests(slots, news, starts)
        logits, _ = self.target.verify(batch)
        out, cu = [], batch.cu_seqlens.tolist()
        for (_, drafts), end in zip(jobs, cu[1:]):
            rows = logits[end - len(drafts) - 1 : end]  # last input token + each draft
            best = rows.argmax(-1).tolist()
            n = common_prefix(best, list(drafts))
            out.append((list(drafts[:n]) + [best[n]], rows))
        return out


class TrtllmTargetClient:
    """`TargetLike` over TensorRT-LLM's `tensorrt_llm` contract. `send(fields) -> generation
    logits [ℓ+1, V]` performs one request (a BLS call in the `dspark` model)."""

    def __init__(
        self,
        send: Callable[[dict], torch.Tensor],
        model_folder: str | Path,
        capacity: int,
        max_seq_len: int,
        eos_token_ids: list[int] | None = None,
        workers: int = 16,
    ):
        config = json.loads((Path(model_folder) / "config.json").read_text())
        self.send = send
        self.vocab_size, self.max_seq_len, self.capacity = int(config["vocab_size"]), max_seq_len, capacity
        eos = config.get("eos_token_id", [])
        self.eos_token_ids = eos_token_ids or (eos if isinstance(eos, list) else [eos])
        self.tap_dim = 0  # TensorRT-LLM exposes no hidden states
        self.device = torch.device("cpu")
        self.info = {"model_folder": str(model_folder)}
        self._history: dict[int, list[int]] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="trtllm-bls")

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free KV slot (capacity {self.capacity})")
        slot = self._free.pop()
        self._history[slot] = []
        return slot

    def release(self, slot: int) -> None:
        del self._history[slot]
        self._free.append(slot)
        self._free.sort(reverse=True)

    def length(self, slot: int) -> int:
        return len(self._history[slot])

    def rollback(self, slot: int, length: int) -> None:
        if not 0 <= length <= len(self._history[slot]):
            raise ValueError(
                f"rollback of slot {slot} to {length}: must be in [0, {len(self._history[slot])}]"
            )
        del self._history[slot][length:]

    def num_free_slots(self) -> int:
        return len(self._free)

    @staticmethod
    def fields(input_ids: list[int], drafts: list[int]) -> dict[str, np.ndarray]:
        f = {
            "input_ids": np.asarray([input_ids], np.int32),
            "input_lengths": np.asarray([[len(input_ids)]], np.int32),
            "request_output_len": np.asarray([[len(drafts) + 1]], np.int32),
            "return_generation_logits": np.asarray([[True]]),
            "streaming": np.asarray([[False]]),
        }
        if drafts:
            f["draft_input_ids"] = np.asarray([drafts], np.int32)
        return f

    def _all(self, requests: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        return list(self._pool.map(lambda r: self.send(self.fields(*r)), requests))

    def prefill(self, slots: list[int], prompts: list[list[int]]):
        rows = self._all([(list(p), []) for p in prompts])
        for slot, prompt in zip(slots, prompts):
            self._history[slot] = list(prompt)
        return torch.stack([r[0] for r in rows]), [torch.empty(len(p), 0) for p in prompts]

    def verify(self, batch: RaggedBatch):
        cu, tokens = batch.cu_seqlens.tolist(), batch.tokens.cpu().tolist()
        requests = []
        for r, slot in enumerate(batch.slots.tolist()):
            new = tokens[cu[r] : cu[r + 1]]
            start = int(batch.positions[cu[r]])
            del self._history[slot][start:]
            requests.append((self._history[slot] + new[:1], new[1:]))
            self._history[slot] += new
        rows = self._all(requests)
        logits = torch.cat(rows) if rows else torch.empty(0, self.vocab_size)
        return logits, torch.empty(logits.shape[0], 0)
