"""The SmolLM2 prompt corpus (`dspark corpus`): chat rendering, sources, dedup, the split by
source document, and the shipped held-out prompt files."""

from __future__ import annotations

import json

import pytest

from dspark.tools import corpus
from dspark.tools.prompts import SMOLLM2_PROMPT_DIR, heldout_prompts


def test_render_chat_is_the_models_template(smollm2_folder):
    from dspark.runtime.chat import ChatTemplate

    template = ChatTemplate.from_folder(smollm2_folder)
    for user in ("Hi", "Complete:\n\n```python\ndef f(x):\n    pass\n```", "ünïcode ✓"):
        assert corpus.render_chat(user) == template.render([{"role": "user", "content": user}])


def test_split_is_by_source_document_and_deterministic():
    rows = [corpus._row("code", "k", f"src/{i // 3}", f"task {i}") for i in range(600)]
    splits = corpus.assemble(rows)
    sources = {s: {r["source"] for r in rs} for s, rs in splits.items()}
    assert not (sources["train"] & sources["eval"]) and not (sources["train"] & sources["calibration"])
    assert not (sources["eval"] & sources["calibration"])
    assert all(len(rs) > 0 for rs in splits.values())
    assert corpus.assemble(rows) == splits  # same input, same split and ids
    for s, rs in splits.items():
        assert all(corpus.split_of(r["source"]) == s for r in rs)


def test_dedupe_normalises_whitespace_and_case():
    rows = [corpus._row("chat", "k", "a", "What is  Python?"),
            corpus._row("chat", "k", "b", "what is python?"), corpus._row("chat", "k", "c", "What is Rust?")]
    assert [r["source"] for r in corpus.dedupe(rows)] == ["a", "c"]


def test_sources_give_each_domain_prompts():
    he = corpus.humaneval_rows()
    assert len(he) == 164 and he[0]["source"] == "humaneval/HumanEval/0" and "```python" in he[0]["user"]
    code = corpus.stdlib_rows(per_module=2)
    kinds = {r["kind"] for r in code}
    assert kinds == {f"stdlib_{t}" for t in corpus.CODE_TASKS} and all(r["domain"] == "code" for r in code)
    assert all(r["source"].startswith("stdlib/") and r["source"].endswith(".py") for r in code)
    math = corpus.math_rows(40, seed=3)
    assert len(math) == 40 and all("Answer:" not in r["user"] and "####" not in r["user"] for r in math)
    assert corpus.math_rows(40, seed=3) == math


def test_type_hint_task_strips_annotations():
    code = "def f(a: int, *args: str, b: float = 1.0, **kw: dict) -> bool:\n    return True\n"
    text = corpus.code_task("type_hints", "m", "f", code)
    assert "def f(a, *args, b=1.0, **kw):" in text and "-> bool" not in text


def test_rst_sections_and_cleanup():
    page = "Title\n=====\n\nIntro :func:`len` text.\n\n.. note::\n\nSub\n---\n\nBody of :class:`~a.B`.\n"
    secs = corpus.rst_sections(page)
    assert [t for t, _ in secs] == ["Title", "Sub"]
    assert corpus._clean_rst(secs[0][1]) == "Intro `len` text."
    assert corpus._clean_rst(secs[1][1]) == "Body of `a.B`."


@pytest.mark.parametrize("split", ["eval", "calibration"])
def test_shipped_heldout_prompt_files(split):
    path = SMOLLM2_PROMPT_DIR / f"{split}.jsonl"
    rows = [json.loads(line) for line in path.open()]
    manifest = json.loads(corpus.MANIFEST.read_text())
    assert manifest["source_overlap"] == {"train&calibration": 0, "train&eval": 0, "calibration&eval": 0}
    for domain in corpus.DOMAINS:
        texts = heldout_prompts("smollm2", split, domain)
        assert len(texts) >= 32
        assert all(t.startswith("<|im_start|>system\n") for t in texts)
        assert all(t.endswith("<|im_start|>assistant\n") for t in texts)
    assert all(corpus.split_of(r["source"]) == split for r in rows)
    with pytest.raises(ValueError, match="domain"):
        heldout_prompts("smollm2", split, "prose")
