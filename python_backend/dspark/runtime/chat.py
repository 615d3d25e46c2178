"""Chat templates: messages -> the prompt text the model was trained on (architecture §10).

A Hugging Face folder carries its template as Jinja source, in tokenizer_config.json
("chat_template": a string, or a list of {"name", "template"}) or in chat_template.jinja
(transformers 5). We render it the way transformers' `apply_chat_template` does: a sandboxed
Jinja environment with trim_blocks / lstrip_blocks and loop controls, a `tojson` filter
that does not HTML-escape, `raise_exception` and `strftime_now`, and the tokenizer's special
tokens (bos_token, eos_token, ...) as variables. SmolLM2's is ChatML:
`<|im_start|>role\\ncontent<|im_end|>\\n` per message, a default system message when the
first one is not a system message, and `<|im_start|>assistant\\n` as the generation prompt.

    template = ChatTemplate.from_folder(folder)
    text = template.render([{"role": "user", "content": "Hi"}])   # add_generation_prompt=True
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                      "mask_token")


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template: empty template")
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._template = _compile(source)

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTemplate:
        """The template of an HF folder: tokenizer_config.json "chat_template" (the "default"
        entry of a named list), else chat_template.jinja. FileNotFoundError / ValueError naming
        the file when there is none."""
        folder = Path(folder)
        cfg_path = folder / "tokenizer_config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no tokenizer_config.json in {folder} (it holds the chat template "
                                    "and the special tokens)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
        source = cfg.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
            source = named.get("default")
            if source is None:
                raise ValueError(f"{cfg_path}: field 'chat_template' has no 'default' entry "
                                 f"(names: {', '.join(map(str, named))})")
        jinja = folder / "chat_template.jinja"
        if source is None and jinja.is_file():
            source = jinja.read_text()
        if not source:
            raise ValueError(f"{cfg_path}: no field 'chat_template' (and no chat_template.jinja): "
                             "this model has no chat template")
        return cls(source, {k: _token_text(cfg.get(k)) for k in SPECIAL_TOKEN_KEYS})

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]); with
        add_generation_prompt the text ends where the assistant's reply begins. Extra keyword
        variables (e.g. tools) are passed to the template as transformers does."""
        check_messages(messages)
        plain = [dict(m) for m in messages]
        return self._template.render(messages=plain, add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens, **variables})


def check_messages(messages: Any) -> None:
    """ValueError naming the first bad field of a chat request's messages."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]: expected an object with 'role' and 'content', "
                             f"got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}].role: expected a non-empty string")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content: expected a string")
