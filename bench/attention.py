"""Benchmark causal self-attention: fused (flash) vs unfused, forward and backward.

    python bench/attention.py [--B 16] [--T 256,1024,2048,8192] [--n_embd 768] [--n_head 12]
                              [--precision fp32,tf32,bf16] [--dropout 0.0] [--iters 20] [--json out.json]
                              [--bf16-tiles "default;fwd=192x128s2,dq=192x64s2"]

Per T: median time (CUDA events around ten launches replayed as one CUDA graph, after warm-up) of
attention_fwd and attention_bwd of each implementation and precision, plus PyTorch's
scaled_dot_product_attention (causal; fp32 inputs, and bf16 inputs where bf16 is asked for) when torch
with CUDA is importable (benchmark only; nothing else uses torch). The torch case runs in a separate
Python process (a self-contained snippet whose last output line is JSON): importing torch into a process
whose CUDA runtime this package already set up can fail, and a fresh process also keeps torch's
allocator and kernels out of our measurements. An unfused case whose [B,H,T,T] buffers do not fit in free
device memory is skipped; the unfused T=8192 case is run last since it is the largest. bf16 (the
flash_bf16 kernels, bf16 qkv / y / dy / dqkv): --bf16-tiles times each ';'-separated set of tiles
(kind=BMxBNsNS, kind fwd | dq | dkv, at every T; `default`: flash.FLASH_BF16_TILES and, at T >= 1024,
FLASH_BF16_TILES_LONG as they are) as its own row, the other kinds at their defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gptcuda.model import rng  # noqa: E402
from gptcuda.ops.cuda import attention as attn  # noqa: E402
from gptcuda.ops.cuda import flash  # noqa: E402
from gptcuda.runtime import Runtime  # noqa: E402
from bench.common import write_results  # noqa: E402
from gptcuda.runtime.profile import Arena  # noqa: E402
from bench.timing import time_graphed_ms  # noqa: E402
from gptcuda.config import config_of  # noqa: E402
from gptcuda.runtime.execution import fused_path  # noqa: E402


def case_bytes(cfg) -> int:
    n = sum(int(np.prod(s)) for s, _ in attn.workspace(cfg).values())
    n += sum(int(np.prod(s)) for s, _ in attn.saved_shapes(cfg).values())
    B, T, C = cfg.batch_size, cfg.block_size, cfg.n_embd
    n += 2 * B * T * 3 * C + 3 * B * T * C
    return 4 * n


def flops(B, H, T, hs):
    """Useful (causal) FLOPs: forward QK^T and PV on the lower triangle; backward 2.5x that."""
    fwd = 4.0 * B * H * hs * T * (T + 1) / 2
    return fwd, 2.5 * fwd


def parse_tiles(text: str) -> dict:
    """'fwd=192x128s2,dq=192x64s2' -> {'fwd': (192, 128, 2), 'dq': (192, 64, 2)}; 'default' -> {}."""
    out = {}
    for part in filter(None, text.strip().split(",")):
        if part == "default":
            continue
        try:
            kind, t = part.split("=")
            mn, ns = t.split("s")
            bm, bn = mn.split("x")
            out[kind] = (int(bm), int(bn), int(ns))
        except ValueError:
            raise SystemExit(f"--bf16-tiles: {part!r} is not kind=BMxBNsNS") from None
    return out


def bench_ours(rt, kind, precision, B, T, C, H, p, warmup, iters):
    cfg = config_of(batch_size=B, block_size=T, n_embd=C, n_head=H, attention=kind, dropout=p)
    free = rt.dev.mem_info()[0]
    need = case_bytes(cfg)
    if need > 0.9 * free:
        return {"skipped": f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
    ar = Arena(rt, "bench")
    try:
        ex = rt.exec.with_precision(precision)
        if precision == "bf16" and kind == "fused":      # the plan's bf16 path at this head size
            ex = dataclasses.replace(ex, attention=fused_path("bf16", False, C // H))
        rt.exec = ex
        rt.set_workspace({k: ar.empty(s, d, name=k) for k, (s, d) in attn.workspace(cfg, ex).items()})
        saved = {k: ar.empty(s, d, name=k) for k, (s, d) in attn.saved_shapes(cfg, ex).items()}
        dt = "bf16" if precision == "bf16" else "f32"
        qkv = ar.noise((B, T, 3 * C), dt)
        dy = ar.noise((B, T, C), dt)
        y = ar.empty((B, T, C), dt, name="y")
        dqkv = ar.empty((B, T, 3 * C), dt, name="dqkv")
        site = rng.dropout_site(0, 0)
        fwd = lambda: attn.attention_fwd(rt, y, qkv, saved, H, p, site)  # noqa: E731
        bwd = lambda: attn.attention_bwd(rt, dqkv, dy, qkv, y, saved, H, p, site)  # noqa: E731
        # ten launches replayed as one CUDA graph a sample, as a training step runs them: no host time
        t_f = time_graphed_ms(rt, fwd, warmup, iters)
        fwd()
        t_b = time_graphed_ms(rt, bwd, warmup, iters)
        return {"fwd_ms": t_f, "bwd_ms": t_b}
    finally:
        ar.free()


# Run as `python -c TORCH_SNIPPET B T H hs warmup iters`; prints one JSON line: null when torch or
# CUDA is missing, {"skipped": reason} when the case fails, else {"fwd_ms": .., "bwd_ms": ..}.
TORCH_SNIPPET = r"""
import json, statistics, sys
try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print(json.dumps(None)); sys.exit(0)
if not torch.cuda.is_available():
    print(json.dumps(None)); sys.exit(0)
