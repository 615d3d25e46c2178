"""The DSpark drafter (docs/architecture.md §5): a DFlash-style parallel backbone on projected target taps,
a sequential head (Markov / RNN / none) sampled left to right, and a confidence head.

Context (per slot): H_ctx = RMSNorm(W_c [taps]) of every token in the target's KV cache;
each backbone layer keeps the K/V of H_ctx (its own k/v projections), extended with the taps
of every accepted token. Block: inputs [emb(x0), m, …, m] (m = learned mask embedding) at
positions L, …, L+G−1 (L = context length, G = trained block size); queries from the block,
keys/values [ctx ; block], non-causal inside the block. Output h_k at block index k−1
predicts the token at anchor+k; U_k = lm_head(norm(h_k)).

γ at propose time: the backbone always runs the trained block of G inputs (so h_k is
exactly what training saw) and the first γ ≤ G outputs are sampled; one drafter trained
with G = 15 serves γ = 7 and γ = 15.

Embedding and LM head are the target's, frozen and shared (never stored with the drafter)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import Field, asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Self, cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.runtime.drafter.context import SlotDrafter, SlotKV, segments
from dspark.runtime.drafter.heads import ConfidenceHead, make_head
from dspark.runtime.interfaces import DraftBlock
from dspark.runtime.linear import Dense, PackedLinear, serving_linear
from dspark.runtime.model import RMSNorm, apply_rope, rope_cos_sin
from dspark.runtime.sampling import SamplingBatch, SamplingParams


class JsonConfig:
    """config.json round trip for drafter config dataclasses; unknown keys are ignored."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # set by @dataclass on each subclass

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Self:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class DSparkConfig(JsonConfig):
    vocab_size: int
    hidden_size: int  # = the target's (shared embedding / LM head)
    tap_dim: int  # n_taps * target hidden
    num_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    block_size: int = 15  # G: trained block, the largest γ
    gamma: int = 7  # default γ at propose time
    head: str = "markov"  # markov | rnn | none
    head_rank: int = 64
    tap_layers: list[int] | None = None  # the target layers the taps come from (checked at load)
    kind: str = "dspark"
    # "taps": context = the target's taps; "own": the drafter's own causal encoder over token
    # embeddings (own_context.py; for targets without hidden states; tap_dim = hidden_size)
    context: str = "taps"
    context_layers: int = 1
    context_intermediate_size: int | None = None  # MLP width of the own encoder (None: intermediate_size)
    # taps scaled per channel by fixed data statistics (buffer tap_scale) before W_c: SmolLM2's
    # residual stream has a few channels 30-100x larger than the rest (massive activations)
    tap_norm: bool = False


