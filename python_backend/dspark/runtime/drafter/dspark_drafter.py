"""The DSpark drafter at serving time (docs/architecture.md §5): `DSparkDrafter` runs a
`dspark_model.DSparkModel` over per-slot context K/V on the target's device (propose, extend,
draft_probs); `load_dspark` builds one from a drafter folder and its target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from dspark.runtime import cpu_attention
from dspark.runtime.cpu_argmax import bigram_chain, row_argmax
from dspark.runtime.drafter.context import SlotDrafter, SlotKV, segments
from dspark.runtime.drafter.dspark_model import DraftLayer, DSparkConfig, DSparkModel, save_dspark
from dspark.runtime.drafter.files import (
    read_calibration,
    read_draft_vocab,
    read_sts_shifts,
    shared_weights,
    to_target_dtype,
)
from dspark.runtime.drafter.heads import MarkovHead
from dspark.runtime.interfaces import DraftBlock, block_width
from dspark.runtime.linear import Dense, Projection, serving_linear
from dspark.runtime.model import apply_rope, rope_cos_sin
from dspark.runtime.sampling import SamplingBatch, SamplingParams

# The greedy Markov head reads B(x) from a [K, K] bigram table over a draft vocabulary of up to
# this many tokens (32 MB in bf16 at 4 096): one row gather per position instead of an embedding
# lookup and a rank-r GEMM over K rows (`_greedy_bigram`).
BIGRAM_MAX_VOCAB = 4096


class DSparkDrafter(SlotDrafter):
    """`DrafterLike` runtime over a `DSparkModel`, device-first: the context K/V of every slot in a
    `SlotKV` on the target's device, the block's K/V written after it (scratch rows that the next
    `extend` overwrites), one batched LM head for the γ positions, then the sequential head left
    to right with nothing but tiny ops per position. No host sync in propose or extend."""

    kind = "dspark"
    # layer 0 norms and projects the block's R + 1 distinct rows, then expands them (`_backbone`);
    # False projects all R·G rows: the reference `dspark bench-drafter --all-block-rows` times
    project_distinct_rows = True

    def __init__(self, model: DSparkModel, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 gamma: int | None = None, sts_temperatures: list[float] | None = None,
                 sts_shifts: list[float] | None = None) -> None:
        super().__init__(model, embed_weight, lm_head_weight, gamma, sts_temperatures, sts_shifts)
        cfg = self.config
        self.dtype = self.model.fc.weight.dtype
        self._kv = SlotKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.device, self.dtype)
        # the block attends through our CPU attention kernel where it serves (`_backbone`); decided
        # once, as the target does
        self._cpu_attention = cpu_attention.enabled(self.device, self.dtype, cfg.num_heads, cfg.num_kv_heads,
                                                    cfg.head_dim)
        self._pending: list[tuple] = []  # (slots, tokens, taps, cu_seqlens, keep) of extends not yet run
        self._packed: dict[nn.Module, Projection] = {}
        # fused serving projections per layer: "qkv", "gate_up"
        self._fused: dict[tuple[int, str], Projection] = {}
        self._rope_cos = self._rope_sin = torch.empty(0)  # [positions, hd] tables (`_rope`)
        self.set_vocab(None)

    def pack_for_inference(self) -> DSparkDrafter:
        """Serve the context and backbone projections (`_proj`), the draft LM head and the
        sequential head's W2 rows (`set_vocab`) from weights laid out once for the device
        (`serving_linear`: oneDNN-prepacked on the CPU, with bucketed row counts). On SmolLM2 the
        draft LM head alone was 38 % of a batch-1 propose with F.linear. The model's weights must
        not change afterwards (a loaded drafter; not one that is being trained)."""
        m = self.model
        linears = [m.fc, m.conf.proj]  # the confidence head: torch's addmm started cold, ~0.2 ms
        # one GEMM where the layer runs several on the same rows (q, k, v; gate, up): fewer
        # calls, and on the CPU each one starts on weights the target's step left cold
        for i, layer in enumerate(m.draft_layers):
            linears += [layer.o_proj, layer.down_proj]
            for name, parts in (("qkv", (layer.q_proj, layer.k_proj, layer.v_proj)),
                                ("gate_up", (layer.gate_proj, layer.up_proj))):
                if all(p.bias is None for p in parts):
                    self._fused[(i, name)] = serving_linear(torch.cat([p.weight.detach() for p in parts]))
                else:
                    linears += parts
        self._packed = {lin: serving_linear(lin.weight.detach(), lin.bias) for lin in linears}
        self.set_vocab(self.vocab)
        return self

    def _split(self, i: int, name: str, x: torch.Tensor, parts: tuple[nn.Linear, ...]) -> list[torch.Tensor]:
        """[linear(x) for linear in parts], as one fused GEMM after `pack_for_inference`."""
        fused = self._fused.get((i, name))
        if fused is None:
            return [self._proj(p, x) for p in parts]
        return list(fused(x).split([p.weight.shape[0] for p in parts], dim=-1))

    def _qkv(self, i: int, layer: DraftLayer, x: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, d] -> q [B, T, H·hd] as projected, and `DraftLayer.kv`'s k, v (k normed and
        rotated), from one GEMM (context rows drop q: their weights are read anyway)."""
        q, k, v = self._split(i, "qkv", x, (layer.q_proj, layer.k_proj, layer.v_proj))
        return (q, *layer.kv_from(k, v, cos, sin))

    def _mlp(self, i: int, layer: DraftLayer, h: torch.Tensor) -> torch.Tensor:
        gate, up = self._split(i, "gate_up", h, (layer.gate_proj, layer.up_proj))
        return self._proj(layer.down_proj, F.silu(gate) * up)

    def _rope(self, positions: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at integer positions (device) all < bound (host), read from tables built with
        `rope_cos_sin` (the same values, two gathers instead of five ops per call)."""
        if bound > self._rope_cos.shape[0]:
            rows = max(2 * self._rope_cos.shape[0], bound, 1024)
            every = torch.arange(rows, device=self.device)
            self._rope_cos, self._rope_sin = rope_cos_sin(self.model.inv_freq, every, self.dtype)
        flat = positions.reshape(-1)  # index_select: a third of advanced indexing's time on a CPU
        return (self._rope_cos.index_select(0, flat).view(*positions.shape, -1),
                self._rope_sin.index_select(0, flat).view(*positions.shape, -1))

    def _proj(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """linear(x), from the packed weight after `pack_for_inference`."""
        packed = self._packed.get(linear)
        return linear(x) if packed is None else packed(x)

    def set_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft over a subset of the vocabulary (None: all of it). The LM head and the sequential
        head's W2 are read for these rows only (the LM head is the step's one big read); tokens
        outside get p_d = 0, which verification handles like any draft distribution (lossless).
        Rows are copied once here, never per step."""
        lm = self.model.lm_head_weight
        w2 = getattr(self.model.head, "W2", None)
        if ids is None:
            self.vocab = None
            self._lm, self._w2 = lm, None if w2 is None else w2.weight
        else:
            ids = torch.as_tensor(ids, dtype=torch.int64).unique().to(self.device)  # sorted, distinct
            if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
                raise ValueError(f"draft vocabulary ids must be in [0, {self.config.vocab_size})")
            self.vocab = ids
            self._lm = lm[ids].contiguous()
            self._w2 = None if w2 is None else w2.weight[ids].contiguous()
        linear = serving_linear if self._packed else Dense
        self._lm_head = linear(self._lm)  # [K, d]: the step's one big read
        self._w2_head = None if self._w2 is None else linear(self._w2)
        self._bigram = None  # [K, K]: B(x) = W1[x] W2ᵀ for every draft-vocabulary token x
        head = self.model.head
        if self.vocab is not None and isinstance(head, MarkovHead) and len(self.vocab) <= BIGRAM_MAX_VOCAB:
            w1 = head.W1.weight[self.vocab].float()
            self._bigram = (w1 @ head.W2.weight[self.vocab].float().T).to(self.dtype)

    def _token_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.vocab is None else self.vocab[idx]

    def _full(self, rows: torch.Tensor, fill: float) -> torch.Tensor:
        """[..., K] over the draft vocabulary -> [..., V] (`fill` outside it)."""
        if self.vocab is None or rows.shape[-1] == self.config.vocab_size:
            return rows
        out = rows.new_full((*rows.shape[:-1], self.config.vocab_size), fill)
        if rows.numel() == 0:
            return out
        out[..., self.vocab] = rows
        return out

    def draft_probs(self, slots: list[int], lengths: torch.Tensor) -> torch.Tensor:
        return self._full(self.probs.take(slots, lengths), 0.0)

    # --- per-slot context ---
    @property
    def kv(self) -> SlotKV:
        """The context K/V, with any pending extend applied (`extend`)."""
        self._flush()
        return self._kv

    def start(self, slot: int, prompt: list[int], taps: torch.Tensor) -> None:
        if taps.shape[0] != len(prompt):
            raise ValueError(f"start: {len(prompt)} prompt tokens but {taps.shape[0]} taps rows")
        self.kv.start(slot)
        self.probs.release(slot)
        getattr(self, "_enc_cache", {}).pop(slot, None)  # context "own": the encoder's K/V
        n = taps.shape[0]
        self.extend([slot], torch.tensor(prompt), taps, torch.tensor([0, n]), torch.tensor([n]))

    def release(self, slot: int) -> None:
        super().release(slot)
        self.kv.release(slot)
        getattr(self, "_enc_cache", {}).pop(slot, None)

    def extend(self, slots: list[int], tokens: torch.Tensor, taps: torch.Tensor, cu_seqlens: torch.Tensor,
               keep: torch.Tensor) -> None:
        """Checked now, run later: the rows join the context with the next call that reads it,
        in the next `propose` as part of the backbone's own projections (one GEMM per layer for
        the context rows and the block: on the CPU every call starts on weights the target's
        step left cold), else before anything else reads the K/V (`kv`, `_flush`). Extends of
        steps without a propose (a hybrid's lookup rows) wait for it too, up to MAX_PENDING."""
        cu = cu_seqlens.cpu()
        if taps.shape[0] != int(cu[-1]) or len(slots) + 1 != cu.numel():
            raise ValueError(f"extend: {len(slots)} slots, cu_seqlens {cu.tolist()}, "
                             f"but {taps.shape[0]} taps rows")
        self._kv.check(slots)
        if taps.shape[0]:
            self._pending.append((slots, tokens, taps, cu, keep))
            if len(self._pending) >= self.MAX_PENDING:
                self._flush()

    MAX_PENDING = 8  # extends held for the next propose (their taps stay alive until then)

    def flush(self) -> None:
        """Run the pending extends now, not in the next propose (the engine times a catch-up of
        deferred rows apart from the propose after it)."""
        self._flush()

    @torch.inference_mode()
    def _flush(self) -> None:
        """Run the pending extends on their own."""
        ctx = self._take_pending()
        if ctx is not None:
            h_ctx, cos, sin, writes = ctx
            for i, layer in enumerate(self.model.draft_layers):
                _, k, v = self._qkv(i, layer, h_ctx[None], cos[None], sin[None])
                self._write_context(i, k[0], v[0], writes)

    def _write_context(self, layer: int, k: torch.Tensor, v: torch.Tensor, writes: list) -> None:
        """The context rows' K/V into the cache, one extend after the other: a later extend's
        rows may land where an earlier one left scratch rows (its rejected drafts)."""
        for lo, hi, slot_rows, rows in writes:
            self._kv.write(layer, slot_rows, rows, k[lo:hi], v[lo:hi])

    def _take_pending(self) -> tuple | None:
        """The pending extends' host bookkeeping and context rows, in order: -> (h_ctx [N, d],
        cos, sin [N, hd], [(lo, hi, slot [n], row [n]) per extend]), the slots' lengths advanced
        past the kept rows; the caller writes each layer's K/V of h_ctx (`_write_context`).
        None when nothing is pending."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        m, dev, kv = self.model, self.device, self._kv
        feats, positions, writes, at, top = [], [], [], 0, 0
        for slots, tokens, taps, cu, keep in pending:
            seq, local = segments(cu)
            lens = (cu[1:] - cu[:-1]).tolist()
            bound = [kv.bound[s] + n for s, n in zip(slots, lens)]
            kv.reserve(slots, bound)
            slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
            slot_rows = slot_t[seq.to(dev)]
            rows = kv.lengths[slot_rows] + local.to(dev)
            feats.append(self._context_rows(slots, tokens, taps, cu, keep))
            positions.append(rows)
            writes.append((at, at + rows.numel(), slot_rows, rows))
            at, top = at + rows.numel(), max(top, *bound)
            kv.advance(slot_t, keep)
            for s, b in zip(slots, bound):
                kv.bound[s] = b
        one = len(pending) == 1
        h_ctx = m.ctx_norm(self._proj(m.fc, feats[0] if one else torch.cat(feats)))
        cos, sin = self._rope(positions[0] if one else torch.cat(positions), top)
        return h_ctx, cos, sin, writes

    def context_length(self, slot: int) -> int:
        return int(self.kv.lengths[slot])

    def _context_rows(self, slots: list[int], tokens: torch.Tensor, taps: torch.Tensor, cu: torch.Tensor,
                      keep: torch.Tensor) -> torch.Tensor:
        """[N, tap_dim] rows to project into the context: the taps, or (context "own") the own
        encoder's features of the tokens, encoded incrementally per slot (its K/V keeps the
        first keep[r] rows: the anchor and the accepted drafts)."""
        enc = self.model.ctx_encoder
        if enc is None:
            return self.model.scale_taps(taps.to(self.device))
        if not hasattr(self, "_enc_cache"):
            self._enc_cache: dict[int, list] = {}
        out, keep_l = [], keep.tolist()
        for r, slot in enumerate(slots):
            lo, hi = int(cu[r]), int(cu[r + 1])
            cache = self._enc_cache.get(slot) or enc.empty_cache(self.model.fc.weight)
            c = cache[0][0].shape[1] if cache else 0
            x = self.model.embed(tokens[lo:hi].to(self.device))[None]
            pos = torch.arange(c, c + hi - lo, device=self.device)[None]
            feats, cache = enc.extend(x, *self.model.rope(pos, x.dtype), cache)
            self._enc_cache[slot] = [(k[:, :c + keep_l[r]], v[:, :c + keep_l[r]]) for k, v in cache]
            out.append(feats[0])
        return torch.cat(out)

    # --- drafting ---
    def _backbone(self, slots: list[int], anchors: torch.Tensor, width: int) -> torch.Tensor:
        """The trained block of G inputs per slot over its cached context -> h [R, width, d] at
        the first `width` ≤ γ drafted positions. A pending extend's context rows go through each
        layer's projections with the block's."""
        kv = self._kv
        kv.check(slots)
        ctx = self._take_pending()  # lengths advanced: the block starts after the kept rows
        m, dev = self.model, self.device
        r, g = len(slots), self.block_size
        first = slots[0] if slots == list(range(slots[0], slots[0] + r)) else None
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        rows = max(kv.bound[s] for s in slots) + g
        kv.reserve(slots, [rows])
        lens = kv.lengths[slot_t]
        pos = lens[:, None] + torch.arange(g, device=dev)  # [R, G]
        # every block query sees its slot's context and the whole block (non-causal inside it):
        # rows 0..L+G−1, what our CPU attention kernel reads for a token at position L+G−1
        kernel = self._cpu_attention
        mask = None if kernel else (torch.arange(rows, device=dev)[None, :]
                                    < (lens + g)[:, None])[:, None, None, :]
        x = m.block_inputs(anchors)
        cos, sin = self._rope(pos, rows)
        n, cos_all, sin_all = 0, cos.reshape(1, r * g, -1), sin.reshape(1, r * g, -1)
        if ctx is not None:  # [context rows; block rows] flat, for the fused projections
            h_ctx, ctx_cos, ctx_sin, writes = ctx
            n = h_ctx.shape[0]
            cos_all = torch.cat([ctx_cos, cos_all[0]])[None]
            sin_all = torch.cat([ctx_sin, sin_all[0]])[None]
        slot_rows = slot_t[:, None].expand(r, g)
        proj, last = self._proj, len(m.draft_layers) - 1
        for i, layer in enumerate(m.draft_layers):
            # layer 0 sees emb(x0) and G−1 copies of the mask embedding: it norms and projects
            # the R + 1 distinct rows, then expands them (R·G rows as projected; the rows kernel
            # gives a row the same bits in any batch). At R 32, γ 7: 33 rows instead of 480.
            distinct = i == 0 and self.project_distinct_rows
            h = layer.input_norm(distinct_block_rows(x) if distinct else x.reshape(r * g, -1))
            rows_in = h if ctx is None else torch.cat([h_ctx, h])  # the context rows' q is dropped
            q, k, v = self._split(i, "qkv", rows_in, (layer.q_proj, layer.k_proj, layer.v_proj))
            if distinct:
                q, k, v = (torch.cat([t[:n], expand_block_rows(t[n:], r, g)]) for t in (q, k, v))
            k, v = layer.kv_from(k[None], v[None], cos_all, sin_all)
            if ctx is not None:  # before the block's rows: a rejected draft's scratch row may
                self._write_context(i, k[0, :n], v[0, :n], writes)  # sit where the block now starts
            q = q[n:].view(r, g, -1)
            k, v = (t[0, n:].view(r, g, *t.shape[2:]) for t in (k, v))
            kv.write(i, slot_rows, pos, k, v)
            # the last layer's outputs are read at the `width` drafted positions only: positions
            # ≥ width enter it as keys and values, so its queries, o_proj and MLP run on width
            # rows, not G (every row's output is unchanged: attention rows are independent; the
            # fused q projection runs on all G rows, which costs no extra read of its weights)
            nq = width if i == last else g
            x = x[:, :nq]
            q = layer.q_norm(q[:, :nq].reshape(r, nq, layer.n_heads, layer.head_dim))
            q = apply_rope(q, cos[:, :nq], sin[:, :nq])
            if kernel:
                out = cpu_attention.cached_attention(
                    q.reshape(r * nq, layer.n_heads, layer.head_dim), kv.k[i], kv.v[i],
                    slot_rows[:, :nq].reshape(-1), (lens + g - 1)[:, None].expand(r, nq).reshape(-1),
                    layer.head_dim ** -0.5)
            else:
                out = self._attend_sdpa(layer, q, *kv.read(i, slot_t, first, rows), mask)
            x = x + proj(layer.o_proj, out.reshape(r, nq, -1))
            x = x + self._mlp(i, layer, layer.post_norm(x))
        return x

    @staticmethod
    def _attend_sdpa(layer: DraftLayer, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
        """q [R, nq, H, hd] over the slots' K/V [R, Hkv, rows, hd] under mask -> [R, nq, H, hd].
        GQA without copying K/V: the query heads sharing a kv head become rows of one query
        block, [R, Hkv, (H/Hkv)·nq, hd]."""
        r, nq = q.shape[:2]
        grp = layer.n_heads // layer.n_kv
        qg = q.view(r, nq, layer.n_kv, grp, layer.head_dim).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(r, layer.n_kv, grp * nq, layer.head_dim)
        out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask)
        return out.view(r, layer.n_kv, grp, nq, layer.head_dim).permute(0, 3, 1, 2, 4)

    def _head(self, h: torch.Tensor, base: torch.Tensor, x0: torch.Tensor,
              choose) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequential head left to right: x_k = choose(k, U_k + B_k(x_{k−1})) -> tokens [R, w]
        (h [R, w, d]); then the confidence logits of all positions at once (z_k reads h_k and
        x_{k−1})."""
        head = self.model.head
        tokens = torch.empty(h.shape[0], h.shape[1], dtype=torch.int64, device=h.device)
        x_prev, state = x0, None
        for k in range(h.shape[1]):
            feats, state = head.step(x_prev, h[:, k], state)
            bias = None if feats is None or self._w2_head is None else self._w2_head(feats)
            logits = base[:, k] if bias is None else base[:, k] + bias
            tokens[:, k] = x_prev = choose(k, logits)
        return tokens, self._confidence(h, x0, tokens)

    def _confidence(self, h: torch.Tensor, x0: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Confidence logits [R, w] of a drafted block: z_k reads h_k and x_{k−1} (x_0 the anchor)."""
        prev = torch.cat([x0[:, None], tokens[:, :-1]], dim=1)
        return self.model.conf(h, self.model.head.token_features(prev), self._proj).float()

    def _greedy_bigram(self, h: torch.Tensor, base: torch.Tensor,
                       x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_head` for greedy rows with a Markov head over the draft vocabulary: from k = 1 on,
        x_{k−1} is a draft-vocabulary token, so B(x_{k−1}) is a row of `_bigram` (the anchor x0 may
        be any token: its bias is the rank-r product). Same logits up to the order of the r
        products in each sum; the loop stays in draft-vocabulary indices until the end, in one
        C call on a CPU (`cpu_argmax.bigram_chain`)."""
        first = row_argmax(base[:, 0] + self._w2_head(self.model.head.W1(x0)))  # type: ignore[misc]
        tokens = self._token_ids(bigram_chain(self._bigram, base, first))  # type: ignore[arg-type]
        return tokens, self._confidence(h, x0, tokens)

    @torch.inference_mode()
    def propose(self, slots: list[int], anchors: torch.Tensor, params: list[SamplingParams],
                uniforms: torch.Tensor) -> DraftBlock:
        """The first w = uniforms.shape[1] ≤ γ tokens of the block (the same tokens and
        confidences as the full block's first w: the last layer's queries are independent rows
        and the head runs left to right). A narrow block skips the unread positions' queries,
        MLP, LM head and head steps; the block's keys still span all G inputs."""
        anchors = anchors.to(self.device, torch.int64)
        h = self._backbone(slots, anchors, block_width(uniforms, self.gamma))
        base = self._lm_head(self.model.norm(h))  # [R, w, K]: the step's one big GEMM
        greedy = [p.greedy for p in params]
        if all(greedy):
            if self._bigram is not None:
                tokens, conf = self._greedy_bigram(h, base, anchors)
            else:
                tokens, conf = self._head(h, base, anchors,
                                          lambda k, logits: self._token_ids(logits.max(-1).indices))
            self.probs.put(slots, greedy, None)
            return DraftBlock(tokens, conf)
        sampling = SamplingBatch.from_params(params, self.device)
        uniforms = uniforms.to(self.device)
        kept: list[torch.Tensor] = []

        def choose(k: int, logits: torch.Tensor) -> torch.Tensor:
            tok, probs = sampling.draw(logits.float(), uniforms[:, k])
            assert probs is not None  # not all greedy: some rows were sampled
            kept.append(probs)
            return self._token_ids(tok)

        tokens, conf = self._head(h, base, anchors, choose)
        self.probs.put(slots, greedy, torch.stack(kept, dim=1))
        return DraftBlock(tokens, conf)

    @torch.inference_mode()
    def score(self, slots: list[int], anchors: torch.Tensor,
              tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: the logits [R, w, V] and confidence logits [R, w] the drafter would
        use at each position if it had drafted `tokens` [R, w ≤ γ] (tests, analysis)."""
        anchors, tokens = anchors.to(self.device, torch.int64), tokens.to(self.device, torch.int64)
        h = self._backbone(slots, anchors, tokens.shape[1])
        base = self._lm_head(self.model.norm(h))
        out: list[torch.Tensor] = []

        def forced(k: int, logits: torch.Tensor) -> torch.Tensor:
            out.append(self._full(logits.float(), float("-inf")))
            return tokens[:, k]

        _, conf = self._head(h, base, anchors, forced)
        return torch.stack(out, 1).cpu(), conf.cpu()

    # --- persistence ---
    def save(self, folder: str | Path) -> Path:
        return save_dspark(self.model, folder)


def distinct_block_rows(x: torch.Tensor) -> torch.Tensor:
    """The block inputs x [R, G, d] (`DSparkModel.block_inputs`: emb(x0) per request, then the
    mask embedding) -> their R + 1 distinct rows [R + 1, d]: the anchors, then one mask row
    (none when G = 1)."""
    return torch.cat([x[:, 0], x[:1, 1:2].reshape(-1, x.shape[-1])])


def expand_block_rows(rows: torch.Tensor, r: int, g: int) -> torch.Tensor:
    """`distinct_block_rows`' layout [R + 1, D] -> the block's [R·G, D]: each request's anchor
    row, then the mask row G−1 times."""
    d = rows.shape[-1]
    return torch.cat([rows[:r, None], rows[r:r + 1].expand(r, g - 1, d)], dim=1).reshape(r * g, d)


def load_dspark(folder: str | Path, target, gamma: int | None = None) -> DSparkDrafter:
    folder = Path(folder)
    cfg = DSparkConfig.from_json(json.loads((folder / "config.json").read_text()))
    embed, lm_head, _ = shared_weights(target)
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"drafter {folder} expects embedding {(cfg.vocab_size, cfg.hidden_size)}, "
                         f"target has {tuple(embed.shape)}")
    tap_layers = getattr(target, "tap_layers", None)
    if cfg.tap_layers is not None and tap_layers is not None and list(tap_layers) != list(cfg.tap_layers):
        raise ValueError(f"drafter {folder} was trained on taps {cfg.tap_layers}, target gives {tap_layers}")
    model = DSparkModel(cfg)
    model.load_state_dict({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()})
    to_target_dtype(model, target, embed)
    drafter = DSparkDrafter(model, embed, lm_head, gamma=gamma, sts_temperatures=read_calibration(folder),
                            sts_shifts=read_sts_shifts(folder))
    drafter.set_vocab(read_draft_vocab(folder))
    return drafter.pack_for_inference()
