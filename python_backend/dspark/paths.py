"""Where the shipped assets live, so the CLI, Triton models, benchmarks and tests agree."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "results"
DEMO = REPO_ROOT / "build" / "demo"
# The shipped demo target (a Hugging Face folder) and drafters, made by `make demo-assets`.
DEMO_TARGET = DEMO / "target"
DEMO_DRAFTERS = DEMO / "drafters"
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
# Downloaded and converted models (git-ignored): `dspark fetch-model`, run by `make setup`.
MODELS = Path(os.environ.get("DSPARK_MODELS", REPO_ROOT / "models"))
SMOLLM2 = MODELS / "smollm2-135m-instruct"
# Drafters trained for SmolLM2 (shipped in git; the shared embedding / LM head come from the target).
SMOLLM2_DRAFTERS = REPO_ROOT / "build" / "smollm2" / "drafters"


def relative(path: str | os.PathLike[str]) -> str:
    """`path` as result files record it: relative to the repository root (POSIX separators)
    when it lies inside the repository, else unchanged. Results never hold machine paths."""
    p = Path(path)
    for q in (Path(os.path.abspath(p)), p.resolve()):  # as given (normalised), then without symlinks
        if q.is_relative_to(REPO_ROOT):
            return q.relative_to(REPO_ROOT).as_posix()
    return str(path)
