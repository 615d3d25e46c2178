"""Locust users for DSpark on Triton (docs/architecture.md §9, §10): a gRPC streaming user
(tritonclient bidirectional stream, made gevent-cooperative), an HTTP `generate_stream`
user (server-sent events) and an OpenAI-endpoint user (`/v1/chat/completions` and
`/v1/completions`, streamed), all closed-loop: each user sends its next request when the
previous one has finished.

Besides Locust's own request rows (response time = AIPerf request latency, response length
= output tokens), every finished request adds rows of type TTFT, ITL (both ms) and
TOKENS_PER_S_USER (the column "response time" then holds tokens/s) per user class, so
`--csv` writes them all. AIPerf's definitions: loadtest/common.py. Exact per-request
values go to `--records-csv`, the aggregate (p50/p90/p99, aggregate tokens/s) to
`--summary-json`.

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 --run-time 2m \\
        --host http://127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --csv /tmp/run \\
        --records-csv /tmp/run_records.csv --summary-json /tmp/run.json \\
        GrpcStreamUser HttpStreamUser OpenAIUser   # OpenAIUser: `dspark serve --openai`
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

import grpc.experimental.gevent as grpc_gevent
import requests
from gevent.queue import Empty, Queue
from locust import User, constant, events, task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    EnsembleFormat,
    RequestRecord,
    StreamTimer,
    TokenCounter,
    http_base,
    iter_sse,
    load_prompts,
    summarize,
    text_of,
    write_records,
)

# grpcio's polling must yield to other greenlets, or one gRPC user blocks the whole process.
grpc_gevent.init_gevent()

RECORDS: list[RequestRecord] = []
_STATE: dict = {}  # prompts and token counter, built once per process at test start
_SEQ = itertools.count()


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    from dspark.paths import SMOLLM2

    g = parser.add_argument_group("DSpark")
    g.add_argument("--grpc-url", default="127.0.0.1:8001", help="Triton gRPC host:port")
    g.add_argument("--openai-url", default="", help="OpenAI frontend base URL (default: --host)")
    g.add_argument(
        "--openai-endpoints",
        default="chat,completions",
        help="which OpenAI endpoints the OpenAI user calls (chat needs a chat template)",
    )
    g.add_argument("--openai-model", default="", help="OpenAI model name (default: first of /v1/models)")
    g.add_argument(
        "--prompts",
        default="code,math,prose",
        help="evaluation prompt sets (comma list of code, math, prose) or a prompts .jsonl file",
    )
    g.add_argument("--prompts-per-set", type=int, default=0, help="first N of each set (0 = all)")
    g.add_argument("--max-prompt-chars", type=int, default=0, help="cut prompts to N chars (0 = keep)")
    g.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: greedy)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument(
        "--tokenizer",
        default=str(SMOLLM2),
        help="served model folder (or tokenizer.json): output tokens are counted with it",
    )
    g.add_argument("--request-timeout", type=float, default=300.0, help="seconds until a request fails")
    g.add_argument("--records-csv", default="", help="write one row per request here at the end")
    g.add_argument("--summary-json", default="", help="write the AIPerf-style summary here at the end")
    g.add_argument("--seed", type=int, default=0, help="prompt order and sampling seeds")


@events.test_start.add_listener
def _on_test_start(environment, **_) -> None:
    o = environment.parsed_options
    _STATE["prompts"] = load_prompts(o.prompts, o.prompts_per_set or None, o.max_prompt_chars, o.seed)
    _STATE["count_tokens"] = TokenCounter(o.tokenizer)
    _STATE["t0"] = time.time()
    RECORDS.clear()


@events.test_stop.add_listener
def _on_test_stop(environment, **_) -> None:
    o = environment.parsed_options
    if "t0" not in _STATE:
        return
    duration = time.time() - _STATE["t0"]
    by_user = {}
    for user in sorted({r.user for r in RECORDS}):
        by_user[user] = summarize([r for r in RECORDS if r.user == user], duration)
    summary = {
        "all": summarize(RECORDS, duration),
        "by_user": by_user,
        "max_tokens": o.max_tokens,
        "users": o.num_users,
        "prompts": o.prompts,
    }
    if o.records_csv:
        write_records(o.records_csv, RECORDS)
    if o.summary_json:
        Path(o.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(o.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
    a = summary["all"]
    if a["ok"]:
        print(
            f"DSpark load test: {a['ok']} requests ok, {a['errors']} errors; aggregate "
            f"{a['aggregate_tokens_per_s']:.1f} output tokens/s; per user p50 "
            f"{a['tokens_per_s_user_p50'] or 0:.1f} tokens/s; TTFT p50 {a['ttft_ms_p50'] or 0:.0f} ms; "
            f"ITL p50 {a['itl_ms_p50'] or 0:.1f} ms",
            file=sys.stderr,
        )


@events.quit.add_listener
def _on_quit(exit_code: int, **_) -> None:
    # grpcio in gevent mode sometimes hangs in interpreter shutdown after everything is
    # written (about every second run here); end the process once Locust is done.
    def exit_now() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)

    atexit.register(exit_now)


def report(environment, request_type: str, name: str, record: RequestRecord) -> None:
    """Locust rows for one finished request, and keep its record."""
    RECORDS.append(record)
    fire = environment.events.request.fire
    error = Exception(record.error) if record.error else None
    if record.kind != "ok":  # a deliberate cancellation / bad request (the soak): its own row
        name = f"{name} [{record.kind}]"
    fire(
        request_type=request_type,
        name=name,
        response_time=(record.latency_s or 0) * 1e3,
        response_length=record.output_tokens,
        exception=error,
        context={},
    )
    if error is not None or record.kind != "ok":
        return
    if record.ttft_s is not None:
        fire(
            request_type="TTFT",
            name=name,
            response_time=record.ttft_s * 1e3,
            response_length=0,
            exception=None,
            context={},
        )
    if record.itl_s is not None:
        fire(
            request_type="ITL",
            name=name,
            response_time=record.itl_s * 1e3,
            response_length=0,
            exception=None,
            context={},
        )
        fire(
            request_type="TOKENS_PER_S_USER",
            name=name,
            response_time=record.tokens_per_s_user,
            response_length=0,
            exception=None,
            context={},
        )


class LLMUser(User):
    """Common parts: options, a seeded prompt cycle per user, sampling parameters."""

    abstract = True
    wait_time = constant(0)

    def on_start(self) -> None:
        self.o = self.environment.parsed_options
        self.index = next(_SEQ)
        self.rng = random.Random(self.o.seed * 1000003 + self.index)
        prompts = _STATE["prompts"]
        start = self.rng.randrange(len(prompts))
        self.prompts = itertools.cycle(prompts[start:] + prompts[:start])
        self.count_tokens = _STATE["count_tokens"]

    def params(self, prompt: str, stream: bool) -> dict:
        o = self.o
        seed = self.rng.randrange(2**31) if o.temperature else None
        return {
            "text_input": prompt,
            "max_tokens": o.max_tokens,
            "stream": stream,
            "temperature": o.temperature,
            "top_p": o.top_p,
            "top_k": o.top_k,
            "seed": seed,
        }


class GrpcStreamUser(LLMUser):
    """Triton gRPC bidirectional stream (tritonclient), one stream per user kept open."""

    def on_start(self) -> None:
        import tritonclient.grpc as grpcclient

        super().on_start()
        self.client = grpcclient.InferenceServerClient(self.o.grpc_url)
        self.format = EnsembleFormat.from_grpc(self.client)
        self.responses: Queue = Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def on_stop(self) -> None:
        # Cancelling a finished stream keeps the ensemble referenced in tritonserver 2.51.
        self.client.stop_stream(cancel_requests=False)
        self.client.close()

    @task
    def generate(self) -> None:
        record = self.stream_once(next(self.prompts))
        report(self.environment, "gRPC", "ensemble stream", record)

    def stream_once(self, prompt: str, cancel_after: int = 0) -> RequestRecord:
        """One streamed request; `cancel_after` > 0 cancels it after that many responses."""
        while not self.responses.empty():  # leftovers of an earlier cancelled request
            self.responses.get_nowait()
        rid = f"u{self.index}-{time.monotonic_ns()}"
        timer = StreamTimer("grpc_stream")
        self.client.async_stream_infer(
            "ensemble",
            self.format.grpc_inputs(self.params(prompt, True)),
            request_id=rid,
            enable_empty_final_response=True,
        )
        while True:
            try:
                result, error = self.responses.get(timeout=self.o.request_timeout)
            except Empty:
                return timer.finish(self.count_tokens, error=f"no response in {self.o.request_timeout:.0f} s")
            if error is not None:
                return timer.finish(self.count_tokens, error=str(error))
            response = result.get_response()
            if response.id and response.id != rid:
                continue  # a late response of a cancelled request
            timer.response(text_of(result.as_numpy("text_output")))
            if response.parameters["triton_final_response"].bool_param:
                return timer.finish(self.count_tokens)
            if cancel_after and timer.record.responses >= cancel_after:
                self.cancel_stream()
                return timer.finish(self.count_tokens, kind="cancelled")

    def cancel_stream(self) -> None:
        """Cancel what is in flight on this user's stream and open a new one."""
        self.client.stop_stream(cancel_requests=True)
        self.responses = Queue()
        self.client.start_stream(callback=lambda result, error, q=self.responses: q.put((result, error)))


