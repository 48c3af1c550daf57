"""Host cost of one eager launch, and of one kernel inside a replayed CUDA graph.

    python bench/launch.py [--n 20000]

Eager: a prepacked Launch (argument block built once) submitted with cuLaunchKernel in a
Python loop; the host time per call is what a step of many small kernels pays without graphs.
Graph: 200 such launches captured once, the graph replayed; wall time per kernel.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gptcuda.ops.cuda import elementwise  # noqa: E402
from gptcuda.runtime import Runtime  # noqa: E402


def main(argv):
    n = int(argv[argv.index("--n") + 1]) if "--n" in argv else 20000
    rt = Runtime(0)
    x = rt.upload(np.random.default_rng(0).normal(size=1024).astype(np.float32))
    y = rt.empty((1024,))
    prog = rt.begin("one")
    elementwise.gelu_fwd(rt, y, x)
    rt.end()
    rec = prog.items[0]
    dev, stream = rt.dev, rt.stream
    for _ in range(200):
        rec.run(dev, stream)
    rt.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        rec.run(dev, stream)
    eager_us = (time.perf_counter() - t) / n * 1e6
    rt.synchronize()
    many = rt.begin("many")
    many.items.extend([rec] * 200)
    rt.end()
    g = rt.capture(many)
    for _ in range(5):
        g.launch()
    rt.synchronize()
    reps = 100
    t = time.perf_counter()
    for _ in range(reps):
        g.launch()
    rt.synchronize()
    graph_us = (time.perf_counter() - t) / (reps * 200) * 1e6
    print(f"eager launch (host, per call): {eager_us:.2f} us")
    print(f"graph replay (wall, per kernel): {graph_us:.2f} us")


if __name__ == "__main__":
    main(sys.argv[1:])
