"""GEMM launchers: fp32 SIMT (kernels/gemm_simt.cu) and TF32 tensor cores (kernels/gemm_tf32.cu,
mma.sync; kernels/gemm_wgmma.cu, Hopper's warpgroup MMA, also fp32 as 3xTF32).

    matmul(rt, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None)
        out[M, N] = op(a) @ op(b) (+ bias) (+ epilogue); a is [M, K] or stored [K, M] (trans_a),
        b is [K, N] or stored [N, K] (trans_b). Leading dims of every view flatten into rows.
        "gelu": aux = pre-activation, out = gelu_tanh(aux); "residual": out = aux + ... (aux may be out);
        "dgelu": out = (op(a) @ op(b)) * gelu_tanh'(aux), aux = the saved pre-activation (read only,
        out must not alias it; no bias).
    matmul_batched(rt, out, a, b, trans_a=False, trans_b=False, alpha=1.0)
        out[..., M, N] = alpha * op(a[...]) @ op(b[...]); leading dims flatten into the batch.

The execution plan's precision picks the base family: "fp32" -> SIMT, "tf32" -> mma.sync. On sm_90
(GPTCUDA_WGMMA=0: not) warpgroup-MMA families compete for the layouts they run, with 16-byte aligned
operands (`wgmma_ok`): in TF32 "wgmma" for x @ W^T (K-major A and B; batched too) and, after B is
transposed into the workspace "gemm_bT", the backward's dX = dY @ W; for the weight gradients dW = dY^T
@ X (trans_a, K = tokens) the register-A families, which read dY [K, M] as stored through registers:
"wgmma_ra" with X^T transposed first into "gemm_aT" (or a B stored [N, K]), "wgmma_ra_mn" with X as
stored, turned K-major by its producers, "wgmma_ra_t" as (X^T dY)^T with dY^T first into "gemm_aT".
In fp32 (fp32_gemm 3xtf32) "wgmma3_ra" runs the op interface's products as three TF32 products of hi
and lo halves split in the kernel (A in the consumers' registers, B in shared memory by the producers).
Precision "bf16" (sm_90 only) has one family, "bf16": the TF32 persistent kernel with bf16 operands,
every layout read as stored (no re-layout, no scratch), C bf16 for x @ W^T and dY @ W and fp32 for the
weight gradients and for x @ W^T (a bf16 generation's fp32 outputs) (BF16_OUTS); a bf16 C is one product
(no split-K: its reduction writes fp32).
The block tile and the split-K factor of a shape come from the measured table of bench/tune.py when it
has an entry for (precision, transposes, epilogue, M, N, K, batch) on this GPU and these kernel sources
(`tuned_plan`; measured on a run's first use of a GPU: tune.py `autotune`), else from a cost model
(`plan`) fed with rt.info.sm_count. Split-K writes partials into the workspace "gemm_splitk" [splits, M,
N] and a fixed-order reduction applies the epilogue, so results are deterministic and do not depend on
timing at run time (which plan a shape gets is fixed once the table is written; GPTCUDA_GEMM_TUNE=0
ignores it).

The modules: families.py (the kernel families: files, tiles, layouts, kernel names and arguments,
rates; the compiled VARIANTS), layout.py (which layouts the warpgroup-MMA families may run on a
runtime, and its scratch), plan.py (the cost model and the planner), table.py (the measured table),
tune.py (measuring it; timer.py: timing candidates on the GPU), launch.py (the launchers).
"""
from __future__ import annotations

# what the backend, bench/ and tests use (each module's own names, private helpers included, from it)
from gptcuda.ops.cuda.gemm.families import (BF16_OUTS, BF16_TILES, EPI_BIAS, EPI_DGELU, EPI_GELU, EPI_NONE, EPI_RESID, FAMILIES, MAX_SPLITS,
                                            PRODUCTS, SIMT_FILE, SIMT_TILES, SPLIT_ALIGN, TF32_FALLBACK_TILES,
                                            TF32_FILE, TF32_TILES, VARIANTS, WGMMA3_RA_TILES, WGMMA_ARCHS, WGMMA_FILE,
                                            WGMMA_RA_MN_TILES, WGMMA_RA_T_TILES, WGMMA_RA_TILES, WGMMA_TILES, cdiv,
                                            layout_code, reduce_name, tf32_name, tf32_smem, transpose_name,
                                            wgmma_name)
from gptcuda.ops.cuda.gemm.layout import WGMMA_WORKSPACES, device_workspaces, wgmma_layout, wgmma_ok
# `plan` is the function from here on (it was the submodule's name until this import rebinds it)
from gptcuda.ops.cuda.gemm.plan import (b_reads, competing, estimate_s, kernel_label, make_plan, plan, plan_label,
                                        plan_unfit, prune_candidates, split_chunk, tune_candidates, workspace)
from gptcuda.ops.cuda.gemm.table import (forget_tables, load_table, plan_from_json, plan_to_json, save_table,
                                         source_hash, table_path, tune_key, tuned_plan)
from gptcuda.ops.cuda.gemm.launch import matmul, matmul_batched
from gptcuda.ops.cuda.gemm.tune import model_gemms

__all__ = ["matmul", "matmul_batched", "workspace", "device_workspaces", "VARIANTS"]     # the backend's
