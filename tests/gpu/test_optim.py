"""GPU tests of kernels/optim.cu: lr schedule, step counters, gradient norm, AdamW."""

import numpy as np
import pytest

from gptcuda.ops.cuda import optim
from gptcuda.ops.reference import ops as ref
from gptcuda.runtime import DeviceView, bf16
from tests.conftest import rel_err, shifted_view
from gptcuda.config import config_of

pytestmark = pytest.mark.gpu


@pytest.fixture
def env(rt):
    saved = (rt.state, dict(getattr(rt, "_workspace", {})))
    cfg = config_of(check=False, batch_size=1, block_size=1, n_embd=8, n_head=1, n_layer=1, vocab_size=65,
                          attention="unfused")
    views = {n: rt.empty(shape, dtype, name=n) for n, (shape, dtype) in optim.workspace(cfg).items()}
    rt.set_workspace({**saved[1], **views})
    yield rt
    rt.state = saved[0]
    rt.set_workspace(saved[1])


def _state(rt, step=0, lr=0.0, grad_norm=0.0, eval_draws=0):
    st = np.zeros(16, np.int32)
    st[0] = step
    st[4] = eval_draws
    f = st.view(np.float32)
    f[1] = lr
    f[3] = grad_norm
    rt.state = rt.upload(st)


def _read(rt):
    s = rt.download(rt.state)
    return s, s.view(np.float32)


def _randn(r, *shape):
    x = r.standard_normal(shape).astype(np.float32)
    x[x == 0] = 0.5
    return x


SCHEDULES = [(1e-3, 1e-4, 100, 5000), (6e-4, 6e-5, 0, 2000), (1e-3, 1e-4, 50, 50), (3e-4, 0.0, 10, 5)]


@pytest.mark.parametrize("sched", SCHEDULES)
def test_lr_schedule(env, sched):
    rt = env
    for step in [0, 1, 5, 9, 10, 11, 49, 50, 51, 99, 100, 101, 1000, 1999, 2000, 2001, 2500, 4999, 5000, 5001, 7000]:
        _state(rt, step=step, lr=float("nan"))
        optim.lr_schedule(rt, *sched)
        s, f = _read(rt)
        want = np.float32(ref.lr_at(step, *sched))
        assert abs(float(f[1]) - float(want)) <= 1e-6 * abs(float(want)) + 1e-12, (step, f[1], want)
        assert s[0] == step


def test_counters(env):
    rt = env
    _state(rt, step=5, lr=0.25, grad_norm=1.5, eval_draws=2)
    for _ in range(3):
        optim.step_advance(rt)
    optim.eval_advance(rt)
    s, f = _read(rt)
    assert s[0] == 8 and s[4] == 3
    assert f[1] == np.float32(0.25) and f[3] == np.float32(1.5)


def _upload(rt, arr, misalign):
    if not misalign:
        return rt.upload(arr)
    base = rt.upload(np.concatenate([np.zeros(1, np.float32), arr.reshape(-1)]))
    return DeviceView(base.ptr + 4, tuple(arr.shape), "f32", "misaligned")


@pytest.mark.parametrize("misalign", [False, True])
@pytest.mark.parametrize("P", [10_800_003, 1_000_000, 4099, 7, 1])
def test_grad_norm(env, P, misalign):
    rt = env
    r = np.random.default_rng(P)
    g_h = _randn(r, P) * 0.01
    g = _upload(rt, g_h, misalign)
    _state(rt, step=3, lr=0.5)
    optim.grad_norm(rt, g)
    s, f = _read(rt)
    want = ref.global_norm([g_h])
    assert abs(float(f[3]) - want) <= 1e-6 * want
    assert s[0] == 3 and f[1] == np.float32(0.5)
    first = f[3]
    optim.grad_norm(rt, g)
    assert _read(rt)[1][3] == first                      # bitwise reproducible


ADAM_CASES = [
    (100_003, 60_001, 4, 3.0, 1.0, 0.1),      # clipping active, decay boundary inside a float4
    (100_003, 60_002, 0, 0.5, 1.0, 0.1),      # norm below clip: no scaling; t = 1
    (4099, 4099, 999, 7.0, 0.0, 0.1),         # clipping disabled, everything decays
    (4099, 0, 12, 2.0, 1.0, 0.3),             # nothing decays
    (5, 3, 2, 1.5, 1.0, 0.1),
]


def _adam_inputs(r, P):
    """Random parameters, gradients and moments (v > 0), none zero."""
    return _randn(r, P), _randn(r, P), _randn(r, P) * 0.1, (np.abs(_randn(r, P)) * 0.01).astype(np.float32)


@pytest.mark.parametrize("misalign", [False, True])
@pytest.mark.parametrize("P,n_decay,step,norm,clip,wd", ADAM_CASES)
def test_adamw(env, P, n_decay, step, norm, clip, wd, misalign):
    rt = env
    r = np.random.default_rng(P + n_decay + step)
    p_h, g_h, m_h, v_h = _adam_inputs(r, P)
    lr = np.float32(3e-3)
    beta1, beta2, eps = 0.9, 0.99, 1e-8
    _state(rt, step=step, lr=float(lr), grad_norm=norm)
    p, g, m, v = (_upload(rt, a, misalign) for a in (p_h, g_h, m_h, v_h))
    optim.adamw(rt, p, g, m, v, n_decay, beta1, beta2, eps, wd, clip)
    scale = ref.clip_scale(float(np.float32(norm)), clip)
    decay = np.arange(P) < n_decay
    rp, rm, rv = ref.adamw_update(p_h, g_h.astype(np.float64) * scale, m_h, v_h, float(lr), beta1, beta2, eps,
                                  wd, step + 1, decay)
    gp, gm, gv = rt.download(p), rt.download(m), rt.download(v)
    assert rel_err(gm, rm) < 1e-5
    assert rel_err(gv, rv) < 1e-5
    assert rel_err(gp - p_h, rp - p_h) < 1e-3          # the update itself
    assert rel_err(gp, rp) < 1e-6
    assert np.array_equal(rt.download(g), g_h)           # grads untouched
    s, f = _read(rt)
    assert s[0] == step                                  # the step is advanced elsewhere


