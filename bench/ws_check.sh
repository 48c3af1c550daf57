#!/usr/bin/env bash
# One device call: the 3xTF32 GEMM tests, and the fp32 char step with the cost model alone
# (gemm_tune off: where no table is measured yet) and with the measured table, in OLD (a tree unpacked
# under .devcarry) and in this tree, alternating. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${OLD:-.devcarry/oldws}
export PYTHONUNBUFFERED=1 GPTCUDA_CACHE=/tmp/gptcuda-cache
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
python3 -m pytest tests/gpu/test_gemm.py -m gpu -q -p no:cacheprovider -n 8 -k "wgmma3 or 3xtf32 or colsum or launcher" \
  2>&1 | tail -4
for tune in off auto; do
  for tree in "$OLD" .; do
    echo "== $tree gemm_tune=$tune"
    (cd "$tree" && python3 bench/step.py configs/ctx256_tf32.yaml --precision=fp32 --gemm_tune=$tune --iters 20 \
      --labels 0 2>&1 | grep -E "ms/step|clock" | head -3)
  done
done
