"""GEMM kernels (kernels/gemm_simt.cu, kernels/gemm_tf32.cu) against the float64 reference.

GPU tests carry @pytest.mark.gpu; the few CPU tests at the bottom drive the launchers with a
recording stand-in for the runtime (shape validation, VARIANTS coverage, split-K planning).
"""
from contextlib import contextmanager

import numpy as np
import pytest

from gptcuda.model.products import Product
from gptcuda.ops.cuda import cdiv, gemm
from gptcuda.ops.cuda.gemm.families import (EPI_BIAS, EPI_DGELU, EPI_GELU, EPI_NONE, EPI_RESID, FAMILIES, PRODUCTS,
                                            SIMT_FILE, SPLIT_ALIGN, TF32_FILE, TRANSPOSE_THREADS, WGMMA_FILE,
                                            reduce_name, transpose_name)
from gptcuda.ops.cuda.gemm.plan import make_plan, plan, plan_label, tune_candidates
from gptcuda.ops.cuda.gemm.table import forget_tables, plan_to_json, save_table, table_key
from gptcuda.runtime.execution import WGMMA_ARCHS
from gptcuda.ops.reference import ops as ref
from gptcuda.runtime import DeviceView, i32
from tests.conftest import FakeGemmRT, fake_view, rel_err
from gptcuda.config import config_of

gpu = pytest.mark.gpu

TOL = {"fp32": 1e-5, "tf32": 2e-3}
EPIS = ["none", "bias", "gelu", "gelu_nobias", "residual", "residual_bias", "residual_alias", "dgelu"]
# _check_matmul's epilogue specs as (EPI, HAS_BIAS); the op interface's products (PRODUCTS): the
# layouts and epilogues every family runs (the as-stored ones compiled for these alone)
SPEC = {"none": (EPI_NONE, False), "bias": (EPI_BIAS, True), "gelu": (EPI_GELU, True),
        "gelu_nobias": (EPI_GELU, False), "residual": (EPI_RESID, False),
        "residual_bias": (EPI_RESID, True), "residual_alias": (EPI_RESID, False),
        "dgelu": (EPI_DGELU, False)}
LAYOUTS = list(PRODUCTS)


def is_product(ta, tb, epi) -> bool:
    return SPEC[epi] in PRODUCTS.get((ta, tb), ())


CASES = [(ta, tb, e) for ta, tb in LAYOUTS for e in EPIS if is_product(ta, tb, e)]


@pytest.fixture
def precision(rt, request):
    old = rt.precision
    rt.exec = rt.exec.with_precision(request.param)
    yield request.param
    rt.exec = rt.exec.with_precision(old)


@pytest.fixture(scope="module")
def _splitk_buffer(rt):
    return rt.empty((8 << 20,), name="gemm_splitk")      # 32 MB, once per module


def _transpose(rt, out, x, K, N, colsum=None, chunk0=0):
    """gemm_transpose: x [K, N] -> out [N, K]; colsum: also colsum[chunk0 + i] = the column sums of x's rows
    64 i .. 64 i + 63."""
    vec = K % 4 == 0 and N % 4 == 0
    rt.launch(rt.function(SIMT_FILE, transpose_name(vec, colsum is not None)), (cdiv(N, 64), cdiv(K, 64)),
              (TRANSPOSE_THREADS,), [out, x, i32(K), i32(N), colsum, i32(chunk0)], label="test")


@contextmanager
def _workspaces(rt, drop=(), **add):
    """rt's planned workspaces for one test: `add` set, `drop` removed; the previous set restored."""
    old = dict(rt._workspace)
    rt.set_workspace({**{k: v for k, v in old.items() if k not in drop}, **add})
    try:
        yield
    finally:
        rt.set_workspace(old)


@pytest.fixture
def splitk_ws(rt, _splitk_buffer):
    """Plan a generous split-K workspace for the test."""
    with _workspaces(rt, gemm_splitk=_splitk_buffer):
        yield _splitk_buffer


@pytest.fixture
def no_ws(rt):
    with _workspaces(rt, drop=("gemm_splitk",)):
        yield


def _operands(rng, M, N, K, ta, tb, scale=1.0):
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32) * scale
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32) * scale
    return a, b


