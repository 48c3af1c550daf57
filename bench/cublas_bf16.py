"""cuBLAS's BF16 products on GPT-2 124M's shapes, to set beside bench/bf16_gemm.py --speed (ours, same call):
how far our products' main loops and epilogues are from the vendor library's on the same GPU.

    python3 bench/cublas_bf16.py [--tokens 16384] [--iters 15] [--ops 'fwd fc,dX fc'] [--energy_seconds 1]

Every product of bench/bf16_gemm.py's gpt2_shapes (the same labels, M, N, K and layouts: NT = A [M, K] and
B [N, K]; NN = B [K, N]; TN = A [K, M]) through torch (bf16 in, bf16 out, fp32 accumulation: reduced-
precision reduction off), timed as ten calls captured in a CUDA graph, the median of the replays over ten,
after a warm-up. Where the step gives a product an epilogue cuBLASLt has, that form is timed too: bias
(addmm) and bias + GELU (the tanh form, cuBLASLt's fused epilogue through torch._addmm_activation); the
residual and dGELU epilogues have no cuBLAS form (PyTorch runs them as separate kernels). The weight
gradients come out in bf16 here (ours: fp32). A side-by-side reference run only: gptcuda never imports torch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.bf16_gemm import gpt2_shapes  # noqa: E402  (shapes only: nothing of gptcuda's runs here)
from bench.common import ClockWatch, energy_cell, energy_per_run, per_call  # noqa: E402  (NVML, read only)


def graph_ms(torch, f, iters: int, energy_s: float = 0.0):
    """(median ms of one call of f: ten calls captured in a CUDA graph, each replay timed by events; energy_s
    > 0: energy_per_run's dict of one call, the graph replayed for energy_s seconds, else None)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 10)
    energy = per_call(energy_per_run(g.replay, torch.cuda.synchronize, energy_s), 10) if energy_s > 0 else None
    return statistics.median(times), energy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="M of the products (16384: B16 T1024)")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--ops", help="these products alone (comma-separated labels, e.g. 'fwd fc,dW head')")
    ap.add_argument("--energy_seconds", type=float, default=0.0,
                    help="> 0: each form's joules a call too, its graph replayed this long (NVML's counter)")
    a = ap.parse_args()
    import torch                                   # here, so that --help works without it
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    ops = set(a.ops.split(",")) if a.ops else None
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    watch = ClockWatch()
    for label, M, N, K, lay, epi, has_bias in gpt2_shapes(a.tokens):
        if (ops and label not in ops) or label.endswith(" rc"):
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        r = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
        A = r(K, M) if lay[0] == "T" else r(M, K)
        B = r(N, K) if lay[1] == "T" else r(K, N)
        opA = A.t() if lay[0] == "T" else A
        opB = B.t() if lay[1] == "T" else B
        forms = [("plain", lambda: torch.mm(opA, opB))]
        if has_bias:
            bias = r(N)
            forms.append(("bias", lambda: torch.addmm(bias, opA, opB)))
            if epi == "gelu":
                forms.append(("bias+gelu", lambda: torch._addmm_activation(bias, opA, opB, use_gelu=True)))
        flop = 2.0 * M * N * K
        cells = []
        for name, f in forms:
            ms, e = graph_ms(torch, f, a.iters, a.energy_seconds)
            cells.append(f"{name} {ms:.4f} ms ({flop / ms / 1e9:.0f} TFLOP/s){energy_cell(e) if e else ''}")
        print(f"cublas {label:<14} {lay} {M:>6}x{N:<6}x{K:<6} " + ", ".join(cells), flush=True)
    print(watch.stop())


if __name__ == "__main__":
    main()