B, T, H, hs, warmup, iters = (int(a) for a in sys.argv[1:7])
dtype = getattr(torch, sys.argv[7] if len(sys.argv) > 7 else "float32")
dev = torch.device("cuda")
def timed(fn):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        ts.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ts)
try:
    q, k, v = (torch.randn(B, H, T, hs, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    dy = torch.randn(B, H, T, hs, device=dev, dtype=dtype)
    with torch.no_grad():
        t_f = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t_b = timed(lambda: torch.autograd.grad(out, (q, k, v), dy, retain_graph=True))
    res = {"fwd_ms": t_f, "bwd_ms": t_b}
except RuntimeError as e:          # out of memory, no kernel for the case
    res = {"skipped": str(e).splitlines()[0][:80]}
print(json.dumps(res))
"""


def bench_torch(B, T, C, H, warmup, iters, timeout=1200, dtype="float32"):
    """PyTorch SDPA (causal; fp32, or bf16 inputs) in a fresh Python process; None when torch / CUDA is
    unavailable."""
    cmd = [sys.executable, "-c", TORCH_SNIPPET] + [str(x) for x in (B, T, H, C // H, warmup, iters, dtype)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"torch subprocess timed out after {timeout} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    try:
        res = json.loads(lines[-1])
    except (IndexError, ValueError):
        err = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skipped": f"torch subprocess failed (rc {r.returncode}): {err[:100]}"}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", default="256,1024,2048,8192")
    ap.add_argument("--n_embd", type=int, default=768)
    ap.add_argument("--n_head", type=int, default=12)
    ap.add_argument("--precision", default="fp32,tf32")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--impl", default="fused,unfused,torch")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bf16-tiles", default="default", help="';'-separated sets of kind=BMxBNsNS (bf16 rows)")
    a = ap.parse_args(argv)
    tile_sets = [parse_tiles(t) for t in a.bf16_tiles.split(";")]

    Ts = [int(t) for t in a.T.split(",")]
    precisions = a.precision.split(",")
    impls = a.impl.split(",")
    B, C, H = a.B, a.n_embd, a.n_head
    hs = C // H
    rt = Runtime(0, precision="fp32", seed=1234)
    st = np.zeros(16, np.int32)
    rt.state = rt.upload(st)

    # every case, the largest unfused one last (it is the most likely to exhaust the device)
    cases = []
    for T in Ts:
        for kind in ("fused", "unfused"):
            if kind in impls:
                cases += [(T, kind, prec, ts) for prec in precisions
                          for ts in (tile_sets if kind == "fused" and prec == "bf16" else [{}])]
        if "torch" in impls:
            cases += [(T, "torch", prec, {}) for prec in ("fp32", "bf16") if prec == "fp32" or prec in precisions]
    cases.sort(key=lambda c: (c[1] == "unfused" and c[0] == max(Ts), 0))

    print(f"# causal attention, B={B} C={C} H={H} hs={hs} dropout={a.dropout}; median of {a.iters} "
          f"after {a.warmup} warm-up; {rt.info.name}")
    print(f"{'T':>6} {'impl':>8} {'prec':>5} {'fwd ms':>9} {'bwd ms':>9} {'total ms':>9} {'fwd TF/s':>9} "
          f"{'bwd TF/s':>9}")
    results = []
    defaults, long_defaults = dict(flash.FLASH_BF16_TILES), dict(flash.FLASH_BF16_TILES_LONG)
    for T, kind, prec, ts in cases:
        for table, base in ((flash.FLASH_BF16_TILES, defaults), (flash.FLASH_BF16_TILES_LONG, long_defaults)):
            table.clear()
            table.update(base)
        flash.FLASH_BF16_TILES.update({(k, hs): v for k, v in ts.items()})   # a row's tiles at every T
        for k in ts:
            flash.FLASH_BF16_TILES_LONG.pop((k, hs), None)
        label = prec + ("" if not ts else " " + ",".join(f"{k}={m}x{n}s{s}" for k, (m, n, s) in ts.items()))
        if kind == "torch":
            r = bench_torch(B, T, C, H, a.warmup, a.iters, dtype="bfloat16" if prec == "bf16" else "float32")
            if r is None:
                continue
        else:
            try:
                r = bench_ours(rt, kind, prec, B, T, C, H, a.dropout, a.warmup, a.iters)
            except Exception as e:   # noqa: BLE001 - report and go on with the other cases
                r = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
        r.update(T=T, impl=kind, precision=prec, B=B, C=C, H=H, dropout=a.dropout, tiles=ts)
        results.append(r)
        if "skipped" in r:
            print(f"{T:>6} {kind:>8} {label:>5}  skipped: {r['skipped']}", flush=True)
            continue
        ff, fb = flops(B, H, T, hs)
        print(f"{T:>6} {kind:>8} {prec:>5} {r['fwd_ms']:9.3f} {r['bwd_ms']:9.3f} {r['fwd_ms'] + r['bwd_ms']:9.3f} "
              f"{ff / r['fwd_ms'] / 1e9:9.2f} {fb / r['bwd_ms'] / 1e9:9.2f}  {label[len(prec) + 1:]}", flush=True)
    write_results(a.json, results)
    rt.close()


if __name__ == "__main__":
    main()