def tf32_round(x):
    """numpy mirror of cvt.rna.tf32.f32 (finite inputs): round to 10 mantissa bits, ties away."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _close(precision, out, ref_fn, a, b, what):
    """rel err against the float64 reference of the fp32 inputs below TOL[precision]; for tf32
    also accepted: 1e-4 against the reference of the tf32-rounded inputs (degenerate tiny K)."""
    e = rel_err(out, ref_fn(a, b))
    if e < TOL[precision]:
        return e
    if precision == "tf32":
        e2 = rel_err(out, ref_fn(tf32_round(a), tf32_round(b)))
        if e2 < 1e-4:
            return e2
        what += f" (vs tf32-rounded inputs: {e2:.3g})"
    raise AssertionError(f"{what}: rel err {e:.3g} >= {TOL[precision]}")


def _check_matmul(rt, M, N, K, ta, tb, epi, seed=0, plan=None):
    """Run one matmul with epilogue spec `epi` (see EPIS) and compare every output (`plan`: force
    a plan instead of the table / cost model's)."""
    rng = np.random.default_rng(seed)
    a, b = _operands(rng, M, N, K, ta, tb)
    with_bias = epi in ("bias", "gelu", "residual_bias")
    bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
    da, db = rt.upload(a), rt.upload(b)
    dbias = rt.upload(bias) if with_bias else None
    out = rt.empty((M, N))
    what = f"M={M} N={N} K={K} ta={ta} tb={tb} {epi} {rt.precision}" + (f" {plan_label(plan)}" if plan else "")

    def mm(x, y):
        return ref.matmul_forward(x, y, ta, tb, bias)

    if epi in ("none", "bias"):
        gemm.matmul(rt, out, da, db, ta, tb, bias=dbias, plan=plan)
        _close(rt.precision, rt.download(out), mm, a, b, what)
    elif epi.startswith("gelu"):
        pre = rt.empty((M, N))
        gemm.matmul(rt, out, da, db, ta, tb, bias=dbias, epilogue="gelu", aux=pre, plan=plan)
        _close(rt.precision, rt.download(pre), mm, a, b, what + " pre")
        _close(rt.precision, rt.download(out), lambda x, y: ref.gelu_forward(mm(x, y)), a, b,
               what + " gelu")
    elif epi == "dgelu":
        # the MLP backward: out = (dout @ W) * gelu'(pre), pre = the saved pre-activation
        # (scaled to reach both tails of gelu', where tanh saturates)
        pre = (rng.standard_normal((M, N)) * 3.0).astype(np.float32)
        dpre = rt.upload(pre)
        gemm.matmul(rt, out, da, db, ta, tb, epilogue="dgelu", aux=dpre, plan=plan)
        assert np.array_equal(rt.download(dpre), pre), "dgelu's pre-activation was modified"
        _close(rt.precision, rt.download(out), lambda x, y: ref.gelu_backward(mm(x, y), pre), a, b,
               what)
    else:
        resid = rng.standard_normal((M, N)).astype(np.float32)
        if epi == "residual_alias":
            out = rt.upload(resid)
            gemm.matmul(rt, out, da, db, ta, tb, epilogue="residual", aux=out, plan=plan)
        else:
            aux = rt.upload(resid)
            gemm.matmul(rt, out, da, db, ta, tb, bias=dbias, epilogue="residual", aux=aux, plan=plan)
            assert np.array_equal(rt.download(aux), resid), "residual input was modified"
        _close(rt.precision, rt.download(out), lambda x, y: resid + mm(x, y), a, b, what)


# ---- every transpose case x every epilogue, odd shapes (tails everywhere) --------------
@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"], indirect=True)
@pytest.mark.parametrize("ta,tb,epi", CASES)
@pytest.mark.parametrize("M,N,K", [(67, 65, 33), (1, 1, 1), (130, 129, 17), (200, 72, 132)])
def test_matmul_odd_shapes(rt, precision, no_ws, M, N, K, ta, tb, epi):
    _check_matmul(rt, M, N, K, ta, tb, epi, seed=M * 7 + N + K)


# ---- aligned shapes (16-byte vector path) with partial tiles -------------------------
@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"], indirect=True)
@pytest.mark.parametrize("ta,tb", LAYOUTS)
@pytest.mark.parametrize("M,N,K", [(260, 132, 68), (64, 64, 8), (384, 256, 200), (1000, 516, 36)])
def test_matmul_aligned_tails(rt, precision, no_ws, M, N, K, ta, tb):
    for i, epi in enumerate(e for e in ("bias", "gelu", "dgelu", "none") if is_product(ta, tb, e)):
        _check_matmul(rt, M, N, K, ta, tb, epi, seed=M + N + K + i)


# ---- misaligned base pointers force the scalar path although ld % 4 == 0 -----------------
@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"], indirect=True)
@pytest.mark.parametrize("ta,tb", LAYOUTS)
def test_matmul_misaligned_pointers(rt, precision, no_ws, ta, tb):
    M, N, K = 96, 80, 40
    rng = np.random.default_rng(5)
    a, b = _operands(rng, M, N, K, ta, tb)
    da0 = rt.upload(np.concatenate([[1.0], a.ravel()]).astype(np.float32))
    db0 = rt.upload(np.concatenate([[2.0], b.ravel()]).astype(np.float32))
    da = DeviceView(da0.ptr + 4, a.shape, "f32", "a+1")
    db = DeviceView(db0.ptr + 4, b.shape, "f32", "b+1")
    out0 = rt.empty((M * N + 1,))
    out = DeviceView(out0.ptr + 4, (M, N), "f32", "out+1")
    gemm.matmul(rt, out, da, db, ta, tb)
    _close(precision, rt.download(out), lambda x, y: ref.matmul_forward(x, y, ta, tb), a, b,
           f"misaligned ta={ta} tb={tb}")


# ---- the model's shapes (GPT B=64 T=256 C=384 V=65 has M=16384 tokens; smaller B here) ----
MODEL_FWD = [(4096, 1152, 384), (4096, 384, 384), (4096, 1536, 384), (4096, 384, 1536),
             (4096, 65, 384)]


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"], indirect=True)
@pytest.mark.parametrize("M,N,K", MODEL_FWD)
def test_matmul_model_forward(rt, precision, splitk_ws, M, N, K):
    # forward x @ W^T (weights stored [N, K]) with bias; the GELU and residual forms of the MLP
    _check_matmul(rt, M, N, K, False, True, "bias", seed=N)
    _check_matmul(rt, M, N, K, False, True, "gelu", seed=N + 1)
    _check_matmul(rt, M, N, K, False, True, "residual_alias", seed=N + 2)
    # backward dX = dout @ W (NN), and the MLP's fused form dfc = (dout @ W_fcproj) * gelu'(fc_pre)
    _check_matmul(rt, M, K, N, False, False, "none", seed=N + 3)
    if (N, K) == (384, 1536):
        _check_matmul(rt, M, K, N, False, False, "dgelu", seed=N + 4)


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"], indirect=True)
@pytest.mark.parametrize("M,N", [(1152, 384), (384, 384), (1536, 384), (384, 1536), (65, 384)])
def test_matmul_weight_grad_splitk(rt, precision, splitk_ws, M, N):
    # dW[M, N] = dout^T @ x with K = tokens (TN): long K, small output -> split-K
    K = 16384
    p = plan(Product(M, N, K, True, False), "tf32" if precision == "tf32" else "simt", sm_count=rt.info.sm_count,
             max_ws=splitk_ws.numel)
    assert p.splits > 1, p
    _check_matmul(rt, M, N, K, True, False, "none", seed=M + N)
    _check_matmul(rt, N, M, K, True, False, "none", seed=M + N + 1)   # the dW^T orientation


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"], indirect=True)
@pytest.mark.parametrize("ta,tb,epi", [c for c in CASES if c[2] in ("none", "gelu", "residual_bias", "residual_alias",
                                                                      "dgelu")])
@pytest.mark.parametrize("N", [65, 68])
def test_splitk_epilogues_odd(rt, precision, splitk_ws, ta, tb, epi, N):
    """Split-K partials reduced with every epilogue: N = 65 one element a thread, N = 68 four (16-byte
    loads of the partials and the epilogue's 16-byte accesses)."""
    M, K = 67, 4133
    p = plan(Product(M, N, K, ta, tb), "tf32" if precision == "tf32" else "simt", sm_count=rt.info.sm_count,
             max_ws=splitk_ws.numel)
    assert p.splits > 1, p
    _check_matmul(rt, M, N, K, ta, tb, epi, seed=K)


# ---- every tile the tuner may pick, forced (the cost model never picks some of them) --------
def _tile_shapes(p):
    """Interior blocks only (the unguarded fast paths), then ragged edges in m, n and k."""
    bm, bn = p.tile[0], p.tile[1]
    return [(2 * bm, 2 * bn, 96), (bm + 36, 2 * bn - 44, 132)]


@gpu
@pytest.mark.parametrize("tile", [*FAMILIES["tf32"].tiles, *FAMILIES["simt"].tiles],
                         ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("ta,tb", LAYOUTS)
def test_every_tile_forced(rt, splitk_ws, tile, ta, tb):
    old = rt.precision
    rt.exec = rt.exec.with_precision("tf32" if len(tile) == 6 else "fp32")
    fam = "tf32" if len(tile) == 6 else "simt"
    try:
        for i, (M, N, K) in enumerate(_tile_shapes(make_plan(fam, tile, 1, 64))):
            p = make_plan(fam, tile, 1, K)
            for epi in (e for e in ("none", "bias", "gelu", "residual_alias", "dgelu") if is_product(ta, tb, e)):
                _check_matmul(rt, M, N, K, ta, tb, epi, seed=i * 10 + len(epi), plan=p)
        # split-K partials through the same tile (k chunks of 256, 256 and a ragged 228)
        M, N, K = tile[0] + 4, tile[1] + 8, 740
        _check_matmul(rt, M, N, K, ta, tb, "bias" if is_product(ta, tb, "bias") else "none", seed=7,
                      plan=make_plan(fam, tile, 3, K))
    finally:
        rt.exec = rt.exec.with_precision(old)


def _wgmma_rt(rt):
    if rt.arch not in WGMMA_ARCHS:
        pytest.skip(f"the wgmma kernel needs {WGMMA_ARCHS}, this device is {rt.arch}")


@gpu
@pytest.mark.parametrize("tile", FAMILIES["wgmma"].tiles, ids=lambda t: "x".join(map(str, t)))
def test_wgmma_tile_forced(rt, splitk_ws, tile):
    """Every warpgroup-MMA tile (x @ W^T only), forced: interior blocks, ragged edges in m, n and k,
    every epilogue, split-K partials, and a batched product."""
    _wgmma_rt(rt)
    old = rt.precision
    rt.exec = rt.exec.with_precision("tf32")
    try:
        for i, (M, N, K) in enumerate([(2 * tile[0], 2 * tile[1], 96), (tile[0] + 36, 2 * tile[1] - 44, 132),
                                       (tile[0] - 3, tile[1] + 8, 36)]):
            p = make_plan("wgmma", tile, 1, K)
            for epi in ("none", "bias", "gelu", "residual_alias", "residual_bias", "dgelu"):
                _check_matmul(rt, M, N, K, False, True, epi, seed=i * 10 + len(epi), plan=p)
        M, N, K = tile[0] + 4, tile[1] + 8, 740
        _check_matmul(rt, M, N, K, False, True, "gelu", seed=7, plan=make_plan("wgmma", tile, 3, K))
        _check_batched_wgmma(rt, tile, 3, 100, tile[1] - 8, 64, seed=9)
    finally:
        rt.exec = rt.exec.with_precision(old)


def _check_batched_wgmma(rt, tile, batch, M, N, K, seed):
    """0.5 x A @ B^T over a batch, K-major operands, forced onto a wgmma tile."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((batch, M, K)).astype(np.float32)
    b = rng.standard_normal((batch, N, K)).astype(np.float32)
    out = rt.empty((batch, M, N))
    gemm.matmul_batched(rt, out, rt.upload(a), rt.upload(b), False, True, alpha=0.5,
                        plan=make_plan("wgmma", tile, 1, K))
    _close("tf32", rt.download(out), lambda x, y: 0.5 * ref.matmul_forward(x, y, False, True), a, b,
           f"batched wgmma {tile}")


WS_TILES = [t for t in FAMILIES["wgmma"].tiles if FAMILIES["wgmma"].geometry(t).persistent]


@gpu
@pytest.mark.parametrize("tile", WS_TILES, ids=lambda t: "x".join(map(str, t)))
def test_wgmma_ws_walks_many_tiles(rt, splitk_ws, tile):
    """The persistent kernel with more output tiles than blocks (one per SM): each block walks
    several tiles of ragged m and n (8 or 9 in one case), the ring's slots and parities running on
    across them, with the epilogues that write aux or read it and the pair of bias buffers the
    tiles take in turn; with split-K (tiles x splits) and batched (tiles x batch)."""
    _wgmma_rt(rt)
    old = rt.precision
    rt.exec = rt.exec.with_precision("tf32")
    try:
        sms = rt.info.sm_count
        M, N = tile[0] * 12 - 20, tile[1] * 12 - 36          # 144 tiles > 132 blocks
        assert cdiv(M, tile[0]) * cdiv(N, tile[1]) > sms
        for epi, K in (("bias", 100), ("gelu", 260), ("dgelu", 68), ("residual_alias", 132)):
            _check_matmul(rt, M, N, K, False, True, epi, seed=K, plan=make_plan("wgmma", tile, 1, K))
        M, N = tile[0] * 33 - 5, tile[1] * 33 - 12             # 8 or 9 tiles a block
        for epi in ("gelu", "bias", "dgelu"):
            _check_matmul(rt, M, N, 68, False, True, epi, seed=33, plan=make_plan("wgmma", tile, 1, 68))
        M, N = tile[0] * 6 - 20, tile[1] * 8 - 36               # 48 tiles x 3 splits (the 32 MB workspace)
        _check_matmul(rt, M, N, 740, False, True, "none", seed=740, plan=make_plan("wgmma", tile, 3, 740))
        _check_batched_wgmma(rt, tile, 5, 3 * tile[0] + 7, 9 * tile[1] + 8, 96, seed=3)
    finally:
        rt.exec = rt.exec.with_precision(old)


@pytest.fixture
def bt_ws(rt):
    """The wgmma kernel's transposed-B scratch, as memory.py plans it for TF32."""
    ws = rt.empty((1 << 20,), name="gemm_bT")
    with _workspaces(rt, gemm_bT=ws):
        yield ws


@gpu
@pytest.mark.parametrize("tile", [t for t in FAMILIES["wgmma"].tiles if t[:2] in ((128, 128), (128, 256))],
                         ids=lambda t: "x".join(map(str, t)))
def test_wgmma_transposed_b(rt, splitk_ws, bt_ws, tile):
    """A @ B with B [K, N] (the backward's dX = dY @ W): B^T into the scratch, then the wgmma kernel;
    ragged shapes, the epilogues the backward uses, split-K."""
    _wgmma_rt(rt)
    old = rt.precision
    rt.exec = rt.exec.with_precision("tf32")
    try:
        for i, (M, N, K) in enumerate([(2 * tile[0], tile[1], 96), (tile[0] + 36, tile[1] + 44, 132)]):
            p = make_plan("wgmma", tile, 1, K, transpose_b=True)
            for epi in ("none", "bias", "dgelu", "residual_alias"):
                _check_matmul(rt, M, N, K, False, False, epi, seed=i * 10 + len(epi), plan=p)
        _check_matmul(rt, 300, 200, 740, False, False, "none", seed=5,
                      plan=make_plan("wgmma", tile, 3, 740, transpose_b=True))
    finally:
        rt.exec = rt.exec.with_precision(old)


# ---- weight gradients A^T @ B on the register-A kernels: B^T or A^T into "gemm_aT" -------------
@pytest.fixture(scope="module")
def _at_buffer(rt):
    return rt.empty((8 << 20,), name="gemm_aT")      # 32 MB, once per module


@contextmanager
def _at_ws(rt, buf, floats=None):
    """The register-A kernels' scratch "gemm_aT", limited to its first `floats` (None: all of buf)."""
    view = buf if floats is None else DeviceView(buf.ptr, (int(floats),), "f32", "gemm_aT")
    with _workspaces(rt, gemm_aT=view):
        yield view


@gpu
def test_register_a_is_chosen_for_weight_grads(rt, splitk_ws, monkeypatch):
    """On sm_90 with the workspaces memory.py plans for GPT-2 small (B8 T1024, TF32), the cost
    model (no measured table) sends every per-layer weight gradient dW = dY^T @ X to a register-A
    kernel after one transpose into gemm_aT (X^T for wgmma_ra, dY^T for the swapped wgmma_ra_t, as
    the measured table does); the MLP's is checked against float64."""
    _wgmma_rt(rt)
    monkeypatch.setenv("GPTCUDA_GEMM_TUNE", "0")
    cfg = config_of(batch_size=8, block_size=1024, n_embd=768, n_head=12, n_layer=12,
                          vocab_size=50304, precision="tf32")
    K = 8192
    ws = gemm.workspace(cfg)
    old = rt.precision
    rt.exec = rt.exec.with_precision("tf32")
    at = rt.empty(ws["gemm_aT"][0], poison=False, name="gemm_aT")
    try:
        with _at_ws(rt, at):
            for M, N in [(2304, 768), (768, 768), (3072, 768), (768, 3072)]:
                prog = rt.begin("probe")
                try:
                    gemm.matmul(rt, rt.empty((M, N), poison=False), rt.empty((K, M), poison=False),
                                rt.empty((K, N), poison=False), True, False)
                finally:
                    rt.end()
                names = [it.fn.name for it in prog.items]
                assert names[0] == transpose_name(True), (M, N, names)
                swapped = ",true,384," in names[1]                 # TC: out^T stored transposed (wgmma_ra_t)
                assert names[1].startswith("gemm_wgmma_ra<") and swapped == (N > M), (M, N, names)
            _check_matmul(rt, 3072, 768, K, True, False, "none", seed=1)
    finally:
        rt.exec = rt.exec.with_precision(old)


# ---- fp32 as three TF32 products (3xTF32, family "wgmma3_ra") ------------------------------------
WS3_CASES = [("wgmma3_ra", t) for t in FAMILIES["wgmma3_ra"].tiles]


@gpu
@pytest.mark.parametrize("precision", ["fp32"], indirect=True)
@pytest.mark.parametrize("fam,tile", WS3_CASES, ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x)))
def test_wgmma3_ra_tile_forced(rt, precision, splitk_ws, fam, tile):
    """Every tile of the 3xTF32 kernel that splits (and turns) B as stored in shared memory and A in the
    consumers' registers (wgmma3_ra), forced, at fp32's tolerance: the op interface's layouts and
    epilogues (PRODUCTS), interior blocks and ragged edges in m, n and k,
    more tiles than blocks (each block walks several), split-K."""
    _wgmma_rt(rt)
    shapes = [(2 * tile[0], 2 * tile[1], 96), (tile[0] + 36, 2 * tile[1] - 44, 132), (tile[0] - 4, tile[1] + 8, 36),
              (tile[0] * 12 - 20, tile[1] * 12 - 36, 100)]
    for i, (M, N, K) in enumerate(shapes):
        p = make_plan(fam, tile, 1, K)
        for j, (ta, tb) in enumerate(LAYOUTS):
            for epi in ("none", "bias", "gelu", "residual_alias", "residual_bias", "dgelu"):
                if is_product(ta, tb, epi) and (i == 0 or (ta, tb) == (False, True) or epi == "none"):
                    _check_matmul(rt, M, N, K, ta, tb, epi, seed=i * 100 + j * 10 + len(epi), plan=p)
    M, N, K = tile[0] * 3 + 4, tile[1] * 2 + 8, 740
    for j, (ta, tb) in enumerate(LAYOUTS):
        _check_matmul(rt, M, N, K, ta, tb, "gelu" if (ta, tb) == (False, True) else "none", seed=7 + j,
                      plan=make_plan(fam, tile, 3, K))


