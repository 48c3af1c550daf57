"""Prove the backward pass: directional finite differences for every parameter tensor.

    python gradcheck.py                                   # configs/tiny.yaml on the GPU
    python gradcheck.py configs/tiny.yaml --backend=reference
    python gradcheck.py configs/tiny.yaml --precision=tf32 --attention=fused
    python gradcheck.py --break=layernorm                 # must FAIL upstream of the final layernorm

For each tensor W with gradient g (one forward + backward on a fixed batch, dropout masks
fixed by the step), step along u = g/||g||: the central difference
(L(W + h u) - L(W - h u)) / 2h must equal ||g||. A table lists tensor, ||g||, measured,
relative error and the verdict; the exit code is 1 when any tensor fails.
"""
import sys

from gptcuda.cli import guarded, split_args
from gptcuda.config import load_config


@guarded
def main(argv):
    path, overrides, _, opts = split_args(argv, options=("break", "tensors"))
    cfg = load_config(path or "configs/tiny.yaml", overrides)
    from gptcuda.gradcheck import run_gradcheck
    broken = [b for b in opts.get("break", "").split(",") if b]
    only = [t for t in opts.get("tensors", "").split(",") if t]
    ok = run_gradcheck(cfg, broken=broken, only=only)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
