"""Split-K of GPT-2's bf16 weight gradients: each tile and split count timed with the partials summed by
gemm_splitk_reduce after the kernel, and folded into the kernel (the gemm_tickets workspace lent: the last
split of each tile sums it; Family.folds), side by side, replayed in CUDA graphs.

    python bench/splitk.py [--tokens 16384] [--splits 1,2,4] [--ops 'dW qkv,dW fc'] [--iters 20]

The products as the training step runs them: dW = dY^T X into fp32, with the bias gradient's column sums
where the layer has a bias (qkv, fc). A tile whose family does not fold prints one time (its reduction).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import ClockWatch  # noqa: E402
from bench.timing import time_graphed_ms  # noqa: E402
from gptcuda.ops.cuda import elementwise, gemm  # noqa: E402
from gptcuda.ops.cuda.gemm.families import BF16_TILES, FAMILIES  # noqa: E402
from gptcuda.ops.cuda.gemm.plan import make_plan  # noqa: E402
from gptcuda.runtime import Runtime  # noqa: E402

C = 768
OPS = {"dW qkv": (3 * C, C, True), "dW attn proj": (C, C, False), "dW fc": (4 * C, C, True),
       "dW fcproj": (C, 4 * C, False)}        # label: (M, N, column sums)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--splits", default="1,2,3,4,6")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    rt = Runtime(0, precision="bf16", seed=0)
    bf = FAMILIES["bf16"]
    K = args.tokens
    splits = [int(s) for s in args.splits.split(",")]
    tickets = rt.empty((4096,), "i32", name="gemm_tickets")
    rt.fill(tickets, 0)
    base = {"gemm_splitk": rt.empty((max(splits) * 4 * C * C,), name="gemm_splitk"),
            elementwise.WORKSPACE: rt.empty((elementwise.MAX_CHUNKS * 4 * C,), name=elementwise.WORKSPACE)}
    rng = np.random.default_rng(0)
    watch = ClockWatch()
    for label in args.ops.split(","):
        M, N, colsum = OPS[label]
        a = rt.upload(rng.standard_normal((K, M)).astype(np.float32), "bf16")     # dY [tokens, M]
        b = rt.upload(rng.standard_normal((K, N)).astype(np.float32), "bf16")     # X [tokens, N]
        c, db = rt.empty((M, N)), (rt.empty((M,)) if colsum else None)
        print(f"{label} [{M} x {N}] over {K} tokens{' +column sums' if colsum else ''} (ms, reduction / folded)",
              flush=True)
        for tile in BF16_TILES:
            if colsum and not bf.serves(tile, 0, colsum=True):
                continue
            row = []
            for s in splits:
                p = make_plan("bf16", tile, s, K)
                if p is None:
                    continue
                times = []
                for fold in ((False, True) if s > 1 and getattr(bf, "folds", lambda t: False)(tile) else (False,)):
                    rt.set_workspace({**base, **({"gemm_tickets": tickets} if fold else {})})
                    times.append(time_graphed_ms(rt, lambda: gemm.matmul(rt, c, a, b, True, False, plan=p,
                                                                         a_colsum=db), iters=args.iters, reps=5))
                row.append(f"s{s} " + " / ".join(f"{t:.4f}" for t in times))
            print(f"  {bf.short(tile):<12} " + ", ".join(row), flush=True)
    assert not np.any(rt.download(tickets)), "a ticket left nonzero"
    print(watch.stop())


if __name__ == "__main__":
    main()
