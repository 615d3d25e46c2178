"""Drafters (docs/architecture.md §5), all implementing `dspark.runtime.interfaces.DrafterLike`."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.runtime.drafter.files import read_calibration, read_sts_shifts
from dspark.runtime.drafter.ngram import NGramDrafter


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
        from dspark.runtime.drafter.dspark_drafter import load_dspark
        return load_dspark(folder, target, gamma=gamma)
    if kind == "eagle":
        from dspark.runtime.drafter.eagle import load_eagle
        return load_eagle(folder, target, gamma=gamma)
    if kind == "draft_lm":
        from dspark.runtime.drafter.draft_lm import load_draft_lm
        return load_draft_lm(folder, target, gamma=7 if gamma is None else gamma)
    raise ValueError(f"{folder}/config.json: unknown drafter kind {kind!r} (dspark | eagle | draft_lm)")


def build_drafter(spec: str, target, gamma: int):
    """-> (drafter drafting γ tokens, or its trained block size if smaller; its folder or
    None). `spec`: "ngram[:N]", a folder name under build/demo/drafters, or a folder path."""
    from dspark.paths import DEMO_DRAFTERS

    folder = None
    if not spec.startswith("ngram"):
        folder = Path(spec) if Path(spec).is_dir() else DEMO_DRAFTERS / spec
        if not folder.is_dir():
            raise FileNotFoundError(f"no drafter folder {spec!r} (nor {folder})")
        spec = str(folder)
    try:
        return load_drafter(spec, target, gamma=gamma), folder
    except ValueError:  # trained block shorter than γ: its own largest γ
        config = json.loads((folder / "config.json").read_text()) if folder else {}
        size = int(config.get("block_size", config.get("gamma", gamma)))
        if folder is None or size >= gamma:
            raise
        return load_drafter(spec, target, gamma=size), folder


def pad_temperatures(temps: list[float] | None, gamma: int) -> list[float]:
    """STS temperatures for γ positions: stored ones, then 1 (uncalibrated) for the rest."""
    temps = list(temps or [])[:gamma]
    return temps + [1.0] * (gamma - len(temps))


__all__ = ["NGramDrafter", "build_drafter", "load_drafter", "load_drafter_folder", "pad_temperatures",
           "read_calibration", "read_sts_shifts"]
