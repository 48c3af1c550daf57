"""GPU tests of the bf16 variants of kernels/layernorm.cu and kernels/elementwise.cu against float64 numpy.

Every input is random (no zeros) and, where its tensor is bf16, exact in bf16 (rounded once on the host,
then uploaded): the float64 reference is computed from the very values the kernel reads. Outputs are
poisoned before the run (rt.empty fills NaN; a value never written fails every check).

Error model. Each kernel computes in fp32 what its fp32 variant computes and rounds once where it stores
bf16, to nearest even; so against the float64 reference:
  * an fp32 output is off by the fp32 computation's error only: the bound of the fp32 variants' tests
    (tests/gpu/test_layernorm.py, test_elementwise.py), FP32 times max|ref|;
  * a bf16 output adds one rounding, at most U = 2^-8 of the value (bf16 keeps 8 significant bits):
    |out - ref| <= U |ref| + FP32 max|ref|, element by element (tests/conftest.py bf16_err; a truncating
    kernel fails it);
  * where the fp32 arithmetic is a single operation (dropout's x * scale, accumulate's dst + src), numpy
    does the same fp32 operation and rounds the same way: equal bit for bit;
  * the statistics (mean, rstd) and the parameter gradients (dw, db) are fp32 sums of widened values:
    the fp32 tests' bounds, and bitwise reproducible.
The bias gradient of a bf16 dout is tested with the fp32 one (test_elementwise.py test_bias_grad).
"""
import numpy as np
import pytest

from gptcuda.config import config_of
from gptcuda.model import rng
from gptcuda.ops.cuda import elementwise as ew
from gptcuda.ops.cuda import layernorm as ln
from gptcuda.ops.reference import ops as ref
from gptcuda.runtime import bf16
from tests.conftest import bf16_err, rel_err, shifted_view

pytestmark = pytest.mark.gpu

SIZE = {"f32": 4, "bf16": 2}
STEP = 9
P = 0.2                            # dropout: scale 1 / (1 - p) = 1.25, exact in fp32


@pytest.fixture
def bf_rt(env):
    """The session runtime (conftest's env: rt.state restored after) at step STEP, with the layernorm and
    elementwise workspaces planned for C <= 1040 (restored after)."""
    rt = env
    rt.state = rt.upload(np.array([STEP] + [0] * 15, np.int32))         # the StepState's step
    saved = dict(getattr(rt, "_workspace", {}))
    cfg = config_of(check=False, batch_size=1, block_size=1, n_embd=1040, n_head=1, n_layer=1, vocab_size=4160,
                    attention="unfused")
    views = {n: rt.empty(shape, dtype, name=n) for fam in (ln, ew) for n, (shape, dtype) in fam.workspace(cfg).items()}
    rt.set_workspace({**saved, **views})
    yield rt
    rt.set_workspace(saved)


def _randn(r, shape, dtype, scale=1.0, shift=0.0):
    """Random values with no zeros, exact in dtype (float32 holding them)."""
    x = (r.standard_normal(shape) * scale + shift).astype(np.float32)
    x[x == 0] = 0.5
    return bf16.round_f32(x) if dtype == "bf16" else x


def _up(rt, vals, dtype, shift=0):
    """A view of dtype holding vals, `shift` elements past its allocation's start (1 bf16: 2-byte
    aligned, the scalar kernels; 4 bf16: 8-byte aligned, the 4-value paths)."""
    return shifted_view(rt, vals.shape, dtype, shift * SIZE[dtype], vals)


def _empty(rt, shape, dtype, shift=0):
    return shifted_view(rt, shape, dtype, shift * SIZE[dtype])               # poisoned: NaN


def _down(rt, v):
    """The view's values as float64 (bf16 widened exactly)."""
    h = rt.download(v)
    return (bf16.values(h) if v.dtype == "bf16" else h).astype(np.float64).reshape(v.shape)


def _bits(rt, v):
    return rt.download(v).view(np.uint16 if v.dtype == "bf16" else np.uint32)


def _check(got, want, fp32, dtype):
    """The error model: an fp32 output within fp32 * max|ref| (rel_err), a bf16 one within one rounding
    more, U |ref| + fp32 * max|ref| element by element (bf16_err)."""
    err = bf16_err(got, want, fp32) if dtype == "bf16" else rel_err(got, want) / fp32
    assert err <= 1, f"{dtype} output: {err:.3g} times the error model's bound (NaN: an output never written)"


def _keep(rt, n, p):
    return rng.dropout_mask(rt.seed, STEP, SITE, n, p)


