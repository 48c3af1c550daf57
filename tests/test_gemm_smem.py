"""Every warpgroup-MMA tile fits in a block's shared memory: the launcher's dynamic bytes (the
family's smem(tile)) plus the kernel's static bytes (mbarriers, the epilogue's bias buffers, as
ptxas reports them) within the 227 KB a block may opt into on sm_90. A launch past it fails on the
GPU; this finds it without one (compiles only)."""
import re

import pytest

from gptcuda.ops.cuda.gemm import families
from gptcuda.runtime import compiler

pytest.importorskip("cuda.bindings.nvrtc")

OPTIN_MAX = 227 * 1024          # cudaDevAttrMaxSharedMemoryPerBlockOptin on the H100 / H200


def _cases():
    out = []
    for name in ("wgmma", "wgmma_ra_mn", "wgmma3_ra"):
        fam = families.FAMILIES[name]
        for tile in fam.tiles:
            # the bias epilogue: the largest static footprint (its bias buffers), GELU the widest
            kernels = [fam.kernel(tile, True, False, families.EPI_GELU, True, True)]
            if fam.colsum:                               # the variant that also sums A
                kernels.append(fam.kernel(tile, True, False, families.EPI_NONE, False, colsum=True))
            out += [pytest.param(name, tile, k, "f32", id=f"{name}:{k}") for k in kernels]
    fam = families.FAMILIES["bf16"]
    for tile in fam.tiles:       # a bf16 C adds its staging boxes; the TN product's column sums their buffers
        kernels = [(fam.kernel(tile, ta, tb, epi, hb, out=o, colsum=cs), o)
                   for ta, tb, epi, hb, o, cs in ((False, True, families.EPI_GELU, True, "bf16", False),
                                                  (False, True, families.EPI_RESID, True, "bf16", False),
                                                  (False, False, families.EPI_DGELU, False, "bf16", False),
                                                  (False, False, families.EPI_DGELU_GELU, False, "bf16", False),
                                                  (True, False, families.EPI_NONE, False, "f32", True))
                   if fam.serves(tile, epi, cs)]   # (the kernels a tile has)
        out += [pytest.param("bf16", tile, k, o, id=f"bf16:{k}") for k, o in kernels]
    return out


@pytest.mark.parametrize("fam,tile,kernel,out", _cases())
def test_static_and_dynamic_smem_fit(fam, tile, kernel, out):
    c = compiler.compile_kernel(families.FAMILIES[fam].file, [kernel], arch="sm_90", use_cache=True)
    lowered = c.lowered[kernel]
    report = re.search(rf"Function properties for {re.escape(lowered)}\n.*\n.*?(\d+) bytes smem", c.log)
    assert report, f"no ptxas report for {kernel}"
    static = int(report[1])
    dynamic = families.FAMILIES[fam].geometry(tile, out).smem
    assert static + dynamic <= OPTIN_MAX, f"{kernel}: {dynamic} dynamic + {static} static bytes > {OPTIN_MAX}"
