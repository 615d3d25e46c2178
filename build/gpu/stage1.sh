#!/usr/bin/env bash
# GPU stage 1 (on the device machine, carry .gpu/p1): keep part 1 for stage 2, run the `gpu`
# tests (the whole speculative step, data generation and drafter training on CUDA) and time
# the Triton kernels against their torch references (results/kernels_<gpu>.json).
cd "$(dirname "$0")/../.."
mkdir -p /tmp/dspark && rm -rf /tmp/dspark/p1 && cp -r .gpu/p1 /tmp/dspark/p1
source build/gpu/env.sh
nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout 240 python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -q -rs \
  tests/test_engine.py tests/test_train.py 2>&1 | tee "$OUT/gpu_tests.log"
timeout 150 python3 kernels/bench.py --quick --rep-ms 50 --out "$OUT/kernels_nvidia_h200.json" 2>&1 | tail -30
echo "stage1 done"
