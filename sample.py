"""Generate text from a trained run.

    python sample.py                                  # the most recent run under out/
    python sample.py --out_dir out/shakespeare_char_fp32 --temp 0.8 --top_k 40
    python sample.py --prompt "ROMEO:" --num_samples 3 --max_new_tokens 300 --seed 7
    python sample.py --backend reference              # float64 numpy on the CPU

Loads best.ckpt (else last.ckpt), the run's config.yaml and tokenizer.json, and generates
with the same kernels that trained it. A prompt character the tokenizer has never seen is a
one-line error naming it.
"""
import sys

from gptcuda.cli import UsageError, guarded, split_args

OPTIONS = ("out_dir", "temp", "top_k", "prompt", "num_samples", "max_new_tokens", "seed", "backend", "ckpt")


@guarded
def main(argv):
    _, overrides, _, opts = split_args(argv, options=OPTIONS)
    if overrides:
        raise UsageError(f"unknown option {overrides[0]} (options: {', '.join('--' + o for o in OPTIONS)})")
    from gptcuda.sampler import sample_main
    return sample_main(opts)


if __name__ == "__main__":
    sys.exit(main())
