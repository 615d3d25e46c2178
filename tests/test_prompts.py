"""Eval prompt sets (dspark.tools.prompts): the shipped files, HumanEval, and the JSONL reader."""

from __future__ import annotations

import json

import pytest

from dspark.tools.prompts import PROMPT_DIR, load_prompt_set, load_prompts_jsonl


def test_code_prompts_are_humaneval_in_task_order():
    prompts = load_prompt_set("code")
    assert len(prompts) == 164
    assert "def has_close_elements(" in prompts[0]  # HumanEval/0
    assert "def separate_paren_groups(" in prompts[1]  # HumanEval/1
    assert load_prompt_set("code", 3) == prompts[:3]


@pytest.mark.parametrize("domain", ["math", "prose"])
def test_shipped_prompt_files(domain):
    assert (PROMPT_DIR / f"{domain}.jsonl").stat().st_size < 300_000
    prompts = load_prompt_set(domain)
    assert len(prompts) == 80
    assert len(set(prompts)) == len(prompts)
    assert all(50 <= len(p) <= 1000 for p in prompts)
    assert load_prompt_set(domain, 5) == prompts[:5]
    assert load_prompt_set(domain, 0) == []


def test_math_prompts_end_where_the_solution_starts():
    for p in load_prompt_set("math", 20):
        assert p.startswith("Question: ") and p.endswith("\nAnswer:")


def test_prompts_come_from_heldout_documents():
    """No shipped math/prose prompt occurs in the corpus train split (when the corpus is built)."""
    from dspark.paths import DEMO

    corpus = DEMO / "work" / "corpus"
    if not (corpus / "prose.train.jsonl").is_file():
        pytest.skip("demo corpus not built (run `python build/demo/corpus.py`)")
    for domain in ("math", "prose"):
        train_text = "\n".join(json.loads(line)["text"] for line in (corpus / f"{domain}.train.jsonl").open())
        leaked = [p for p in load_prompt_set(domain, 30) if p in train_text]
        # math templates can repeat a question by chance; prose prefixes must never repeat
        assert len(leaked) <= (2 if domain == "math" else 0), leaked[:2]


def test_unknown_domain_and_negative_n():
    with pytest.raises(ValueError, match="unknown prompt domain"):
        load_prompt_set("chat")
    with pytest.raises(ValueError, match="n must be >= 0"):
        load_prompt_set("math", -1)


def test_jsonl_accepts_turns_and_prompt_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": ["first turn", "second"]}\n\n{"prompt": "plain prompt"}\n')
    assert load_prompts_jsonl(path) == ["first turn", "plain prompt"]


@pytest.mark.parametrize("bad", ['{"prompt": 3}', '{"turns": []}', '{"text": "x"}', "[1, 2]", "{not json"])
def test_jsonl_bad_line_names_its_number(tmp_path, bad):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + bad + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2:"):
        load_prompts_jsonl(path)
