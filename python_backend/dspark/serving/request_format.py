"""TensorRT-LLM's ensemble request format (architecture §10): the input names and types of the
TensorRT-LLM backend's `inflight_batcher_llm/ensemble/config.pbtxt`, what DSpark does with each,
and the validation both `preprocessing` and `dspark` (when called directly) run on a request.

Names follow the current TensorRT-LLM ensemble (NVIDIA/TensorRT-LLM triton_backend); the two
names the release paired with tritonserver 2.51 used instead (`random_seed`, `min_length`,
tensorrtllm_backend v0.14) are accepted as well, so clients of either work unchanged.

Every field is one of: used; accepted only at its neutral value (a value that changes nothing
here, e.g. `beam_width` 1, `repetition_penalty` 1); or not supported (rejected whenever present).
Nothing is ignored silently: a rejected request gets a `RequestError` naming the field, which
the models turn into INVALID_ARG (HTTP 400).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# name -> (Triton data type, dims without the batch dimension). The ensemble declares these
# (max_batch_size > 0, like TensorRT-LLM's, so each tensor has a leading batch dimension of 1).
INPUTS: dict[str, tuple[str, list[int]]] = {
    "text_input": ("TYPE_STRING", [1]),
    "decoder_text_input": ("TYPE_STRING", [1]),
    "max_tokens": ("TYPE_INT32", [1]),
    "num_return_sequences": ("TYPE_INT32", [1]),
    "bad_words": ("TYPE_STRING", [-1]),
    "stop_words": ("TYPE_STRING", [-1]),
    "exclude_input_in_output": ("TYPE_BOOL", [1]),
    "end_id": ("TYPE_INT32", [1]),
    "pad_id": ("TYPE_INT32", [1]),
    "top_k": ("TYPE_INT32", [1]),
    "top_p": ("TYPE_FP32", [1]),
    "temperature": ("TYPE_FP32", [1]),
    "length_penalty": ("TYPE_FP32", [1]),
    "repetition_penalty": ("TYPE_FP32", [1]),
    "min_tokens": ("TYPE_INT32", [1]),
    "min_length": ("TYPE_INT32", [1]),  # v0.14 name of min_tokens
    "presence_penalty": ("TYPE_FP32", [1]),
    "frequency_penalty": ("TYPE_FP32", [1]),
    "seed": ("TYPE_UINT64", [1]),
    "random_seed": ("TYPE_UINT64", [1]),  # v0.14 name of seed
    "return_log_probs": ("TYPE_BOOL", [1]),
    "return_context_logits": ("TYPE_BOOL", [1]),
    "return_generation_logits": ("TYPE_BOOL", [1]),
    "return_perf_metrics": ("TYPE_BOOL", [1]),
    "return_kv_cache_reuse_stats": ("TYPE_BOOL", [1]),
    "return_num_input_tokens": ("TYPE_BOOL", [1]),
    "return_num_output_tokens": ("TYPE_BOOL", [1]),
    "beam_width": ("TYPE_INT32", [1]),
    "stream": ("TYPE_BOOL", [1]),
    "prompt_embedding_table": ("TYPE_FP16", [-1, -1]),
    "prompt_table_extra_id": ("TYPE_UINT64", [1]),
    "prompt_vocab_size": ("TYPE_INT32", [1]),
    "embedding_bias_words": ("TYPE_STRING", [-1]),
    "embedding_bias_weights": ("TYPE_FP32", [-1]),
    "lora_task_id": ("TYPE_UINT64", [1]),
    "lora_weights": ("TYPE_FP16", [-1, -1]),
    "lora_config": ("TYPE_INT32", [-1, 3]),
    "guided_decoding_guide_type": ("TYPE_STRING", [1]),
    "guided_decoding_guide": ("TYPE_STRING", [1]),
}
REQUIRED = ("text_input", "max_tokens")
# Accepted only at this value (it changes nothing for a single greedy/sampled sequence).
NEUTRAL: dict[str, object] = {
    "num_return_sequences": 1,
    "beam_width": 1,
    "length_penalty": 1.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "min_length": 0,
    "return_log_probs": False,
    "return_context_logits": False,
    "return_generation_logits": False,
    "return_kv_cache_reuse_stats": False,
}
# Rejected whenever present (no neutral value that a client would send).
UNSUPPORTED = (
    "decoder_text_input",
    "bad_words",
    "prompt_embedding_table",
    "prompt_table_extra_id",
    "prompt_vocab_size",
    "embedding_bias_words",
    "embedding_bias_weights",
    "lora_task_id",
    "lora_weights",
    "lora_config",
    "guided_decoding_guide_type",
    "guided_decoding_guide",
)
WHY_NOT = {
    "beam_width": "beam search is not supported (speculative sampling serves one sequence)",
    "num_return_sequences": "one sequence per request",
    "min_tokens": "a minimum length (EOS suppression) is not supported",
    "min_length": "a minimum length (EOS suppression) is not supported",
    "bad_words": "bad-word masking is not supported",
    "decoder_text_input": "encoder-decoder models are not supported",
    "return_log_probs": "log-probabilities are not returned",
    "return_context_logits": "logits are not returned",
    "return_generation_logits": "logits are not returned",
    "return_kv_cache_reuse_stats": "KV-cache reuse statistics are not returned",
}
# Outputs: the ensemble's `text_output`, `num_input_tokens` / `num_output_tokens` when asked
# (return_num_*), and with return_perf_metrics the timing and speculative-decoding counters
# TensorRT-LLM returns (same names and types).
OUTPUTS: dict[str, tuple[str, list[int]]] = {
    "text_output": ("TYPE_STRING", [-1]),
    "num_input_tokens": ("TYPE_INT32", [1]),
    "num_output_tokens": ("TYPE_INT32", [1]),
    "arrival_time_ns": ("TYPE_INT64", [1]),
    "first_scheduled_time_ns": ("TYPE_INT64", [1]),
    "first_token_time_ns": ("TYPE_INT64", [1]),
    "last_token_time_ns": ("TYPE_INT64", [1]),
    "acceptance_rate": ("TYPE_FP32", [1]),
    "total_accepted_draft_tokens": ("TYPE_INT32", [1]),
    "total_draft_tokens": ("TYPE_INT32", [1]),
}
PERF_OUTPUTS = (
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
)

MAX_TEMPERATURE = 100.0  # beyond this every row is uniform to float precision: surely a mistake
MAX_STOP_WORDS = 16
MAX_STOP_WORD_CHARS = 256


class RequestError(ValueError):
    """A bad request; the message names the field."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.field = name


