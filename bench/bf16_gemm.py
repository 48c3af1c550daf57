"""The BF16 products (gemm family bf16: kernels/gemm_wgmma.cu gemm_wgmma_ws with DT = 1, through gemm.matmul)
against float64, and their speed beside TF32's, on the GPT-2 124M shapes.

    python bench/bf16_gemm.py [--check] [--speed] [--iters 30] [--json out.json] [--ops 'fwd fc,dW head']
                              [--tiles 256x128s4,128x256s4] [--epi none] [--tokens 16384] [--energy_seconds 1]

--check: every layout of the op interface (NT: A [M, K] and B [N, K] K-major; NN: B [K, N] as stored,
MN-major; TN: A [K, M] and B [K, N] as stored) into its C type (bf16; the weight gradients' TN fp32), the
epilogues (bias, GELU with its pre-activation, residual, dGELU), edge tiles (M, N, K not multiples of the
tile), split-K partials and their reduction, on every tile, each against a float64 product of the same
bf16 inputs. Error model: the inputs are exact in
bf16, the products exact in fp32, the sums in fp32 (K terms: <= K 2^-24 of sum |a b| where the
accumulation rounds to nearest, up to twice that where it truncates); a bf16 output adds one rounding
(2^-9 relative). PASS: max|out - ref| / max|ref| <= 4e-5 (fp32 out; K <= 3072) or 6e-3 (bf16 out).
--speed: the median time of each GPT-2 124M product (B8 T1024: M = 8192 tokens, C 768, V 50304; --tokens:
another count), replayed in a CUDA graph, in TF32 as the training step plans it (with its re-layouts) and in
BF16 (its best tile, every layout as stored), with TFLOP/s, the SM clock read before and after. Each bf16
tile's time comes with its time a wave of tiles (us: the time over the waves of one tile an SM), which tells
products of one tile and k loop apart where their operands, not their arithmetic, differ (the head's
logits read their 77 MB B again for every panel of A until their tiles walked m fastest: bench/NOTES.md);
--energy_seconds: and its joules a launch and mean power (NVML's energy counter, bench/common.energy_graphed),
beside cuBLAS's (bench/cublas_bf16.py --energy_seconds) where a step runs at the board's power cap.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import ClockWatch, energy_cell, energy_graphed, write_results  # noqa: E402
from bench.timing import time_graphed_ms  # noqa: E402
from gptcuda.ops.cuda import cdiv, gemm  # noqa: E402
from gptcuda.ops.cuda.gemm.families import BF16_TILES, EPILOGUE_CODES, FAMILIES, layout_code  # noqa: E402
from gptcuda.ops.cuda.gemm.plan import make_plan  # noqa: E402
from gptcuda.ops.reference import ops as ref  # noqa: E402
from gptcuda.runtime import Runtime, bf16  # noqa: E402
from gptcuda.runtime.profile import rel_err as rel  # noqa: E402

EPILOGUES = {"bias": "none", "gelu": "gelu", "residual": "residual", "dgelu": "dgelu", "dgelu_gelu": "dgelu_gelu",
             "none": "none"}


def product(rt, ex, c, a, b, ta, tb, epi="none", bias=None, aux=None, tile=None, splits=1):
    """c = op(a) op(b) (+ bias) (+ epilogue) through gemm.matmul in plan ex, the tile (and split count)
    forced where given (else the cost model's)."""
    K = a.shape[-2] if ta else a.shape[-1]
    fam = ex.gemm_family
    p = make_plan(fam, tile, splits, K) if tile is not None else None
    gemm.matmul(rt, c, a, b, ta, tb, bias=bias, epilogue=EPILOGUES[epi], aux=aux, plan=p, ex=ex)


def check(rt, rng) -> bool:
    ex = rt.exec
    ok = True
    cases = []
    for ta, tb in ((False, True), (False, False), (True, False)):
        out_t = "f32" if ta else "bf16"
        for (M, N, K) in ((256, 256, 256), (200, 136, 72), (1000, 520, 3072)):
            cases.append((ta, tb, M, N, K, "none", False, out_t, 1))
    for epi, hb in (("bias", True), ("gelu", True), ("gelu", False), ("residual", True), ("residual", False)):
        cases.append((False, True, 520, 392, 264, epi, hb, "bf16", 1))
    cases.append((False, False, 520, 392, 264, "dgelu", False, "bf16", 1))
    cases.append((True, False, 384, 768, 4096, "none", False, "f32", 4))     # split-K partials, the reduction
    for tile in BF16_TILES:
        for ta, tb, M, N, K, epi, hb, out_t, splits in cases:
            if tile[3] == 0 and tile != (128, 256, 4, 0) and (epi != "none" or splits > 1 or K != 3072):
                continue          # the other gemm_wgmma_ws tiles: each layout at the largest shape
            a64 = bf16.round_f32(rng.standard_normal((K, M) if ta else (M, K))).astype(np.float64)
            b64 = bf16.round_f32(rng.standard_normal((N, K) if tb else (K, N))).astype(np.float64)
            a, b = rt.upload(a64, "bf16"), rt.upload(b64, "bf16")
            prod = (a64.T if ta else a64) @ (b64.T if tb else b64)
            bias = rng.standard_normal(N).astype(np.float32) if hb else None
            pre = prod + (bias.astype(np.float64) if hb else 0.0)
            aux64 = bf16.round_f32(rng.standard_normal((M, N))).astype(np.float64) \
                if epi in ("residual", "dgelu") else None
            c = rt.empty((M, N), out_t)
            aux = rt.upload(aux64, "bf16") if aux64 is not None else (rt.empty((M, N), "bf16") if epi == "gelu"
                                                                       else None)
            product(rt, ex, c, a, b, ta, tb, epi, rt.upload(bias) if hb else None, aux, tile, splits)
            got = rt.download(c)
            got = (bf16.values(got) if out_t == "bf16" else got).astype(np.float64)
            if epi == "gelu":
                pre_got = bf16.values(rt.download(aux)).astype(np.float64)
                err = max(rel(got, ref.gelu_forward(pre_got)), rel(pre_got, pre))
            elif epi == "residual":
                err = rel(got, aux64 + pre)
            elif epi == "dgelu":
                err = rel(got, ref.gelu_backward(prod, aux64))
            else:
                err = rel(got, pre)
            tol = 6e-3 if out_t == "bf16" else 4e-5
            good = err <= tol
            ok &= good
            print(f"{'PASS' if good else 'FAIL'} tile {tile[0]}x{tile[1]} {layout_code(ta, tb)} {M}x{N}x{K} "
                  f"split {splits} {epi}{'+bias' if hb else ''} out {out_t}: rel err {err:.2e} (tol {tol:.0e})",
                  flush=True)
    return ok


def wave_us(ms, M, N, tile, sm_count) -> float:
    """Microseconds a wave of tiles of a one-split product M x N on `tile` (BM, BN, ...) took: its time over
    ceil(tiles / SMs), one block an SM (the ping-pong tile's two warpgroups take turns on one SM's tiles)."""
    return ms * 1e3 / cdiv(cdiv(M, tile[0]) * cdiv(N, tile[1]), sm_count)


def gpt2_shapes(tokens=8192, C=768, V=50304):
    """(label, M, N, K, layout, epilogue, bias) of GPT-2 124M's products at `tokens` tokens (one layer and
    the head), each with the epilogue the training step gives it."""
    out = []
    for name, n_out, n_in, fwd, dx in (("qkv", 3 * C, C, "bias", "none"), ("attn proj", C, C, "residual", "none"),
                                       ("fc", 4 * C, C, "gelu", "none"), ("fc proj", C, 4 * C, "residual", "dgelu"),
                                       ("head", V, C, "none", "none")):
        out += [(f"fwd {name}", tokens, n_out, n_in, "NT", fwd, name != "head"),
                (f"dX {name}", tokens, n_in, n_out, "NN", dx, False), (f"dW {name}", n_out, n_in, tokens, "TN",
                                                                       "none", False)]
    # recompute's form of dX fc proj: the GELU output rebuilt over the pre-activation too
    return out + [("dX fc proj rc", tokens, 4 * C, C, "NN", "dgelu_gelu", False)]


def speed(rt, rng, iters, bf16_only=False, ops=None, tiles=None, epi_as=None, tokens=8192,
          energy_s=0.0) -> list:
    """Each product's best tile (one product, no split; the epilogue of the training step), replayed in a
    CUDA graph: TF32 as the training step runs it (the cost model's plan: B^T first for NN, the register-A
    kernels for TN), BF16 as stored, every tile's time printed (bf16_only: no TF32 column). epi_as ("none",
    "gelu+bias", ...): every product timed with that epilogue instead of its own (what an epilogue costs).
    energy_s > 0: each bf16 tile's joules a launch and mean power too, replayed for energy_s seconds (NVML's
    counter: bench/common.energy_graphed)."""
    rows = []
    watch = ClockWatch()
    tf32, bf = rt.exec.with_precision("tf32"), rt.exec
    for label, M, N, K, lay, epi, hb in gpt2_shapes(tokens):
        if ops and label not in ops:
            continue
        if epi_as:
            epi, hb = epi_as.split("+")[0], epi_as.endswith("+bias")
            label = f"{label} as {epi_as}"
        ta, tb = lay[0] == "T", lay[1] == "T"
        flop = 2.0 * M * N * K
        best = {"f32": (float("nan"), "-")} if bf16_only else {}
        for ex, dtype in ((bf, "bf16"),) if bf16_only else ((tf32, "f32"), (bf, "bf16")):
            a = rt.upload(rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32), dtype)
            b = rt.upload(rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32), dtype)
            c = rt.empty((M, N), "bf16" if dtype == "bf16" and not ta else "f32")
            bias = rt.upload(rng.standard_normal(N).astype(np.float32)) if hb else None
            aux = rt.upload(rng.standard_normal((M, N)).astype(np.float32), c.dtype) if EPILOGUES[epi] != "none" else None
            pick = tuple(t for t in BF16_TILES if (not tiles or FAMILIES["bf16"].short(t) in tiles) and
                         FAMILIES["bf16"].serves(t, EPILOGUE_CODES[EPILOGUES[epi]])) if dtype == "bf16" else (None,)
            times = []
            for tile in pick:
                def run(tile=tile):
                    product(rt, ex, c, a, b, ta, tb, epi, bias, aux, tile=tile)

                ms = time_graphed_ms(rt, run, iters=iters, reps=5)
                wave = f" ({wave_us(ms, M, N, tile, rt.info.sm_count):.1f} us)" if tile else ""
                if energy_s > 0 and tile:
                    wave += energy_cell(energy_graphed(rt, run, ms, energy_s))
                times.append(f"{FAMILIES['bf16'].short(tile) if tile else 'model'} {ms:.4f}{wave}")
                if dtype not in best or ms < best[dtype][0]:
                    best[dtype] = (ms, tile or "model")
            if dtype == "bf16":
                print(f"  {label} {epi}{'+bias' if hb else ''}: " + ", ".join(times), flush=True)
        tf, bb = best["f32"], best["bf16"]
        rows.append({"op": label, "M": M, "N": N, "K": K, "layout": lay, "tf32_ms": tf[0], "bf16_ms": bb[0],
                     "bf16_tile": bb[1], "bf16_tflops": flop / bb[0] / 1e9, "tf32_tflops": flop / tf[0] / 1e9})
        print(f"{label:<14} {lay} {M:>6}x{N:<6}x{K:<6} tf32 {tf[0]:8.4f} ms ({flop / tf[0] / 1e9:6.1f} TFLOP/s)  "
              f"bf16 {bb[0]:8.4f} ms ({flop / bb[0] / 1e9:6.1f} TFLOP/s {FAMILIES['bf16'].short(bb[1])})  "
              f"x{tf[0] / bb[0]:.2f}", flush=True)
    total_tf, total_bf = sum(r["tf32_ms"] for r in rows), sum(r["bf16_ms"] for r in rows)
    print(f"sum (one layer + head): tf32 {total_tf:.3f} ms, bf16 {total_bf:.3f} ms; {watch.stop()}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--bf16-only", action="store_true", help="--speed without the TF32 column")
    ap.add_argument("--ops", help="--speed: these products alone (comma-separated labels, e.g. 'fwd fc,dW head')")
    ap.add_argument("--tiles", help="--speed: these bf16 tiles alone (short names, e.g. 128x256s4,256x128s4)")
    ap.add_argument("--epi", help="--speed: every product with this epilogue instead (e.g. none, gelu+bias)")
    ap.add_argument("--tokens", type=int, default=8192, help="--speed: M of the products (8192: B8 T1024)")
    ap.add_argument("--energy_seconds", type=float, default=0.0,
                    help="--speed: > 0: each bf16 tile's joules a launch too, replayed this long (NVML's counter)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.tokens < 1:
        ap.error(f"--tokens {args.tokens}: a positive count")
    if args.epi and args.epi.split("+")[0] not in EPILOGUES:
        ap.error(f"--epi {args.epi}: one of {', '.join(EPILOGUES)}, optionally +bias")
    rt = Runtime(0, precision="bf16", seed=0)
    rt.set_workspace({"gemm_splitk": rt.empty((32 * 768 * 768,)), "gemm_bT": rt.empty((768 * 50304,)),
                      "gemm_aT": rt.empty((3072 * max(8192, args.tokens),))})
    rng = np.random.default_rng(0)
    ok = True
    result = {}
    if args.check or not args.speed:
        ok = check(rt, rng)
        print("bf16 GEMM check:", "ALL PASS" if ok else "FAILED")
        result["check"] = ok
    if args.speed:
        result["speed"] = speed(rt, rng, args.iters, args.bf16_only, args.ops and args.ops.split(","),
                                args.tiles and args.tiles.split(","), args.epi, args.tokens, args.energy_seconds)
    if args.json:
        write_results(args.json, result)
    rt.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
