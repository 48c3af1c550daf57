"""A layer's weight and input gradients apart and as one gemm_wgmma_dual launch, on the GPT-2 124M shapes.

    python bench/grad_pairs.py [--tokens 16384] [--iters 20] [--pairs fc,qkv,proj,fcproj] [--all] [--json F]

Each pair (fc: dX fc and dW fc with fc.b's sums; qkv: likewise with attn.b's; proj: the attention
projection's; fcproj: dX fcproj with the GELU's backward beside dW fcproj; head, on request: dX head and dW
wte), replayed in a CUDA graph: apart (gemm.matmul twice, the plans the step would use apart: the measured
table's or the cost model's, with the split-K reduction and the column sums), and paired (gemm.matmul_pair
with pair_plan's tile and split, the model's time beside the measured one; the table's entry for the pair,
if any, is not consulted). --all: every tile (the ping-pong ones too) and split count 1-4, to set the schedule
model's constants
(plan.py dual_time). Every output of the paired launch is checked bit for bit against the apart one of the
same tiles first. The SM clock is read before and after.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import ClockWatch, write_results  # noqa: E402
from bench.timing import time_graphed_ms  # noqa: E402
from gptcuda.model.products import Product  # noqa: E402
from gptcuda.ops.cuda import elementwise, gemm  # noqa: E402
from gptcuda.ops.cuda.gemm.families import DUAL_PP_TILES, DUAL_TILES, FAMILIES, dual_serves  # noqa: E402
from gptcuda.ops.cuda.gemm.plan import dual_time, make_plan, pair_plan  # noqa: E402
from gptcuda.runtime import Runtime  # noqa: E402

# name -> (N, K, dX epilogue, bias sums) of a layer y[T, N] = x[T, K] @ w[N, K]^T at GPT-2 124M; "head": the
# logits' (dX head and dW wte, which the step keeps apart: both run at ~770 TFLOP/s alone, 8.9 and 2.9 waves)
PAIRS = {"fc": (3072, 768, "none", True), "qkv": (2304, 768, "none", True), "proj": (768, 768, "none", False),
         "fcproj": (768, 3072, "dgelu", False), "head": (50304, 768, "none", False)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--pairs", default="fc,qkv,proj,fcproj", help=f"some of {','.join(PAIRS)}")
    ap.add_argument("--all", action="store_true", help="every tile and split count 1-4 as well")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.tokens <= 0 or args.iters <= 0:
        ap.error(f"--tokens {args.tokens} --iters {args.iters}: positive counts")
    unknown = [p for p in args.pairs.split(",") if p not in PAIRS]
    if unknown:
        ap.error(f"--pairs: unknown {', '.join(unknown)} (there are {', '.join(PAIRS)})")
    rt = Runtime(0, precision="bf16", seed=1)
    if not rt.exec.grad_pairs:
        sys.exit("bench/grad_pairs.py: GPTCUDA_GRAD_PAIRS=0 is set; unset it to time the pairs")
    rng = np.random.default_rng(0)
    T, sm = args.tokens, rt.info.sm_count
    rt.set_workspace({"gemm_splitk": rt.empty((8 * 3072 * 768,), name="gemm_splitk"),
                      elementwise.WORKSPACE: rt.empty((elementwise.MAX_CHUNKS, 3072), name=elementwise.WORKSPACE)})
    room = rt.workspace("gemm_splitk").numel
    rows, watch = [], ClockWatch()
    for name in args.pairs.split(","):
        N, K, epi, has_db = PAIRS[name]
        up = lambda *s: rt.upload(rng.standard_normal(s).astype(np.float32), "bf16")
        dy, x, w = up(T, N), up(T, K), up(N, K)
        aux = up(T, K) if epi == "dgelu" else None
        dx, dw = rt.empty((T, K), "bf16"), rt.empty((N, K))
        db = rt.empty((N,)) if has_db else None
        gw, gx = Product(N, K, T, True, False, colsum=has_db), Product(T, K, N, False, False, epi)
        chosen = pair_plan(gw, gx, sm, room)

        def apart(pw=None, px=None):
            gemm.matmul(rt, dx, dy, w, False, False, epilogue=epi, aux=aux, plan=px)
            gemm.matmul(rt, dw, dy, x, True, False, plan=pw, a_colsum=db)

        def paired(p=None):
            gemm.matmul_pair(rt, dx, dw, dy, x, w, db=db, epilogue=epi, aux=aux, plan=p)

        # the pair's bits against the apart products' with its tiles
        paired(chosen)
        got = [rt.download(v).copy() for v in (dx, dw) + ((db,) if db is not None else ())]
        apart(chosen, make_plan("bf16", chosen.tile, 1, N))
        same = all(np.array_equal(g.view(np.uint8), rt.download(v).view(np.uint8))
                   for g, v in zip(got, (dx, dw) + ((db,) if db is not None else ())))
        t_apart = time_graphed_ms(rt, apart, iters=args.iters, reps=5)
        t_pair = time_graphed_ms(rt, lambda: paired(chosen), iters=args.iters, reps=5)    # (not the table's entry)
        model = dual_time(gw, gx, chosen.tile, chosen.splits, chosen.k_chunk, sm) * 1e3
        row = {"pair": name, "tokens": T, "apart_ms": t_apart, "paired_ms": t_pair, "bitwise": same,
               "plan": [FAMILIES["bf16"].short(chosen.tile), chosen.splits], "model_ms": model, "all": {}}
        print(f"{name:<7} T{T}: apart {t_apart:.4f} ms, paired {t_pair:.4f} ms "
              f"({FAMILIES['bf16'].short(chosen.tile)} split {chosen.splits}, model {model:.4f}) "
              f"x{t_pair / t_apart:.3f}, bitwise {'yes' if same else 'NO'}", flush=True)
        if args.all:
            cells = []
            for tile in DUAL_TILES + DUAL_PP_TILES:
                for s in range(1, 5):
                    p = make_plan("bf16", tile, s, T)
                    if p is None or not dual_serves(tile, 4 if epi == "dgelu" else 0, has_db) or \
                            s > 1 and s * N * K > room:
                        continue
                    ms = time_graphed_ms(rt, lambda: paired(p), iters=args.iters, reps=5)
                    m = dual_time(gw, gx, tile, s, p.k_chunk, sm) * 1e3
                    row["all"][f"{FAMILIES['bf16'].short(tile)}/{s}"] = [ms, m]
                    cells.append(f"{FAMILIES['bf16'].short(tile)}/{s} {ms:.4f} (model {m:.4f})")
            print("    " + ", ".join(cells), flush=True)
        rows.append(row)
    print(f"sum: apart {sum(r['apart_ms'] for r in rows):.4f} ms, paired {sum(r['paired_ms'] for r in rows):.4f} ms; "
          f"{watch.stop()}")
    write_results(args.json, rows)
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
