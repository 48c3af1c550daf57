"""GPU test of kernels/data.cu: device batches equal gptcuda.data.get_batch bit for bit."""
import numpy as np
import pytest

from gptcuda import data, rng
from gptcuda.cuda_ops import data as gdata

pytestmark = pytest.mark.gpu


def _state(rt, step, eval_draws):
    st = np.zeros(16, np.int32)
    st[0] = step
    st[4] = eval_draws
    rt.state = rt.upload(st)


@pytest.mark.parametrize("n,B,T", [(100_003, 64, 256), (10_007, 8, 64), (65, 3, 64), (2_000, 5, 300), (50, 1, 1)])
@pytest.mark.parametrize("counter", ["step", "eval_draws"])
def test_get_batch_exact(env, n, B, T, counter):
    rt = env
    r = np.random.default_rng(n + T)
    tokens_h = r.integers(0, 65, size=n).astype(np.int32)
    tokens = rt.upload(tokens_h)
    site = rng.SITE_BATCH_TRAIN if counter == "step" else rng.SITE_BATCH_EVAL_TRAIN
    for step, draws in [(0, 0), (13, 5), (4999, 123456)]:
        _state(rt, step, draws)
        x, y = rt.empty((B, T), "i32"), rt.empty((B, T), "i32")
        gdata.get_batch(rt, x, y, tokens, site, counter)
        value = step if counter == "step" else draws
        wx, wy = data.get_batch(tokens_h, rt.seed, value, site, B, T)
        assert np.array_equal(rt.download(x), wx)
        assert np.array_equal(rt.download(y), wy)
        s = rt.download(rt.state)
        assert s[0] == step and s[4] == draws        # the draw does not advance anything


def test_get_batch_sites_differ(env):
    rt = env
    tokens_h = np.arange(100_000, dtype=np.int32)
    tokens = rt.upload(tokens_h)
    _state(rt, 7, 7)
    out = []
    for site in (rng.SITE_BATCH_TRAIN, rng.SITE_BATCH_VAL):
        x, y = rt.empty((16, 32), "i32"), rt.empty((16, 32), "i32")
        gdata.get_batch(rt, x, y, tokens, site, "step")
        out.append(rt.download(x))
        assert np.array_equal(rt.download(y), out[-1] + 1)
    assert not np.array_equal(out[0], out[1])
