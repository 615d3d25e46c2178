#!/usr/bin/env bash
# Pack what the GPU run needs and git does not hold into .gpu/p1 and .gpu/p2 (git-ignored;
# each travels as one `carry` of at most 64 MiB with the working tree): the default model's
# GGUF (the exact source of models/smollm2-135m-instruct, 98 MB: split in two), its small HF
# files, the drafter data's token shards (features are recomputed there), the train prompts
# (a second data folder is generated there) and the pure-Python `gguf` reader.
set -euo pipefail
cd "$(dirname "$0")/../.."
G=models/.cache/SmolLM2-135M-Instruct.Q4_1.gguf
M=models/smollm2-135m-instruct
D=build/smollm2/work/drafter_data
for f in "$G" "$M/config.json" "$D/meta.json" build/smollm2/work/corpus/train.jsonl; do
  [ -f "$f" ] || { echo "missing $f: run make setup and build/smollm2/train_all.sh first" >&2; exit 2; }
done
rm -rf .gpu && mkdir -p .gpu/p1/model .gpu/p1/data .gpu/p1/site .gpu/p2
head -c 40000000 "$G" > .gpu/p1/gguf.part1
tail -c +40000001 "$G" > .gpu/p2/gguf.part2
sha256sum "$G" | cut -d' ' -f1 > .gpu/p1/gguf.sha256
cp "$M"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja,dspark_source.json} .gpu/p1/model/
cp "$D"/shard_*.pt "$D"/meta.json .gpu/p1/data/
cp build/smollm2/work/corpus/train.jsonl .gpu/p1/
cp -r "$(.venv/bin/python -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')" .gpu/p1/site/
find .gpu/p1/site -name __pycache__ -prune -exec rm -rf {} +
du -sb .gpu/p1 .gpu/p2
