"""gradcheck on the CPU: the TF32 error model's numbers, the reference check passing and catching
--break=layernorm, the tf32 mode's code path (finite differences on a second engine) run with a
reference backend whose products truncate their operands to TF32 as the wgmma kernels do, and the
command line (--help, one-line errors)."""
import contextlib
import math
import subprocess
import sys
import types

import numpy as np
import pytest

from conftest import ROOT
from gptcuda import faults
from gptcuda.training import gradcheck as gc
from gptcuda.config import load_config
from gptcuda.data.text import TextDataset
from gptcuda.training.engine import Engine
import gptcuda.ops.reference.ops as R

U = 2.0 ** -11
DATA = TextDataset(str(ROOT / "data/tinyshakespeare/input.txt"))


def cfg_of(*overrides):
    return load_config(str(ROOT / "configs/tiny.yaml"), [f"--data={ROOT / 'data/tinyshakespeare/input.txt'}",
                                                       *overrides])


# ---- the error model ---------------------------------------------------------------------------

def model_by_hand(C, H, T, B, V):
    ks = [C, C // H, C, V, C, C // H, T, B * T]
    bias = 8 * 1.44 * U
    rnd = math.sqrt(8) * (2 / math.sqrt(12)) * math.sqrt(2) * U
    acc = sum(ks) / 8 * 2.0 ** -23
    return bias + rnd + acc, bias + 3 * rnd + acc


@pytest.mark.parametrize("C,H,T,B,V", [
    (64, 2, 16, 4, 65),          # configs/tiny.yaml
    (36, 3, 7, 1, 65),           # the GPU test's smallest shapes
    (200, 5, 70, 5, 65),         # ... and largest
    (768, 12, 1024, 8, 50304),   # GPT-2 124M: the accumulation term grows with V and B*T
])
def test_tf32_error_model_numbers(C, H, T, B, V):
    cfg = cfg_of(f"--n_embd={C}", f"--n_head={H}", f"--block_size={T}", f"--batch_size={B}")
    m = gc.tf32_error_model(cfg, V)
    beta, beta_one = model_by_hand(C, H, T, B, V)
    assert m["chain"] == 8
    assert m["bias"] == pytest.approx(5.625e-3, rel=1e-3)          # 8 GEMMs x 1.44 U
    assert m["random"] == pytest.approx(1.128e-3, rel=1e-3)        # sqrt(8) x 0.82 U
    assert m["beta"] == pytest.approx(beta, rel=1e-9) and m["beta_one"] == pytest.approx(beta_one, rel=1e-9)
    # well under the 1-4% by which a layernorm backward without its x_hat term errs upstream
    assert m["beta"] < (7.0e-3 if V < 1000 else 8.0e-3)
    assert m["beta_one"] < (9.5e-3 if V < 1000 else 1.05e-2)


def test_tiny_model_values():
    m = gc.tf32_error_model(cfg_of(), 65)
    assert m["accum"] == pytest.approx((64 + 32 + 64 + 65 + 64 + 32 + 16 + 64) / 8 * 2.0 ** -23)
    assert m["beta"] == pytest.approx(6.759e-3, abs=1e-6)
    assert m["beta_one"] == pytest.approx(9.014e-3, abs=1e-6)


def test_fp32_and_reference_settings_unchanged():
    assert gc.SETTINGS["reference"] == dict(h=1e-4, tol=1e-6, eps=2.2e-16)
    assert gc.SETTINGS["fp32"] == dict(h=1e-2, tol=1e-2, eps=1.2e-7)


def test_fd_config():
    cfg = cfg_of("--precision=tf32", "--attention=fused", "--dropout=0.1", "--backend=cuda")
    f = gc.fd_config(cfg)
    assert f.precision == "fp32" and f.fp32_gemm == "3xtf32"
    assert (f.seed, f.dropout, f.attention, f.n_embd, f.batch_size) == (cfg.seed, 0.1, "fused", 64, 4)
    assert gc.fd_config(cfg_of("--precision=fp32", "--backend=cuda")) is None
    assert gc.fd_config(cfg_of("--precision=tf32", "--backend=reference")) is None   # the reference: float64
    assert gc.check_mode(cfg_of("--precision=tf32", "--backend=reference")) == "reference"


# ---- the reference check -----------------------------------------------------------------------

SMALL = ["--backend=reference", "--n_layer=2", "--n_embd=36", "--n_head=3", "--block_size=11",
         "--batch_size=2", "--dropout=0.1"]


def verdicts(lines):
    return {l.split()[0]: l.split()[-1] for l in lines if l.startswith(("h0.", "h1.", "wte", "wpe", "lnf"))}


UPSTREAM = [n for n in ("wte", "wpe") + tuple(f"h{l}.{t}" for l in range(2) for t in (
    "attn.w", "proj.w", "fc.w", "fcproj.w", "ln1.w", "ln1.b", "attn.b", "proj.b", "ln2.w", "ln2.b", "fc.b",
    "fcproj.b"))]


def test_reference_gradcheck_passes_and_catches_the_break():
    lines = []
    assert gc.run_gradcheck(cfg_of(*SMALL), log=lines.append), "\n".join(lines)
    assert lines[-1] == "gradcheck PASSED"
    lines = []
    assert not gc.run_gradcheck(cfg_of(*SMALL), broken=["layernorm"], log=lines.append)
    v = verdicts(lines)
    assert v["lnf.w"] == v["lnf.b"] == "pass"
    assert all(v[n] == "FAIL" for n in ("wte", "wpe", "h0.attn.w", "h1.fc.w", "h0.ln1.w")), v
    assert not faults.broken, "the fault must be cleared after the check"


# ---- the tf32 mode, with a TF32-emulating reference backend for the gradient ------------------

def tf32_truncate(x):
    """fp32, then the top 19 bits (sign, exponent, 10 mantissa bits): what wgmma reads."""
    u = np.asarray(x, np.float64).astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return u.view(np.float32).astype(np.float64)


class _TF32Numpy(types.ModuleType):
    """numpy with matmul on TF32-truncated operands, its result rounded to fp32."""

    def __init__(self):
        super().__init__("numpy_tf32")

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def matmul(a, b, *args, **kw):
        return np.matmul(tf32_truncate(a), tf32_truncate(b)).astype(np.float32).astype(np.float64)


@contextlib.contextmanager
def tf32_products():
    saved, R.np = R.np, _TF32Numpy()
    try:
        yield
    finally:
        R.np = saved


def emulating_engines(cfg, programs):
    """The gradient's engine (it records fwdbwd) runs every product in emulated TF32; the finite
    differences' engine is the plain float64 reference (standing in for the fp32 one)."""
    e = Engine(cfg, DATA.train, DATA.val, cfg.vocab_size or DATA.vocab_size, programs=programs)
    if "fwdbwd" in programs:
        run = e.run

        def run_tf32(name):
            with tf32_products():
                run(name)
        e.run = run_tf32
    return e


def test_emulation_moves_the_gradient():
    """The emulated TF32 gradient errs by about TF32's rounding along itself: the check is not
    trivially passed by a float64 gradient, and the old check (finite differences of the TF32
    forward itself) has a real error to contend with."""
    cfg = cfg_of(*SMALL, "--precision=tf32")
    plain = Engine(cfg, DATA.train, DATA.val, DATA.vocab_size, programs=("fwdbwd",))
    emu = emulating_engines(cfg, ("fwdbwd",))
    from gptcuda.model import rng
    from gptcuda.data.text import get_batch
    x, y = get_batch(DATA.train, cfg.seed, 0, rng.SITE_BATCH_TRAIN, cfg.batch_size, cfg.block_size)
    for e in (plain, emu):
        e.set_batch(x, y)
        e.run("fwdbwd")
    g0, g1 = plain.grads()["h0.attn.w"], emu.grads()["h0.attn.w"]
    along = float(np.sum((g1 - g0) * g1) / np.linalg.norm(g1) / np.linalg.norm(g0))
    beta = gc.tf32_error_model(cfg, DATA.vocab_size)["beta"]
    assert 3e-4 < abs(along) < beta, along


def test_tf32_mode_passes_emulated_tf32_gradients():
    lines = []
    cfg = cfg_of(*SMALL, "--precision=tf32")
    ok = gc.run_gradcheck(cfg, log=lines.append, mode="tf32", make_engine=emulating_engines)
    assert ok, "\n".join(lines)
    assert "finite differences on a second reference (float64) forward" in lines[0]
    rows = [l.split() for l in lines if l.startswith(("h0.", "h1.", "wte", "wpe", "lnf"))]
    assert len(rows) == 28 and all(r[-1] == "pass" for r in rows)
    # the tolerance column: beta plus the measured truncation and the rounding term, never below beta
    beta = gc.tf32_error_model(cfg, DATA.vocab_size)["beta"]
    assert all(float(r[4]) >= beta for r in rows)


def test_tf32_mode_catches_the_break():
    lines = []
    cfg = cfg_of(*SMALL, "--precision=tf32")
    assert not gc.run_gradcheck(cfg, broken=["layernorm"], log=lines.append, mode="tf32",
                                make_engine=emulating_engines)
    v = verdicts(lines)
    assert v["lnf.w"] == v["lnf.b"] == "pass"
    failed = [n for n in UPSTREAM if v[n] == "FAIL"]
    assert len(failed) >= 0.75 * len(UPSTREAM), v
    assert lines[-1] == "gradcheck FAILED" and not faults.broken


# ---- the command line --------------------------------------------------------------------------

def cli(*args):
    return subprocess.run([sys.executable, "gradcheck.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(flag):
    p = cli(flag)
    assert p.returncode == 0 and "usage" not in p.stderr.lower() and p.stderr == ""
    assert "--break" in p.stdout and "--tensors" in p.stdout and "finite differences" in p.stdout


@pytest.mark.parametrize("args,word", [
    (["--break=nope"], "nope"),
    (["--tensors=h9.attn.w"], "h9.attn.w"),
    (["--tensors"], "--tensors"),
])
def test_bad_options_are_one_line(args, word):
    p = cli("configs/tiny.yaml", "--backend=reference", *args)
    assert p.returncode == 2, p
    assert len(p.stderr.strip().splitlines()) == 1 and word in p.stderr and "Traceback" not in p.stderr
    assert p.stdout == ""
