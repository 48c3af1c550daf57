#!/usr/bin/env bash
# The GPT-2-scale quality check of precision bf16: configs/gpt2_124m.yaml at B8 (no accumulation), ITERS steps
# on the prepared shared corpus (.devcarry/soak_data: ../shared/data/corpus/build.py DIR, then prepare.py DIR
# --tokenizer gpt2), in bf16 and in tf32 with the same seed and batches; the val loss of each evaluation side
# by side. ARGS: more overrides for both (e.g. --gemm_tune=off: no table measured first). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/cases.sh          # $OUT and the environment
DATA=${DATA:-.devcarry/soak_data}
ITERS=${ITERS:-400}
for p in bf16 tf32; do
  python3 train.py configs/gpt2_124m.yaml --precision=$p --data=$DATA --val_data= --batch_size=8 \
    --total_batch_tokens=0 --max_iters=$ITERS --eval_interval=$((ITERS / 4)) --out_dir=/tmp/q_$p --overwrite ${ARGS:-} \
    > "$OUT/quality_$p.log" 2>&1
  echo "== $p: $(grep -cE '^step .*val loss' "$OUT/quality_$p.log") evaluations"
  grep -E "val loss|best val|rror" "$OUT/quality_$p.log" | tail -6
done
