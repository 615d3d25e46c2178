#!/usr/bin/env bash
# Build the SmolLM2-135M-Instruct drafters (build/smollm2/drafters/NAME) from scratch, one step
# after another, every heavy step under the shared CPU lock:
#   corpus -> target-generated data -> 5 drafters (one shared budget) -> STS -> offline eval.
#   bash build/smollm2/train_all.sh            # STEPS=... THREADS=... to resize
# Every step resumes: the corpus and data folders are reused when present (data shards are
# resumable), trainings resume from build/smollm2/work/train/NAME/ckpt.pt. Delete
# build/smollm2/work/ to start over. On a GPU machine set THREADS and drop the lock.
set -euo pipefail
cd "$(dirname "$0")/../.."
DSPARK=.venv/bin/dspark
STEPS=${STEPS:-1000}
THREADS=${THREADS:-1}   # 1 thread: on a shared 2-core machine 2 OpenMP threads ran 15x slower per matmul
LOCK=${LOCK:-/tmp/dspark-heavy.lock}
export OMP_NUM_THREADS=$THREADS
run() { echo "== $(date -u +%T) $*"; flock "$LOCK" nice -n 5 "$@"; }

[ -f build/smollm2/work/corpus/train.jsonl ] || run $DSPARK corpus --self-instruct 480 --threads "$THREADS"
if [ ! -f build/smollm2/work/drafter_data/meta.json ]; then
  run $DSPARK train --make-data --model smollm2 --n-per-domain 600 --max-new 256 --max-prompt 448 \
    --gen-batch 96 --chunk 300 --t1-share 0.3 --greedy-share 0.15 --threads "$THREADS"
fi
ARCH="--block-size 15 --gamma 7 --layers 1 --intermediate 1536 --head-rank 64 --norm-init-scale 0.25"
BUDGET="--steps $STEPS --batch 8 --anchors 8 --lr 3e-3 --warmup 20 --threads $THREADS"
run $DSPARK train --model smollm2 --kind dspark --head markov --name dspark-markov $ARCH $BUDGET
run $DSPARK train --model smollm2 --kind dspark --head none --name dflash $ARCH $BUDGET
run $DSPARK train --model smollm2 --kind eagle --name eagle $ARCH $BUDGET --lr 1e-3
run $DSPARK train --model smollm2 --kind dspark --head rnn --name dspark-rnn $ARCH $BUDGET
# own-context DSpark: no target taps (a TensorRT-LLM target exposes none); its own token encoder
run $DSPARK train --model smollm2 --kind dspark --head markov --context own --context-layers 1 --context-intermediate 512 \
  --name dspark-own $ARCH $BUDGET
CAL="--model smollm2 --gamma 15 --n-prompts 32 --max-tokens 128 --max-prompt-tokens 448 --concurrency 24 --threads $THREADS"
run $DSPARK calibrate --drafter dspark-markov,dspark-rnn,dflash,eagle,dspark-own $CAL
run $DSPARK eval --model smollm2 --n-prompts 24 --max-tokens 128 --max-prompt-tokens 448 --gammas 7,15 \
  --temperatures 0,1 --concurrency 24 --threads "$THREADS"
echo "== $(date -u +%T) done"