def _scale(p):
    return np.float32(1.0 / (1.0 - p))           # the kernels' scale (dropout_args: f32(1 / (1 - p)))


SITE = rng.dropout_site(1, 2)
BF16_FWD = [t for t in ln.FWD_TYPES if "bf16" in t]
BF16_BWD = [t for t in ln.BWD_TYPES if "bf16" in t]
# (leading dims, C): register path NV 1 (a lane tail), 2 (tail), 3, 8; the loop kernels for odd C and C > 1024
LN_CASES = [((5,), 4), ((3, 11), 200), ((4, 64), 384), ((2, 9), 1024), ((7, 3), 37), ((6,), 1030)]


# ---- layernorm -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead,C", LN_CASES)
@pytest.mark.parametrize("types", BF16_FWD, ids="-".join)
def test_layernorm_fwd_bf16(bf_rt, types, lead, C, bias):
    """out (bf16) = one rounding of the fp32 layernorm of x (fp32 or bf16); mean and rstd fp32."""
    rt = bf_rt
    tx, _, to = types
    r = np.random.default_rng(C + 7 * len(lead))
    x_h = _randn(r, (*lead, C), tx, 2.0, 0.7)                     # a non-zero mean
    w_h, b_h = _randn(r, (C,), "f32"), _randn(r, (C,), "f32")
    out, mean, rstd = _empty(rt, (*lead, C), to), _empty(rt, lead, "f32"), _empty(rt, lead, "f32")
    ln.layernorm_fwd(rt, out, mean, rstd, _up(rt, x_h, tx), rt.upload(w_h), rt.upload(b_h) if bias else None)
    ro, rm, rr = ref.layernorm_forward(x_h, w_h, b_h if bias else None)
    assert rel_err(_down(rt, mean), rm) < 1e-5 and rel_err(_down(rt, rstd), rr) < 1e-5
    _check(_down(rt, out), ro, 1e-5, to)


@pytest.mark.parametrize("lead,C", [((4, 64), 384), ((3, 11), 200), ((7, 3), 37), ((6,), 1030)])
@pytest.mark.parametrize("types", BF16_FWD, ids="-".join)
def test_layernorm_fwd_residual_dropout_bf16(bf_rt, types, lead, C):
    """With residual = (resid, branch, p, site): x = resid + dropout(branch), rounded once to x's type,
    and the layernorm of x as stored; bit for bit residual_dropout followed by the plain layernorm
    (register kernels: fused; loop kernels: made first in either case)."""
    rt = bf_rt
    tx, tb, to = types
    r = np.random.default_rng(11 * C + len(lead))
    resid_h, branch_h = _randn(r, (*lead, C), tx, 2.0, 0.7), _randn(r, (*lead, C), tb)
    w_h, b_h = _randn(r, (C,), "f32"), _randn(r, (C,), "f32")
    resid, branch, w, b = _up(rt, resid_h, tx), _up(rt, branch_h, tb), rt.upload(w_h), rt.upload(b_h)
    outs = []
    for fused in (False, True):
        x, out, mean, rstd = _empty(rt, (*lead, C), tx), _empty(rt, (*lead, C), to), rt.empty(lead), rt.empty(lead)
        if fused:
            ln.layernorm_fwd(rt, out, mean, rstd, x, w, b, residual=(resid, branch, P, SITE))
        else:
            ew.residual_dropout(rt, x, resid, branch, P, SITE)
            ln.layernorm_fwd(rt, out, mean, rstd, x, w, b)
        outs.append([_bits(rt, v) for v in (x, out, mean, rstd)] + [_down(rt, x), _down(rt, out)])
    for a, b_ in zip(outs[0][:4], outs[1][:4]):
        assert np.array_equal(a, b_)
    keep = _keep(rt, resid_h.size, P).reshape(resid_h.shape)
    _check(outs[1][4], resid_h.astype(np.float64) + ref.dropout_forward(branch_h, keep, P), 1e-6, tx)
    _check(outs[1][5], ref.layernorm_forward(outs[1][4], w_h, b_h)[0], 1e-5, to)


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead,C", LN_CASES)
@pytest.mark.parametrize("types", BF16_BWD, ids="-".join)
def test_layernorm_bwd_bf16(bf_rt, types, lead, C, bias, drop):
    """dx (+=, read and stored in its type: one rounding of the fp32 sum where bf16), dw and db fp32
    (bitwise reproducible); dropped = dropout_bwd of dx as stored: its fp32 product x * 1.25, rounded
    to dropped's type, equal bit for bit to numpy's; ds (with db), the column sums of the branch gradient
    (dropped, else dx) as stored."""
    rt = bf_rt
    tdo, tx, tdx, tdr = types
    r = np.random.default_rng(3 * C + len(lead) + 100 * drop)
    x_h = _randn(r, (*lead, C), tx, 2.0, 0.7)
    w_h, dout_h, dx0 = _randn(r, (C,), "f32"), _randn(r, (*lead, C), tdo), _randn(r, (*lead, C), tdx)
    _, m64, r64 = ref.layernorm_forward(x_h, w_h, None)
    mean_h, rstd_h = m64.astype(np.float32), r64.astype(np.float32)
    rdx, rdw, rdb = ref.layernorm_backward(dout_h, x_h, mean_h, rstd_h, w_h)
    x, dout, w = _up(rt, x_h, tx), _up(rt, dout_h, tdo), rt.upload(w_h)
    mean, rstd = rt.upload(mean_h), rt.upload(rstd_h)
    runs = []
    for _ in range(2):
        dx, dw, db = _up(rt, dx0, tdx), rt.empty((C,)), rt.empty((C,)) if bias else None
        ds = rt.empty((C,)) if bias else None
        dropped = _empty(rt, (*lead, C), tdr) if drop else None
        ln.layernorm_bwd(rt, dx, dw, db, dout, x, mean, rstd, w, (dropped, P, SITE) if drop else None, ds=ds)
        runs.append([_bits(rt, v) for v in (dx, dw, db, ds, dropped) if v is not None])
        got_dx = _down(rt, dx)
        _check(got_dx, dx0.astype(np.float64) + rdx, 1e-5, tdx)
        assert rel_err(_down(rt, dw), rdw) < 3e-5
        if bias:
            assert rel_err(_down(rt, db), rdb) < 3e-5
            branch = _down(rt, dropped) if drop else got_dx
            assert rel_err(_down(rt, ds), branch.astype(np.float64).reshape(-1, C).sum(0)) < 1e-5
        if drop:
            keep = _keep(rt, x_h.size, P).reshape(x_h.shape)
            want = np.where(keep, got_dx.astype(np.float32) * _scale(P), np.float32(0))
            want = bf16.bits(want) if tdr == "bf16" else want.view(np.uint32)
            assert np.array_equal(runs[-1][-1].reshape(want.shape), want)
    for a, b_ in zip(*runs):
        assert np.array_equal(a, b_)


