# What the device scripts share (sourced from the repository root): the logs' folder $OUT (default
# out/device), unbuffered Python and the kernel cache; the speed cases, a case's bench/step.py arguments;
# the GPT-2 BPE token shards (tiny Shakespeare through prepare.py) that its gpt2_* cases read, prepared once.
#   case_args gpt2_b8_bf16 && python3 bench/step.py $CASE_ARGS --iters 30
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GPTCUDA_CACHE=${GPTCUDA_CACHE:-/tmp/gptcuda-cache}
GPT2_DATA=/tmp/shakespeare_gpt2
gpt2_shards() {
  [ -f $GPT2_DATA/val_000000.bin ] || python3 prepare.py data/tinyshakespeare/input.txt --tokenizer gpt2 \
    --out $GPT2_DATA > /dev/null 2>&1
}
# CASE_ARGS for case $1 (status 1: no such case)
case_args() {
  local gpt2="--data=$GPT2_DATA --val_data= --total_batch_tokens=0"
  case $1 in
    char_tf32)    CASE_ARGS="configs/ctx256_tf32.yaml" ;;
    char_fp32)    CASE_ARGS="configs/ctx256_tf32.yaml --precision=fp32" ;;
    char_bf16)    CASE_ARGS="configs/ctx256_bf16.yaml" ;;
    ctx2048)      CASE_ARGS="configs/ctx2048_tf32.yaml" ;;
    ctx2048_bf16) CASE_ARGS="configs/ctx2048_bf16.yaml" ;;
    gpt2_b8)      gpt2_shards; CASE_ARGS="configs/gpt2_124m_tf32.yaml $gpt2 --batch_size=8" ;;
    gpt2_b8_bf16) gpt2_shards; CASE_ARGS="configs/gpt2_124m.yaml $gpt2 --batch_size=8" ;;
    gpt2_b16_bf16) gpt2_shards; CASE_ARGS="configs/gpt2_124m.yaml $gpt2 --batch_size=16" ;;
    gpt2_b8_bf16f) gpt2_shards; CASE_ARGS="configs/gpt2_124m.yaml $gpt2 --batch_size=8 --grad_dtype=fp32 --recompute=6" ;;
    gpt2_b16_bf16f)               # fp32 gradients and 6 layers rebuilding the GELU output (the config before bf16 ones)
                  gpt2_shards; CASE_ARGS="configs/gpt2_124m.yaml $gpt2 --batch_size=16 --grad_dtype=fp32 --recompute=6" ;;
    gpt2_b16_bf16f0)              # fp32 gradients, no layer rebuilding it (the recompute's share of the difference)
                  gpt2_shards; CASE_ARGS="configs/gpt2_124m.yaml $gpt2 --batch_size=16 --grad_dtype=fp32 --recompute=0" ;;
    gpt2_b8_bf16_stored)          # the GELU output kept a layer, not rebuilt in the backward (a larger plan)
                  gpt2_shards; CASE_ARGS="configs/gpt2_124m.yaml $gpt2 --batch_size=8 --recompute=false" ;;
    *) echo "unknown speed case $1"; return 1 ;;
  esac
}
