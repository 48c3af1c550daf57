"""Time the training step and show where its time goes.

    python bench/step.py configs/shakespeare_char_fp32.yaml [--key=value ...] [--iters 50]
    python bench/step.py configs/gpt2_124m.yaml --total_batch_tokens=0 --batch_size=16

Every override counts, as in train.py (the data, its tokenizer, vocab_size / vocab_multiple, the
micro-batches of total_batch_tokens). Prints the median ms/step and tokens/s of whole steps as
training runs them (the host gathers and queues the batch, then the step's CUDA graph is
replayed; and with eager launches), the host time per step, then a phase table: every launch of
one step timed with CUDA events captured between the kernels (inside a graph, so no host gaps),
summed by kernel, by group (GEMM, attention, layernorm, ...) and by launch label (--labels N: the N
largest; 0: none).

--profile: then one more eager step between cuProfilerStart and cuProfilerStop, for a profiler started
with its collection off (`ncu --profile-from-start off ...`: bench/profile_step.sh): the step's launches
alone, not the setup's or the GEMM tuner's. --timeline FILE: each launch's start and end (ms) in a replay
of the step's graph, a line each: start end label kernel (runtime/profile.py timeline); printed: its span,
busy time, gaps and the labels with the most in-graph time (timeline_summary).
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import ClockWatch, event_times_ms  # noqa: E402
from gptcuda.cli import split_args  # noqa: E402
from gptcuda.config import load_config  # noqa: E402
from gptcuda.training.engine import Engine  # noqa: E402
from gptcuda.runtime.profile import phase_table, timeline, timeline_summary  # noqa: E402
from gptcuda.training.trainer import open_run_data  # noqa: E402

def host_ms(rt, fn, reps=7):
    """Host time to submit one step, from an idle queue (so that no back-pressure is counted)."""
    ts = []
    for _ in range(reps):
        rt.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    rt.synchronize()
    return statistics.median(ts)


def main(argv):
    path, overrides, flags, opts = split_args(argv, flags=("profile",),
                                              options=("iters", "json", "labels", "timeline"))
    iters = int(opts.get("iters", 50))
    cfg = load_config(path, overrides + ["--max_iters=100000"])
    data, V, accum = open_run_data(cfg)
    eng = Engine(cfg, data.train, data.val, V, programs=("train",), n_vocab=data.vocab_size, accum=accum)
    rt = eng.be.rt
    tokens = accum * cfg.batch_size * cfg.block_size
    if "train" not in eng.graphs:
        eng.graphs["train"] = eng.be.capture(eng.programs["train"])

    def eager_step():
        eng.feed("train", eng.counters["step"])
        eng.be.run(eng.programs["train"])
        eng.counters["step"] += 1

    watch = ClockWatch(cfg.device)
    t_graph = event_times_ms(rt, eng.train_step, iters, warmup=5)
    host_graph = host_ms(rt, eng.train_step)
    t_eager = event_times_ms(rt, eager_step, max(iters // 2, 5), warmup=3)
    host_eager = host_ms(rt, eager_step)
    clock = watch.stop()
    mg, me = statistics.median(t_graph), statistics.median(t_eager)
    print(f"{cfg.precision} attention={cfg.attention} B{cfg.batch_size} T{cfg.block_size} "
          f"L{cfg.n_layer} C{cfg.n_embd} V{V} (tokenizer {data.vocab_size}) dropout {cfg.dropout}"
          + (f", {accum} micro-batches" if accum > 1 else "") + f": {len(eng.programs['train'])} launches/step")
    print(f"graph : {mg:8.3f} ms/step  {tokens / mg * 1e3:12,.0f} tok/s   host {host_graph:.3f} ms/step "
          f"({100 * host_graph / mg:.1f}% of the step)")
    print(f"eager : {me:8.3f} ms/step  {tokens / me * 1e3:12,.0f} tok/s   host {host_eager:.3f} ms/step")
    print(clock)
    print()
    print(phase_table(rt, eng.programs["train"], by_label=int(opts.get("labels", 30))))
    if "profile" in flags:
        from cuda.bindings import driver as cu
        from gptcuda.runtime.driver import call
        rt.synchronize()
        call(cu.cuProfilerStart)
        eager_step()
        rt.synchronize()
        call(cu.cuProfilerStop)
    if "timeline" in opts:             # each launch's start and end in a graph replay (profile.timeline)
        rows = timeline(rt, eng.programs["train"])
        with open(opts["timeline"], "w") as f:
            for rec, t0, t1 in rows:
                f.write(f"{t0:.4f} {t1:.4f} {rec.label.replace(' ', '_')} {rec.fn.name.split('<')[0]}\n")
        print(timeline_summary(rows))
    if "json" in opts:
        with open(opts["json"], "w") as f:
            json.dump({"config": cfg.to_dict(), "vocab": V, "accum": accum, "graph_ms": mg, "eager_ms": me,
                       "host_graph_ms": host_graph,
                       "clock": clock}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
