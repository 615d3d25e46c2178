"""Text <-> token helpers shared by the Triton models, the CLI and the clients' tests.

Streaming text out of a token stream has two traps this module handles once:
- a token can end in the middle of a multi-byte UTF-8 character (byte-level BPE splits
  "中" or an emoji over several tokens): `IncrementalDetokenizer` holds those bytes back
  until the character is complete, so no delta ever carries half a character;
- a stop string can arrive split over several deltas: `StopStringMatcher` holds back any
  tail that could still grow into a stop string and cuts the text at the earliest match.
`TextStream` chains both; the `dspark` BLS model keeps one per request (docs/architecture.md §10).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal, overload

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode yields for incomplete bytes


@overload
def load_tokenizer(folder: str | Path, optional: Literal[False] = False) -> Tokenizer: ...
@overload
def load_tokenizer(folder: str | Path, optional: bool) -> Tokenizer | None: ...


def load_tokenizer(folder: str | Path, optional: bool = False) -> Tokenizer | None:
    """The Hugging Face `tokenizer.json` of a checkpoint folder (or the file itself).
    A missing file raises FileNotFoundError naming it. Callers that work on token ids alone say
    so with `optional=True` and get None for a weights-only folder (no tokenizer files at all);
    a folder with tokenizer_config.json but no tokenizer.json is broken either way."""
    path = Path(folder)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    if (path.parent / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path.parent} has tokenizer_config.json but no tokenizer.json "
                                "(we read the fast-tokenizer file only)")
    if optional:
        return None
    raise FileNotFoundError(f"no tokenizer.json at {path}")


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text` (the tokenizer's post-processor adds BOS where the model wants one)."""
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Plain full decode, special tokens (EOS, ...) dropped."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Decodes a short window `ids[prefix_offset:]` and emits what it adds over
    `ids[prefix_offset:read_offset]` (the window gives tokenizers that strip a leading
    space, like SentencePiece, the left context they need). A decoded window that ends in
    U+FFFD ends in an incomplete character: the text before it is emitted, the offsets
    stay, and the held bytes are decoded again together with the next tokens. `finish()`
    flushes what is still held back when the stream ends.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), context_tokens: int = 4):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-context_tokens:]) if context_tokens > 0 else []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # ids before this are fully emitted as text
        self.window_emitted = 0  # chars of ids[read_offset:] already emitted (before a held tail)
        self.text = ""  # everything emitted so far

    def _window_texts(self) -> tuple[str, str]:
        prefix = decode(self.tokenizer, self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.tokenizer, self.ids[self.prefix_offset :])
        return prefix, full

    def push(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly complete text ("" while a character is incomplete)."""
        self.ids.extend(int(t) for t in new_ids)
        prefix, full = self._window_texts()
        complete = not full.endswith(REPLACEMENT_CHAR)
        stable = full if complete else full.rstrip(REPLACEMENT_CHAR)
        delta = stable[len(prefix) + self.window_emitted :]
        if complete and len(full) > len(prefix):
            self.prefix_offset, self.read_offset, self.window_emitted = self.read_offset, len(self.ids), 0
        else:
            self.window_emitted += len(delta)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Emit whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix, full = self._window_texts()
        delta = full[len(prefix) + self.window_emitted :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.window_emitted = 0
        self.text += delta
        return delta


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index in `text` where the earliest stop string starts, or -1."""
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(hits, default=-1)


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string:
    those characters may still become a stop string and must not be emitted yet."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class StopStringMatcher:
    """Filters a stream of text deltas: emits text up to (not including) the earliest stop
    string, holding back a tail that could be the start of one."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.pending = ""  # received, not yet emitted
        self.stopped = False

    def push(self, delta: str) -> str:
        """Text that is safe to emit now; sets `stopped` when a stop string completed."""
        if self.stopped:
            return ""
        self.pending += delta
        cut = find_stop(self.pending, self.stops)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = partial_stop_len(self.pending, self.stops)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out

    def finish(self) -> str:
        """The held-back tail once the stream ended without completing a stop string."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class TextStream:
    """Token ids in, stop-aware text deltas out: one per request in a streaming server."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stops: Sequence[str] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.matcher = StopStringMatcher(stops)
        self.text = ""  # everything emitted so far

    @property
    def stopped(self) -> bool:
        """A stop string completed: the request is done; further ids are ignored."""
        return self.matcher.stopped

    def push(self, new_ids: Sequence[int]) -> str:
        delta = self.matcher.push(self.detokenizer.push(new_ids)) if not self.stopped else ""
        self.text += delta
        return delta

    def finish(self) -> str:
        delta = "" if self.stopped else self.matcher.push(self.detokenizer.finish())
        delta += self.matcher.finish()
        self.text += delta
        return delta
