"""The HTTP front of `dspark serve` (architecture §10): an ASGI app on the public HTTP port that
forwards Triton's HTTP API to tritonserver (listening on a private loopback port) and, with
`--openai`, serves the OpenAI-compatible endpoints (`dspark.serving.openai_api`).

Why a front at all: tritonserver 2.51 has no HTTP body-size option, and a body of 4 MiB or more
crashes it (signal 11, measured: model_repository/README.md); its generate endpoints answer
malformed JSON, strings or fractions for integers, negative seeds or a `"stream": true` on
`generate` with HTTP 500 or a 200 carrying an error, and wrap 1e10 into an INT32 silently. Here:
- a body over `max_body_bytes` -> 413 before it reaches tritonserver (Content-Length is checked
  first; a chunked body is counted as it arrives);
- generate / generate_stream bodies are parsed and type-checked against the model's inputs
  (`request_format.check_json_body`) -> 400 naming the field;
- everything else passes through unchanged, streamed (SSE included). When the client goes
  away, the upstream connection is closed, which is what tritonserver notices (cancellation).
Errors keep Triton's shape: {"error": "..."}.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

import httpx2 as httpx
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dspark.serving.request_format import RequestError, check_json_body

DEFAULT_MAX_BODY_BYTES = 2 << 20  # well under the 4 MiB that crashes tritonserver 2.51
GENERATE = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/[^/]+)?/(?P<ep>generate|generate_stream)$")
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "host",
    "proxy-authenticate",
    "proxy-authorization",
}


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than `limit` bytes (header first, then as it streams)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(int(declared))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(len(body))
    return bytes(body)


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class Front:
    """State shared by the routes: the upstream client and the models' input specs."""

    def __init__(self, upstream: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.upstream = upstream.rstrip("/")
        self.max_body_bytes = max_body_bytes
        self.client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(None, connect=10.0))
        self._inputs: dict[str, dict[str, tuple[str, list[int]]]] = {}

    async def model_inputs(self, model: str) -> dict[str, tuple[str, list[int]]] | None:
        """name -> (data type, dims) of a model's inputs, from tritonserver (cached); None if unknown."""
        if model not in self._inputs:
            r = await self.client.get(f"/v2/models/{model}/config")
            if r.status_code != 200:
                return None
            config = r.json()
            self._inputs[model] = {
                i["name"]: (i["data_type"], list(i.get("dims", []))) for i in config.get("input", [])
            }
        return self._inputs[model]

    async def check_generate(self, model: str, endpoint: str, body: bytes) -> JSONResponse | None:
        """400 for a generate body tritonserver would mishandle; None when it may pass."""
        if not body.strip():
            return error(
                400,
                "the request body is empty: send a JSON object of inputs, e.g. "
                '{"text_input": "Hi", "max_tokens": 16}',
            )
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(400, f"the request body is not valid JSON: {e}")
        inputs = await self.model_inputs(model)
        if inputs is None:
            return None  # tritonserver answers for an unknown model
        try:
            check_json_body(payload, inputs)
        except RequestError as e:
            return error(400, str(e))
        if endpoint == "generate" and payload.get("stream") is True:
            return error(
                400, "stream: true needs the generate_stream endpoint (generate returns one response)"
            )
        return None

    async def proxy(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.max_body_bytes)
        except BodyTooLarge as e:
            return error(
                413,
                f"the request body is {e.args[0]} bytes; at most {self.max_body_bytes} are accepted "
                "(dspark serve --max-body-bytes)",
            )
        except ClientDisconnect:
            return Response(status_code=499)
        match = GENERATE.match(request.url.path)
        if match and request.method == "POST":
            rejected = await self.check_generate(match["model"], match["ep"], body)
            if rejected is not None:
                return rejected
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream = self.client.build_request(
            request.method, request.url.path, params=request.query_params, headers=headers, content=body
        )
        try:
            response = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            return error(502, f"tritonserver is not answering: {e!r}")
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}

        async def relay():
            try:  # a client that goes away cancels this generator: the upstream connection closes
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)

    async def close(self) -> None:
        await self.client.aclose()


def create_app(upstream: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, openai: Any = None) -> Starlette:
    """The front app. `openai`: a `dspark.serving.openai_api.OpenAIConfig` to serve /v1 too."""
    front = Front(upstream, max_body_bytes)
    routes = []
    if openai is not None:
        from dspark.serving.openai_api import routes as openai_routes

        routes += openai_routes(front, openai)
    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]
    routes.append(Route("/{path:path}", front.proxy, methods=methods))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await front.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.front = front
    return app
