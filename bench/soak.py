"""Kill -9 a training at random points, resume it each time: does it end where an uninterrupted run ends?

    python bench/soak.py --data DIR [--config configs/gpt2_124m.yaml] [--kills 5] [--seed 1]
                         [--out out/soak] [--key=value ...]

Trains CONFIG (with the --key=value overrides) straight into OUT/straight, then into OUT/soak as train.py
processes that are sent SIGKILL at `--kills` random points, each chosen among three kinds (the first three
kills take one of each): inside a training step (the step's program launched: on the GPU its micro-batches
are running), inside an evaluation, and inside a checkpoint write (the temporary file written, not yet
renamed). After each kill the next process continues the run (--resume; a plain start where no checkpoint
was saved yet), the last one to the end. Then compares OUT/soak with OUT/straight: last.ckpt and best.ckpt
(every array, and the metadata but for out_dir) and metrics.jsonl (every record without its timings: ms,
tok_s, mfu). Prints each kill and "soak: IDENTICAL" (exit 0) or "soak: DIFFER" with what differs (exit 1).

A kill point is the n-th such event of one process (a child runs `soak.py --child KIND N -- ARGS`: train.py
with that one event patched to SIGKILL its own process). Timings are not compared; everything else must be
bit for bit.
"""
import json
import os
import random
import signal
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

KINDS = ("step", "eval", "ckpt")
TIMINGS = ("ms", "tok_s", "mfu")


def _child(kind: str, n: int, argv) -> int:
    """train.main(argv) with the n-th `kind` event of this process turned into SIGKILL."""
    import train
    from gptcuda.model import checkpoint
    from gptcuda.training.engine import Engine
    count = [0]

    def hit():
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)

    if kind in ("step", "eval"):
        real = Engine.run

        def run(self, name):
            real(self, name)                 # launched (asynchronous on the GPU): killed inside it
            if name.startswith("train" if kind == "step" else "eval"):
                hit()
        Engine.run = run
    else:
        real_replace = os.replace

        def replace(src, dst):               # a checkpoint's temporary file written and fsync'd
            if str(dst).endswith(".ckpt"):
                hit()
            return real_replace(src, dst)
        checkpoint.os.replace = replace      # this process only
    return train.main(argv)


