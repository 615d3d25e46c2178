"""What a drafter folder holds besides its weights, and what a drafter borrows from its target:
config.json (`JsonConfig`), calibration.json (STS temperatures and shifts, written by `dspark
calibrate`), draft_vocab.json (written by `dspark draft-vocab`) and the target's shared
embedding / LM head / final norm (`shared_weights`, and `SharedHead`, the networks' use of
them). Read by every trained drafter kind.
"""

from __future__ import annotations

import json
from dataclasses import Field, asdict, fields
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F

from dspark.runtime.model import RMSNorm


class JsonConfig:
    """config.json round trip for drafter config dataclasses; unknown keys are ignored."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # set by @dataclass on each subclass

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Self:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


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


def to_target_dtype(model: torch.nn.Module, target, embed: torch.Tensor) -> torch.nn.Module:
    """A drafter network on its target's device and dtype (its taps and LM head are used as they
    are), its weights rounded as the target's are (`weights_dtype`: bf16 weights computed in fp32
    on an AVX2-only CPU, `dspark.wiring.torch_dtypes`)."""
    from dspark.runtime.loader import round_params_

    model.to(embed.device, embed.dtype)
    weights_dtype = getattr(target, "weights_dtype", None)
    return round_params_(model, weights_dtype) if weights_dtype not in (None, embed.dtype) else model


class SharedHead:
    """Mixin for a drafter network that reads the target's embedding and LM head (frozen, never
    stored with the drafter): `attach_shared` hands them over at load time, `lm_head` applies
    the target's LM head after the network's own final `norm`."""

    embed_weight: torch.Tensor | None = None
    lm_head_weight: torch.Tensor | None = None
    norm: RMSNorm  # the network's own final norm

    def attach_shared(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        self.embed_weight, self.lm_head_weight = embed_weight.detach(), lm_head_weight.detach()

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """U = lm_head(norm(h)) with the target's LM-head weight."""
        assert self.lm_head_weight is not None, "attach_shared() first"
        return F.linear(self.norm(h), self.lm_head_weight.to(h.dtype))
