"""Train a character-level GPT on the GPU.

    python train.py configs/shakespeare_char_fp32.yaml
    python train.py configs/tiny.yaml --max_iters=100 --learning_rate=3e-3
    python train.py configs/ctx2048_tf32.yaml --plan       # print the memory plan, touch no GPU
    python train.py configs/tiny.yaml --resume             # continue from out_dir/last.ckpt
    python train.py configs/tiny.yaml --backend=reference  # float64 numpy, no GPU needed
    python train.py configs/ctx2048_tf32.yaml --profile    # the phase table of one step, then exit
    python -m gptcuda.launch --nproc 2 train.py configs/tiny.yaml   # data parallel on 2 GPUs

Settings: defaults < the YAML file < --key=value overrides (see gptcuda/config.py).
The run directory (out_dir) gets config.yaml, tokenizer.json, metrics.jsonl, best.ckpt, last.ckpt.
Ctrl-C saves last.ckpt and exits. Exit codes: 0 done, 1 the loss went non-finite, 2 a usage,
config, data, checkpoint, device or data-parallel setup error (one line on stderr).
With RANK and WORLD_SIZE set (gptcuda.launch, mpirun, srun: README "Several GPUs") each process
trains on GPU LOCAL_RANK with batch_size rows of the world's batch; rank 0 logs and writes files.
"""
import sys

from gptcuda.cli import fatal, guarded, split_args
from gptcuda.config import load_config


@guarded
def main(argv):
    path, overrides, flags, _ = split_args(argv, flags=("plan", "resume", "no-bar", "profile"))
    cfg = load_config(path, overrides)
    from gptcuda import dist
    from gptcuda.trainer import NonFiniteLoss, Trainer, print_plan
    if "plan" in flags:
        print_plan(cfg)
        return 0
    group = None
    try:
        env = dist.parse_env()
        if env.enabled:
            cfg.device = env.local_rank
            group = dist.init_group(env)                  # the rendezvous; NCCL is imported here only
        trainer = Trainer(cfg, resume="resume" in flags, group=group)
        if "profile" in flags:
            table = trainer.profile()
            if trainer.main:
                print(table)
            return 0
        try:
            best = trainer.train(bar="no-bar" not in flags and sys.stderr.isatty())
        except NonFiniteLoss as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    except dist.DistError as e:
        if group is not None:
            group.abort()
        fatal(str(e))
    if group is not None:
        group.close()
    if trainer.main:
        print(f"best val loss {best:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
