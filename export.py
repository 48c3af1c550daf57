"""Export a trained run for other tools: a Hugging Face GPT-2 directory or an llm.c model file.

    python export.py RUN --to hf DIR      [--ckpt best|last|PATH] [--overwrite]
    python export.py RUN --to llmc FILE   [--ckpt best|last|PATH] [--overwrite] [--dtype f32|bf16]

RUN is a run directory (train.py's out_dir: config.yaml, tokenizer.json, best.ckpt, last.ckpt); --ckpt
picks its checkpoint (default best.ckpt, else last.ckpt).

  hf    DIR gets config.json (GPT2Config), model.safetensors (fp32, GPT2LMHeadModel's names; the head is
        tied to wte and not stored) and the tokenizer files: vocab.json + merges.txt for tokenizer gpt2,
        tokenizer.json for bpe:N. Load it with transformers.GPT2LMHeadModel.from_pretrained(DIR).
        A char-tokenizer run cannot be written (GPT-2 directories carry a BPE tokenizer).
  llmc  FILE is llm.c's fp32 model file (header version 3, vocabulary padded to a multiple of 128),
        for `./train_gpt2fp32cu -e FILE` or train_gpt2cu built with PRECISION=FP32; --dtype bf16: its
        bf16 file (version 5, every tensor rounded to nearest even), for train_gpt2cu's default BF16 build.
        (A run's checkpoint holds fp32 master weights, whatever its precision.)

Both need bias=true (GPT-2 has biases). DIR / FILE is written beside itself and renamed into place; an
existing non-empty DIR or an existing FILE is refused unless --overwrite.
Exit codes: 0 written, 2 a usage error or a model the target cannot express (one line on stderr).
"""
import sys

USAGE = __doc__


def parse(argv):
    from gptcuda.cli import UsageError
    run, target, dest, ckpt, overwrite, dtype = None, None, None, None, False, "f32"
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            return None
        if a == "--overwrite":
            overwrite = True
        elif a.split("=", 1)[0] in ("--to", "--ckpt", "--dtype"):
            key = a.split("=", 1)[0]
            if "=" in a:
                val = a.split("=", 1)[1]
            else:
                if i + 1 >= len(argv):
                    raise UsageError(f"{key} needs a value")
                i += 1
                val = argv[i]
            if key == "--ckpt":
                ckpt = val
            elif key == "--dtype":
                if val not in ("f32", "bf16"):
                    raise UsageError(f"--dtype must be f32 or bf16, got {val!r}")
                dtype = val
            else:
                if val not in ("hf", "llmc"):
                    raise UsageError(f"--to must be hf or llmc, got {val!r}")
                target = val
                if dest is None and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    i += 1
                    dest = argv[i]
        elif a.startswith("-"):
            raise UsageError(f"unknown option {a!r} (see --help)")
        elif run is None:
            run = a
        elif dest is None and target is not None:
            dest = a
        else:
            raise UsageError(f"unexpected argument {a!r} (see --help)")
        i += 1
    if run is None or target is None or dest is None:
        raise UsageError("usage: export.py RUN --to hf DIR | --to llmc FILE [--ckpt best|last|PATH] [--overwrite]")
    return run, target, dest, ckpt, overwrite, dtype


def main(argv=None):
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:          # Ctrl-C while loading or writing: the partial output is removed
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE.rstrip())
        return 0
    from gptcuda.model.checkpoint import CheckpointError
    from gptcuda.cli import UsageError
    from gptcuda.config import ConfigError
    from gptcuda.interop import InteropError, export_run
    try:
        run, target, dest, ckpt, overwrite, dtype = parse(argv)
        print(export_run(run, target, dest, ckpt=ckpt, overwrite=overwrite, dtype=dtype))
    except (UsageError, InteropError, CheckpointError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except OSError as e:                  # a read-only place, a full disk: the partial output is removed
        from gptcuda.errors import describe_os_error
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: {' '.join(str(e).split())} (pip install safetensors)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
