"""The in-process target engine (docs/architecture.md §4): our transformer + a fixed-slot KV cache,
implementing `dspark.runtime.interfaces.TargetLike` (prefill, ragged verify, slot management).
Plain decoding is the engine loop with no drafter (`SpecEngine(target).generate`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dspark.runtime import cpu_attention
from dspark.runtime.attention import build_attn_meta
from dspark.runtime.batch import RaggedBatch
from dspark.runtime.config import ModelConfig
from dspark.runtime.kv_cache import KVCache
from dspark.runtime.loader import load_model, round_params_
from dspark.runtime.model import Transformer
from dspark.runtime.text import load_tokenizer

PREFILL_PADDED_TOKENS = 4096  # prefill batches requests while R * longest prompt stays under this
# Full O(N) batch checks in verify (seq_idx vs cu_seqlens, contiguous positions, token range):
# off in serving (they cost a pass over the batch, and a device sync when tokens live on a GPU),
# on in the tests (tests/conftest.py sets DSPARK_DEBUG_CHECKS=1). The O(R) slot checks that keep
# the KV cache consistent always run.
DEBUG_CHECKS = os.environ.get("DSPARK_DEBUG_CHECKS", "") not in ("", "0")


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
                 dtype: torch.dtype = torch.float32, compile: bool = False,
                 weights_dtype: torch.dtype | None = None) -> None:
        """`weights_dtype` (e.g. bf16 with an fp32 `dtype`): every weight rounded to it, activations
        and the KV cache in `dtype` (`dspark.wiring.torch_dtypes`: bf16 on an AVX2-only CPU, where
        the rows kernel streams such weights as bf16).
        compile=True: the cached forward goes through torch.compile (dynamic shapes, weights
        frozen and packed by inductor). Measured ~10-20 % faster steps on this CPU, after a
        compile of several minutes on 2 cores per shape family (decode, masked decode, blocks);
        off by default for that reason (`dspark bench-target --compile` measures it)."""
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.weights_dtype = weights_dtype or dtype
        if self.weights_dtype != dtype:
            round_params_(self.model, self.weights_dtype)
        # weights (fused, prepacked) and RoPE tables laid out once
        self.model.fuse_for_inference(max_positions=max_seq_len, prepack=not compile)
        self._forward_ragged = self.model.forward_ragged
        if compile:
            import torch._inductor.config as inductor_config

            # process-wide (an options={"freezing": True} argument is not applied, checked on the
            # generated code): inductor folds the weights as constants and prepacks them for oneDNN
            inductor_config.freezing = True
            self._forward_ragged = torch.compile(self.model.forward_ragged, dynamic=True)
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
        # decodes and verifies through our C attention where it runs (bf16 on an AVX512-BF16 CPU)
        self.cpu_attention = cpu_attention.enabled(self.device, dtype, config.num_attention_heads,
                                                   config.num_key_value_heads, config.head_dim)

    @classmethod
    def from_pretrained(cls, path: str | Path, capacity: int = 8, max_seq_len: int = 1024,
                        device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        num_taps: int = 3, quant: str | None = None, compile: bool = False,
                        weights_dtype: torch.dtype | None = None) -> TargetEngine:
        """Load an HF folder. quant="q4_1": the linear layers keep the folder's GGUF Q4_1 blocks
        and run torch's int4 matmul (`dspark.runtime.quant`; activations in bf16)."""
        # before the weights: a broken folder fails fast; weights-only folders serve token ids
        tokenizer = load_tokenizer(path, optional=True)
        if quant is None:
            model, cfg = load_model(path, device=device, dtype=dtype, num_taps=num_taps)
        elif quant == "q4_1":
            from dspark.runtime.quant import load_q4_1_model

            if dtype != torch.bfloat16:
                raise ValueError(f"quant q4_1 runs with bf16 activations, got dtype {dtype}")
            model, cfg = load_q4_1_model(path, num_taps=num_taps)
        else:
            raise ValueError(f"unknown quant {quant!r} (None or 'q4_1')")
        return cls(model, cfg, tokenizer, capacity, max_seq_len, device, dtype, compile, weights_dtype)

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
            if not 0 <= min(prompt) <= max(prompt) < self.vocab_size:
                raise ValueError(f"prefill: prompt for slot {slot} has token ids outside "
                                 f"[0, {self.vocab_size})")
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
        if batch.num_requests == 0:
            return (torch.empty(0, self.vocab_size, device=self.device, dtype=self.dtype),
                    torch.empty(0, self.tap_dim, device=self.device, dtype=self.dtype))
        if DEBUG_CHECKS:
            self._validate_full(batch)
        return self._forward(batch)

    def _check_slots(self, slots: list[int], starts: list[int], lens: list[int]) -> None:
        """O(R) host checks that keep the cache consistent: allocated, distinct slots, new tokens
        starting at each slot's cached length and fitting max_seq_len."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"RaggedBatch.slots has duplicates: {slots}")
        lengths, in_use = self.cache.lengths, self.cache.in_use
        for slot, start, n in zip(slots, starts, lens):
            if not (0 <= slot < len(in_use) and in_use[slot] and lengths[slot] == start
                    and start + n <= self.max_seq_len):
                self.cache.check_append(slot, start, n)  # raises the precise error

    def _validate_full(self, batch: RaggedBatch) -> None:
        """Every field against every other (DEBUG_CHECKS): costs a pass over the batch."""
        batch.validate()
        cu = batch.cu_seqlens.cpu()
        lens = cu[1:] - cu[:-1]
        if not torch.equal(batch.seq_idx.cpu(), torch.repeat_interleave(torch.arange(len(lens)), lens)):
            raise ValueError("RaggedBatch.seq_idx does not match cu_seqlens")
        slots = batch.slots.tolist()
        self._check_slots(slots, batch.positions.cpu()[cu[:-1]].tolist(), lens.tolist())
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
        """Run the cached forward and advance each slot's length. `batch.tokens` may already be
        on the device; the other fields are host tensors (read here without a device sync)."""
        cu = batch.cu_seqlens.tolist()
        lens = [b - a for a, b in zip(cu, cu[1:])]
        slots = batch.slots.tolist()
        starts = batch.positions[batch.cu_seqlens[:-1]].tolist()
        self._check_slots(slots, starts, lens)
        meta = build_attn_meta(batch.seq_idx, batch.positions, batch.cu_seqlens, batch.slots, self.n_groups,
                               self.device, cpu_kernel=self.cpu_attention)
        tokens = batch.tokens.to(self.device, non_blocking=True)
        logits, taps, _ = self._forward_ragged(
            tokens, meta, self.cache.k, self.cache.v,
            None if logits_rows is None else logits_rows.to(self.device, non_blocking=True))
        for slot, start, n in zip(slots, starts, lens):
            self.cache.lengths[slot] = start + n
        return logits, taps
