"""The in-process target engine (docs/architecture.md §4): our transformer + a fixed-slot KV cache,
implementing `dspark.runtime.interfaces.TargetLike` (prefill, ragged verify, slot management).
Plain decoding is the engine loop with no drafter (`SpecEngine(target).generate`)."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.runtime.batch import RaggedBatch
from dspark.runtime.config import ModelConfig
from dspark.runtime.kv_cache import KVCache
from dspark.runtime.loader import load_model, load_tokenizer
from dspark.runtime.model import Transformer, build_attn_meta

PREFILL_PADDED_TOKENS = 4096  # prefill batches requests while R * longest prompt stays under this


def _prefill_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of request indices whose padded size (count * longest) fits the
    budget (a single longer prompt forms its own group): bounds the padded attention mask."""
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= budget:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


class TargetEngine:
    def __init__(self, model: Transformer, config: ModelConfig, tokenizer=None, capacity: int = 8,
                 max_seq_len: int = 1024, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False).fuse_for_inference()
        self.config = config
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = dtype
        self.vocab_size = config.vocab_size
        self.max_seq_len = max_seq_len
        self.tap_layers = list(model.tap_layers)
        self.tap_dim = model.tap_dim
        self.eos_token_ids = list(config.eos_token_ids)
        self.cache = KVCache(config.num_hidden_layers, capacity, config.num_key_value_heads, max_seq_len,
                             config.head_dim, device=device, dtype=dtype)
        self.n_groups = config.num_attention_heads // config.num_key_value_heads

    @classmethod
    def from_pretrained(cls, path: str | Path, capacity: int = 8, max_seq_len: int = 1024,
                        device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        num_taps: int = 3) -> TargetEngine:
        model, cfg = load_model(path, device=device, dtype=dtype, num_taps=num_taps)
        return cls(model, cfg, load_tokenizer(path), capacity, max_seq_len, device, dtype)

    # --- slots (TargetLike) ---
    def allocate(self) -> int:
        return self.cache.allocate()

    def release(self, slot: int) -> None:
        self.cache.release(slot)

    def length(self, slot: int) -> int:
        return self.cache.length(slot)

    def rollback(self, slot: int, length: int) -> None:
        self.cache.rollback(slot, length)

    def num_free_slots(self) -> int:
        return self.cache.num_free_slots()

    # --- forwards ---
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Cache the prompts (appended after whatever each slot holds, normally nothing).
        -> last-token logits [R, V], taps per prompt [L_r, tap_dim]."""
        if len(slots) != len(prompts):
            raise ValueError(f"prefill got {len(slots)} slots for {len(prompts)} prompts")
        for slot, prompt in zip(slots, prompts):
            if len(prompt) == 0:
                raise ValueError(f"prefill: empty prompt for slot {slot}")
            self.cache.check_append(slot, self.cache.length(slot), len(prompt))
        logits, taps = [], []
        for group in _prefill_groups([len(p) for p in prompts], PREFILL_PADDED_TOKENS):
            g_slots, g_prompts = [slots[i] for i in group], [prompts[i] for i in group]
            batch = RaggedBatch.from_requests(g_slots, g_prompts, [self.cache.length(s) for s in g_slots])
            g_logits, g_taps = self._forward(batch, logits_rows=batch.cu_seqlens[1:] - 1)
            logits.append(g_logits)
            taps.extend(g_taps.split([len(p) for p in g_prompts]))
        return torch.cat(logits), taps

    def verify(self, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> logits [N, V], taps [N, tap_dim]. Token i of request r attends to slot r's cached
        prefix and to r's new tokens before it; its K/V is appended to the slot."""
        self._validate(batch)
        if batch.num_requests == 0:
            return (torch.empty(0, self.vocab_size, device=self.device, dtype=self.dtype),
                    torch.empty(0, self.tap_dim, device=self.device, dtype=self.dtype))
        return self._forward(batch)

    def _validate(self, batch: RaggedBatch) -> None:
        batch.validate()
        slots = batch.slots.tolist()
        if len(set(slots)) != len(slots):
            raise ValueError(f"RaggedBatch.slots has duplicates: {slots}")
        cu = batch.cu_seqlens.cpu()
        lens = cu[1:] - cu[:-1]
        if not torch.equal(batch.seq_idx.cpu(), torch.repeat_interleave(torch.arange(len(slots)), lens)):
            raise ValueError("RaggedBatch.seq_idx does not match cu_seqlens")
        for slot, start, n in zip(slots, batch.positions.cpu()[cu[:-1]].tolist(), lens.tolist()):
            self.cache.check_append(slot, start, n)
        starts = torch.tensor([self.cache.lengths[s] for s in slots])
        local = torch.arange(batch.num_tokens) - cu[:-1].repeat_interleave(lens)
        expected = starts.repeat_interleave(lens) + local
        if not torch.equal(batch.positions.cpu(), expected):
            raise ValueError("RaggedBatch.positions must run from each slot's cached length upward")
        toks = batch.tokens
        if toks.numel() and not (int(toks.min()) >= 0 and int(toks.max()) < self.vocab_size):
            raise ValueError(f"RaggedBatch.tokens must be in [0, {self.vocab_size})")

    @torch.no_grad()  # not inference_mode: callers may feed taps to modules they train
    def _forward(self, batch: RaggedBatch, logits_rows: torch.Tensor | None = None):
        """Run the cached forward (inputs already validated) and advance each slot's length."""
        dev = self.device
        tokens, seq_idx, positions = (t.to(dev) for t in (batch.tokens, batch.seq_idx, batch.positions))
        cu, slots = batch.cu_seqlens.to(dev), batch.slots.to(dev)
        meta = build_attn_meta(seq_idx, positions, cu, slots, self.n_groups)
        logits, taps, _ = self.model.forward_ragged(
            tokens, meta, self.cache.k, self.cache.v, None if logits_rows is None else logits_rows.to(dev))
        ends = batch.positions[batch.cu_seqlens[1:] - 1].tolist()
        for slot, end in zip(batch.slots.tolist(), ends):
            self.cache.lengths[slot] = end + 1
        return logits, taps
