"""`dspark serve`: tritonserver on the model repository behind the dspark HTTP front.

- gRPC and metrics: tritonserver itself, on --host (127.0.0.1 unless you say otherwise).
- HTTP: the front (`dspark.serving.front`) on --host:--http-port, forwarding to tritonserver's
  HTTP on a private loopback port: request bodies are size-limited and generate bodies
  type-checked there (a 4 MiB body crashes tritonserver 2.51). `--openai` adds /v1/models,
  /v1/completions and /v1/chat/completions (`dspark.serving.openai_api`).
Prints what it binds and how to call it; without a GPU, the CUDA / NVML lines tritonserver logs
are marked harmless. If tritonserver dies, this exits non-zero saying how (signal, exit code)
and with its last log lines; its shared-memory regions are removed either way.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

from dspark import paths, wiring
from dspark.serving.front import DEFAULT_MAX_BODY_BYTES, create_app
from dspark.serving.triton_server import TritonServer, death_reason, has_gpu

MODEL_NAME = "dspark"  # the id OpenAI clients use


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", type=Path, default=paths.MODEL_REPOSITORY)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address HTTP, gRPC and metrics bind to (default 127.0.0.1: this machine only; "
        "0.0.0.0 = every interface)",
    )
    p.add_argument("--http-port", type=int, default=8000, help="0 = pick a free port")
    p.add_argument("--grpc-port", type=int, default=8001, help="0 = pick a free port")
    p.add_argument("--metrics-port", type=int, default=8002, help="0 = pick a free port")
    p.add_argument("--openai", action="store_true", help="also serve the OpenAI-compatible /v1 endpoints")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest HTTP request body accepted (default %(default)s)",
    )
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for readiness")
    p.add_argument(
        "--exit-timeout",
        type=int,
        default=30,
        help="seconds tritonserver waits for in-flight requests when stopping",
    )
    # Engine settings: unset flags keep the config.pbtxt parameters (dspark.wiring.Spec).
    for name, help_text in (
        ("model", "smollm2, demo or a Hugging Face folder"),
        ("dtype", "auto, fp32, bf16, q4_1"),
        ("device", "auto, cpu, cuda[:N]"),
        ("capacity", "KV-cache slots"),
        ("max_seq_len", "tokens per slot"),
        ("num_threads", "torch CPU threads"),
        ("drafter", "none, auto, ngram[:N], a drafter name or folder, ngram[:N]+<trained>"),
        ("policy", "dspark, mtp1, fixed:k, ..."),
        ("gamma", "draft block size γ"),
        ("sps", "auto, gpu_shaped or an sps.json path"),
    ):
        kind = int if name in ("capacity", "max_seq_len", "num_threads", "gamma") else str
        p.add_argument("--" + name.replace("_", "-"), type=kind, help=f"{help_text} (default: config.pbtxt)")


def model_env(args: argparse.Namespace) -> dict[str, str]:
    """The DSPARK_* overrides the models read through dspark.wiring (see config.pbtxt)."""
    env = {}
    for name, var in wiring.ENV_VARS.items():
        value = getattr(args, name, None)
        if value is not None:
            env[var] = str(Path(value).resolve()) if name == "model" and Path(value).is_dir() else str(value)
    return env


def usage(server: TritonServer, host: str, http_port: int, args: argparse.Namespace) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    http, grpc = f"{shown}:{http_port}", server.grpc_url
    scope = (
        "this machine only (--host 0.0.0.0 serves other machines too)"
        if host in ("127.0.0.1", "localhost")
        else f"{host}: reachable from other machines"
    )
    openai = (
        f"  OpenAI   http://{http}/v1   (models, completions, chat/completions; model id {MODEL_NAME!r})\n"
        if args.openai
        else ""
    )
    openai_try = (
        f"  curl -s http://{http}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'       -d \'{{"model": "{MODEL_NAME}", "messages": [{{"role": "user", "content": "Hi"}}]}}\'\n'
        if args.openai
        else ""
    )
    return f"""
