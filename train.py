"""Train a GPT on the GPU: characters or BPE tokens (gpt2, bpe:N), from a text file or token shards.

    python train.py configs/shakespeare_char_fp32.yaml
    python train.py configs/gpt2_124m.yaml --data=data/mycorpus --val_data=   # shards from prepare.py
    python train.py configs/tiny.yaml --max_iters=100 --learning_rate=3e-3
    python train.py configs/ctx2048_tf32.yaml --plan       # print the memory plan, touch no GPU
    python train.py configs/tiny.yaml --resume             # continue from out_dir/last.ckpt
    python train.py configs/tiny.yaml --overwrite          # start afresh where a run already is
    python train.py configs/tiny.yaml --backend=reference  # float64 numpy, no GPU needed
    python train.py configs/ctx2048_tf32.yaml --profile    # the phase table of one step, then exit
    python train.py configs/shakespeare_gpt2.yaml --init_from=hf:gpt2_dir --eval_only   # those weights' losses
    python -m gptcuda.launch --nproc 2 train.py configs/tiny.yaml   # data parallel on 2 GPUs

Settings: defaults < the YAML file < --key=value overrides (see gptcuda/config.py).
The run directory (out_dir) gets config.yaml, tokenizer.json, metrics.jsonl, best.ckpt, last.ckpt;
an out_dir that already holds a run is refused unless --resume (continue it: the model and
tokenizer settings must match the checkpoint's, recipe changes are logged) or --overwrite.
Ctrl-C (SIGINT) or SIGTERM saves last.ckpt and exits (130, 143); a second one waits for the save.
Exit codes: 0 done, 1 the loss went non-finite, 2 a usage, config, data, checkpoint, run
directory, device or data-parallel setup error (one line on stderr), 130 / 143 interrupted.
With RANK and WORLD_SIZE set (gptcuda.launch, mpirun, srun: README "Several GPUs") each process
trains on GPU LOCAL_RANK with batch_size rows of the world's batch; rank 0 logs and writes files.
"""
import sys

try:
    from gptcuda.cli import RunError, UsageError, guarded, print_help, split_args
    from gptcuda.config import load_config
except KeyboardInterrupt:           # Ctrl-C while the modules load: one word, no traceback
    print("interrupted", file=sys.stderr)
    sys.exit(130)

FLAGS = {
    "--plan": "print the config, the data and the memory plan; touch no GPU and write no file (a gpt2 or "
              "bpe:N config needs no data for it)",
    "--resume": "continue the run in out_dir from its last.ckpt",
    "--overwrite": "start a new run in an out_dir that holds one, replacing its files",
    "--no-bar": "log a line a step instead of the progress bar",
    "--profile": "print the phase table of one training step (cuda backend), then exit",
    "--eval_only": "evaluate the weights (--resume: the run's last.ckpt; init_from: those; else the fresh "
                   "initialisation) on eval_iters batches of each split, the same ones for any weights, print "
                   "the losses, write no file",
}


@guarded
def main(argv):
    path, overrides, flags, _ = split_args(argv, flags=tuple(f[2:] for f in FLAGS))
    if "help" in flags:
        return print_help(__doc__, FLAGS)
    cfg = load_config(path, overrides)
    from gptcuda import dist
    from gptcuda.training.trainer import EXIT_CODES, NonFiniteLoss, Trainer, check_device, fmt_loss, print_plan
    if "plan" in flags:
        print_plan(cfg)
        return 0
    for other in ("profile", "overwrite"):         # --eval_only writes nothing and trains no step
        if "eval_only" in flags and other in flags:
            raise UsageError(f"--eval_only and --{other}: pass one")
    group = None
    try:
        env = dist.parse_env()
        if env.enabled:
            cfg.device = env.local_rank
        check_device(cfg)                                 # no GPU: one line, before anything else
        if env.enabled:
            group = dist.init_group(env)                  # the rendezvous; NCCL is imported here only
        trainer = Trainer(cfg, resume="resume" in flags, overwrite="overwrite" in flags, group=group,
                          files="profile" not in flags and "eval_only" not in flags)
        if "profile" in flags:
            table = trainer.profile()
            if trainer.main:
                print(table)
            return 0
        try:
            if "eval_only" in flags:
                losses = trainer.evaluate_only()
            else:
                best = trainer.train(bar="no-bar" not in flags and sys.stderr.isatty())
        except NonFiniteLoss as e:
            sys.stdout.flush()
            print(f"error: {e}", file=sys.stderr)
            return 1
    except dist.DistError as e:
        if group is not None:
            group.abort()
        raise RunError(str(e)) from None
    if group is not None:
        group.close()
    if trainer.interrupted is not None:
        return EXIT_CODES.get(trainer.interrupted, 128 + int(trainer.interrupted))
    if trainer.main:
        print(f"step {trainer.start_step}: train loss {fmt_loss(losses['train'])}, val loss "
              f"{fmt_loss(losses['val'])}" if "eval_only" in flags else f"best val loss {fmt_loss(best)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
