"""Where PyTorch's step spends its GPU time: torch.profiler over the reference model's training step
(the anchor script's GPT and recipe, read from .devcarry/reference/torch_reference.py: torch.compile and
bf16 autocast with fp32 weights and fused AdamW, as nanoGPT trains), the kernels' times summed by kernel
and by group, to set beside bench/step.py's phase table of ours (same call, same shape); with
--energy_seconds, the step's joules and mean power too (NVML's counter, as bench/energy.py reads ours).
A side-by-side reference run only: gptcuda never imports torch.

    python3 bench/torch_profile.py [--shape B,T,L,H,C,V] [--dropout 0.0] [--mode bf16c|bf16|tf32c]
                                   [--steps 5] [--top 30] [--ref .devcarry/reference/torch_reference.py]
                                   [--energy_seconds 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import ClockWatch, energy_per_run  # noqa: E402  (NVML, read only)

# the groups of a kernel's name (first match); the rest is "other"
GROUPS = (("attention", r"flash|fmha|attention|sdpa"), ("gemm", r"gemm|xmma|cutlass|nvjet|sm90_|s\d+gemm"),
          ("optimizer", r"adam|multi_tensor|foreach"), ("loss", r"cross_entropy|nll|log_softmax"),
          ("triton", r"^triton_"), ("elementwise", r"elementwise|vectorized|reduce|copy|fill"))


def group(name: str) -> str:
    n = name.lower()
    for g, pat in GROUPS:
        if re.search(pat, n):
            return g
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,1024,12,12,768,50304")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--mode", default="bf16c", choices=("bf16c", "bf16", "tf32c"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--ref", default=".devcarry/reference/torch_reference.py")
    ap.add_argument("--energy_seconds", type=float, default=0.0,
                    help="> 0: also the step's joules and mean power over this long (NVML's energy counter)")
    a = ap.parse_args()
    os.environ["DROPOUT"] = str(a.dropout)
    spec = importlib.util.spec_from_file_location("torch_reference", a.ref)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    import torch
    from torch.profiler import ProfilerActivity, profile

    B, T, L, H, C, V = (int(v) for v in a.shape.split(","))
    bf16, comp = a.mode.startswith("bf16"), a.mode.endswith("c")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    m = ref.GPT(V=V, T=T, C=C, L=L, H=H, sdpa=True).to("cuda")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=True)
    f = torch.compile(m) if comp else m
    idx = torch.randint(0, V, (B, T), device="cuda")
    tgt = torch.randint(0, V, (B, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = f(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(8):
        step()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        step()
    ev[1].record()
    torch.cuda.synchronize()
    print(f"PyTorch {a.mode} B{B} T{T} L{L} H{H} C{C} V{V} dropout {a.dropout}: "
          f"{ev[0].elapsed_time(ev[1]) / 10:.3f} ms/step (mean of 10, unprofiled)")
    if a.energy_seconds > 0:           # the step's joules, as bench/energy.py reads ours
        watch = ClockWatch()
        d = energy_per_run(step, torch.cuda.synchronize, a.energy_seconds)
        print(f"energy: {d['ms']:.3f} ms/step, " + ("no energy counter" if d["mj"] is None else
              f"{d['mj'] / 1e3:.3f} J/step, {d['watts']:.0f} W") + f" ({d['runs']} steps; {watch.stop()})")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    by_kernel, by_group = defaultdict(lambda: [0.0, 0]), defaultdict(float)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time if hasattr(e, "device_time") else e.cuda_time
        by_kernel[e.name][0] += us / 1e3 / a.steps
        by_kernel[e.name][1] += 1
        by_group[group(e.name)] += us / 1e3 / a.steps
    total = sum(by_group.values())
    print(f"kernel time a step {total:.3f} ms ({a.steps} profiled steps)")
    for g, ms in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"  {g:<12} {ms:8.3f} ms  {100 * ms / total:5.1f}%")
    print("by kernel (ms a step, launches a step)")
    for name, (ms, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"  {ms:8.3f} ms {n / a.steps:5.0f}x  {group(name):<10} {name[:150]}")


if __name__ == "__main__":
    main()