@gpu
@pytest.mark.parametrize("M,N,K,ta,tb", [(4096, 1536, 384, False, True), (4096, 384, 1536, False, True),
                                         (4096, 384, 1536, False, False), (4096, 1152, 384, False, True),
                                         (1152, 384, 4096, True, False), (384, 1536, 4096, True, False)])
@pytest.mark.parametrize("precision", ["fp32"], indirect=True)
def test_3xtf32_is_as_accurate_as_simt(rt, precision, no_ws, M, N, K, ta, tb):
    """The model's products in fp32 (the weight gradients with K = 4096 tokens): 3xTF32 (the cost
    model's best 3xTF32 plan) against float64 is within 2x of the SIMT FMA kernel's error (both
    ~1e-7 relative to max|ref|)."""
    _wgmma_rt(rt)
    rng = np.random.default_rng(M + N + K)
    a, b = _operands(rng, M, N, K, ta, tb)
    want = ref.matmul_forward(a, b, ta, tb)
    da, db = rt.upload(a), rt.upload(b)
    errs = {}
    for fam in ("wgmma3_ra", "simt"):
        p = plan(Product(M, N, K, ta, tb), "simt", "3xtf32", rt.info.sm_count, tiles=FAMILIES["wgmma3_ra"].tiles)
        if fam == "simt":
            p = plan(Product(M, N, K, ta, tb), "simt", sm_count=rt.info.sm_count)
        assert p.family == fam, p
        out = rt.empty((M, N))
        rt.memset(out, 0x7FC00000)                       # poison: NaN
        gemm.matmul(rt, out, da, db, ta, tb, plan=p)
        errs[fam] = rel_err(rt.download(out), want)
    assert errs["wgmma3_ra"] < 2e-6 and errs["wgmma3_ra"] <= 2.0 * errs["simt"], errs


