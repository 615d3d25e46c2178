"""Incremental detokenization never splits a UTF-8 character; stop strings cut the stream
at the earliest match even when they arrive split across deltas (dspark.runtime.text)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dspark.runtime.text import (
    IncrementalDetokenizer,
    StopStringMatcher,
    TextStream,
    decode,
    encode,
    find_stop,
    load_tokenizer,
    partial_stop_len,
)

SAMPLE = "héllo wörld 中文字符 and emoji 🙂👍 ok. naïve café — done"


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: every UTF-8 byte is its own token (worst case)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def trained_tokenizer() -> Tokenizer:
    """Small byte-level BPE with some merges, so tokens mix whole words and byte pieces."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator([SAMPLE, "hello world and more words"] * 4, trainer=trainer)
    return tok


@pytest.mark.parametrize("make", [byte_tokenizer, trained_tokenizer])
def test_deltas_are_whole_characters_and_concatenate_to_full_decode(make):
    tok = make()
    ids = encode(tok, SAMPLE)
    assert len(ids) > len(SAMPLE) // 3  # multi-byte characters really are split over tokens
    rng = random.Random(0)
    for _ in range(5):
        detok = IncrementalDetokenizer(tok, prompt_ids=encode(tok, "prompt "))
        deltas, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 3)  # token groups, like a speculative step emits
            deltas.append(detok.push(ids[i : i + n]))
            i += n
        deltas.append(detok.finish())
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == SAMPLE == detok.text


def test_byte_tokens_hold_back_until_character_complete():
    tok = byte_tokenizer()
    ids = encode(tok, "a中")  # 'a' + three bytes
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([t]) for t in ids] == ["a", "", "", "中"]


def test_finish_flushes_incomplete_tail_as_replacement_char():
    tok = byte_tokenizer()
    ids = encode(tok, "x🙂")[:3]  # 'x' + the first two of four bytes
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids) == "x"
    assert detok.finish() == "\ufffd"


def test_special_tokens_are_skipped():
    tok = trained_tokenizer()
    eos = tok.token_to_id("<eos>")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(encode(tok, "hello") + [eos]) == "hello"
    assert detok.finish() == ""
    assert decode(tok, encode(tok, "hello") + [eos]) == "hello"


def test_find_stop_and_partial_match():
    assert find_stop("abc STOP def END", ["END", "STOP"]) == 4
    assert find_stop("abc", ["x", ""]) == -1
    assert partial_stop_len("hello ST", ["STOP"]) == 2
    assert partial_stop_len("hello S", ["STOP", "SX"]) == 1
    assert partial_stop_len("hello", ["STOP"]) == 0
    assert partial_stop_len("aab", ["abx"]) == 2


def test_stop_string_split_across_deltas():
    m = StopStringMatcher(["</end>", "\n\n"])
    out = [m.push(d) for d in ["The ans", "wer </", "e", "nd> tail", " more"]]
    assert out == ["The ans", "wer ", "", "", ""]
    assert m.stopped and m.finish() == ""


def test_held_back_tail_is_released_when_it_does_not_match():
    m = StopStringMatcher(["STOP"])
    assert m.push("go ST") == "go "
    assert m.push("ART") == "START"
    assert m.push(" STO") == " "
    assert not m.stopped
    assert m.finish() == "STO"


def test_text_stream_with_stop_inside_multibyte_stream():
    tok = byte_tokenizer()
    text = "数学 answer: 42 ### ignored 中"
    stream = TextStream(tok, stops=["###"])
    deltas = [stream.push([t]) for t in encode(tok, text)]
    deltas.append(stream.finish())
    assert stream.stopped
    assert "".join(deltas) == stream.text == "数学 answer: 42 "
    assert all("\ufffd" not in d for d in deltas)


def test_load_tokenizer_roundtrip(tmp_path):
    tok = trained_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert decode(loaded, encode(loaded, SAMPLE)) == SAMPLE
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "missing")


def test_load_tokenizer_optional_only_for_weights_only_folders(tmp_path):
    """Callers that work on token ids alone say so (optional=True); a half tokenizer still fails."""
    (tmp_path / "weights").mkdir()
    assert load_tokenizer(tmp_path / "weights", optional=True) is None
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "weights")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json but no tokenizer.json"):
        load_tokenizer(tmp_path / "broken", optional=True)
