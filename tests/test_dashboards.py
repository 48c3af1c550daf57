"""The optional dashboards: TensorBoard events read back against metrics.jsonl (and across a resume), W&B in
offline mode (never the network), and the one-line error when a dashboard's package is missing."""
import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gptcuda.config import load_config
from gptcuda.errors import RunError
from gptcuda.training import dashboards
from gptcuda.training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "data" / "tinyshakespeare" / "input.txt"
TINY = ["--backend=reference", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=8", "--batch_size=2",
        "--eval_interval=2", "--eval_iters=1", "--log_interval=1", "--dropout=0.0", "--warmup_iters=0",
        f"--data={TEXT}"]


def quiet(*a, **k):
    pass


def train(out, *extra, resume=False, overwrite=False):
    cfg = load_config(None, TINY + [f"--out_dir={out}", *extra])
    Trainer(cfg, resume=resume, overwrite=overwrite, log=quiet).train(bar=False)


def records(out):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def tb_events(d):
    """(wall time, step, tag, value) of every scalar, and the purge steps, in TensorBoard's event files
    (TFRecords: length, its crc, an Event, its crc), oldest file first."""
    from tensorboardX.proto import event_pb2
    scalars, purges = [], []
    for f in sorted(glob.glob(str(d / "events.out.tfevents.*")), key=os.path.getmtime):
        data = Path(f).read_bytes()
        i = 0
        while i < len(data):
            n = struct.unpack("<Q", data[i:i + 8])[0]
            ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
                purges.append(ev.step)
            for v in ev.summary.value:
                scalars.append((ev.step, v.tag, v.simple_value))
    return scalars, purges


def test_tensorboard_holds_every_record_and_a_resume_purges_past_the_checkpoint(tmp_path):
    pytest.importorskip("tensorboardX")
    out = tmp_path / "run"
    train(out, "--max_iters=4", "--log_tensorboard=true")
    want = [(r["step"], k, v) for r in records(out) for k, v in r.items() if k != "step"]
    got, purges = tb_events(out / "tensorboard")
    assert [(s, k) for s, k, _ in got] == [(s, k) for s, k, _ in want]
    assert all(abs(g - w) <= 1e-6 * max(1, abs(w)) for (_, _, g), (_, _, w) in zip(got, want))     # float32
    assert purges == []
    train(out, "--max_iters=6", "--log_tensorboard=true", resume=True)
    got, purges = tb_events(out / "tensorboard")
    assert purges == [5]                     # steps above the checkpoint's (4) logged before are dropped
    assert [s for s, k, _ in got if k == "loss"] == [1, 2, 3, 4, 5, 6]
    train(out, "--max_iters=2", "--log_tensorboard=true", overwrite=True)     # a new run: a new dashboard
    got, _ = tb_events(out / "tensorboard")
    assert [s for s, k, _ in got if k == "loss"] == [1, 2]


def test_a_missing_dashboard_package_is_one_line(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    cfg = load_config(None, TINY + [f"--out_dir={tmp_path / 'run'}", "--log_tensorboard=true"])
    with pytest.raises(RunError, match=r'log_tensorboard: true needs the tensorboardX package: pip install -e "\.\[tensorboard\]"'):
        Trainer(cfg, log=quiet)
    assert not (tmp_path / "run").exists()                    # refused before anything is written
    # and from train.py, where neither package can be imported
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(
        "import importlib.util as u\nf = u.find_spec\nu.find_spec = lambda n, *a: None if n == 'wandb' else f(n, *a)\n")
    env = dict(os.environ, PYTHONPATH=f"{stub}{os.pathsep}{ROOT}")
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, f"--out_dir={tmp_path / 'run'}",
                        "--wandb_log=true", "--max_iters=1"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("error: wandb_log: true needs the wandb package: pip install -e \".[wandb]\"")
    assert not (tmp_path / "run").exists()


def test_numbers_are_what_a_dashboard_gets():
    assert dashboards.numbers({"step": 3, "loss": 2, "ok": True, "name": "x", "lr": 1e-3}) == {"loss": 2.0, "lr": 1e-3}


def test_wandb_offline_continues_the_run_on_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    out = tmp_path / "run"
    train(out, "--max_iters=2", "--wandb_log=true", "--wandb_project=test")
    run_id = (out / "wandb_id").read_text().strip()
    first = glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}"))
    assert len(first) == 1 and glob.glob(os.path.join(first[0], "*.wandb"))
    train(out, "--max_iters=4", "--wandb_log=true", "--wandb_project=test", resume=True)
    assert (out / "wandb_id").read_text().strip() == run_id
    runs = glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}*"))       # a second in one second gets "-1"
    assert len(runs) == 2 and all(os.path.isfile(os.path.join(r, f"run-{run_id}.wandb")) for r in runs)