class HttpStreamUser(LLMUser):
    """Triton HTTP `generate_stream` (server-sent events, one event per text piece)."""

    def on_start(self) -> None:
        super().on_start()
        self.base = http_base(self.host or "http://127.0.0.1:8000")
        self.format = EnsembleFormat.from_http(self.base)
        self.session = requests.Session()

    @task
    def generate(self) -> None:
        report(self.environment, "HTTP", "generate_stream", self.stream_once(next(self.prompts)))

    def stream_once(self, prompt: str, stream: bool = True, disconnect_after: int = 0) -> RequestRecord:
        """One request to `generate_stream` (or `generate`); `disconnect_after` > 0 drops the
        connection after that many events, as a client that goes away."""
        timer = StreamTimer("http_stream" if stream else "http_generate")
        endpoint = "generate_stream" if stream else "generate"
        try:
            with self.session.post(
                f"{self.base}/v2/models/ensemble/{endpoint}",
                stream=stream,
                json=self.format.json_body(self.params(prompt, stream)),
                timeout=self.o.request_timeout,
            ) as r:
                if r.status_code != 200:
                    timer.response("")
                    return timer.finish(self.count_tokens, error=f"HTTP {r.status_code}: {r.text[:300]}")
                if not stream:
                    timer.response(r.json().get("text_output", ""))
                    return timer.finish(self.count_tokens)
                for payload in iter_sse(r.iter_lines(chunk_size=None)):
                    event = json.loads(payload)
                    if "error" in event:
                        timer.response("")
                        return timer.finish(self.count_tokens, error=str(event["error"]))
                    timer.response(event.get("text_output", ""))
                    if disconnect_after and timer.record.responses >= disconnect_after:
                        r.raw.close()  # the socket goes away mid-stream
                        return timer.finish(self.count_tokens, kind="cancelled")
        except requests.RequestException as e:
            return timer.finish(self.count_tokens, error=f"{type(e).__name__}: {e}")
        return timer.finish(self.count_tokens)


