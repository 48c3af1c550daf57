"""GPU tests of causal self-attention (unfused and fused) against the float64 reference."""
import dataclasses
import math

import numpy as np
import pytest

from gptcuda.model import rng
from gptcuda.ops.cuda import attention as attn
from gptcuda.ops.cuda import flash
from gptcuda.ops.reference import ops as ref
from gptcuda.runtime import DeviceView, bf16
from tests.conftest import rel_err
from gptcuda.config import config_of

pytestmark = pytest.mark.gpu

STEP = 7
SITE = rng.dropout_site(2, 0)
FP32_FWD, FP32_BWD = 2e-5, 5e-5
TF32_FWD, TF32_BWD = 2e-3, 3e-3
# bf16 (flash_bf16): the inputs are bf16 values (exact), every sum fp32; what rounds is P (fwd), Pd and
# dS (bwd) to bf16 before the second products and y / dqkv once at the end, each within 2^-8 (bf16's
# unit roundoff: 8 significant bits): two and three unit roundoffs (tf32's tolerances are four and six
# of its 2^-11); lse is fp32 throughout.
BF16_FWD, BF16_BWD, BF16_LSE = 4 * 2.0 ** -9, 6 * 2.0 ** -9, 1e-5


@pytest.fixture
def env(rt):
    """Save and restore what the tests change on the shared runtime."""
    saved = (rt.state, rt.precision, dict(getattr(rt, "_workspace", {})))
    yield rt
    rt.state, rt.exec = saved[0], rt.exec.with_precision(saved[1])
    rt.set_workspace(saved[2])


def _setup(rt, B, T, C, H, kind, p, precision="fp32"):
    cfg = config_of(check=False, batch_size=B, block_size=T, n_embd=C, n_head=H, n_layer=1, vocab_size=65,
                          attention=kind, dropout=p, precision=precision, bias=True)
    plan = dict(attn.workspace(cfg))       # matmul_batched needs no workspace
    views = {name: rt.empty(shape, dtype, name=name) for name, (shape, dtype) in plan.items()}
    rt.set_workspace({**getattr(rt, "_workspace", {}), **views})
    st = np.zeros(16, np.int32)
    st[0] = STEP
    rt.state = rt.upload(st)
    rt.exec = rt.exec.with_precision(precision)
    saved = {name: rt.empty(shape, dtype, name=name) for name, (shape, dtype) in attn.saved_shapes(cfg).items()}
    return saved


def _keep(rt, B, H, T, p):
    if p == 0:
        return None
    return rng.attention_keep(rt.seed, STEP, SITE, (B, H, T, T), p)


def _ref_lse(qkv, H):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // H
    q = qkv[..., :C].reshape(B, T, H, hs).transpose(0, 2, 1, 3).astype(np.float64)
    k = qkv[..., C:2 * C].reshape(B, T, H, hs).transpose(0, 2, 1, 3).astype(np.float64)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) / math.sqrt(hs)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]


def _plan(rt, path):
    """The runtime's plan with the fused attention path asked for (None: the runtime's own rule)."""
    ex = rt.exec
    if path is None:
        return ex
    assert path in attn.FLASH_PATHS, path
    return dataclasses.replace(ex, attention=path)


