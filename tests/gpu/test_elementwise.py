"""GPU tests of kernels/elementwise.cu: GELU, dropout (exact masks), residual dropout, bias gradient."""

import numpy as np
import pytest

from gptcuda.model import rng
from gptcuda.ops.cuda import elementwise as ew
from gptcuda.ops.reference import ops as ref
from gptcuda.runtime import DeviceView, bf16
from tests.conftest import rel_err
from gptcuda.config import config_of

pytestmark = pytest.mark.gpu

STEP = 11
SITE = rng.dropout_site(1, 2)
SIZES = [(64, 256, 384), (4099,), (3, 5, 7), (1,), (6,)]


@pytest.fixture
def env(rt):
    saved = (rt.state, dict(getattr(rt, "_workspace", {})))
    st = np.zeros(16, np.int32)
    st[0] = STEP
    rt.state = rt.upload(st)
    yield rt
    rt.state = saved[0]
    rt.set_workspace(saved[1])


def _randn(r, *shape):
    x = r.standard_normal(shape).astype(np.float32)
    x[x == 0] = 0.5
    return x


def _upload(rt, arr, misalign=False, dtype="f32"):
    """Upload arr (as dtype); with misalign the view starts 4 bytes into its allocation (forces the
    scalar kernels: 4-value accesses need 16 bytes of alignment in fp32, 8 in bf16)."""
    if not misalign:
        return rt.upload(arr, dtype)
    pad = 1 if dtype == "f32" else 2
    flat = np.concatenate([np.full(pad, 9.0, np.float32), np.asarray(arr, np.float32).reshape(-1)])
    base = rt.upload(flat, dtype)
    return DeviceView(base.ptr + 4, tuple(arr.shape), dtype, "misaligned")


def _empty(rt, shape, misalign=False):
    if not misalign:
        return rt.empty(shape)
    base = rt.empty((int(np.prod(shape)) + 1,))
    return DeviceView(base.ptr + 4, tuple(shape), "f32", "misaligned")


@pytest.mark.parametrize("misalign", [False, True])
@pytest.mark.parametrize("shape", SIZES)
def test_gelu(env, shape, misalign):
    rt = env
    r = np.random.default_rng(len(shape) + int(np.prod(shape)))
    x_h = _randn(r, *shape) * 2.0
    d_h = _randn(r, *shape)
    x = _upload(rt, x_h, misalign)
    out = _empty(rt, shape, misalign)
    ew.gelu_fwd(rt, out, x)
    assert rel_err(rt.download(out), ref.gelu_forward(x_h)) < 1e-5
    dpre = _empty(rt, shape, misalign)
    dout = _upload(rt, d_h, misalign)
    ew.gelu_bwd(rt, dpre, dout, x)
    want = ref.gelu_backward(d_h, x_h)
    assert rel_err(rt.download(dpre), want) < 1e-5
    ew.gelu_bwd(rt, dout, dout, x)                   # in place
    assert rel_err(rt.download(dout), want) < 1e-5


def _keep(rt, n, p):
    return rng.dropout_mask(rt.seed, STEP, SITE, n, p)


