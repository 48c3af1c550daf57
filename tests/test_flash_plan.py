"""Which fused-attention kernels the launchers pick, and their tile plans (no GPU: a recording
stand-in runtime)."""
import pytest

from gptcuda.ops.cuda import attention as attn, flash
from gptcuda.runtime import DeviceView, execution
from tests.conftest import FakeGemmRT, fake_view


class _AttnRT(FakeGemmRT):
    def __init__(self, B, H, T, precision="tf32"):
        super().__init__(precision=precision)
        self.state, self.seed = fake_view((16,)), 1234
        self._ws["attention_d"] = DeviceView(1 << 43, (B * H * T,), "f32", "attention_d")


def _bwd_launches(hs, wgmma_env, p=0.1, B=2, H=3, T=300):
    C = H * hs
    rt = _AttnRT(B, H, T)
    ex = execution.resolve(arch="sm_90", precision="tf32", attention="fused", env={"GPTCUDA_WGMMA": wgmma_env})
    qkv, y, dy, dqkv = fake_view((B, T, 3 * C)), fake_view((B, T, C)), fake_view((B, T, C)), fake_view((B, T, 3 * C))
    attn.attention_bwd(rt, dqkv, dy, qkv, y, {"lse": fake_view((B, H, T))}, H, p, 7, ex)
    return {name.split("<")[0]: (name, grid, block, smem) for name, grid, block, smem in rt.launches}


@pytest.mark.parametrize("hs", attn.FLASH_HEAD_SIZES)
def test_dkv_on_wgmma_where_the_plan_has_it(hs):
    """flash_bwd_dkv_wg where the plan has warpgroup MMA and the head size is one it takes; the
    mma.sync kernel otherwise (head size 128, GPTCUDA_WGMMA=0)."""
    wg = _bwd_launches(hs, "1")
    assert "flash_bwd_dq_tc" in wg
    if hs in attn.FLASH_WG_HEAD_SIZES:
        name, grid, block, smem = wg["flash_bwd_dkv_wg"]
        plan = flash.flash_dkv_wg_plan(hs)
        assert name == f"flash_bwd_dkv_wg<{hs},true,128,64,32,2,{plan['smem']}>" and grid == (6, 5) and block == (128,)
        assert smem == plan["smem"] and "flash_bwd_dkv_tc" not in wg
    else:
        assert wg["flash_bwd_dkv_tc"][0].startswith(f"flash_bwd_dkv_tc<{hs},true,") and "flash_bwd_dkv_wg" not in wg
    tc = _bwd_launches(hs, "0", p=0.0)       # GPTCUDA_WGMMA=0: the mma.sync kernel
    assert tc["flash_bwd_dkv_tc"][0].startswith(f"flash_bwd_dkv_tc<{hs},false,") and "flash_bwd_dkv_wg" not in tc


@pytest.mark.parametrize("hs", attn.FLASH_WG_HEAD_SIZES)
def test_dkv_wg_plan_fits(hs):
    """FaDkvWg's shared memory: K, V (64 x hs), 2 ring stages of Q, dO (32 x hs) and 1 KB of lse / D,
    1 KB to align the base: three blocks an SM (each also reserves 1 KB of the SM's 228 KB)."""
    smem = flash.flash_dkv_wg_plan(hs)["smem"]
    assert smem == 2 * 64 * hs * 4 + 2 * (2 * 32 * hs * 4 + 1024) + 1024
    assert 3 * (smem + 1024) <= 228 * 1024
    with pytest.raises(ValueError, match="head sizes"):
        flash.flash_dkv_wg_plan(128)


def test_dkv_wg_variants_listed():
    names = {n.split(",")[0] for f, n, d in attn.VARIANTS if f == flash.FLASH_WG_FILE}
    assert names == {f"flash_bwd_dkv_wg<{hs}" for hs in attn.FLASH_WG_HEAD_SIZES}
    for hs in attn.FLASH_WG_HEAD_SIZES:
        for drop in (False, True):
            k = flash.flash_kernel("dkv", "flash_tc", hs, drop, wg=True)
            assert (k.file, k.name, {}) in attn.VARIANTS


# ---- fp32: 3xTF32 on the tensor cores (flash_3x) where fp32 GEMMs run as 3xTF32, else FFMA (flash)