@gpu
@pytest.mark.parametrize("K,N", [(64, 128), (300, 388), (37, 5), (130, 66), (4, 2049)])
def test_transpose(rt, K, N):
    """gemm_transpose: x [K, N] -> x^T [N, K], bit for bit; full tiles, ragged tiles and the scalar
    fallback (K or N not a multiple of 4)."""
    rng = np.random.default_rng(K * N)
    x = (rng.standard_normal((K, N)) * 10.0 ** rng.integers(-3, 3, (K, N))).astype(np.float32)
    out = rt.empty((N, K))
    rt.memset(out, 0x7FC00000)
    _transpose(rt, out, rt.upload(x), K, N)
    assert np.array_equal(rt.download(out), x.T)


@gpu
@pytest.mark.parametrize("K,N", [(64, 128), (300, 388), (37, 5), (130, 66)])
def test_transpose_colsum(rt, K, N):
    """gemm_transpose<VEC, true>: x^T bit for bit, and colsum[chunk0 + i] = the column sums of
    x's rows 64 i .. 64 i + 63 (four 16-row sums added in order), rows outside the tiles untouched."""
    rng = np.random.default_rng(K + N)
    x = rng.standard_normal((K, N)).astype(np.float32)
    tiles, chunk0 = -(-K // 64), 3
    out, colsum = rt.empty((N, K)), rt.empty((chunk0 + tiles + 2, N))
    rt.memset(out, 0x7FC00000)
    rt.memset(colsum, 0x7FC00000)
    _transpose(rt, out, rt.upload(x), K, N, colsum=colsum, chunk0=chunk0)
    assert np.array_equal(rt.download(out), x.T)
    got = rt.download(colsum)
    assert np.all(np.isnan(got[:chunk0])) and np.all(np.isnan(got[chunk0 + tiles:]))
    for i in range(tiles):
        rows = np.zeros((64, N), np.float32)
        rows[:min(64, K - 64 * i)] = x[64 * i:64 * i + 64]
        want = [np.float32(0)] * 4
        for q in range(4):
            s = np.zeros(N, np.float32)
            for r in range(16):
                s = s + rows[16 * q + r]
            want[q] = s
        assert np.array_equal(got[chunk0 + i], ((want[0] + want[1]) + want[2]) + want[3]), i


@gpu
def test_weight_grad_a_colsum(rt, no_ws):
    """matmul(dW, dY, X, trans_a, a_colsum=db) on a plan whose kernel does not sum A (mma.sync):
    db = dY.sum(0) by bias_grad, dW unchanged by it (bit for bit against the same plan without
    a_colsum), db NaN-poisoned before."""
    old = rt.precision
    rt.exec = rt.exec.with_precision("tf32")
    M, N, K = 196, 172, 740
    rng = np.random.default_rng(0)
    a, b = _operands(rng, M, N, K, True, False)
    da, db = rt.upload(a), rt.upload(b)
    part = rt.empty((256 * M,), name="bias_partials")
    try:
        with _workspaces(rt, bias_partials=part):
            for q in [make_plan("tf32", (128, 128, 32, 2, 2, 3), 1, K)]:
                out, out2, bias = rt.empty((M, N)), rt.empty((M, N)), rt.empty((M,))
                rt.memset(bias, 0x7FC00000)
                gemm.matmul(rt, out, da, db, True, False, plan=q, a_colsum=bias)
                gemm.matmul(rt, out2, da, db, True, False, plan=q)
                assert np.array_equal(rt.download(out), rt.download(out2))
                want = a.astype(np.float64).sum(0)
                got = rt.download(bias)
                assert rel_err(got, want) < 1e-5, (plan_label(q), rel_err(got, want))
    finally:
        rt.exec = rt.exec.with_precision(old)


def _check_a_colsum(rt, fam, tile, tbs, part):
    """matmul(dW, dY, X, trans_a, a_colsum=db) on a `fam` plan that sums A [K, M] as it reads it:
    db = dY.sum(0) from one row of partials per split (poisoned before: every row written) added by
    sum_rows, dW bit for bit the plain kernel's. Ragged m / n / k, several m and n tiles (more
    tiles than blocks in one case), split-K; B [K, N] or, tb, [N, K] (wgmma_ra: B [K, N] transposed
    first)."""
    cases = [(196, 172, 740, 1), (300, 200, 740, 3), (68, 36, 36, 1), (tile[0] * 11 - 20, tile[1] * 13 - 36, 100, 1),
             (1100, 520, 2000, 2)]
    for i, (M, N, K, splits) in enumerate(cases):
        for tb in tbs:
            rng = np.random.default_rng(i)
            a, b = _operands(rng, M, N, K, True, tb)
            da, db = rt.upload(a), rt.upload(b)
            p = make_plan(fam, tile, splits, K, transpose_b=fam == "wgmma_ra" and not tb)
            out, out2, bias = rt.empty((M, N)), rt.empty((M, N)), rt.empty((M,))
            rt.memset(bias, 0x7FC00000)
            rt.memset(part, 0x7FC00000)
            gemm.matmul(rt, out, da, db, True, tb, plan=p, a_colsum=bias)
            gemm.matmul(rt, out2, da, db, True, tb, plan=p)
            assert np.array_equal(rt.download(out), rt.download(out2)), (M, N, K, splits, tb)
            want = a.astype(np.float64).sum(0)
            got = rt.download(bias)
            assert rel_err(got, want) < 1e-5, (M, N, K, splits, tb, rel_err(got, want))


RA_CASES = [(f, t) for f in ("wgmma_ra", "wgmma_ra_mn", "wgmma_ra_t") for t in FAMILIES[f].tiles]


@gpu
@pytest.mark.parametrize("fam,tile", RA_CASES,
                         ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x)))
