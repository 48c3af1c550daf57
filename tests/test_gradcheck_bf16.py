"""gradcheck's bf16 mode on the CPU: the BF16 error model's numbers, and the model checked against a
float64 simulation of the CUDA bf16 path: the reference backend with every value the CUDA path stores
or reads in bf16 rounded to nearest even where it does (`Bf16Sim`). Its gradient against the exact
float64 one stays inside the model at the GPU test's shapes; the bf16 mode's code path (finite
differences on a second engine) passes it and catches --break=layernorm; the golden test's bf16
tolerances (tests/gpu/test_golden.py) hold for it on configs/tiny.yaml; the command line's bf16 errors
are one line."""
import dataclasses
import math

import numpy as np
import pytest

from conftest import ROOT
from gptcuda import faults
from gptcuda.config import load_config, model_vocab
from gptcuda.data.text import TextDataset, get_batch
from gptcuda.model import rng
from gptcuda.model.memory import plan_memory
from gptcuda.model.params import param_table
from gptcuda.ops.reference import ops as R
from gptcuda.ops.reference.backend import ReferenceBackend, _2d, matmul_epilogue
from gptcuda.runtime import bf16 as B16
from gptcuda.runtime import execution
from gptcuda.training import gradcheck as gc
from gptcuda.training.engine import Engine, plan_for
from tests.gpu import test_golden as golden
from tests.gpu.test_gradcheck_gpu import BF16_BREAK_CASE, BF16_BREAK_FAILS, BF16_CASES

U = 2.0 ** -8
DATA = TextDataset(str(ROOT / "data/tinyshakespeare/input.txt"))
V72 = model_vocab(load_config(str(ROOT / "configs/tiny.yaml"), ["--vocab_multiple=8"]), DATA.vocab_size)


def cfg_of(*overrides, backend="reference"):
    return load_config(str(ROOT / "configs/tiny.yaml"), [f"--data={ROOT / 'data/tinyshakespeare/input.txt'}",
                                                       "--precision=bf16", "--attention=fused", "--vocab_multiple=8",
                                                       f"--backend={backend}", *overrides])


def case_cfg(case: dict):
    return cfg_of(*[f"--{k}={v}" for k, v in case.items() if k != "attention"])


# ---- the simulation ----------------------------------------------------------------------------

def to_bf16(x):
    """float64 -> fp32 -> bf16 (to nearest even) -> float64: the value a bf16 tensor of fp32 x holds."""
    return B16.round_f32(np.asarray(x, np.float64)).astype(np.float64)