@pytest.mark.parametrize("misalign", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("shape", SIZES)
def test_dropout(env, shape, p, misalign):
    rt = env
    r = np.random.default_rng(int(np.prod(shape)) + int(p * 10))
    x_h = _randn(r, *shape)
    n = x_h.size
    keep = _keep(rt, n, p).reshape(shape)
    want = ref.dropout_forward(x_h, keep, p)
    x = _upload(rt, x_h, misalign)
    out = _empty(rt, shape, misalign)
    ew.dropout_fwd(rt, out, x, p, SITE)
    got = rt.download(out)
    assert rel_err(got, want) < 1e-6
    if p > 0:
        assert np.array_equal(got != 0, keep)        # the exact mask (x has no zeros)
    # backward, in place
    d_h = _randn(r, *shape)
    d = _upload(rt, d_h, misalign)
    ew.dropout_bwd(rt, d, d, p, SITE)
    got = rt.download(d)
    assert rel_err(got, ref.dropout_backward(d_h, keep, p)) < 1e-6
    if p > 0:
        assert np.array_equal(got != 0, keep)
    # forward in place (p == 0: nothing to do)
    ew.dropout_fwd(rt, x, x, p, SITE)
    assert rel_err(rt.download(x), want) < 1e-6


@pytest.mark.parametrize("misalign", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("shape", SIZES)
def test_residual_dropout(env, shape, p, misalign):
    rt = env
    r = np.random.default_rng(5 + int(np.prod(shape)))
    x_h, res_h = _randn(r, *shape), _randn(r, *shape)
    keep = _keep(rt, x_h.size, p).reshape(shape)
    want = res_h.astype(np.float64) + ref.dropout_forward(x_h, keep, p)
    x, res = _upload(rt, x_h, misalign), _upload(rt, res_h, misalign)
    out = _empty(rt, shape, misalign)
    ew.residual_dropout(rt, out, res, x, p, SITE)
    assert rel_err(rt.download(out), want) < 1e-6
    ew.residual_dropout(rt, res, res, x, p, SITE)     # out aliases resid (the model's x = x + drop(f))
    assert rel_err(rt.download(res), want) < 1e-6
    res2 = _upload(rt, res_h, misalign)
    ew.residual_dropout(rt, x, res2, x, p, SITE)      # out aliases x
    assert rel_err(rt.download(x), want) < 1e-6


def test_dropout_other_step_other_mask(env):
    rt = env
    n = 4096
    x = rt.upload(np.ones(n, np.float32))
    out = rt.empty((n,))
    st = np.zeros(16, np.int32)
    st[0] = STEP + 1
    rt.state = rt.upload(st)
    ew.dropout_fwd(rt, out, x, 0.5, SITE)
    got = rt.download(out) != 0
    assert np.array_equal(got, rng.dropout_mask(rt.seed, STEP + 1, SITE, n, 0.5))
    assert not np.array_equal(got, rng.dropout_mask(rt.seed, STEP, SITE, n, 0.5))


def _plan_bias(rt, width):
    cfg = config_of(check=False, batch_size=1, block_size=1, n_embd=4 * ((width + 15) // 16), n_head=1, n_layer=1,
                          vocab_size=width, attention="unfused")
    views = {n: rt.empty(shape, dtype, name=n) for n, (shape, dtype) in ew.workspace(cfg).items()}
    rt.set_workspace({**getattr(rt, "_workspace", {}), **views})


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("misalign", [False, True])
@pytest.mark.parametrize("M,N", [(16384, 384), (2048, 1536), (37, 13), (1000, 1155), (1, 4), (300, 1)])
def test_bias_grad(env, M, N, misalign, dtype):
    """db (fp32) = dout's column sums in fp32: within the fp32 summation's error of the float64 sums
    of the same values (a bf16 dout's values are exact in fp32), bitwise reproducible."""
    rt = env
    _plan_bias(rt, N)
    r = np.random.default_rng(M + N)
    d_h = _randn(r, M, N)
    if dtype == "bf16":
        d_h = bf16.round_f32(d_h)                     # the values the bf16 tensor holds
    d = _upload(rt, d_h, misalign, dtype)
    outs = []
    for _ in range(2):
        db = rt.empty((N,))
        ew.bias_grad(rt, db, d)
        outs.append(rt.download(db))
    assert rel_err(outs[0], d_h.astype(np.float64).sum(0)) < 2e-5
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


def test_bias_grad_3d(env):
    rt = env
    _plan_bias(rt, 96)
    r = np.random.default_rng(1)
    d_h = _randn(r, 4, 33, 96)
    db = rt.empty((96,))
    ew.bias_grad(rt, db, rt.upload(d_h))
    assert rel_err(rt.download(db), d_h.astype(np.float64).reshape(-1, 96).sum(0)) < 1e-5


@pytest.mark.parametrize("ring", ["planned", "small"])
def test_held_sums_equal_immediate(env, ring):
    """Bias and layernorm weight gradients held (defer_sums) and made at flush_sums, SUM_ITEMS a launch,
    equal the ones made at once bit for bit: more sums than one launch takes, and ("small") a ring
    that fills up and is flushed on the way; nothing is written before the flush."""
    from gptcuda.ops.cuda import layernorm as ln
    rt = env
    C, N = 768, 3000
    cfg = config_of(check=False, batch_size=1, block_size=1, n_embd=C, n_head=1, n_layer=1, vocab_size=4 * C,
                          attention="unfused")
    views = {n: rt.empty(shape, dtype, name=n)
             for fam in (ew, ln) for n, (shape, dtype) in fam.workspace(cfg).items()}
    if ring == "small":                    # room for about two sums at a time
        views[ew.SUMS] = rt.empty((2 * ln.MAX_BLOCKS * 2 * C // 3,), name=ew.SUMS)
    rt.set_workspace({**getattr(rt, "_workspace", {}), **views})
    r = np.random.default_rng(7)
    ds = [rt.upload(_randn(r, N, w)) for w in (C, 4 * C, 37, 3 * C, C, 1000, 4 * C, C, 5, 2 * C, C)]
    x_h = _randn(r, N, C) * 2.0 + 0.7
    w_h, dout_h = _randn(r, C), _randn(r, N, C)
    _, m64, r64 = ref.layernorm_forward(x_h, w_h, None)
    x, w, dout = rt.upload(x_h), rt.upload(w_h), rt.upload(dout_h)
    mean, rstd = rt.upload(m64.astype(np.float32)), rt.upload(r64.astype(np.float32))

    def run(hold):
        outs = [rt.empty((int(d.shape[-1]),)) for d in ds] + [rt.empty((C,)) for _ in range(4)]
        for o in outs:
            rt.fill(o, 0x7FC00000)                    # NaN: a sum never made shows
        if hold:
            ew.defer_sums(rt, True)
        for d, o in zip(ds, outs):
            ew.bias_grad(rt, o, d)
        for k in range(2):
            ln.layernorm_bwd(rt, rt.empty((N, C)), outs[len(ds) + 2 * k], outs[len(ds) + 2 * k + 1], dout, x, mean,
                             rstd, w)
        if hold:
            assert ring == "small" or np.isnan(rt.download(outs[0])).all()    # held until the flush
            ew.flush_sums(rt)
            ew.defer_sums(rt, False)
        return [rt.download(o) for o in outs]

    now, held = run(False), run(True)
    assert getattr(rt, "held_sums", None) is None
    for a, b in zip(now, held):
        assert not np.isnan(a).any() and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert rel_err(now[1], rt.download(ds[1]).astype(np.float64).sum(0)) < 2e-5