def test_tf32_as_stored_a_colsum(rt, _at_buffer, splitk_ws, fam, tile):
    """The weight gradient's bias gradient (TF32) from gemm_wgmma_ra's consumers, or wgmma_ra_t's A^T
    transpose: _check_a_colsum (wgmma_ra: B [K, N] and [N, K])."""
    _wgmma_rt(rt)
    old = rt.precision
    rt.exec = rt.exec.with_precision("tf32")
    part = rt.empty((256 * 1500,), name="bias_partials")
    try:
        with _at_ws(rt, _at_buffer), _workspaces(rt, bias_partials=part):
            _check_a_colsum(rt, fam, tile, (False, True) if fam == "wgmma_ra" else (False,), part)
    finally:
        rt.exec = rt.exec.with_precision(old)


@gpu
@pytest.mark.parametrize("fam,tile", RA_CASES, ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x)))
def test_wgmma_ra_tile_forced(rt, splitk_ws, _at_buffer, fam, tile):
    """dW = A^T @ B with A [K, M] read as stored through registers (gemm_wgmma_ra: fragments from the
    MN-major swizzled boxes, rows permuted and put back by the epilogue): ragged m (not a multiple
    of 32: the copy engine's zeros), n and k, the epilogues a weight gradient takes, B [K, N]
    (wgmma_ra: transposed first into gemm_aT; wgmma_ra_mn: turned by the producers) and, for
    wgmma_ra, B [N, K] as stored; split-K; more tiles than blocks (each block walks several).
    wgmma_ra_t: the product out^T = B^T A (B through registers, A^T first) stored transposed, no
    epilogue."""
    _wgmma_rt(rt)
    old = rt.precision
    rt.exec = rt.exec.with_precision("tf32")
    tbs = (False, True) if fam == "wgmma_ra" else (False,)
    try:
        with _at_ws(rt, _at_buffer):
            for i, (M, N, K) in enumerate([(2 * tile[0], 2 * tile[1], 96), (tile[0] + 36, 2 * tile[1] - 44, 132),
                                           (68, 36, 36), (tile[0] * 12 - 20, tile[1] * 12 - 36, 100)]):
                for tb in tbs:
                    p = make_plan(fam, tile, 1, K, transpose_b=fam == "wgmma_ra" and not tb)
                    _check_matmul(rt, M, N, K, True, tb, "none", seed=i * 10 + tb, plan=p)
            for tb in tbs:
                bt = fam == "wgmma_ra" and not tb
                _check_matmul(rt, 300, 200, 740, True, tb, "none", seed=5,
                              plan=make_plan(fam, tile, 3, 740, transpose_b=bt))
                _check_matmul(rt, 900, 520, 8200, True, tb, "none", seed=6,     # (A^T of wgmma_ra_t: 7.4 M floats)
                              plan=make_plan(fam, tile, 1, 8200, transpose_b=bt))
            for epi in ("bias", "residual"):            # dY^T X takes no epilogue
                with pytest.raises(ValueError, match="not compiled for .* epilogue code"):
                    _check_matmul(rt, 64, 64, 64, True, False, epi, plan=make_plan(
                        fam, tile, 1, 64, transpose_b=fam == "wgmma_ra"))
    finally:
        rt.exec = rt.exec.with_precision(old)


