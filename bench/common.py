"""Shared by the benchmarks: event timing, SM-clock labels, the median, the --json results file (a case's
device buffers: gptcuda/runtime/profile.py Arena)."""
from __future__ import annotations

import json
import statistics

from gptcuda.runtime.driver import sm_clock_mhz
from gptcuda.runtime.profile import paired_times_ms


def event_times_ms(rt, fn, iters: int, warmup: int = 3) -> list:
    """Time fn() (which enqueues work on rt.stream) with CUDA events, one pair per run."""
    return paired_times_ms(rt, [fn], iters, warmup)[0]


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
