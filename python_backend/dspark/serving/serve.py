"""Start tritonserver on the model repository with a target checkpoint, wait until it is
ready, print the endpoints and example client commands, and stop cleanly on Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from dspark import paths
from dspark.serving.triton_server import TritonServer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=paths.DEMO_TARGET,
                   help="Hugging Face checkpoint folder of the target (default: the demo target; "
                        "env DSPARK_TARGET)")
    p.add_argument("--model-repository", type=Path, default=paths.MODEL_REPOSITORY)
    p.add_argument("--host", default="0.0.0.0", help="address the HTTP and gRPC endpoints bind to")
    p.add_argument("--http-port", type=int, default=8000, help="0 = pick a free port")
    p.add_argument("--grpc-port", type=int, default=8001, help="0 = pick a free port")
    p.add_argument("--metrics-port", type=int, default=8002, help="0 = pick a free port")
    p.add_argument("--capacity", type=int, help="KV-cache slots (default: config.pbtxt)")
    p.add_argument("--max-seq-len", type=int, help="tokens per slot (default: config.pbtxt)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: config.pbtxt)")
    p.add_argument("--num-threads", type=int, help="torch CPU threads in the decode model")
    p.add_argument("--drafter", help="none, ngram[:N], a name under build/demo/drafters or a folder "
                                     "(default: config.pbtxt)")
    p.add_argument("--policy", help="scheduler policy, e.g. dspark, mtp1, fixed:3 (default: config.pbtxt)")
    p.add_argument("--gamma", type=int, help="draft block size γ (default: config.pbtxt)")
    p.add_argument("--sps", help="SPS table: a sps.json path or gpu_shaped (default: config.pbtxt)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")


def model_env(args: argparse.Namespace) -> dict[str, str]:
    """The DSPARK_* overrides every model.py reads (see model_repository/dspark/config.pbtxt)."""
    env = {"DSPARK_TARGET": str(Path(args.model).resolve())}
    for name, value in (("DSPARK_CAPACITY", args.capacity), ("DSPARK_MAX_SEQ_LEN", args.max_seq_len),
                        ("DSPARK_DEVICE", args.device), ("DSPARK_NUM_THREADS", args.num_threads),
                        ("DSPARK_DRAFTER", args.drafter), ("DSPARK_POLICY", args.policy),
                        ("DSPARK_GAMMA", args.gamma), ("DSPARK_SPS", args.sps)):
        if value is not None:
            env[name] = str(value)
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
    model = Path(args.model)
    if not (model / "config.json").is_file() or not (model / "tokenizer.json").is_file():
        print(f"error: no Hugging Face checkpoint (config.json + tokenizer.json) at {model}.\n"
              f"Build the demo target with `make demo-assets`, or pass --model FOLDER.", file=sys.stderr)
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
