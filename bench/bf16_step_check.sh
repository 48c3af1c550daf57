#!/usr/bin/env bash
# One device call: the first bf16 training runs beside TF32 (the char model from configs/ctx256_tf32.yaml,
# its vocabulary padded to 72, ITERS steps each, same seed and batches: val loss side by side), then
# bench/step.py's GPT-2 124M B8 step in bf16 and in TF32. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/cases.sh
ITERS=${ITERS:-300}
for p in bf16 tf32; do
  echo "== char $p, $ITERS steps"
  python3 train.py configs/ctx256_tf32.yaml --precision=$p --vocab_multiple=8 --max_iters=$ITERS \
    --lr_decay_iters=$ITERS --eval_interval=$((ITERS / 3)) --eval_iters=50 --out_dir=/tmp/char_$p --overwrite \
    > "$OUT/char_$p.log" 2>&1
  grep -E "val loss|best|rror|ms/step|tok/s" "$OUT/char_$p.log" | tail -6
done
gpt2_shards
for p in bf16 tf32; do
  echo "== GPT-2 124M B8 T1024 step, $p"
  python3 bench/step.py configs/gpt2_124m.yaml --precision=$p --data=$GPT2_DATA --val_data= --total_batch_tokens=0 \
    --batch_size=8 --iters 20 > "$OUT/step_$p.log" 2>&1
  grep -E "ms/step|clock|rror|plan|total" "$OUT/step_$p.log" | head -6
done
