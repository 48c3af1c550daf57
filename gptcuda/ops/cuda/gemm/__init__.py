"""GEMM launchers: fp32 SIMT (kernels/gemm_simt.cu) and TF32 tensor cores (kernels/gemm_tf32.cu,
mma.sync; kernels/gemm_wgmma.cu, Hopper's warpgroup MMA, also fp32 as 3xTF32 and BF16).

    matmul(rt, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None)
        out[M, N] = op(a) @ op(b) (+ bias) (+ epilogue); a is [M, K] or stored [K, M] (trans_a),
        b is [K, N] or stored [N, K] (trans_b). Leading dims of every view flatten into rows.
        "gelu": aux = pre-activation, out = gelu_tanh(aux); "residual": out = aux + ... (aux may be out);
        "dgelu": out = (op(a) @ op(b)) * gelu_tanh'(aux), aux = the saved pre-activation (read only,
        out must not alias it; no bias).
    matmul_batched(rt, out, a, b, trans_a=False, trans_b=False, alpha=1.0)
        out[..., M, N] = alpha * op(a[...]) @ op(b[...]); leading dims flatten into the batch.

The execution plan's precision picks the base family (fp32: SIMT, tf32: mma.sync, bf16: the bf16
warpgroup-MMA kernel); on sm_90 (GPTCUDA_WGMMA=0: not) warpgroup-MMA families compete with it for the
layouts they run (families.py). A product's block tile, split-K factor and operand re-layout come from
the measured table of its GPU and these kernel sources when it has the product (table.py; measured on
a run's first use of a GPU: tune.py `autotune`, timing with timer.py), else from the cost model
(plan.py) fed with rt.info.sm_count. Split-K writes partials into the workspace "gemm_splitk" [splits,
M, N] and a fixed-order reduction applies the epilogue, so results are deterministic and do not depend
on timing at run time (which plan a product gets is fixed once the table is written; GPTCUDA_GEMM_TUNE=0
ignores it).

The modules: families.py (the kernel families: files, tiles, layouts, launch geometry, kernel names,
rates; the compiled VARIANTS), plan.py (a product, the cost model and the planner, the workspaces),
table.py (the measured table), tune.py (measuring it; timer.py: timing candidates on the GPU),
launch.py (the launchers). What the backend uses is here; bench/ and the tests import each module's own.
"""
from __future__ import annotations

from gptcuda.ops.cuda.gemm.families import VARIANTS
from gptcuda.ops.cuda.gemm.launch import matmul, matmul_batched
from gptcuda.ops.cuda.gemm.plan import device_workspaces, workspace

__all__ = ["matmul", "matmul_batched", "workspace", "device_workspaces", "VARIANTS"]
