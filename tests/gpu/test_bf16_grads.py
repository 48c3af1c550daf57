"""bf16 gradients (grad_dtype bf16) on the GPU: every writer of the gradient region in its bf16 form.

Each of them computes in fp32 exactly what its fp32 form computes and rounds once where it stores (to
nearest even), so its output must be the fp32 form's output rounded to bf16, bit for bit, on the same
inputs and with the same plan (tile, split count): the weight gradients' products (gemm_wgmma_ws / _pp with
a bf16 C, gemm_wgmma_dual's unsplit W, the split-K reduction into bf16), the row sums (the layernorm's and
the bias gradients: sum_rows), the embedding's (dwte += from a bf16 value, dwpe =). The norm and AdamW read
the bf16 values widened exactly: the same bits as on an fp32 copy of those values. Against float64 the
fp32 forms have their own tests; this file checks the one rounding. Then the model: a bf16 step with bf16
gradients against fp32 ones (one rounding apart), deterministic, resuming bit for bit.
"""
import numpy as np
import pytest

from gptcuda.config import config_of
from gptcuda.ops.cuda import elementwise as ew
from gptcuda.ops.cuda import encoder as enc
from gptcuda.ops.cuda import gemm, optim
from gptcuda.ops.cuda import layernorm as ln
from gptcuda.ops.cuda.gemm.families import DUAL_PP_TILES, DUAL_TILES, FAMILIES, dual_serves
from gptcuda.ops.cuda.gemm.plan import make_plan
from gptcuda.runtime import bf16

gpu = pytest.mark.gpu
BF = FAMILIES["bf16"]


@pytest.fixture
def bf16_rt(rt):
    """The session runtime in precision bf16 with split-K, bias-sum, layernorm and optimizer workspaces."""
    old_exec, old_ws, old_state = rt.exec, dict(rt._workspace), rt.state
    rt.exec = rt.exec.with_precision("bf16")
    cfg = config_of(check=False, batch_size=1, block_size=1, n_embd=1040, n_head=1, n_layer=1, vocab_size=4160,
                    attention="unfused")
    views = {n: rt.empty(shape, dtype, name=n) for fam in (ln, ew, optim) for n, (shape, dtype) in
             fam.workspace(cfg).items()}
    rt.set_workspace({**old_ws, **views, "gemm_splitk": rt.empty((8 << 20,), name="gemm_splitk")})
    yield rt
    rt.exec, rt.state = old_exec, old_state
    rt.set_workspace(old_ws)


