"""Quality across seeds: many runs of a training recipe at once, their best val losses side by side.

    python bench/seeds.py GROUP [GROUP ...] [--per-gpu 2] [--until N] [--budget-s S] [--json F]
                          [--out DIR] [--threshold 1.465] [--gpus N] [--paired A,B ...]

    GROUP  label=CONFIG:SEEDS[:key=value,key=value]   our train.py, e.g. tf32=configs/ctx256_tf32.yaml:1-8
           label@TREE=CONFIG:SEEDS[:key=value,...]    the train.py of another checkout (a directory with
                                                       its own train.py, gptcuda/ and kernels/, e.g. an
                                                       older commit unpacked by git archive); CONFIG is
                                                       read from TREE, data paths from here
           label=torch:SCRIPT:SEEDS[:DROPOUT]          the PyTorch recipe script (torch_train_ref.py)
    SEEDS  a list and ranges: 1-4,9
    --paired A,B   the best-val differences B - A over the seeds both have: A and B are group labels
                   of this run or FILE.json:label of an earlier one (repeatable)

A recipe's best val loss is the minimum of its evaluations, and one run's trajectory is chaotic:
any change of arithmetic (TF32 against fp32, a different tile) or of the seed moves it by several
thousandths. So a precision is judged by the spread of its best val over seeds, not by one run.

Runs go round-robin over the visible GPUs (CUDA_VISIBLE_DEVICES per process), --per-gpu at a time
on each. --until N stops every run after step N of the unchanged schedule (our runs keep the
config's lr_decay_iters; the torch script's loop is cut at N with its cosine still over its own
step count), which keeps the best val whenever it falls before N: in the shakespeare-char recipe
val loss bottoms out near step 1750-2250 and climbs steadily after 2500. A run not started
before --budget-s is skipped (and listed). The torch script takes its seed from a patched copy
(both manual_seed(1337) calls), made under --out; the anchor script itself is never changed.

Prints, per run, the best val and its step; per group, n, mean, sample std, min, max and how many
runs reach --threshold; --json writes all of it with every run's val history.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from bench.common import visible_gpus  # noqa: E402


def parse_seeds(text: str) -> list:
    seeds = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            seeds += list(range(int(a), int(b) + 1))
        elif part:
            seeds.append(int(part))
    if not seeds:
        raise ValueError(f"no seeds in {text!r}")
    return seeds


def parse_group(text: str) -> dict:
    """label=CONFIG:SEEDS[:k=v,...] or label=torch:SCRIPT:SEEDS[:DROPOUT]."""
    label, sep, rest = text.partition("=")
    label, at, tree = label.partition("@")
    if not sep or not label or (at and not tree):
        raise ValueError(f"group {text!r}: expected label[@TREE]=CONFIG:SEEDS[:key=value,...]")
    parts = rest.split(":")
    if parts[0] == "torch":
        if len(parts) not in (3, 4):
            raise ValueError(f"group {text!r}: expected label=torch:SCRIPT:SEEDS[:DROPOUT]")
        if at:
            raise ValueError(f"group {text!r}: @TREE names a checkout of ours, not a torch script")
        return dict(label=label, kind="torch", script=parts[1], seeds=parse_seeds(parts[2]),
                    dropout=float(parts[3]) if len(parts) == 4 else 0.2)
    if len(parts) not in (2, 3):
        raise ValueError(f"group {text!r}: expected label=CONFIG:SEEDS[:key=value,...]")
    overrides = [f"--{kv}" for kv in parts[2].split(",") if kv] if len(parts) == 3 else []
    group = dict(label=label, kind="ours", config=parts[0], seeds=parse_seeds(parts[1]), overrides=overrides)
    if at:
        if not os.path.isfile(os.path.join(tree, "train.py")):
            raise ValueError(f"group {text!r}: {tree} has no train.py")
        group.update(tree=os.path.abspath(tree), config=os.path.join(os.path.abspath(tree), parts[0]))
    return group


def torch_copy(script: str, seed: int, until, out: str) -> str:
    """A copy of the torch recipe script with its seed (and, with until, its loop length) replaced."""
    src = open(script).read()
    n_seed = src.count("manual_seed(1337)")
    if n_seed != 2:
        raise ValueError(f"{script}: expected two manual_seed(1337) calls, found {n_seed}")
    src = src.replace("manual_seed(1337)", f"manual_seed({seed})")
    if until is not None:
        loop = "for it in range(steps):"
        if src.count(loop) != 1:
            raise ValueError(f"{script}: expected one '{loop}'")
        # the cosine keeps `steps`; the loop stops after `until` updates (an evaluation lands there
        # when until is a multiple of EVAL, as the script evaluates every EVAL steps)
        src = src.replace(loop, f"for it in range(min(steps, {int(until)})):")
        src = src.replace("or it + 1 == steps:", f"or it + 1 == min(steps, {int(until)}):")
    path = os.path.join(out, f"torch_ref_seed{seed}.py")
    with open(path, "w") as f:
        f.write(src)
    return path


def job_command(group: dict, seed: int, until, out: str) -> tuple:
    """(argv, env additions, run directory) of one run."""
    run_dir = os.path.join(out, f"{group['label']}_seed{seed}")
    os.makedirs(run_dir, exist_ok=True)
    if group["kind"] == "torch":
        copy = torch_copy(group["script"], seed, until, run_dir)
        data = os.path.join(ROOT, "data", "tinyshakespeare", "input.txt")
        return ([sys.executable, copy, str(group["dropout"]), "5000"],
                {"EVAL": "250", "DATA": data}, run_dir)
    tree = group.get("tree")
    argv = [sys.executable, os.path.join(tree or ROOT, "train.py"), group["config"], f"--seed={seed}",
            f"--out_dir={run_dir}", "--checkpoint=false", "--no-bar"]
    if until is not None:
        from gptcuda.config import load_config
        cfg = load_config(group["config"], group["overrides"])
        argv += [f"--max_iters={min(until, cfg.max_iters)}", f"--lr_decay_iters={cfg.lr_decay_iters}"]
    # another checkout imports its own gptcuda (and so compiles its own kernels/)
    env_add = {}
    if tree:
        env_add["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return argv + group["overrides"], env_add, run_dir


def read_history(group: dict, run_dir: str, log_text: str) -> list:
    """[(step, val)] of a finished run."""
    if group["kind"] == "torch":
        hist = []
        for line in log_text.splitlines():
            m = re.match(r"step (\d+) lr \S+ train \S+ val (\S+)", line)
            if m:
                hist.append((int(m.group(1)), float(m.group(2))))
        return hist
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    hist = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "eval_val" in rec:
                hist.append((int(rec["step"]), float(rec["eval_val"])))
    return hist


def summarize(runs: list, threshold: float, labels=None) -> list:
    """Per group (in the order of labels): n, mean, std, min, max, how many reach the threshold."""
    rows = []
    for label in labels or dict.fromkeys(r["label"] for r in runs):
        vals = [r["best_val"] for r in runs if r["label"] == label and r["best_val"] is not None]
        if not vals:
            rows.append(dict(label=label, n=0))
            continue
        rows.append(dict(label=label, n=len(vals), mean=statistics.fmean(vals),
                         std=statistics.stdev(vals) if len(vals) > 1 else float("nan"),
                         min=min(vals), max=max(vals), reach=sum(v <= threshold for v in vals)))
    return rows


def best_vals(spec: str, runs: list) -> dict:
    """{seed: best val} of a group label of this run, or of FILE.json:label from an earlier one."""
    path, sep, label = spec.rpartition(":")
    if sep and path.endswith(".json"):
        with open(path) as f:
            runs = json.load(f)["runs"]
    else:
        label = spec
    vals = {r["seed"]: r["best_val"] for r in runs if r["label"] == label and r["best_val"] is not None}
    if not vals:
        raise ValueError(f"--paired: no finished runs for {spec!r}")
    return vals


def paired(a: dict, b: dict) -> dict:
    """b - a over the seeds both have: n, the mean difference, its sample std and standard error."""
    common = sorted(set(a) & set(b))
    d = [b[s] - a[s] for s in common]
    row = dict(seeds=common, n=len(d), diffs=d, mean=statistics.fmean(d) if d else float("nan"))
    row["std"] = statistics.stdev(d) if len(d) > 1 else float("nan")
    row["se"] = row["std"] / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("groups", nargs="+")
    ap.add_argument("--per-gpu", type=int, default=2)
    ap.add_argument("--until", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None)
    ap.add_argument("--threshold", type=float, default=1.465)
    ap.add_argument("--out", default="out/seeds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs to spread over (default: all visible; with --backend=reference runs, any)")
    ap.add_argument("--paired", action="append", default=[], metavar="A,B")
    args = ap.parse_args(argv)
    try:
        groups = [parse_group(g) for g in args.groups]
    except ValueError as e:
        ap.error(str(e))
    for spec in args.paired:
        if len(spec.split(",")) != 2:
            ap.error(f"--paired {spec!r}: expected A,B")
    labels = [g["label"] for g in groups]
    if len(set(labels)) != len(labels):
        ap.error(f"group labels must differ (they name the run directories): {labels}")
    n_gpu = visible_gpus() if args.gpus is None else args.gpus
    if n_gpu == 0:
        print("bench/seeds.py: no GPU visible", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    # interleave the groups so every group gets runs even when the budget runs out
    queue, i = [], 0
    while any(i < len(g["seeds"]) for g in groups):
        queue += [(g, g["seeds"][i]) for g in groups if i < len(g["seeds"])]
        i += 1
    t0 = time.time()
    slots = {gpu: [] for gpu in range(n_gpu)}
    runs, skipped = [], []
    print(f"{len(queue)} runs on {n_gpu} GPU(s), {args.per_gpu} at a time on each"
          + (f", each stopped after step {args.until}" if args.until else ""), flush=True)
    while queue or any(slots.values()):
        for gpu, procs in slots.items():
            for p in [p for p in procs if p["proc"].poll() is not None]:
                procs.remove(p)
                p["log"].close()
                text = open(p["log_path"]).read()
                hist = read_history(p["group"], p["run_dir"], text)
                best = min(hist, key=lambda h: h[1]) if hist else None
                rec = dict(label=p["group"]["label"], seed=p["seed"], gpu=gpu, rc=p["proc"].returncode,
                           wall_s=time.time() - p["t0"], best_val=best[1] if best else None,
                           best_step=best[0] if best else None, history=hist)
                runs.append(rec)
                tail = "" if rec["rc"] == 0 else "  FAILED: " + " | ".join(text.strip().splitlines()[-3:])
                print(f"  {rec['label']:>10} seed {rec['seed']:>3}  gpu {gpu}  best val "
                      + (f"{best[1]:.4f} @ {best[0]:>4}" if best else "-") + f"  {rec['wall_s']:.0f} s{tail}",
                      flush=True)
            while queue and len(procs) < args.per_gpu:
                if args.budget_s is not None and time.time() - t0 > args.budget_s:
                    skipped += [f"{g['label']} seed {s}" for g, s in queue]
                    queue.clear()
                    break
                group, seed = queue.pop(0)
                cmd, env_add, run_dir = job_command(group, seed, args.until, args.out)
                log_path = os.path.join(run_dir, "run.log")
                log = open(log_path, "w")
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), **env_add)
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
                procs.append(dict(proc=proc, log=log, log_path=log_path, group=group, seed=seed,
                                  run_dir=run_dir, t0=time.time()))
        time.sleep(0.5)
    runs.sort(key=lambda r: (labels.index(r["label"]), r["seed"]))
    rows = summarize(runs, args.threshold, labels)
    print(f"\nbest val loss over seeds (threshold {args.threshold}), {time.time() - t0:.0f} s")
    print(f"  {'group':>10} {'n':>3} {'mean':>7} {'std':>7} {'min':>7} {'max':>7}  <= threshold")
    for r in rows:
        if r["n"] == 0:
            print(f"  {r['label']:>10}   0")
            continue
        std = f"{r['std']:.4f}" if r["n"] > 1 else "-"
        print(f"  {r['label']:>10} {r['n']:>3} {r['mean']:.4f} {std:>7} {r['min']:.4f} {r['max']:.4f}"
              f"  {r['reach']}/{r['n']}")
    if skipped:
        print("not started (budget): " + ", ".join(skipped))
    pairs = []
    for spec in args.paired:
        a, b = spec.split(",")
        try:
            row = dict(a=a, b=b, **paired(best_vals(a, runs), best_vals(b, runs)))
        except (OSError, ValueError, KeyError) as e:
            print(f"paired {b} - {a}: {e}")
            continue
        pairs.append(row)
        if row["n"] == 0:
            print(f"paired {b} - {a}: no seed in common")
            continue
        spread = (f", std {row['std']:.4f}, standard error {row['se']:.4f}"
                  + (f" (t {row['mean'] / row['se']:+.2f})" if row["se"] > 0 else "") if row["n"] > 1 else "")
        print(f"paired {b} - {a} over {row['n']} seeds: mean {row['mean']:+.4f}{spread}; "
              + " ".join(f"{s}:{d:+.4f}" for s, d in zip(row["seeds"], row["diffs"])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(groups=[{k: v for k, v in g.items()} for g in groups], until=args.until,
                           threshold=args.threshold, runs=runs, summary=rows, skipped=skipped, paired=pairs),
                      f, indent=1)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
