"""The bf16 GEMM family (gemm_wgmma_ws and gemm_wgmma_pp with DT = 1, through gemm.matmul) against float64.

Error model: the inputs are exact in bf16 and their products exact in fp32; the kernel sums K products
in fp32 (relative error <= K 2^-24 of sum |a b|, twice that where the tensor core truncates), and a bf16
C adds one rounding of each element (2^-9 of it; conftest.bf16_err's 2^-8 bound). fp32 C: within
FP32_TOL of max|ref| at K <= 4096; bf16 C: bf16_err <= 1 with that fp32 term. GELU's output is checked
against gelu of the pre-activation as stored (bf16), the pre-activation against the float64 one. The bf16
epilogue's GELU and gelu' take tanh from one approximate instruction (tanh.approx.f32, absolute error
~1.2e-5): gelu_abs and dgelu_abs bound what that adds where the values are small (the negative tail), and
test_bf16_gelu_every_input checks the bound on every finite bf16 pre-activation.
CPU tests at the bottom drive the launcher on the recording runtime: the variant and the tensor maps each
layout gets, and the dtypes it refuses.
"""
import numpy as np
import pytest

from gptcuda.model.products import Product
from gptcuda.ops.cuda import elementwise, gemm
from gptcuda.ops.cuda.attention import VARIANTS as ATTENTION_VARIANTS
from gptcuda.ops.cuda.gemm.families import (BF16_OUTS, BF16_PP_WIDE, BF16_TILES, EPI_DGELU, EPI_DGELU_GELU, EPI_NONE,
                                             FAMILIES, VARIANTS, layout_code)
from gptcuda.ops.cuda.gemm.plan import make_plan, plan, plan_unfit, tune_candidates
from gptcuda.ops.reference import ops as ref
from gptcuda.runtime import bf16, compiler
from tests.conftest import FakeGemmRT, bf16_err, fake_view, rel_err

gpu = pytest.mark.gpu
FP32_TOL = 4e-5
FP32_MIN = 2.0 ** -126       # below it the kernels flush to 0
LAYOUTS = [(False, True), (False, False), (True, False)]          # NT, NN, TN: the op interface's products


BF16 = FAMILIES["bf16"]


def _dgelu_tile(tile):
    """tile, or where it has no dgelu kernels (Family.serves) the 256 x 128 tile: the rebuilt GELU is the
    same function whichever tile computes it."""
    return tile if BF16.serves(tile, EPI_DGELU_GELU) else (256, 128, 4, 0)


def gelu_abs(x):
    """What the bf16 GELU's tanh.approx adds: |x| / 2 times its absolute error (< 2^-16.4), and flushed
    subnormals."""
    return 2.0 ** -16 * np.abs(x) + FP32_MIN


def dgelu_abs(x, d):
    """What tanh.approx adds to d * gelu'(x): (1/2 + |x u'(x)|) times its error, below 2^-15 (1 + |x|^3);
    beyond |x| = 8 tanh is +-1 to fp32 and gelu' its limit (0 or 1), which the kernel must give."""
    x = np.asarray(x, dtype=np.float64)
    return np.abs(d) * np.where(np.abs(x) <= 8, 2.0 ** -15 * (1.0 + np.abs(x) ** 3), 0.0) + FP32_MIN


@pytest.fixture
def bf16_rt(rt):
    """The session runtime in precision bf16 with a split-K workspace (restored after)."""
    old_exec, old_ws = rt.exec, dict(rt._workspace)
    rt.exec = rt.exec.with_precision("bf16")
    rt.set_workspace({**old_ws, "gemm_splitk": rt.empty((4 << 20,), name="gemm_splitk"),
                      elementwise.WORKSPACE: rt.empty((elementwise.MAX_CHUNKS, 1024), name=elementwise.WORKSPACE)})
    yield rt
    rt.exec = old_exec
    rt.set_workspace(old_ws)


def _operands(rt, rng, ta, tb, M, N, K):
    a64 = bf16.round_f32(rng.standard_normal((K, M) if ta else (M, K))).astype(np.float64)
    b64 = bf16.round_f32(rng.standard_normal((N, K) if tb else (K, N))).astype(np.float64)
    prod = (a64.T if ta else a64) @ (b64.T if tb else b64)
    return rt.upload(a64, "bf16"), rt.upload(b64, "bf16"), prod


