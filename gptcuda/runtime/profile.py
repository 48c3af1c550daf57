"""Timing on the device.

Where a step's time goes: every launch of a program timed by CUDA events captured between the kernels
inside a graph (so no host gaps are counted), summed by kernel and by group (`phase_table`: `train.py
--profile`, bench/step.py).

Timing alternatives against each other (the GEMM tuner, ops/cuda/gemm/tune.py, and the benchmarks):
`build_ahead` compiles the kernels they ask for at once, first; `paired_times_ms` times runs between CUDA
events in an order rotated each round, `graph_times_ms` runs of launches recorded `reps` times into one
CUDA graph (`reps_for`: how many fill a window), `fastest` picks one; an `Arena` holds a case's device
buffers (operands filled with noise) and frees them together; `download_ends` reads back part of a large
output and `rel_err` compares it with another's."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

import numpy as np

from gptcuda.runtime import bf16
from gptcuda.runtime.core import DeviceView

GROUPS = {"gemm_simt": "GEMM", "gemm_tf32": "GEMM", "attention": "attention", "flash": "attention",
          "layernorm": "layernorm", "elementwise": "elementwise", "loss": "loss", "optim": "optimizer",
          "encoder": "embedding"}


def captured(rt, record):
    """record() (launches on rt's stream) captured into a graph: (replay(), destroy()) of it."""
    dev = rt.dev
    dev.begin_capture(rt.stream)
    try:
        record()
    finally:
        graph, exe = dev.end_capture(rt.stream)
    return (lambda: dev.graph_launch(exe, rt.stream)), (lambda: dev.graph_destroy(graph, exe))


def kernel_name(rec) -> str:
    """A launch's kernel's name; a memset's "memset"."""
    fn = getattr(rec, "fn", None)
    return fn.name if fn is not None else "memset"


def ordering_record(rec) -> bool:
    """A program record that orders streams or talks to peers (stream waits and events, NCCL), not a kernel
    or a memset: alone it waits on nothing, or on other ranks."""
    fn = getattr(rec, "fn", None)
    return fn is not None and fn.file in ("stream", "nccl")


def launch_label(rec) -> str:
    """A launch's label (a GEMM's is its shape and role), else its kernel's name (kernel_name)."""
    return getattr(rec, "label", None) or kernel_name(rec)


def _replay_medians(rt, record, pairs, iters: int) -> list:
    """Capture record() (launches, and timing events recorded as graph nodes) from rt's stream into a graph,
    replay it iters times; the median ms from a to b of each event pair (a, b) in pairs. The graph and the
    pairs' events are destroyed after."""
    dev = rt.dev
    replay, destroy = captured(rt, record)
    per = [[] for _ in pairs]
    for _ in range(iters):
        replay()
        rt.synchronize()
        for t, (a, b) in zip(per, pairs):
            t.append(dev.elapsed_ms(a, b))
    destroy()
    for ev in {id(e): e for pair in pairs for e in pair}.values():
        dev.event_destroy(ev)
    return [statistics.median(t) for t in per]


def launch_times(rt, prog, iters: int = 5):
    """[(record, median ms)] for each launch of prog: from an event before it to one before the next."""
    dev = rt.dev
    events = [dev.event() for _ in range(len(prog.items) + 1)]

    def record():
        for ev, rec in zip(events, prog.items):
            dev.record(ev, rt.stream, external=True)
            rec.run(dev, rt.stream)
        dev.record(events[-1], rt.stream, external=True)

    return list(zip(prog.items, _replay_medians(rt, record, list(zip(events, events[1:])), iters)))


def timeline(rt, prog, iters: int = 3) -> list:
    """[(record, start ms, end ms)] of each launch of prog as a captured graph runs them: timing events
    recorded before and after each, times from an event at the graph's start, the median over iters
    replays (the events add ~1-2 us a launch: the gaps they show are upper bounds)."""
    dev = rt.dev
    base = dev.event()
    marks = {i: (dev.event(), dev.event()) for i, rec in enumerate(prog.items)
             if getattr(rec, "fn", None) is not None and not ordering_record(rec)}

    def record():
        dev.record(base, rt.stream, external=True)
        for i, rec in enumerate(prog.items):
            if i in marks:
                dev.record(marks[i][0], rt.stream, external=True)
            rec.run(dev, rt.stream)
            if i in marks:
                dev.record(marks[i][1], rt.stream, external=True)

    ms = _replay_medians(rt, record, [(base, e) for pair in marks.values() for e in pair], iters)
    return [(prog.items[i], ms[2 * k], ms[2 * k + 1]) for k, i in enumerate(marks)]


def _by_label(rows) -> list:
    """[(label, ms, launches, kernel names)] of [(record, ms)] summed by launch label (a record without one:
    its kernel's name; a memset: "memset"), the most time first."""
    labels = defaultdict(lambda: [0.0, 0, set()])
    for rec, ms in rows:
        e = labels[launch_label(rec)]
        e[0] += ms
        e[1] += 1
        e[2].add(kernel_name(rec))
    return sorted(((lab, ms, n, names) for lab, (ms, n, names) in labels.items()), key=lambda t: -t[1])


def timeline_summary(rows, top: int = 12) -> str:
    """A timeline's (profile.timeline's [(record, start ms, end ms)]) totals: its span, the launches' busy
    time, the gaps between one launch's end and the next one's start, and the `top` labels by their
    summed in-graph time (launches, ms)."""
    if not rows:
        return "timeline: no launches"
    busy = sum(t1 - t0 for _, t0, t1 in rows)
    gaps = sum(max(0.0, b[1] - a[2]) for a, b in zip(rows, rows[1:]))
    out = [f"timeline: {len(rows)} launches over {rows[-1][2] - rows[0][1]:.3f} ms, busy {busy:.3f} ms, gaps "
           f"{gaps:.3f} ms (the timing events' own cost included)"]
    out += [f"  {ms:8.3f} ms {n:4d}x  {lab}" for lab, ms, n, _ in _by_label([(r, t1 - t0) for r, t0, t1 in rows])[:top]]
    return "\n".join(out)


def phase_table(rt, prog, iters: int = 5, top: int = 25, by_label: int = 0) -> str:
    """The launches' times summed by group and by kernel (the `top` largest); by_label > 0: also
    by launch label (a GEMM's is its shape and role, e.g. "matmul[8192x768x3072]:A^T"), the
    by_label largest, with each label's kernels."""
    rows = launch_times(rt, prog, iters)
    by_kernel, by_group = defaultdict(lambda: [0.0, 0]), defaultdict(float)
    for rec, ms in rows:
        fn = getattr(rec, "fn", None)
        file, name = (fn.file, fn.name) if fn is not None else ("memset.cu", "memset")
        by_kernel[(file, name)][0] += ms
        by_kernel[(file, name)][1] += 1
        stem = file[:-3] if file.endswith(".cu") else file
        stem = "flash" if stem.startswith("flash_") else stem          # flash_*.cu: one family
        by_group[GROUPS.get(stem, stem)] += ms
    total = sum(ms for _, ms in rows)
    out = [f"phase table: {len(rows)} launches, sum of per-launch times {total:.3f} ms"]
    for g, ms in sorted(by_group.items(), key=lambda kv: -kv[1]):
        out.append(f"  {g:<14} {ms:8.3f} ms  {100 * ms / total:5.1f}%")
    out.append("by kernel")
    for (file, name), (ms, cnt) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"  {ms:8.3f} ms {cnt:4d}x  {file}:{name}")
    if by_label:
        out.append("by label")
        for lab, ms, cnt, names in _by_label(rows)[:by_label]:
            out.append(f"  {ms:8.3f} ms {cnt:4d}x  {lab:<40} {' | '.join(sorted(names))}")
    return "\n".join(out)


