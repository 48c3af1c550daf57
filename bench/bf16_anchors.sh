#!/usr/bin/env bash
# The BF16 issue's speed rows beside their anchors, one group a device call (a row is compared only with
# anchors timed in the same call). Ours: bench/step.py (CUDA-event medians of the captured step, the SM
# clock before and after); PyTorch: torch_reference.py shape (SHAPE_MODES: bf16c = torch.compile + bf16
# autocast with fp32 weights, tf32c = torch.compile in TF32); llm.c: llmc_anchor.sh (FP32 = TF32 cuBLAS,
# and BF16). The anchor scripts are read from .devcarry/reference/, llm.c from .devcarry/llmc.
#   GROUP=gpt2  bash bench/bf16_anchors.sh   # GPT-2 124M B8 and B16 bf16, B8 tf32; PyTorch; llm.c
#   GROUP=b8    bash bench/bf16_anchors.sh   # GPT-2 124M B8 bf16, PyTorch's, ours again
#   GROUP=gpt2bf16 bash bench/bf16_anchors.sh  # gpt2 without the TF32 rows (a shorter call)
#   GROUP=small bash bench/bf16_anchors.sh   # char B64 T256 bf16 and tf32, B16 T2048 bf16 (dropout 0.2);
#                                            # FULL=1: also char fp32 and T2048 tf32
#   GROUP=trace bash bench/bf16_anchors.sh   # GPT-2 B16 bf16, ours then PyTorch's, with nvidia-smi sampling the
#                                            # SM clock, power and clock event reasons (bench/clock_trace.py)
#   GROUP=cublas bash bench/bf16_anchors.sh  # our bf16 products (the step's epilogues, and none) beside
#                                            # cuBLAS's (bench/cublas_bf16.py) at 16384 tokens
#   GROUP=energy bash bench/bf16_anchors.sh  # GPT-2 B16 bf16: our step's joules by launch label (bench/energy.py),
#                                            # PyTorch's step's joules and kernels (bench/torch_profile.py), our
#                                            # products' joules a launch on every tile beside cuBLAS's
#   TORCH_REPEAT=3 (any group): each PyTorch row from three processes in turn
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/cases.sh
ours() {             # a case of bench/cases.sh; the log's tag (default: the case)
  case_args $1 || return
  local tag=${2:-$1}
  echo "== ours $tag: bench/step.py $CASE_ARGS"
  python3 bench/step.py $CASE_ARGS --iters ${ITERS:-30} --json "$OUT/ours_$tag.json" > "$OUT/ours_$tag.log" 2>&1
  grep -E "graph :|SM clock|rror" "$OUT/ours_$tag.log"
}
torch_shape() {      # SHAPES SHAPE_MODES DROPOUT tag; TORCH_REPEAT processes (default 1), each timed on its own:
  local i            # PyTorch's step moves between calls (B8 18.4-25.0 ms), most right after its compile, so
  for i in $(seq ${TORCH_REPEAT:-1}); do   # the later processes (compiled code cached) show its spread
    echo "== PyTorch shape ($i): SHAPES=$1 SHAPE_MODES=$2 DROPOUT=$3"
    mkdir -p "$OUT/torch_$4_$i"
    (cd "$OUT/torch_$4_$i" && SHAPES="$1" SHAPE_MODES="$2" DROPOUT=$3 OUT="$OUT/torch_$4_$i" \
      python3 "$OLDPWD/.devcarry/reference/torch_reference.py" shape 2>&1 | tail -12)
  done
}
mark() { echo "MARK $(date +'%Y/%m/%d %H:%M:%S.%3N') $1" >> "$OUT/marks.txt"; }
echo "device: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader)"
case ${GROUP:-gpt2} in
  gpt2|gpt2bf16)
    ours gpt2_b8_bf16
    ours gpt2_b16_bf16
    if [ "$GROUP" = gpt2 ]; then
      ours gpt2_b8 gpt2_b8_tf32
      torch_shape "8,1024,12,12,768,50304;16,1024,12,12,768,50304" bf16c,tf32c 0 gpt2
    else
      torch_shape "8,1024,12,12,768,50304;16,1024,12,12,768,50304" bf16c 0 gpt2
    fi
    rm -rf /tmp/llmc && cp -r .devcarry/llmc /tmp/llmc
    bash .devcarry/reference/llmc_anchor.sh /tmp/llmc 8 16 2>&1 | tail -14
    ;;
  b8)          # the B8 row alone, ours before and after PyTorch's (the clock's drift between them shows)
    ours gpt2_b8_bf16
    torch_shape "8,1024,12,12,768,50304" bf16c 0 b8
    ours gpt2_b8_bf16 gpt2_b8_bf16_again
    ;;
  small)
    ours char_bf16
    ours char_tf32
    ours ctx2048_bf16
    if [ -n "${FULL:-}" ]; then        # the fp32 and T2048 tf32 rows too
      ours char_fp32
      ours ctx2048 ctx2048_tf32
    fi
    torch_shape "64,256,6,6,384;16,2048,6,6,384" bf16c 0.2 small
    ;;
  trace)
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
      --format=csv,noheader,nounits -lms 50 > "$OUT/smi.csv" 2>&1 &
    smi=$!
    mark idle_start; sleep 3; mark idle_end
    mark ours_b16_start; ours gpt2_b16_bf16; mark ours_b16_end
    mark torch_b16_start; torch_shape "16,1024,12,12,768,50304" bf16c 0 b16; mark torch_b16_end
    mark ours_b16_again_start; ours gpt2_b16_bf16 gpt2_b16_bf16_again; mark ours_b16_again_end
    kill $smi
    python3 bench/clock_trace.py "$OUT/smi.csv" "$OUT/marks.txt"
    ;;
  energy)
    case_args gpt2_b16_bf16 && python3 bench/energy.py $CASE_ARGS > "$OUT/energy_b16.log" 2>&1
    head -45 "$OUT/energy_b16.log"
    python3 bench/torch_profile.py --shape 16,1024,12,12,768,50304 --mode bf16c --energy_seconds 3 --top 40 \
      > "$OUT/torch_energy_b16.log" 2>&1
    grep -vi warning "$OUT/torch_energy_b16.log" | head -30
    python3 bench/bf16_gemm.py --speed --bf16-only --tokens 16384 --energy_seconds 0.5 2>&1 | grep -E "^ |clock"
    python3 bench/cublas_bf16.py --tokens 16384 --energy_seconds 0.5 2>&1 | tail -17
    ;;
  cublas)
    python3 bench/cublas_bf16.py --tokens 16384 2>&1 | tail -17
    python3 bench/bf16_gemm.py --speed --bf16-only --tokens 16384 2>&1 | grep -E "^[a-zA-Z]" | tail -17
    python3 bench/bf16_gemm.py --speed --bf16-only --tokens 16384 --epi none 2>&1 | grep -E "^[a-zA-Z]" | tail -17
    ;;
  *) echo "unknown GROUP ${GROUP}"; exit 2 ;;
esac
echo "end: $(nvidia-smi --query-gpu=clocks.sm --format=csv,noheader)"