@gpu
@pytest.mark.parametrize("precision", ["fp32"], indirect=True)
@pytest.mark.parametrize("fam,tile", WS3_CASES, ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x)))
def test_wgmma3_ra_a_colsum(rt, precision, splitk_ws, fam, tile):
    """The same from gemm_wgmma3_ra's consumers (fp32 as 3xTF32: the
    sums of A's values before their split), B as stored [K, N] or [N, K]."""
    _wgmma_rt(rt)
    part = rt.empty((256 * 1500,), name="bias_partials")
    with _workspaces(rt, bias_partials=part):
        _check_a_colsum(rt, fam, tile, (False,), part)      # (TT is no product: PRODUCTS)


@gpu
def test_wgmma_is_chosen_for_the_model(rt, no_ws, bt_ws):
    """On sm_90 the cost model sends the model's x @ W^T products to the wgmma kernel and its
    dY @ W products there through B^T (when the scratch is planned), and its weight gradients with no
    gemm_aT planned to a kernel that transposes nothing; a wgmma plan is refused where the kernel
    cannot run."""
    _wgmma_rt(rt)
    old = rt.precision
    rt.exec = rt.exec.with_precision("tf32")
    try:
        prog = rt.begin("probe")
        try:
            x, w, out = rt.empty((16384, 384)), rt.empty((1152, 384)), rt.empty((16384, 1152))
            gemm.matmul(rt, out, x, w, False, True, bias=rt.empty((1152,)))
            gemm.matmul(rt, rt.empty((16384, 384)), out, w, False, False)
            gemm.matmul(rt, rt.empty((1152, 384)), out, x, True, False)
        finally:
            rt.end()
        names = [it.fn.name for it in prog.items]
        assert names[0].startswith("gemm_wgmma"), names           # gemm_wgmma / gemm_wgmma_tma
        assert names[1] == transpose_name(True) and names[2].startswith("gemm_wgmma"), names
        assert not any(n.startswith("gemm_transpose") for n in names[3:]), names
        p = make_plan("wgmma", FAMILIES["wgmma"].tiles[0], 1, 64)
        with pytest.raises(ValueError, match="wgmma"):
            gemm.matmul(rt, rt.empty((64, 64)), rt.empty((64, 64)), rt.empty((64, 64)), False, False, plan=p)
        with pytest.raises(ValueError, match="wgmma"):
            gemm.matmul(rt, rt.empty((64, 64)), rt.empty((64, 64)), rt.empty((64, 64)), True, True, plan=p)
    finally:
        rt.exec = rt.exec.with_precision(old)


@gpu
def test_tuned_table_is_used(rt, splitk_ws, tmp_path, monkeypatch):
    """A table entry (as bench/tune.py writes it) changes the kernel matmul launches; results agree."""
    monkeypatch.setenv("GPTCUDA_CACHE", str(tmp_path / "kc"))
    forget_tables()
    old = rt.precision
    rt.exec = rt.exec.with_precision("tf32")
    try:
        M, N, K = 1000, 384, 200
        p = make_plan("tf32", (192, 128, 32, 3, 2, 3), 1, K)
        save_table(rt.info.name, {table_key("tf32", Product(M, N, K, False, True, "gelu", True)): plan_to_json(p)})
        prog = rt.begin("probe")
        try:
            gemm.matmul(rt, rt.empty((M, N)), rt.empty((M, K)), rt.empty((N, K)), False, True,
                        bias=rt.empty((N,)), epilogue="gelu", aux=rt.empty((M, N)))
        finally:
            rt.end()
        assert prog.items[0].fn.name == FAMILIES["tf32"].kernel(p.tile, False, True, EPI_GELU, True, True)
        _check_matmul(rt, M, N, K, False, True, "gelu", seed=3)
    finally:
        rt.exec = rt.exec.with_precision(old)
        forget_tables()


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"], indirect=True)
def test_splitk_deterministic(rt, precision, splitk_ws):
    M, N, K = 384, 1152, 16384
    rng = np.random.default_rng(3)
    a, b = _operands(rng, M, N, K, True, False)
    da, db = rt.upload(a), rt.upload(b)
    outs = []
    for _ in range(3):
        out = rt.empty((M, N))
        gemm.matmul(rt, out, da, db, True, False)
        outs.append(rt.download(out))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    _close(precision, outs[0], lambda x, y: ref.matmul_forward(x, y, True, False), a, b, "splitk")


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"], indirect=True)
def test_matmul_square_4096(rt, precision, no_ws):
    _check_matmul(rt, 1024, 1024, 4096, False, False, "none", seed=11)


# ---- batched (attention: scores = q @ k^T * scale, y = att @ v, and their backward) ------
@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"], indirect=True)
@pytest.mark.parametrize("ta,tb", LAYOUTS)
@pytest.mark.parametrize("lead,M,N,K", [((2, 3), 67, 65, 33), ((4, 6), 256, 256, 64),
                                        ((3, 2), 256, 64, 256), ((5,), 1, 7, 3)])
def test_matmul_batched(rt, precision, lead, M, N, K, ta, tb):
    rng = np.random.default_rng(M + N + K + len(lead))
    a = rng.standard_normal(lead + ((K, M) if ta else (M, K))).astype(np.float32)
    b = rng.standard_normal(lead + ((N, K) if tb else (K, N))).astype(np.float32)
    alpha = 0.125
    out = rt.empty(lead + (M, N))
    gemm.matmul_batched(rt, out, rt.upload(a), rt.upload(b), ta, tb, alpha=alpha)
    _close(precision, rt.download(out), lambda x, y: alpha * ref.matmul_forward(x, y, ta, tb),
           a, b, f"batched {lead} {M}x{N}x{K} ta={ta} tb={tb}")


