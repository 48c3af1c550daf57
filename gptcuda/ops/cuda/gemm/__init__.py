"""GEMM launchers: matmul (the op interface's, gptcuda/ops/backend.py), matmul_pair (its linear_bwd: a
layer's weight and input gradients, one launch of gemm_wgmma_dual where the plan allows) and matmul_batched
(the unfused attention's) on kernels/gemm_simt.cu (fp32 FMA), gemm_tf32.cu (TF32 mma.sync) and gemm_wgmma.cu (Hopper's
warpgroup MMA: TF32, fp32 as 3xTF32, BF16). The execution plan's precision picks the base family, which the
warpgroup-MMA families compete with on sm_90. A product's plan (family, tile, split-K, operand re-layout) is
the measured table's for its GPU and kernel sources where it has the product, else the cost model's; split-K
partials go to the workspace gemm_splitk and a fixed-order reduction, so results are deterministic.

    families.py   the kernel families: files, tiles, layouts, launch geometry, kernel names, rates; VARIANTS
    plan.py       the cost model and the planner of a product (model/products.py), the workspaces a config plans
    table.py      the measured table
    tune.py       measuring it: candidates, timing them on the GPU, autotune
    launch.py     the launchers
What the backend uses is here; bench/ and the tests import each module's own names.
"""
from __future__ import annotations

from gptcuda.ops.cuda.gemm.families import VARIANTS
from gptcuda.ops.cuda.gemm.launch import matmul, matmul_batched, matmul_pair
from gptcuda.ops.cuda.gemm.plan import device_workspaces, workspace

__all__ = ["matmul", "matmul_batched", "matmul_pair", "workspace", "device_workspaces", "VARIANTS"]
