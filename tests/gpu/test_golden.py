"""Golden test: the CUDA model against the float64 reference on a tiny config.

Same seeded weights, same fixed batch: logits, every parameter gradient, and the losses of
ten AdamW steps (batches and dropout masks drawn on both sides from the same counter-based
RNG) must agree to |a - b| <= 1e-5 + 1e-2 |ref| (fp32), and within TF32's error for tf32.

bf16 (BF16: fused attention, the 65 characters rounded up to 72, dropout 0.1) against the tolerances of
the BF16 error model (gptcuda/training/gradcheck.py bf16_error_model at tiny's shape: L = 2 with dropout,
a chain of 31 roundings to bf16, 1 sigma = beta = 1.26% of an entry; the forward's part to the logits, 21
roundings, beta_fwd = 1.03%). An entry's error is relative to its own size or, where the terms it sums
cancel, to theirs, the size of the tensor's entries (rms):
    logits          |a - b| <= N_SIGMA beta_fwd (|b| + rms(b))
    each gradient   |a - b| <= N_SIGMA beta (|b| + rms(b))              (per tensor)
N_SIGMA = 6: a Gaussian tail of 2e-9 an entry, 2e-4 over the ~10^5 entries of the gradients. A loss is
one number, as gradcheck's directional derivative is, and is taken as it is (1 sigma, no averaging):
    step k's loss   |a_k - b_k| <= beta_fwd max(b_k, ln n_vocab) + beta sum_{j<k} lr_j A_j (|g_j|_1 + sum_t n_t rms(g_j,t))
The first term: the forward's error at given weights, sum_v (p_v - onehot_v) dz_v for logit errors dz
relative beta_fwd, whose size is beta_fwd |L - H(p)| <= beta_fwd max(L, ln n_vocab). The second: the
two runs' weights drift apart as their updates differ; AdamW's update of step j is lr_j m/sqrt(v) (bias-corrected),
|m/sqrt(v)| <= A_j entrywise (Cauchy-Schwarz over the moments' weights; `adam_bound`), so the update
moves the loss by at most lr_j A_j |g_j|_1 to first order, and its error, made from a gradient whose
entries err by beta (|g| + rms), by at most beta lr_j A_j (|g_j|_1 + sum_t n_t rms(g_j,t)) (g_j: the
reference's gradient of step j, t its tensors of n_t entries). tests/test_gradcheck_bf16.py runs this
comparison between a float64 simulation of the bf16 path and the reference: the logits at 0.27 of their
bound, the gradients at 0.54 at most (the qkv weights'), the losses at 0.003 (the loss bound, 1 sigma of
a chain with no averaging, is the loosest: about 0.04 at step 0 against differences near 1e-4)."""
import math
from pathlib import Path

import numpy as np
import pytest

from gptcuda.model import rng
from gptcuda.config import load_config, model_vocab
from gptcuda.data.text import TextDataset, get_batch
from gptcuda.ops.reference import ops as R
from gptcuda.runtime import bf16
from gptcuda.training.engine import Engine
from gptcuda.training.gradcheck import bf16_error_model

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
DATA = TextDataset(str(ROOT / "data/tinyshakespeare/input.txt"))
TINY = str(ROOT / "configs/tiny.yaml")


def engines(overrides):
    out = []
    for backend in ("cuda", "reference"):
        cfg = load_config(TINY, overrides + [f"--backend={backend}", "--max_iters=10"])
        out.append(Engine(cfg, DATA.train, DATA.val, model_vocab(cfg, DATA.vocab_size),
                          programs=("train", "forward", "fwdbwd"), n_vocab=DATA.vocab_size))
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


BF16 = ["--precision=bf16", "--attention=fused", "--vocab_multiple=8", "--dropout=0.1"]
N_SIGMA = 6


def adam_bound(beta1, beta2, t) -> float:
    """max |m_hat / sqrt(v_hat)| after t steps, over every gradient history: sqrt(sum_i w_i^2 / u_i) with
    w_i, u_i the weights of g_i in m_hat and of g_i^2 in v_hat (Cauchy-Schwarz; 1 at t = 1)."""
    i = np.arange(1, t + 1)
    w = (1 - beta1) * beta1 ** (t - i) / (1 - beta1 ** t)
    u = (1 - beta2) * beta2 ** (t - i) / (1 - beta2 ** t)
    return float(np.sqrt(np.sum(w * w / u)))


def logits_of(e) -> np.ndarray:
    view = e.bufs.acts["logits"]
    out = e.be.download(view)
    return np.asarray(bf16.values(out) if getattr(view, "dtype", None) == "bf16" else out, np.float64)


def ratio(a, b, sigma) -> float:
    """max |a - b| / (N_SIGMA sigma (|b| + rms(b))): at most 1 within the bound (inf where a is not finite)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return math.inf
    rms = float(np.sqrt(np.mean(b * b)))
    if rms == 0.0:
        return 0.0 if np.array_equal(a, b) else math.inf
    return float(np.max(np.abs(a - b) / (N_SIGMA * sigma * (np.abs(b) + rms))))


def compare_bf16(e, ref, data) -> dict:
    """The golden comparison of a bf16 engine e with the float64 reference (module docstring): each
    check's largest error over its bound ("logits", "grad <name>", "losses"; <= 1 passes)."""
    cfg = ref.cfg
    m = bf16_error_model(cfg, ref.cfg.vocab_size)
    ref.set_params(e.params())
    x, y = get_batch(data.train, 99, 0, rng.SITE_BATCH_TRAIN, cfg.batch_size, cfg.block_size)
    for g in (e, ref):
        g.set_batch(x, y)
        g.run("forward")
    out = {"logits": ratio(logits_of(e), logits_of(ref), m["beta_fwd"])}
    for g in (e, ref):
        g.run("fwdbwd")
    ge, gr = e.grads(), ref.grads()
    out.update({f"grad {k}": ratio(ge[k], gr[k], m["beta"]) for k in gr})
    moves = []                 # lr_j A_j (|g_j|_1 + sum_t n_t rms(g_j,t)) of each reference step
    for j in range(10):
        e.train_step()
        ref.train_step()
        g = ref.grads()
        size = sum(float(np.sum(np.abs(v))) + v.size * float(np.sqrt(np.mean(np.square(v)))) for v in g.values())
        lr = R.lr_at(j, cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters)
        moves.append(lr * adam_bound(cfg.beta1, cfg.beta2, j + 1) * size)
    he, hr = e.loss_history(10), ref.loss_history(10)
    tol = [m["beta_fwd"] * max(abs(hr[k]), math.log(ref.n_vocab)) + m["beta"] * sum(moves[:k]) for k in range(10)]
    out["losses"] = max(abs(he[k] - hr[k]) / tol[k] if np.isfinite(he[k]) else math.inf for k in range(10))
    assert e.state()["step"] == ref.state()["step"] == 10
    return out


@pytest.mark.parametrize("extra", [[], ["--recompute=true"], ["--recompute=1"]], ids=["stored", "recompute", "recompute1"])
def test_golden_bf16(extra):
    """precision bf16 on the H200 against the float64 reference, within the BF16 error model's bounds
    (recompute: the GELU output rebuilt in the backward's dgelu product; 1: in the first layer only)."""
    gpu, ref = engines(BF16 + extra)
    assert gpu.exec.precision == "bf16" and gpu.cfg.vocab_size == ref.cfg.vocab_size == 72
    ratios = compare_bf16(gpu, ref, DATA)
    print({k: round(v, 3) for k, v in ratios.items()})
    bad = {k: v for k, v in ratios.items() if not v <= 1.0}
    assert not bad, bad