def _check(got, ref, out_dtype):
    if out_dtype == "bf16":
        assert bf16_err(bf16.values(got), ref, FP32_TOL) <= 1.0
    else:
        assert rel_err(got, ref) <= FP32_TOL


@gpu
@pytest.mark.parametrize("tile", tuple(BF16_TILES))
@pytest.mark.parametrize("ta,tb", LAYOUTS)
@pytest.mark.parametrize("M,N,K", [(256, 256, 256), (200, 136, 72), (1000, 520, 3072)])
def test_bf16_layouts(bf16_rt, tile, ta, tb, M, N, K):
    rt, rng = bf16_rt, np.random.default_rng(M + N + K)
    a, b, prod = _operands(rt, rng, ta, tb, M, N, K)
    out_dtype = BF16_OUTS[layout_code(ta, tb)][0]
    c = rt.empty((M, N), out_dtype)
    gemm.matmul(rt, c, a, b, ta, tb, plan=make_plan("bf16", tile, 1, K))
    _check(rt.download(c), prod, out_dtype)


@gpu
@pytest.mark.parametrize("tile", tuple(BF16_TILES))
@pytest.mark.parametrize("out", ["bf16", "f32"])
@pytest.mark.parametrize("epi,has_bias", [("none", True), ("gelu", True), ("gelu", False), ("residual", True),
                                          ("residual", False)])
@pytest.mark.parametrize("N", [392, 396])
def test_bf16_forward_epilogues(bf16_rt, epi, has_bias, out, tile, N):
    """x @ W^T into bf16 (activations) or fp32 (a bf16 generation's qkv, residual stream and logits: C and
    aux fp32, the GELU output from the fp32 pre-activation), on every tile; N = 396: rows of C not
    16-byte aligned (the epilogue's element-wise path)."""
    rt, rng = bf16_rt, np.random.default_rng(7)
    M, K = 520, 264
    a, b, prod = _operands(rt, rng, False, True, M, N, K)
    bias = rng.standard_normal(N).astype(np.float32) if has_bias else None
    pre = prod + (bias.astype(np.float64) if has_bias else 0.0)
    c = rt.empty((M, N), out)
    if epi == "residual":
        r64 = bf16.round_f32(rng.standard_normal((M, N))).astype(np.float64)
        aux = rt.upload(r64, out)
        pre = pre + r64
    else:
        aux = rt.empty((M, N), out) if epi == "gelu" else None
    gemm.matmul(rt, c, a, b, False, True, bias=rt.upload(bias) if has_bias else None, epilogue=epi, aux=aux,
                plan=make_plan("bf16", tile, 1, K))
    if out == "f32":
        want = ref.gelu_forward(pre) if epi == "gelu" else pre
        assert rel_err(rt.download(c), want) <= FP32_TOL
        if epi == "gelu":
            assert rel_err(rt.download(aux), pre) <= FP32_TOL
        return
    got = bf16.values(rt.download(c)).astype(np.float64)
    if epi == "gelu":
        stored = bf16.values(rt.download(aux)).astype(np.float64)
        assert bf16_err(stored, pre, FP32_TOL) <= 1.0
        assert bf16_err(got, ref.gelu_forward(stored), 1e-6, gelu_abs(stored)) <= 1.0  # of the pre-activation as stored
    else:
        assert bf16_err(got, pre, FP32_TOL) <= 1.0


@gpu
@pytest.mark.parametrize("tile", [t for t in BF16_TILES if BF16.serves(t, EPI_DGELU)])
def test_bf16_dgelu(bf16_rt, tile):
    rt, rng = bf16_rt, np.random.default_rng(8)
    M, N, K = 520, 392, 264
    a, b, prod = _operands(rt, rng, False, False, M, N, K)
    pre64 = bf16.round_f32(rng.standard_normal((M, N))).astype(np.float64)
    c = rt.empty((M, N), "bf16")
    gemm.matmul(rt, c, a, b, False, False, epilogue="dgelu", aux=rt.upload(pre64, "bf16"),
                plan=make_plan("bf16", tile, 1, K))
    assert bf16_err(bf16.values(rt.download(c)), ref.gelu_backward(prod, pre64), FP32_TOL, dgelu_abs(pre64, prod)) <= 1.0


