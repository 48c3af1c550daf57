"""Generate text from a trained run.

    python sample.py                                  # the most recent run under out/
    python sample.py --out_dir out/shakespeare_char_fp32 --temp 0.8 --top_k 40
    python sample.py --prompt "ROMEO:" --num_samples 3 --max_new_tokens 300 --seed 7
    python sample.py --temp 0                         # greedy: always the most likely token
    python sample.py --backend reference              # float64 numpy on the CPU

Loads best.ckpt (else last.ckpt), the run's config.yaml and tokenizer.json, and generates
with the same kernels that trained it. A prompt character the tokenizer has never seen, or an
argument out of its range, is a one-line error naming it (exit code 2).
"""
import sys

from gptcuda.cli import UsageError, guarded, print_help, split_args

OPTIONS = {
    "--out_dir DIR": "the run to sample from (default: the most recently written run under out/)",
    "--ckpt FILE": "the checkpoint (default: DIR/best.ckpt, else DIR/last.ckpt)",
    "--prompt TEXT": "the text to continue (default: a newline)",
    "--num_samples N": "samples, generated together (>= 1; default 1)",
    "--max_new_tokens N": "tokens generated after the prompt (>= 0; default 500)",
    "--temp T": "temperature: 0 is greedy (the most likely token), else >= 0.001 (default 0.8)",
    "--top_k K": "sample among the K most likely tokens; 0: all of them (>= 0; default 0)",
    "--seed S": "the sampling seed, in [0, 2**32) (default 1337)",
    "--backend B": "cuda or reference (default: the run's)",
}
NAMES = tuple(o[2:].split()[0] for o in OPTIONS)


@guarded
def main(argv):
    _, overrides, flags, opts = split_args(argv, options=NAMES)
    if "help" in flags:
        return print_help(__doc__, OPTIONS, config=False)
    if overrides:
        raise UsageError(f"unknown option {overrides[0]} (options: {', '.join('--' + o for o in NAMES)}; "
                         f"--help describes them)")
    from gptcuda.sampler import sample_main
    return sample_main(opts)


if __name__ == "__main__":
    sys.exit(main())
