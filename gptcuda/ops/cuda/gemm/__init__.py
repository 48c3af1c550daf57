"""GEMM launchers: matmul (the op interface's, gptcuda/ops/backend.py) and matmul_batched (the unfused
attention's) on the kernels of kernels/gemm_simt.cu (fp32 FMA), gemm_tf32.cu (TF32 mma.sync) and
gemm_wgmma.cu (Hopper's warpgroup MMA: TF32, fp32 as 3xTF32, BF16).

The execution plan's precision picks the base family; on sm_90 (GPTCUDA_WGMMA=0: not) warpgroup-MMA
families compete with it for the layouts they run. A product's block tile, split-K factor and operand
re-layout come from the measured table of its GPU and these kernel sources where it has the product
(measured on a run's first use of a GPU), else from the cost model. Split-K writes partials into the
workspace "gemm_splitk" and a fixed-order reduction applies the epilogue, so results are deterministic
and do not depend on timing at run time (which plan a product gets is fixed once the table is written;
GPTCUDA_GEMM_TUNE=0 ignores it).

    families.py   the kernel families: files, tiles, layouts, launch geometry, kernel names, rates; VARIANTS
    plan.py       the cost model and the planner of a product (model/products.py), the workspaces a config plans
    table.py      the measured table
    tune.py       measuring it: candidates, timing them on the GPU, autotune
    launch.py     the launchers
What the backend uses is here; bench/ and the tests import each module's own names.
"""
from __future__ import annotations

from gptcuda.ops.cuda.gemm.families import VARIANTS
from gptcuda.ops.cuda.gemm.launch import matmul, matmul_batched
from gptcuda.ops.cuda.gemm.plan import device_workspaces, workspace

__all__ = ["matmul", "matmul_batched", "workspace", "device_workspaces", "VARIANTS"]