@gpu
@pytest.mark.parametrize("tile", tuple(BF16_TILES))
@pytest.mark.parametrize("N", [392, 200])
def test_bf16_dgelu_rebuilds_gelu(bf16_rt, tile, N):
    """dgelu_gelu (recompute's backward): out as dgelu's, bit for bit, and the pre-activation rewritten into
    the forward GELU epilogue's output of it, bit for bit (the rebuilt GELU is the one the forward stored);
    N = 200: the last column tile partly outside (the product's B rows are C's: 16-byte aligned here)."""
    rt, rng = bf16_rt, np.random.default_rng(9)
    M, K = 520, 264
    x, w, _ = _operands(rt, rng, False, True, M, N, K)            # the forward: act = gelu(pre), pre = x @ w^T
    pre, act = rt.empty((M, N), "bf16"), rt.empty((M, N), "bf16")
    gemm.matmul(rt, act, x, w, False, True, epilogue="gelu", aux=pre, plan=make_plan("bf16", tile, 1, K))
    dy, w2, prod = _operands(rt, rng, False, False, M, N, K)
    d_ref, d_new = rt.empty((M, N), "bf16"), rt.empty((M, N), "bf16")
    gemm.matmul(rt, d_ref, dy, w2, False, False, epilogue="dgelu", aux=pre,
                plan=make_plan("bf16", _dgelu_tile(tile), 1, K))
    pre_bits, act_bits = rt.download(pre), rt.download(act)
    assert not np.array_equal(pre_bits, act_bits)
    gemm.matmul(rt, d_new, dy, w2, False, False, epilogue="dgelu_gelu", aux=pre,
                plan=make_plan("bf16", _dgelu_tile(tile), 1, K))
    assert np.array_equal(rt.download(d_new), rt.download(d_ref))
    assert np.array_equal(rt.download(pre), act_bits)
    pre64 = bf16.values(pre_bits).astype(np.float64)
    assert bf16_err(bf16.values(rt.download(d_new)), ref.gelu_backward(prod, pre64), FP32_TOL,
                    dgelu_abs(pre64, prod)) <= 1.0


@gpu
@pytest.mark.parametrize("tile", tuple(BF16_TILES))
def test_bf16_gelu_every_input(bf16_rt, tile):
    """The bf16 epilogue's GELU and gelu' on every finite bf16 pre-activation (the GELU's whole input domain:
    the forward rounds the pre-activation to bf16 first), against float64 within gelu_abs / dgelu_abs: pre =
    I @ table^T (exact), dgelu's product 1 (exact), dgelu_gelu's rebuilt GELU bit for bit the forward's."""
    rt = bf16_rt
    M = N = 256
    table = np.arange(1 << 16, dtype=np.uint16)
    table[(table & 0x7F80) == 0x7F80] = 0                                   # inf and NaN out
    b_bits = table.reshape(N, M)                                            # B [N, K = M]: pre = B^T
    pre, act = rt.empty((M, N), "bf16"), rt.empty((M, N), "bf16")
    gemm.matmul(rt, act, rt.upload(np.eye(M), "bf16"), rt.upload(b_bits, "bf16"), False, True, epilogue="gelu",
                aux=pre, plan=make_plan("bf16", tile, 1, M))
    x = bf16.values(b_bits).astype(np.float64).T
    assert np.array_equal(bf16.values(rt.download(pre)), x)
    act_bits = rt.download(act)
    assert bf16_err(bf16.values(act_bits), ref.gelu_forward(x), 0.0, gelu_abs(x)) <= 1.0
    K = 64
    ones_a, ones_b = np.zeros((M, K)), np.zeros((K, N))
    ones_a[:, 0], ones_b[0, :] = 1.0, 1.0
    a, b = rt.upload(ones_a, "bf16"), rt.upload(ones_b, "bf16")
    d_ref, d_new = rt.empty((M, N), "bf16"), rt.empty((M, N), "bf16")
    gemm.matmul(rt, d_ref, a, b, False, False, epilogue="dgelu", aux=pre,
                plan=make_plan("bf16", _dgelu_tile(tile), 1, K))
    assert bf16_err(bf16.values(rt.download(d_ref)), ref.gelu_backward(1.0, x), 0.0, dgelu_abs(x, 1.0)) <= 1.0
    gemm.matmul(rt, d_new, a, b, False, False, epilogue="dgelu_gelu", aux=pre,
                plan=make_plan("bf16", _dgelu_tile(tile), 1, K))
    assert np.array_equal(rt.download(d_new), rt.download(d_ref))
    assert np.array_equal(rt.download(pre), act_bits)


