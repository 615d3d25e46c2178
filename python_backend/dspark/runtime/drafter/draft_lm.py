"""Classic draft-target baseline (docs/architecture.md §5): a standalone small LM (our Qwen3 implementation,
saved as a Hugging Face folder so transformers' `assistant_model` can load it too), wrapped
as a `DrafterLike` with its own KV cache (a `TargetEngine` over the draft checkpoint).

It ignores the target taps. Per request it keeps the token history; at propose it feeds the
tokens not yet in its cache plus the anchor, then γ−1 one-token steps, and rolls its cache
back to the accepted history afterwards (the drafts may be rejected).
Confidence (it has no trained head): z_k = logit of the draft's own top probability at T = 1,
which depends on x_{<k} only."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.runtime.batch import RaggedBatch
from dspark.runtime.config import ModelConfig
from dspark.runtime.drafter.context import DraftProbStore
from dspark.runtime.drafter.files import read_calibration, read_sts_shifts
from dspark.runtime.interfaces import DraftBlock, block_width
from dspark.runtime.loader import save_pretrained
from dspark.runtime.model import Transformer
from dspark.runtime.sampling import SamplingBatch, SamplingParams
from dspark.runtime.target import TargetEngine


def new_draft_lm(target_cfg: ModelConfig, num_layers: int = 2, intermediate_size: int | None = None,
                 embed_weight: torch.Tensor | None = None) -> tuple[Transformer, ModelConfig]:
    """A `num_layers` copy of the target's architecture (same vocab / width / heads), tied
    embeddings, optionally initialised from the target's embedding."""
    cfg = ModelConfig(**{**target_cfg.to_dict(), "num_hidden_layers": num_layers, "tie_word_embeddings": True,
                         "intermediate_size": intermediate_size or target_cfg.intermediate_size})
    model = Transformer(cfg, tap_layers=[num_layers - 1])
    if embed_weight is not None:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed_weight.float())
    return model, cfg


class DraftLMDrafter:
    kind = "draft_lm"

    def __init__(self, engine: TargetEngine, gamma: int = 7, max_gamma: int = 15,
                 sts_temperatures: list[float] | None = None, sts_shifts: list[float] | None = None) -> None:
        self.engine = engine
        self.max_gamma = max_gamma
        self._gamma = 0
        self.gamma = gamma
        self.sts_temperatures, self.sts_shifts = sts_temperatures, sts_shifts
        self.vocab_size = engine.vocab_size
        self._own: dict[int, int] = {}  # engine slot -> our KV slot
        self._known: dict[int, list[int]] = {}  # tokens of the request that are final
        self.probs = DraftProbStore()

    @property
    def gamma(self) -> int:
        return self._gamma

    @gamma.setter
    def gamma(self, value: int) -> None:
        if not 1 <= int(value) <= self.max_gamma:
            raise ValueError(f"gamma {value} must be in [1, {self.max_gamma}]")
        self._gamma = int(value)

    def start(self, slot: int, prompt: list[int], taps: torch.Tensor | None = None) -> None:
        if slot in self._own:
            self.release(slot)
        self._own[slot] = self.engine.allocate()
        self._known[slot] = list(prompt)
        self.probs.release(slot)

    def release(self, slot: int) -> None:
        own = self._own.pop(slot, None)
        self._known.pop(slot, None)
        self.probs.release(slot)
        if own is not None:
            self.engine.release(own)

    def extend(self, slots: list[int], tokens: torch.Tensor, taps: torch.Tensor | None,
               cu_seqlens: torch.Tensor, keep: torch.Tensor) -> None:
        flat = tokens.tolist()
        for slot, start, n in zip(slots, cu_seqlens[:-1].tolist(), keep.tolist(), strict=True):
            self._known[slot].extend(flat[start:start + n])

    def draft_probs(self, slots: list[int], lengths: torch.Tensor) -> torch.Tensor:
        return self.probs.take(slots, lengths)

    @torch.inference_mode()
    def propose(self, slots: list[int], anchors: torch.Tensor, params: list[SamplingParams],
                uniforms: torch.Tensor) -> DraftBlock:
        eng, r, gamma = self.engine, len(slots), block_width(uniforms, self.gamma)
        own = [self._own[s] for s in slots]
        starts = [eng.length(o) for o in own]
        feed = [self._known[s][st:] + [int(a)] for s, st, a in zip(slots, starts, anchors.tolist())]
        batch = RaggedBatch.from_requests(own, feed, starts)
        logits = eng.verify(batch)[0][batch.cu_seqlens[1:] - 1]
        sampling = SamplingBatch.from_params(params, logits.device)
        uniforms = uniforms.to(logits.device)
        tokens = torch.empty(r, gamma, dtype=torch.int64, device=logits.device)
        conf = torch.empty(r, gamma, device=logits.device)
        kept: list[torch.Tensor | None] = []
        for k in range(gamma):
            logits = logits.float()
            top = torch.softmax(logits, -1).max(-1).values.clamp(1e-6, 1 - 1e-6)
            conf[:, k] = torch.log(top) - torch.log1p(-top)
            tokens[:, k], probs = sampling.draw(logits, uniforms[:, k])
            kept.append(probs)
            if k + 1 < gamma:
                pos = [eng.length(o) for o in own]
                step = RaggedBatch(tokens[:, k].clone(), torch.arange(r), torch.tensor(pos),
                                   torch.arange(r + 1), torch.tensor(own))
                logits = eng.verify(step)[0]
        for s, o in zip(slots, own):
            eng.rollback(o, len(self._known[s]))  # drop the anchor and the drafts: not final yet
        sampled = [q for q in kept if q is not None]
        self.probs.put(slots, [p.greedy for p in params], torch.stack(sampled, 1) if sampled else None)
        return DraftBlock(tokens, conf)


def save_draft_lm(model: Transformer, cfg: ModelConfig, folder: str | Path, tokenizer_path: str | Path | None,
                  dtype: torch.dtype = torch.float32, max_gamma: int = 15) -> Path:
    """An HF folder (our loader and transformers both read it) marked as a draft LM drafter."""
    save_pretrained(model, cfg, folder, tokenizer_path=tokenizer_path, dtype=dtype)
    path = Path(folder) / "config.json"
    hf = json.loads(path.read_text())
    hf.update({"kind": "draft_lm", "dspark_max_gamma": int(max_gamma)})
    path.write_text(json.dumps(hf, indent=2) + "\n")
    return Path(folder)


def load_draft_lm(folder: str | Path, target, gamma: int = 7) -> DraftLMDrafter:
    """The draft LM of `folder` with as many KV slots as the target and room for γ extra tokens."""
    capacity = getattr(getattr(target, "cache", None), "capacity", 8)
    max_seq = getattr(target, "max_seq_len", 1024) + 17
    device = getattr(target, "device", "cpu")
    engine = TargetEngine.from_pretrained(folder, capacity=capacity, max_seq_len=max_seq, device=device,
                                          num_taps=1)
    if target is not None and engine.vocab_size != target.vocab_size:
        raise ValueError(f"draft LM vocab {engine.vocab_size} != target vocab {target.vocab_size}")
    extra = json.loads((Path(folder) / "config.json").read_text()).get("dspark_max_gamma", 15)
    return DraftLMDrafter(engine, gamma=gamma, max_gamma=int(extra),
                          sts_temperatures=read_calibration(folder), sts_shifts=read_sts_shifts(folder))