@dataclass
class Limits:
    max_seq_len: int  # tokens per KV slot: prompt + max_tokens must fit
    vocab_size: int | None = None  # for end_id / pad_id; None = unchecked
    max_input_bytes: int = 0  # text_input size checked before tokenizing (0 = 32 bytes per token)

    @property
    def input_bytes(self) -> int:
        return self.max_input_bytes or 32 * self.max_seq_len


@dataclass
class GenerationRequest:
    """A validated request (prompt still text; `prompt_ids` once tokenized)."""

    text: str
    max_tokens: int
    stream: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_words: list[str] = field(default_factory=list)
    end_id: int | None = None
    exclude_input: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_perf_metrics: bool = False
    prompt_ids: list[int] = field(default_factory=list)


Getter = Callable[[str], "np.ndarray | None"]  # input name -> its values (any shape) or None


def _scalar(name: str, values: np.ndarray):
    flat = np.asarray(values).reshape(-1)
    if flat.size != 1:
        raise RequestError(name, f"expected one value, got {flat.size}")
    return flat[0].item() if hasattr(flat[0], "item") else flat[0]


def _text(name: str, value) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(name, "is not valid UTF-8") from None
    return str(value)


def parse(get: Getter, limits: Limits) -> GenerationRequest:
    """Validate every field present; raise RequestError naming the first bad one."""
    present = {name: v for name in INPUTS if (v := get(name)) is not None}
    for name in REQUIRED:
        if name not in present:
            raise RequestError(name, "is required")
    for name in UNSUPPORTED:
        if name in present:
            raise RequestError(name, f"not supported: {WHY_NOT.get(name, 'this field is not supported')}")
    for name, neutral in NEUTRAL.items():
        if name in present:
            value = _scalar(name, present[name])
            ok = value == neutral or (name in ("min_tokens", "min_length") and 0 <= value <= 1)
            if not ok:
                raise RequestError(
                    name, f"only {neutral!r} is supported: {WHY_NOT.get(name, 'no effect here')}"
                )
    if "seed" in present and "random_seed" in present:
        raise RequestError("random_seed", "give seed or random_seed, not both")

    raw = _scalar("text_input", present["text_input"])
    size = len(raw) if isinstance(raw, bytes) else len(str(raw).encode("utf-8"))
    if size > limits.input_bytes:
        raise RequestError("text_input", f"is {size} bytes; at most {limits.input_bytes} are accepted")
    text = _text("text_input", raw)
    if not text:
        raise RequestError("text_input", "must be a non-empty string")

    req = GenerationRequest(
        text=text, max_tokens=_int("max_tokens", present["max_tokens"], 1, limits.max_seq_len)
    )
    if "stream" in present:
        req.stream = bool(_scalar("stream", present["stream"]))
    if "temperature" in present:
        req.temperature = _float("temperature", present["temperature"], 0.0, MAX_TEMPERATURE)
    if "top_p" in present:
        req.top_p = _float("top_p", present["top_p"], 0.0, 1.0, low_open=True)
    if "top_k" in present:
        req.top_k = _int("top_k", present["top_k"], 0, 2**31 - 1)
    for name in ("seed", "random_seed"):
        if name in present:
            req.seed = _int(name, present[name], 0, 2**64 - 1)
    vocab = (limits.vocab_size or 2**31) - 1
    if "end_id" in present:
        req.end_id = _int("end_id", present["end_id"], 0, vocab)
    if "pad_id" in present:
        _int("pad_id", present["pad_id"], 0, vocab)  # outputs are never padded: checked, then unused
    if "stop_words" in present:
        words = [_text("stop_words", w) for w in np.asarray(present["stop_words"]).reshape(-1).tolist()]
        if len(words) > MAX_STOP_WORDS:
            raise RequestError("stop_words", f"at most {MAX_STOP_WORDS} stop words, got {len(words)}")
        if any(not w or len(w) > MAX_STOP_WORD_CHARS for w in words):
            raise RequestError(
                "stop_words", f"each stop word must have 1 to {MAX_STOP_WORD_CHARS} characters"
            )
        req.stop_words = words
    flags = (
        "exclude_input_in_output",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "return_perf_metrics",
    )
    for name in flags:
        if name in present:
            setattr(
                req,
                "exclude_input" if name == "exclude_input_in_output" else name,
                bool(_scalar(name, present[name])),
            )
    return req


