"""Time the fused cross-entropy on bf16 logits as the training step runs it (the gradient in place),
replayed in a CUDA graph: the median ms and the DRAM rate of one read and one write of the logits.

    python bench/loss_speed.py [--tokens 16384] [--vocab 50304] [--n_vocab 50257] [--iters 20]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import ClockWatch  # noqa: E402
from bench.timing import time_graphed_ms  # noqa: E402
from gptcuda.ops.cuda import loss as L  # noqa: E402
from gptcuda.runtime import Runtime  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=50304, help="the logits' row length")
    ap.add_argument("--n_vocab", type=int, default=50257, help="the real vocabulary (columns past it masked)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if not 0 < args.n_vocab <= args.vocab or args.tokens < 1:
        ap.error("need 0 < n_vocab <= vocab and tokens >= 1")
    rt = Runtime(0, precision="bf16", seed=0)
    rng = np.random.default_rng(0)
    N, V = args.tokens, args.vocab
    logits = rt.upload((rng.standard_normal((N, V)) * 3).astype(np.float32), "bf16")
    targets = rt.upload(rng.integers(0, args.n_vocab, N).astype(np.int32))
    losses = rt.empty((N,))
    watch = ClockWatch()
    ms = time_graphed_ms(rt, lambda: L.crossentropy(rt, losses, logits, logits, targets, 1.0 / N,
                                                    n_vocab=args.n_vocab), iters=args.iters, reps=5)
    print(f"crossentropy: {ms:.4f} ms, {2 * 2 * N * V / ms / 1e6:.0f} GB/s (N {N}, V {V})", flush=True)
    print(watch.stop())
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