def _r(rng, *shape):
    """bf16-exact random values (no zeros) in float32."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[x == 0] = 0.5
    return bf16.round_f32(x)


def _rounded(rt, f32_view) -> np.ndarray:
    """The bf16 bits of an fp32 output rounded to nearest even."""
    return bf16.bits(rt.download(f32_view))


def _bits(rt, v) -> np.ndarray:
    return rt.download(v).view(np.uint16)


TN_TILES = [(t, s, c) for t in BF.tiles for s in (1, 3) for c in (False, True)
            if BF.serves(t, 0, c, "bf16" if s == 1 else "f32")]


@gpu
@pytest.mark.parametrize("tile,splits,colsum", TN_TILES)
@pytest.mark.parametrize("T,M,N", [(1000, 520, 392), (2048, 768, 256)])
def test_weight_gradient_into_bf16(bf16_rt, tile, splits, colsum, T, M, N):
    """dW = dY^T X (and db = dY's column sums) into bf16: the fp32 product's values rounded, bit for bit, with
    the same plan: unsplit, the kernel's own bf16 C (256 x 128 has no room for a bf16 C beside the column sums:
    Bf16.serves); split, fp32 partials reduced into bf16."""
    rt, rng = bf16_rt, np.random.default_rng(T + M + N + splits)
    dy, x = rt.upload(_r(rng, T, M), "bf16"), rt.upload(_r(rng, T, N), "bf16")
    p = make_plan("bf16", tile, splits, T)
    outs = {}
    for dt in ("f32", "bf16"):
        dw, db = rt.empty((M, N), dt), rt.empty((M,), dt) if colsum else None
        gemm.matmul(rt, dw, dy, x, True, False, plan=p, a_colsum=db)
        outs[dt] = (dw, db)
    for a, b in zip(outs["f32"], outs["bf16"]):
        assert a is None or np.array_equal(_rounded(rt, a), _bits(rt, b))


@gpu
@pytest.mark.parametrize("tile,epilogue,colsum", [(t, e, c) for t in DUAL_TILES + DUAL_PP_TILES for e, c in
                                                  (("none", True), ("none", False), ("dgelu", False))
                                                  if dual_serves(t, 4 if e == "dgelu" else 0, c)])
@pytest.mark.parametrize("splits", [1, 3])
def test_pair_weight_gradient_into_bf16(bf16_rt, tile, epilogue, colsum, splits):
    """gemm_wgmma_dual with a bf16 dW (unsplit: its W consumers store bf16, OUT_W 1; split: fp32 partials, the
    reduction into bf16): the fp32 pair's dW and db rounded, bit for bit, and dX the same bits."""
    rt, rng = bf16_rt, np.random.default_rng(7 * splits + len(epilogue))
    T, K, N = 4000, 768, 520
    if not rt.exec.grad_pairs:
        pytest.skip("GPTCUDA_GRAD_PAIRS=0 in this environment")
    dy, x, w = (rt.upload(_r(rng, *s), "bf16") for s in ((T, N), (T, K), (N, K)))
    pre = rt.upload(_r(rng, T, K), "bf16") if epilogue == "dgelu" else None
    p = make_plan("bf16", tile, splits, T)
    outs = {}
    for dt in ("f32", "bf16"):
        dx, dw, db = rt.empty((T, K), "bf16"), rt.empty((N, K), dt), rt.empty((N,), dt) if colsum else None
        gemm.matmul_pair(rt, dx, dw, dy, x, w, db=db, epilogue=epilogue, aux=pre, plan=p)
        outs[dt] = (dx, dw, db)
    (dx32, dw32, db32), (dx16, dw16, db16) = outs["f32"], outs["bf16"]
    assert np.array_equal(_bits(rt, dx32), _bits(rt, dx16))
    assert np.array_equal(_rounded(rt, dw32), _bits(rt, dw16))
    assert db32 is None or np.array_equal(_rounded(rt, db32), _bits(rt, db16))


@gpu
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_and_bias_gradients_into_bf16(bf16_rt, bias):
    """The row sums' second pass into bf16 (sum_rows TO 1; a deferred batch of bf16 outputs too): the
    layernorm's dw, db, ds and bias_grad's db are the fp32 ones rounded, bit for bit; dx the same bits."""
    rt, rng = bf16_rt, np.random.default_rng(11 + bias)
    lead, C = (4, 129), 768
    x_h, dout_h, dx0 = _r(rng, *lead, C), _r(rng, *lead, C), _r(rng, *lead, C)
    w_h = rng.standard_normal(C).astype(np.float32)
    mean_h = x_h.mean(-1, dtype=np.float32)
    rstd_h = (1.0 / np.sqrt(x_h.var(-1, dtype=np.float32) + 1e-5)).astype(np.float32)
    x, dout, w = rt.upload(x_h, "bf16"), rt.upload(dout_h, "bf16"), rt.upload(w_h)
    mean, rstd = rt.upload(mean_h), rt.upload(rstd_h)
    outs = {}
    for dt in ("f32", "bf16"):
        for defer in (False, True):
            dx = rt.upload(dx0, "bf16")
            grads = [rt.empty((C,), dt) for _ in range(3 if bias else 1)]
            ew.defer_sums(rt, defer)
            ln.layernorm_bwd(rt, dx, grads[0], grads[1] if bias else None, dout, x, mean, rstd, w,
                             ds=grads[2] if bias else None)
            gb = rt.empty((C,), dt)
            ew.bias_grad(rt, gb, dout)
            ew.defer_sums(rt, False)
            outs[dt, defer] = (dx, gb, *grads)
    for defer in (False, True):
        (dx32, *g32), (dx16, *g16) = outs["f32", defer], outs["bf16", defer]
        assert np.array_equal(_bits(rt, dx32), _bits(rt, dx16))
        for a, b in zip(g32, g16):
            assert np.array_equal(_rounded(rt, a), _bits(rt, b))


