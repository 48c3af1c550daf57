"""Prove the backward pass: directional finite differences for every parameter tensor.

    python gradcheck.py                                   # configs/tiny.yaml on the GPU
    python gradcheck.py configs/tiny.yaml --backend=reference
    python gradcheck.py configs/tiny.yaml --precision=tf32 --attention=fused
    python gradcheck.py --precision=bf16 --attention=fused --vocab_multiple=8
    python gradcheck.py --break=layernorm                 # must FAIL upstream of the final layernorm
    python gradcheck.py --tensors=h0.attn.w,lnf.w         # only these tensors

For each tensor W with gradient g (one forward + backward on a fixed batch, dropout masks
fixed by the step), step along u = g/||g||: the central difference
(L(W + h u) - L(W - h u)) / 2h must equal ||g||. A table lists tensor, ||g||, measured,
relative error and the verdict; the exit code is 1 when any tensor fails.

With --precision=tf32 the finite differences are taken on an fp32 forward (3xTF32 GEMMs) of the
same weights, batch and dropout masks, against a tolerance from TF32's error model, and the two
largest entries of each tensor are checked as well (gptcuda/training/gradcheck.py says why and how much).
--precision=bf16 likewise, against BF16's error model (every bf16 store and operand rounded to nearest,
counted along the longest path), checking the eight largest entries; bf16 runs fused attention on an
sm_90 GPU, with a vocabulary that is a multiple of 8 (--vocab_multiple=8 for the character models).
"""
import sys

try:
    from gptcuda.cli import guarded, print_help, split_args
    from gptcuda.config import load_config
except KeyboardInterrupt:           # Ctrl-C while the modules load: one word, no traceback
    print("interrupted", file=sys.stderr)
    sys.exit(130)

OPTIONS = {
    "CONFIG.yaml": "the model (default configs/tiny.yaml)",
    "--break NAME[,NAME]": "deliberately break a backward op (gptcuda/faults.py: layernorm); must FAIL",
    "--tensors NAME[,NAME]": "check only these parameter tensors (wte, h0.attn.w, lnf.b, ...)",
}


def print_usage() -> int:
    return print_help(__doc__, OPTIONS)


@guarded
def main(argv):
    if "-h" in argv or "--help" in argv:
        return print_usage()
    path, overrides, _, opts = split_args(argv, options=("break", "tensors"))
    cfg = load_config(path or "configs/tiny.yaml", overrides)
    from gptcuda.training.gradcheck import run_gradcheck
    broken = [b for b in opts.get("break", "").split(",") if b]
    only = [t for t in opts.get("tensors", "").split(",") if t]
    ok = run_gradcheck(cfg, broken=broken, only=only)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
