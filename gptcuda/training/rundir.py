"""A run directory (out_dir) as the trainer uses it: whether it holds a run (`holds_run`), whether it can be
written (`check_out_dir`), one process's exclusive lock on it for the life of a run (`lock_run_dir`), and
metrics.jsonl cut back to a checkpoint's step (`cut_metrics`).

A directory holds a run when it has a checkpoint worth keeping: last.ckpt, or a best.ckpt past step 0. One
without (a run that died before its first checkpoint) holds nothing to lose: a new run may start there."""
from __future__ import annotations

import json
import os

from gptcuda.errors import RunError
from gptcuda.files import DirLock, atomic_open
from gptcuda.model.checkpoint import CheckpointError, read_checkpoint_meta

RUN_FILES = ("last.ckpt", "best.ckpt", "metrics.jsonl", "config.yaml", "tokenizer.json", "execution.json")
LOCK_FILE = ".run.lock"


def holds_run(out: str) -> list[str]:
    """The checkpoints of out_dir that make it hold a run ([]: none; a best.ckpt of step 0 is a fresh
    initialisation, and an unreadable one counts, so that it is never replaced unasked)."""
    held = []
    for f in ("last.ckpt", "best.ckpt"):
        p = os.path.join(out, f)
        if not os.path.lexists(p):
            continue
        if f == "best.ckpt" and not held:
            try:
                if int(read_checkpoint_meta(p).get("step", 1)) == 0:
                    continue
            except (CheckpointError, OSError, ValueError, TypeError):
                pass
        held.append(f)
    return held


def lock_run_dir(out: str) -> DirLock:
    """The exclusive lock of a run directory that exists (RunError naming the holder's pid if another
    process holds it)."""
    return DirLock(os.path.join(out, LOCK_FILE), f"out_dir {out}")


def check_out_dir(out_dir: str):
    """RunError unless out_dir is a directory, or can be made one, that this process may write in."""
    p = os.path.abspath(out_dir)
    if os.path.lexists(p) and not os.path.isdir(p):
        raise RunError(f"out_dir {out_dir} is a file, not a directory")
    anc = p
    while not os.path.lexists(anc):
        up = os.path.dirname(anc)
        if up == anc:
            break
        anc = up
    if not os.path.isdir(anc):
        raise RunError(f"out_dir {out_dir} cannot be made: {anc} is a file, not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        where = "is not writable" if anc == p else f"cannot be made: {anc} is not writable"
        raise RunError(f"out_dir {out_dir} {where}")



def cut_metrics(path: str, step: int, evaluated_step: int) -> int:
    """Drop the records of metrics.jsonl that a run resumed at `step` writes again: those of later steps,
    and the evaluation at `step` unless the checkpoint holds it (evaluated_step == step). A torn last
    line (a killed writer) goes too. Returns how many records were dropped; rewrites the file atomically."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return 0
    lines = [l for l in lines if l.strip()]
    keep, dropped = [], 0
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                dropped += 1
            else:
                keep.append(line)
            continue
        s = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(s, int) and (s > step or (s == step and "eval_val" in rec and evaluated_step != step)):
            dropped += 1
            continue
        keep.append(line)
    if dropped:
        with atomic_open(path, "wb") as f:
            f.write("".join(l + "\n" for l in keep).encode("utf-8", "surrogateescape"))
    return dropped
