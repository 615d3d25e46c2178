"""Drafters (DESIGN §5), all implementing `dspark.interfaces.DrafterLike`."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.drafter.ngram import NGramDrafter


def load_drafter(spec: str, target=None, gamma: int = 7):
    """A drafter from a spec: "ngram" or "ngram:N" (prompt lookup, N-token suffixes, default 3).
    Trained drafters (checkpoint folders) are added here by the drafter package."""
    name, _, arg = spec.partition(":")
    if name == "ngram":
        return NGramDrafter(gamma=gamma, n=int(arg) if arg else 3)
    if Path(spec).is_dir():
        return load_drafter_folder(spec, target, gamma)
    raise ValueError(f"unknown drafter {spec!r} (known: ngram[:N], or a drafter folder)")


def load_drafter_folder(folder: str | Path, target, gamma: int | None = None):
    """A trained drafter folder; config.json "kind": dspark | eagle | draft_lm (an HF config
    without "kind" is a draft LM). The target supplies the shared embedding / LM head."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    kind = cfg.get("kind", "draft_lm" if "model_type" in cfg else None)
    if kind == "dspark":
        from dspark.drafter.dspark_drafter import load_dspark
        return load_dspark(folder, target, gamma=gamma)
    if kind == "eagle":
        from dspark.drafter.eagle import load_eagle
        return load_eagle(folder, target, gamma=gamma)
    if kind == "draft_lm":
        from dspark.drafter.draft_lm import load_draft_lm
        return load_draft_lm(folder, target, gamma=7 if gamma is None else gamma)
    raise ValueError(f"{folder}/config.json: unknown drafter kind {kind!r} (dspark | eagle | draft_lm)")


__all__ = ["NGramDrafter", "load_drafter", "load_drafter_folder"]
