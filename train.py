"""Train a character-level GPT on the GPU.

    python train.py configs/shakespeare_char_fp32.yaml
    python train.py configs/tiny.yaml --max_iters=100 --learning_rate=3e-3
    python train.py configs/ctx2048_tf32.yaml --plan       # print the memory plan, touch no GPU
    python train.py configs/tiny.yaml --resume             # continue from out_dir/last.ckpt
    python train.py configs/tiny.yaml --backend=reference  # float64 numpy, no GPU needed
    python train.py configs/ctx2048_tf32.yaml --profile    # the phase table of one step, then exit

Settings: defaults < the YAML file < --key=value overrides (see gptcuda/config.py).
The run directory (out_dir) gets config.yaml, tokenizer.json, metrics.jsonl, best.ckpt, last.ckpt.
Ctrl-C saves last.ckpt and exits. Exit codes: 0 done, 1 the loss went non-finite, 2 a usage,
config, data, checkpoint or device error (one line on stderr).
"""
import sys

from gptcuda.cli import guarded, split_args
from gptcuda.config import load_config


@guarded
def main(argv):
    path, overrides, flags, _ = split_args(argv, flags=("plan", "resume", "no-bar", "profile"))
    cfg = load_config(path, overrides)
    from gptcuda.trainer import NonFiniteLoss, Trainer, print_plan
    if "plan" in flags:
        print_plan(cfg)
        return 0
    trainer = Trainer(cfg, resume="resume" in flags)
    if "profile" in flags:
        print(trainer.profile())
        return 0
    try:
        best = trainer.train(bar="no-bar" not in flags and sys.stderr.isatty())
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"best val loss {best:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
