"""Generate text from a trained run, or from GPT-2 weights made elsewhere.

    python sample.py                                  # the most recent run under out/
    python sample.py --out_dir out/shakespeare_char_fp32 --temp 0.8 --top_k 40
    python sample.py --prompt "ROMEO:" --num_samples 3 --max_new_tokens 300 --seed 7
    python sample.py --temp 0                         # greedy: always the most likely token
    python sample.py --init_from hf:gpt2_dir --prompt "Hello" --top_p 0.9 --stop "<|endoftext|>"
    python sample.py --prompt_file prompts.txt        # one prompt a line, all generated together
    python sample.py --precision bf16                 # bf16 weights and KV cache (sm_90): half the bytes a token
    python sample.py --backend reference              # float64 numpy on the CPU

Loads best.ckpt (else last.ckpt), the run's config.yaml and tokenizer.json (or the --init_from
weights), and generates with the same kernels that trained it: the prompts are read and the
tokens drawn on the GPU, one CUDA graph replay a token, and the text is printed as it comes. A
prompt character the tokenizer has never seen, or an argument out of its range, is a one-line
error naming it (exit code 2).
"""
import sys

try:
    from gptcuda.cli import UsageError, guarded, print_help, split_args
except KeyboardInterrupt:           # Ctrl-C while the modules load: one word, no traceback
    print("interrupted", file=sys.stderr)
    sys.exit(130)

OPTIONS = {
    "--out_dir DIR": "the run to sample from (default: the most recently written run under out/)",
    "--ckpt FILE": "the checkpoint (default: DIR/best.ckpt, else DIR/last.ckpt)",
    "--init_from W": "other weights instead of a run: hf:DIR (Hugging Face GPT-2), llmc:FILE (llm.c), a run dir",
    "--prompt TEXT": "the text to continue (default: a newline)",
    "--prompt_file FILE": "prompts, one a line (\\n inside a line is a newline), generated together",
    "--num_samples N": "samples of each prompt, generated together (>= 1; default 1)",
    "--max_new_tokens N": "tokens generated after the prompt (>= 0; default 500)",
    "--temp T": "temperature: 0 is greedy (the most likely token), else >= 0.001 (default 0.8)",
    "--top_k K": "sample among the K most likely tokens; 0: all of them (>= 0; default 0)",
    "--top_p P": "sample among the fewest most likely tokens holding P of the probability (default 1: all)",
    "--stop TEXT": "end a sample once it has generated TEXT (<|endoftext|>: GPT-2's end-of-text token)",
    "--seed S": "the sampling seed, in [0, 2**32) (default 1337)",
    "--precision P": "fp32 (default), tf32, or bf16 (sm_90: weights read from a bf16 copy, bf16 KV cache; "
                     "fp32 sums, softmax and logits)",
    "--backend B": "cuda or reference (default: the run's)",
}
NAMES = tuple(o[2:].split()[0] for o in OPTIONS)


@guarded
def main(argv):
    _, overrides, flags, opts = split_args(argv, options=NAMES)
    if "help" in flags:
        return print_help(__doc__, OPTIONS, config=False)
    if overrides:
        raise UsageError(f"unknown option {overrides[0].split('=', 1)[0]} (options: {', '.join('--' + o for o in NAMES)}; "
                         f"--help describes them)")
    from gptcuda.generate.sampler import sample_main
    return sample_main(opts)


if __name__ == "__main__":
    sys.exit(main())
