"""Evaluate weights on HellaSwag: a run's, Hugging Face GPT-2's or llm.c's, with our forward kernels.

    python eval.py out/gpt2_124m --hellaswag data/hellaswag/hellaswag_val.jsonl
    python eval.py hf:gpt2_dir --hellaswag hellaswag_val.jsonl --limit 500
    python eval.py llmc:gpt2_124M.bin --hellaswag hellaswag_val.jsonl --backend reference --limit 20

WEIGHTS: a run directory (its best.ckpt, else last.ckpt, or --ckpt), a run's .ckpt file, hf:DIR or
llmc:FILE (GPT-2's 50257-token vocabulary: the gpt2 tokenizer). Scored as llm.c's dev/data/hellaswag.py
scores it (gptcuda/training/hellaswag.py): acc by each ending's summed loss, acc_norm by its mean loss.
Prints one line: the examples, acc, acc_norm and the time. Writes nothing.
Exit codes: 0 done, 2 a usage, file, weights or device error (one line on stderr).
"""
import sys
import time

from gptcuda.cli import UsageError, guarded, print_help, split_args

OPTIONS = {
    "--hellaswag FILE": "HellaSwag examples, one JSON object a line (llm.c's hellaswag_val.jsonl)",
    "--limit N": "score the first N examples only (default 0: all)",
    "--ckpt FILE": "a run's checkpoint: best, last or a path (default best, else last)",
    "--batch_size N": "rows a forward (4 a example; default 64)",
    "--precision P": "fp32 (default) or tf32",
    "--attention A": "unfused (default) or fused",
    "--backend B": "cuda (default) or reference (float64 on the CPU)",
}
NAMES = tuple(o[2:].split()[0] for o in OPTIONS)


def _int(opts, key, default, low):
    v = opts.get(key, str(default))
    if not v.lstrip("-").isdigit() or int(v) < low:
        raise UsageError(f"--{key} must be an integer >= {low}, got {v!r}")
    return int(v)


def _choice(opts, key, choices):
    v = opts.get(key, choices[0])
    if v not in choices:
        raise UsageError(f"--{key} must be one of {'|'.join(choices)}, got {v!r}")
    return v


def _weights(argv):
    """(the first positional argument or None, argv without it): a value after an option is no positional."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("-"):
            return a, argv[:i] + argv[i + 1:]
        i += 2 if a[2:] in NAMES else 1
    return None, argv


@guarded
def main(argv):
    weights, rest = _weights(list(argv))
    _, overrides, flags, opts = split_args(rest, options=NAMES)
    if "help" in flags:
        return print_help(__doc__, OPTIONS, config=False)
    if overrides:
        raise UsageError(f"unknown option {overrides[0]} (options: {', '.join('--' + o for o in NAMES)})")
    if weights is None:
        raise UsageError("name the weights: eval.py RUN|hf:DIR|llmc:FILE --hellaswag FILE")
    if "hellaswag" not in opts:
        raise UsageError("--hellaswag FILE is required (the examples to score)")
    limit, rows = _int(opts, "limit", 0, 0), _int(opts, "batch_size", 64, 1)
    backend = _choice(opts, "backend", ("cuda", "reference"))
    precision = _choice(opts, "precision", ("fp32", "tf32"))     # (scoring has no bf16 check yet)
    attention = _choice(opts, "attention", ("unfused", "fused"))
    import dataclasses
    from gptcuda.generate.sampler import load_model
    from gptcuda.training import hellaswag
    from gptcuda.training.trainer import check_device
    examples = hellaswag.read_examples(opts["hellaswag"], limit)
    model = load_model(weights, opts.get("ckpt"))
    if model.tokenizer is None:
        raise UsageError(f"{weights}: the weights name no tokenizer (a GPT-2 vocabulary of 50257, or a run "
                         f"directory, has one)")
    cfg = dataclasses.replace(model.cfg, backend=backend, precision=precision, attention=attention)
    check_device(cfg)
    items = hellaswag.render(examples, model.tokenizer, cfg.block_size)
    eng = hellaswag.scoring_engine(cfg, model.named, model.n_vocab, items, rows)
    t = time.perf_counter()
    res = hellaswag.score(eng, items)
    secs = time.perf_counter() - t
    print(f"hellaswag {opts['hellaswag']}: {res.n} examples, acc {res.acc:.4f}, acc_norm {res.acc_norm:.4f} "
          f"({secs:.1f} s, {model.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
