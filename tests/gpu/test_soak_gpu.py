"""bench/soak.py on the GPU with a tiny config: kill -9 inside a step (its graph launched, still running),
an evaluation and a checkpoint write, resumed each time, ends bit for bit where the straight run ends.
(The GPT-2 124M soak is device_check.sh's soak step.)"""
from pathlib import Path

import pytest

from bench import soak

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent.parent


def test_soak_on_the_gpu(tmp_path):
    said = []
    over = ["--total_batch_tokens=256", "--max_iters=12", "--eval_interval=4", "--eval_iters=2", "--dropout=0.1"]
    ok = soak.soak(str(ROOT / "configs/tiny.yaml"), str(ROOT / "data/tinyshakespeare/input.txt"), over, kills=3,
                   seed=5, out=str(tmp_path), say=said.append)
    assert ok and said[-1].startswith("soak: IDENTICAL"), said
    assert sorted(s.split()[2] for s in said[:-1]) == ["ckpt", "eval", "step"]
    assert all("(killed)" in s for s in said[:-1]), said
