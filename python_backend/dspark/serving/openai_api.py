"""OpenAI-compatible endpoints in front of the ensemble (architecture §10): `/v1/models`,
`/v1/completions`, `/v1/chat/completions`, streaming as server-sent events (`data: {...}` lines
ending with `data: [DONE]`). Served by `dspark serve --openai` on the front's port.

Each request becomes one `ensemble` generate_stream call on tritonserver (streamed upstream even
when the client does not stream, so a client that goes away is noticed at the next piece of text
and its slot is freed). Chat messages are rendered with the served model's own chat template
(`dspark.runtime.chat`). Fields OpenAI defines that change the output and that this server does
not implement (n > 1, logprobs, echo, penalties, tools, ...) are rejected with 400 naming the
field; OpenAI's defaults apply otherwise (temperature 1, top_p 1, max_tokens 16 for completions).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from dspark.runtime.chat import ChatTemplate

ENSEMBLE = "ensemble"
# field -> the only accepted value(s) (OpenAI's default): others change the output and are not implemented.
NEUTRAL = {
    "n": (1, None),
    "best_of": (1, None),
    "echo": (False, None),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None,),
    "suffix": (None,),
    "tools": (None,),
    "tool_choice": (None, "none"),
    "functions": (None,),
    "response_format": (None,),
}
IGNORED = {"model", "user", "stream_options", "metadata", "store", "service_tier", "parallel_tool_calls"}


@dataclass
class OpenAIConfig:
    model_name: str  # the id clients send as "model" and /v1/models lists
    model_folder: str  # the checkpoint folder (its chat template)
    max_tokens_cap: int = 2048


class OpenAIError(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}},
            status_code=self.status,
        )


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise OpenAIError(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OpenAIError(f"{name} must be an integer in [{low}, {high}], got {value!r}", name)
    return value


def generation_fields(body: dict, config: OpenAIConfig, default_max_tokens: int | None) -> dict:
    """The ensemble inputs of an OpenAI request body (validated; 400 naming the field)."""
    for name, allowed in NEUTRAL.items():
        if name in body and body[name] not in allowed:
            raise OpenAIError(f"{name}={body[name]!r} is not supported by this server", name)
    if body.get("model") not in (None, config.model_name):
        raise OpenAIError(
            f"model {body.get('model')!r} is not served here (use {config.model_name!r})",
            "model",
            status=404,
            kind="not_found_error",
        )
    max_tokens = _integer(body, "max_completion_tokens", None, 1, config.max_tokens_cap)
    max_tokens = max_tokens or _integer(body, "max_tokens", default_max_tokens, 1, config.max_tokens_cap)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None and (
        not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4
    ):
        raise OpenAIError("stop must be a string or a list of up to 4 non-empty strings", "stop")
    fields: dict[str, Any] = {
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 1e-9, 1.0),
        "exclude_input_in_output": True,
        "stream": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    seed = _integer(body, "seed", None, 0, 2**63 - 1)
    if seed is not None:
        fields["seed"] = seed
    if stops:
        fields["stop_words"] = stops
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError("stream must be true or false", "stream")
    return fields


async def _body(request: Request) -> dict:
    try:
        body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


class Generation:
    """One ensemble generate_stream call: yields text pieces; counts tokens; knows why it ended."""

    def __init__(self, front, fields: dict):
        self.front, self.fields = front, fields
        self.prompt_tokens = 0
        self.completion_tokens = 0

    @property
    def finish_reason(self) -> str:
        return "length" if self.completion_tokens >= self.fields.get("max_tokens", 1 << 30) else "stop"

    async def pieces(self) -> AsyncIterator[str]:
        url = f"/v2/models/{ENSEMBLE}/generate_stream"
        async with self.front.client.stream("POST", url, json=self.fields) as response:
            if response.status_code != 200:
                raise OpenAIError(
                    _upstream_error(await response.aread()), status=_status(response.status_code)
                )
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise OpenAIError(
                        event["error"],
                        status=400 if _is_user_error(event["error"]) else 500,
                        kind="invalid_request_error" if _is_user_error(event["error"]) else "server_error",
                    )
                self.prompt_tokens = int(event.get("num_input_tokens", self.prompt_tokens))
                self.completion_tokens += int(event.get("num_output_tokens", 0))
                text = event.get("text_output", "")
                if text:
                    yield text


def _upstream_error(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", errors="replace")


def _status(code: int) -> int:
    return 400 if code in (400, 413) else 502


def _is_user_error(message: str) -> bool:
    """Validation errors name the field ("max_tokens: ...", "text_input: ...")."""
    head = message.split(":", 1)[0].strip()
    return head.isidentifier() and not message.startswith(("generation failed", "engine"))


def _translate(message: str) -> str:
    return message.replace("text_input", "prompt")


def routes(front, config: OpenAIConfig) -> list[Route]:
    template: ChatTemplate | None = None

    def chat_template() -> ChatTemplate:
        nonlocal template
        if template is None:
            template = ChatTemplate.from_folder(config.model_folder)
        return template

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": config.model_name, "object": "model", "created": 0, "owned_by": "dspark"}],
            }
        )

    async def completions(request: Request):
        return await _complete(request, chat=False)

    async def chat_completions(request: Request):
        return await _complete(request, chat=True)

    async def _complete(request: Request, chat: bool):
        try:
            body = await _body(request)
            unknown = (
                set(body)
                - set(NEUTRAL)
                - IGNORED
                - {
                    "prompt",
                    "messages",
                    "max_tokens",
                    "max_completion_tokens",
                    "temperature",
                    "top_p",
                    "seed",
                    "stop",
                    "stream",
                }
            )
            if unknown:
                name = sorted(unknown)[0]
                raise OpenAIError(f"unknown field {name!r}", name)
            fields = generation_fields(body, config, None if chat else 16)
            if chat:
                try:
                    fields["text_input"] = chat_template().render(
                        body.get("messages"), add_generation_prompt=True
                    )
                except ValueError as e:
                    raise OpenAIError(str(e), "messages") from None
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                if not isinstance(prompt, str) or not prompt:
                    raise OpenAIError("prompt must be a non-empty string (one prompt per request)", "prompt")
                fields["text_input"] = prompt
            if "max_tokens" not in fields:
                fields["max_tokens"] = config.max_tokens_cap  # chat default: until the end token, capped
            generation = Generation(front, fields)
            stream = bool(body.get("stream", False))
            usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else True
            if stream:
                return StreamingResponse(
                    _sse(generation, chat, config, usage), media_type="text/event-stream"
                )
            text = "".join([p async for p in generation.pieces()])
            return JSONResponse(_final(generation, chat, config, text))
        except OpenAIError as e:
            if e.param is None and "text_input" in str(e):
                e = OpenAIError(_translate(str(e)), "prompt" if not chat else "messages", e.status, e.kind)
            return e.response()

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


def _ids(chat: bool) -> tuple[str, int]:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time())


def _usage(g: Generation) -> dict:
    return {
        "prompt_tokens": g.prompt_tokens,
        "completion_tokens": g.completion_tokens,
        "total_tokens": g.prompt_tokens + g.completion_tokens,
    }


def _final(g: Generation, chat: bool, config: OpenAIConfig, text: str) -> dict:
    rid, created = _ids(chat)
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": g.finish_reason,
            "logprobs": None,
        }
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": config.model_name,
            "choices": [choice],
            "usage": _usage(g),
        }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": config.model_name,
        "choices": [{"index": 0, "text": text, "finish_reason": g.finish_reason, "logprobs": None}],
        "usage": _usage(g),
    }


async def _sse(g: Generation, chat: bool, config: OpenAIConfig, include_usage: bool) -> AsyncIterator[str]:
    rid, created = _ids(chat)
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
        if chat:
            d: dict[str, Any] = (
                {"role": "assistant", "content": ""}
                if role
                else ({} if delta is None else {"content": delta})
            )
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return (
            "data: "
            + json.dumps(
                {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": config.model_name,
                    "choices": [choice],
                }
            )
            + "\n\n"
        )

    try:
        if chat:
            yield chunk(None, None, role=True)
        async for piece in g.pieces():
            yield chunk(piece, None)
        yield chunk(None, g.finish_reason)
        if include_usage:
            yield (
                "data: "
                + json.dumps(
                    {
                        "id": rid,
                        "object": kind,
                        "created": created,
                        "model": config.model_name,
                        "choices": [],
                        "usage": _usage(g),
                    }
                )
                + "\n\n"
            )
    except OpenAIError as e:
        yield "data: " + json.dumps({"error": {"message": str(e), "type": e.kind, "param": e.param}}) + "\n\n"
    yield "data: [DONE]\n\n"
