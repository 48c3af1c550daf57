"""Which fused-attention kernels the launchers pick, and their tile plans (no GPU: a recording
stand-in runtime)."""
import pytest

from gptcuda.ops.cuda import attention as attn
from gptcuda.runtime import DeviceView, execution
from tests.conftest import FakeGemmRT, fake_view


class _AttnRT(FakeGemmRT):
    def __init__(self, B, H, T):
        super().__init__(precision="tf32")
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
        assert name == f"flash_bwd_dkv_wg<{hs},true>" and grid == (6, 5) and block == (128,)
        assert smem == attn.flash_dkv_wg_plan(hs)["smem"] and "flash_bwd_dkv_tc" not in wg
    else:
        assert wg["flash_bwd_dkv_tc"][0] == f"flash_bwd_dkv_tc<{hs},true>" and "flash_bwd_dkv_wg" not in wg
    tc = _bwd_launches(hs, "0", p=0.0)       # GPTCUDA_WGMMA=0: the mma.sync kernel
    assert tc["flash_bwd_dkv_tc"][0] == f"flash_bwd_dkv_tc<{hs},false>" and "flash_bwd_dkv_wg" not in tc


@pytest.mark.parametrize("hs", attn.FLASH_WG_HEAD_SIZES)
def test_dkv_wg_plan_fits(hs):
    """FaDkvWg's shared memory: K, V (64 x hs), 2 ring stages of Q, dO (32 x hs) and 1 KB of lse / D,
    1 KB to align the base: three blocks an SM (each also reserves 1 KB of the SM's 228 KB)."""
    smem = attn.flash_dkv_wg_plan(hs)["smem"]
    assert smem == 2 * 64 * hs * 4 + 2 * (2 * 32 * hs * 4 + 1024) + 1024
    assert 3 * (smem + 1024) <= 228 * 1024
    with pytest.raises(ValueError, match="head sizes"):
        attn.flash_dkv_wg_plan(128)


def test_dkv_wg_variants_listed():
    names = {n for f, n, d in attn.VARIANTS if f == attn.FLASH_FILE}
    for hs in attn.FLASH_HEAD_SIZES:
        want = {f"flash_bwd_dkv_wg<{hs},true>", f"flash_bwd_dkv_wg<{hs},false>"}
        assert want <= names if hs in attn.FLASH_WG_HEAD_SIZES else not want & names
