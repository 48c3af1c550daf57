"""The GEMM table measured at setup on the device (gptcuda/ops/cuda/gemm/tune.py autotune): a tiny
config's shapes are all measured into a table under a fresh compile cache, a second call measures
nothing and the runtime's workspaces are restored; an Engine records its step from the table, and
a second Engine, measuring nothing, trains bitwise like the first."""
import time

import numpy as np
import pytest

from gptcuda.model.products import products
from gptcuda.config import load_config
from gptcuda.data.text import TextDataset
from gptcuda.ops.cuda.gemm import tune
from gptcuda.ops.cuda.gemm.table import load_table, table_key, table_path
from gptcuda.runtime import execution
from gptcuda.training.engine import Engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_autotune_measures_every_shape_once(rt, table_cache, precision):
    cfg = load_config("configs/tiny.yaml", [f"--precision={precision}", "--dropout=0.1"])
    V = 65
    keys = {table_key(precision, op) for op in products(cfg, V)}
    saved_exec, saved_ws = rt.exec, dict(rt._workspace)
    graphs = list(rt._graphs)
    rt.exec = execution.resolve(cfg, arch=rt.arch)              # as the CUDA backend resolves it: auto
    try:
        s = tune.autotune(rt, cfg, V)
        assert s.measured == len(keys) and s.known == 0, s
        assert s.tuned_ms <= s.model_ms, s                  # the cost model's plan is a candidate too
        path = table_path(rt.info.name)
        assert str(path) == s.path and path.is_file()
        assert path.parent == table_cache / "tune"
        assert keys <= set(load_table(rt.info.name, refresh=True))
        assert rt._workspace == saved_ws and rt._graphs == graphs     # (its buffers: tests/test_autotune.py)
        t = time.perf_counter()
        again = tune.autotune(rt, cfg, V)
        assert again.measured == 0 and again.known == len(keys)
        assert time.perf_counter() - t < 1.0
    finally:
        rt.exec = saved_exec


def test_engine_records_from_the_table(monkeypatch):
    """An Engine measures what the table lacks (the session's compile cache: other tests' Engines
    may have measured these shapes already), a second one nothing, and both train on the same plans."""
    monkeypatch.delenv("GPTCUDA_GEMM_TUNE", raising=False)
    data = TextDataset("data/tinyshakespeare/input.txt")
    cfg = load_config("configs/tiny.yaml", ["--precision=tf32", "--dropout=0.1", "--max_iters=3"])
    eng = Engine(cfg, data.train, data.val, data.vocab_size, programs=("train",))
    assert eng.exec.gemm_tune == "auto" and eng.tuning is not None
    want = {table_key("tf32", op) for op in products(eng.cfg, data.vocab_size)}
    assert want <= set(load_table(eng.be.rt.info.name))
    for _ in range(3):
        eng.train_step()
    assert np.all(np.isfinite(eng.loss_history(3)))
    again = Engine(cfg, data.train, data.val, data.vocab_size, programs=("train",))
    assert again.tuning.startswith(f"GEMM table: the {len(want)} shapes")
    for _ in range(3):
        again.train_step()
    assert np.array_equal(again.loss_history(3), eng.loss_history(3))     # the same plans: bitwise