def _train(out: str, config: str, data: str, overrides, extra=(), kill=None, log=None):
    """Run train.py (or a killing child) to its end; returns the exit code."""
    argv = [config, f"--data={data}", f"--out_dir={out}", "--no-bar", *overrides, *extra]
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *argv] if kill is None else \
        [sys.executable, os.path.abspath(__file__), "--child", kill[0], str(kill[1]), "--", *argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    with open(log, "a") if log else open(os.devnull, "w") as f:
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


def _left(out: str, cfg) -> tuple[int, int, int]:
    """(the step a process started on out begins at, the steps and the evaluations it has left): last.ckpt
    is written by an evaluation, so a resumed process does not repeat the one at its step."""
    from gptcuda.model.checkpoint import read_checkpoint_meta
    p = os.path.join(out, "last.ckpt")
    step = int(read_checkpoint_meta(p)["step"]) if os.path.exists(p) else 0
    lo = step + 1 if os.path.exists(p) else 0
    evals = sum(1 for e in range(lo, cfg.max_iters + 1) if e % cfg.eval_interval == 0 or e == cfg.max_iters)
    return step, cfg.max_iters - step, evals


def _same(x, y) -> bool:
    """Bit for bit (NaN padding included)."""
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def compare(a: str, b: str) -> list[str]:
    """What differs between two run directories: checkpoints (arrays; metadata but out_dir) and
    metrics.jsonl without its timings. [] when nothing does."""
    from gptcuda.model.checkpoint import load_checkpoint
    diffs = []
    for name in ("last.ckpt", "best.ckpt"):
        pa, pb = os.path.join(a, name), os.path.join(b, name)
        if not (os.path.exists(pa) and os.path.exists(pb)):
            diffs.append(f"{name}: present in {'one' if os.path.exists(pa) or os.path.exists(pb) else 'neither'}")
            continue
        (xa, ma), (xb, mb) = load_checkpoint(pa), load_checkpoint(pb)
        for m in (ma, mb):
            m["config"] = {k: v for k, v in m.get("config", {}).items() if k != "out_dir"}
        diffs += [f"{name}: array {k}" for k in sorted(set(xa) | set(xb))
                  if k not in xa or k not in xb or not _same(xa[k], xb[k])]
        diffs += [f"{name}: meta {k} {ma.get(k)!r} != {mb.get(k)!r}" for k in sorted(set(ma) | set(mb))
                  if ma.get(k) != mb.get(k)]

    def records(d):
        with open(os.path.join(d, "metrics.jsonl"), encoding="utf-8") as f:
            return [{k: v for k, v in json.loads(ln).items() if k not in TIMINGS} for ln in f if ln.strip()]
    ra, rb = records(a), records(b)
    if ra != rb:
        i = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
        diffs.append(f"metrics.jsonl: {len(ra)} and {len(rb)} records, first difference at record {i}")
    return diffs


def soak(config: str, data: str, overrides, kills: int, seed: int, out: str, say=print) -> bool:
    from gptcuda.config import load_config
    cfg = load_config(config, overrides)
    straight, soaked = os.path.join(out, "straight"), os.path.join(out, "soak")
    log = os.path.join(out, "soak.log")
    os.makedirs(out, exist_ok=True)
    rc = _train(straight, config, data, overrides, ["--overwrite"], log=log)
    if rc != 0:
        say(f"soak: the straight run failed (exit {rc}; see {log})")
        return False
    r = random.Random(seed)
    order = list(KINDS) + [r.choice(KINDS) for _ in range(max(0, kills - len(KINDS)))]
    order = r.sample(order[:len(KINDS)], min(kills, len(KINDS))) + order[len(KINDS):kills]
    first = True
    for i, kind in enumerate(order):
        step, left, evals = _left(soaked, cfg) if not first else (0, cfg.max_iters, _left(soaked + "/-", cfg)[2])
        # the n-th event of this process, early enough to come before the run ends (each evaluation runs
        # both splits and writes last.ckpt, and best.ckpt when it improves)
        span = {"step": max(1, left // 2), "eval": max(1, 2 * evals), "ckpt": max(1, evals)}[kind]
        n = r.randint(1, span)
        resume = ["--resume"] if os.path.exists(os.path.join(soaked, "last.ckpt")) else []
        extra = ["--overwrite"] if first else resume
        rc = _train(soaked, config, data, overrides, extra, kill=(kind, n), log=log)
        first = False
        say(f"kill {i + 1}: {kind} #{n} of a process started at step {step}: exit {rc}"
            + (" (killed)" if rc == -signal.SIGKILL else " (ran to its end: no such event)"))
    extra = ["--resume"] if os.path.exists(os.path.join(soaked, "last.ckpt")) else []
    rc = _train(soaked, config, data, overrides, extra, log=log)
    if rc != 0:
        say(f"soak: the last resume failed (exit {rc}; see {log})")
        return False
    diffs = compare(straight, soaked)
    say("soak: IDENTICAL (last.ckpt, best.ckpt, metrics.jsonl without timings)" if not diffs else
        "soak: DIFFER: " + "; ".join(diffs[:8]))
    return not diffs


def main(argv) -> int:
    if argv[:1] == ["--child"]:
        return _child(argv[1], int(argv[2]), argv[4:])
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    from gptcuda.cli import split_args
    _, overrides, _, opts = split_args(argv, options=("data", "config", "kills", "seed", "out"))
    if "data" not in opts:
        print("error: --data DIR is required (the prepared token data to train on)", file=sys.stderr)
        return 2
    config = opts.get("config", "configs/gpt2_124m.yaml")
    ok = soak(os.path.abspath(config) if os.path.exists(config) else config, os.path.abspath(opts["data"]),
              overrides, int(opts.get("kills", 5)), int(opts.get("seed", 1)),
              os.path.abspath(opts.get("out", "out/soak")))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
