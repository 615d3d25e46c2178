#!/usr/bin/env bash
# Make a GPU model repository: this repository's models, with the CPU stand-in of `tensorrt_llm`
# replaced by the stock TensorRT-LLM backend model (config.pbtxt.template here) and `dspark`
# pointed at it. NOT RUN here (GPU profile; docs/architecture.md §11).
#   build/trtllm/fill_repository.sh ENGINE_DIR HF_FOLDER [OUT_REPO] [GAMMA]
set -euo pipefail
ENGINE=${1:?engine folder from build_engine.sh}
HF=${2:?the target's Hugging Face folder (tokenizer)}
OUT=${3:-model_repository_gpu}
GAMMA=${4:-7}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
rm -rf "$OUT" && cp -r "$ROOT/model_repository" "$OUT"
rm -rf "$OUT/tensorrt_llm/1/model.py" "$OUT/target"   # the stock backend replaces the stand-in
sed -e "s#\${engine_dir}#$ENGINE#" -e "s#\${max_draft_len}#$GAMMA#" \
    "$HERE/tensorrt_llm.config.pbtxt.template" > "$OUT/tensorrt_llm/config.pbtxt"
# dspark: call tensorrt_llm (no taps: the drafter must run on its own context), tokenizer = HF folder
sed -i -e 's#{ key: "target_model" value: { string_value: "target" } }#{ key: "target_model" value: { string_value: "tensorrt_llm" } }#' \
       -e "s#{ key: \"model\" value: { string_value: \"smollm2\" } }#{ key: \"model\" value: { string_value: \"$HF\" } }#" \
    "$OUT/dspark/config.pbtxt"
for m in preprocessing drafter; do
  sed -i "s#{ key: \"model\" value: { string_value: \"smollm2\" } }#{ key: \"model\" value: { string_value: \"$HF\" } }#" \
    "$OUT/$m/config.pbtxt"
done
echo "GPU model repository in $OUT (drafter: set an own-context drafter in $OUT/drafter/config.pbtxt)"
