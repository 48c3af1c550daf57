"""The sorted encoder backward (encoder_bwd's "sort" path: the sort, the long runs' pieces, the runs, dwpe) on
token-id distributions of one size, replayed in CUDA graphs: what the longest run of one id costs.

    python bench/encoder_bwd.py [--batch 16] [--block 1024] [--n_embd 768] [--vocab 50304] [--shards DIR]

Rows: uniform ids; one id K times among uniform ones (K = 500 .. all); and, with --shards (prepare.py's
GPT-2 token shards, e.g. tiny Shakespeare's), a window of real text.
"""
import argparse
import glob
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import ClockWatch  # noqa: E402
from bench.timing import time_graphed_ms  # noqa: E402
from gptcuda.ops.cuda import encoder as enc  # noqa: E402
from gptcuda.runtime import Runtime  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--n_embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--shards", help="a directory of prepare.py's train_*.bin GPT-2 token shards")
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args(argv)
    B, T, C, V = args.batch, args.block, args.n_embd, args.vocab
    N = B * T
    if enc.bwd_wte_method(N, C, V) != "sort":
        ap.error(f"N {N}, C {C}, V {V}: encoder_bwd takes the scan path there")
    rt = Runtime(0, precision="bf16", seed=0)
    rt.set_workspace({enc.WORKSPACE: rt.empty((enc.workspace_ints(N, C),), "i32")})
    rng = np.random.default_rng(0)
    dwte, dwpe = rt.empty((V, C)), rt.empty((T, C))
    rt.fill(dwte, 0)
    dout = rt.upload(rng.standard_normal((B, T, C)).astype(np.float32), "bf16")
    cases = {"uniform ids": rng.integers(0, V, N)}
    for k in (500, 1000, 2000, 4000, N):
        ids = rng.integers(0, V, N)
        ids[rng.permutation(N)[:k]] = 198
        cases[f"one id x{k}"] = ids
    shards = sorted(glob.glob(os.path.join(args.shards, "train_*.bin"))) if args.shards else []
    if shards:
        toks = np.fromfile(shards[0], dtype=np.uint16)[512:]        # past the shard's 1 KB header
        if toks.size < N:
            ap.error(f"{shards[0]}: {toks.size} tokens, fewer than {N}")
        cases[os.path.basename(os.path.normpath(args.shards))] = toks[-N:].astype(np.int64)
    watch = ClockWatch()
    print(f"encoder_bwd (sort) at B{B} T{T} C{C} V{V}, bf16 dout: ms a call")
    for name, ids in cases.items():
        idx = rt.upload(ids.astype(np.int32).reshape(B, T), "i32")
        ms = time_graphed_ms(rt, lambda: enc.encoder_bwd(rt, dwte, dwpe, dout, idx, method="sort"),
                             iters=args.iters, reps=5)
        print(f"  {name:<22} {len(np.unique(ids)):6d} ids, the longest run {np.bincount(ids).max():6d}: {ms:.4f} ms",
              flush=True)
    print(watch.stop())


if __name__ == "__main__":
    main()
