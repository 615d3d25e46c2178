"""Soak test (issue 14 item 3): `dspark serve` under saturating concurrency for a long run,
mixing streaming and non-streaming requests, OpenAI requests (when the frontend is up),
cancellations, client disconnects and malformed requests (loadtest/soak_users.py), then
checks that the server is back where it started:

    results/soak.json = {"requests", "unexpected_failures", "answered_or_clean_error",
                         "slots_in_use_after", "rss_mb_before", "rss_mb_after",
                         "shm_regions_after", ...}

RSS is the resident memory of the server's whole process tree (tritonserver and its Python
backend stubs), measured once warmed up and again once idle after the soak; the goal is
rss_mb_after <= rss_mb_before * (1 + --rss-margin). Beside it, memory_mb_before / _after split
the same tree into PSS (shared pages counted once), private anonymous memory, the shared-memory
pool and mapped files, per process, and memory_timeline samples them every --sample-every
seconds during the soak, to tell a pool that fills up and stays from a leak that keeps growing.
Shared-memory regions: those the server's
processes map (/proc/PID/maps; other servers on the machine are not counted), while it runs,
and how many of them are left in /dev/shm after it stops (shm_regions_after, must be 0).

    flock /tmp/dspark-heavy.lock python loadtest/soak.py --duration 600 --users 16
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import locust_command, metric_sum, read_records, scrape  # noqa: E402

from dspark.paths import MODEL_REPOSITORY, REPO_ROOT, RESULTS  # noqa: E402
from dspark.serving.triton_server import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def memory_mb(pid: int) -> dict:
    """Memory of the server's process tree in MB. `rss` sums VmRSS, which counts a shared page
    once per process that maps it (the Python backend's shm pool is mapped by tritonserver and
    by every stub); `pss` shares such pages out (each counted once in total); `anon` is private
    heap (where a leak grows), `shmem` the shared-memory pool, `file` mapped libraries and
    weights. `by_process` is each process's PSS, keyed by its Triton model (or command) and pid."""
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    total = dict.fromkeys(["rss", "pss", "anon", "file", "shmem"], 0.0)
    by_process = {}
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                key = keys.get(line.split(":", 1)[0] + ":")
                if key:
                    total[key] += int(line.split()[1]) / 1024
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
            pss = next((int(line.split()[1]) / 1024 for line in rollup if line.startswith("Pss:")), 0.0)
            name = process_name(p)
        except OSError:
            continue
        total["pss"] += pss
        by_process[f"{name}:{p}"] = round(pss, 1)
    return {k: round(v, 1) for k, v in total.items()} | {"by_process": by_process}