def check_prompt_length(req: GenerationRequest, limits: Limits) -> None:
    """After tokenizing: the prompt and max_tokens must fit one KV slot."""
    n = len(req.prompt_ids)
    if n == 0:
        raise RequestError("text_input", "encodes to zero tokens")
    room = limits.max_seq_len - n
    if room < 1:
        raise RequestError(
            "text_input",
            f"is {n} tokens; at most {limits.max_seq_len - 1} fit (max_seq_len {limits.max_seq_len})",
        )
    if req.max_tokens > room:
        raise RequestError(
            "max_tokens",
            f"{req.max_tokens} exceeds the {room} tokens left after the {n}-token "
            f"prompt (max_seq_len {limits.max_seq_len})",
        )


def _int(name: str, values, low: int, high: int) -> int:
    value = _scalar(name, values)
    if isinstance(value, float) and not value.is_integer():
        raise RequestError(name, f"must be an integer, got {value}")
    value = int(value)
    if not low <= value <= high:
        raise RequestError(name, f"must be in [{low}, {high}], got {value}")
    return value


def _float(name: str, values, low: float, high: float, low_open: bool = False) -> float:
    value = float(_scalar(name, values))
    if not math.isfinite(value):
        raise RequestError(name, f"must be finite, got {value}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(name, f"must be in {bracket}{low:g}, {high:g}], got {value:g}")
    return value


# ---- JSON bodies of HTTP generate / generate_stream (checked by the front before tritonserver) ----

JSON_LIMITS = {
    "TYPE_INT32": (-(2**31), 2**31 - 1),
    "TYPE_UINT64": (0, 2**64 - 1),
    "TYPE_INT64": (-(2**63), 2**63 - 1),
    "TYPE_UINT32": (0, 2**32 - 1),
}


def check_json_body(body: object, inputs: dict[str, tuple[str, list[int]]]) -> None:
    """Type-check a generate JSON body against a model's inputs (name -> (type, dims)) so that
    tritonserver never sees a value it would wrap (1e10 as INT32) or answer with HTTP 500.
    Raises RequestError naming the field."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object of input names to values")
    for name, value in body.items():
        if name in ("parameters", "id"):
            continue
        if name not in inputs:
            raise RequestError(name, "is not an input of this model")
        dtype, dims = inputs[name]
        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and dims == [1]:
            if len(value) != 1:
                raise RequestError(name, f"expected one value, got {len(value)}")
        for v in _flatten(values):
            _check_json_value(name, dtype, v)


def _flatten(values: list) -> list:
    out = []
    for v in values:
        out.extend(_flatten(v) if isinstance(v, list) else [v])
    return out


def _check_json_value(name: str, dtype: str, v: object) -> None:
    if dtype == "TYPE_STRING":
        if not isinstance(v, str):
            raise RequestError(name, f"must be a string, got {type(v).__name__}")
    elif dtype == "TYPE_BOOL":
        if not isinstance(v, bool):
            raise RequestError(name, f"must be true or false, got {v!r}")
    elif dtype in JSON_LIMITS:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RequestError(name, f"must be an integer, got {type(v).__name__}")
        if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
            raise RequestError(name, f"must be an integer, got {v}")
        low, high = JSON_LIMITS[dtype]
        if not low <= int(v) <= high:
            raise RequestError(name, f"must be in [{low}, {high}] ({dtype[5:]}), got {int(v)}")
    elif dtype in ("TYPE_FP32", "TYPE_FP16", "TYPE_FP64"):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RequestError(name, f"must be a number, got {type(v).__name__}")
        limit = {"TYPE_FP32": 3.4028234e38, "TYPE_FP16": 65504.0}.get(dtype, math.inf)
        if not math.isfinite(float(v)) or abs(float(v)) > limit:
            raise RequestError(name, f"must be a finite {dtype[5:]} number, got {v}")