@gpu
@pytest.mark.parametrize("method", ["scan", "sort"])
@pytest.mark.parametrize("B,T,C,V", [(4, 64, 96, 65), (2, 256, 768, 50304)])
def test_embedding_gradients_into_bf16(bf16_rt, method, B, T, C, V):
    """encoder_bwd into bf16 dwte (+=: its old bf16 value plus the fp32 sum, rounded once) and dwpe (=): the fp32
    path's result from the same old values, rounded, bit for bit; rows of absent ids keep their bits."""
    rt, rng = bf16_rt, np.random.default_rng(B * T + C)
    if method == "scan" and V > 1000:
        pytest.skip("the scan path is for small vocabularies")
    idx_h = rng.integers(0, V // 2, size=(B, T)).astype(np.int32)
    dout = rt.upload(_r(rng, B, T, C), "bf16")
    wte0 = _r(rng, V, C)
    idx = rt.upload(idx_h)
    ws = {enc.WORKSPACE: rt.empty((enc.workspace_ints(B * T, C),), "i32", name=enc.WORKSPACE)}
    old = rt.set_workspace({**rt._workspace, **ws})
    try:
        outs = {}
        for dt in ("f32", "bf16"):
            dwte, dwpe = rt.upload(wte0, dt), rt.empty((T, C), dt)
            enc.encoder_bwd(rt, dwte, dwpe, dout, idx, method=method)
            outs[dt] = (dwte, dwpe)
    finally:
        rt.set_workspace(old)
    for a, b in zip(outs["f32"], outs["bf16"]):
        assert np.array_equal(_rounded(rt, a), _bits(rt, b))
    assert np.array_equal(_bits(rt, outs["bf16"][0])[V - 1], bf16.bits(wte0[V - 1]))


@gpu
@pytest.mark.parametrize("n,shift", [(1 << 20, 0), (4099, 0), (4099, 1)])
def test_norm_and_adamw_read_bf16_gradients(bf16_rt, n, shift):
    """grad_norm and AdamW (with and without the working copy) over bf16 gradients: the same bits as over an
    fp32 copy of those values (widening is exact), also 2 bytes off 16-byte alignment (the scalar kernels)."""
    rt, rng = bf16_rt, np.random.default_rng(n + shift)
    g_h = _r(rng, n) * np.float32(2.0 ** -7)        # (a power of two: still bf16-exact)
    p_h, m_h = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32) * 1e-3
    v_h = np.abs(rng.standard_normal(n).astype(np.float32)) * 1e-5
    st = np.zeros(16, np.int32)
    st[0] = 3
    st.view(np.float32)[1] = 1e-3
    results = {}
    for dt in ("f32", "bf16"):
        rt.state = rt.upload(st)
        base = rt.upload(np.concatenate([np.zeros(shift, np.float32), g_h]), dt)
        g = type(base)(base.ptr + shift * base.itemsize, (n,), dt, "g")
        optim.grad_norm(rt, g)
        norm = rt.download(rt.state).view(np.float32)[3]
        out = []
        for copy in (False, True):
            p, m, v = rt.upload(p_h), rt.upload(m_h), rt.upload(v_h)
            work = rt.empty((n,), "bf16") if copy else None
            optim.adamw(rt, p, g, m, v, n // 2, 0.9, 0.95, 1e-8, 0.1, 1.0, work=work)
            out += [rt.download(a).view(np.uint32) for a in (p, m, v)] + ([_bits(rt, work)] if copy else [])
        results[dt] = (norm, out)
    assert results["f32"][0] == results["bf16"][0] and np.isfinite(results["f32"][0])
    for a, b in zip(results["f32"][1], results["bf16"][1]):
        assert np.array_equal(a, b)
