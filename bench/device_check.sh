#!/usr/bin/env bash
# One device session's check-and-benchmark, driven from the repo so that it is repeatable.
#   bash bench/device_check.sh [tests] [gradcheck] [bench] [torch] [train_fp32] [train_tf32] [long]
# Logs go to $OUT (or ./out/device when OUT is unset). The PyTorch anchor scripts are read from
# .devcarry/reference/ (a copy of the reference scripts carried along; never imported by gptcuda).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GPTCUDA_CACHE=${GPTCUDA_CACHE:-/tmp/gptcuda-cache}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests gradcheck bench)
has() { local s; for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

log "device: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader)"
python3 -c "import cuda.bindings, numpy; from gptcuda.compiler import nvrtc_version; print('cuda-bindings', cuda.bindings.__version__, 'nvrtc', nvrtc_version(), 'numpy', numpy.__version__)" | tee -a "$OUT/summary.txt"

if has tests; then
  log "GPU test suite: python3 -m pytest tests -q -m gpu"
  python3 -m pytest tests -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25
  tail -1 "$OUT/tests.log" >> "$OUT/summary.txt"
fi
if has gradcheck; then
  for p in fp32 tf32; do
    log "gradcheck $p"
    python3 gradcheck.py configs/tiny.yaml --precision=$p --dropout=0.1 2>&1 | tee -a "$OUT/gradcheck.log" | tail -3
  done
  log "gradcheck --break=layernorm (must fail upstream of lnf)"
  python3 gradcheck.py configs/tiny.yaml --break=layernorm 2>&1 | tee -a "$OUT/gradcheck.log" | grep -E "lnf|wte|FAILED|PASSED"
fi
if has bench; then
  log "launch overhead"
  python3 bench/launch.py 2>&1 | tee -a "$OUT/summary.txt"
  for p in fp32 tf32; do
    log "step $p"
    python3 bench/step.py configs/shakespeare_char_fp32.yaml --precision=$p --json "$OUT/step_$p.json" 2>&1 | tee "$OUT/step_$p.log" | head -40
  done
fi
if has torch; then
  log "PyTorch anchors (same run)"
  (cd "$OUT" && DROPOUT=0.2 OUT="$OUT" python3 "$OLDPWD/.devcarry/reference/torch_reference.py" steps compile 2>&1 | tail -8) | tee -a "$OUT/summary.txt"
fi
for p in fp32 tf32; do
  if has train_$p; then
    log "5000-step shakespeare $p"
    python3 train.py configs/shakespeare_char_fp32.yaml --precision=$p --out_dir="$OUT/run_$p" --no-bar 2>&1 \
      | tee "$OUT/train_$p.log" | grep -E "^step [0-9]+:|best val|error" | tail -30
    python3 sample.py --out_dir "$OUT/run_$p" --max_new_tokens 300 --seed 1 2>&1 | tail -12 | tee -a "$OUT/summary.txt"
    rm -f "$OUT/run_$p"/*.ckpt
  fi
done
log "end: $(nvidia-smi --query-gpu=clocks.sm,memory.used --format=csv,noheader)"