@gpu
@pytest.mark.parametrize("tile", tuple(BF16_TILES))
def test_bf16_two_outputs_many_tiles_a_block(bf16_rt, tile):
    """The epilogues that write two outputs (GELU: C and the pre-activation; dgelu_gelu: dgelu and the GELU
    rebuilt), and those that read aux (dgelu, the residual), with several tiles a block (~400 tiles of 128 x
    128: the persistent blocks walk 3 or more, a ping-pong block's two warpgroups each several), so that the
    staging boxes are reused across boxes and tiles while the copy engine still reads the last ones; M off
    the tile rows. The forward against float64, dgelu_gelu bit for bit as dgelu and the GELU it rebuilds bit
    for bit as the forward's."""
    rt, rng = bf16_rt, np.random.default_rng(11)
    M, N, K = 2120, 3072, 64
    x, w, prod = _operands(rt, rng, False, True, M, N, K)
    bias = rng.standard_normal(N).astype(np.float32)
    pre, act = rt.empty((M, N), "bf16"), rt.empty((M, N), "bf16")
    gemm.matmul(rt, act, x, w, False, True, bias=rt.upload(bias), epilogue="gelu", aux=pre,
                plan=make_plan("bf16", tile, 1, K))
    stored = bf16.values(rt.download(pre)).astype(np.float64)
    assert bf16_err(stored, prod + bias.astype(np.float64), FP32_TOL) <= 1.0
    act_bits = rt.download(act)
    assert bf16_err(bf16.values(act_bits).astype(np.float64), ref.gelu_forward(stored), 1e-6, gelu_abs(stored)) <= 1.0
    dy, w2, _ = _operands(rt, rng, False, False, M, N, K)
    d_ref, d_new = rt.empty((M, N), "bf16"), rt.empty((M, N), "bf16")
    gemm.matmul(rt, d_ref, dy, w2, False, False, epilogue="dgelu", aux=pre,
                plan=make_plan("bf16", _dgelu_tile(tile), 1, K))
    gemm.matmul(rt, d_new, dy, w2, False, False, epilogue="dgelu_gelu", aux=pre,
                plan=make_plan("bf16", _dgelu_tile(tile), 1, K))
    assert np.array_equal(rt.download(d_new), rt.download(d_ref))
    assert np.array_equal(rt.download(pre), act_bits)
    # the residual epilogue reads aux too
    r64 = bf16.round_f32(rng.standard_normal((M, N))).astype(np.float64)
    res = rt.empty((M, N), "bf16")
    gemm.matmul(rt, res, x, w, False, True, bias=rt.upload(bias), epilogue="residual", aux=rt.upload(r64, "bf16"),
                plan=make_plan("bf16", tile, 1, K))
    assert bf16_err(bf16.values(rt.download(res)), prod + bias.astype(np.float64) + r64, FP32_TOL) <= 1.0


@gpu
@pytest.mark.parametrize("tile", [(128, 256, 4, 0), (128, 128, 6, 1)])
@pytest.mark.parametrize("splits", [2, 4])
def test_bf16_weight_gradient_split_k(bf16_rt, splits, tile):
    """TN into fp32 in split-K partials of whole 64-wide k tiles, then the fixed-order reduction; the
    bias gradient (a_colsum) of the bf16 dY beside it."""
    rt, rng = bf16_rt, np.random.default_rng(splits)
    M, N, K = 384, 768, 4096
    a, b, prod = _operands(rt, rng, True, False, M, N, K)
    p = make_plan("bf16", tile, splits, K)
    assert p.k_chunk % 64 == 0
    c, db = rt.empty((M, N)), rt.empty((M,))
    gemm.matmul(rt, c, a, b, True, False, plan=p, a_colsum=db)
    assert rel_err(rt.download(c), prod) <= FP32_TOL
    assert rel_err(rt.download(db), bf16.values(rt.download(a)).astype(np.float64).sum(0)) <= 1e-5