DSpark is serving model `ensemble` (tritonserver pid {server.pid}), bound to {scope}
  HTTP     http://{http}    (Triton HTTP API: generate, generate_stream, /v2/health/ready;
           request bodies up to {args.max_body_bytes} bytes)
  gRPC     {grpc}
  metrics  {server.metrics_url}
{openai}
Try:
  curl -s -X POST http://{http}/v2/models/ensemble/generate \\
       -d '{{"text_input": "def fibonacci(n):", "max_tokens": 32}}'
  curl -s -N -X POST http://{http}/v2/models/ensemble/generate_stream \\
       -d '{{"text_input": "def fibonacci(n):", "max_tokens": 32, "stream": true}}'
  python clients/generate_client.py --protocol grpc --url {grpc} --prompt "def fibonacci(n):" --stream
{openai_try}
Ctrl-C stops the server.
"""


CPU_NOTE = (
    "note: no GPU here. tritonserver still logs a few CUDA / NVML / DCGM lines while it starts "
    "('CudaDriverHelper has not been initialized', 'unable to create stream ... CUDA driver version "
    "is insufficient'): they are harmless on the CPU and marked as such below."
)


def listen(host: str, port: int) -> socket.socket | None:
    """The front's listening socket, bound now (port 0 = any free one), before tritonserver and its
    stubs open ephemeral ports that could take a port merely seen free; None when in use."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host or "0.0.0.0", port))
    except OSError:
        s.close()
        return None
    s.listen(2048)
    return s


def warm_up(server: TritonServer) -> None:
    """One 1-token request: `dspark` connects to its target and drafter models on its first
    request, so after this the engine is built and its metrics are exported."""
    import json
    import urllib.request

    body = json.dumps({"text_input": "Hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/generate", data=body)
    try:
        urllib.request.urlopen(request, timeout=600).read()
    except Exception as e:  # serving still starts; the first client request will say what is wrong
        print(f"warning: warm-up request failed: {e}", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from dspark.serving.openai_api import OpenAIConfig

    try:
        folder = wiring.model_folder(wiring.resolve(model=args.model).model)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sock = listen(args.host, args.http_port)
    if sock is None:
        print(f"error: HTTP port {args.http_port} on {args.host} is in use (--http-port)", file=sys.stderr)
        return 2
    http_port = sock.getsockname()[1]
    if not has_gpu():
        print(CPU_NOTE, file=sys.stderr, flush=True)
    server = TritonServer(
        args.model_repository,
        0,
        args.grpc_port,
        args.metrics_port,
        host=args.host,
        http_host="127.0.0.1",
        env=model_env(args),
        log_to_console=True,
        extra_args=[f"--exit-timeout-secs={args.exit_timeout}"],
    )
    openai = OpenAIConfig(MODEL_NAME, str(folder)) if args.openai else None
    app = create_app(f"http://{server.http_url}", args.max_body_bytes, openai)
    front = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=http_port, log_level="warning", timeout_graceful_shutdown=5)
    )
    died: list[str] = []

    def watch() -> None:  # tritonserver dying takes the front down with a reason
        while server.process is not None and server.process.poll() is None and not front.should_exit:
            time.sleep(0.5)
        if server.process is not None and server.process.poll() is not None and not front.should_exit:
            died.append(death_reason(server.process.returncode))
            front.should_exit = True

    try:
        server.start()
        server.wait_ready(args.ready_timeout)
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        server.stop()
        sock.close()
        return 1
    except KeyboardInterrupt:
        server.stop()
        sock.close()
        return 130
    warm_up(server)
    print(usage(server, args.host, http_port, args), flush=True)
    threading.Thread(target=watch, name="tritonserver-watch", daemon=True).start()
    try:
        front.run(sockets=[sock])  # returns on Ctrl-C / SIGTERM, or when the watcher sees tritonserver die
    except KeyboardInterrupt:  # uvicorn re-raises the signal it handled
        pass
    finally:
        if died:
            print(
                f"error: tritonserver {died[0]}; its last log lines:\n{server.log_tail(20)}", file=sys.stderr
            )
        else:
            print("stopping tritonserver ...", file=sys.stderr, flush=True)
        server.stop()
    return 1 if died else 0
