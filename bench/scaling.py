"""Data-parallel scaling: the training step at several world sizes, with its communication time.

    python bench/scaling.py configs/gpt2_124m_t1024.yaml --worlds 1,2,4,8 [--iters 20] [--json F]
                            [--key=value ...]

For each world size W (up to the GPUs visible) it starts W ranks with gptcuda.launch; each rank
builds the engine (batch_size rows per GPU: weak scaling, the global batch grows with W), replays
the captured step `--warmup` times, then `--iters` times with CUDA events around each step on the
main stream and, inside the graph, around every collective on the communication stream. Rank 0
reports the median of:

    ms/step       the step on the main stream (events), the GPU idle before and after it
    comm busy     the sum of the collectives' times on the communication stream (loss mean and
                  gradient buckets; with zero=1 the reduce-scatter, norm partials and all-gather,
                  which run on the main stream)
    exposed       how long the main stream waited for the communication stream at the end of the
                  backward (0 when the last bucket finished in the shadow of the backward)
    tok/s         global tokens per second; efficiency = tok/s(W) / (W x tok/s(1))

W = 1 is the single-GPU step (no NCCL); GPTCUDA_BUCKET_MB sets the bucket size.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import visible_gpus  # noqa: E402
from gptcuda.cli import split_args  # noqa: E402


def worker(path, overrides, iters, warmup, out):
    """One rank (started by gptcuda.launch)."""
    from gptcuda import dist
    from gptcuda.config import load_config
    from gptcuda.training.engine import Engine
    from gptcuda.training.trainer import open_run_data
    cfg = load_config(path, overrides + ["--max_iters=100000"])
    env = dist.parse_env()
    group = None
    if env.enabled:
        cfg.device = env.local_rank
        group = dist.init_group(env)
        group.comm_timing = True
    W = group.world_size if group is not None else 1
    data, V, accum = open_run_data(cfg, W)
    eng = Engine(cfg, data.train, data.val, V, programs=("train",), group=group, n_vocab=data.vocab_size,
                 accum=accum)
    rt, dev = eng.be.rt, eng.be.rt.dev
    for _ in range(warmup):
        eng.train_step()
    rt.synchronize()
    start, stop = dev.event(), dev.event()
    step_ms, busy, exposed = [], [], []
    for _ in range(iters):
        dev.record(start, rt.stream)
        eng.train_step()
        dev.record(stop, rt.stream)
        rt.synchronize()
        step_ms.append(dev.elapsed_ms(start, stop))
        if eng.dp is not None:
            t = eng.dp.comm_times()
            busy.append(t["busy"])
            exposed.append(t.get("exposed", 0.0))
    tokens = W * accum * cfg.batch_size * cfg.block_size
    ms = statistics.median(step_ms)
    res = {"world": W, "ms": ms, "ms_all": step_ms, "tok_s": tokens / ms * 1e3,
           "comm_busy_ms": statistics.median(busy) if busy else 0.0,
           "exposed_ms": statistics.median(exposed) if exposed else 0.0,
           "n_params": eng.table.n_params, "batch_per_gpu": cfg.batch_size, "block": cfg.block_size,
           "zero": cfg.zero, "precision": cfg.precision,
           "buckets": len(eng.dp.buckets) if eng.dp is not None else 0,
           "describe": eng.dp.describe() if eng.dp is not None else "one GPU, no NCCL",
           "loss_last": eng.state()["loss"]}
    if group is None or group.is_main:
        with open(out, "w") as f:
            json.dump(res, f)
    if group is not None:
        group.close()


def main(argv):
    path, overrides, flags, opts = split_args(argv, flags=("worker",),
                                              options=("worlds", "iters", "warmup", "json", "out"))
    iters, warmup = int(opts.get("iters", 20)), int(opts.get("warmup", 5))
    if "worker" in flags:
        worker(path, overrides, iters, warmup, opts["out"])
        return 0
    worlds = [int(w) for w in opts.get("worlds", "1,2,4,8").split(",")]
    have = visible_gpus()
    here = os.path.abspath(__file__)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for W in worlds:
            if W > have:
                print(f"world {W}: skipped, {have} GPU(s) visible")
                continue
            out = os.path.join(tmp, f"w{W}.json")
            cmd = [sys.executable, "-m", "gptcuda.launch", "--nproc", str(W), here, path, *overrides,
                   "--worker", f"--out={out}", f"--iters={iters}", f"--warmup={warmup}"]
            p = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(here)))
            if p.returncode != 0 or not os.path.exists(out):
                print(f"world {W}: failed (exit {p.returncode})")
                continue
            with open(out) as f:
                rows.append(json.load(f))
    if not rows:
        return 1
    base = next((r["tok_s"] for r in rows if r["world"] == 1), None)
    r0 = rows[0]
    print(f"\n{r0['n_params'] / 1e6:.1f}M parameters, {r0['precision']}, {r0['batch_per_gpu']} x {r0['block']} tokens "
          f"per GPU, zero={r0['zero']}, {iters} timed steps (median)")
    print(f"{'GPUs':>4} {'ms/step':>9} {'comm busy':>10} {'exposed':>9} {'tok/s':>12} {'tok/s/GPU':>11} {'eff.':>6}")
    for r in rows:
        eff = f"{100 * r['tok_s'] / (r['world'] * base):5.1f}%" if base else "   -"
        print(f"{r['world']:>4} {r['ms']:9.2f} {r['comm_busy_ms']:10.2f} {r['exposed_ms']:9.2f} "
              f"{r['tok_s']:12,.0f} {r['tok_s'] / r['world']:11,.0f} {eff:>6}")
    for r in rows:
        print(f"  {r['world']}: {r['describe']}")
    if "json" in opts:
        with open(opts["json"], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