@gpu
@pytest.mark.parametrize("tile", [t for t in BF16_TILES if BF16.serves(t, EPI_NONE, colsum=True)])
@pytest.mark.parametrize("M,splits", [(520, 1), (1000, 1), (520, 3)])
def test_bf16_weight_gradient_column_sums(bf16_rt, tile, M, splits):
    """The bias gradient summed by the TN kernel as A's k tiles pass (COLSUM: M off the 64-row boxes, K off
    the 64-wide k tiles, the sums spread over the row's column tiles: N = 1000 makes 4 to 8): a_colsum =
    dY.sum(0) within the fp32 sum's error, bitwise reproducible, and the weight gradient bit for bit the one
    of the same plan without it."""
    rt, rng = bf16_rt, np.random.default_rng(M + splits)
    N, K = 1000, 2000
    a, b, prod = _operands(rt, rng, True, False, M, N, K)
    p = make_plan("bf16", tile, splits, K)
    plain, c = rt.empty((M, N)), rt.empty((M, N))
    gemm.matmul(rt, plain, a, b, True, False, plan=p)
    sums = []
    for _ in range(2):
        db = rt.empty((M,))
        gemm.matmul(rt, c, a, b, True, False, plan=p, a_colsum=db)
        sums.append(rt.download(db))
    assert np.array_equal(rt.download(c).view(np.uint32), rt.download(plain).view(np.uint32))
    assert rel_err(rt.download(c), prod) <= FP32_TOL
    assert rel_err(sums[0], bf16.values(rt.download(a)).astype(np.float64).sum(0)) <= 1e-5
    assert np.array_equal(sums[0].view(np.uint32), sums[1].view(np.uint32))


def _moves_registers(name):
    """The block size of a kernel whose warpgroups trade registers (setmaxnreg: the bf16 GEMMs,
    gemm_wgmma_ws with DT 1 and gemm_wgmma_pp, and flash_bf16's kernels), else None."""
    params = name[name.index("<") + 1:-1].replace(" ", "").split(",")
    if name.startswith("gemm_wgmma_pp") or (name.startswith("gemm_wgmma_ws") and params[7:8] == ["1"]):
        return int(params[5])
    return int(params[2]) if name.startswith("flash_") and "_bf16<" in name else None


@gpu
def test_register_split_launch_counts(bf16_rt):
    """setmaxnreg.inc waits for registers its block gave back, so the consumers' counts (gemm_wgmma.cu,
    flash_bf16.cu) assume the launch holds __launch_bounds__'s cap: with fewer they would wait forever.
    Every such variant as the runtime compiles it launches with exactly the cap."""
    names = [(f, n) for f, n, _ in (*VARIANTS, *ATTENTION_VARIANTS) if "<" in n and _moves_registers(n)]
    assert len(names) >= 60 and any(n.startswith("flash_") for _, n in names)
    assert not compiler.build_all([(f, n, {}, bf16_rt.arch) for f, n in names])     # in parallel, into the cache
    for f, n in names:
        regs = bf16_rt.function(f, n).attrs["registers"]
        assert regs == 65536 // _moves_registers(n) // 8 * 8, (n, regs)


# ---- CPU: the launcher on the recording runtime ---------------------------------------------------------
def _fake(shape, dtype, ptr):
    v = fake_view(shape, ptr)
    return type(v)(v.ptr, v.shape, dtype, v.name)


