"""Nothing shared, nothing mismatched: a run directory and a prepare.py output are locked for the life of
the process that writes them; a run that saved no checkpoint restarts plainly; tokenizer and data are
checked against each other before the first step; every entry point's OSError is one line. CPU only."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import train
from gptcuda.config import load_config
from gptcuda.training.trainer import Trainer
from test_faults import ROOT, _popen, _wait_for_steps, args, call, data, one_line_error, snapshot  # noqa: F401


# ---- 1. two trainings in one out_dir ------------------------------------------------------------

def _lock_pid(out, timeout=60):
    path = os.path.join(out, ".run.lock")
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        try:
            pid = open(path).read().strip()
            if pid:
                return int(pid)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no lock at {path}")


def test_a_second_run_into_a_locked_out_dir_is_refused(tmp_path, data, capsys):
    out = str(tmp_path / "run")
    p = _popen(data, out)
    try:
        _wait_for_steps(p, 1)
        assert _lock_pid(out) == p.pid
        before = snapshot(out)
        for extra in ((), ("--resume",), ("--overwrite",)):
            rc, _, err = call(train.main, args(data, out, "--max_iters=3", *extra), capsys)
            one_line_error(rc, err, out, f"pid {p.pid}", "in use")
        after = snapshot(out)
        assert set(after) >= set(before) - {"metrics.jsonl"}      # the run goes on; nothing of it removed
        p.send_signal(signal.SIGTERM)
        rest, err = p.communicate(timeout=120)
        assert p.returncode == 143, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not os.path.exists(os.path.join(out, ".run.lock"))    # released with the run
    rc, _, err = call(train.main, args(data, out, "--resume", "--max_iters=3", "--eval_interval=200"), capsys)
    assert rc == 0, err


def test_a_killed_holder_does_not_block(tmp_path, data, capsys):
    out = str(tmp_path / "run")
    p = _popen(data, out)
    try:
        _wait_for_steps(p, 1)
        _lock_pid(out)
    finally:
        p.kill()
        p.wait()
    assert os.path.exists(os.path.join(out, ".run.lock"))        # left by kill -9, but held by no one
    rc, _, err = call(train.main, args(data, out, "--overwrite"), capsys)
    assert rc == 0, err
    assert not os.path.exists(os.path.join(out, ".run.lock"))


# ---- 5. a run that died before its first checkpoint ------------------------------------------

@pytest.mark.parametrize("left", ["metrics", "best0"])
def test_a_run_dir_without_a_checkpoint_restarts_plainly(left, tmp_path, data, capsys, monkeypatch):
    out = str(tmp_path / "run")
    from gptcuda.model import checkpoint
    real = os.replace

    def die(src, dst):                  # killed during the step-0 checkpoint write (best.ckpt first)
        if str(dst).endswith("last.ckpt") or (left == "metrics" and str(dst).endswith(".ckpt")):
            raise KeyboardInterrupt
        return real(src, dst)
    monkeypatch.setattr(checkpoint.os, "replace", die)
    with pytest.raises(KeyboardInterrupt):
        Trainer(load_config(args(data, out)[0], args(data, out)[1:-1]),
                      log=lambda *a: None).train(bar=False)
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(out, "last.ckpt"))
    assert os.path.exists(os.path.join(out, "best.ckpt")) == (left == "best0")
    rc, _, err = call(train.main, args(data, out, "--resume"), capsys)
    one_line_error(rc, err, "no checkpoint", "without --resume")
    rc, _, err = call(train.main, args(data, out), capsys)
    assert rc == 0, err
    assert os.path.exists(os.path.join(out, "last.ckpt"))
