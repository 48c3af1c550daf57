"""The BF16 warpgroup-MMA product (kernels/gemm_wgmma.cu gemm_wgmma_ws with DT = 1) against float64, and its
speed beside the TF32 kernel it extends, on the GPT-2 124M shapes.

    python bench/bf16_gemm.py [--check] [--speed] [--iters 30] [--json out.json]

--check: every layout the kernel reads (NT: A [M, K] and B [N, K] K-major; NN: B [K, N] as stored, MN-major;
TN: A [K, M] and B [K, N] as stored; TT), fp32 and bf16 outputs, the epilogues (bias, GELU with its
pre-activation, residual, dGELU), edge tiles (M, N, K not multiples of the tile), split-K partials and a
batch, each against a float64 product of the same bf16 inputs. Error model: the inputs are exact in
bf16, the products exact in fp32, the sums in fp32 (K terms: <= K 2^-24 of sum |a b| where the
accumulation rounds to nearest, up to twice that where it truncates); a bf16 output adds one rounding
(2^-9 relative). PASS: max|out - ref| / max|ref| <= 4e-5 (fp32 out; K <= 3072) or 6e-3 (bf16 out).
--speed: the median time of each GPT-2 124M product (B8 T1024: M = 8192 tokens, C 768, V 50304) in TF32
(gemm_wgmma_ws as the training step runs it, K-major operands) and in BF16 (every layout as stored),
with TFLOP/s, the SM clock read before and after.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import ClockWatch, median_ms, write_results  # noqa: E402
from gptcuda.ops.cuda import expression  # noqa: E402
from gptcuda.runtime import Runtime, bf16, f32, i32, u64  # noqa: E402

FILE = "gemm_wgmma.cu"
EPI = {"none": 0, "bias": 1, "gelu": 2, "residual": 3, "dgelu": 4}
SIZE = {"f32": 4, "bf16": 2}


def kernel(tile, epi, has_bias, dt, mn_a, mn_b, out):
    bm, bn, stages = tile
    return expression("gemm_wgmma_ws", bm, bn, stages, epi, has_bias, (bm // 64 + 1) * 128,
                      stages * (bm + bn) * 128 + 1024, dt, mn_a, mn_b, out)


def operand_map(rt, x, rows, K, mn, box_rows, batch=1):
    """The tensor map of an operand: K-major [batch, rows, K] (box {BK, rows of the tile}) or MN-major
    [batch, K, rows] (boxes {64, 64}); BK = 128 bytes of k."""
    e = SIZE[x.dtype]
    bk = 128 // e
    if mn:
        return rt.tensor_map(x, (rows, K, batch), (e * rows, e * rows * K), (64, bk, 1))
    return rt.tensor_map(x, (K, rows, batch), (e * K, e * K * rows), (bk, box_rows, 1))


def launch(rt, tile, c, a, b, M, N, K, mn_a, mn_b, epi="none", bias=None, aux=None, splits=1, batch=1, alpha=1.0):
    """c [batch * splits, M, N] = alpha * op(a) op(b) (+ bias) (+ epilogue); a, b of one dtype."""
    dt = 1 if a.dtype == "bf16" else 0
    bm, bn, stages = tile
    bk = 64 if dt else 32
    k_chunk = -(-K // splits)
    k_chunk = -(-k_chunk // bk) * bk
    assert splits == 1 or -(-K // k_chunk) == splits
    name = kernel(tile, EPI[epi], bias is not None, dt, mn_a, mn_b, 1 if c.dtype == "bf16" else 0)
    fn = rt.function(FILE, name)
    ma = operand_map(rt, a, M, K, mn_a, bm, batch)
    mb = operand_map(rt, b, N, K, mn_b, bn, batch)
    zs = batch * splits
    tiles = -(-M // bm) * -(-N // bn) * zs
    rt.launch(fn, (max(1, min(tiles, rt.info.sm_count)), 1, 1), ((bm // 64 + 1) * 128,),
              [c, aux, ma, mb, bias, i32(M), i32(N), i32(K), i32(N), u64(M * N), f32(alpha), i32(splits),
               i32(k_chunk), i32(zs), None], smem=stages * (bm + bn) * 128 + 1024, label=name)


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def gelu_grad(x):
    u = np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)
    t = np.tanh(u)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * np.sqrt(2.0 / np.pi) * (1 + 3 * 0.044715 * x * x)


def rel(got, ref):
    got = np.asarray(got, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def check(rt, rng) -> bool:
    ok = True
    cases = []
    for ta, tb in ((False, True), (False, False), (True, False), (True, True)):
        for (M, N, K) in ((256, 256, 256), (200, 136, 72), (1000, 520, 3072)):
            cases.append((ta, tb, M, N, K, "none", False, "f32", 1, 1))
            cases.append((ta, tb, M, N, K, "none", False, "bf16", 1, 1))
    for epi, hb in (("bias", True), ("gelu", True), ("gelu", False), ("residual", True), ("dgelu", False)):
        cases.append((False, True, 520, 392, 264, epi, hb, "bf16", 1, 1))
        cases.append((False, False, 520, 392, 264, epi, hb, "bf16", 1, 1))
    cases.append((True, False, 384, 768, 4096, "none", False, "f32", 4, 1))   # split-K partials
    cases.append((False, True, 256, 192, 128, "none", False, "bf16", 1, 3))   # a batch
    for tile in ((128, 128, 4), (128, 256, 4), (256, 128, 4), (128, 192, 4)):
        for ta, tb, M, N, K, epi, hb, out_t, splits, batch in cases:
            if tile != (128, 128, 4) and (epi != "none" or splits > 1 or batch > 1 or K != 3072):
                continue          # the other tiles: each layout and output type at the largest shape
            a_shape = (batch, K, M) if ta else (batch, M, K)
            b_shape = (batch, N, K) if tb else (batch, K, N)
            a64 = bf16.round_f32(rng.standard_normal(a_shape)).astype(np.float64)
            b64 = bf16.round_f32(rng.standard_normal(b_shape)).astype(np.float64)
            a, b = rt.upload(a64, "bf16"), rt.upload(b64, "bf16")
            prod = np.einsum("zkm,zkn->zmn" if ta else "zmk,zkn->zmn", a64,
                             np.swapaxes(b64, 1, 2) if tb else b64)
            bias = rng.standard_normal(N).astype(np.float32) if hb else None
            pre = prod + (bias.astype(np.float64) if hb else 0.0)
            aux64 = None
            if epi in ("residual", "dgelu"):
                aux64 = bf16.round_f32(rng.standard_normal((batch, M, N))).astype(np.float64)
            c = rt.empty((batch * splits, M, N), out_t)
            aux = rt.upload(aux64, "bf16") if aux64 is not None else (rt.empty((batch, M, N), "bf16")
                                                                       if epi == "gelu" else None)
            launch(rt, tile, c, a, b, M, N, K, ta, not tb, epi, rt.upload(bias) if hb else None, aux, splits, batch)
            got = rt.download(c)
            got = bf16.values(got) if out_t == "bf16" else got
            if splits > 1:
                got = got.astype(np.float64).sum(0, keepdims=True)
            if epi == "gelu":
                pre_got = bf16.values(rt.download(aux)).astype(np.float64)
                ref = gelu(pre_got)
                err = max(rel(got, ref), rel(pre_got, pre))
            elif epi == "residual":
                err = rel(got, aux64 + pre)
            elif epi == "dgelu":
                err = rel(got, prod * gelu_grad(aux64))
            else:
                err = rel(got, pre)
            tol = 6e-3 if out_t == "bf16" else 4e-5
            good = err <= tol
            ok &= good
            print(f"{'PASS' if good else 'FAIL'} tile {tile[0]}x{tile[1]} {'T' if ta else 'N'}{'T' if tb else 'N'} "
                  f"{M}x{N}x{K} batch {batch} split {splits} {epi}{'+bias' if hb else ''} out {out_t}: "
                  f"rel err {err:.2e} (tol {tol:.0e})", flush=True)
    return ok


def gpt2_shapes(tokens=8192, C=768, V=50304):
    """(label, M, N, K, layout) of GPT-2 124M's products at `tokens` tokens (one layer and the head)."""
    out = []
    for name, n_out, n_in in (("qkv", 3 * C, C), ("attn proj", C, C), ("fc", 4 * C, C), ("fc proj", C, 4 * C),
                              ("head", V, C)):
        out += [(f"fwd {name}", tokens, n_out, n_in, "NT"), (f"dX {name}", tokens, n_in, n_out, "NN"),
                (f"dW {name}", n_out, n_in, tokens, "TN")]
    return out


