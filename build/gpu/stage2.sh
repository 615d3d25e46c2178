#!/usr/bin/env bash
# GPU stage 2 (on the device machine after stage 1, carry .gpu/p2): rebuild the exact default
# model from its GGUF, recompute the drafter data's features on the GPU, generate a second,
# disjoint data folder (600 more train prompts per domain; it ran at 6.5 sequences/s beside five
# trainings on the H200, too slow for its 170 s slot there) and train the SmolLM2 drafters in
# parallel on one GPU, each for the same wall-clock budget S seconds (default 240); pack the
# exported drafters and training records into 16 MB pieces (4 come back now, stage3 the rest).
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
S=${S:-240}
LIMIT=${LIMIT:-540}   # seconds this stage may take in all
exec > >(tee -a "$OUT/stage2.log") 2>&1
source build/gpu/env.sh
el() { echo $(( $(date +%s) - T0 )); }
P1=/tmp/dspark/p1
[ -d $P1 ] || { echo "part 1 missing: run stage1.sh on this machine first"; exit 2; }
cat $P1/gguf.part1 .gpu/p2/gguf.part2 > /tmp/dspark/smollm2.gguf
echo "$(cat $P1/gguf.sha256)  /tmp/dspark/smollm2.gguf" | sha256sum -c - || exit 3
M=models/smollm2-135m-instruct && mkdir -p $M && cp $P1/model/* $M/
python3 build/gpu/gguf_convert.py /tmp/dspark/smollm2.gguf $M || exit 4
D=build/smollm2/work/drafter_data && D2=build/smollm2/work/drafter_data2
mkdir -p $D build/smollm2/work/corpus /tmp/ret/results /tmp/logs && cp $P1/data/* $D/ && cp $P1/train.jsonl build/smollm2/work/corpus/
DATA="--model smollm2 --max-new 256 --max-prompt 448 --t1-share 0.3 --greedy-share 0.15 --threads 4"
# shards present: only the features are computed (on the GPU, bf16 as served)
dtrain --make-data $DATA --n-per-domain 600 --gen-batch 96 --chunk 300 > /tmp/logs/features.log 2>&1 || { tail -30 /tmp/logs/features.log; exit 5; }
echo "features done at $(el)s"
pids=()
ARCH="--block-size 15 --gamma 7 --layers 1 --intermediate 1536 --head-rank 64 --norm-init-scale 0.25"
BUD="--steps 100000 --batch 32 --anchors 16 --lr 3e-3 --warmup 50 --threads 2 --device cuda --ckpt-every 1000000 --results /tmp/ret/results"
trn() { local name=$1; shift
  dtrain --model smollm2 --name "$name" --out "/tmp/ret/drafters/$name" --work "/tmp/work/$name" $ARCH $BUD "$@" \
    > "/tmp/logs/$name.log" 2>&1
  echo "$name rc=$? at $(el)s: $(grep -o 'train [^|]*|[^|]*|' /tmp/logs/$name.log | tail -1)"; }
trn dspark-markov --kind dspark --head markov --time-budget $S & pids+=($!)
trn dflash --kind dspark --head none --time-budget $S & pids+=($!)
trn eagle --kind eagle --lr 1e-3 --time-budget $S & pids+=($!)
trn dspark-markov-2layer --kind dspark --head markov --layers 2 --time-budget $S & pids+=($!)
trn dspark-markov-halftime --kind dspark --head markov --time-budget $((S / 2)) & pids+=($!)
( timeout $((LIMIT - S - 120)) bash -c "$(declare -f dtrain); dtrain --make-data $DATA --data $D2 --n-per-domain 600 \
    --prompt-offset 600 --gen-batch 256 --chunk 600 --seed 1" > /tmp/logs/data2.log 2>&1
  rc=$?; echo "data2 rc=$rc at $(el)s"; tail -c 1500 $D2/meta.json 2>/dev/null | tr '\n' ' '; echo
  S2=$(( LIMIT - $(el) - 80 )); [ $S2 -gt $S ] && S2=$S
  if [ $rc -eq 0 ] && [ $S2 -ge 60 ]; then
    trn dspark-markov-2xdata --kind dspark --head markov --data $D,$D2 --time-budget $S2
    cp $D2/meta.json /tmp/ret/results/drafter_data2_meta.json
  else echo "2xdata skipped (rc $rc, budget $S2)"; fi ) & pids+=($!)
wait "${pids[@]}"  # (a bare `wait` also waits for the log's tee and never returns)
echo "trainings done at $(el)s"; nvidia-smi --query-gpu=memory.used --format=csv
mkdir -p /tmp/ret/logs && for f in /tmp/logs/*.log; do tail -c 20000 "$f" > "/tmp/ret/logs/$(basename "$f")"; done
cp $D/meta.json /tmp/ret/results/drafter_data_meta_gpu.json
tar -C /tmp/ret -cf /tmp/ret.tar drafters results logs && rm -rf /tmp/chunks && mkdir -p /tmp/chunks
split -b 16000000 -d -a 1 /tmp/ret.tar /tmp/chunks/ret.tar. && ls -la /tmp/chunks && sha256sum /tmp/ret.tar
cp $(ls /tmp/chunks/* | head -4) "$OUT/"
echo "stage2 done at $(el)s"
