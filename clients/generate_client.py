"""Send a prompt to the DSpark Triton ensemble and print the continuation, then TTFT, tokens/s and τ.

The request is TensorRT-LLM's ensemble format (docs/architecture.md §10): `text_input`,
`max_tokens`, `stream`, `temperature`, `top_p`, `top_k`, `seed`, `stop_words`, ... -> `text_output`;
any client of a TensorRT-LLM ensemble can call this server the same way.
gRPC (tritonclient, bidirectional stream; `--stream` prints text as it arrives) or HTTP (the
`generate` / `generate_stream` endpoints, stdlib only).

    python clients/generate_client.py --protocol grpc --url localhost:8001 --prompt "Hi" --stream
    python clients/generate_client.py --protocol http --url localhost:8000 --prompt "Hi" \\
        --max-tokens 32 --stop "\\n\\n"

After the text, one line on stderr: time to first token, output tokens per second and τ (tokens
per target step, from the server's speculative-decoding counters: return_perf_metrics).
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

MODEL = "ensemble"
# name -> (Triton type, numpy type): the ensemble's inputs this client sends (batch dimension 1).
TYPES = {
    "text_input": ("BYTES", np.object_),
    "max_tokens": ("INT32", np.int32),
    "stream": ("BOOL", bool),
    "temperature": ("FP32", np.float32),
    "top_p": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "seed": ("UINT64", np.uint64),
    "stop_words": ("BYTES", np.object_),
    "end_id": ("INT32", np.int32),
    "exclude_input_in_output": ("BOOL", bool),
    "return_num_input_tokens": ("BOOL", bool),
    "return_num_output_tokens": ("BOOL", bool),
    "return_perf_metrics": ("BOOL", bool),
}


class GenerateError(RuntimeError):
    """The server rejected or failed the request (message from the server; `status` = HTTP
    status or gRPC status name)."""

    def __init__(self, message: str, status: int | str | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Stats:
    """What the responses said about the request (filled while generating)."""

    start: float = 0.0
    first_text_s: float | None = None  # client-side time to the first piece of text
    end_s: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    accepted_drafts: int = 0  # total_accepted_draft_tokens
    verified_drafts: int = 0  # total_draft_tokens

    def observe(self, outputs: dict, text: str) -> None:
        now = time.perf_counter() - self.start
        if text and self.first_text_s is None:
            self.first_text_s = now
        self.end_s = now
        self.input_tokens = int(outputs.get("num_input_tokens", self.input_tokens))
        self.output_tokens += int(outputs.get("num_output_tokens", 0))
        self.accepted_drafts = int(outputs.get("total_accepted_draft_tokens", self.accepted_drafts))
        self.verified_drafts = int(outputs.get("total_draft_tokens", self.verified_drafts))

    @property
    def tau(self) -> float | None:
        """Tokens per target verify step, the bonus included: the first token comes from the
        prefill, each later step emits its accepted drafts + 1."""
        steps = self.output_tokens - 1 - self.accepted_drafts
        return (self.output_tokens - 1) / steps if steps > 0 else None

    def line(self) -> str:
        ttft = "n/a" if self.first_text_s is None else f"{self.first_text_s:.3f} s"
        rate = self.output_tokens / self.end_s if self.end_s > 0 else 0.0
        tau = "n/a" if self.tau is None else f"{self.tau:.2f}"
        return (
            f"TTFT {ttft} | {self.output_tokens} tokens in {self.end_s:.2f} s = {rate:.1f} tokens/s | "
            f"τ {tau} ({self.accepted_drafts}/{self.verified_drafts} drafts accepted)"
        )


def request_fields(
    prompt: str,
    max_tokens: int,
    stream: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    end_id: int | None = None,
    stats: bool = True,
) -> dict:
    """The ensemble's inputs; None means "leave the optional input out" (server default).
    The output is the continuation only (exclude_input_in_output)."""
    fields = {
        "text_input": prompt,
        "max_tokens": max_tokens,
        "stream": stream,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop_words": stop or None,
        "end_id": end_id,
        "exclude_input_in_output": True,
    }
    if stats:
        fields |= {
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
            "return_perf_metrics": True,
        }
    return {k: v for k, v in fields.items() if v is not None}


def grpc_inputs(fields: dict):
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in fields.items():
        dtype_name, dtype = TYPES[name]
        values = value if isinstance(value, list) else [value]
        values = [v.encode() if isinstance(v, str) else v for v in values]
        array = np.array([values], dtype=dtype)  # [1, n]: the batch dimension
        tensor = grpcclient.InferInput(name, list(array.shape), dtype_name)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _grpc_outputs(result) -> dict:
    out = {}
    for o in result.get_response().outputs:
        value = result.as_numpy(o.name)
        if value is not None and o.name != "text_output":
            out[o.name] = value.reshape(-1)[0].item()
    return out


def generate_grpc(
    url: str,
    prompt: str,
    max_tokens: int,
    stream: bool = True,
    timeout: float = 300,
    stats: Stats | None = None,
    model: str = MODEL,
    **params,
) -> Iterator[str]:
    """Yield text pieces over one gRPC bidirectional stream (one piece when not `stream`)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    stats = stats if stats is not None else Stats()
    stats.start = time.perf_counter()
    fields = request_fields(prompt, max_tokens, stream, **params)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    done = False  # the server sent its final response (or an error)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, grpc_inputs(fields), enable_empty_final_response=True)
        while not done:
            result, error = results.get(timeout=timeout)
            if error is not None:
                done = True
                status = error.status() if isinstance(error, InferenceServerException) else None
                raise GenerateError(error.message() if hasattr(error, "message") else str(error), status)
            done = result.get_response().parameters["triton_final_response"].bool_param
            output = result.as_numpy("text_output")
            text = "" if output is None else "".join(x.decode("utf-8") for x in output.reshape(-1))
            stats.observe(_grpc_outputs(result), text)
            if output is not None:
                yield text
    finally:
        client.stop_stream(cancel_requests=not done)  # a caller that stops reading cancels the request
        client.close()


