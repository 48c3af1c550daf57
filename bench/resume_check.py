"""A run trained straight, and the same run stopped half-way and resumed: bit for bit the same?

    python bench/resume_check.py configs/gpt2_124m.yaml --data=DIR --max_iters=50 [--key=value ...]

Trains CONFIG for max_iters steps into OUT/straight, then again into OUT/resumed stopping after
max_iters // 2 steps (as an interrupted run does: last.ckpt written there) and resuming with
--resume's code path; prints the loss every few steps, the time a step, and whether the loss
histories and the final parameters are identical. Exit 1 when they differ.
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from gptcuda.model.checkpoint import load_checkpoint  # noqa: E402
from gptcuda.cli import split_args  # noqa: E402
from gptcuda.config import load_config  # noqa: E402
from gptcuda.training.trainer import Trainer  # noqa: E402


def main(argv):
    path, overrides, _, opts = split_args(argv, options=("out",))
    out = opts.get("out", "out/resume_check")
    quiet = lambda *a, **k: None  # noqa: E731
    cfg = load_config(path, overrides + [f"--out_dir={out}/straight"])
    n = cfg.max_iters
    t0 = time.perf_counter()
    t = Trainer(cfg, log=print, overwrite=True)
    t.train(bar=False)
    straight_s = time.perf_counter() - t0
    cfg2 = load_config(path, overrides + [f"--out_dir={out}/resumed"])
    t = Trainer(cfg2, log=quiet, overwrite=True)
    t.cfg.max_iters = n // 2
    t.train(bar=False)
    Trainer(cfg2, resume=True, log=quiet).train(bar=False)
    a, ma = load_checkpoint(os.path.join(out, "straight", "last.ckpt"))
    b, mb = load_checkpoint(os.path.join(out, "resumed", "last.ckpt"))
    ha, hb = a["history"][:n], b["history"][:n]
    for s in sorted({1, 2, 5, 10, 20, n // 2, n // 2 + 1, n} & set(range(1, n + 1))):
        print(f"step {s:5d}  loss straight {ha[s - 1]:.6f}  resumed {hb[s - 1]:.6f}")
    same = ma["step"] == mb["step"] == n and np.array_equal(ha, hb) and np.array_equal(a["params"], b["params"])
    tok = t.accum * cfg.batch_size * cfg.block_size
    print(f"{n} steps of {tok} tokens ({t.accum} micro-batches): {straight_s:.1f} s including set-up; "
          f"loss {ha[0]:.4f} -> {ha[-1]:.4f}; straight and resumed histories and parameters "
          f"{'IDENTICAL' if same else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