def _run(rt, B, T, C, H, kind, p, precision="fp32", seed=0, path=None, shift=0):
    """path: the fused path to run (flash | flash_tc | flash_3x | flash_bf16), else the plan's. bf16:
    qkv and dy drawn as bf16 values, the tensors bf16, outputs widened (every output poisoned first).
    shift: lse and D start that many values past a 16-byte boundary (a layer's slice of a stack may)."""
    r = np.random.default_rng(seed + 1000 * T + C)
    dt = "bf16" if precision == "bf16" else "f32"
    qkv_h = r.standard_normal((B, T, 3 * C)).astype(np.float32)
    dy_h = r.standard_normal((B, T, C)).astype(np.float32)
    if dt == "bf16":
        qkv_h, dy_h = bf16.round_f32(qkv_h), bf16.round_f32(dy_h)
    saved = _setup(rt, B, T, C, H, kind, p, precision)
    if shift:
        def shifted(v):
            return DeviceView(rt.empty((v.numel + shift,)).ptr + 4 * shift, v.shape, v.dtype, v.name)
        saved["lse"] = shifted(saved["lse"])
        rt.set_workspace({**rt._workspace, "attention_d": shifted(rt.workspace("attention_d"))})
    ex = _plan(rt, path)
    qkv = rt.upload(qkv_h, dt)
    dy = rt.upload(dy_h, dt)
    y = rt.empty((B, T, C), dt)
    dqkv = rt.empty((B, T, 3 * C), dt)           # (rt.empty poisons; _setup's saved tensors too)
    attn.attention_fwd(rt, y, qkv, saved, H, p, SITE, ex)
    attn.attention_bwd(rt, dqkv, dy, qkv, y, saved, H, p, SITE, ex)
    rt.synchronize()
    keep = _keep(rt, B, H, T, p)
    y_ref, probs_ref = ref.attention_forward(qkv_h, H, keep, p)
    dqkv_ref = ref.attention_backward(dy_h, qkv_h, probs_ref, H, keep, p)
    got = (lambda v: bf16.values(rt.download(v))) if dt == "bf16" else rt.download
    out = {"y": (got(y), y_ref), "dqkv": (got(dqkv), dqkv_ref)}
    if kind == "fused":               # the backward's D = rowsum(dO * O), O as stored (bf16: made by dQ's kernel)
        D_ref = (dy_h.astype(np.float64) * got(y)).reshape(B, T, H, C // H).sum(-1).transpose(0, 2, 1)
        out["D"] = (rt.download(rt.workspace("attention_d")).reshape(-1)[:B * H * T].reshape(B, H, T), D_ref)
    if "probs" in saved:
        out["probs"] = (rt.download(saved["probs"]), probs_ref)
    if "lse" in saved:
        out["lse"] = (rt.download(saved["lse"]), _ref_lse(qkv_h, H))
    return out


def _check(out, fwd_tol, bwd_tol):
    errs = {k: rel_err(a, b) for k, (a, b) in out.items()}
    for k, e in errs.items():
        tol = bwd_tol if k in ("dqkv", "D") else fwd_tol
        assert e < tol, f"{k}: rel_err {e:.3g} >= {tol:g} (all: {errs})"


# B, T, C, H: head sizes 32 and 64, T not a multiple of any tile, and long rows
SHAPES = [
    (2, 67, 64, 2),      # hs 32
    (1, 256, 128, 2),    # hs 64
    (1, 1000, 64, 1),    # hs 64, long rows, tail
    (3, 5, 64, 2),       # tiny T
]


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,T,C,H", SHAPES)
def test_unfused_fp32(env, B, T, C, H, p):
    _check(_run(env, B, T, C, H, "unfused", p), FP32_FWD, FP32_BWD)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_unfused_odd_head_size(env, p):
    # hs = 10: no 16-byte vector path in the permutes
    _check(_run(env, 2, 33, 30, 3, "unfused", p), FP32_FWD, FP32_BWD)


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,T,C,H", [(2, 67, 64, 2), (1, 256, 128, 2)])
def test_unfused_tf32(env, B, T, C, H, p):
    _check(_run(env, B, T, C, H, "unfused", p, "tf32"), TF32_FWD, TF32_BWD)


def test_unfused_probs_causal_zero(env):
    out = _run(env, 1, 40, 64, 2, "unfused", 0.0)
    probs = out["probs"][0]
    upper = np.triu(np.ones((40, 40), bool), 1)
    assert np.all(probs[..., upper] == 0.0)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


FUSED_SHAPES = SHAPES + [
    (1, 130, 256, 2),    # hs 128
    (2, 64, 128, 4),     # exactly one tile
    (1, 300, 64, 2),     # hs 32: three 128-row blocks, tails in every kernel's last tile
    (1, 300, 256, 2),    # hs 128: five 64-row blocks, tails
]


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,T,C,H", FUSED_SHAPES)
def test_fused_fp32(env, B, T, C, H, p):
    """The FFMA kernels (flash: fp32 with fp32_gemm ffma, or no wgmma)."""
    _check(_run(env, B, T, C, H, "fused", p, path="flash"), FP32_FWD, FP32_BWD)


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,T,C,H", FUSED_SHAPES)
def test_fused_3xtf32(env, B, T, C, H, p):
    """The 3xTF32 kernels (flash_3x: fp32 where its GEMMs run as 3xTF32), to the FFMA kernels' tolerances."""
    _check(_run(env, B, T, C, H, "fused", p, path="flash_3x"), FP32_FWD, FP32_BWD)


def test_fused_fp32_follows_the_plan(env):
    """A runtime's own plan (no config) runs fp32 attention as 3xTF32 where its fp32 GEMMs are 3xTF32."""
    env.exec = env.exec.with_precision("fp32")
    ex = env.exec
    assert ex.attention is None and ex.precision == "fp32"
    assert attn._path({"lse": None}, "test", ex)[1] == ("flash_3x" if ex.fp32_as_3xtf32 else "flash")


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,T,C,H", [(1, 256, 128, 2), (1, 1000, 64, 1), (1, 300, 256, 2), (2, 200, 384, 6),
                                     (4, 256, 384, 6)])
