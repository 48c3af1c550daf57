"""GPU tests of kernels/loss.cu: fused softmax cross-entropy and the deterministic mean loss."""
import numpy as np
import pytest

from gptcuda.ops.cuda import loss as L
from gptcuda.ops.reference import ops as ref
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


# (leading dims, real vocabulary, padded row length): GPT-2's 50257 -> 50304, a char vocabulary padded
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("lead,Vr,V", [((3, 5), 50257, 50304), ((4, 16), 65, 128), ((7,), 1000, 1025)])
def test_crossentropy_padded_vocab(env, lead, Vr, V, inplace):
    """Columns Vr.. are padding: the loss and softmax see only the first Vr, their gradient is 0
    (whatever the padded logits hold, even huge values)."""
    rt = env
    r = np.random.default_rng(Vr)
    logits_h = _randn(r, *lead, V) * 3.0
    logits_h[..., Vr:] = 1e4
    tg_h = r.integers(0, Vr, size=lead).astype(np.int32)
    tg_h.reshape(-1)[0] = Vr - 1
    scale = 0.37
    rl, probs = ref.crossentropy_forward(logits_h[..., :Vr], tg_h)
    rd = np.zeros((*lead, V))
    rd[..., :Vr] = ref.crossentropy_backward(probs, tg_h, scale).reshape(*lead, Vr)
    logits, tg = rt.upload(logits_h), rt.upload(tg_h)
    losses = rt.empty(lead)
    dlogits = logits if inplace else rt.empty((*lead, V))
    L.crossentropy(rt, losses, dlogits, logits, tg, scale, n_vocab=Vr)
    assert rel_err(rt.download(losses), rl.reshape(lead)) < 1e-5
    got = rt.download(dlogits)
    assert rel_err(got, rd) < 1e-5
    assert np.all(got[..., Vr:] == 0)


def test_crossentropy_padded_target_is_nan(env):
    """A target in the padding (>= the real vocabulary) is out of range: NaN loss, no one-hot term."""
    rt = env
    logits = rt.upload(np.ones((2, 8), np.float32))
    tg = rt.upload(np.array([1, 6], np.int32))
    losses = rt.empty((2,))
    L.crossentropy(rt, losses, None, logits, tg, 0.0, n_vocab=6)
    lo = rt.download(losses)
    assert np.isclose(lo[0], np.log(6.0)) and np.isnan(lo[1])


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