def process_name(pid: int) -> str:
    """The Triton model a Python-backend stub serves (its cmdline names .../<model>/1/model.py),
    else the process's command name."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    model = next((Path(a.decode(errors="replace")).parent.parent.name for a in args
                  if a.endswith(b"/1/model.py")), None)
    return model or Path(f"/proc/{pid}/comm").read_text().strip()


class MemorySampler(threading.Thread):
    """Samples memory_mb(pid) every `every` seconds while the soak runs (a plateau is a pool
    filling up; a steady climb is a leak)."""

    def __init__(self, pid: int, every: float):
        super().__init__(daemon=True)
        self.pid, self.every, self.t0 = pid, every, time.monotonic()
        self.samples: list[dict] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            m = memory_mb(self.pid)
            self.samples.append({"t_s": round(time.monotonic() - self.t0, 1),
                                 **{k: v for k, v in m.items() if k != "by_process"}})

    def stop(self) -> list[dict]:
        self.stopped.set()
        self.join(timeout=5)
        return self.samples


def shm_regions(pid: int) -> set[str]:
    """Shared-memory regions (/dev/shm) mapped by the server's process tree. Other servers on
    the same machine have their own; only ours count."""
    names = set()
    for p in process_tree(pid):
        try:
            maps = Path(f"/proc/{p}/maps").read_text()
        except OSError:
            continue
        names.update(m.split("/dev/shm/", 1)[1].split()[0] for m in maps.splitlines() if "/dev/shm/" in m)
    return names


class Server:
    """`dspark serve` on free ports (with the OpenAI frontend when the CLI offers it)."""

    def __init__(self, args: argparse.Namespace, log: Path):
        self.http, self.grpc, self.metrics = free_port(), free_port(), free_port()
        cmd = [
            sys.executable,
            "-m",
            "dspark.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--http-port",
            str(self.http),
            "--grpc-port",
            str(self.grpc),
            "--metrics-port",
            str(self.metrics),
            "--model",
            args.model,
            "--policy",
            args.policy,
            "--capacity",
            str(args.capacity),
            "--model-repository",
            str(args.model_repository),
            *(["--sps", args.sps] if args.sps else []),
            *(["--drafter", args.drafter] if args.drafter else []),
        ]
        help_text = subprocess.run(
            [sys.executable, "-m", "dspark.cli", "serve", "--help"],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
        ).stdout
        self.openai = None  # `dspark serve --openai` serves /v1 on the HTTP port
        if "--openai" in help_text and not args.no_openai:
            cmd.append("--openai")
            self.openai = f"http://127.0.0.1:{self.http}"
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dspark serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as r:
                    if r.status == 200 and (self.openai is None or self._openai_up()):
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout:.0f} s; see {self.log.name}")

    def _openai_up(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.openai}/v1/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def openai_endpoints(model_folder: str) -> str:
    """chat and completions, or completions alone when the model has no chat template."""
    folder = Path(model_folder)
    config = folder / "tokenizer_config.json"
    has_template = (folder / "chat_template.jinja").is_file() or (
        config.is_file() and "chat_template" in json.loads(config.read_text())
    )
    return "chat,completions" if has_template else "completions"


def wait_idle(metrics_url: str, timeout: float = 120) -> dict[str, float]:
    """Metrics once no request is pending or active (the exporter refreshes every 0.5 s)."""
    deadline = time.monotonic() + timeout
    samples = scrape(metrics_url)
    while time.monotonic() < deadline:
        samples = scrape(metrics_url)
        if (
            metric_sum(samples, "dspark_pending_requests") == 0
            and metric_sum(samples, "dspark_active_requests") == 0
        ):
            time.sleep(1.0)
            return scrape(metrics_url)
        time.sleep(0.5)
    return samples


def run_locust(
    args: argparse.Namespace, server: Server, out: Path, duration: float, users: int, classes: list[str]
) -> subprocess.CompletedProcess:
    openai = (["--openai-url", server.openai, "--openai-endpoints", openai_endpoints(args.tokenizer)]
              if server.openai else [])
    cmd = locust_command(HERE / "soak_users.py", users, duration, f"http://127.0.0.1:{server.http}",
                         f"127.0.0.1:{server.grpc}", out, args,
                         ["--stop-timeout", "30", "--summary-json", f"{out}_summary.json", *openai, *classes])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 300, cwd=REPO_ROOT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--drafter", default=None, help="default: the served default (config.pbtxt)")
    p.add_argument("--policy", default="dspark")
    p.add_argument("--capacity", type=int, default=8)
    p.add_argument("--users", type=int, default=16, help="concurrent users (saturating: above --capacity)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of soak")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of plain load before the baseline")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompt-chars", type=int, default=1500)
    p.add_argument("--prompts", default="code,math,prose")
    p.add_argument("--tokenizer", default=None, help="default: the served model's folder")
    p.add_argument("--sps", default="", help="SPS table of the dspark policy (default: the server's)")
    p.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY)
    p.add_argument("--rss-margin", type=float, default=0.15, help="allowed RSS growth over the baseline")
    p.add_argument("--sample-every", type=float, default=30.0, help="seconds between memory samples")
    p.add_argument("--no-openai", action="store_true", help="leave the OpenAI frontend out")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    p.add_argument(
        "--workdir", type=Path, default=None, help="Locust CSVs and the server log (default: a temp dir)"
    )
    args = p.parse_args(argv)
    from dspark import wiring

    args.tokenizer = args.tokenizer or str(wiring.model_folder(wiring.resolve(model=args.model).model))
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dspark-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    ours: set[str] = set()  # every region our server mapped at some point
    server = Server(args, work / "server.log")
    try:
        server.wait_ready(args.ready_timeout)
        metrics_url = f"http://127.0.0.1:{server.metrics}/metrics"
        classes = ["SoakGrpcUser", "SoakHttpUser"] + (["SoakOpenAIUser"] if server.openai else [])
        warm = run_locust(
            args,
            server,
            work / "warmup",
            args.warmup,
            max(2, args.users // 4),
            ["SoakGrpcUser", "SoakHttpUser"],
        )
        wait_idle(metrics_url)
        mem_before = memory_mb(server.proc.pid)
        rss_before = mem_before["rss"]
        ours |= shm_regions(server.proc.pid)
        shm_running_before = len(ours)
        print(
            f"[soak] baseline RSS {rss_before:.0f} MB; soaking {args.duration:.0f} s with {args.users} users "
            f"({', '.join(classes)})",
            flush=True,
        )
        sampler = MemorySampler(server.proc.pid, args.sample_every)
        sampler.start()
        proc = run_locust(args, server, work / "soak", args.duration, args.users, classes)
        timeline = sampler.stop()
        idle = wait_idle(metrics_url)
        mem_after = memory_mb(server.proc.pid)
        rss_after = mem_after["rss"]
        now = shm_regions(server.proc.pid)
        ours |= now
        shm_running_after = len(now)
        alive = server.proc.poll() is None
    finally:
        code = server.stop()
    records = read_records(work / "soak_records.csv") if (work / "soak_records.csv").is_file() else []
    unexpected = [r for r in records if r.error]
    by_kind = {
        k: sum(r.kind == k and not r.error for r in records) for k in ("ok", "cancelled", "bad_request")
    }
    result = {
        "requests": len(records),
        "unexpected_failures": len(unexpected),
        "answered_or_clean_error": sum(by_kind.values()),
        "slots_in_use_after": metric_sum(idle, "dspark_active_requests"),
        "pending_after": metric_sum(idle, "dspark_pending_requests"),
        "rss_mb_before": round(rss_before, 1),
        "rss_mb_after": round(rss_after, 1),
        "rss_margin": args.rss_margin,
        "rss_within_margin": rss_after <= rss_before * (1 + args.rss_margin),
        "shm_regions_after": sum(Path("/dev/shm", name).exists() for name in ours),  # left after exit
        "memory_mb_before": mem_before,
        "memory_mb_after": mem_after,
        "memory_timeline": timeline,
        "shm_regions_while_serving": {"before": shm_running_before, "after": shm_running_after},
        "by_kind": by_kind,
        "by_user": {u: sum(r.user == u for r in records) for u in sorted({r.user for r in records})},
        "unexpected_examples": sorted({(r.user, r.error[:200]) for r in unexpected})[:10],
        "server_alive_after": alive,
        "server_exit_code": code,
        "locust_exit_code": proc.returncode,
        "warmup_locust_exit_code": warm.returncode,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir", "model_repository")},
        "openai": server.openai is not None,
    }
    result["settings"]["tokenizer"] = os.path.relpath(args.tokenizer, REPO_ROOT)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: result[k] for k in list(result)[:9]}, indent=2))
    print(f"[soak] Locust CSVs and the server log: {work}")
    ok = (
        not unexpected
        and result["slots_in_use_after"] == 0
        and result["rss_within_margin"]
        and result["shm_regions_after"] == 0
        and alive
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
