"""Start tritonserver on the model repository with a target checkpoint, wait until it is
ready, print the endpoints and example client commands, and stop cleanly on Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from dspark import paths, wiring
from dspark.serving.triton_server import TritonServer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", type=Path, default=paths.MODEL_REPOSITORY)
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP and gRPC endpoints bind to")
    p.add_argument("--http-port", type=int, default=8000, help="0 = pick a free port")
    p.add_argument("--grpc-port", type=int, default=8001, help="0 = pick a free port")
    p.add_argument("--metrics-port", type=int, default=8002, help="0 = pick a free port")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    # Engine settings: unset flags keep the config.pbtxt parameters (dspark.wiring.Spec).
    for name, help_text in (("model", "smollm2, demo or a Hugging Face folder"),
                            ("dtype", "auto, fp32, bf16"),
                            ("device", "auto, cpu, cuda[:N]"), ("capacity", "KV-cache slots"),
                            ("max_seq_len", "tokens per slot"), ("num_threads", "torch CPU threads"),
                            ("drafter", "none, auto, ngram[:N], a drafter name or folder"),
                            ("policy", "dspark, mtp1, fixed:k, ..."), ("gamma", "draft block size γ"),
                            ("sps", "auto, gpu_shaped or an sps.json path")):
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


def usage(server: TritonServer) -> str:
    http, grpc = server.http_url, server.grpc_url
    return f"""
DSpark is serving model `ensemble` (pid {server.pid})
  HTTP     http://{http}    (generate, generate_stream, /v2/health/ready)
  gRPC     {grpc}
  metrics  {server.metrics_url}

Try:
  curl -s -X POST http://{http}/v2/models/ensemble/generate \\
       -d '{{"text_input": "def fibonacci(n):", "max_tokens": 32}}'
  curl -s -N -X POST http://{http}/v2/models/ensemble/generate_stream \\
       -d '{{"text_input": "def fibonacci(n):", "max_tokens": 32, "stream": true}}'
  python clients/generate_client.py --protocol grpc --url {grpc} --prompt "def fibonacci(n):" --stream

Ctrl-C stops the server.
"""


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    try:
        wiring.model_folder(wiring.resolve(model=args.model).model)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = TritonServer(args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
                          host=args.host, env=model_env(args), log_to_console=True)
    signal.signal(signal.SIGINT, _interrupt)  # also when started with SIGINT ignored (background)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` / `docker stop` take the Ctrl-C path
    try:
        server.start()
        server.wait_ready(args.ready_timeout)
        print(usage(server), flush=True)
        server.process.wait()  # returns if the server dies on its own
        print(f"tritonserver exited with code {server.process.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping tritonserver ...", file=sys.stderr, flush=True)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not orphan the server
            signal.signal(sig, signal.SIG_IGN)
        server.stop()