@pytest.mark.parametrize("precision,fp32_gemm,arch,env,path", [
    ("fp32", "3xtf32", "sm_90", {}, "flash_3x"),
    ("fp32", "ffma", "sm_90", {}, "flash"),
    ("fp32", "3xtf32", "sm_80", {}, "flash"),                        # no wgmma: no 3xTF32 GEMMs either
    ("fp32", "3xtf32", "sm_90", {"GPTCUDA_WGMMA": "0"}, "flash"),
    ("tf32", "3xtf32", "sm_90", {}, "flash_tc"),
    ("tf32", "ffma", "sm_90", {}, "flash_tc"),
    ("tf32", "3xtf32", "sm_80", {}, "flash_tc"),
])
def test_plan_picks_the_fused_path(precision, fp32_gemm, arch, env, path):
    ex = execution.resolve(arch=arch, precision=precision, fp32_gemm=fp32_gemm, attention="fused", env=env)
    assert ex.attention == path and path in execution.ATTENTION_PATHS
    assert (path == "flash_3x") == ex.fp32_as_3xtf32
    assert execution.resolve(arch=arch, precision=precision, fp32_gemm=fp32_gemm, attention="unfused",
                             env=env).attention == "unfused"
    other = "tf32" if precision == "fp32" else "fp32"
    assert ex.with_precision(other).with_precision(precision) == ex
    assert {"flash_3x": "3xTF32", "flash": "FFMA", "flash_tc": "flash on tensor cores ("}[path] in ex.format()


def test_precision_switch_moves_the_fused_path():
    ex = execution.resolve(arch="sm_90", precision="tf32", attention="fused")
    assert ex.with_precision("fp32").attention == "flash_3x"
    ex = execution.resolve(arch="sm_90", precision="tf32", fp32_gemm="ffma", attention="fused")
    assert ex.with_precision("fp32").attention == "flash"
    # a runtime's plan without a config's attention: the fused kernels by the same rule
    assert execution.fused_path("fp32", True) == "flash_3x" and execution.fused_path("fp32", False) == "flash"
    assert execution.fused_path("tf32", True) == execution.fused_path("tf32", False) == "flash_tc"
    for precision, fp32_gemm, arch, path in (("fp32", "3xtf32", "sm_90", "flash_3x"), ("fp32", "ffma", "sm_90", "flash"),
                                             ("fp32", "3xtf32", "sm_80", "flash"), ("tf32", "3xtf32", "sm_90", "flash_tc")):
        ex = execution.resolve(arch=arch, precision=precision, fp32_gemm=fp32_gemm, env={})
        assert ex.attention is None and attn._path({"lse": None}, "test", ex) == ("lse", path)


def _launches(ex, hs, p, B=2, H=3, T=300):
    C = H * hs
    rt = _AttnRT(B, H, T, ex.precision)
    qkv, y, dy, dqkv = fake_view((B, T, 3 * C)), fake_view((B, T, C)), fake_view((B, T, C)), fake_view((B, T, 3 * C))
    saved = {"lse": fake_view((B, H, T))}
    attn.attention_fwd(rt, y, qkv, saved, H, p, 7, ex)
    attn.attention_bwd(rt, dqkv, dy, qkv, y, saved, H, p, 7, ex)
    return {name.split("<")[0]: (name, grid, block, smem) for name, grid, block, smem in rt.launches}


