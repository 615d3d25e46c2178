"""Run the real `dspark serve` (tritonserver + the HTTP front) for the server tests: free ports,
wait for readiness, scrape metrics, stop by pid (SIGINT, then SIGKILL of the process group)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from dspark.paths import MODEL_REPOSITORY, REPO_ROOT
from dspark.serving.triton_server import free_port

DSPARK = Path(sys.executable).parent / "dspark"


class Serve:
    def __init__(
        self,
        *flags: str,
        repo: Path = MODEL_REPOSITORY,
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ):
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.cmd = [
            str(DSPARK),
            "serve",
            "--model-repository",
            str(repo),
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            "--metrics-port",
            str(self.metrics_port),
            *flags,
        ]
        self.env = {**os.environ, **(env or {})}
        self.log = log
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> Serve:
        out = open(self.log, "wb") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300) -> Serve:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"dspark serve exited ({self.process.returncode}):\n{self.log_text()[-3000:]}"
                )
            if self.is_ready():
                return self
            time.sleep(0.5)
        raise TimeoutError(f"dspark serve not ready after {timeout} s:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def stop(self, timeout: float = 60) -> float:
        """SIGINT by pid; -> seconds until the process exited (SIGKILL to its group after timeout)."""
        if self.process is None or self.process.poll() is not None:
            return 0.0
        start = time.monotonic()
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        took = time.monotonic() - start
        for pgid in [self.process.pid] + self.triton_pids():  # tritonserver has a session of its own
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.wait()
        return took

    def triton_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"tritonserver pid (\d+)", self.log_text())]


def scrape(metrics_url: str) -> dict[str, float]:
    """dspark_* samples on the metrics port, keyed by name plus labels as printed."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = re.findall(r"^(dspark_\S+) (\S+)$", text, flags=re.MULTILINE)
    return {name: float(value) for name, value in samples}


def wait_idle(metrics_url: str, timeout: float = 60.0) -> dict[str, float]:
    """Metrics once no request is pending (the exporter refreshes every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        first = scrape(metrics_url)
        if first.get("dspark_pending_requests") == 0 and first.get("dspark_active_requests") == 0:
            time.sleep(0.7)  # one more refresh: counters of the last step are in
            second = scrape(metrics_url)
            if second == first:
                return second
        if time.monotonic() > deadline:
            raise AssertionError(f"server never went idle: {first}")
        time.sleep(0.2)


def process_group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members