def to_tf32(x):
    """float64 -> fp32 -> TF32 to nearest (ties away, as cvt.rna: flash_tc's operands) -> float64."""
    u = np.ascontiguousarray(np.asarray(x, np.float64).astype(np.float32)).view(np.uint32).astype(np.uint64)
    return ((u + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32).astype(np.float64)


def bf16_entries(cfg, V) -> set:
    """The memory plan entries the CUDA bf16 path holds in bf16 (memory.plan_memory with act bf16; the
    working copy aside: the products' operands are rounded where they are read)."""
    plan = plan_memory(dataclasses.replace(cfg, vocab_size=V), param_table(cfg, V), V, 1, {}, {}, 1, act="bf16")
    return {e.name for e in plan.entries if e.dtype == "bf16" and e.name != "params_bf16"}


class Bf16Sim(ReferenceBackend):
    """The float64 reference with the CUDA bf16 path's roundings: after every op each bf16 entry of the
    memory plan (`bf16_entries`) is rounded, so a value is rounded once where a kernel stores it and used
    as stored (the fused residual add, dres += , dropout in place); the products and the embedding read
    the weights rounded (the working copy), biases and layernorm weights as they are; GELU's output is
    made from the pre-activation as stored (gemm_epilogue.cuh); attention's P and dS are rounded as the
    A operands of its second products (`att`: "bf16", the bf16 flash kernel's; "tf32", flash_tc's on the
    fp32 copies today, with its tf32(Q * scale * log2 e) too), and its backward's D = rowsum(dO * O)
    reads the stored O. Statistics, softmax, losses and sums stay float64 (fp32 on the GPU). grad_dtype bf16:
    the gradient region is rounded after every op too (each writer's sum rounded once where stored; wte's
    again after the embedding's addition)."""

    def __init__(self, cfg, V, att="bf16", seed=None, rounding=True):
        super().__init__(cfg, seed)
        self.names = bf16_entries(cfg, V)
        self.att = att
        # rounding False: every rounding the identity (the simulation's own ops against the reference's)
        self.r = to_bf16 if rounding else np.asarray
        self.att_round = (to_bf16 if att == "bf16" else to_tf32) if rounding else np.asarray
        self.stored = []

    def allocate(self, plan, table):
        bufs = super().allocate(plan, table)
        if getattr(self.cfg, "grad_dtype", "fp32") == "bf16":
            self.stored.append(bufs.flat_grads)
        return bufs

    def allocate_arena(self, plan):
        acts = super().allocate_arena(plan)
        self.stored = [acts[n] for n in sorted(self.names) if n in acts] + self.stored
        missing = {"res", "mid", "ln1", "qkv", "atty", "ln2", "fc_pre", "lnf", "logits", "dres", "dln", "dqkv",
                   "dfc"} - self.names
        assert not missing, f"the memory plan no longer holds {missing} in bf16: revisit the simulation"
        return acts

    def _store(self):
        for a in self.stored:
            a[...] = self.r(a)

    def _rec(self, fn):
        def op():
            fn()
            self._store()
        super()._rec(op)

    def encoder_fwd(self, out, idx, wte, wpe):
        self._rec(lambda: out.__setitem__(Ellipsis, R.encoder_forward(idx, self.r(wte), self.r(wpe))))

    def matmul(self, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None, a_colsum=None):
        def f():
            A, Bm = self.r(_2d(a)), self.r(_2d(b))          # activations as stored, weights as the working copy
            if a_colsum is not None:
                a_colsum[...] = A.sum(axis=0)
            r = R.matmul_forward(A, Bm, trans_a, trans_b, bias)
            matmul_epilogue(_2d(out), r, epilogue, None if aux is None else _2d(aux), stored=self.r)
        self._rec(f)

    def _heads(self, qkv, n_head):
        q, k, v, hs = R._split_heads(qkv, n_head)
        scale = 1.0 / math.sqrt(hs)
        if self.att == "tf32" and self.r is to_bf16:     # flash_tc: tf32(Q * scale * log2 e) . K
            qs = to_tf32(q * scale * math.log2(math.e)) / math.log2(math.e)
        else:
            qs = q * scale
        return q, k, v, hs, qs

    def attention_fwd(self, y, qkv, saved, n_head, p, site):
        def f():
            B, T = qkv.shape[0], qkv.shape[1]
            keep = self._keep(site, (B, n_head, T, T), p, rows=True) if p > 0 else None
            q, k, v, hs, qs = self._heads(qkv, n_head)
            s = np.where(np.tril(np.ones((T, T), dtype=bool)), qs @ np.swapaxes(k, -1, -2), -np.inf)
            e = np.exp(s - s.max(axis=-1, keepdims=True))
            probs = e / e.sum(axis=-1, keepdims=True)
            y[...] = R._merge_heads(self.att_round(R.dropout_forward(probs, keep, rng.attention_rate(p))) @ v)
            saved["probs"][...] = probs
        self._rec(f)

    def attention_bwd(self, dqkv, dy, qkv, y, saved, n_head, p, site):
        def f():
            B, T = qkv.shape[0], qkv.shape[1]
            keep = self._keep(site, (B, n_head, T, T), p, rows=True) if p > 0 else None
            q, k, v, hs, _ = self._heads(qkv, n_head)
            probs = saved["probs"]
            dyh = np.asarray(dy).reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
            yh = np.asarray(y).reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)
            D = (dyh * yh).sum(axis=-1, keepdims=True)                     # rowsum(dO * O), O as stored
            dv = np.swapaxes(self.att_round(R.dropout_forward(probs, keep, rng.attention_rate(p))), -1, -2) @ dyh
            dprobs = R.dropout_backward(dyh @ np.swapaxes(v, -1, -2), keep, rng.attention_rate(p))
            ds = self.att_round(probs * (dprobs - D) / math.sqrt(hs))
            dq, dk = ds @ k, np.swapaxes(ds, -1, -2) @ q
            dqkv[...] = np.concatenate([R._merge_heads(dq), R._merge_heads(dk), R._merge_heads(dv)], axis=-1)
        self._rec(f)


