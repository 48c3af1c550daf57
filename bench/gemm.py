"""Benchmark the GEMM kernels (fp32 SIMT, TF32 tensor cores) against cuBLAS.

    python bench/gemm.py [--mnk M,N,K ...] [--trans NN|NT|TN] [--precision fp32|tf32|both]
                         [--sweep] [--ladder] [--iters 30] [--json out.json]

Default shapes: 4096^3 (NN and NT), and every GEMM of the model at B64 T256 (M = 16384 tokens), C=384, V=65:
forward (x @ W^T, NT), backward data (dout @ W, NN) and weight gradients (dout^T @ x, TN,
K = 16384). Per shape and precision: the kernel the planner picks, median time (CUDA events,
the GEMM replayed back to back inside a CUDA graph), TFLOP/s, relative error against a float64
numpy reference on sampled rows (max|out-ref| / max|ref|), and cuBLAS through torch (or cupy)
when importable, with the ratio ours / cuBLAS. --sweep also times every candidate tile (and
split) of the family, marking the chosen plan (the measured table of bench/tune.py when it has
the shape, else the cost model).
--ladder adds the teaching kernels of kernels/gemm_simt.cu (naive, coalesced, shared-memory
tiled, register tiled) before the production ones (square shapes only).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import ClockWatch, write_results  # noqa: E402
from bench.timing import time_graphed_ms  # noqa: E402  (graph replay: runtime/profile.py graph_times_ms)
from gptcuda.model.products import Product  # noqa: E402
from gptcuda.ops.cuda import gemm  # noqa: E402
from gptcuda.ops.cuda.gemm.families import FAMILIES, MAX_SPLITS, SIMT_FILE  # noqa: E402
from gptcuda.ops.cuda.gemm.launch import _vec_ok  # noqa: E402
from gptcuda.ops.cuda.gemm.plan import WGMMA_WORKSPACES, competing, plan, plan_label, wgmma_layout  # noqa: E402
from gptcuda.runtime.profile import Arena, rel_err, reps_for  # noqa: E402
from gptcuda.ops.cuda.gemm.table import tuned_plan  # noqa: E402
from gptcuda.runtime import Runtime, i32  # noqa: E402

B, T, C, V = 64, 256, 384, 65
TOKENS = B * T


def model_shapes(B=B, T=T, C=C, V=V):
    """(label, M, N, K, trans) of every GEMM of one training step (one layer's worth + the head)."""
    TOKENS = B * T
    fwd = [("qkv", 3 * C, C), ("attproj", C, C), ("fc", 4 * C, C), ("fcproj", C, 4 * C), ("lm_head", V, C)]
    out = []
    for name, n_out, n_in in fwd:            # W is [n_out, n_in]
        out.append((f"fwd {name}", TOKENS, n_out, n_in, "NT"))
    for name, n_out, n_in in fwd:            # dX [tokens, n_in] = dout [tokens, n_out] @ W
        out.append((f"dX {name}", TOKENS, n_in, n_out, "NN"))
    for name, n_out, n_in in fwd:            # dW [n_out, n_in] = dout^T @ x, K = tokens
        out.append((f"dW {name}", n_out, n_in, TOKENS, "TN"))
    return out


# ---------------------------------------------------------------------------------------
def sampled_rel_err(out, a, b, ta, tb, rows):
    """max|out - ref| / max|ref| over the sampled rows of out, float64 reference."""
    opa = a.T if ta else a
    opb = b.T if tb else b
    ref = opa[rows].astype(np.float64) @ opb.astype(np.float64)
    return rel_err(out[rows], ref)


# ---------------------------------------------------------------------------------------
def torch_matmul_ms(a, b, ta, tb, precision, warmup, iters):
    """cuBLAS through torch: median ms of one matmul (fp32 inputs, TF32 allowed for tf32)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    ta_ = torch.from_numpy(a).cuda()
    tb_ = torch.from_numpy(b).cuda()
    A = ta_.t() if ta else ta_
    Bm = tb_.t() if tb else tb_
    out = torch.empty((A.shape[0], Bm.shape[1]), device="cuda", dtype=torch.float32)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        for _ in range(warmup):
            torch.matmul(A, Bm, out=out)
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            torch.matmul(A, Bm, out=out)
            e.record()
            ts.append((s, e))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in ts)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
        del ta_, tb_, A, Bm, out
        torch.cuda.empty_cache()


def cupy_matmul_ms(a, b, ta, tb, precision, warmup, iters):
    try:
        import cupy as cp
    except ImportError:
        return None
    import os as _os
    old = _os.environ.get("CUPY_TF32")
    _os.environ["CUPY_TF32"] = "1" if precision == "tf32" else "0"
    try:
        A = cp.asarray(a)
        Bm = cp.asarray(b)
        A = A.T if ta else A
        Bm = Bm.T if tb else Bm
        for _ in range(warmup):
            cp.matmul(A, Bm)
        cp.cuda.Device().synchronize()
        ts = []
        for _ in range(iters):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record()
            cp.matmul(A, Bm)
            e.record()
            ts.append((s, e))
        e.synchronize()
        return statistics.median(cp.cuda.get_elapsed_time(s, e) for s, e in ts)
    finally:
        if old is None:
            _os.environ.pop("CUPY_TF32", None)
        else:
            _os.environ["CUPY_TF32"] = old


def cublas_ms(a, b, ta, tb, precision, warmup, iters):
    for f in (torch_matmul_ms, cupy_matmul_ms):
        try:
            t = f(a, b, ta, tb, precision, warmup, iters)
        except Exception as e:  # noqa: BLE001 - a missing/old library must not stop the benchmark
            print(f"  ({f.__name__} failed: {str(e).splitlines()[0][:80]})")
            t = None
        if t is not None:
            return t, f.__name__.split("_")[0]
    return None, None


# ---------------------------------------------------------------------------------------
def bench_shape(rt, label, M, N, K, trans, precisions, args, ws_floats):
    ta, tb = trans[0] == "T", trans[1] == "T"
    rng = np.random.default_rng(M * 7 + N * 3 + K)
    a = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
    flop = 2.0 * M * N * K
    if flop <= 2.0 * 2 ** 30:                      # small: the full reference is cheap
        rows = np.arange(M)
    else:
        rows = np.sort(rng.choice(M, size=min(M, args.sample_rows), replace=False))
    ar = Arena(rt, "bench")
    results = []
    try:
        da, db = ar.upload(a), ar.upload(b)
        out = ar.empty((M, N))
        ws = ar.empty((ws_floats,))
        # as memory.py plans them for training: the wgmma kernel's B^T scratch for the A @ B shapes,
        # the register-A kernels' B^T or A^T of the weight gradients A^T @ B
        rt.set_workspace({"gemm_splitk": ws, "gemm_bT": ar.empty((K * N if trans == "NN" else 1,)),
                          "gemm_aT": ar.empty((max(M, N) * K if ta else 1,))})
        lda = M if ta else K
        ldb = K if tb else N
        g = Product(M, N, K, ta, tb, vec=_vec_ok(da, db, lda, ldb))
        scratch = {name: rt.workspace(name).numel for name in WGMMA_WORKSPACES}
        for prec in precisions:
            rt.exec = rt.exec.with_precision(prec)
            family, mode, sm = rt.exec.gemm_family, rt.exec.wgmma_mode, rt.info.sm_count
            # what gemm.matmul launches: the measured table's entry (bench/tune.py), else the cost model
            chosen = tuned_plan(rt, g, rt.exec, ws_floats, scratch) or plan(g, family, mode, sm, ws_floats)
            cands = [(chosen, True)]
            if chosen.family == "wgmma3_ra":       # the FMA kernel beside it (fp32_gemm: ffma)
                cands.append((plan(g, family, None, sm, ws_floats), False))
            if args.sweep:
                tiles = []                     # every tile of every family competing for this product
                for name in competing(family, wgmma_layout(mode, g)):
                    fam = FAMILIES[name]
                    tiles += fam.tiles if g.vec or name != family else fam.unaligned_tiles
                for tile in tiles:
                    for sp in sorted({1, plan(g, family, mode, sm, ws_floats, tiles=[tile]).splits}):
                        p = plan(g, family, mode, sm, ws_floats, tiles=[tile], splits=sp)
                        if p != chosen:
                            cands.append((p, False))
            reps = reps_for(2.0, flop / ((150.0 if prec == "tf32" else 30.0) * 1e9), 2, 50)   # ~2 ms at a guessed rate
            base = None
            for p, is_chosen in cands:
                ms = time_graphed_ms(rt, lambda p=p: gemm.matmul(rt, out, da, db, ta, tb, plan=p),
                                     warmup=args.warmup, iters=args.iters, reps=reps)
                err = sampled_rel_err(rt.download(out), a, b, ta, tb, rows)
                row = {"shape": label, "M": M, "N": N, "K": K, "trans": trans, "precision": prec,
                       "kernel": f"{plan_label(p)} {trans}{'' if g.vec else ' unaligned'}", "chosen": is_chosen,
                       "ms": ms, "tflops": flop / ms / 1e9, "rel_err": err}
                if is_chosen:
                    base = row
                results.append(row)
            if not args.no_cublas:
                t, lib = cublas_ms(a, b, ta, tb, prec, args.warmup, args.iters)
                if t is not None:
                    base["cublas_ms"] = t
                    base["cublas_tflops"] = flop / t / 1e9
                    base["ratio"] = base["tflops"] / base["cublas_tflops"]
                    base["cublas_lib"] = lib
            for row in results:
                if row["precision"] == prec:
                    print_row(row)
    finally:
        ar.free()
        rt.set_workspace({})
    return results


HEADER = (f"{'shape':<14} {'M':>6} {'N':>5} {'K':>6} {'op':>2} {'prec':>4}  {'kernel':<44} "
          f"{'ms':>8} {'TFLOP/s':>8} {'rel err':>8} {'cuBLAS':>8} {'ratio':>6}")


def print_row(r):
    cub = f"{r['cublas_tflops']:8.1f} {r['ratio']:6.2f}" if "cublas_tflops" in r else f"{'-':>8} {'-':>6}"
    mark = "" if r["chosen"] else "  (sweep)"
    print(f"{r['shape']:<14} {r['M']:>6} {r['N']:>5} {r['K']:>6} {r['trans']:>2} {r['precision']:>4}  "
          f"{r['kernel']:<44} {r['ms']:8.4f} {r['tflops']:8.1f} {r['rel_err']:8.1e} {cub}{mark}", flush=True)


# ---------------------------------------------------------------------------------------
LADDER = [  # (name expression, block, tile) of the teaching kernels in gemm_simt.cu
    ("gemm_ladder_naive", (16, 16), (16, 16)),
    ("gemm_ladder_coalesced", (32, 8), (8, 32)),
    ("gemm_ladder_smem<32>", (32, 32), (32, 32)),
    ("gemm_ladder_regtile<64,64,8,4,4>", (256,), (64, 64)),
]


def bench_ladder(rt, M, N, K, args):
    """C = A @ B (NN) with each teaching kernel, then the production fp32 kernel."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    rows = np.sort(rng.choice(M, size=min(M, args.sample_rows), replace=False))
    flop = 2.0 * M * N * K
    ar = Arena(rt, "bench")
    out_rows = []
    try:
        da, db, out = ar.upload(a), ar.upload(b), ar.empty((M, N))
        for name, block, tile in LADDER:
            fn = rt.function(SIMT_FILE, name)
            grid = (-(-N // tile[1]), -(-M // tile[0]))

            def rec(fn=fn, grid=grid, block=block):
                rt.launch(fn, grid, block, [out, da, db, i32(M), i32(N), i32(K)])
            ms = time_graphed_ms(rt, rec, warmup=args.warmup, iters=max(5, args.iters // 3), reps=2)
            err = sampled_rel_err(rt.download(out), a, b, False, False, rows)
            out_rows.append((name, ms, flop / ms / 1e9, err))
        for prec, fam in (("fp32", "simt"), ("tf32", "tf32")):      # the production kernels
            rt.exec = rt.exec.with_precision(prec)
            p = plan(Product(M, N, K), fam, sm_count=rt.info.sm_count)
            ms = time_graphed_ms(rt, lambda: gemm.matmul(rt, out, da, db, plan=p), warmup=args.warmup,
                                 iters=args.iters, reps=5)
            out_rows.append((f"{plan_label(p)} NN", ms, flop / ms / 1e9,
                             sampled_rel_err(rt.download(out), a, b, False, False, rows)))
    finally:
        ar.free()
    print(f"\nladder {M}x{N}x{K} NN")
    for name, ms, tf, err in out_rows:
        print(f"  {name:<44} {ms:9.3f} ms {tf:8.1f} TFLOP/s  rel err {err:.1e}")
    return [{"ladder": n, "ms": ms, "tflops": tf, "rel_err": e} for n, ms, tf, e in out_rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mnk", nargs="*", default=None, help="shapes M,N,K (default: 4096^3 + the model's)")
    ap.add_argument("--trans", default=None, choices=["NN", "NT", "TN"],          # gemm.PRODUCTS' layouts
                    help="transpose case for every shape (default: the model's case of each shape; NN for --mnk)")
    ap.add_argument("--model", default=None, metavar="B,T,C,V",
                    help="the model's shapes at this batch, context, width and vocabulary (default 64,256,384,65)")
    ap.add_argument("--precision", default="both", choices=["fp32", "tf32", "both"])
    ap.add_argument("--sweep", action="store_true", help="also time every candidate tile / split")
    ap.add_argument("--ladder", action="store_true", help="teaching kernels on a square shape first")
    ap.add_argument("--ladder_size", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sample_rows", type=int, default=64)
    ap.add_argument("--no_cublas", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    dims = tuple(int(x) for x in args.model.split(",")) if args.model else (B, T, C, V)
    if args.mnk:
        shapes = []
        for s in args.mnk:
            M, N, K = (int(x) for x in s.split(","))
            shapes.append((f"{M}x{N}x{K}", M, N, K, args.trans or "NN"))
    else:
        # 4096^3 as A @ B (NN: wgmma through B^T) and as x @ W^T (NT: wgmma directly)
        shapes = [("square", 4096, 4096, 4096, t) for t in ([args.trans] if args.trans else ["NN", "NT"])]
        shapes += [(l, M, N, K, args.trans or t) for l, M, N, K, t in model_shapes(*dims)]
    precisions = ["fp32", "tf32"] if args.precision == "both" else [args.precision]

    rt = Runtime(0, precision="fp32", seed=0)
    print(f"{rt.info.name}, {rt.info.sm_count} SMs, {rt.arch}")
    cfg = type("Cfg", (), dict(batch_size=dims[0], block_size=dims[1], n_embd=dims[2], n_head=6,
                               n_layer=6, vocab_size=dims[3], attention="unfused"))
    ws_model = max([s for s, _ in gemm.workspace(cfg).values()] or [(0,)])[0]
    # room for the largest split the planner may pick for these shapes (at most 256 MB)
    ws_floats = max([ws_model, 1] + [MAX_SPLITS * M * N for _, M, N, K, _ in shapes
                                     if MAX_SPLITS * M * N <= 64 << 20])
    results = []
    if args.ladder:
        n = args.ladder_size
        results += bench_ladder(rt, n, n, n, args)
        print()
    print(HEADER)
    watch = ClockWatch(0)
    for label, M, N, K, trans in shapes:
        results += bench_shape(rt, label, M, N, K, trans, precisions, args, ws_floats)
    print(watch.stop())
    chosen = [r for r in results if r.get("chosen") and "ratio" in r]
    for prec in precisions:
        # the geomean is over the model's shapes (the squares are reported row by row above)
        rs = [r for r in chosen if r["precision"] == prec and r["shape"] != "square"]
        if rs:
            geo = math.exp(sum(math.log(r["ratio"]) for r in rs) / len(rs))
            tf = math.exp(sum(math.log(r["tflops"]) for r in rs) / len(rs))
            cb = math.exp(sum(math.log(r["cublas_tflops"]) for r in rs) / len(rs))
            print(f"{prec}: geomean {tf:.1f} TFLOP/s, cuBLAS {cb:.1f}, ratio {geo:.2f} over {len(rs)} shapes")
    write_results(args.json, results)
    rt.close()


if __name__ == "__main__":
    main()
