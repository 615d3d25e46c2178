"""Run the real `tritonserver` shipped in the nvidia-pytriton wheel (architecture §10).

The wheel holds the server binary, its shared libraries (`nvidia_pytriton.libs`), the
Python backend and one backend stub per Python version. `TritonServer` assembles a
backend folder for the running Python, starts the server on a model repository, waits
for `/v2/health/ready` and stops it by its own pid. The stub embeds the system
`libpython3.X`; it finds this virtualenv (and so numpy, torch and the editable `dspark`
install) because the venv's `bin/` comes first on PATH, the same trick pytriton uses.

Without a GPU the server is started without its GPU metrics and pinned-memory pools; it
still logs a few CUDA lines, which the console relay marks as harmless (`HARMLESS_ON_CPU`).
The Python backend's shared-memory regions get a per-server prefix, so `stop` removes them
from /dev/shm even when the server died (a crash leaves them behind otherwise).
"""

from __future__ import annotations

import atexit
import collections
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

# Lines tritonserver 2.51 logs on a machine without a GPU; they change nothing on the CPU.
HARMLESS_ON_CPU = (
    "CudaDriverHelper has not been initialized",
    "CUDA driver version is insufficient",
    "Failed to initialize NVML",
    "DCGM unable to start",
    "pinned memory pool will not be available",
    "failed to allocate pinned system memory",
)
CPU_NOTE = "  [harmless without a GPU: the CPU build of the models does not use CUDA]"
SHM_DIR = Path("/dev/shm")
# Python backend shared memory: start and grow in 16 MiB steps (a verify step moves logits
# [N, V] between models: ~100 KB per token for a 49k vocabulary in bf16).
SHM_BYTES = 16 << 20


def has_gpu() -> bool:
    """An NVIDIA driver is present (what tritonserver's CUDA code needs)."""
    return Path("/dev/nvidiactl").exists()


def _term_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the thread that started it dies, so a
    `dspark serve` killed outright (SIGKILL, a second signal during shutdown) does not leave an
    orphaned tritonserver holding its ports and shared memory; SIGTERM lets it clean up. Start
    the server from a thread that lives as long as the server (the main thread does)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux / no glibc: no such guarantee
        pass


def death_reason(returncode: int | None) -> str:
    """Human wording of a Popen return code (negative = killed by that signal)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (a crash)" if -returncode in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS) else ""
        return f"killed by {name}{hint}"
    return f"exited with code {returncode}"


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
    # Several model processes share the cores (target, drafter, dspark): OpenMP threads that
    # spin after each parallel region (the default) starve the others; passive ones sleep.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # oneDNN caches one primitive per matmul shape (1 024 by default); the prepacked projections
    # bucket their row counts (linear.row_bucket) so that every shape fits 256 entries and the
    # cache stops churning: the soak's RSS growth fell from +14.8 % to +2.2 % (README "Soak")
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
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
    DSPARK_MODEL reach each model's stub this way). The log goes to `log_path` (a temp
    file by default) unless `log_to_console`, where it is relayed line by line to stderr with
    the CPU-harmless lines marked. Binds `host` (127.0.0.1 unless told otherwise).
    """

    def __init__(
        self,
        model_repository: str | Path,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        log_to_console: bool = False,
        extra_args: list[str] | None = None,
        http_host: str | None = None,
    ):
        self.model_repository = Path(model_repository).resolve()
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.host = host
        self.http_host = (
            http_host or host
        )  # `dspark serve` keeps tritonserver's HTTP private behind its front
        self.env = env or {}
        self.log_to_console = log_to_console
        self.extra_args = extra_args or []
        self.log_path = Path(log_path) if log_path else None  # set in start() when None
        self.workdir: Path | None = None  # backend folder (+ default log), removed by stop()
        self.process: subprocess.Popen | None = None
        self.shm_prefix = f"dspark_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self.recent: collections.deque[str] = collections.deque(maxlen=200)  # console relay: last lines
        self._relay: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def local_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        host = "127.0.0.1" if self.http_host in ("0.0.0.0", "") else self.http_host
        return f"{host}:{self.http_port}"

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
            f"--http-address={self.http_host}",
            f"--grpc-address={self.host}",
            f"--metrics-address={self.host}",
            # Our configs are complete; auto-complete would start one extra stub process
            # per Python model just to import model.py (and torch) a second time.
            "--disable-auto-complete-config",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--backend-config=python,shm-default-byte-size={SHM_BYTES}",
            f"--backend-config=python,shm-growth-byte-size={SHM_BYTES}",
            *(
                []
                if has_gpu()
                else [
                    "--allow-gpu-metrics=false",
                    "--pinned-memory-pool-byte-size=0",
                    "--cuda-memory-pool-byte-size=0:0",
                ]
            ),
            *self.extra_args,
        ]

    def start(self) -> TritonServer:
        if self.process is not None:
            raise RuntimeError("server already started")
        self.workdir = Path(tempfile.mkdtemp(prefix="dspark-triton-"))
        backends = prepare_backend_dir(self.workdir / "backends")
        self.log_path = self.log_path or self.workdir / "tritonserver.log"
        out = subprocess.PIPE if self.log_to_console else open(self.log_path, "wb")  # noqa: SIM115
        try:
            # Own session: a terminal Ctrl-C reaches only us, and stop() can end the whole
            # group (the server and its per-model stub processes) by the server's pid.
            self.process = subprocess.Popen(
                self.command(backends),
                env=server_env(self.env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_term_with_parent,
            )
        finally:
            if out is not subprocess.PIPE:
                out.close()
        if self.log_to_console:
            self._relay = threading.Thread(target=self._relay_log, name="tritonserver-log", daemon=True)
            self._relay.start()
        atexit.register(self.stop)  # an uncaught exception in the caller must not orphan the server
        return self

    def _relay_log(self) -> None:
        """Console mode: copy the server's output to stderr, marking the CPU-harmless lines."""
        cpu = not has_gpu()
        for raw in self.process.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.recent.append(line)
            if cpu and any(h in line for h in HARMLESS_ON_CPU):
                line += CPU_NOTE
            print(line, file=sys.stderr, flush=True)

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        """The server's error lines (model load failures and such) and the last `lines` lines."""
        if self.log_to_console:
            log = list(self.recent)
        elif self.log_path is None or not self.log_path.exists():
            return ""
        else:
            log = self.log_path.read_text(errors="replace").splitlines()
        errors = [line[:4000] for line in log[:-lines] if line.startswith("E") or "error" in line.lower()]
        return "\n".join(errors[-20:] + log[-lines:])

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the server reports ready; raise with the log tail if it dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"tritonserver {death_reason(code)} before ready:\n{self.log_tail()}")
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
        if self._relay is not None:
            self._relay.join(timeout=5)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.remove_shm()
        return proc.returncode

    def remove_shm(self) -> list[str]:
        """Delete this server's Python-backend shared-memory regions (left behind by a crash)."""
        removed = []
        for path in SHM_DIR.glob(self.shm_prefix + "*"):
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                pass
        return removed

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