def engine(cfg, sim, programs=("fwdbwd",), att="bf16"):
    """An Engine on the tokenizer's vocabulary rounded up to 8 (72), the loss masking the rest."""
    V = model_vocab(cfg, DATA.vocab_size)
    be = Bf16Sim(cfg, V, att) if sim else None
    return Engine(cfg, DATA.train, DATA.val, V, backend=be, programs=programs, n_vocab=DATA.vocab_size)


_GRADS = {}


def grads(cfg, sim, att="bf16", broken=()):
    """(loss, gradients) of one forward + backward on the gradcheck's batch (kept: several tests ask)."""
    key = (repr(cfg), sim, att, tuple(broken))
    if key not in _GRADS:
        _GRADS[key] = _grads(cfg, sim, att, broken)
    return _GRADS[key]


def _grads(cfg, sim, att, broken):
    faults.set_broken(broken)
    try:
        e = engine(cfg, sim, att=att)
    finally:
        faults.set_broken(())
    x, y = get_batch(DATA.train, cfg.seed, 0, rng.SITE_BATCH_TRAIN, cfg.batch_size, cfg.block_size)
    e.set_batch(x, y)
    e.run("fwdbwd")
    return e.state()["loss"], {k: np.asarray(v, np.float64) for k, v in e.grads().items()}


def errors(g, exact, coords=gc.COORDS_BF16):
    """Per tensor: (the error along u = g/||g|| as gradcheck sees it, | ||g|| - exact . u | / ||g||; the
    largest relative error of g's `coords` largest entries; rms(g - exact) / rms(exact))."""
    out = {}
    for name, e in exact.items():
        a = g[name]
        n = float(np.linalg.norm(a))
        if n == 0.0 or not np.any(e):
            continue
        along = abs(n - float(np.sum(e * a)) / n) / n
        fa, fe = a.reshape(-1), e.reshape(-1)
        top = np.argsort(-np.abs(fa), kind="stable")[:coords]
        entry = max(abs(fa[i] - fe[i]) / abs(fa[i]) for i in top)
        out[name] = (along, entry, float(np.sqrt(np.mean((a - e) ** 2)) / np.sqrt(np.mean(e ** 2))))
    return out


# ---- the rounding and the model's numbers ------------------------------------------------------

def test_one_rounding():
    """U = 2^-8 bounds one rounding to nearest (reached at the bottom of a binade), its mean is 0 (no
    truncation bias) and its rms is below RN_RMS U (0.58 U: the bottom of a binade; 0.42 U averaged)."""
    x = np.exp(np.random.default_rng(0).uniform(-8, 8, 400_000)) * np.random.default_rng(1).choice([-1, 1], 400_000)
    x = x.astype(np.float32).astype(np.float64)
    rel = (to_bf16(x) - x) / x
    assert gc.U_BF16 == U
    assert 0.99 * U < np.max(np.abs(rel)) <= U
    rms = float(np.sqrt(np.mean(rel ** 2)))
    assert 0.40 * U < rms < gc.RN_RMS * U
    assert abs(float(np.mean(rel))) < 5 * rms / math.sqrt(rel.size)          # no bias
    lo = np.abs(x) / 2.0 ** np.floor(np.log2(np.abs(x))) < 1 + 2.0 ** -7      # a binade's first ulp
    assert float(np.sqrt(np.mean(rel[lo] ** 2))) == pytest.approx(gc.RN_RMS * U, rel=0.03)


