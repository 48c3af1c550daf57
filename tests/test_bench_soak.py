"""bench/soak.py on the reference backend: a tiny run with gradient accumulation killed with SIGKILL inside a
step, an evaluation and a checkpoint write, resumed each time, ends bit for bit where the straight run ends;
and the comparison it prints catches a difference."""
import json
import os
import shutil

import numpy as np
import pytest

from bench import soak
from gptcuda.model.checkpoint import load_checkpoint, save_checkpoint
from test_faults import data  # noqa: F401  (the module's text fixture)

OVER = ["--backend=reference", "--total_batch_tokens=128", "--max_iters=6", "--eval_interval=3", "--eval_iters=1",
        "--dropout=0.1", "--log_interval=1"]


@pytest.mark.slow
def test_soak_kills_everywhere_and_ends_identical(data, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")          # the children: one BLAS thread, as CI's workers
    said = []
    assert soak.soak("configs/tiny.yaml", data, OVER, kills=3, seed=3, out=str(tmp_path), say=said.append), said
    kills, last = said[:-1], said[-1]
    assert len(kills) == 3 and all("(killed)" in s for s in kills), said
    assert sorted(s.split()[2] for s in kills) == ["ckpt", "eval", "step"]
    assert last.startswith("soak: IDENTICAL")
    a, b = str(tmp_path / "straight"), str(tmp_path / "soak")
    assert soak.compare(a, b) == []
    # what it compares: a changed loss record, a changed array
    recs = [json.loads(ln) for ln in open(os.path.join(b, "metrics.jsonl"))]
    recs[3]["ms"] = 1e9                                      # a timing: not compared
    c = str(tmp_path / "changed")
    shutil.copytree(b, c)
    with open(os.path.join(c, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    assert soak.compare(a, c) == []
    recs[3]["loss" if "loss" in recs[3] else "eval_val"] += 1e-12
    with open(os.path.join(c, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    arrays, meta = load_checkpoint(os.path.join(c, "last.ckpt"))
    arrays["adam_v"][0] = np.nextafter(arrays["adam_v"][0], 1)  # one ulp of one number
    save_checkpoint(os.path.join(c, "last.ckpt"), arrays, meta)
    diffs = soak.compare(a, c)
    assert any(d.startswith("metrics.jsonl") for d in diffs) and "last.ckpt: array adam_v" in diffs
