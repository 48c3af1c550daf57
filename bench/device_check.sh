#!/usr/bin/env bash
# The GPU check-and-benchmark, driven from the repo so that it is repeatable.
#   bash bench/device_check.sh [tests] [gradcheck] [tune] [bench] [attention] [long] [torch] [gemm]
#                              [train_fp32] [train_tf32] [train_config] [seeds] [dist]
#                              [gpt2_data] [gpt2_step] [llmc] [gpt2_train] [gpt2_accum]
#                              [interop] [finetune] [generate] [speed] [anchors] [hellaswag] [plot] [tables]
#                              [soak] [sass] [bf16] [attn_bf16] [torch_profile]
# Environment: TESTS (pytest paths, default tests), TEST_PROCS, TESTS_TIMEOUT (seconds: the suite is stopped after), STEP_CASES ("fp32:unfused tf32:fused ..."),
# GEMM_PRECISION, GEMM_ARGS, ATTN_T, TRAIN_ATTN, BUDGET_S (seconds after which no step starts),
# SEEDS_GROUPS / SEEDS_UNTIL / SEEDS_PER_GPU / SEEDS_BUDGET_S / SEEDS_PAIRED ("A,B A,B": for seeds:
# bench/seeds.py; a group label@TREE runs another checkout, e.g. one unpacked under .devcarry),
# TRAIN_CONFIG (for train_config), DIST_WORLDS ("1,2"), DIST_ZERO ("0 1"), TORCH_WHICH ("steps compile"), TUNE_PRECISIONS ("tf32 fp32"),
# GPT2_BATCHES ("8 16": bench/step.py of configs/gpt2_124m_tf32.yaml and the PyTorch / llm.c anchors at these
# micro-batches), ACCUM_STEPS (50: gpt2_accum's steps of 524288 tokens), GEN_BATCHES ("1,16,64,256"),
# GEN_TORCH_MODES ("eager,compile"), HELLASWAG_ARGS (more bench/hellaswag_check.py options), PLOT_ITERS (500:
# each of plot's two runs), GEN_ARGS (more bench/generate.py options), SOAK_DATA / SOAK_KILLS (5) /
# SOAK_SEED / SOAK_ARGS (soak: bench/soak.py), SASS_OLD (sass: the tree
# to compare with, default .devcarry/oldtree, e.g. `git archive REV | tar -x -C .devcarry/oldtree`),
# SASS_FILES (sass: only these kernel files, each tree's names), SASS_JOBS (sass: compiling processes, default 2; the H200 machine has 16 cores).
# llm.c (karpathy/llm.c f1e2ace: Makefile, train_gpt2.cu, llmc/) is read from .devcarry/llmc.
# A STEP_CASES entry may carry overrides: fp32:fused:fp32_gemm=ffma,batch_size=32.
# Logs go to $OUT (or ./out/device when OUT is unset). The PyTorch anchor scripts are read from
# .devcarry/reference/ (a copy of the reference scripts carried along; never imported by gptcuda).
set -uo pipefail
cd "$(dirname "$0")/.."
. bench/cases.sh          # $OUT, the environment, the speed cases, GPT2_DATA and gpt2_shards
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests gradcheck bench)
T0=$(date +%s)
# a step starts only while the run's budget (BUDGET_S seconds, default 480) is not spent, so the
# logs are always packed before the device call's own time limit
has() {
  local s
  if [ $(( $(date +%s) - T0 )) -gt "${BUDGET_S:-480}" ]; then echo "== skipped $1 (budget spent)" | tee -a "$OUT/summary.txt"; return 1; fi
  for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1
}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
# NCCL for the data-parallel tests and runs: nccl4py from the carried wheels when the image lacks it
nccl_env() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if ! python3 -c "import nccl.bindings" 2>/dev/null && ls .devcarry/whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install --no-deps --no-index -q --target /tmp/site .devcarry/whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
}


