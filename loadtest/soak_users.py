"""Locust users of the soak (loadtest/soak.py, issue 14 item 3): the load test's users plus
what a server meets in production: gRPC streams cancelled mid-way, HTTP and OpenAI streams
whose client goes away, non-streaming `generate`, and malformed requests that must get a
clean 400 naming the field. Records are classified, not just counted:

- kind "ok": answered; "cancelled": stopped by the client on purpose (no error expected);
- kind "bad_request": a deliberately bad request; clean when answered 400 with a message;
- anything with `error` set is an unexpected failure.

The OpenAI user runs only when `--openai-url` answers (soak.py decides)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import requests
from locust import task

sys.path.insert(0, str(Path(__file__).resolve().parent))
import locustfile as base  # noqa: E402  (its listeners add the shared options and records)
from common import RequestRecord, StreamTimer  # noqa: E402

# (description, JSON body or raw bytes) -> each must be answered 400 / INVALID_ARG
BAD_REQUESTS = [
    ("malformed JSON", b'{"text_input": "hi", "max_tokens": '),
    ("empty body", b""),
    ("max_tokens negative", {"text_input": "hi", "max_tokens": -1}),
    ("max_tokens a string", {"text_input": "hi", "max_tokens": "ten"}),
    ("text_input missing", {"max_tokens": 8}),
    ("temperature not finite", {"text_input": "hi", "max_tokens": 8, "temperature": 1e39}),
]


class SoakGrpcUser(base.GrpcStreamUser):
    weight = 3

    @task(4)
    def generate(self) -> None:
        super().generate()

    @task(1)
    def cancel_mid_stream(self) -> None:
        record = self.stream_once(next(self.prompts), cancel_after=2)
        base.report(self.environment, "gRPC", "ensemble stream", record)


class SoakHttpUser(base.HttpStreamUser):
    weight = 3

    @task(3)
    def generate(self) -> None:
        super().generate()

    @task(2)
    def generate_non_streaming(self) -> None:
        base.report(self.environment, "HTTP", "generate", self.stream_once(next(self.prompts), stream=False))

    @task(1)
    def disconnect_mid_stream(self) -> None:
        record = self.stream_once(next(self.prompts), disconnect_after=2)
        base.report(self.environment, "HTTP", "generate_stream", record)

    @task(1)
    def bad_request(self) -> None:
        what, body = BAD_REQUESTS[self.rng.randrange(len(BAD_REQUESTS))]
        base.report(self.environment, "HTTP", "generate [bad request]", self.send_bad(what, body))

    def send_bad(self, what: str, body) -> RequestRecord:
        timer = StreamTimer("http_bad_request")
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            r = self.session.post(
                f"{self.base}/v2/models/ensemble/generate",
                data=data,
                timeout=60,
                headers={"Content-Type": "application/json"},
            )
        except requests.RequestException as e:
            return timer.finish(
                self.count_tokens, error=f"{what}: {type(e).__name__}: {e}", kind="bad_request"
            )
        timer.response("")
        try:
            message = r.json().get("error", "")
        except ValueError:
            message = ""
        if r.status_code == 400 and message:
            return timer.finish(self.count_tokens, kind="bad_request")
        return timer.finish(
            self.count_tokens, error=f"{what}: HTTP {r.status_code} {r.text[:200]!r}", kind="bad_request"
        )


class SoakOpenAIUser(base.OpenAIUser):
    weight = 2

    @task(2)
    def chat(self) -> None:
        super().chat()

    @task(2)
    def completion(self) -> None:
        super().completion()

    @task(1)
    def disconnect_mid_stream(self) -> None:
        chat = "chat" in self.o.openai_endpoints
        record = self.stream_once(next(self.prompts), chat=chat, disconnect_after=2)
        base.report(self.environment, "OpenAI", "/v1/chat/completions" if chat else "/v1/completions", record)