@pytest.mark.parametrize("shift", [4, 1])               # 8 bytes: register kernels; 2 bytes: loop kernels
def test_layernorm_bf16_alignment(bf_rt, shift):
    """bf16 views aligned to 8 bytes but not 16 take the register kernels (4 values a lane move as 8
    bytes), views 2 bytes off the loop kernels: the same values either way, within the error model."""
    rt = bf_rt
    lead, C = (4, 33), 384
    r = np.random.default_rng(shift)
    x_h, dout_h, dx0 = (_randn(r, (*lead, C), "bf16", 2.0, 0.7), _randn(r, (*lead, C), "bf16"),
                        _randn(r, (*lead, C), "bf16"))
    w_h, b_h = _randn(r, (C,), "f32"), _randn(r, (C,), "f32")
    w, b = rt.upload(w_h), rt.upload(b_h)
    x = _up(rt, x_h, "bf16", shift)
    out, mean, rstd = _empty(rt, (*lead, C), "bf16", shift), rt.empty(lead), rt.empty(lead)
    ln.layernorm_fwd(rt, out, mean, rstd, x, w, b)
    ro, rm, rr = ref.layernorm_forward(x_h, w_h, b_h)
    _check(_down(rt, out), ro, 1e-5, "bf16")
    dx, dw, db = _up(rt, dx0, "bf16", shift), rt.empty((C,)), rt.empty((C,))
    ln.layernorm_bwd(rt, dx, dw, db, _up(rt, dout_h, "bf16", shift), x, mean, rstd, w)
    rdx, rdw, rdb = ref.layernorm_backward(dout_h, x_h, _down(rt, mean), _down(rt, rstd), w_h)
    _check(_down(rt, dx), dx0.astype(np.float64) + rdx, 1e-5, "bf16")
    assert rel_err(_down(rt, dw), rdw) < 3e-5 and rel_err(_down(rt, db), rdb) < 3e-5


