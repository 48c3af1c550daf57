#!/usr/bin/env bash
# Nsight Compute over the launches of any command whose names match KERNELS (the clocks left alone):
# every section that says where a kernel's warps wait (warp states, schedulers, source counters with
# their stall sampling), the details page into $OUT/profile_<TAG>.txt and each launch's stall reasons
# (cycles a warp spends on each between two issued instructions) into $OUT/stalls_<TAG>.txt.
#   TAG=attn KERNELS='regex:flash_' SKIP=4 COUNT=3 bash bench/profile_cmd.sh python3 bench/attention.py \
#       --precision bf16 --impl fused --B 8 --T 1024 --iters 2 --warmup 1
# (SOURCE=1 also writes the SASS source page with per-instruction samples: $OUT/source_<TAG>.csv)
# The log, the raw page and the source page are then packed into $OUT/profile_<TAG>.tgz, beside the details
# and stall files: three files a tag.
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/cases.sh
TAG=${TAG:-cmd}
rep=/tmp/profile_$TAG
ncu --clock-control none --kernel-name-base demangled -k "${KERNELS:-regex:.}" --launch-skip "${SKIP:-0}" \
  --launch-count "${COUNT:-1}" --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
  --section LaunchStats --section InstructionStats --section SourceCounters -o "$rep" -f "$@" \
  > "$OUT/profile_${TAG}.log" 2>&1
echo "ncu rc $? ($(grep -c '==PROF==' "$OUT/profile_${TAG}.log") profiler lines)"
ncu -i "$rep.ncu-rep" --page details --print-details all --print-units base > "$OUT/profile_${TAG}.txt" 2>&1
ncu -i "$rep.ncu-rep" --page raw --print-units base > "$OUT/raw_${TAG}.txt" 2>&1
grep -E "\)x\(|issue_stalled" \
  "$OUT/raw_${TAG}.txt" | grep -vE "not_issued| 0$" > "$OUT/stalls_${TAG}.txt"
echo "details: $(wc -l < "$OUT/profile_${TAG}.txt") lines, stalls: $(wc -l < "$OUT/stalls_${TAG}.txt") lines"
# SOURCE=1: the source page as SASS with each instruction's samples and stall reasons (csv), to place stalls
if [ "${SOURCE:-0}" = 1 ]; then
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/source_${TAG}.csv" 2>&1
  echo "source: $(wc -l < "$OUT/source_${TAG}.csv") lines"
fi
(cd "$OUT" && tar czf "profile_${TAG}.tgz" "profile_${TAG}.log" "raw_${TAG}.txt" $([ "${SOURCE:-0}" = 1 ] && echo "source_${TAG}.csv") \
  && rm -f "profile_${TAG}.log" "raw_${TAG}.txt" "source_${TAG}.csv")
