#!/usr/bin/env bash
# Nsight Compute over one training step's launches (bench/step.py --profile: one eager step between
# cuProfilerStart and cuProfilerStop, so the setup's and the GEMM tuner's launches are not collected),
# the clocks left alone. The report's details page (every collected launch) into $OUT/profile_<case>.txt,
# and bench/ncu_table.py's line a kernel of it printed.
#   CASE=gpt2_b8_bf16 KERNELS='regex:gemm_wgmma|flash' COUNT=400 bash bench/profile_step.sh
# (the cases: bench/cases.sh; KERNELS: ncu's -k over demangled names, so template arguments match too)
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/cases.sh
CASE=${CASE:-gpt2_b8_bf16}
case_args "$CASE" || exit 1
rep=/tmp/profile_$CASE
ncu --profile-from-start off --clock-control none --kernel-name-base demangled -k "${KERNELS:-regex:.}" \
  --launch-count "${COUNT:-400}" --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats -o "$rep" -f \
  python3 bench/step.py $CASE_ARGS --iters 5 --labels 0 --profile > "$OUT/profile_${CASE}.log" 2>&1
echo "ncu rc $? ($(grep -c '==PROF==' "$OUT/profile_${CASE}.log") profiler lines)"
ncu -i "$rep.ncu-rep" --page details --print-units base > "$OUT/profile_${CASE}.txt" 2>&1
echo "details: $(wc -l < "$OUT/profile_${CASE}.txt") lines"
python3 bench/ncu_table.py "$OUT/profile_${CASE}.txt"