def chain_by_hand(L, d):
    return (3 + d) + 6 + (2 * L + 2 * d * L) + 3 + 2 + (2 * L + d) + 3


@pytest.mark.parametrize("L,drop", [(1, 0.0), (2, 0.0), (2, 0.1), (3, 0.1)])
def test_bf16_error_model_numbers(L, drop):
    cfg = cfg_of(f"--n_layer={L}", f"--dropout={drop}")
    m = gc.bf16_error_model(cfg, V72)
    d = int(drop > 0)
    assert m["chain"] == chain_by_hand(L, d) == 17 + 4 * L + d * (2 + 2 * L)
    assert m["bias"] == 0.0                                             # rounding to nearest
    one = U / math.sqrt(3)
    assert m["random"] == pytest.approx(math.sqrt(m["chain"]) * one, rel=1e-12)
    C, T, hs, B = 64, 16, 32, 4
    assert m["accum"] == pytest.approx((C + hs + T + C + C + V72 + C + hs + T + B * T) / 8 * 2.0 ** -23)
    assert m["beta"] == pytest.approx(m["random"] + m["accum"]) and m["beta_one"] == pytest.approx(3 * m["random"] + m["accum"])
    assert m["chain_fwd"] == 12 + 2 * L + d * (1 + 2 * L)
    assert m["beta_fwd"] == pytest.approx(math.sqrt(m["chain_fwd"]) * one, rel=1e-3)
    assert m["beta_fwd"] < m["beta"]


def test_bf16_model_values_in_the_docstring():
    """The numbers the module docstring states."""
    for L, drop, beta, beta_one in [(2, 0.1, 1.26e-2, 3.77e-2), (1, 0.0, 1.03e-2, 3.10e-2), (3, 0.1, 1.37e-2, 4.12e-2)]:
        m = gc.bf16_error_model(cfg_of(f"--n_layer={L}", f"--dropout={drop}"), V72)
        assert m["beta"] == pytest.approx(beta, abs=6e-5) and m["beta_one"] == pytest.approx(beta_one, abs=6e-5)
    assert gc.bf16_error_model(cfg_of("--n_layer=2", "--dropout=0"), V72)["chain"] == 25
    assert gc.bf16_error_model(cfg_of("--n_layer=2", "--dropout=0", "--grad_dtype=bf16"), V72)["chain"] == 26


def test_tf32_model_unchanged():
    cfg = cfg_of(backend="cuda")
    assert gc.error_model(dataclasses.replace(cfg, precision="tf32"), "tf32", 65) == gc.tf32_error_model(cfg, 65)
    assert gc.SETTINGS["tf32"] == dict(h=1e-2, eps=1.2e-7) and gc.SETTINGS["bf16"] == dict(h=1e-2, eps=1.2e-7)


def test_fd_config_of_bf16():
    cfg = cfg_of("--dropout=0.1", backend="cuda")
    assert gc.check_mode(cfg) == "bf16"
    f = gc.fd_config(cfg)
    assert f.precision == "fp32" and f.fp32_gemm == "3xtf32" and f.attention == "fused"
    assert (f.seed, f.dropout, f.vocab_multiple, f.n_embd) == (cfg.seed, 0.1, 8, 64)


# ---- the simulation against exact float64 --------------------------------------------------------

@pytest.mark.parametrize("drop", [0.0, 0.1])
def test_simulation_without_rounding_is_the_reference(drop):
    """The simulation's own ops (its attention, the epilogues, the stores) with every rounding the
    identity give the reference's loss and gradients: what it measures is the rounding alone."""
    cfg = cfg_of("--n_layer=2", "--n_embd=96", "--n_head=3", "--block_size=23", "--batch_size=3", f"--dropout={drop}")
    V = model_vocab(cfg, DATA.vocab_size)
    x, y = get_batch(DATA.train, cfg.seed, 0, rng.SITE_BATCH_TRAIN, cfg.batch_size, cfg.block_size)
    out = []
    for be in (Bf16Sim(cfg, V, rounding=False), None):
        e = Engine(cfg, DATA.train, DATA.val, V, backend=be, programs=("fwdbwd",), n_vocab=DATA.vocab_size)
        e.set_batch(x, y)
        e.run("fwdbwd")
        out.append((e.state()["loss"], e.grads()))
    (l0, g0), (l1, g1) = out
    assert l0 == pytest.approx(l1, rel=1e-13)
    for k in g1:
        assert np.allclose(g0[k], g1[k], rtol=1e-10, atol=1e-14 * np.max(np.abs(g1[k]))), k


