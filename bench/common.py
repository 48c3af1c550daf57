"""Shared by the benchmarks: event timing, SM-clock labels, the median, device buffers of a case,
the --json results file."""
from __future__ import annotations

import json
import statistics

import numpy as np

from gptcuda.runtime.driver import sm_clock_mhz
from gptcuda.runtime import DeviceView


def event_times_ms(rt, fn, iters: int, warmup: int = 3) -> list:
    """Time fn() (which enqueues work on rt.stream) with CUDA events, one pair per run."""
    dev = rt.dev
    for _ in range(warmup):
        fn()
    rt.synchronize()
    evs = [(dev.event(), dev.event()) for _ in range(iters)]
    for a, b in evs:
        dev.record(a, rt.stream)
        fn()
        dev.record(b, rt.stream)
    rt.synchronize()
    return [dev.elapsed_ms(a, b) for a, b in evs]


def median_ms(rt, fn, iters: int = 50, warmup: int = 5) -> float:
    return statistics.median(event_times_ms(rt, fn, iters, warmup))


class ClockWatch:
    """Read the SM clock before and after a timed region; label the result THROTTLED if it moved."""

    def __init__(self, ordinal: int = 0):
        self.ordinal = ordinal
        self.before = sm_clock_mhz(ordinal)
        self.after = None

    def stop(self) -> str:
        self.after = sm_clock_mhz(self.ordinal)
        if self.before is None or self.after is None:
            return "clock: unknown (no NVML)"
        return f"SM clock {self.before} -> {self.after} MHz" + ("  THROTTLED" if self.moved else "")

    @property
    def moved(self) -> bool:
        """Any change counts: a clock that moved during a timed region makes its numbers suspect."""
        return self.before is not None and self.after is not None and self.after != self.before


class Arena:
    """f32 device buffers of one case, freed together (so the next case starts from a clean device)."""

    def __init__(self, rt):
        self.rt, self.ptrs = rt, []

    def empty(self, shape, name: str = "bench") -> DeviceView:
        shape = tuple(int(s) for s in shape)
        n = max(1, int(np.prod(shape)))
        ptr = self.rt.dev.malloc(4 * n)
        self.ptrs.append(ptr)
        return DeviceView(ptr, shape, "f32", name)

    def upload(self, arr, name: str = "bench") -> DeviceView:
        v = self.empty(arr.shape, name)
        self.rt.write(v, arr)
        return v

    def free(self):
        self.rt.synchronize()
        for p in self.ptrs:
            self.rt.dev.free(p)
        self.ptrs.clear()


def write_results(path, results) -> None:
    """Write the result rows to `path` as indented JSON; nothing when path is empty (no --json)."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def visible_gpus() -> int:
    """How many GPUs the driver sees (0 without a driver or a GPU)."""
    from gptcuda.runtime.driver import NoDeviceError, _load, call
    try:
        drv = _load()
        call(drv.cuInit, 0)
        return int(call(drv.cuDeviceGetCount))
    except (NoDeviceError, Exception):
        return 0
