"""GPU tests of kernels/encoder.cu against the float64 reference (deterministic backward)."""
import numpy as np
import pytest

from gptcuda.cuda_ops import encoder as enc
from gptcuda.reference import ops as ref
from tests.conftest import rel_err

pytestmark = pytest.mark.gpu

# (B, T, C, V, Tmax): float4 paths, scalar paths (C % 4 != 0), tails everywhere
SHAPES = [
    (4, 64, 384, 65, 256),
    (3, 17, 37, 11, 20),
    (2, 33, 132, 7, 40),
    (1, 1, 4, 3, 1),
    (5, 50, 1000, 300, 64),
    (16, 256, 384, 65, 256),
]


def _randn(r, *shape):
    x = r.standard_normal(shape).astype(np.float32)
    x[x == 0] = 0.5
    return x


def _ids(r, B, T, V):
    idx = r.integers(0, V, size=(B, T)).astype(np.int32)
    if V > 2:
        idx[idx == V - 1] = 0        # one vocabulary row never appears: its gradient must stay as it was
    return idx


@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_encoder_fwd(rt, B, T, C, V, Tmax):
    r = np.random.default_rng(B * 1000 + C)
    idx_h = _ids(r, B, T, V)
    wte_h, wpe_h = _randn(r, V, C), _randn(r, Tmax, C)
    idx, wte, wpe = rt.upload(idx_h), rt.upload(wte_h), rt.upload(wpe_h)
    out = rt.empty((B, T, C))
    enc.encoder_fwd(rt, out, idx, wte, wpe)
    got = rt.download(out)
    assert rel_err(got, ref.encoder_forward(idx_h, wte_h, wpe_h)) < 1e-6


@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_encoder_bwd(rt, B, T, C, V, Tmax):
    r = np.random.default_rng(B * 7 + C)
    idx_h = _ids(r, B, T, V)
    dout_h = _randn(r, B, T, C)
    dwte0 = _randn(r, V, C)                      # dwte accumulates
    idx, dout = rt.upload(idx_h), rt.upload(dout_h)
    ref_dwte, ref_dwpe = ref.encoder_backward(dout_h, idx_h, V, Tmax)
    results = []
    for _ in range(2):
        dwte = rt.upload(dwte0)
        dwpe = rt.empty((Tmax, C))               # overwritten entirely (rows >= T zeroed)
        enc.encoder_bwd(rt, dwte, dwpe, dout, idx)
        results.append((rt.download(dwte), rt.download(dwpe)))
    (g_wte, g_wpe), (g_wte2, g_wpe2) = results
    assert rel_err(g_wte, dwte0.astype(np.float64) + ref_dwte) < 1e-5
    assert rel_err(g_wpe, ref_dwpe) < 1e-5
    assert np.all(g_wpe[T:] == 0)
    if V > 2:
        assert np.array_equal(g_wte[V - 1], dwte0[V - 1])
    # bitwise reproducible
    assert np.array_equal(g_wte.view(np.uint32), g_wte2.view(np.uint32))
    assert np.array_equal(g_wpe.view(np.uint32), g_wpe2.view(np.uint32))
