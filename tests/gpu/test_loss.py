"""GPU tests of kernels/loss.cu: fused softmax cross-entropy and the deterministic mean loss."""
import numpy as np
import pytest

from gptcuda.cuda_ops import loss as L
from gptcuda.reference import ops as ref
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu


def _randn(r, *shape):
    x = r.standard_normal(shape).astype(np.float32)
    x[x == 0] = 0.5
    return x


def _state(rt, step):
    st = np.zeros(16, np.int32)
    st[0] = step
    rt.state = rt.upload(st)


def _read_state(rt):
    s = rt.download(rt.state)
    return s, s.view(np.float32)


# (leading dims, V): warp-per-row kernel up to V = 1024, block-per-row beyond
CASES = [((4, 64), 65), ((37,), 1), ((3, 7), 33), ((9,), 1024), ((5,), 1025), ((3, 2), 5003), ((2,), 50304)]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("lead,V", CASES)
def test_crossentropy(env, lead, V, inplace):
    rt = env
    r = np.random.default_rng(V + len(lead))
    logits_h = _randn(r, *lead, V) * 3.0
    tg_h = r.integers(0, V, size=lead).astype(np.int32)
    N = int(np.prod(lead))
    scale = 1.0 / N
    rl, probs = ref.crossentropy_forward(logits_h, tg_h)
    rd = ref.crossentropy_backward(probs, tg_h, scale).reshape(*lead, V)
    logits, tg = rt.upload(logits_h), rt.upload(tg_h)
    losses = rt.empty(lead)
    dlogits = logits if inplace else rt.empty((*lead, V))
    L.crossentropy(rt, losses, dlogits, logits, tg, scale)
    assert rel_err(rt.download(losses), rl.reshape(lead)) < 1e-5
    assert rel_err(rt.download(dlogits), rd) < 1e-5


@pytest.mark.parametrize("lead,V", [((4, 64), 65), ((3,), 5003)])
def test_crossentropy_no_grad(env, lead, V):
    rt = env
    r = np.random.default_rng(V)
    logits_h = _randn(r, *lead, V)
    tg_h = r.integers(0, V, size=lead).astype(np.int32)
    rl, _ = ref.crossentropy_forward(logits_h, tg_h)
    logits, tg = rt.upload(logits_h), rt.upload(tg_h)
    losses = rt.empty(lead)
    L.crossentropy(rt, losses, None, logits, tg, 0.0)
    assert rel_err(rt.download(losses), rl.reshape(lead)) < 1e-5
    dl = rt.empty((*lead, V))                            # given but grad_scale 0: untouched
    L.crossentropy(rt, losses, dl, logits, tg, 0.0)
    assert np.all(np.isnan(rt.download(dl)))
    assert np.array_equal(rt.download(logits), logits_h)


@pytest.mark.parametrize("N", [16384, 1, 1023, 1025, 3000])
def test_loss_reduce(env, N):
    rt = env
    r = np.random.default_rng(N)
    losses_h = (np.abs(r.standard_normal(N)) + 0.1).astype(np.float32)
    losses = rt.upload(losses_h)
    want = losses_h.astype(np.float64).mean()
    _state(rt, 3)
    hist = rt.empty((10,))
    L.loss_reduce(rt, losses, hist)
    s, f = _read_state(rt)
    assert abs(f[2] - want) <= 1e-6 * want
    h = rt.download(hist)
    assert h[3] == f[2]
    assert np.all(np.isnan(np.delete(h, 3)))
    assert s[0] == 3                                      # step untouched
    # bitwise reproducible
    L.loss_reduce(rt, losses, hist)
    assert _read_state(rt)[1][2] == f[2]
    # step beyond the history, and no history
    _state(rt, 10)
    hist = rt.empty((10,))
    L.loss_reduce(rt, losses, hist)
    assert np.all(np.isnan(rt.download(hist)))
    assert _read_state(rt)[1][2] == f[2]
    _state(rt, 0)
    L.loss_reduce(rt, losses, None)
    assert _read_state(rt)[1][2] == f[2]