log "device: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader)"
python3 -c "import cuda.bindings, numpy; from gptcuda.runtime.compiler import nvrtc_version; print('cuda-bindings', cuda.bindings.__version__, 'nvrtc', nvrtc_version(), 'numpy', numpy.__version__)" | tee -a "$OUT/summary.txt"

if has tests; then
  nccl_env
  log "GPU test suite: python3 -m pytest ${TESTS:-tests} -q -m gpu"
  ${TESTS_TIMEOUT:+timeout $TESTS_TIMEOUT} python3 -m pytest ${TESTS:-tests} -q -m gpu -p no:cacheprovider \
    -n ${TEST_PROCS:-8} 2>&1 | tee "$OUT/tests.log" | tail -25
  tail -1 "$OUT/tests.log" >> "$OUT/summary.txt"
fi
if has gradcheck; then
  for p in fp32 tf32; do
    log "gradcheck $p"
    python3 gradcheck.py configs/tiny.yaml --precision=$p --dropout=0.1 2>&1 | tee -a "$OUT/gradcheck.log" | tail -3
  done
  log "gradcheck --break=layernorm (must fail upstream of lnf)"
  python3 gradcheck.py configs/tiny.yaml --break=layernorm 2>&1 | tee -a "$OUT/gradcheck.log" | grep -E "lnf|wte|FAILED|PASSED"
  for a in fused unfused; do           # widths, heads and T off the tile sizes, in TF32
    log "gradcheck tf32 $a, 3 layers, C 96, 3 heads, T 23, B 3"
    python3 gradcheck.py --precision=tf32 --attention=$a --n_layer=3 --n_embd=96 --n_head=3 --block_size=23 \
      --batch_size=3 --dropout=0.1 2>&1 | tee -a "$OUT/gradcheck.log" | tail -1
  done
  log "gradcheck tf32 --break=layernorm (must fail)"
  python3 gradcheck.py --precision=tf32 --break=layernorm 2>&1 | tee -a "$OUT/gradcheck.log" | tail -1
fi
# the measured GEMM table first: the step benchmarks below use it, as training does
if has tune; then
  for p in ${TUNE_PRECISIONS:-tf32 fp32}; do
    log "measured GEMM dispatch $p"
    python3 bench/tune.py configs/shakespeare_char_fp32.yaml --precision=$p 2>&1 | tee "$OUT/tune_$p.log" | tail -25
  done
