"""Shared by the benchmarks: event timing, SM-clock labels, the median, the --json results file (a case's
device buffers: gptcuda/runtime/profile.py Arena)."""
from __future__ import annotations

import json
import math
import statistics
import time

from gptcuda.runtime.driver import nvml_read, sm_clock_mhz
from gptcuda.runtime.profile import captured, paired_times_ms

REPLAY_MS = 5.0          # energy_graphed repeats a call in one graph until a replay lasts about this long


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


def energy_mj(ordinal: int = 0):
    """The board's energy counter through NVML (mJ since the driver loaded; driver.nvml_read) where the board
    keeps one, else None. Read only."""
    return nvml_read(lambda nv, h: int(nv.nvmlDeviceGetTotalEnergyConsumption(h)), ordinal)


def energy_per_run(run, sync, seconds: float, read=energy_mj, clock=time.perf_counter) -> dict:
    """The time and energy of one run() (work it enqueues; sync() waits for it): one run timed alone (after
    a warm-up run) sizes a batch of at least `seconds` (3 runs or more), enqueued at once between two
    readings of the energy counter (read(): mJ, or None). {"runs", "ms", "mj", "watts"}: means over the
    batch, mj and watts None without a counter. A run that keeps the GPU busy for less than its own host
    time (a launch's ~µs) counts idle time too: give it enough work (bench/energy.py repeats a launch)."""
    run()
    sync()
    t0 = clock()
    run()
    sync()
    runs = max(3, math.ceil(seconds / max(clock() - t0, 1e-6)))
    e0, t0 = read(), clock()
    for _ in range(runs):
        run()
    sync()
    wall, e1 = clock() - t0, read()
    mj = None if e0 is None or e1 is None else (e1 - e0) / runs
    return {"runs": runs, "ms": 1e3 * wall / runs, "mj": mj,
            "watts": None if mj is None else mj * runs / 1e3 / wall}


def repeats_for(ms: float) -> int:
    """How many calls of `ms` go into one graph so that a replay lasts ~REPLAY_MS (1 to 4096)."""
    return max(1, min(4096, math.ceil(REPLAY_MS / max(ms, 1e-4))))


def per_call(d: dict, calls: int) -> dict:
    """energy_per_run's dict of a run of `calls` calls, as one call's (the mean power unchanged)."""
    return {"runs": d["runs"], "ms": d["ms"] / calls, "mj": None if d["mj"] is None else d["mj"] / calls,
            "watts": d["watts"]}


def energy_cell(d: dict) -> str:
    """A launch's energy as the GEMM tables print it beside its time: " [mJ W]" (energy_per_run's dict)."""
    return " [no energy counter]" if d["mj"] is None else f" [{d['mj']:.2f} mJ {d['watts']:.0f} W]"


def energy_graphed(rt, record_fn, ms: float, seconds: float, **meter) -> dict:
    """The time and energy of one record_fn() (launches on rt's stream; ms: about its time): repeated in one
    CUDA graph to a ~REPLAY_MS replay, replayed for at least `seconds` (energy_per_run, given `meter`: its
    read and clock), as one call's."""
    reps = repeats_for(ms)

    def record():
        for _ in range(reps):
            record_fn()

    replay, destroy = captured(rt, record)
    try:
        return per_call(energy_per_run(replay, rt.synchronize, seconds, **meter), reps)
    finally:
        destroy()


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