# ---- timing alternatives ---------------------------------------------------------------
def build_ahead(rt, runs, build, bar) -> list:
    """Per run of `runs` (callables that launch), whether every kernel it asks for compiled: the kernels
    noted (rt.noting: nothing compiled, recorded or run), then compiled at once by `build` (compiler.build_all's
    interface: the jobs and progress(n) -> the indices that failed) with a progress bar `bar(total)`."""
    asked = []
    for run in runs:
        with rt.noting() as noted:
            run()
        asked.append(noted)
    jobs = list(dict.fromkeys(k for ks in asked for k in ks))
    with bar(len(jobs)) as line:
        bad = {jobs[i] for i in build([(f, n, dict(d), a) for f, n, d, a in jobs], lambda n: line.update(n - line.n))}
    return [bad.isdisjoint(ks) for ks in asked]


def reps_for(target_ms: float, est_ms: float, lo: int = 1, hi: int = 64) -> int:
    """How many runs of about est_ms each fill target_ms, within lo .. hi."""
    return int(min(hi, max(lo, math.ceil(target_ms / max(est_ms, 1e-4)))))


def paired_times_ms(rt, runs, rounds: int, warmup: int = 1) -> list:
    """[per run its `rounds` times in ms]: each of `runs` (callables that enqueue work on rt.stream) run
    `warmup` times, then `rounds` rounds of each once between a pair of CUDA events, in an order rotated
    each round (so all see the same clocks). The events are destroyed, also on an error."""
    dev, evs = rt.dev, []
    try:
        for _ in range(warmup):
            for run in runs:
                run()
        rt.synchronize()
        for r in range(rounds):
            for i in [(i + r) % len(runs) for i in range(len(runs))]:
                e0, e1 = dev.event(), dev.event()
                evs.append((i, e0, e1))
                dev.record(e0, rt.stream)
                runs[i]()
                dev.record(e1, rt.stream)
        rt.synchronize()
        times = [[] for _ in runs]
        for i, e0, e1 in evs:
            times[i].append(dev.elapsed_ms(e0, e1))
        return times
    finally:
        for _, e0, e1 in evs:
            dev.event_destroy(e0)
            dev.event_destroy(e1)