def speed(rt, rng, iters) -> list:
    rows = []
    watch = ClockWatch()
    for label, M, N, K, lay in gpt2_shapes():
        ta, tb = lay[0] == "T", lay[1] == "T"
        flop = 2.0 * M * N * K
        best = {}
        for dtype in ("f32", "bf16"):
            # TF32 runs K-major operands only (the training step re-lays the others out first, not timed
            # here); BF16 reads every layout as stored
            mn_a, mn_b = (ta, not tb) if dtype == "bf16" else (False, False)
            a = rt.upload(rng.standard_normal((K, M) if mn_a else (M, K)).astype(np.float32), dtype)
            b = rt.upload(rng.standard_normal((K, N) if mn_b else (N, K)).astype(np.float32), dtype)
            c = rt.empty((M, N), "bf16" if dtype == "bf16" and lay != "TN" else "f32")
            for tile in ((128, 256, 4), (256, 128, 4), (128, 192, 4), (128, 128, 4)):
                if dtype == "f32" and tile == (128, 128, 4):
                    continue
                ms = median_ms(rt, lambda: launch(rt, tile, c, a, b, M, N, K, mn_a, mn_b), iters)
                if dtype not in best or ms < best[dtype][0]:
                    best[dtype] = (ms, tile)
        tf, bf = best["f32"], best["bf16"]
        rows.append({"op": label, "M": M, "N": N, "K": K, "layout": lay, "tf32_ms": tf[0], "tf32_tile": tf[1],
                     "bf16_ms": bf[0], "bf16_tile": bf[1], "bf16_tflops": flop / bf[0] / 1e9,
                     "tf32_tflops": flop / tf[0] / 1e9})
        print(f"{label:<14} {lay} {M:>6}x{N:<6}x{K:<6} tf32 {tf[0]:8.4f} ms ({flop / tf[0] / 1e9:6.1f} TFLOP/s "
              f"{tf[1][0]}x{tf[1][1]})  bf16 {bf[0]:8.4f} ms ({flop / bf[0] / 1e9:6.1f} TFLOP/s "
              f"{bf[1][0]}x{bf[1][1]})  x{tf[0] / bf[0]:.2f}", flush=True)
    total_tf, total_bf = sum(r["tf32_ms"] for r in rows), sum(r["bf16_ms"] for r in rows)
    print(f"sum (one layer + head): tf32 {total_tf:.3f} ms, bf16 {total_bf:.3f} ms; {watch.stop()}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rt = Runtime(0, precision="tf32", seed=0)
    rng = np.random.default_rng(0)
    ok = True
    result = {}
    if args.check or not args.speed:
        ok = check(rt, rng)
        print("bf16 GEMM check:", "ALL PASS" if ok else "FAILED")
        result["check"] = ok
    if args.speed:
        result["speed"] = speed(rt, rng, args.iters)
    if args.json:
        write_results(args.json, result)
    rt.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
