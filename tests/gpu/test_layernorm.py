"""GPU tests of kernels/layernorm.cu against the float64 reference."""

import numpy as np
import pytest

from gptcuda.ops.cuda import layernorm as ln
from gptcuda.ops.reference import ops as ref
from tests.conftest import rel_err
from gptcuda.config import config_of

pytestmark = pytest.mark.gpu

# (leading dims, C): register path for C % 4 == 0 and C <= 1024 (NV = 1..8, with lane tails),
# the loop kernels for odd C and C > 1024
CASES = [
    ((4, 64), 384),
    ((37,), 128),
    ((3, 11), 200),
    ((5,), 4),
    ((2, 9), 1024),
    ((13,), 900),
    ((7, 3), 37),
    ((6,), 1030),
    ((3,), 2048),
    ((2048,), 384),
]


@pytest.fixture
def env(rt):
    saved = (rt.state, dict(getattr(rt, "_workspace", {})))
    yield rt
    rt.state = saved[0]
    rt.set_workspace(saved[1])


def _plan(rt, C):
    cfg = config_of(check=False, batch_size=1, block_size=1, n_embd=C, n_head=1, n_layer=1, vocab_size=65,
                          attention="unfused")
    views = {n: rt.empty(shape, dtype, name=n) for n, (shape, dtype) in ln.workspace(cfg).items()}
    rt.set_workspace({**getattr(rt, "_workspace", {}), **views})


def _randn(r, *shape):
    x = r.standard_normal(shape).astype(np.float32)
    x[x == 0] = 0.5
    return x


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead,C", CASES)
def test_layernorm_fwd(env, lead, C, bias):
    rt = env
    r = np.random.default_rng(C + len(lead))
    x_h = _randn(r, *lead, C) * 2.0 + 0.7           # non-zero mean
    w_h, b_h = _randn(r, C), _randn(r, C)
    x, w = rt.upload(x_h), rt.upload(w_h)
    b = rt.upload(b_h) if bias else None
    out, mean, rstd = rt.empty((*lead, C)), rt.empty(lead), rt.empty(lead)
    ln.layernorm_fwd(rt, out, mean, rstd, x, w, b)
    ro, rm, rr = ref.layernorm_forward(x_h, w_h, b_h if bias else None)
    assert rel_err(rt.download(out), ro) < 1e-5
    assert rel_err(rt.download(mean), rm) < 1e-5
    assert rel_err(rt.download(rstd), rr) < 1e-5


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead,C", CASES)
def test_layernorm_bwd(env, lead, C, bias):
    rt = env
    _plan(rt, C)
    r = np.random.default_rng(3 * C + len(lead))
    x_h = _randn(r, *lead, C) * 2.0 + 0.7
    w_h, dout_h = _randn(r, C), _randn(r, *lead, C)
    dx0 = _randn(r, *lead, C)                         # dx accumulates (residual gradient)
    _, m64, r64 = ref.layernorm_forward(x_h, w_h, None)
    mean_h, rstd_h = m64.astype(np.float32), r64.astype(np.float32)
    rdx, rdw, rdb = ref.layernorm_backward(dout_h, x_h, mean_h, rstd_h, w_h)
    x, w, dout = rt.upload(x_h), rt.upload(w_h), rt.upload(dout_h)
    mean, rstd = rt.upload(mean_h), rt.upload(rstd_h)
    runs = []
    for _ in range(2):
        dx = rt.upload(dx0)
        dw = rt.empty((C,))
        db = rt.empty((C,)) if bias else None
        ds = rt.empty((C,)) if bias else None         # the branch gradient's column sums (here dx's)
        ln.layernorm_bwd(rt, dx, dw, db, dout, x, mean, rstd, w, ds=ds)
        runs.append((rt.download(dx), rt.download(dw), rt.download(db) if bias else None,
                     rt.download(ds) if bias else None))
    gdx, gdw, gdb, gds = runs[0]
    assert rel_err(gdx, dx0.astype(np.float64) + rdx) < 1e-5
    assert rel_err(gdw, rdw) < 3e-5
    if bias:
        assert rel_err(gdb, rdb) < 3e-5
        assert rel_err(gds, gdx.astype(np.float64).reshape(-1, C).sum(0)) < 1e-5     # dx as stored
    # bitwise reproducible
    for a, b_ in zip(runs[0], runs[1]):
        if a is not None:
            assert np.array_equal(a.view(np.uint32), b_.view(np.uint32))


