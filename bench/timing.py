"""CUDA-event timing for the benchmarks.

    time_ms(rt, fn, warmup=5, iters=50, batch=1) -> median ms of one fn() call

fn enqueues device work on rt.stream (a launcher call, rt.run(prog), graph.launch). Each of the
`iters` samples is one pair of events around `batch` back-to-back calls, divided by batch, so
work shorter than the host's launch cost can be timed in batches (or captured into a graph
first: `graphed(rt, record_fn, reps)`).
"""
from __future__ import annotations

import statistics


def time_ms(rt, fn, warmup: int = 5, iters: int = 50, batch: int = 1) -> float:
    dev = rt.dev
    for _ in range(warmup):
        fn()
    rt.synchronize()
    events = [(dev.event(), dev.event()) for _ in range(iters)]
    for start, end in events:
        dev.record(start, rt.stream)
        for _ in range(batch):
            fn()
        dev.record(end, rt.stream)
    rt.synchronize()
    return statistics.median(dev.elapsed_ms(s, e) for s, e in events) / batch


def graphed(rt, record_fn, reps: int = 1):
    """Record record_fn() `reps` times into one program, capture it as a CUDA graph and return
    (launch, n_launches): launch() replays all reps with no host work per kernel."""
    prog = rt.begin("bench")
    try:
        for _ in range(reps):
            record_fn()
    finally:
        rt.end()
    graph = rt.capture(prog)
    return graph.launch, len(prog.items)


def time_graphed_ms(rt, record_fn, warmup: int = 3, iters: int = 20, reps: int = 10) -> float:
    """Median ms of one record_fn() when `reps` of them run back to back inside a CUDA graph."""
    launch, _ = graphed(rt, record_fn, reps)
    return time_ms(rt, launch, warmup, iters) / reps


__all__ = ["time_ms", "graphed", "time_graphed_ms"]
