#!/usr/bin/env bash
# One device call's side-by-side speed rows: bench/step.py on the speed cases in OLD (a tree unpacked
# under .devcarry, e.g. `git archive REV | tar -x -C .devcarry/oldtree`) and in this tree, alternating
# case by case, each with the measured GEMM table (gemm_tune auto: measured on first use, per tree, as
# the kernel sources differ) or the cost model alone (TUNES="off").
#   OLD=.devcarry/oldtree CASES="char_tf32 char_fp32 ctx2048 gpt2_b8" TUNES="auto" bash bench/ab_speed.sh
# (the cases: bench/cases.sh). OLD_ENV / NEW_ENV: environment settings for one side's runs, e.g. the same
# tree with and without a switch: OLD=. OLD_ENV="GPTCUDA_WGMMA=0" CASES="gpt2_b8" bash bench/ab_speed.sh
# Logs under $OUT (ab_<case>_<tune>_<old|new>.log) and one line per run in $OUT/ab_summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${OLD:-.devcarry/oldtree}
. bench/cases.sh
for c in ${CASES:-char_tf32 char_fp32 ctx2048 gpt2_b8}; do
  case_args $c || continue
  args=$CASE_ARGS
  for tune in ${TUNES:-auto}; do
    for side in old new; do
      tree=$([ $side = old ] && echo "$OLD" || echo .)
      log="$OUT/ab_${c}_${tune}_${side}.log"
      envs=$([ $side = old ] && echo "${OLD_ENV:-}" || echo "${NEW_ENV:-}")
      (cd "$tree" && env $envs python3 bench/step.py $args --gemm_tune=$tune --iters ${ITERS:-20} > "$log" 2>&1)
      echo "$c gemm_tune=$tune $side: $(grep -E "^graph" "$log" | head -1) | $(grep -E "clock" "$log" | head -1)" \
        | tee -a "$OUT/ab_summary.txt"
    done
  done
done