def test_simulation_stores_bf16_and_moves_the_gradient():
    """Every entry the CUDA path holds in bf16 holds bf16 values after a forward + backward (so the
    rounding is applied where it stores), and the simulated gradient is off the exact one by about
    bf16's rounding (the check below has a real error to bound)."""
    cfg = cfg_of("--n_layer=2", "--n_embd=96", "--n_head=3", "--block_size=23", "--batch_size=3", "--dropout=0.1")
    e = engine(cfg, True)
    x, y = get_batch(DATA.train, cfg.seed, 0, rng.SITE_BATCH_TRAIN, cfg.batch_size, cfg.block_size)
    e.set_batch(x, y)
    e.run("fwdbwd")
    for name in e.be.names:
        a = np.asarray(e.bufs.acts[name])
        written = a[np.isfinite(a)]
        assert written.size, name
        assert np.array_equal(written, to_bf16(written)), f"{name} holds values that are not bf16"
    _, exact = grads(cfg, False)
    _, sim = grads(cfg, True)
    errs = errors(sim, exact)
    assert max(v[2] for v in errs.values()) > U            # rms error: a few roundings' worth
    assert max(v[0] for v in errs.values()) > 1e-4          # along u too


def test_simulation_rounds_bf16_gradients():
    """grad_dtype bf16: the simulated gradients hold bf16 values, and they are not the fp32 gradients' values
    (the rounding happened where they were written)."""
    cfg = cfg_of("--n_layer=2", "--n_embd=96", "--n_head=3", "--block_size=23", "--batch_size=3")
    _, g32 = grads(cfg, True)
    _, g16 = grads(dataclasses.replace(cfg, grad_dtype="bf16"), True)
    for k, g in g16.items():
        assert np.array_equal(g, to_bf16(g)), k
    assert any(not np.array_equal(g16[k], g32[k]) for k in g32)


def _cases():
    return [pytest.param(c, id=f"L{c['n_layer']}-C{c['n_embd']}-H{c['n_head']}-T{c['block_size']}-B{c['batch_size']}"
                         f"-p{c['dropout']}") for c in BF16_CASES]


@pytest.mark.parametrize("grad_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", _cases())
def test_model_bounds_the_simulation(case, grad_dtype):
    """At the GPU test's shapes: the simulated bf16 gradient errs along u by at most beta / 2, on the
    COORDS_BF16 largest entries by at most beta_one / 2, and in rms (relative to the tensor's) by at most
    the model's 1 sigma, in every tensor; with the bf16 flash kernel's roundings and with flash_tc's
    (TF32, today's); with fp32 gradients and with bf16 ones (grad_dtype: one rounding more)."""
    cfg = dataclasses.replace(case_cfg(case), grad_dtype=grad_dtype)
    m = gc.bf16_error_model(cfg, V72)
    _, exact = grads(cfg, False)
    for att in ("bf16", "tf32"):
        _, sim = grads(cfg, True, att=att)
        errs = errors(sim, exact)
        worst = [max(v[i] for v in errs.values()) for i in range(3)]
        assert worst[0] <= m["beta"] / 2, (att, worst, m["beta"])
        assert worst[1] <= m["beta_one"] / 2, (att, worst, m["beta_one"])
        assert worst[2] <= m["random"], (att, worst, m["random"])


# ---- the bf16 mode's code path --------------------------------------------------------------------