class OpenAIUser(LLMUser):
    """The OpenAI-compatible frontend: streamed chat and text completions, alternately."""

    def on_start(self) -> None:
        super().on_start()
        endpoints = set(self.o.openai_endpoints.split(","))
        if not endpoints or not endpoints <= {"chat", "completions"}:
            raise ValueError(f"--openai-endpoints: chat and/or completions, not {self.o.openai_endpoints!r}")
        self.base = http_base(self.o.openai_url or self.host or "http://127.0.0.1:8000")
        self.session = requests.Session()
        self.model = self.o.openai_model
        if not self.model:
            self.model = self.session.get(f"{self.base}/v1/models", timeout=30).json()["data"][0]["id"]

    def body(self, prompt: str, chat: bool) -> dict:
        o = self.o
        body = {"model": self.model, "max_tokens": o.max_tokens, "stream": True}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        optional = {
            "temperature": o.temperature if o.temperature is not None else 0.0,
            "top_p": o.top_p,
            "seed": self.rng.randrange(2**31) if o.temperature else None,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        return body

    @task
    def chat(self) -> None:
        if "chat" not in self.o.openai_endpoints:
            return self.completion()
        record = self.stream_once(next(self.prompts), chat=True)
        report(self.environment, "OpenAI", "/v1/chat/completions", record)

    @task
    def completion(self) -> None:
        if "completions" not in self.o.openai_endpoints:
            return self.chat()
        record = self.stream_once(next(self.prompts), chat=False)
        report(self.environment, "OpenAI", "/v1/completions", record)

    def stream_once(self, prompt: str, chat: bool = True, disconnect_after: int = 0) -> RequestRecord:
        """One streamed completion; `disconnect_after` > 0 drops the connection after that many events."""
        timer = StreamTimer("openai_chat" if chat else "openai_completion")
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            with self.session.post(
                self.base + path, json=self.body(prompt, chat), stream=True, timeout=self.o.request_timeout
            ) as r:
                if r.status_code != 200:
                    timer.response("")
                    return timer.finish(self.count_tokens, error=f"HTTP {r.status_code}: {r.text[:300]}")
                for payload in iter_sse(r.iter_lines(chunk_size=None)):
                    if payload == "[DONE]":
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        timer.response("")
                        return timer.finish(self.count_tokens, error=str(event["error"]))
                    choices = event.get("choices") or [{}]
                    piece = (choices[0].get("delta") or {}).get("content") if chat else choices[0].get("text")
                    timer.response(piece or "")
                    if disconnect_after and timer.record.responses >= disconnect_after:
                        r.raw.close()
                        return timer.finish(self.count_tokens, kind="cancelled")
        except requests.RequestException as e:
            return timer.finish(self.count_tokens, error=f"{type(e).__name__}: {e}")
        return timer.finish(self.count_tokens)