# ---- elementwise ---------------------------------------------------------------------------------------
EW_SIZES = [(64, 256, 384), (4099,), (3, 5, 7), (1,), (6,)]
SHIFTS = [0, 4, 1]                 # bf16 elements: 16-byte, 8-byte (4-value path), 2-byte (scalar kernels)


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("shape", EW_SIZES)
def test_gelu_bf16(bf_rt, shape, shift):
    rt = bf_rt
    r = np.random.default_rng(len(shape) + int(np.prod(shape)) + shift)
    x_h, d_h = _randn(r, shape, "bf16", 2.0), _randn(r, shape, "bf16")
    x = _up(rt, x_h, "bf16", shift)
    out = _empty(rt, shape, "bf16", shift)
    ew.gelu_fwd(rt, out, x)
    _check(_down(rt, out), ref.gelu_forward(x_h), 1e-5, "bf16")
    dpre, dout = _empty(rt, shape, "bf16", shift), _up(rt, d_h, "bf16", shift)
    ew.gelu_bwd(rt, dpre, dout, x)
    want = ref.gelu_backward(d_h, x_h)
    _check(_down(rt, dpre), want, 1e-5, "bf16")
    ew.gelu_bwd(rt, dout, dout, x)                   # in place
    assert np.array_equal(_bits(rt, dout), _bits(rt, dpre))


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("shape", EW_SIZES)
def test_dropout_bf16(bf_rt, shape, p, shift):
    """out = x * scale (one fp32 product) where kept, 0 elsewhere, rounded to bf16: numpy's bit for bit;
    forward, backward in place, p = 0 a copy."""
    rt = bf_rt
    r = np.random.default_rng(int(np.prod(shape)) + int(p * 10) + shift)
    x_h, d_h = _randn(r, shape, "bf16"), _randn(r, shape, "bf16")
    keep = _keep(rt, x_h.size, p).reshape(shape) if p > 0 else np.ones(shape, bool)

    def want(v):
        return bf16.bits(np.where(keep, v * _scale(p), np.float32(0)))
    out = _empty(rt, shape, "bf16", shift)
    ew.dropout_fwd(rt, out, _up(rt, x_h, "bf16", shift), p, SITE)
    assert np.array_equal(_bits(rt, out).reshape(shape), want(x_h))
    d = _up(rt, d_h, "bf16", shift)
    ew.dropout_bwd(rt, d, d, p, SITE)
    assert np.array_equal(_bits(rt, d).reshape(shape), want(d_h))


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("shape", EW_SIZES)
@pytest.mark.parametrize("types", [t for t in ew.RESIDUAL_TYPES if "bf16" in t], ids="-".join)
def test_residual_dropout_bf16(bf_rt, types, shape, p, shift):
    """out = resid + dropout(x) in fp32, rounded once to out's type; out may alias resid (its type)."""
    rt = bf_rt
    to, tr, tx = types
    r = np.random.default_rng(5 + int(np.prod(shape)) + shift)
    x_h, res_h = _randn(r, shape, tx), _randn(r, shape, tr)
    keep = _keep(rt, x_h.size, p).reshape(shape) if p > 0 else None
    want = res_h.astype(np.float64) + ref.dropout_forward(x_h, keep, p)
    x, res = _up(rt, x_h, tx, shift), _up(rt, res_h, tr, shift)
    out = _empty(rt, shape, to, shift)
    ew.residual_dropout(rt, out, res, x, p, SITE)
    _check(_down(rt, out), want, 1e-6, to)
    ew.residual_dropout(rt, res, res, x, p, SITE)     # out aliases resid (the model's x = x + drop(f))
    assert np.array_equal(_bits(rt, res), _bits(rt, out))


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("shape", EW_SIZES)
def test_accumulate_bf16(bf_rt, shape, shift):
    """dst = src exactly (first), dst = dst + src: one fp32 sum rounded to bf16, numpy's bit for bit."""
    rt = bf_rt
    r = np.random.default_rng(17 + int(np.prod(shape)) + shift)
    a_h, b_h = _randn(r, shape, "bf16"), _randn(r, shape, "bf16", 0.01)
    dst, src = _empty(rt, shape, "bf16", shift), _up(rt, b_h, "bf16", shift)
    ew.accumulate(rt, dst, src, True)
    assert np.array_equal(_bits(rt, dst).reshape(shape), bf16.bits(b_h))
    dst = _up(rt, a_h, "bf16", shift)
    ew.accumulate(rt, dst, src, False)
    assert np.array_equal(_bits(rt, dst).reshape(shape), bf16.bits(a_h + b_h))     # a_h + b_h: an fp32 sum

