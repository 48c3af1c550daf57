"""The resume check every backend's tests share: a run trained in one go, and the same run stopped
half way (as an interrupted run would be, at an evaluation) and resumed, end in the same last.ckpt
bit for bit."""
import os

import numpy as np

from gptcuda.config import load_config
from gptcuda.model.checkpoint import load_checkpoint
from gptcuda.training.trainer import Trainer


def quiet(*a, **k):
    pass


def resume_matches_full(tmp_path, overrides, steps, stop_at, inspect=None):
    """Train configs/tiny.yaml with overrides (which set max_iters=steps) in one go under
    tmp_path/full, and under tmp_path/part up to stop_at then --resume to the end; both last.ckpt
    are at step `steps` with the same loss history and parameters. inspect(trainer): called with
    the first run's Trainer before it trains. Returns (full, part) run directories."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    t = Trainer(load_config("configs/tiny.yaml", overrides + [f"--out_dir={full}"]), log=quiet)
    if inspect is not None:
        inspect(t)
    t.train(bar=False)
    t = Trainer(load_config("configs/tiny.yaml", overrides + [f"--out_dir={part}"]), log=quiet)
    t.cfg.max_iters = stop_at
    t.train(bar=False)
    assert load_checkpoint(os.path.join(part, "last.ckpt"))[1]["step"] == stop_at
    Trainer(load_config("configs/tiny.yaml", overrides + [f"--out_dir={part}"]), resume=True, log=quiet).train(bar=False)
    a, ma = load_checkpoint(os.path.join(full, "last.ckpt"))
    b, mb = load_checkpoint(os.path.join(part, "last.ckpt"))
    assert ma["step"] == mb["step"] == steps
    assert np.array_equal(a["history"][:steps], b["history"][:steps])
    assert np.array_equal(a["params"], b["params"])
    assert np.array_equal(a["adam_m"], b["adam_m"]) and np.array_equal(a["adam_v"], b["adam_v"])
    return full, part