@gpu
def test_batched_misaligned_stride(rt):
    # per-batch stride M*K = 3*5 floats is not a multiple of 4: the scalar path must be used
    rng = np.random.default_rng(9)
    a = rng.standard_normal((7, 3, 5)).astype(np.float32)
    b = rng.standard_normal((7, 5, 4)).astype(np.float32)
    out = rt.empty((7, 3, 4))
    gemm.matmul_batched(rt, out, rt.upload(a), rt.upload(b))
    assert rel_err(rt.download(out), ref.matmul_forward(a, b)) < 1e-5


@gpu
def test_leading_dims_flatten(rt, no_ws):
    # out [B, T, N] = x [B, T, K] @ W^T, W [N, K]; dW [N, K] = dout^T @ x with [B, T, .] views
    rng = np.random.default_rng(2)
    B, T, K, N = 3, 37, 24, 40
    x = rng.standard_normal((B, T, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    out = rt.empty((B, T, N))
    gemm.matmul(rt, out, rt.upload(x), rt.upload(w), False, True)
    want = x.reshape(-1, K) @ w.astype(np.float64).T
    assert rel_err(rt.download(out).reshape(-1, N), want) < 1e-5
    dout = rng.standard_normal((B, T, N)).astype(np.float32)
    dw = rt.empty((N, K))
    gemm.matmul(rt, dw, rt.upload(dout), rt.upload(x), True, False)
    want = dout.reshape(-1, N).astype(np.float64).T @ x.reshape(-1, K)
    assert rel_err(rt.download(dw), want) < 1e-5


# ---- the mma.sync fragment mapping and the tf32 rounding the TF32 kernel assumes ------------
def _frag_c(r, n):
    """(lane, register) that holds D[r, n] of an m16n8k8 (gemm_tf32.cu's assumption)."""
    return 4 * (r % 8) + n // 2, n % 2 + 2 * (r // 8)


@gpu
def test_mma_probe_fragment_mapping(rt):
    fn = rt.function(TF32_FILE, "mma_probe")
    rng = np.random.default_rng(0)
    b = rng.integers(1, 64, size=(8, 8)).astype(np.float32)      # exact in tf32
    db = rt.upload(b)
    d, raw = rt.empty((16, 8)), rt.empty((32, 4))
    for r in range(16):
        for k in range(8):
            a = np.zeros((16, 8), np.float32)
            a[r, k] = 1.0                                           # one-hot A: D = e_r b[k, :]
            rt.launch(fn, (1,), (32,), [d, raw, rt.upload(a), db])
            got_d, got_raw = rt.download(d), rt.download(raw)
            want = np.zeros((16, 8), np.float32)
            want[r] = b[k]
            assert np.array_equal(got_d, want), (r, k)
            want_raw = np.zeros((32, 4), np.float32)
            for n in range(8):
                lane, reg = _frag_c(r, n)
                want_raw[lane, reg] = b[k, n]
            assert np.array_equal(got_raw, want_raw), (r, k)
    # a general product of small integers is exact
    a = rng.integers(-8, 8, size=(16, 8)).astype(np.float32)
    rt.launch(fn, (1,), (32,), [d, raw, rt.upload(a), db])
    assert np.array_equal(rt.download(d), a @ b)


@gpu
def test_tf32_rounding_matches_cvt_rna(rt):
    fn = rt.function(TF32_FILE, "tf32_round_probe")
    rng = np.random.default_rng(1)
    x = rng.standard_normal(1 << 16).astype(np.float32) * np.float32(10.0) ** rng.integers(-30, 30, 1 << 16)
    bits = x.view(np.uint32).copy()
    # exact ties, just below / above a tie, the largest finite values, zeros and infinities
    hi = bits[:4096] & np.uint32(0xFFFFE000)
    extra = np.concatenate([hi | np.uint32(0x1000), hi | np.uint32(0x0FFF), hi | np.uint32(0x1001),
                            np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7FF000, 0, 0x80000000,
                                      0x7F800000, 0xFF800000, 0x00800000], np.uint32)])
    bits = np.concatenate([bits, extra])
    exp = (bits >> np.uint32(23)) & np.uint32(0xFF)
    normal_or_zero = (exp != 0) | ((bits & np.uint32(0x7FFFFFFF)) == 0)   # denormals left out
    not_nan = ~((exp == 0xFF) & ((bits & np.uint32(0x7FFFFF)) != 0))
    x = bits[normal_or_zero & not_nan].view(np.float32)
    n = x.size
    out_cvt, out_add = rt.empty((n,), "i32"), rt.empty((n,), "i32")
    rt.launch(fn, ((n + 255) // 256,), (256,), [out_cvt, out_add, rt.upload(x), i32(n)])
    c = rt.download(out_cvt).view(np.uint32) >> 13
    a = rt.download(out_add).view(np.uint32) >> 13
    bad = np.nonzero(c != a)[0]
    assert bad.size == 0, [(hex(x.view(np.uint32)[i]), hex(c[i]), hex(a[i])) for i in bad[:5]]
    assert np.array_equal(a, tf32_round(x).view(np.uint32) >> 13)


# =========================================================================================
# CPU tests: the launchers driven by a recording stand-in for the runtime
# =========================================================================================
_FakeRT, _v = FakeGemmRT, fake_view


def test_launcher_names_are_in_variants():
    """Every kernel the launchers ask for, for the op interface's products (PRODUCTS) and every plan
    the tuner may force on them, is a listed variant; a product outside PRODUCTS is refused on a family
    that reads its operands as stored."""
    variants = {(f, n, tuple(sorted(d.items()))) for f, n, d in gemm.VARIANTS}
    epilogues = {EPI_NONE: "none", EPI_BIAS: "none", EPI_GELU: "gelu", EPI_RESID: "residual",
                 EPI_DGELU: "dgelu"}       # (dgelu_gelu: the bf16 family's alone, refused below)
    for prec, arch in (("fp32", None), ("tf32", None), ("tf32", "sm_90"), ("fp32", "sm_90")):
        rt = _FakeRT(prec, ws=1 << 24, arch=arch, bt=1 << 25 if arch else 0, at=1 << 25 if arch else 0)
        shapes = [(67, 65, 33), (16384, 1152, 384), (16384, 65, 384), (1152, 384, 16384),
                  (65, 384, 16384), (4096, 4096, 4096), (64, 64, 64), (8, 8, 8)]
        for (M, N, K) in shapes:
            for (ta, tb), pairs in PRODUCTS.items():
                a = _v((K, M) if ta else (M, K))
                b = _v((N, K) if tb else (K, N))
                for epi, has_bias in pairs:
                    if epi not in epilogues:
                        continue
                    aux = None if epilogues[epi] == "none" else _v((M, N), 1 << 33)
                    gemm.matmul(rt, _v((M, N)), a, b, ta, tb, bias=_v((N,)) if has_bias else None,
                                epilogue=epilogues[epi], aux=aux)
                # misaligned pointers -> scalar variants
                gemm.matmul(rt, _v((M, N)), _v(a.shape, (1 << 30) + 4), b, ta, tb)
                gemm.matmul_batched(rt, _v((3, M, N)), _v((3,) + a.shape), _v((3,) + b.shape), ta, tb)
        with pytest.raises(ValueError, match="not compiled for NN with epilogue code 5"):
            gemm.matmul(rt, _v((64, 64)), _v((64, 64)), _v((64, 64)), epilogue="dgelu_gelu", aux=_v((64, 64), 1 << 33))
        if arch is None:
            with pytest.raises(ValueError, match="not compiled for TT"):
                gemm.matmul(rt, _v((64, 64)), _v((64, 64)), _v((64, 64)), True, True)
            with pytest.raises(ValueError, match="not a layout"):
                gemm.matmul_batched(rt, _v((3, 8, 8)), _v((3, 8, 8)), _v((3, 8, 8)), True, True)
        # every plan the tuner may force on each of them
        for (M, N, K) in [(16384, 384, 1536), (384, 1152, 16384)]:
            for (ta, tb), pairs in PRODUCTS.items():
                a, b = _v((K, M) if ta else (M, K)), _v((N, K) if tb else (K, N))
                for epi, has_bias in (e for e in pairs if e[0] in epilogues):
                    for p in tune_candidates(Product(M, N, K, ta, tb, epilogues[epi], has_bias), rt.exec.gemm_family,
                                             rt.exec.wgmma_mode, 1 << 24):
                        aux = None if epilogues[epi] == "none" else _v((M, N), 1 << 33)
                        gemm.matmul(rt, _v((M, N)), a, b, ta, tb, bias=_v((N,)) if has_bias else None,
                                    epilogue=epilogues[epi], aux=aux, plan=p)
        missing = rt.names - variants
        assert not missing, f"launched but not in VARIANTS: {sorted(missing)[:5]}"
        assert (arch is not None) == any(n[0] == WGMMA_FILE for n in rt.names), (prec, arch)
        assert (arch is not None and prec == "tf32") == any(n[1] == transpose_name(True) for n in rt.names), (prec, arch)
        # every launch has a legal geometry
        for name, grid, block, smem in rt.launches:
            grid = tuple(grid) + (1,) * (3 - len(grid))
            assert 1 <= grid[0] and 1 <= grid[1] <= 65535 and 1 <= grid[2] <= 65535, (name, grid)
            assert block[0] in (64, 128, 192, 256, 384, 512, 640), (name, block)   # 384, 640: + a loading warpgroup


def test_matmul_shape_errors():
    rt = _FakeRT()
    with pytest.raises(ValueError, match="rows"):
        gemm.matmul(rt, _v((4, 5)), _v((3, 6)), _v((6, 5)))
    with pytest.raises(ValueError, match="K="):
        gemm.matmul(rt, _v((4, 5)), _v((4, 6)), _v((7, 5)))
    with pytest.raises(ValueError, match="trans_a"):
        gemm.matmul(rt, _v((4, 5)), _v((6, 3)), _v((6, 5)), trans_a=True)
    with pytest.raises(ValueError, match="bias"):
        gemm.matmul(rt, _v((4, 5)), _v((4, 6)), _v((6, 5)), bias=_v((4,)))
    with pytest.raises(ValueError, match="aux"):
        gemm.matmul(rt, _v((4, 5)), _v((4, 6)), _v((6, 5)), epilogue="gelu")
    with pytest.raises(ValueError, match="epilogue"):
        gemm.matmul(rt, _v((4, 5)), _v((4, 6)), _v((6, 5)), epilogue="relu")
    with pytest.raises(ValueError, match="aux"):
        gemm.matmul(rt, _v((4, 5)), _v((4, 6)), _v((6, 5)), epilogue="dgelu")
    with pytest.raises(ValueError, match="no bias"):
        gemm.matmul(rt, _v((4, 5)), _v((4, 6)), _v((6, 5)), bias=_v((5,)), epilogue="dgelu", aux=_v((4, 5), 1 << 33))
    with pytest.raises(ValueError, match="overlap"):      # out aliases the pre-activation it reads
        gemm.matmul(rt, _v((4, 5)), _v((4, 6)), _v((6, 5)), epilogue="dgelu", aux=_v((4, 5)))
    with pytest.raises(ValueError, match="overlap"):      # partial overlap
        gemm.matmul(rt, _v((4, 5)), _v((4, 6)), _v((6, 5)), epilogue="dgelu", aux=_v((4, 5), (1 << 30) + 40))
    with pytest.raises(ValueError, match="batch"):
        gemm.matmul_batched(rt, _v((2, 4, 5)), _v((3, 4, 6)), _v((2, 6, 5)))
    with pytest.raises(ValueError, match=">= 3"):
        gemm.matmul_batched(rt, _v((4, 5)), _v((4, 6)), _v((6, 5)))
    assert not rt.launches


def test_splitk_plan_and_workspace():
    cfg = config_of(batch_size=64, block_size=256, n_embd=384, n_head=6, n_layer=6,
                          vocab_size=65, attention="unfused", precision="fp32", fp32_gemm="ffma")
    ws = gemm.workspace(cfg)                     # SIMT only: the split-K partials alone
    (shape, dtype), = ws.values()
    assert "gemm_splitk" in ws and dtype == "f32"
    cap = shape[0]
    K = cfg.batch_size * cfg.block_size
    for fam in ("simt", "tf32"):
        for (M, N) in [(1152, 384), (384, 384), (1536, 384), (384, 1536), (65, 384),
                       (384, 1152), (384, 65)]:
            p = plan(Product(M, N, K), fam, max_ws=cap)
            assert p.splits > 1 and p.splits * M * N <= cap, (M, N, p)
            assert p.k_chunk % SPLIT_ALIGN == 0
            assert (p.splits - 1) * p.k_chunk < K <= p.splits * p.k_chunk
    # without a workspace there is no split, and the big forward GEMMs never split
    assert plan(Product(1152, 384, K), "simt", max_ws=0).splits == 1
    assert plan(Product(16384, 1152, 384), "simt", max_ws=cap).splits == 1


def test_splitk_launch_sequence():
    rt = _FakeRT(ws=1 << 24)
    gemm.matmul(rt, _v((1152, 384)), _v((1152, 16384)), _v((384, 16384)), False, True, bias=_v((384,)))
    assert len(rt.launches) == 2
    assert rt.launches[1][0] == reduce_name(EPI_BIAS, True)