@pytest.mark.parametrize("ta,tb", LAYOUTS)
def test_bf16_variant_and_tensor_maps(ta, tb):
    """Each layout launches gemm_wgmma_ws<..., 1, MN_A = ta, MN_B = not tb, OUT> with its operands' tensor
    maps: a K-major operand boxes of one 64-wide k tile by the tile's rows, an MN-major one boxes {64, 64},
    all in the 128-byte swizzle, bf16 strides (2 bytes an element)."""
    rt = FakeGemmRT("bf16", arch="sm_90")
    maps = []
    real = rt.dev.tensor_map
    rt.dev.tensor_map = lambda ptr, dims, strides, box, swizzle=True, dtype="f32": \
        maps.append((tuple(dims), tuple(strides), tuple(box), swizzle, dtype)) or real(ptr, dims, strides, box,
                                                                                       swizzle, dtype)
    M, N, K = 1024, 768, 512
    out = "f32" if ta else "bf16"
    a = _fake((K, M) if ta else (M, K), "bf16", 1 << 30)
    b = _fake((N, K) if tb else (K, N), "bf16", 1 << 32)
    gemm.matmul(rt, _fake((M, N), out, 1 << 34), a, b, ta, tb, plan=make_plan("bf16", (128, 256, 4, 0), 1, K))
    (name, grid, block, smem), = rt.launches
    assert name.startswith("gemm_wgmma_ws<128,256,4,0,false,384,") and \
        name.endswith(f",1,{str(ta).lower()},{str(not tb).lower()},{1 if out == 'bf16' else 0}>")
    (da, sa, ba, swa, ta_), (db, sb, bb, swb, tb_), *store = maps
    assert ta_ == tb_ == "bf16" and swa is True and swb is True
    assert (da, ba, sa[0]) == (((M, K, 1), (64, 64, 1), 2 * M) if ta else ((K, M, 1), (64, 128, 1), 2 * K))
    assert (db, bb, sb[0]) == (((K, N, 1), (64, 256, 1), 2 * K) if tb else ((N, K, 1), (64, 64, 1), 2 * N))
    # a bf16 C is stored by the copy engine (wg_store_tile_tma): boxes of 64 rows x 32 columns, 64-byte swizzle,
    # after a ring of 4 x 48 KB (+ 1 KB) two 4 KB staging boxes for each of the 2 consumer warpgroups
    assert store == ([((N, M, 1), (2 * N, 2 * M * N), (32, 64, 1), 64, "bf16")] if out == "bf16" else [])
    assert smem == 4 * 384 * 128 + 1024 + (2 * 8192 if out == "bf16" else 0)
    assert name.split(",")[6] == str(smem)


def test_bf16_store_maps_only_where_they_describe_c():
    """C whose rows are not 16-byte multiples (N = 50257, the unpadded vocabulary) keeps the threads' stores:
    no store map, c_tma 0, the same kernel; the GELU product maps aux (its pre-activation) as well."""
    names = []
    for N, maps_want, c_tma in ((50257, 2, 0), (50304, 4, 1)):
        rt = FakeGemmRT("bf16", arch="sm_90")
        got = []
        real = rt.dev.tensor_map
        rt.dev.tensor_map = lambda ptr, dims, strides, box, swizzle=True, dtype="f32": \
            got.append(box) or real(ptr, dims, strides, box, swizzle, dtype)
        args = []
        launch = rt.launch
        rt.launch = lambda fn, grid, block, a, smem=0, label=None: args.append(a) or launch(fn, grid, block, a, smem,
                                                                                             label)
        M, K = 512, 768
        a, b = _fake((M, K), "bf16", 1 << 30), _fake((N, K), "bf16", 1 << 32)
        gemm.matmul(rt, _fake((M, N), "bf16", 1 << 34), a, b, False, True, bias=_fake((N,), "f32", 1 << 36),
                    epilogue="gelu", aux=_fake((M, N), "bf16", 1 << 38), plan=make_plan("bf16", (256, 128, 4, 0), 1, K))
        assert len(got) == maps_want and got[2:] == [(32, 64, 1)] * (maps_want - 2)
        assert len(args) == 1 and args[0][-1].value == c_tma
        names += [n for n, *_ in rt.launches]
    assert len(names) == 2 and names[0] == names[1]