def simulated_engines(cfg, programs):
    """The gradient's engine (it records fwdbwd) is the bf16 simulation; the finite differences' engine
    the plain float64 reference, standing in for the fp32 one."""
    V = model_vocab(cfg, DATA.vocab_size)
    be = Bf16Sim(cfg, V) if "fwdbwd" in programs else None
    return Engine(cfg, DATA.train, DATA.val, V, backend=be, programs=programs, n_vocab=DATA.vocab_size)


def rows(lines):
    return [l.split() for l in lines if l.startswith(("h0.", "h1.", "h2.", "wte", "wpe", "lnf"))]


def test_bf16_mode_passes_simulated_gradients():
    lines = []
    cfg = case_cfg(BF16_BREAK_CASE)
    ok = gc.run_gradcheck(cfg, log=lines.append, mode="bf16", make_engine=simulated_engines)
    assert ok, "\n".join(lines)
    assert lines[0].startswith("gradcheck: reference backend, bf16, attention fused, dropout 0.1")
    assert "BF16 error model: 31 roundings to nearest" in lines[1]
    r = rows(lines)
    assert len(r) == 28 and all(x[-1] == "pass" for x in r)
    beta = gc.bf16_error_model(cfg, V72)["beta"]
    assert all(float(x[4]) >= beta for x in r)
    assert lines[-1] == "gradcheck PASSED"


UPSTREAM = ("wte", "wpe", "h0.", "h1.")


def test_bf16_mode_catches_the_break():
    """--break=layernorm at the GPU break test's shape: the tensors downstream of the broken op pass,
    most of those upstream fail (the GPU test asserts the same fraction)."""
    lines = []
    cfg = case_cfg(BF16_BREAK_CASE)
    assert not gc.run_gradcheck(cfg, broken=["layernorm"], log=lines.append, mode="bf16",
                                make_engine=simulated_engines)
    v = {x[0]: x[-1] for x in rows(lines)}
    assert v["lnf.w"] == v["lnf.b"] == "pass"
    upstream = [n for n in v if n.startswith(UPSTREAM)]
    failed = [n for n in upstream if v[n] == "FAIL"]
    assert len(failed) >= BF16_BREAK_FAILS * len(upstream), (len(failed), len(upstream), v)
    assert lines[-1] == "gradcheck FAILED" and not faults.broken


def test_break_errs_beyond_the_model():
    """How far the break moves the gradient, against the model, at the GPU test's shapes: along u
    beyond beta, or on one of the COORDS_BF16 largest entries beyond beta_one, for most tensors upstream
    of the final layernorm (178 of 194: gptcuda/training/gradcheck.py's docstring)."""
    beyond, total = 0, 0
    for case in BF16_CASES:
        cfg = case_cfg(case)
        m = gc.bf16_error_model(cfg, V72)
        _, exact = grads(cfg, False)
        _, broken = grads(cfg, True, broken=["layernorm"])
        for name, (along, entry, _) in errors(broken, exact).items():
            if not name.startswith("lnf"):
                total += 1
                beyond += along > m["beta"] or entry > m["beta_one"]
    assert beyond >= 0.85 * total, (beyond, total)