@pytest.mark.parametrize("lead,C", [((4, 64), 384), ((3, 11), 200), ((7, 3), 37), ((6,), 1030), ((2, 9), 1024)])
def test_layernorm_bwd_dropout_output(env, lead, C):
    """layernorm_bwd with drop = (dropped, p, site) writes dropout_bwd of its new dx into dropped
    (poisoned before), bit for bit what elementwise.dropout_bwd draws from that dx; dx, dw, db as
    without it (register and loop kernels); ds, the column sums of dropped (the branch gradient)."""
    from gptcuda.model import rng
    from gptcuda.ops.cuda import elementwise as ew
    rt = env
    _plan(rt, C)
    st = np.zeros(16, np.int32)
    st[0] = 9
    rt.state = rt.upload(st)
    r = np.random.default_rng(5 * C + len(lead))
    x_h = _randn(r, *lead, C) * 2.0 + 0.7
    w_h, dout_h, dx0 = _randn(r, C), _randn(r, *lead, C), _randn(r, *lead, C)
    _, m64, r64 = ref.layernorm_forward(x_h, w_h, None)
    x, w, dout = rt.upload(x_h), rt.upload(w_h), rt.upload(dout_h)
    mean, rstd = rt.upload(m64.astype(np.float32)), rt.upload(r64.astype(np.float32))
    site, p = rng.dropout_site(3, 1), 0.2
    outs = []
    for fused in (False, True):
        dx, dw, db, dropped = rt.upload(dx0), rt.empty((C,)), rt.empty((C,)), rt.empty((*lead, C))
        rt.memset(dropped, 0x7FC00000)
        if fused:
            ds = rt.empty((C,))
            ln.layernorm_bwd(rt, dx, dw, db, dout, x, mean, rstd, w, drop=(dropped, p, site), ds=ds)
            assert rel_err(rt.download(ds), rt.download(dropped).astype(np.float64).reshape(-1, C).sum(0)) < 1e-5
        else:
            ln.layernorm_bwd(rt, dx, dw, db, dout, x, mean, rstd, w)
            ew.dropout_bwd(rt, dropped, dx, p, site)
        outs.append([rt.download(v) for v in (dx, dw, db, dropped)])
    for a, b_ in zip(*outs):
        assert np.array_equal(a.view(np.uint32), b_.view(np.uint32))
    kept = outs[1][3] != 0
    assert 0.7 < kept.mean() < 0.9


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead,C", [((4, 64), 384), ((3, 11), 200), ((7, 3), 37), ((6,), 1030), ((2, 9), 1024)])
def test_layernorm_fwd_residual_dropout(env, lead, C, bias):
    """layernorm_fwd with residual = (resid, branch, p, site) makes x = resid + dropout(branch)
    (poisoned before) and normalizes it: bit for bit elementwise.residual_dropout followed by the
    plain layernorm (register and loop kernels)."""
    from gptcuda.model import rng
    from gptcuda.ops.cuda import elementwise as ew
    rt = env
    st = np.zeros(16, np.int32)
    st[0] = 4
    rt.state = rt.upload(st)
    r = np.random.default_rng(7 * C + len(lead))
    resid_h, branch_h = _randn(r, *lead, C) * 2.0 + 0.7, _randn(r, *lead, C)
    w_h, b_h = _randn(r, C), _randn(r, C)
    resid, branch, w = rt.upload(resid_h), rt.upload(branch_h), rt.upload(w_h)
    b = rt.upload(b_h) if bias else None
    site, p = rng.dropout_site(2, 2), 0.2
    outs = []
    for fused in (False, True):
        x, out, mean, rstd = rt.empty((*lead, C)), rt.empty((*lead, C)), rt.empty(lead), rt.empty(lead)
        rt.memset(x, 0x7FC00000)
        if fused:
            ln.layernorm_fwd(rt, out, mean, rstd, x, w, b, residual=(resid, branch, p, site))
        else:
            ew.residual_dropout(rt, x, resid, branch, p, site)
            ln.layernorm_fwd(rt, out, mean, rstd, x, w, b)
        outs.append([rt.download(v) for v in (x, out, mean, rstd)])
    for a, b_ in zip(*outs):
        assert np.array_equal(a.view(np.uint32), b_.view(np.uint32))
    kept = outs[1][0] != resid_h
    assert 0.7 < kept.mean() < 0.9
    o64, _, _ = ref.layernorm_forward(outs[1][0], w_h, b_h if bias else None)
    assert rel_err(outs[1][1], o64) < 1e-5
