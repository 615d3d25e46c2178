#!/usr/bin/env bash
# Rebuild the demo assets: corpus -> tokenizer + token streams -> target model -> eval.
# Intermediate data goes to build/demo/work/ (git-ignored); the shipped outputs are
# build/demo/target/ (HF folder), build/demo/prompts/, results/target_*.{json,png}.
#
#   bash build/demo/build.sh                      # time-budgeted training (DEMO_TRAIN_SECONDS, default 3300)
#   DEMO_TRAIN_STEPS=160 bash build/demo/build.sh # fixed step count instead (reproducible schedule)
#
# Training resumes from build/demo/work/target_ckpt.pt; delete it to start over.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DOCS=/usr/share/doc/python3.11/html/_sources
if [ ! -d "$DOCS" ]; then
  echo "prose source $DOCS missing; installing python3.11-doc" >&2
  apt-get update && apt-get install -y python3.11-doc
fi
echo "== corpus"
$PY build/demo/corpus.py
echo "== tokenizer"
nice -n 5 $PY build/demo/tokenizer.py
echo "== target"
if [ -n "${DEMO_TRAIN_STEPS:-}" ]; then
  nice -n 5 $PY build/demo/train_target.py --max-steps "$DEMO_TRAIN_STEPS"
else
  nice -n 5 $PY build/demo/train_target.py --time-budget "${DEMO_TRAIN_SECONDS:-3300}"
fi
echo "== eval"
nice -n 5 $PY build/demo/eval_target.py
