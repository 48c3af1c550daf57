"""Golden test: the CUDA model against the float64 reference on a tiny config.

Same seeded weights, same fixed batch: logits, every parameter gradient, and the losses of
ten AdamW steps (batches and dropout masks drawn on both sides from the same counter-based
RNG) must agree to |a - b| <= 1e-5 + 1e-2 |ref| (fp32), and within TF32's error for tf32."""
import numpy as np
import pytest

from gptcuda.model import rng
from gptcuda.config import load_config
from gptcuda.data.text import TextDataset, get_batch
from gptcuda.training.engine import Engine

pytestmark = pytest.mark.gpu

DATA = TextDataset("data/tinyshakespeare/input.txt")


def engines(overrides):
    out = []
    for backend in ("cuda", "reference"):
        cfg = load_config("configs/tiny.yaml", overrides + [f"--backend={backend}", "--max_iters=10"])
        out.append(Engine(cfg, DATA.train, DATA.val, DATA.vocab_size, programs=("train", "forward", "fwdbwd")))
    return out


def close(a, b, atol, rtol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return bool(np.all(np.isfinite(a)) and np.all(np.abs(a - b) <= atol + rtol * np.abs(b)))


CASES = [
    (["--precision=fp32", "--dropout=0.0"], 1e-5, 1e-2),
    (["--precision=fp32", "--dropout=0.1"], 1e-5, 1e-2),
    (["--precision=fp32", "--attention=fused", "--dropout=0.1"], 1e-5, 1e-2),
    (["--precision=tf32", "--dropout=0.1"], 2e-3, 5e-2),
    (["--precision=tf32", "--attention=fused", "--dropout=0.1"], 2e-3, 5e-2),
    (["--precision=fp32", "--attention=fused", "--dropout=0.1", "--recompute=true"], 1e-5, 1e-2),
]


@pytest.mark.parametrize("overrides,atol,rtol", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_golden(overrides, atol, rtol):
    gpu, ref = engines(overrides)
    ref.set_params(gpu.params())          # identical start (both were initialised from one seed anyway)
    cfg = gpu.cfg
    x, y = get_batch(DATA.train, 99, 0, rng.SITE_BATCH_TRAIN, cfg.batch_size, cfg.block_size)
    for e in (gpu, ref):
        e.set_batch(x, y)
        e.run("forward")
    lg = gpu.be.download(gpu.bufs.acts["logits"])
    lr_ = ref.be.download(ref.bufs.acts["logits"])
    assert close(lg, lr_, atol, rtol), f"logits max diff {np.max(np.abs(lg - lr_))}"

    for e in (gpu, ref):
        e.run("fwdbwd")
    gg, gr = gpu.grads(), ref.grads()
    bad = [k for k in gr if not close(gg[k], gr[k], atol, rtol)]
    assert not bad, {k: float(np.max(np.abs(gg[k] - gr[k]))) for k in bad}

    for e in (gpu, ref):
        for _ in range(10):
            e.train_step()
    hg, hr = gpu.loss_history(10), ref.loss_history(10)
    assert close(hg, hr, atol, rtol), (hg, hr)
    assert gpu.state()["step"] == ref.state()["step"] == 10
