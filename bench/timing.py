"""CUDA-event timing for the benchmarks: bench/common.py's event timing, plus CUDA-graph replay.

    time_ms(rt, fn, warmup=5, iters=50, batch=1) -> median ms of one fn() call
    time_graphed_ms(rt, record_fn, warmup=3, iters=20, reps=10) -> median ms of one record_fn()

fn enqueues device work on rt.stream (a launcher call, rt.run(prog), graph.launch); the samples
are bench.common.event_times_ms's (one pair of events per sample). `batch` back-to-back calls per
sample, or `time_graphed_ms` (reps recorded launches replayed as one CUDA graph: gptcuda/runtime/profile.py
graph_times_ms), time work shorter than the host's launch cost.
"""
from __future__ import annotations

import statistics

from bench.common import event_times_ms, median_ms  # noqa: F401  (re-exported)
from gptcuda.runtime.profile import graph_times_ms


def time_ms(rt, fn, warmup: int = 5, iters: int = 50, batch: int = 1) -> float:
    if batch == 1:
        return median_ms(rt, fn, iters, warmup)

    def many():
        for _ in range(batch):
            fn()
    return statistics.median(event_times_ms(rt, many, iters, warmup)) / batch


def time_graphed_ms(rt, record_fn, warmup: int = 3, iters: int = 20, reps: int = 10) -> float:
    """Median ms of one record_fn() when `reps` of them run back to back inside a CUDA graph."""
    return statistics.median(graph_times_ms(rt, [record_fn], [reps], iters, warmup, "bench")[0])


__all__ = ["time_ms", "time_graphed_ms", "event_times_ms", "median_ms"]
