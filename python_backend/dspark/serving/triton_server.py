"""Run the real `tritonserver` shipped in the nvidia-pytriton wheel (docs/architecture.md §10).

The wheel holds the server binary, its shared libraries (`nvidia_pytriton.libs`), the
Python backend and one backend stub per Python version. `TritonServer` assembles a
backend folder for the running Python, starts the server on a model repository, waits
for `/v2/health/ready` and stops it by its own pid. The stub embeds the system
`libpython3.X`; it finds this virtualenv (and so numpy, torch and the editable `dspark`
install) because the venv's `bin/` comes first on PATH, the same trick pytriton uses.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def pytriton_dir() -> Path:
    """The installed `pytriton` package folder."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed: it provides the tritonserver binary")
    return Path(next(iter(spec.submodule_search_locations)))


def tritonserver_binary() -> Path:
    return pytriton_dir() / "tritonserver" / "bin" / "tritonserver"


def server_libs_dir() -> Path:
    """Shared libraries the wheel's server links against (site-packages/nvidia_pytriton.libs)."""
    return pytriton_dir().parent / "nvidia_pytriton.libs"


def prepare_backend_dir(dest: str | Path) -> Path:
    """Create `dest/python/` with the Python backend and the stub for this interpreter;
    returns `dest` for `--backend-directory`."""
    dist = pytriton_dir() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"the pytriton wheel has no Python backend stub for Python {version}")
    python_dir = Path(dest) / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(dist / "backends" / "python" / name, python_dir / name)
    shutil.copy2(stub, python_dir / "triton_python_backend_stub")
    return Path(dest)


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the server: the wheel's libraries, and this venv first on PATH so
    each model's stub runs with this interpreter's site-packages."""
    env = dict(os.environ)
    libs = str(server_libs_dir())
    env["LD_LIBRARY_PATH"] = f"{libs}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else libs
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """One `tritonserver` process serving `model_repository`.

    Port 0 picks a free port. `env` adds environment variables (model overrides such as
    DSPARK_TARGET reach each model's stub this way). The log goes to `log_path` (a temp
    file by default) unless `log_to_console`.
    """

    def __init__(
        self,
        model_repository: str | Path,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        host: str = "0.0.0.0",
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        log_to_console: bool = False,
        extra_args: list[str] | None = None,
    ):
        self.model_repository = Path(model_repository).resolve()
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.host = host
        self.env = env or {}
        self.log_to_console = log_to_console
        self.extra_args = extra_args or []
        self.log_path = Path(log_path) if log_path else None  # set in start() when None
        self.workdir: Path | None = None  # backend folder (+ default log), removed by stop()
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def local_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        return f"{self.local_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.local_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.local_host}:{self.metrics_port}/metrics"

    def command(self, backends: Path) -> list[str]:
        return [
            str(tritonserver_binary()),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            # Our configs are complete; auto-complete would start one extra stub process
            # per Python model just to import model.py (and torch) a second time.
            "--disable-auto-complete-config",
            *self.extra_args,
        ]

    def start(self) -> TritonServer:
        if self.process is not None:
            raise RuntimeError("server already started")
        self.workdir = Path(tempfile.mkdtemp(prefix="dspark-triton-"))
        backends = prepare_backend_dir(self.workdir / "backends")
        self.log_path = self.log_path or self.workdir / "tritonserver.log"
        out = None if self.log_to_console else open(self.log_path, "wb")  # noqa: SIM115
        try:
            # Own session: a terminal Ctrl-C reaches only us, and stop() can end the whole
            # group (the server and its per-model stub processes) by the server's pid.
            self.process = subprocess.Popen(
                self.command(backends),
                env=server_env(self.env),
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            if out:
                out.close()
        atexit.register(self.stop)  # an uncaught exception in the caller must not orphan the server
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        """The server's error lines (model load failures and such) and the last `lines` lines."""
        if self.log_to_console or self.log_path is None or not self.log_path.exists():
            return ""
        log = self.log_path.read_text(errors="replace").splitlines()
        errors = [line[:4000] for line in log[:-lines] if line.startswith("E") or "error" in line.lower()]
        return "\n".join(errors[-20:] + log[-lines:])

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the server reports ready; raise with the log tail if it dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"tritonserver exited (code {code}) before ready:\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT (graceful: in-flight requests finish, models unload), then SIGKILL to the
        server's process group if it is still alive after `timeout`. Returns the exit code."""
        proc = self.process
        if proc is None:
            return None
        atexit.unregister(self.stop)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # the stubs share the server's process group; make sure none outlives it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return proc.returncode

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