# ---- a bf16 model's working copy ---------------------------------------------------------------
# adamw_copy is adamw's update (the same fp32 arithmetic, element by element, at the same vector width:
# the 4-value and the one-value loops may contract the arithmetic into FMAs differently, as seen on the
# H200, so a kernel is compared with adamw of its own width) plus one rounding of each updated parameter
# to bf16: checked bitwise, no tolerance.

# shifts in bytes of (the fp32 buffers, the copy): aligned; fp32 misaligned (one value a thread); the
# copy alone not 8-byte aligned (one value a thread while adamw without it takes 4)
@pytest.mark.parametrize("shifts", [(0, 0), (4, 0), (0, 2), (0, 4)])
@pytest.mark.parametrize("P,n_decay,step,norm,clip,wd", ADAM_CASES)
def test_adamw_bf16_copy(env, P, n_decay, step, norm, clip, wd, shifts):
    """The fp32 update with the working copy written is adamw's bit for bit (params, m, v; adamw run on
    the same inputs at the same vector width: fp32 buffers 4 bytes off where the copy kernel takes one
    value a thread), and the copy (poisoned before) is bf16.bits of the updated params."""
    rt = env
    r = np.random.default_rng(P + n_decay + step + 1)
    host = _adam_inputs(r, P)
    beta1, beta2, eps = 0.9, 0.99, 1e-8
    _state(rt, step=step, lr=3e-3, grad_norm=norm)
    fshift, wshift = shifts
    one_value = fshift % 16 or wshift % 8                        # the copy kernel's width: 1, else 4
    plain = [shifted_view(rt, (P,), "f32", 4 if one_value else 0, a) for a in host]
    optim.adamw(rt, *plain, n_decay, beta1, beta2, eps, wd, clip)
    bufs = [shifted_view(rt, (P,), "f32", fshift, a) for a in host]
    work = shifted_view(rt, (P,), "bf16", wshift)                # NaN-poisoned
    optim.adamw(rt, *bufs, n_decay, beta1, beta2, eps, wd, clip, work=work)
    for a, b in zip(plain, bufs):                                # params, grads (untouched), m, v
        assert np.array_equal(rt.download(a).view(np.uint32), rt.download(b).view(np.uint32))
    assert np.array_equal(rt.download(work), bf16.bits(rt.download(bufs[0])))
    assert _read(rt)[0][0] == step and _read(rt)[0][5] == 1      # work_fresh: set by the copy alone


@pytest.mark.parametrize("shifts", [(0, 0), (4, 0), (0, 2), (0, 4)])
@pytest.mark.parametrize("P", [1_000_003, 4099, 7, 1])
def test_to_bf16(env, P, shifts):
    """The working copy at init / load: every fp32 value rounded to nearest even, bitwise (exact ties
    both ways, values just off a tie, magnitudes from subnormal to overflow, infinities)."""
    rt = env
    r = np.random.default_rng(P)
    x = (_randn(r, P) * np.float32(10.0) ** r.integers(-30, 30, P).astype(np.float32)).astype(np.float32)
    u = x.view(np.uint32)
    k = r.integers(0, 4, P)
    u[k == 1] = (u[k == 1] & 0xFFFF0000) | 0x8000               # ties: to the even pattern
    u[k == 2] = (u[k == 2] & 0xFFFF0000) | r.choice([0x7FFF, 0x8001], int((k == 2).sum())).astype(np.uint32)
    special = np.array([1e-39, -3e-41, 3.4e38, -3.39e38, np.inf, -np.inf, 1 + 2 ** -8, 1 + 3 * 2 ** -8], np.float32)
    x[:min(P, len(special))] = special[:P]
    assert np.all(x != 0) and not np.any(np.isnan(x))
    src = shifted_view(rt, (P,), "f32", shifts[0], x)
    out = shifted_view(rt, (P,), "bf16", shifts[1])              # NaN-poisoned
    optim.to_bf16(rt, out, src)
    assert np.array_equal(rt.download(out), bf16.bits(x))


def test_to_bf16_unless_fresh(env):
    """The working copy made at a program's start (unless_fresh): nothing while the step state's work_fresh
    is 1 (adamw_copy wrote it), the copy where it is 0 (the host wrote the parameters); plain AdamW leaves
    the flag as it is."""
    rt = env
    r = np.random.default_rng(5)
    x = _randn(r, 4099)
    src, out = rt.upload(x), rt.empty((4099,), "bf16")        # NaN-poisoned
    _state(rt)
    rt.write(rt.state, np.array([0, 0, 0, 0, 0, 1] + [0] * 10, np.int32))
    before = rt.download(out)
    optim.to_bf16(rt, out, src, unless_fresh=True)
    assert np.array_equal(rt.download(out), before)
    rt.write(rt.state, np.zeros(16, np.int32))
    optim.to_bf16(rt, out, src, unless_fresh=True)
    assert np.array_equal(rt.download(out), bf16.bits(x))
    host = _adam_inputs(r, 4099)
    optim.adamw(rt, *[rt.upload(a) for a in host], 0, 0.9, 0.99, 1e-8, 0.0, 0.0)
    assert _read(rt)[0][5] == 0