def generate_http(
    url: str,
    prompt: str,
    max_tokens: int,
    stream: bool = False,
    timeout: float = 300,
    stats: Stats | None = None,
    model: str = MODEL,
    **params,
) -> Iterator[str]:
    """Yield text pieces from HTTP `generate_stream` (server-sent events) or `generate` (one piece)."""
    stats = stats if stats is not None else Stats()
    stats.start = time.perf_counter()
    fields = request_fields(prompt, max_tokens, stream, **params)
    base = url if url.startswith("http") else f"http://{url}"
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(
        f"{base}/v2/models/{model}/{endpoint}",
        data=json.dumps(fields).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            if not stream:
                event = json.loads(response.read())
                stats.observe(event, event["text_output"])
                yield event["text_output"]
                return
            for line in response:  # SSE: "data: {json}" lines separated by blank lines
                line = line.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:") :])
                if "error" in event:
                    raise GenerateError(event["error"])
                stats.observe(event, event.get("text_output", ""))
                yield event.get("text_output", "")
    except urllib.error.HTTPError as e:
        body = e.read().decode("utf-8", errors="replace")
        try:
            message = json.loads(body)["error"]
        except (ValueError, KeyError):
            message = body
        raise GenerateError(message, e.code) from None


def unescape(text: str) -> str:
    r"""`--stop "\n\n"` as typed in a shell arrives as backslash-n: read \n, \t, \r and \\ as escapes."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "ntr\\":
            out.append({"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="host:port (default localhost:8001 for grpc, :8000 for http)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help=r'stop string (repeatable; "\n" is a newline)')
    p.add_argument(
        "--model", default=MODEL, help="ensemble (default), or dspark to call the BLS model directly"
    )
    args = p.parse_args(argv)
    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    generate = generate_grpc if args.protocol == "grpc" else generate_http
    params = dict(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=[unescape(s) for s in args.stop] if args.stop else None,
    )
    stats = Stats()
    try:
        for piece in generate(
            url, args.prompt, args.max_tokens, stream=args.stream, stats=stats, model=args.model, **params
        ):
            print(piece, end="", flush=True)
    except GenerateError as e:
        print(f"\nerror ({e.status}): {e}", file=sys.stderr)
        return 1
    print()
    print(stats.line(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