def graph_times_ms(rt, runs, reps, rounds: int, warmup: int = 1, name: str = "timed") -> list:
    """[per run its `rounds` times in ms, of one run each]: run i (a callable that records launches) recorded
    reps[i] times into a program captured as a CUDA graph (replayed with no host work per kernel), the graphs
    replayed `warmup` times (module load, clocks) and timed paired (`paired_times_ms`), then destroyed, also
    on an error."""
    graphs = []
    try:
        for run, n in zip(runs, reps):
            prog = rt.begin(name)
            try:
                for _ in range(n):
                    run()
            finally:
                rt.end()
            graphs.append(rt.capture(prog))
        times = paired_times_ms(rt, [graph.launch for graph in graphs], rounds, warmup)
        return [[t / n for t in ts] for ts, n in zip(times, reps)]
    finally:
        rt.synchronize()
        for graph in graphs:
            graph.destroy()


def fastest(samples, ok=None) -> tuple:
    """(per run the median of its times, inf without any; the index of the fastest run whose output agreed,
    ok None: any run's; ties: the earlier; None: none)."""
    times = [statistics.median(s) if s else math.inf for s in samples]
    fine = [i for i, t in enumerate(times) if math.isfinite(t) and (ok is None or ok[i])]
    return times, (min(fine, key=lambda i: times[i]) if fine else None)


# noise operands repeat a window of one draw this long: no factor below 2048, so no two rows of a matrix
# repeat (a wrong row or k offset shows), and the host never holds a whole operand
NOISE_BLOCK = (1 << 22) - 3


class Arena:
    """Device buffers of one case, freed together (free(): the next case starts from a clean device).
    `noise` fills one with a window of standard normal noise, drawn once from `seed` (bf16: as bit patterns)."""

    def __init__(self, rt, name: str = "arena", seed: int = 0):
        self.rt, self.name, self.ptrs = rt, name, []
        self.rng, self._noise = np.random.default_rng(seed), None

    def empty(self, shape, dtype: str = "f32", name: str = "") -> DeviceView:
        v = DeviceView(0, tuple(int(s) for s in shape), dtype, name or self.name)
        self.ptrs.append(self.rt.dev.malloc(max(1, v.nbytes)))
        return DeviceView(self.ptrs[-1], v.shape, dtype, v.name)

    def upload(self, arr, name: str = "") -> DeviceView:
        """A new f32 buffer holding arr."""
        v = self.empty(np.shape(arr), name=name)
        self.rt.write(v, arr)
        return v

    def noise(self, shape, dtype: str = "f32") -> DeviceView:
        if self._noise is None:
            self._noise = self.rng.standard_normal(2 * NOISE_BLOCK, dtype=np.float32)
        v = self.empty(shape, dtype)
        start = int(self.rng.integers(NOISE_BLOCK))
        block = self._noise[start:start + min(v.numel, NOISE_BLOCK)]
        block = bf16.bits(block) if dtype == "bf16" else block
        for off in range(0, v.numel, NOISE_BLOCK):
            m = min(NOISE_BLOCK, v.numel - off)
            self.rt.write(DeviceView(v.ptr + v.itemsize * off, (m,), dtype, v.name), block[:m])
        return v

    def free(self):
        self.rt.synchronize()
        for p in self.ptrs:
            self.rt.dev.free(p)
        self.ptrs.clear()


def download_ends(rt, view, limit: int | None = None) -> np.ndarray:
    """view's elements, flat, as values (bf16 widened): all, or where there are more than `limit`, the first
    and the last limit // 2 (comparing outputs without reading back all of a large one)."""
    n = view.numel
    if limit is None or n <= limit:
        got = rt.download(view).reshape(-1)
    else:
        got = np.concatenate([rt.download(DeviceView(view.ptr + view.itemsize * at, (limit // 2,), view.dtype,
                                                     "part")) for at in (0, n - limit // 2)])
    return bf16.values(got) if view.dtype == "bf16" else got


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref| in float64; inf where got is not all finite."""
    got = np.asarray(got, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
