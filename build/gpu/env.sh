# Sourced by the stage scripts on the GPU machine: the package from this checkout (no install),
# the GPU's own Python (torch, triton, transformers are there), compiled Triton kernels.
export PYTHONPATH="$PWD/python_backend:/tmp/pp:/tmp/dspark/p1/site${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p /tmp/pp && ln -sfn "$PWD/kernels" /tmp/pp/dspark_kernels  # installs as dspark_kernels
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20
# `dspark train ARGS` without the CLI's other subcommands (their serving imports are not needed here)
dtrain() {
  python3 -c 'import argparse, sys
from dspark.tools import train
p = argparse.ArgumentParser(prog="dspark train"); train.add_arguments(p)
sys.exit(train.main(p.parse_args(sys.argv[1:])))' "$@"
}