@pytest.mark.parametrize("hs", attn.FLASH_HEAD_SIZES)
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_fp32_launches_the_x3_kernels(hs, p):
    """fp32 with fp32_gemm 3xtf32 on sm_90: flash_fwd_x3, flash_bwd_dq_x3, flash_bwd_dkv_x3 (never the
    warpgroup dK/dV kernel), grids of the 3xTF32 tile plans; fp32_gemm ffma: the FFMA kernels."""
    B, H, T = 2, 3, 300
    drop = "true" if p > 0 else "false"
    ex = execution.resolve(arch="sm_90", precision="fp32", fp32_gemm="3xtf32", attention="fused", env={})
    got = _launches(ex, hs, p, B, H, T)
    assert set(got) == {"flash_fwd_x3", "flash_rowsum_do", "flash_bwd_dq_x3", "flash_bwd_dkv_x3"}
    for kind, kernel in (("fwd", "flash_fwd_x3"), ("dq", "flash_bwd_dq_x3"), ("dkv", "flash_bwd_dkv_x3")):
        plan = flash.flash_tc_plan(kind, hs, x3=True)
        name, grid, block, smem = got[kernel]
        assert name == flash.expression(kernel, hs, p > 0, *plan["args"]) and name.startswith(f"{kernel}<{hs},{drop},")
        assert grid == (B * H, -(-T // plan["rows"])) and smem == plan["smem"] == plan["args"][-1] and block == (128,)
        assert smem == flash.flash_plan(kind, hs, "flash_3x")["smem"]
    ffma = _launches(execution.resolve(arch="sm_90", precision="fp32", fp32_gemm="ffma", attention="fused", env={}),
                     hs, p, B, H, T)
    assert set(ffma) == {"flash_fwd", "flash_rowsum_do", "flash_bwd_dq", "flash_bwd_dkv"}
    assert ffma["flash_fwd"][1] == (B * H, -(-T // flash.FLASH_BQ))


# the 3xTF32 tile plans (the _x3 kernels' FaFwdTc / FaDqTc / FaDkvTc in flash_tc.cuh): rows a block, ring
# stages, and whether the resident operands sit in registers (fwd: Q's hi and lo fragments)
X3_PLANS = {   # (kind, hs): (rows, smem floats)
    ("fwd", 32): (128, 3 * 2 * 32 * 36), ("fwd", 64): (64, 3 * 2 * 32 * 68),
    ("fwd", 128): (64, 3 * 2 * 16 * 132 + 64 * 132),                           # Q resident
    ("dq", 32): (128, 3 * 2 * 32 * 36 + 2 * 128 * 36), ("dq", 64): (64, 3 * 2 * 32 * 68 + 2 * 64 * 68),
    ("dq", 128): (64, 2 * 2 * 16 * 132 + 2 * 64 * 132),
    ("dkv", 32): (128, 3 * (2 * 16 * 36 + 32) + 2 * 128 * 36), ("dkv", 64): (64, 3 * (2 * 16 * 68 + 32) + 2 * 64 * 68),
    ("dkv", 128): (64, 2 * (2 * 16 * 132 + 32) + 2 * 64 * 132),
}


@pytest.mark.parametrize("kind,hs", sorted(X3_PLANS))
def test_x3_plans(kind, hs):
    """The 3xTF32 plans as the kernels define them, two blocks an SM (each reserves 1 KB of 228 KB)
    like the tf32 ones; the tf32 plans stay as they were."""
    rows, floats = X3_PLANS[kind, hs]
    plan = flash.flash_tc_plan(kind, hs, x3=True)
    assert (plan["rows"], plan["smem"]) == (rows, 4 * floats)
    assert flash.flash_plan(kind, hs, "flash_3x") == plan
    assert 2 * (plan["smem"] + 1024) <= 228 * 1024
    tc = flash.flash_tc_plan(kind, hs)
    assert tc == flash.flash_tc_plan(kind, hs, x3=False) and tc["rows"] == (128 if hs <= 64 else 64)
    assert 2 * (tc["smem"] + 1024) <= 228 * 1024


def test_x3_variants_listed_and_paths_checked():
    names = {n for f, n, d in attn.VARIANTS if f == flash.FLASH_FILES["flash_3x"]}
    assert names == {flash.flash_kernel(kind, "flash_3x", hs, drop).name for kind in ("fwd", "dq", "dkv")
                     for hs in attn.FLASH_HEAD_SIZES for drop in (False, True)}
    assert len({n.split(",")[0] + n.split(",")[1] for n in names}) == len(names)     # one plan a (kernel, hs, drop)
    with pytest.raises(ValueError, match="path"):
        flash.flash_plan("fwd", 64, "flash_x3")
    with pytest.raises(ValueError, match="flash_tc kernel"):
        attn._fused_bwd(_AttnRT(1, 1, 8, "fp32"), fake_view((1, 8, 192)), fake_view((1, 8, 64)),
                        fake_view((1, 8, 192)), fake_view((1, 8, 64)), fake_view((1, 1, 8)), 1, 0.0, 7,
                        "flash_3x", True)


@pytest.mark.parametrize("kind,path,wg", [("fwd", "flash_tc", False), ("dkv", "flash_3x", False),
                                          ("dq", "flash", False), ("dkv", "flash_tc", True)])
def test_kernels_refuse_a_plan_they_cannot_run(kind, path, wg):
    """The geometry is the launcher's: a kernel compiles with its plan's template arguments and
    static_asserts the rest, so shared memory that is not its layout's, or another block size, fails
    to compile (NVRTC's fast level)."""
    from gptcuda.runtime import compiler
    k = flash.flash_kernel(kind, path, 64, False, wg)
    compiler.check_compile(k.file, [k.name])
    base, args = k.name[:-1].split("<")
    args = args.split(",")
    for bad in (args[:-1] + [str(k.smem + 16)], args[:2] + ["256"] + args[3:]):
        name = f"{base}<{','.join(bad)}>"
        with pytest.raises(compiler.CompileError, match="the launcher's plan"):
            compiler.check_compile(k.file, [name])


def test_bf16_tiles_by_sequence_length():
    """The bf16 kernels take FLASH_BF16_TILES_LONG's tile where T reaches FLASH_BF16_LONG_T (192 rows,
    three consumer warpgroups, pipelined) and FLASH_BF16_TILES' below it; every tile a launch can name is
    in the variants CI compiles, once."""
    T = flash.FLASH_BF16_LONG_T
    names = [n for f, n, _ in flash.variants() if f == "flash_bf16.cu"]
    assert len(names) == len(set(names))
    for (kind, hs), (bm, bn, ns) in flash.FLASH_BF16_TILES_LONG.items():
        short = flash.flash_bf16_tile(kind, hs, T - 1)
        assert short == flash.FLASH_BF16_TILES[(kind, hs)] != (bm, bn, ns)
        assert flash.flash_bf16_tile(kind, hs, T) == flash.flash_bf16_tile(kind, hs, 4 * T) == (bm, bn, ns)
        for t in (T - 1, T):
            for drop in (False, True):
                k = flash.flash_kernel(kind, "flash_bf16", hs, drop, T=t)
                assert k.name in names
                assert (k.rows, k.stream_rows, k.threads) == ((bm, bn, 128 * (bm // 64 + 1)) if t == T
                                                              else (short[0], short[1], 128 * (short[0] // 64 + 1)))


def test_bf16_kernels_walk_work_items_where_pipelined():
    """A bf16 flash kernel's plan walks work items (a grid of at most one block an SM, the resident tiles in
    two buffers) where its loop is pipelined (ns 3: dK/dV at head size 64, the forward and dQ at head size
    64 and T >= 1024) and takes one item a block otherwise (the a-tile-at-a-time loop has no registers for
    the walk); pipelined dK/dV's stages also hold their queries' lse and D."""
    resident = {"fwd": 1, "dq": 2, "dkv": 2}
    for hs in flash.FLASH_BF16_HEAD_SIZES:
        for T in (0, flash.FLASH_BF16_LONG_T):
            for kind in ("fwd", "dq", "dkv"):
                bm, bn, ns = flash.flash_bf16_tile(kind, hs, T)
                plan = flash.flash_bf16_plan(kind, hs, T)
                assert plan["walk"] == (ns >= 3) == flash.flash_kernel(kind, "flash_bf16", hs, True, T=T).walk
                # pipelined dK/dV's stages: lse and D, bn + 4 values each in 128-byte slots
                extra = 2 * (-(-(bn + 4) * 4 // 128) * 128) if kind == "dkv" and ns >= 3 else 0
                assert plan["smem"] == (resident[kind] * (2 if ns >= 3 else 1) * bm * hs * 2
                                        + ns * (2 * bn * hs * 2 + extra) + 1024)
    assert flash.flash_bf16_plan("dkv", 64)["walk"] and not flash.flash_bf16_plan("dkv", 128)["walk"]
    assert not flash.flash_bf16_plan("fwd", 64, 256)["walk"] and flash.flash_bf16_plan("fwd", 64, 1024)["walk"]
    assert flash.flash_bf16_plan("dq", 64, 1024)["walk"] and not flash.flash_bf16_plan("dq", 128, 1024)["walk"]


def test_bf16_plans_fit_shared_memory(monkeypatch):
    """Every bf16 flash kernel a launch can name fits the shared memory a block may have (the launch's
    cuFuncSetAttribute refuses more), and the plan refuses tiles that would not."""
    for hs in flash.FLASH_BF16_HEAD_SIZES:
        for T in (0, flash.FLASH_BF16_LONG_T):
            for kind in ("fwd", "dq", "dkv"):
                assert flash.flash_bf16_plan(kind, hs, T)["smem"] <= flash.FLASH_BF16_SMEM_MAX
    monkeypatch.setitem(flash.FLASH_BF16_TILES, ("dkv", 128), (256, 128, 3))
    with pytest.raises(ValueError, match="shared memory"):
        flash.flash_bf16_plan("dkv", 128)