def test_bf16_dtype_refusals():
    rt = FakeGemmRT("bf16", arch="sm_90")
    a, b = _fake((256, 128), "bf16", 1 << 30), _fake((256, 128), "bf16", 1 << 32)
    with pytest.raises(TypeError, match="take bf16 operands"):
        gemm.matmul(rt, _fake((256, 256), "bf16", 1 << 34), _fake((256, 128), "f32", 1 << 30), b, False, True)
    with pytest.raises(ValueError, match="into f32"):      # dY @ W writes bf16 activation gradients
        gemm.matmul(rt, _fake((256, 128), "f32", 1 << 34), a, _fake((128, 128), "bf16", 1 << 32), False, False)
    with pytest.raises(TypeError, match="aux of out's type"):
        gemm.matmul(rt, _fake((256, 256), "bf16", 1 << 34), a, b, False, True, epilogue="residual",
                    aux=_fake((256, 256), "f32", 1 << 36))
    tf = FakeGemmRT("tf32", arch="sm_90")
    with pytest.raises(TypeError, match="take f32 operands"):
        gemm.matmul(tf, _fake((256, 256), "f32", 1 << 34), a, b, False, True)


def test_bf16_plans():
    """The cost model plans bf16 products on the bf16 family, split-K chunks in whole 64-wide k tiles,
    and none for a bf16 C (the reduction writes fp32); the variants are compiled for what it plans."""
    p = plan(Product(768, 768, 8192, True, False), "bf16", max_ws=32 * 768 * 768)
    assert p.family == "bf16" and p.splits > 1 and p.k_chunk % 64 == 0
    assert make_plan("bf16", (128, 128, 6, 1), 3, 1000).k_chunk == 384          # 334 rounded up to 64s
    rt = FakeGemmRT("bf16", ws=1 << 24, arch="sm_90")
    M, N, K = 256, 256, 8192
    gemm.matmul(rt, _fake((M, N), "bf16", 1 << 34), _fake((M, K), "bf16", 1 << 30), _fake((N, K), "bf16", 1 << 32),
                False, True)
    assert len(rt.launches) == 1                            # one product: no split-K into a bf16 C
    names = {n for _, n, _ in gemm.VARIANTS}
    assert all(n in names for _, n, _ in rt.names)


def test_bf16_wide_ping_pong_tile_serves_no_dgelu():
    """The 128 x 192 ping-pong tile (192 accumulators a thread) has no dgelu / dgelu_gelu kernels (slower
    there than on 256 x 128: families.py BF16_PP_WIDE): none in VARIANTS, a forced plan refused with the
    reason, and neither the cost model nor the tuner plans them on it; its other products (the GELU forward,
    a weight gradient with its column sums) it serves."""
    t = BF16_PP_WIDE
    assert t in BF16_TILES
    names = {n for _, n, _ in VARIANTS}
    for epi, hb, colsum in ((EPI_DGELU, False, False), (EPI_DGELU_GELU, False, False), (EPI_NONE, False, True)):
        ta = colsum
        def name(tile):
            return BF16.kernel(tile, ta, False, epi, hb, out="f32" if colsum else "bf16", colsum=colsum)
        assert (name(t) in names) == colsum and name((256, 128, 4, 0)) in names
    dw = Product(3072, 768, 8192, True, False, colsum=True)
    assert plan_unfit(make_plan("bf16", t, 4, dw.K), dw, "bf16", out="f32") is None
    assert any(p.tile == t for p in tune_candidates(dw, "bf16", max_ws=1 << 30))
    for g in (Product(8192, 3072, 768, False, False, "dgelu_gelu"), Product(8192, 3072, 768, False, False, "dgelu")):
        assert "has no kernel for epilogue code" in plan_unfit(make_plan("bf16", t, 1, g.K), g, "bf16",
                                                              out="f32" if g.ta else "bf16")
        assert all(p.tile != t for p in tune_candidates(g, "bf16", max_ws=1 << 30))
        assert plan(g, "bf16", max_ws=1 << 30).tile != t
    fwd = Product(8192, 3072, 768, False, True, "gelu", True)
    assert plan_unfit(make_plan("bf16", t, 1, 768), fwd, "bf16", out="bf16") is None
    assert any(p.tile == t for p in tune_candidates(fwd, "bf16"))
