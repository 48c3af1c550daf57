"""Where a step's time goes: every launch of a program timed by CUDA events captured between
the kernels inside a graph (so no host gaps are counted), summed by kernel and by group.
Used by `train.py --profile` and bench/step.py."""
from __future__ import annotations

import statistics
from collections import defaultdict

GROUPS = {"gemm_simt": "GEMM", "gemm_tf32": "GEMM", "attention": "attention", "flash": "attention",
          "layernorm": "layernorm", "elementwise": "elementwise", "loss": "loss", "optim": "optimizer",
          "encoder": "embedding"}


def launch_times(rt, prog, iters: int = 5):
    """[(record, median ms)] for each launch of prog."""
    dev = rt.dev
    events = [dev.event() for _ in range(len(prog.items) + 1)]
    dev.begin_capture(rt.stream)
    try:
        for ev, rec in zip(events, prog.items):
            dev.record(ev, rt.stream, external=True)
            rec.run(dev, rt.stream)
        dev.record(events[-1], rt.stream, external=True)
    finally:
        graph, exe = dev.end_capture(rt.stream)
    per = [[] for _ in prog.items]
    for _ in range(iters):
        dev.graph_launch(exe, rt.stream)
        rt.synchronize()
        for i in range(len(prog.items)):
            per[i].append(dev.elapsed_ms(events[i], events[i + 1]))
    dev.graph_destroy(graph, exe)
    return [(rec, statistics.median(t)) for rec, t in zip(prog.items, per)]


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
        labels = defaultdict(lambda: [0.0, 0, set()])
        for rec, ms in rows:
            fn = getattr(rec, "fn", None)
            e = labels[getattr(rec, "label", None) or (fn.name if fn is not None else "memset")]
            e[0] += ms
            e[1] += 1
            e[2].add(fn.name if fn is not None else "memset")
        out.append("by label")
        for lab, (ms, cnt, names) in sorted(labels.items(), key=lambda kv: -kv[1][0])[:by_label]:
            out.append(f"  {ms:8.3f} ms {cnt:4d}x  {lab:<40} {' | '.join(sorted(names))}")
    return "\n".join(out)