@pytest.mark.parametrize("case", _cases() + [pytest.param(BF16_BREAK_CASE, id="break-case")])
def test_gpu_engines_record_on_a_fake_device(case):
    """The engines the GPU test builds, recorded on the fake device (tests/fakes.py: every kernel a
    listed variant, every launch's arguments checked against the kernel's parameters): the bf16
    gradient's with the deliberately wrong layernorm backward (its bf16 variants, GC_BREAK_LAYERNORM),
    and the fp32 finite differences' engine."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from gptcuda.ops.cuda_backend import CudaBackend
    from tests.fakes import RecordingRuntime
    cfg = dataclasses.replace(case_cfg(case), backend="cuda")
    toks = np.arange(1000, dtype=np.int32) % 65
    faults.set_broken(["layernorm"])
    try:
        rt = RecordingRuntime(cfg)
        Engine(cfg, toks, toks[:200], V72, backend=CudaBackend(cfg, rt=rt), programs=("fwdbwd", "forward_train"),
               n_vocab=65, tune=False)
    finally:
        faults.set_broken(())
    broken = [k for k in rt._functions if k[0] == "layernorm.cu" and k[2] == (("GC_BREAK_LAYERNORM", 1),)]
    assert broken and all(k[1].startswith("layernorm_bwd") and k[1].endswith(", 1, 1, 1, 1>") for k in broken)
    fcfg = gc.fd_config(cfg)
    rt32 = RecordingRuntime(fcfg)
    e = Engine(fcfg, toks, toks[:200], V72, backend=CudaBackend(fcfg, rt=rt32), programs=("forward_train",),
               n_vocab=65, tune=False)
    assert e.exec.precision == "fp32" and e.bufs.acts["res"].dtype == "f32"


# ---- the golden test's bf16 case ------------------------------------------------------------------

def test_golden_bf16_case_is_well_formed():
    """The golden test's bf16 overrides resolve on configs/tiny.yaml for the CUDA backend: bf16 on the
    warpgroup-MMA family, fused attention, the vocabulary 65 -> 72, a bf16 memory plan."""
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), golden.BF16 + ["--backend=cuda", "--max_iters=10"])
    ex = execution.resolve(cfg, arch="sm_90")
    assert (ex.precision, ex.gemm_family, ex.attention, ex.act_dtype) == ("bf16", "bf16", "flash_tc", "bf16")
    V = model_vocab(cfg, DATA.vocab_size)
    assert V == 72 and V % 8 == 0
    plan = plan_for(cfg, V)
    assert plan["logits"].shape == (4, 16, 72) and plan["logits"].dtype == "bf16"
    assert plan["params_bf16"].dtype == "bf16"
    with pytest.raises(ValueError):
        execution.resolve(cfg, arch="sm_80")             # bf16 needs the H200's warpgroup MMA


def test_golden_bf16_tolerances_hold_for_the_simulation():
    """The golden test's bf16 comparison run between the simulation and the float64 reference: logits,
    every gradient and ten AdamW losses within its tolerances, each within 2/3 of its bound (room for
    what the GPU does otherwise: fp32 arithmetic, another summation order, TF32 attention today)."""
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), golden.BF16 + [
        f"--data={ROOT / 'data/tinyshakespeare/input.txt'}", "--backend=reference", "--max_iters=10"])
    progs = ("train", "forward", "fwdbwd")
    sim, ref = engine(cfg, True, progs), engine(cfg, False, progs)
    ratios = golden.compare_bf16(sim, ref, DATA)
    assert max(ratios.values()) <= 2 / 3, ratios
    assert min(ratios.values()) > 0.0, ratios                 # the simulation differs: the check saw something


# ---- the command line ------------------------------------------------------------------------------

@pytest.mark.parametrize("args,key", [
    (["--precision=bf16"], "attention"),
    (["--precision=bf16", "--attention=fused"], "vocab_multiple"),
    (["--precision=bf16", "--attention=fused", "--vocab_multiple=8", "--n_embd=36", "--n_head=3"], "n_embd"),
])
def test_bf16_config_errors_are_one_line(capsys, args, key):
    """bf16's rules (fused attention, a vocabulary and a width that are multiples of 8) refuse a config
    in one line naming the key, exit code 2, before any engine is built."""
    import gradcheck as script
    assert script.main(args) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and key in out.err and "Traceback" not in out.err


def test_bf16_without_a_gpu_is_one_line(capsys):
    """A well-formed bf16 gradcheck is no longer refused: without a GPU it stops as every CUDA run does."""
    from conftest import has_gpu
    if has_gpu():
        pytest.skip("a GPU is here: tests/gpu/test_gradcheck_gpu.py runs the bf16 check")
    import gradcheck as script
    assert script.main(["--precision=bf16", "--attention=fused", "--vocab_multiple=8"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error model" not in err and "--backend=reference" in err
