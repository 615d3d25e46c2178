#!/usr/bin/env bash
# Build the SmolLM2-135M-Instruct drafters (build/smollm2/drafters/NAME) from scratch, one step
# after another, every heavy step under the shared CPU lock:
#   corpus -> target-generated data -> 5 drafters (one shared budget) -> STS -> offline eval.
#   bash build/smollm2/train_all.sh            # STEPS=... THREADS=... to resize
# Every step resumes: the corpus and data folders are reused when present (data shards are
# resumable), trainings resume from build/smollm2/work/train/NAME/ckpt.pt. Delete
# build/smollm2/work/ to start over. On a GPU machine set THREADS and drop the lock.
# The shipped dspark-markov, dflash and eagle were trained on a GPU instead (build/gpu/stage2.sh:
# the same data and architecture, --device cuda, 32 sequences x 16 anchors per step, 240 s each);
# GPU=1 runs those three trainings here with that recipe (on a CUDA machine).
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
# the draft vocabulary every DSpark drafter of the model reads at load (its LM head's rows)
[ -f build/smollm2/drafters/draft_vocab.json ] || \
  run $DSPARK draft-vocab --model smollm2 --data build/smollm2/work/drafter_data --size 4096
ARCH="--block-size 15 --gamma 7 --layers 1 --intermediate 1536 --head-rank 64 --norm-init-scale 0.25"
BUDGET="--steps $STEPS --batch 8 --anchors 8 --lr 3e-3 --warmup 20 --threads $THREADS"
if [ "${GPU:-0}" = 1 ]; then
  GPU_BUDGET="--steps 100000 --batch 32 --anchors 16 --lr 3e-3 --warmup 50 --threads 2 --device cuda --time-budget 240"
  $DSPARK train --model smollm2 --kind dspark --head markov --name dspark-markov $ARCH $GPU_BUDGET
  $DSPARK train --model smollm2 --kind dspark --head none --name dflash $ARCH $GPU_BUDGET
  $DSPARK train --model smollm2 --kind eagle --name eagle $ARCH $GPU_BUDGET --lr 1e-3
else
  run $DSPARK train --model smollm2 --kind dspark --head markov --name dspark-markov $ARCH $BUDGET
  run $DSPARK train --model smollm2 --kind dspark --head none --name dflash $ARCH $BUDGET
  run $DSPARK train --model smollm2 --kind eagle --name eagle $ARCH $BUDGET --lr 1e-3
fi
run $DSPARK train --model smollm2 --kind dspark --head rnn --name dspark-rnn $ARCH $BUDGET
# own-context DSpark: no target taps (a TensorRT-LLM target exposes none); its own token encoder
run $DSPARK train --model smollm2 --kind dspark --head markov --context own --context-layers 1 --context-intermediate 512 \
  --name dspark-own $ARCH $BUDGET
CAL="--model smollm2 --gamma 15 --n-prompts 32 --max-tokens 128 --max-prompt-tokens 448 --concurrency 24 --threads $THREADS --sts affine"
run $DSPARK calibrate --drafter dspark-markov,dspark-rnn,dflash,eagle,dspark-own $CAL
EVAL="--n-prompts 16 --max-tokens 128 --max-prompt-tokens 448 --concurrency 24 --threads $THREADS --reuse-traces"
run $DSPARK eval --model smollm2 --drafters ngram,dspark-markov,dflash,eagle,dspark-rnn,dspark-own \
  --gammas 7,15 --temperatures 0,1 $EVAL
# Ablations of the default drafter (not shipped; build/smollm2/work/ablations/): a two-layer
# backbone, twice the steps (the shipped run continued on a 2000-step cosine: its first 1000 steps
# are the shipped run's own batches), half the data (the data-size slope: doubling the data means
# another ~70 min of target generation + taps on this CPU).
ABL=build/smollm2/work/ablations
run $DSPARK train --model smollm2 --kind dspark --head markov --name dspark-markov-2layer $ARCH --layers 2 \
  $BUDGET --out $ABL/dspark-markov-2layer
mkdir -p build/smollm2/work/train/dspark-markov-2xsteps
[ -f build/smollm2/work/train/dspark-markov-2xsteps/ckpt.pt ] || \
  cp build/smollm2/work/train/dspark-markov/ckpt.pt build/smollm2/work/train/dspark-markov-2xsteps/
run $DSPARK train --model smollm2 --kind dspark --head markov --name dspark-markov-2xsteps $ARCH \
  $BUDGET --steps $((2 * STEPS)) --out $ABL/dspark-markov-2xsteps
run $DSPARK train --model smollm2 --kind dspark --head markov --name dspark-markov-halfdata $ARCH \
  $BUDGET --data-fraction 0.5 --out $ABL/dspark-markov-halfdata
mkdir -p $ABL/traces && cp -n build/smollm2/work/traces/dspark-markov.runs.jsonl $ABL/traces/ || true
run $DSPARK eval --model smollm2 --drafters dspark-markov,$ABL/dspark-markov-2layer,$ABL/dspark-markov-2xsteps,$ABL/dspark-markov-halfdata \
  --baseline dspark-markov --traces-dir $ABL/traces --gammas 7 --temperatures 0,1 $EVAL \
  --out results/offline_eval_smollm2_ablations.json
echo "== $(date -u +%T) done"