def test_3xtf32_error_within_twice_ffma(env, B, T, C, H, p):
    """On the same inputs, the 3xTF32 kernels' error against float64 is at most twice the FFMA
    kernels' (3xTF32 drops only a_lo*b_lo and the tf32 rounding of lo, about 2^-22 relative)."""
    errs = {}
    for path in ("flash", "flash_3x"):
        out = _run(env, B, T, C, H, "fused", p, path=path)
        errs[path] = {k: rel_err(a, b) for k, (a, b) in out.items()}
    print(f"\nB{B} T{T} C{C} H{H} p{p}: " + "; ".join(
        f"{k} ffma {errs['flash'][k]:.3g} 3xtf32 {errs['flash_3x'][k]:.3g}" for k in errs["flash"]))
    for k in ("y", "dqkv"):
        assert errs["flash_3x"][k] <= 2 * errs["flash"][k], (k, errs)


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,T,C,H", FUSED_SHAPES)
def test_fused_tf32(env, B, T, C, H, p):
    _check(_run(env, B, T, C, H, "fused", p, "tf32"), TF32_FWD, TF32_BWD)


@pytest.mark.parametrize("path", ["flash", "flash_3x"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_fused_equals_unfused(env, p, path):
    a = _run(env, 2, 77, 128, 2, "unfused", p)
    b = _run(env, 2, 77, 128, 2, "fused", p, path=path)
    assert rel_err(b["y"][0], a["y"][0]) < FP32_FWD
    assert rel_err(b["dqkv"][0], a["dqkv"][0]) < FP32_BWD


@pytest.mark.parametrize("path,C,H", [("flash", 128, 2), ("flash_3x", 128, 2), ("flash_3x", 64, 2),
                                      ("flash_3x", 256, 2), ("flash_tc", 128, 2)])
def test_fused_deterministic(env, path, C, H):
    """Two runs bitwise equal (head sizes 64, 32, 128 for 3xTF32)."""
    precision = "tf32" if path == "flash_tc" else "fp32"
    a = _run(env, 1, 200, C, H, "fused", 0.1, precision, path=path)
    b = _run(env, 1, 200, C, H, "fused", 0.1, precision, path=path)
    assert np.array_equal(a["y"][0], b["y"][0])
    assert np.array_equal(a["lse"][0], b["lse"][0])
    assert np.array_equal(a["dqkv"][0], b["dqkv"][0])


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,T,C,H", FUSED_SHAPES + [(2, 200, 384, 6)])
def test_dkv_wgmma_equals_mma_sync(env, B, T, C, H, p):
    """flash_bwd_dkv_wg (the dK / dV kernel on warpgroup MMA) and flash_bwd_dkv_tc on the same
    inputs, dqkv poisoned before each: dQ (the same kernel) equal bit for bit, dK / dV within TF32
    rounding of each other and of float64."""
    if not env.exec.wgmma:
        pytest.skip("warpgroup MMA needs an sm_90 device (and GPTCUDA_WGMMA not 0)")
    if C // H not in attn.FLASH_WG_HEAD_SIZES:
        pytest.skip(f"flash_bwd_dkv_wg takes head sizes {attn.FLASH_WG_HEAD_SIZES}")
    r = np.random.default_rng(11 + T + C)
    qkv_h = r.standard_normal((B, T, 3 * C)).astype(np.float32)
    dy_h = r.standard_normal((B, T, C)).astype(np.float32)
    saved = _setup(env, B, T, C, H, "fused", p, "tf32")
    qkv, dy, y = env.upload(qkv_h), env.upload(dy_h), env.empty((B, T, C))
    attn.attention_fwd(env, y, qkv, saved, H, p, SITE)
    outs = []
    for wg in (False, True):
        dqkv = env.empty((B, T, 3 * C))
        env.memset(dqkv, 0x7FC00000)
        attn._fused_bwd(env, dqkv, dy, qkv, y, saved["lse"], H, p, SITE, "flash_tc", wg)
        env.synchronize()
        outs.append(env.download(dqkv))
    tc, wg = outs
    assert np.array_equal(wg[..., :C], tc[..., :C])
    assert rel_err(wg[..., C:], tc[..., C:]) < 5e-4
    keep = _keep(env, B, H, T, p)
    _, probs_ref = ref.attention_forward(qkv_h, H, keep, p)
    want = ref.attention_backward(dy_h, qkv_h, probs_ref, H, keep, p)
    assert rel_err(wg[..., C:], want[..., C:]) < TF32_BWD


@pytest.mark.parametrize("hs", attn.FLASH_HEAD_SIZES)
def test_rowsum_do(rt, hs):
    """D [B, H, T] = rowsum over each head's columns of dy * y, for every head size the fp32 fused paths
    take, with a row count that leaves the last block part empty; D poisoned before. (The bf16 path's D,
    made by its dQ kernel: test_fused_bf16.)"""
    B, T, H = 3, 37, 5
    g = np.random.default_rng(hs)
    dy = g.standard_normal((B, T, H * hs)).astype(np.float32)
    y = g.standard_normal((B, T, H * hs)).astype(np.float32)
    D = rt.empty((B, H, T))
    rt.memset(D, 0x7FC00000)
    attn.rowsum_do(rt, D, rt.upload(dy), rt.upload(y), B, T, H, hs)
    want = (dy.astype(np.float64) * y).reshape(B, T, H, hs).sum(-1).transpose(0, 2, 1)
    assert rel_err(rt.download(D), want) < 1e-6


# ---- bf16: flash_bf16 (warpgroup MMA, TMA, a producer warpgroup), head sizes 64 and 128

def _run_bf16(rt, B, T, C, H, p, seed=0):
    return _run(rt, B, T, C, H, "fused", p, "bf16", seed, path="flash_bf16")


BF16_SHAPES = [
    (1, 256, 128, 2),    # hs 64: two query tiles
    (1, 1000, 64, 1),    # hs 64, long rows, a part tile at the end
    (2, 1100, 128, 2),   # hs 64 at T >= 1024: the long tiles (192 rows, pipelined), a third-full last tile
    (2, 200, 384, 6),    # hs 64, two sequences (the tensor maps' third dimension), six heads
    (3, 1024, 384, 6),   # hs 64: more blocks than SMs (144 of dK / dV), the long tiles
    (3, 5, 128, 2),      # tiny T: one part tile
    (2, 67, 256, 2),     # hs 128, a part tile
    (1, 384, 256, 2),    # hs 128
]


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,T,C,H", BF16_SHAPES)
def test_fused_bf16(env, B, T, C, H, p):
    out = _run_bf16(env, B, T, C, H, p)
    errs = {k: rel_err(a, b) for k, (a, b) in out.items()}
    for k, tol in (("y", BF16_FWD), ("dqkv", BF16_BWD), ("lse", BF16_LSE), ("D", 1e-5)):
        assert errs[k] < tol, f"{k}: rel_err {errs[k]:.3g} >= {tol:g} (all: {errs})"


@pytest.mark.parametrize("B,T,C,H,shift", [(1, 1025, 128, 2, 1), (3, 5, 128, 2, 3), (2, 67, 128, 2, 2),
                                           (1, 1031, 256, 2, 1)])
def test_fused_bf16_unaligned_lse(env, B, T, C, H, shift):
    """lse and D need not start on 16 bytes: a layer's slice of the [L, B, H, T] stack where B H T is not a
    multiple of 4, a head's at an odd T. dK/dV's copies of a tile's lse and D (the pipelined loop, head size
    64) start on the boundary before and skip to the tile's values (a box that starts elsewhere faults)."""
    out = _run(env, B, T, C, H, "fused", 0.0, "bf16", path="flash_bf16", shift=shift)
    errs = {k: rel_err(a, b) for k, (a, b) in out.items()}
    for k, tol in (("y", BF16_FWD), ("dqkv", BF16_BWD), ("lse", BF16_LSE), ("D", 1e-5)):
        assert errs[k] < tol, f"{k}: rel_err {errs[k]:.3g} >= {tol:g} (all: {errs})"


# other tiles of the plan at head size 64: pipelined or not, 3 and 4 consumer warpgroups (a block of 192
# rows leaves whole warpgroups past T on these shapes, which must compute nothing and still release the ring)
BF16_TILE_SETS = [
    {"fwd": (128, 128, 3), "dq": (128, 64, 3)},          # the forward and dQ pipelined over three stages
    {"fwd": (192, 128, 3), "dq": (192, 64, 3), "dkv": (192, 64, 3)},
    {"fwd": (128, 64, 2), "dq": (128, 64, 2), "dkv": (128, 64, 2)},   # a tile at a time
    {"fwd": (192, 64, 2), "dkv": (192, 64, 2)},
    {"fwd": (256, 64, 2)},
]


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,T,C,H", [(1, 1000, 64, 1), (2, 200, 384, 6), (3, 5, 128, 2)])
@pytest.mark.parametrize("tiles", BF16_TILE_SETS, ids=lambda t: "-".join(f"{k}{m}x{n}s{s}" for k, (m, n, s) in t.items()))
def test_fused_bf16_tiles(env, monkeypatch, tiles, B, T, C, H, p):
    for kind, t in tiles.items():
        monkeypatch.setitem(flash.FLASH_BF16_TILES, (kind, 64), t)
    out = _run_bf16(env, B, T, C, H, p)
    errs = {k: rel_err(a, b) for k, (a, b) in out.items()}
    for k, tol in (("y", BF16_FWD), ("dqkv", BF16_BWD), ("lse", BF16_LSE), ("D", 1e-5)):
        assert errs[k] < tol, f"{k}: rel_err {errs[k]:.3g} >= {tol:g} (all: {errs})"


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("B,T,C,H", [(2, 200, 384, 6), (2, 300, 384, 6), (1, 1000, 64, 1), (1, 1060, 128, 2)])
def test_fused_bf16_kernels_walk_items(env, monkeypatch, B, T, C, H, p):
    """The bf16 flash kernels' blocks walk several work items each where their loops are pipelined: as if the
    GPU had 5 SMs (dK/dV 24, 36, 8 and 18 items; at T 1060 the forward and dQ too, 12 items of 192 query
    rows), so that a block takes the resident buffers in turn and its ring counts on across items. The
    query tiles end at T rounded up to 64 rows: at T 300 (128-row tiles) and 1060 (192) the first starts
    64 rows before row 0 (a warpgroup with no rows), and at 1060 the last has 28 rows past T."""
    monkeypatch.setattr(attn, "sm_count", lambda rt: 5)
    out = _run_bf16(env, B, T, C, H, p)
    errs = {k: rel_err(a, b) for k, (a, b) in out.items()}
    for k, tol in (("y", BF16_FWD), ("dqkv", BF16_BWD), ("lse", BF16_LSE), ("D", 1e-5)):
        assert errs[k] < tol, f"{k}: rel_err {errs[k]:.3g} >= {tol:g} (all: {errs})"


def test_fused_bf16_deterministic(env):
    """The same bits twice, on a shape whose blocks outnumber the SMs."""
    a = _run_bf16(env, 3, 1024, 384, 6, 0.1)
    b = _run_bf16(env, 3, 1024, 384, 6, 0.1)
    for k in a:
        assert np.array_equal(a[k][0], b[k][0]), k
