#!/usr/bin/env bash
# Train the shipped demo drafters on the demo target (DESIGN §8): one data folder, then the
# five drafters one after another with the SAME budget (steps x sequences x anchors).
#   bash build/demo/drafters/train_all.sh            # STEPS=... N_PER_DOMAIN=... to resize
set -euo pipefail
cd "$(dirname "$0")/../../.."
DSPARK=.venv/bin/dspark
STEPS=${STEPS:-700}
N_PER_DOMAIN=${N_PER_DOMAIN:-400}
THREADS=${THREADS:-2}
run() { echo "== $(date -u +%T) $*"; nice -n 5 "$@"; }
BUDGET="--steps $STEPS --batch 8 --anchors 8 --block-size 15 --gamma 7 --lr 3e-3 --warmup 10 --threads $THREADS"

if [ ! -f build/demo/work/drafter_data/features.pt ]; then
  run $DSPARK train --make-data --n-per-domain "$N_PER_DOMAIN" --max-new 128 --min-prompt 16 \
    --max-prompt 64 --gen-batch 75 --threads "$THREADS"
fi
run $DSPARK train --kind dspark --head markov --name dspark-markov $BUDGET
run $DSPARK train --kind dspark --head none --name dflash $BUDGET
run $DSPARK train --kind eagle --name eagle $BUDGET
run $DSPARK train --kind dspark --head rnn --name dspark-rnn $BUDGET
run $DSPARK train --kind draft_lm --name draft-lm $BUDGET
echo "== $(date -u +%T) done"