def rope_inv_freq_plain(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def apply_module(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return linear(x)


class DraftLayer(nn.Module):
    """Pre-norm decoder layer whose attention also reads externally supplied context K/V."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           proj=apply_module) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> k, v [B, T, Hkv, hd] (k normed and rotated). Used for ctx and block alike.
        proj(linear, x): how to apply a projection (default: the module itself)."""
        b, t, _ = x.shape
        k = self.k_norm(proj(self.k_proj, x).view(b, t, self.n_kv, self.head_dim))
        return apply_rope(k, cos, sin), proj(self.v_proj, x).view(b, t, self.n_kv, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, Q, d] block stream; ctx_k/v [B, C, Hkv, hd]; mask [B, Q, C+Q] bool (True = attend)."""
        b, q_len, _ = x.shape
        h = self.input_norm(x)
        q = apply_rope(self.q_norm(self.q_proj(h).view(b, q_len, self.n_heads, self.head_dim)), cos, sin)
        k, v = self.kv(h, cos, sin)
        k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)
        v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                             enable_gqa=self.n_heads != self.n_kv)
        x = x + self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DSparkModel(nn.Module):
    """Trainable parameters of the drafter. The target's embedding / LM-head weights are
    attached with `attach_shared` as plain tensors (not parameters: frozen, not saved)."""

    inv_freq: torch.Tensor  # buffers, registered in __init__
    tap_scale: torch.Tensor | None  # None unless cfg.tap_norm

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        if not 1 <= cfg.gamma <= cfg.block_size:
            raise ValueError(f"gamma {cfg.gamma} must be in [1, block_size={cfg.block_size}]")
        self.config = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(cfg.tap_dim, d, bias=False)  # W_c
        self.ctx_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.register_buffer("tap_scale", torch.ones(cfg.tap_dim) if cfg.tap_norm else None)
        self.ctx_encoder = None
        if cfg.context == "own":
            from dspark.runtime.drafter.own_context import OwnContextEncoder

            self.ctx_encoder = OwnContextEncoder(cfg, DraftLayer)
        elif cfg.context != "taps":
            raise ValueError(f"DSparkConfig.context: unknown {cfg.context!r} (taps | own)")
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = make_head(cfg.head, cfg.vocab_size, d, cfg.head_rank)
        self.conf = ConfidenceHead(d, cfg.head_rank)
        self.register_buffer("inv_freq", rope_inv_freq_plain(cfg.head_dim, cfg.rope_theta), persistent=False)
        for m in [self.fc, *self.layers]:
            for p in m.modules():
                if isinstance(p, nn.Linear):
                    nn.init.normal_(p.weight, std=0.02)
        self.embed_weight: torch.Tensor | None = None
        self.lm_head_weight: torch.Tensor | None = None

    def attach_shared(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        self.embed_weight, self.lm_head_weight = embed_weight.detach(), lm_head_weight.detach()

    def init_from_target(self, embed_weight: torch.Tensor, norm_weight: torch.Tensor,
                         mask_token_id: int | None = None) -> None:
        """Start the mask embedding at the target's <|mask|> row (or the mean row) and the final
        norm at the target's final norm, so U_k starts in the target's logit scale."""
        with torch.no_grad():
            row = embed_weight[mask_token_id] if mask_token_id is not None else embed_weight.mean(0)
            self.mask_embedding.copy_(row.float())
            self.norm.weight.copy_(norm_weight.float())

    @property
    def draft_layers(self) -> Sequence[DraftLayer]:
        """`layers` with its item type (to mypy, nn.ModuleList holds plain nn.Module)."""
        return cast("Sequence[DraftLayer]", self.layers)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.embed_weight is not None, "attach_shared() first"
        return F.embedding(tokens, self.embed_weight).to(self.fc.weight.dtype)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """U = lm_head(norm(h)) with the target's LM-head weight."""
        assert self.lm_head_weight is not None, "attach_shared() first"
        return F.linear(self.norm(h), self.lm_head_weight.to(h.dtype))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """taps [B, L, tap_dim] at positions [B, L] -> per layer (k, v) [B, L, Hkv, hd]."""
        h_ctx = self.ctx_norm(self.fc(taps.to(self.fc.weight.dtype)))
        cos, sin = self.rope(positions, h_ctx.dtype)
        return [layer.kv(h_ctx, cos, sin) for layer in self.draft_layers]

    def backbone(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv, mask: torch.Tensor) -> torch.Tensor:
        """Block stream x [B, Q, d] at positions [B, Q]; mask [B, Q, C+Q] -> h [B, Q, d]."""
        cos, sin = self.rope(positions, x.dtype)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, ck, cv, mask)
        return x

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [...] -> [..., G, d]: emb(x0) then the mask embedding G−1 times."""
        g = self.config.block_size
        first = self.embed(anchors)[..., None, :]
        rest = self.mask_embedding.expand(*anchors.shape, g - 1, -1)
        return torch.cat([first, rest.to(first.dtype)], dim=-2)

    def scale_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """taps in the drafter's dtype, times the per-channel tap_scale when the config has tap_norm."""
        x = taps.to(self.fc.weight.dtype)
        return x if self.tap_scale is None else x * self.tap_scale.to(x.dtype)

    def context_features(self, tokens: torch.Tensor, taps: torch.Tensor | None,
                         positions: torch.Tensor) -> torch.Tensor:
        """The rows the context is built from: the taps, or (context "own") the own encoder's
        causal features of the tokens [B, T] at positions [B, T] (training / full pass)."""
        if self.ctx_encoder is None:
            if taps is None:
                raise ValueError("context_features: context 'taps' needs the target taps, got None")
            return self.scale_taps(taps)
        x = self.embed(tokens)
        return self.ctx_encoder(x, *self.rope(positions, x.dtype))

    def train_hidden(self, tokens: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Many blocks per sequence in one pass (training). tokens [B, T], taps [B, T, tap_dim]
        (taps of token t at row t), anchors [B, nb] positions a (the block's context is the taps
        of tokens 0..a−1) -> h [B, nb, G, d]. Equals running each block alone at inference."""
        b, t = tokens.shape
        nb, g = anchors.shape[1], self.config.block_size
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        ctx_kv = self.context_kv(self.context_features(tokens, taps, positions), positions)
        x = self.block_inputs(tokens.gather(1, anchors)).reshape(b, nb * g, -1)
        offs = torch.arange(g, device=tokens.device)
        positions = (anchors[..., None] + offs).reshape(b, nb * g)
        q_anchor = anchors[..., None].expand(b, nb, g).reshape(b, nb * g)
        ctx_mask = torch.arange(t, device=tokens.device)[None, None, :] < q_anchor[..., None]
        block_id = torch.arange(nb, device=tokens.device).repeat_interleave(g)
        blk_mask = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
        h = self.backbone(x, positions, ctx_kv, torch.cat([ctx_mask, blk_mask], dim=-1))
        return h.view(b, nb, g, -1)

    def trainable_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


class DSparkDrafter(SlotDrafter):
    """`DrafterLike` runtime over a `DSparkModel`, device-first: the context K/V of every slot in a
    `SlotKV` on the target's device, the block's K/V written after it (scratch rows that the next
    `extend` overwrites), one batched LM head for the γ positions, then the sequential head left
    to right with nothing but tiny ops per position. No host sync in propose or extend."""

    kind = "dspark"

    def __init__(self, model: DSparkModel, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 gamma: int | None = None, sts_temperatures: list[float] | None = None,
                 sts_shifts: list[float] | None = None) -> None:
        super().__init__(model, embed_weight, lm_head_weight, gamma, sts_temperatures, sts_shifts)
        cfg = self.config
        self.dtype = self.model.fc.weight.dtype
        self.kv = SlotKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.device, self.dtype)
        self._packed: dict[nn.Module, PackedLinear | Dense] = {}
        self.set_vocab(None)

    def pack_for_inference(self) -> DSparkDrafter:
        """Serve the context and backbone projections (`_proj`), the draft LM head and the
        sequential head's W2 rows (`set_vocab`) from weights laid out once for the device
        (`serving_linear`: oneDNN-prepacked on the CPU, with bucketed row counts). On SmolLM2 the
        draft LM head alone was 38 % of a batch-1 propose with F.linear. The model's weights must
        not change afterwards (a loaded drafter; not one that is being trained)."""
        m = self.model
        linears = [m.fc] + [lin for layer in m.draft_layers for lin in (
            layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj, layer.gate_proj, layer.up_proj,
            layer.down_proj)]
        self._packed = {lin: serving_linear(lin.weight.detach(), lin.bias) for lin in linears}
        self.set_vocab(self.vocab)
        return self

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

    @torch.inference_mode()
    def extend(self, slots: list[int], tokens: torch.Tensor, taps: torch.Tensor, cu_seqlens: torch.Tensor,
               keep: torch.Tensor) -> None:
        cu = cu_seqlens.cpu()
        if taps.shape[0] != int(cu[-1]) or len(slots) + 1 != cu.numel():
            raise ValueError(f"extend: {len(slots)} slots, cu_seqlens {cu.tolist()}, "
                             f"but {taps.shape[0]} taps rows")
        self.kv.check(slots)
        if taps.shape[0] == 0:
            return
        m, dev = self.model, self.device
        seq, local = segments(cu)
        lens = (cu[1:] - cu[:-1]).tolist()
        self.kv.reserve(slots, [self.kv.bound[s] + n for s, n in zip(slots, lens)])
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        slot_rows = slot_t[seq.to(dev)]
        rows = self.kv.lengths[slot_rows] + local.to(dev)
        h_ctx = m.ctx_norm(self._proj(m.fc, self._context_rows(slots, tokens, taps, cu, keep)))[None]
        cos, sin = m.rope(rows[None], h_ctx.dtype)
        for i, layer in enumerate(m.draft_layers):
            k, v = layer.kv(h_ctx, cos, sin, self._proj)
            self.kv.write(i, slot_rows, rows, k[0], v[0])
        self.kv.advance(slot_t, keep)
        for s, n in zip(slots, lens):
            self.kv.bound[s] += n

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
    def _backbone(self, slots: list[int], anchors: torch.Tensor) -> torch.Tensor:
        """The trained block of G inputs per slot over its cached context -> h [R, γ, d]."""
        self.kv.check(slots)
        m, dev = self.model, self.device
        r, g = len(slots), self.block_size
        first = slots[0] if slots == list(range(slots[0], slots[0] + r)) else None
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        rows = max(self.kv.bound[s] for s in slots) + g
        self.kv.reserve(slots, [rows])
        lens = self.kv.lengths[slot_t]
        pos = lens[:, None] + torch.arange(g, device=dev)  # [R, G]
        # every block query sees its slot's context and the whole block (non-causal inside it)
        mask = (torch.arange(rows, device=dev)[None, :] < (lens + g)[:, None])[:, None, None, :]
        x = m.block_inputs(anchors)
        cos, sin = m.rope(pos, x.dtype)
        slot_rows = slot_t[:, None].expand(r, g)
        proj, last = self._proj, len(m.draft_layers) - 1
        for i, layer in enumerate(m.draft_layers):
            h = layer.input_norm(x)
            k, v = layer.kv(h, cos, sin, proj)
            self.kv.write(i, slot_rows, pos, k, v)
            keys, vals = self.kv.read(i, slot_t, first, rows)
            # the last layer's outputs are read at the γ drafted positions only: positions ≥ γ
            # enter it as keys and values, so its queries, o_proj and MLP run on γ rows, not G
            # (every row's output is unchanged: attention rows are independent)
            nq = self.gamma if i == last else g
            x, h = x[:, :nq], h[:, :nq]
            q = layer.q_norm(proj(layer.q_proj, h).view(r, nq, layer.n_heads, layer.head_dim))
            q = apply_rope(q, cos[:, :nq], sin[:, :nq])
            # GQA without copying K/V: the query heads sharing a kv head become rows of one query
            # block, [R, Hkv, (H/Hkv)·nq, hd] against the slot cache's [R, Hkv, rows, hd]
            grp = layer.n_heads // layer.n_kv
            qg = q.view(r, nq, layer.n_kv, grp, layer.head_dim).permute(0, 2, 3, 1, 4)
            qg = qg.reshape(r, layer.n_kv, grp * nq, layer.head_dim)
            out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask)
            out = out.view(r, layer.n_kv, grp, nq, layer.head_dim).permute(0, 3, 1, 2, 4)
            x = x + proj(layer.o_proj, out.reshape(r, nq, -1))
            h = layer.post_norm(x)
            x = x + proj(layer.down_proj, F.silu(proj(layer.gate_proj, h)) * proj(layer.up_proj, h))
        return x

    def _head(self, h: torch.Tensor, base: torch.Tensor, x0: torch.Tensor,
              choose) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequential head left to right: x_k = choose(k, U_k + B_k(x_{k−1})) -> tokens [R, γ];
        then the confidence logits of all positions at once (z_k reads h_k and x_{k−1})."""
        head = self.model.head
        tokens = torch.empty(h.shape[0], self.gamma, dtype=torch.int64, device=h.device)
        x_prev, state = x0, None
        for k in range(self.gamma):
            feats, state = head.step(x_prev, h[:, k], state)
            bias = None if feats is None or self._w2_head is None else self._w2_head(feats)
            logits = base[:, k] if bias is None else base[:, k] + bias
            tokens[:, k] = x_prev = choose(k, logits)
        prev = torch.cat([x0[:, None], tokens[:, :-1]], dim=1)
        return tokens, self.model.conf(h, head.token_features(prev)).float()

    @torch.inference_mode()
    def propose(self, slots: list[int], anchors: torch.Tensor, params: list[SamplingParams],
                uniforms: torch.Tensor) -> DraftBlock:
        anchors = anchors.to(self.device, torch.int64)
        h = self._backbone(slots, anchors)
        base = self._lm_head(self.model.norm(h))  # [R, γ, K]: the step's one big GEMM
        greedy = [p.greedy for p in params]
        if all(greedy):
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
        """Teacher-forced: the logits [R, γ, V] and confidence logits [R, γ] the drafter would
        use at each position if it had drafted `tokens` [R, γ] (tests, analysis)."""
        anchors, tokens = anchors.to(self.device, torch.int64), tokens.to(self.device, torch.int64)
        h = self._backbone(slots, anchors)
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


def save_dspark(model: DSparkModel, folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """config.json + model.safetensors (trainable weights only, stored as `dtype`; the shared
    embedding / LM head come from the target at load time). Leaves calibration.json alone."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


CALIBRATION_FILE = "calibration.json"  # written by `dspark calibrate`


def read_calibration_file(folder: str | Path | None) -> dict:
    """A drafter folder's calibration.json ({} when the folder or the file is absent)."""
    path = None if folder is None else Path(folder) / CALIBRATION_FILE
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def read_calibration(folder: str | Path | None) -> list[float] | None:
    """STS temperatures written by `dspark calibrate` (calibration.json "sts_temperatures");
    None when the folder (or the file) is absent."""
    temps = read_calibration_file(folder).get("sts_temperatures")
    return None if temps is None else [float(t) for t in temps]


def read_sts_shifts(folder: str | Path | None) -> list[float] | None:
    """The affine STS logit shifts b_k (calibration.json "sts_shifts", written by `dspark calibrate
    --sts affine`); None for temperature-only calibration or no file."""
    shifts = read_calibration_file(folder).get("sts_shifts")
    return None if shifts is None else [float(b) for b in shifts]


DRAFT_VOCAB_FILE = "draft_vocab.json"  # written by `dspark draft-vocab`


def read_draft_vocab(folder: str | Path) -> torch.Tensor | None:
    """The draft vocabulary for a drafter folder: its own draft_vocab.json, else the one of the
    model's drafter root (its parent folder); None when neither exists (draft over all tokens)."""
    for path in (Path(folder) / DRAFT_VOCAB_FILE, Path(folder).parent / DRAFT_VOCAB_FILE):
        if path.is_file():
            return torch.tensor(json.loads(path.read_text())["ids"], dtype=torch.int64)
    return None


def shared_weights(target) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embedding [V, d], LM head [V, d], final norm [d]) of a TargetEngine or a Transformer."""
    model = getattr(target, "model", target)
    lm = model.embed_tokens.weight if model.lm_head_proj is None else model.lm_head_proj.weight
    return model.embed_tokens.weight, lm, model.norm.weight


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
    model.to(embed.device, embed.dtype)  # the target's dtype: its taps and LM head are used as they are
    drafter = DSparkDrafter(model, embed, lm_head, gamma=gamma, sts_temperatures=read_calibration(folder),
                            sts_shifts=read_sts_shifts(folder))
    drafter.set_vocab(read_draft_vocab(folder))
    return drafter.pack_for_inference()
