#!/usr/bin/env bash
# Build the TensorRT-LLM target engine for the GPU profile (docs/architecture.md §11).
# NOT RUN in this repository's CI or on its CPU machines: it needs an NVIDIA GPU and the NGC
# Triton TensorRT-LLM container (nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3), which
# ships `trtllm-build` and the TensorRT-LLM convert scripts. Usage, inside that container:
#   build/trtllm/build_engine.sh HF_FOLDER OUT_DIR [GAMMA] [MAX_BATCH]
# then fill the model repository template (fill_repository.sh) and start tritonserver on it.
set -euo pipefail
HF=${1:?Hugging Face checkpoint folder of the target (e.g. models/smollm2-135m-instruct)}
OUT=${2:?output folder for the engine}
GAMMA=${3:-7}          # the largest draft block the BLS sends (--max_draft_len)
MAX_BATCH=${4:-64}
CKPT="$OUT/checkpoint"

# 1. HF weights -> TensorRT-LLM checkpoint (Llama architecture: SmolLM2, Qwen, ...).
python3 /app/examples/llama/convert_checkpoint.py --model_dir "$HF" --output_dir "$CKPT" --dtype bfloat16

# 2. The engine: external draft tokens of up to GAMMA per request, verified in one forward;
#    generation logits gathered (the BLS runs DSpark's lossless acceptance on them);
#    paged KV cache with block reuse (a request continues the cached prefix of its sequence).
trtllm-build --checkpoint_dir "$CKPT" --output_dir "$OUT/engine" \
  --speculative_decoding_mode draft_tokens_external --max_draft_len "$GAMMA" \
  --gather_generation_logits \
  --use_paged_context_fmha enable --kv_cache_type paged \
  --max_batch_size "$MAX_BATCH" --max_input_len 4096 --max_seq_len 8192 \
  --gemm_plugin bfloat16

echo "engine written to $OUT/engine; next: build/trtllm/fill_repository.sh $OUT/engine $HF"
