"""Send a prompt to the DSpark Triton ensemble and print the continuation.

gRPC (tritonclient, bidirectional stream; `--stream` prints tokens as they arrive) or HTTP
(the `generate` / `generate_stream` endpoints, stdlib only). Tensor names: docs/architecture.md §10.

    python clients/generate_client.py --protocol grpc --url localhost:8001 --prompt "Hi" --stream
    python clients/generate_client.py --protocol http --url localhost:8000 --prompt "Hi" --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np

MODEL = "ensemble"


class GenerateError(RuntimeError):
    """The server rejected or failed the request (message from the server; `status` = HTTP
    status or gRPC status name)."""

    def __init__(self, message: str, status: int | str | None = None):
        super().__init__(message)
        self.status = status


def request_fields(
    prompt: str,
    max_tokens: int,
    stream: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
) -> dict:
    """The ensemble's inputs; None means "leave the optional input out" (server default)."""
    fields = {"text_input": prompt, "max_tokens": max_tokens, "stream": stream, "temperature": temperature,
              "top_p": top_p, "top_k": top_k, "seed": seed, "stop": stop}
    return {k: v for k, v in fields.items() if v is not None}


def _grpc_inputs(fields: dict):
    import tritonclient.grpc as grpcclient

    spec = {"text_input": ("BYTES", np.object_), "max_tokens": ("INT32", np.int32), "stream": ("BOOL", bool),
            "temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32), "top_k": ("INT32", np.int32),
            "seed": ("UINT64", np.uint64), "stop": ("BYTES", np.object_)}
    inputs = []
    for name, value in fields.items():
        dtype_name, dtype = spec[name]
        values = [s.encode() for s in value] if name == "stop" else [value]
        values = [v.encode() if isinstance(v, str) else v for v in values]
        array = np.array(values, dtype=dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), dtype_name)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def generate_grpc(url: str, prompt: str, max_tokens: int, stream: bool = True, timeout: float = 300,
                  **params) -> Iterator[str]:
    """Yield text pieces over one gRPC bidirectional stream (one piece when not `stream`)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    fields = request_fields(prompt, max_tokens, stream, **params)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    done = False  # the server sent its final response (or an error)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(MODEL, _grpc_inputs(fields), enable_empty_final_response=True)
        while not done:
            result, error = results.get(timeout=timeout)
            if error is not None:
                done = True
                status = error.status() if isinstance(error, InferenceServerException) else None
                raise GenerateError(error.message() if hasattr(error, "message") else str(error), status)
            done = result.get_response().parameters["triton_final_response"].bool_param
            output = result.as_numpy("text_output")
            if output is not None:
                yield "".join(x.decode("utf-8") for x in output.reshape(-1))
    finally:
        # Cancel only a request still running (the caller stopped reading): cancelling a
        # finished stream keeps the ensemble referenced in tritonserver 2.51 until exit.
        client.stop_stream(cancel_requests=not done)
        client.close()


def generate_http(url: str, prompt: str, max_tokens: int, stream: bool = False, timeout: float = 300,
                  **params) -> Iterator[str]:
    """Yield text pieces from HTTP `generate_stream` (server-sent events) or `generate` (one piece)."""
    fields = request_fields(prompt, max_tokens, stream, **params)
    base = url if url.startswith("http") else f"http://{url}"
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(f"{base}/v2/models/{MODEL}/{endpoint}", data=json.dumps(fields).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            if not stream:
                yield json.loads(response.read())["text_output"]
                return
            for line in response:  # SSE: "data: {json}" lines separated by blank lines
                line = line.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    raise GenerateError(event["error"])
                yield event["text_output"]
    except urllib.error.HTTPError as e:
        body = e.read().decode("utf-8", errors="replace")
        try:
            message = json.loads(body)["error"]
        except (ValueError, KeyError):
            message = body
        raise GenerateError(message, e.code) from None


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
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    args = p.parse_args(argv)
    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    generate = generate_grpc if args.protocol == "grpc" else generate_http
    params = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                  stop=args.stop)
    try:
        for piece in generate(url, args.prompt, args.max_tokens, stream=args.stream, **params):
            print(piece, end="", flush=True)
    except GenerateError as e:
        print(f"\nerror ({e.status}): {e}", file=sys.stderr)
        return 1
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
