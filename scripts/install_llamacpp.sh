#!/usr/bin/env bash
# Optional benchmark extra: llama-cpp-python built from source (for `dspark bench`'s llama.cpp
# columns; never a runtime dependency). The default native build crashes on some VMs with an
# illegal instruction in AMX tile code, so the build is portable (GGML_NATIVE=OFF) with AMX off and
# each AVX-512 extension on only where /proc/cpuinfo lists it (an AVX2-only CPU gets an AVX2
# build). Compiling takes ~10-20 min on 2 cores: on a shared machine run it under
#   flock /tmp/dspark-heavy.lock scripts/install_llamacpp.sh
set -euo pipefail
VENV="${VENV:-$(dirname "$0")/../.venv}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { case "$FLAGS" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
echo "[install_llamacpp] AVX512 $(has avx512f), VBMI $(has avx512vbmi), VNNI $(has avx512_vnni), BF16 $(has avx512_bf16)"
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) \
  -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
"$VENV/bin/pip" install --no-binary llama-cpp-python --no-deps "llama-cpp-python==$VERSION"
# its runtime dependencies (--no-deps above keeps pip from touching torch's numpy pin)
"$VENV/bin/pip" install diskcache jinja2 typing-extensions
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
