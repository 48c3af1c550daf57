"""Where a training step's energy goes: the step's joules and mean power, then each launch label's (a GEMM's
shape and role, as bench/step.py's phase table groups them), from the board's energy counter (NVML). Where a
step runs at the board's power cap (GPT-2 B16 bf16 on the H200 and the H100), its time is its energy over
the cap, so the labels that take more joules than their share of time are the ones to make cheaper.

    python3 bench/energy.py configs/gpt2_124m.yaml --data=DIR --val_data= --total_batch_tokens=0 --batch_size=16
                            [--seconds 2] [--label_seconds 1] [--top 40]

Every override counts, as in train.py. The step: its CUDA graph replayed (the host feeding each batch) for at
least --seconds; a label: its launches of one step, in program order, captured together in a graph repeated
until a replay lasts ~5 ms, replayed for at least --label_seconds: the label's work alone, not beside its
neighbours in the step (the clock it runs at is its own). Both between two readings of NVML's energy counter
(bench/common.energy_per_run). Printed: the idle board's power, the step's ms, J and W, and the labels by
joules a step with their ms, mean W and share of the labels' joules. Read only: no clock or power setting.
The replays rerun in-place kernels (the optimizer, the loss's gradient) many times: the run's state is not
a training state after it.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import ClockWatch, energy_graphed, energy_mj, energy_per_run  # noqa: E402
from gptcuda.cli import split_args  # noqa: E402
from gptcuda.config import load_config  # noqa: E402
from gptcuda.runtime.profile import kernel_name, launch_label, launch_times, ordering_record  # noqa: E402
from gptcuda.training.engine import Engine  # noqa: E402
from gptcuda.training.trainer import open_run_data  # noqa: E402


def label_groups(items) -> dict:
    """{label: [records]} of a program's launches in program order, the stream's ordering records and NCCL's
    left out (alone they wait on nothing, or on peers)."""
    groups = {}
    for rec in items:
        if not ordering_record(rec):
            groups.setdefault(launch_label(rec), []).append(rec)
    return groups


def energy_table(step: dict, idle_w, rows, top: int = 40) -> str:
    """The report: step = energy_per_run's dict for one step; rows = [(label, kernel names, energy_per_run's
    dict scaled to one step)], printed by joules a step (by time where the counter is missing)."""
    def j(d):
        return "    -   " if d["mj"] is None else f"{d['mj'] / 1e3:8.3f}"

    def w(d):
        return "   - " if d["watts"] is None else f"{d['watts']:5.0f}"

    out = ["idle board: " + ("no energy counter" if idle_w is None else f"{idle_w:.0f} W"),
           f"step: {step['ms']:8.3f} ms {j(step)} J {w(step)} W  ({step['runs']} steps)"]
    total_mj = sum(d["mj"] or 0.0 for _, _, d in rows)
    total_ms = sum(d["ms"] for _, _, d in rows)
    out.append(f"labels alone: {total_ms:8.3f} ms {total_mj / 1e3:8.3f} J a step (each replayed apart)")
    out.append("      ms        J      W    %J  label | kernels")
    key = (lambda r: -(r[2]["mj"] or 0.0)) if total_mj else (lambda r: -r[2]["ms"])
    for label, names, d in sorted(rows, key=key)[:top]:
        share = f"{100 * d['mj'] / total_mj:5.1f}" if total_mj and d["mj"] is not None else "    -"
        out.append(f"  {d['ms']:8.3f} {j(d)} {w(d)} {share}  {label} | {' '.join(sorted(names))}")
    return "\n".join(out)


def idle_watts(seconds: float = 1.0):
    """The board's mean power over `seconds` of this process sleeping (None without the counter)."""
    e0 = energy_mj()
    time.sleep(seconds)
    e1 = energy_mj()
    return None if e0 is None or e1 is None else (e1 - e0) / seconds / 1e3


def main(argv):
    path, overrides, flags, opts = split_args(argv, options=("seconds", "label_seconds", "top"))
    if "help" in flags or path is None:
        print(__doc__)
        return
    cfg = load_config(path, overrides + ["--max_iters=100000"])
    data, V, accum = open_run_data(cfg)
    eng = Engine(cfg, data.train, data.val, V, programs=("train",), n_vocab=data.vocab_size, accum=accum)
    rt = eng.be.rt
    prog = eng.programs["train"]
    if "train" not in eng.graphs:
        eng.graphs["train"] = eng.be.capture(prog)
    idle_w = idle_watts()
    watch = ClockWatch(cfg.device)
    step = energy_per_run(eng.train_step, rt.synchronize, float(opts.get("seconds", 2.0)))
    clock = watch.stop()
    ms_of = {}
    for rec, ms in launch_times(rt, prog):
        ms_of[id(rec)] = ms_of.get(id(rec), 0.0) + ms
    rows = []
    for label, recs in label_groups(prog.items).items():
        def record(recs=recs):
            for r in recs:
                r.run(rt.dev, rt.stream)

        d = energy_graphed(rt, record, sum(ms_of.get(id(r), 0.0) for r in recs),
                           float(opts.get("label_seconds", 1.0)))
        rows.append((label, {kernel_name(r) for r in recs}, d))
    print(f"{cfg.precision} B{cfg.batch_size} T{cfg.block_size} L{cfg.n_layer} C{cfg.n_embd} V{V}: "
          f"{len(prog)} launches a step; {clock} (the step's replays)")
    print(energy_table(step, idle_w, rows, int(opts.get("top", 40))))


if __name__ == "__main__":
    main(sys.argv[1:])