fi
if has bench; then
  log "launch overhead"
  python3 bench/launch.py 2>&1 | tee -a "$OUT/summary.txt"
  for pa in ${STEP_CASES:-fp32:unfused fp32:fused tf32:unfused tf32:fused}; do
    IFS=: read -r p a o <<< "$pa"          # precision:attention[:key=value,key=value]
    tag=${p}_$a${o:+_${o//[=,]/_}}
    {
      log "step $p $a ${o:-}"
      python3 bench/step.py configs/shakespeare_char_fp32.yaml --precision=$p --attention=$a \
        $(for kv in ${o//,/ }; do printf -- "--%s " "$kv"; done) \
        --json "$OUT/step_$tag.json" > "$OUT/step_$tag.log" 2>&1
      sed -n '1,18p' "$OUT/step_$tag.log"
    }
  done
fi
# the four workloads of the speed goals, each with its phase table: the char model in TF32 and in fp32
# (3xTF32), the T2048 context, GPT-2 124M at B8 (SPEED_CASES selects; GEMM_MODELS adds bench/gemm.py at
# those models' shapes, e.g. "8,1024,768,50304")
if has bf16; then            # the BF16 warpgroup-MMA product against float64 (and its speed beside TF32)
  log "bf16 GEMM: bench/bf16_gemm.py --check ${BF16_GEMM_ARGS:-}"
  python3 bench/bf16_gemm.py --check ${BF16_GEMM_ARGS:-} --json "$OUT/bf16_gemm.json" > "$OUT/bf16_gemm.log" 2>&1
  grep -E "FAIL|check:|sum |TFLOP" "$OUT/bf16_gemm.log" | tail -20 | tee -a "$OUT/summary.txt"
fi
if has speed; then
  for c in ${SPEED_CASES:-char_tf32 char_fp32 ctx2048 gpt2_b8 char_bf16 gpt2_b8_bf16}; do
    case_args $c || continue
    args=$CASE_ARGS
    log "step $c: bench/step.py $args ${SPEED_ARGS:-}"
    python3 bench/step.py $args ${SPEED_ARGS:-} --iters ${SPEED_ITERS:-30} --json "$OUT/speed_$c.json" \
      > "$OUT/speed_$c.log" 2>&1
    grep -E "ms/step|THROTTLED|clock|error|Error" "$OUT/speed_$c.log" | head -6 | tee -a "$OUT/summary.txt"
  done
  for m in ${GEMM_MODELS:-}; do
    log "GEMM shapes of the model $m (${GEMM_PRECISION:-tf32}, cuBLAS beside)"
    python3 bench/gemm.py --precision ${GEMM_PRECISION:-tf32} --model $m ${GEMM_ARGS:-} 2>&1 \
      | tee "$OUT/gemm_${m//,/_}.log" | tail -40
  done
fi
# the same call's anchors for the speed goals: PyTorch's char step (eager and torch.compile, dropout 0.2
# as configs/ctx256_tf32.yaml), its GPT-2 124M B8 T1024 (dropout 0) and B16 T2048 6L C384 (dropout 0.2,
# configs/ctx2048_tf32.yaml) steps, and llm.c's GPT-2 124M (FP32 = TF32 cuBLAS, and BF16) at B8
if has anchors; then
  for a in "char:steps compile:0.2:" "gpt2:shape:0:8,1024,12,12,768,50304" "ctx2048:shape:0.2:16,2048,6,6,384"; do
    IFS=: read -r tag which drop shapes <<< "$a"
    log "PyTorch anchor $tag: torch_reference.py $which (DROPOUT=$drop${shapes:+, SHAPES=$shapes})"
    mkdir -p "$OUT/torch_$tag"
    (cd "$OUT/torch_$tag" && SHAPES="$shapes" DROPOUT=$drop OUT="$OUT/torch_$tag" \
      python3 "$OLDPWD/.devcarry/reference/torch_reference.py" $which 2>&1 | tail -12) | tee -a "$OUT/summary.txt"
  done
  log "llm.c GPT-2 124M anchor B${ANCHOR_LLMC_B:-8} (FP32 = TF32 cuBLAS, and BF16)"
  rm -rf /tmp/llmc && cp -r .devcarry/llmc /tmp/llmc
  bash .devcarry/reference/llmc_anchor.sh /tmp/llmc ${ANCHOR_LLMC_B:-8} 2>&1 | tee "$OUT/llmc.log" | tail -8 | tee -a "$OUT/summary.txt"
fi
if has attention; then
  log "attention benchmark"
  python3 bench/attention.py --n_embd 384 --n_head 6 --B 16 --T ${ATTN_T:-256,1024,2048,8192} 2>&1 | tee "$OUT/attention.log" | tail -30
fi
# the bf16 flash kernels at the three bf16 workloads' attention shapes (GPT-2 B8 T1024, T2048 and the char
# model with dropout 0.2), PyTorch's bf16 SDPA beside (ATTN_IMPL); ATTN_BF16_TILES: bench/attention.py --bf16-tiles
if has attn_bf16; then
  for s in "8:1024:768:12:0" "16:2048:384:6:0.2" "64:256:384:6:0.2"; do
    IFS=: read -r b t c h d <<< "$s"
    log "bf16 attention B$b T$t C$c H$h dropout $d"
    python3 bench/attention.py --precision bf16 --impl ${ATTN_IMPL:-fused,torch} --B $b --T $t --n_embd $c --n_head $h \
      --dropout $d --iters ${ATTN_ITERS:-30} --bf16-tiles "${ATTN_BF16_TILES:-default}" 2>&1 \
      | tee "$OUT/attn_bf16_$t.log" | tail -12 | tee -a "$OUT/summary.txt"
  done
fi
if has torch_profile; then      # PyTorch's bf16 step by kernel (bench/torch_profile.py), beside ours' phase table
  for s in "gpt2_b8:8,1024,12,12,768,50304:0" "t2048:16,2048,6,6,384,65:0.2"; do
    IFS=: read -r tag shape d <<< "$s"
    log "PyTorch's step by kernel, $tag: bench/torch_profile.py --shape $shape --dropout $d"
    python3 bench/torch_profile.py --shape "$shape" --dropout $d --top ${TORCH_PROFILE_TOP:-40} \
      > "$OUT/torch_profile_$tag.log" 2>&1
    grep -v "Warn\|_warn_once" "$OUT/torch_profile_$tag.log" | head -20 | tee -a "$OUT/summary.txt"
  done
fi
if has long; then
  log "long context step: ctx2048 tf32 fused"
  python3 bench/step.py configs/ctx2048_tf32.yaml --iters 10 2>&1 | tee "$OUT/step_ctx2048.log" | sed -n '1,14p'
fi
if has long_train; then
  log "long context training: ctx2048 tf32 fused (60 steps) and ctx8192 (6 steps)"
  python3 train.py configs/ctx2048_tf32.yaml --max_iters=60 --eval_interval=30 --eval_iters=4 --log_interval=10 \
    --out_dir="$OUT/ctx2048" --no-bar 2>&1 | grep -E "^step|total|error" | tail -14
  python3 train.py configs/ctx8192_tf32.yaml --max_iters=6 --eval_interval=3 --eval_iters=1 --log_interval=2 \
    --out_dir="$OUT/ctx8192" --no-bar 2>&1 | grep -E "^step|total|error" | tail -8
  python3 train.py configs/ctx8192_tf32.yaml --attention=unfused --out_dir="$OUT/ctx8192u" 2>&1 | tail -4
  rm -rf "$OUT"/ctx*/*.ckpt
  if [ -f .devcarry/reference/torch_reference.py ]; then
    (cd "$OUT" && LONG_T=2048,8192 OUT="$OUT" python3 "$OLDPWD/.devcarry/reference/torch_reference.py" long 2>&1 | tail -4) | tee -a "$OUT/summary.txt"
  fi
fi
if has torch; then
  log "PyTorch anchors (same run)"
  (cd "$OUT" && DROPOUT=0.2 OUT="$OUT" python3 "$OLDPWD/.devcarry/reference/torch_reference.py" ${TORCH_WHICH:-steps compile} 2>&1 | tail -8) | tee -a "$OUT/summary.txt"
fi
for p in fp32 tf32; do
  if has train_$p; then
    log "5000-step shakespeare $p"
    python3 train.py configs/shakespeare_char_fp32.yaml --precision=$p --attention=${TRAIN_ATTN:-unfused} \
      --out_dir="$OUT/run_$p" --no-bar 2>&1 \
      | tee "$OUT/train_$p.log" | grep -E "^step [0-9]+:|best val|error" | tail -30
    python3 sample.py --out_dir "$OUT/run_$p" --max_new_tokens 300 --seed 1 2>&1 | tail -12 | tee -a "$OUT/summary.txt"
    rm -f "$OUT/run_$p"/*.ckpt
  fi
done
if has train_config; then                  # a shipped config as it is, e.g. TRAIN_CONFIG=configs/ctx256_tf32.yaml
  log "5000-step $TRAIN_CONFIG"
  python3 train.py "$TRAIN_CONFIG" --out_dir="$OUT/run_config" --no-bar 2>&1 \
    | tee "$OUT/train_config.log" | grep -E "^step [0-9]+:|best val|error" | tail -30
  python3 sample.py --out_dir "$OUT/run_config" --max_new_tokens 300 --seed 1 2>&1 | tail -12 | tee -a "$OUT/summary.txt"
  rm -f "$OUT/run_config"/*.ckpt
fi
if has dist; then
  nccl_env
  log "data parallel: NCCL $(python3 -c 'from gptcuda import dist; print(dist.nccl_version())' 2>&1 | tail -1)"
  timeout 360 python3 -m pytest tests/gpu/test_dist_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/dist.log" | tail -6
  for z in ${DIST_ZERO:-0}; do
    timeout 240 python3 bench/scaling.py configs/gpt2_124m_t1024.yaml --worlds ${DIST_WORLDS:-1,2} --iters 10 \
      --zero=$z --json "$OUT/scaling_zero$z.json" 2>&1 | tee -a "$OUT/dist.log" | tail -8
  done
fi
if has gpt2_data; then
  log "prepare.py tiny Shakespeare -> GPT-2 BPE shards"
  python3 prepare.py data/tinyshakespeare/input.txt --tokenizer gpt2 --out $GPT2_DATA 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
  python3 prepare.py data/tinyshakespeare/input.txt --tokenizer gpt2 --out $GPT2_DATA 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
  ls -l $GPT2_DATA | tee -a "$OUT/summary.txt"
fi
if has gpt2_step; then
  for b in ${GPT2_BATCHES:-8 16}; do
    log "step GPT-2 124M B$b T1024 tf32 (vocabulary 50304)"
    python3 bench/step.py configs/gpt2_124m_tf32.yaml --data=$GPT2_DATA --val_data= --total_batch_tokens=0 \
      --batch_size=$b --iters 20 --json "$OUT/step_gpt2_b$b.json" > "$OUT/step_gpt2_b$b.log" 2>&1
    sed -n '1,40p' "$OUT/step_gpt2_b$b.log"
  done
  if [ -f .devcarry/reference/torch_reference.py ]; then
    log "PyTorch GPT-2 124M (same run)"
    shapes=$(for b in ${GPT2_BATCHES:-8 16}; do printf "%s;" "$b,1024,12,12,768,50304"; done)
    (cd "$OUT" && SHAPES="${shapes%;}" DROPOUT=0 OUT="$OUT" python3 "$OLDPWD/.devcarry/reference/torch_reference.py" shape 2>&1 | tail -12) | tee -a "$OUT/summary.txt"
  fi
fi
if has llmc; then
  log "llm.c GPT-2 124M anchor (FP32 = TF32 cuBLAS, and BF16)"
  rm -rf /tmp/llmc && cp -r .devcarry/llmc /tmp/llmc
  bash .devcarry/reference/llmc_anchor.sh /tmp/llmc ${GPT2_BATCHES:-8 16} 2>&1 | tee "$OUT/llmc.log" | tail -20
  if [ -x /tmp/llmc/train_gpt2cu ] && [ -f $GPT2_DATA/train_000000.bin ]; then
    log "llm.c train_gpt2cu on our prepare.py shards"
    (cd /tmp/llmc && ./train_gpt2cu -i $GPT2_DATA/train_000000.bin -j $GPT2_DATA/val_000000.bin -e d12 -b 4 -t 1024 \
      -x 10 -v 5 -s 0 -r 0 2>&1 | grep -E "train data|val data|num_tokens|val loss|^step +(1|5|10)/" | tee -a "$OUT/summary.txt")
  fi
fi
if has gpt2_train; then
  log "configs/shakespeare_gpt2.yaml end to end, then sample.py"
  python3 train.py configs/shakespeare_gpt2.yaml --out_dir="$OUT/sg2" --no-bar 2>&1 \
    | tee "$OUT/train_sg2.log" | grep -E "^step [0-9]+:|best val|error|parameters" | tail -14
  python3 sample.py --out_dir "$OUT/sg2" --max_new_tokens 120 --seed 1 --num_samples 2 2>&1 | tail -14 | tee -a "$OUT/summary.txt"
fi
if has gpt2_accum; then
  log "configs/gpt2_124m.yaml, total_batch_tokens 524288, ${ACCUM_STEPS:-50} steps on the shards, straight and resumed"
  python3 bench/resume_check.py configs/gpt2_124m.yaml --data=$GPT2_DATA --val_data= --max_iters=${ACCUM_STEPS:-50} \
    --lr_decay_iters=${ACCUM_STEPS:-50} --warmup_iters=5 --eval_interval=1000 --eval_iters=4 --out /tmp/resume_check 2>&1 \
    | tee "$OUT/gpt2_accum.log" | grep -vE "^ *[a-z_0-9]+: " | tail -30
fi
# kill -9 at 5 random points of a GPT-2 124M run with gradient accumulation (inside a step's micro-batches, an
# evaluation, a checkpoint write), resumed each time: last.ckpt, best.ckpt and metrics.jsonl (timings aside) must
# equal an uninterrupted run's. 65536 tokens a step (4 micro-batches of 16 x 1024), 24 steps, dropout 0.1 (the
# RNG streams cross the restarts too). Data: SOAK_DATA, else the prepared shared corpus carried as
# .devcarry/soak_data (../shared/data/corpus/build.py DIR; prepare.py DIR --tokenizer gpt2), else the
# tiny-Shakespeare GPT-2 shards.
if has soak; then
  SOAK_DATA=${SOAK_DATA:-$( [ -f .devcarry/soak_data/prepare.json ] && echo .devcarry/soak_data )}
  [ -z "$SOAK_DATA" ] && { gpt2_shards; SOAK_DATA=$GPT2_DATA; }
  log "soak: configs/gpt2_124m.yaml on $SOAK_DATA, ${SOAK_KILLS:-5} kill -9s, resumed each time"
  python3 bench/soak.py --config configs/gpt2_124m.yaml --data "$SOAK_DATA" --kills ${SOAK_KILLS:-5} --seed ${SOAK_SEED:-1} \
    --out /tmp/soak --val_data= --total_batch_tokens=65536 --max_iters=24 --eval_interval=8 --eval_iters=4 \
    --warmup_iters=4 --lr_decay_iters=24 --dropout=0.1 ${SOAK_ARGS:-} 2>&1 | tee "$OUT/soak.log" | tee -a "$OUT/summary.txt"
  tail -40 /tmp/soak/soak.log > "$OUT/soak_runs.log" 2>/dev/null
  rm -rf /tmp/soak
fi
# llm.c's FP32 build (cuBLAS, TF32 off with -f 0) reads our --to llmc export: interop_check (c) compares its
# first val loss with ours; (a) and (b) are the Hugging Face logits gates
if has interop; then
  log "interop: HF import / export logits, llm.c -e on our export"
  if [ ! -x /tmp/llmc_fp32/train_gpt2cu ]; then
    rm -rf /tmp/llmc_fp32 && cp -r .devcarry/llmc /tmp/llmc_fp32
    sed -i 's/cudaCheck_(cudaMemAdvise(\*out, bytes, cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId), file, line);/{ cudaMemLocation loc_{}; loc_.type = cudaMemLocationTypeHost; loc_.id = 0; cudaCheck_(cudaMemAdvise(*out, bytes, cudaMemAdviseSetPreferredLocation, loc_), file, line); }/' /tmp/llmc_fp32/llmc/cuda_utils.cuh
    (cd /tmp/llmc_fp32 && make train_gpt2cu PRECISION=FP32 USE_CUDNN=0 NO_MULTI_GPU=1 NO_USE_MPI=1 \
      GPU_COMPUTE_CAPABILITY=90 > build.log 2>&1) || tail -5 /tmp/llmc_fp32/build.log
  fi
  gpt2_shards
  python3 bench/interop_check.py --data $GPT2_DATA --llmc_bin /tmp/llmc_fp32/train_gpt2cu --out /tmp/interop 2>&1 \
    | tee "$OUT/interop.log" | grep -vE "^ *[a-z_0-9]+: " | tail -40
  cp /tmp/interop/run/metrics.jsonl "$OUT/interop_run_metrics.jsonl" 2>/dev/null
fi
# fine-tuning from imported weights: a random GPT2LMHeadModel-shaped export of a run trained here, then train.py
# --init_from it on the GPT-2 shards (loss falls), then sample.py --init_from the Hugging Face directory
if has finetune; then
  log "fine-tune: train.py --init_from=hf:DIR, then sample.py --init_from"
  python3 export.py /tmp/interop/run --to hf /tmp/ft_hf --overwrite 2>&1 | tail -1
  python3 train.py configs/shakespeare_gpt2.yaml --init_from=hf:/tmp/ft_hf --block_size=64 --attention=unfused --data=$GPT2_DATA --val_data= \
    --max_iters=60 --eval_interval=30 --eval_iters=10 --warmup_iters=5 --lr_decay_iters=60 --learning_rate=1e-3 \
    --out_dir=/tmp/ft_run --overwrite --no-bar 2>&1 | tee "$OUT/finetune.log" | grep -E "^step [0-9]+:|init_from|initialised|best val|error" | tee -a "$OUT/summary.txt"
  python3 sample.py --out_dir /tmp/ft_run --max_new_tokens 60 --seed 1 --num_samples 2 --top_p 0.9 2>&1 | tail -8 | tee -a "$OUT/summary.txt"
  python3 sample.py --init_from hf:/tmp/ft_hf --prompt "ROMEO:" --max_new_tokens 40 --temp 0 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
fi
if has generate; then
  log "generation beside HF transformers: batches ${GEN_BATCHES:-1,16,64,256}, torch modes ${GEN_TORCH_MODES:-eager,static,compile}"
  python3 bench/generate.py --batches ${GEN_BATCHES:-1,16,64,256} --torch_modes ${GEN_TORCH_MODES:-eager,static,compile} \
    ${GEN_ARGS:-} --json "$OUT/generate.json" 2>&1 | tee "$OUT/generate.log" | tail -16 | tee -a "$OUT/summary.txt"
fi
# HellaSwag: GPT-2 124M-shaped random weights exported to HF; a few hundred synthetic examples scored by our
# forward and by transformers (per ending and per example), then the time of 10,042 examples
# which GEMM kernels the measured table picks for every shipped config (and the char configs at the other
# precision): bench/tables.py sets each up as training does (gemm_tune auto), the tables come back
if has tables; then
  gpt2_shards
  log "GEMM table picks of the shipped configs (bench/tables.py)"
  python3 bench/tables.py configs/tiny.yaml configs/tiny.yaml:--precision=tf32 configs/ctx256_tf32.yaml \
    configs/ctx256_tf32.yaml:--precision=fp32 configs/ctx256_fp32.yaml configs/shakespeare_char_fp32.yaml \
    configs/shakespeare_char_fp32.yaml:--precision=tf32 configs/ctx1024_tf32.yaml configs/ctx2048_tf32.yaml \
    configs/ctx8192_tf32.yaml configs/gpt2_124m_t1024.yaml configs/shakespeare_gpt2.yaml \
    "configs/gpt2_124m.yaml:--data=$GPT2_DATA,--val_data=,--total_batch_tokens=0" \
    "configs/gpt2_124m.yaml:--data=$GPT2_DATA,--val_data=,--total_batch_tokens=0,--batch_size=8" \
    --json="$OUT/tables.json" > "$OUT/tables.log" 2>&1
  sed -n '/family \/ tile picked/,$p' "$OUT/tables.log" | tee -a "$OUT/summary.txt"
  mkdir -p "$OUT/tune" && cp "$GPTCUDA_CACHE"/tune/*.json "$OUT/tune/" 2>/dev/null
fi
if has hellaswag; then
  log "hellaswag: our forward beside transformers on synthetic examples; the time of 10,042"
  python3 bench/hellaswag_check.py --out /tmp/hellaswag ${HELLASWAG_ARGS:-} 2>&1 | tee "$OUT/hellaswag.log" \
    | grep -E "PASS|FAIL|examples|losses|acc" | tee -a "$OUT/summary.txt"
  rm -rf /tmp/hellaswag/hf
fi
# plot.py on two real runs: the Shakespeare GPT-2 recipe in fp32 and in tf32 (their metrics come back too)
if has plot; then
  gpt2_shards
  for p in fp32 tf32; do
    log "plot run $p: configs/shakespeare_gpt2.yaml, ${PLOT_ITERS:-500} steps"
    python3 train.py configs/shakespeare_gpt2.yaml --precision=$p --data=$GPT2_DATA --val_data= --max_iters=${PLOT_ITERS:-500} \
      --lr_decay_iters=${PLOT_ITERS:-500} --eval_interval=100 --out_dir=/tmp/plot_runs/gpt2_$p --overwrite --no-bar 2>&1 \
      | tee "$OUT/plot_train_$p.log" | grep -E "^step [0-9]+:|best val|error" | tail -3 | tee -a "$OUT/summary.txt"
    mkdir -p "$OUT/plot_runs/gpt2_$p" && cp /tmp/plot_runs/gpt2_$p/metrics.jsonl "$OUT/plot_runs/gpt2_$p/"
  done
  python3 -c "import matplotlib" 2>/dev/null || { ls .devcarry/whl/matplotlib*.whl >/dev/null 2>&1 && \
    python3 -m pip install --no-index -q --find-links .devcarry/whl matplotlib; }
  python3 plot.py /tmp/plot_runs/gpt2_fp32 /tmp/plot_runs/gpt2_tf32 --out "$OUT/plot_gpt2.png" --overwrite 2>&1 \
    | tee -a "$OUT/summary.txt"     # without matplotlib there: plot.py on the metrics that came back
fi
if has seeds; then          # best val over seeds, e.g. SEEDS_GROUPS="tf32=configs/ctx256_tf32.yaml:1-8"
  log "best val over seeds: ${SEEDS_GROUPS}"
  paired=(); for p in ${SEEDS_PAIRED:-}; do paired+=(--paired "$p"); done
  python3 bench/seeds.py ${SEEDS_GROUPS} --per-gpu ${SEEDS_PER_GPU:-2} ${SEEDS_UNTIL:+--until $SEEDS_UNTIL} "${paired[@]}" \
    --budget-s ${SEEDS_BUDGET_S:-300} --out "$OUT/seeds" --json "$OUT/seeds.json" 2>&1 \
    | tee "$OUT/seeds.log" | tail -40 | tee -a "$OUT/summary.txt"
  find "$OUT/seeds" -name "*.ckpt" -delete
fi
if has sass; then           # every kernel's machine code against another tree (no GPU needed; NVRTC and ptxas)
  old=${SASS_OLD:-.devcarry/oldtree}
  log "machine code: bench/sass_compare.py $old . ${SASS_FILES:+--files $SASS_FILES}"
  python3 bench/sass_compare.py "$old" . --jobs ${SASS_JOBS:-2} ${SASS_FILES:+--files $SASS_FILES} --out "$OUT/sass" 2>&1 \
    | tee "$OUT/sass.log" | grep -v "^  \[" | tail -40 | tee -a "$OUT/summary.txt"
  rm -rf "$OUT/sass/old/cubins" "$OUT/sass/new/cubins"
fi
if has gemm; then
  log "GEMM benchmark (cuBLAS through torch in the same process, benchmark only)"
  python3 bench/gemm.py --precision ${GEMM_PRECISION:-both} ${GEMM_ARGS:-} 2>&1 | tee "$OUT/gemm.log" | tail -60
fi
log "end: $(nvidia-smi --query-gpu=clocks.sm,memory.used --format=csv,noheader)"
# at most a few files come back: keep the summary, pack everything else
find "$OUT" -name "*.ckpt" -delete
tar czf /tmp/logs.tgz -C "$OUT" --exclude=summary.txt . \
  && find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.txt -exec rm -rf {} + \
  && mv /tmp/logs.tgz "$OUT/logs.tgz"
