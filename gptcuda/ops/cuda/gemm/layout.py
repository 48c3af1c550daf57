"""Which layouts the warpgroup-MMA families may run (`wgmma_layout`: the layout code, else False), on
which device (the runtime's execution plan, rt.exec) and with which planned scratch of a runtime
(WGMMA_WORKSPACES: where a plan's operand is re-laid out first, gemm/plan.py Plan.relaid)."""
from __future__ import annotations

from gptcuda.ops.cuda.gemm.families import PRODUCTS, layout_code
from gptcuda.runtime import RuntimeProtocol

WGMMA_WORKSPACES = ("gemm_bT", "gemm_aT")   # scratch only the wgmma kernels read


def wgmma_layout(mode, trans_a, trans_b, vec, K, batch=1):
    """The layout code (families.layout_code) of a product the warpgroup-MMA families may run in the
    execution plan's `wgmma_mode`, else False. 16-byte aligned operands only; "tf32": x @ W^T ("NT",
    batched too) and, one product with K % 4 == 0 (the re-laid operands' rows are tensor maps'
    16-byte strides), "NN" (wgmma after B^T), "TN" and "TT" (A [K, M] through registers: the
    register-A families); "3xtf32": the op interface's layouts (gemm.PRODUCTS), one product, K % 4 == 0
    (wgmma3_ra); None: none."""
    code = layout_code(trans_a, trans_b)
    if mode is None or not vec:
        return False
    if mode == "tf32" and code == "NT":
        return code
    if batch != 1 or K % 4 or (mode == "3xtf32" and (trans_a, trans_b) not in PRODUCTS):
        return False
    return code


def wgmma_ok(rt: RuntimeProtocol, trans_a, trans_b, vec, K=0, batch=1, ex=None):
    """`wgmma_layout` of this launch in the execution plan ex (default rt's: sm_90 and GPTCUDA_WGMMA
    != 0 run the kernels)."""
    return wgmma_layout((rt.exec if ex is None else ex).wgmma_mode, trans_a, trans_b, vec, K, batch)


def ws_capacity(rt: RuntimeProtocol, name="gemm_splitk"):
    """(view, floats) of a planned GEMM workspace: split-K partials or the wgmma kernels' scratch
    (WGMMA_WORKSPACES) ((None, 0) when the plan has none)."""
    try:
        ws = rt.workspace(name)
    except KeyError:
        return None, 0
    return ws, ws.numel


def rt_scratch(rt: RuntimeProtocol) -> dict:
    """{name: floats} of rt's planned WGMMA_WORKSPACES (0: none)."""
    return {name: ws_capacity(rt, name)[1] for name in WGMMA_WORKSPACES}


def device_workspaces(ws: dict, rt) -> dict:
    """`workspace(cfg)`'s entries that rt's device uses: without the wgmma kernels (not sm_90, or
    GPTCUDA_WGMMA=0) the re-laid operands' scratch would never be read."""
    if rt.exec.wgmma:
        return dict(ws)
    return {k: v for k, v in ws.items() if k not in WGMMA_WORKSPACES}
