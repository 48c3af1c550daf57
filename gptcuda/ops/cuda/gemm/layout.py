"""Which operand layouts the warpgroup-MMA families (K-major A and B only) can run, and with which
re-layout: B transposed first ("transpose"), A (and B) transposed first in k slabs
("transpose_a" / "transpose_ab"); for 3xTF32 (wgmma3_ra) the op interface's layouts as stored; on
which device (`wgmma_device`: the runtime's execution plan, rt.exec) and with which planned scratch
(WGMMA_WORKSPACES) of a runtime."""
from __future__ import annotations

from gptcuda.ops.cuda.gemm.families import FAMILIES, PRODUCTS, SPLIT_ALIGN
from gptcuda.runtime import RuntimeProtocol

WGMMA_WORKSPACES = ("gemm_bT", "gemm_aT")   # scratch only the wgmma kernels read


def transpose_a_slab(M, N, K, trans_b, floats) -> int:
    """k rows per slab of a transpose_a plan whose scratch "gemm_aT" holds `floats`: K when A^T
    [M, K] (and B^T [N, K] after it, unless trans_b) fit, else the most whole 32-wide k tiles
    that do (0: not even one)."""
    per_k = M + (0 if trans_b else N)
    if per_k <= 0 or K <= 0:
        return 0
    if per_k * K <= floats:
        return K
    return min(K, floats // per_k // SPLIT_ALIGN * SPLIT_ALIGN)


def wgmma_mode(trans_a, trans_b, vec, K, N, batch, bt_floats, M=0, at_floats=0):
    """How the warpgroup-MMA kernel can run a product of this layout: "direct" (A and B K-major:
    trans_a = False, trans_b = True, 16-byte aligned operands), "transpose" (trans_b = False, one
    product, K % 4 == 0 and a B^T scratch of bt_floats holds [N, K]); trans_a (A stored [K, M]):
    one product, K % 4 == 0 (the slabs' rows are the tensor maps' 16-byte strides) and at least one
    32-wide k slab of A^T [M, k] (+ B^T [N, k]) fits the scratch "gemm_aT" of at_floats
    (`transpose_a_slab`): "transpose_ab" (trans_b = False: both operands transposed, at any
    alignment) or "transpose_a" (trans_b = True: B read in place, 16-byte aligned); else False."""
    if trans_a:
        if batch != 1 or K % 4 or (trans_b and not vec) or not transpose_a_slab(M, N, K, trans_b, at_floats):
            return False
        return "transpose_a" if trans_b else "transpose_ab"
    if not vec:
        return False
    if trans_b:
        return "direct"
    return "transpose" if batch == 1 and K % 4 == 0 and 0 < K * N <= bt_floats else False


def wgmma3_mode(trans_a, trans_b, vec, K, batch):
    """`wgmma_mode` for the 3xTF32 kernel, which reads the op interface's layouts (gemm.PRODUCTS) as
    stored: 16-byte aligned operands, one product, K % 4 == 0; "direct" (trans_b) or "transpose"."""
    if not vec or batch != 1 or K % 4 or (trans_a, trans_b) not in PRODUCTS:
        return False
    return "direct" if trans_b else "transpose"


def wgmma_layout_mode(mode, trans_a, trans_b, vec, M, N, K, batch, scratch: dict):
    """How the warpgroup-MMA kernels can run this product in the execution plan's `wgmma_mode`:
    "tf32": `wgmma_mode` with "gemm_bT" as the B^T scratch and "gemm_aT" as the A^T (+ B^T) slabs of
    trans_a products (the slab size: `transpose_a_slab`); "3xtf32": `wgmma3_mode`; scratch: {name:
    floats} of the planned WGMMA_WORKSPACES (a missing one: none). False: not at all (mode None: the
    kernels do not run)."""
    if mode == "tf32":
        return wgmma_mode(trans_a, trans_b, vec, K, N, batch, scratch.get("gemm_bT", 0), M,
                          scratch.get("gemm_aT", 0))
    if mode == "3xtf32":
        return wgmma3_mode(trans_a, trans_b, vec, K, batch)
    return False


# wgmma modes (`wgmma_mode`) -> (transpose_b, transpose_a) of the family's plans
_MODE_FLAGS = {"direct": (False, False), "transpose": (True, False), "transpose_ab": (True, True),
               "transpose_a": (False, True)}


def mode_flags(family, wgmma):
    """(transpose_b, transpose_a) of a `family` plan for a launch whose `wgmma_ok` answer is wgmma."""
    fam = FAMILIES.get(family)
    if fam is not None and fam.b_first:              # TF32 register A: B^T first
        return wgmma == "transpose_ab", False
    if fam is None or not fam.k_major or not wgmma:
        return False, False
    tb, ta = _MODE_FLAGS.get(wgmma, (False, False))
    return (tb, ta) if fam.transposes_a else (wgmma == "transpose", False)


# ---- a runtime's device and planned workspaces ----------------------------------------------------
def ws_capacity(rt: RuntimeProtocol, name="gemm_splitk"):
    """(view, floats) of a planned GEMM workspace: split-K partials or the wgmma kernels' scratch
    (WGMMA_WORKSPACES) ((None, 0) when the plan has none)."""
    try:
        ws = rt.workspace(name)
    except KeyError:
        return None, 0
    return ws, ws.numel


def wgmma_device(rt: RuntimeProtocol) -> bool:
    """Whether the warpgroup-MMA kernels run (the execution plan's `wgmma`: sm_90, GPTCUDA_WGMMA != 0)."""
    return rt.exec.wgmma


def device_workspaces(ws: dict, rt) -> dict:
    """`workspace(cfg)`'s entries that rt's device uses: without the wgmma kernels (not sm_90, or
    GPTCUDA_WGMMA=0) the transposed-B / -A scratch would never be read."""
    if wgmma_device(rt):
        return dict(ws)
    return {k: v for k, v in ws.items() if k not in WGMMA_WORKSPACES}


def wgmma_ok(rt: RuntimeProtocol, trans_a, trans_b, vec, K=0, N=0, batch=1, M=0, ex=None):
    """`wgmma_layout_mode` of this launch with rt's planned workspaces where the kernels exist (the
    execution plan ex, default rt's: an sm_90 device; GPTCUDA_WGMMA=0: never), else False."""
    mode = (rt.exec if ex is None else ex).wgmma_mode
    if mode is None:
        return False
    return wgmma_layout_mode(mode, trans_a, trans_b, vec, M, N, K, batch,
                             {name: ws_capacity(rt, name)[1] for name in WGMMA_WORKSPACES})


def ra_scratch(M, N, K, at_floats) -> dict:
    """`competing`'s ra_bt / ra_at for a product of this shape: whether "gemm_aT" of at_floats holds a
    register-A plan's re-laid operand, B^T [N, K] (wgmma_ra) / A^T [M, K] (wgmma_ra_t)."""
    return {"ra_bt": 0 < N * K <= at_floats, "ra_at": 0 < M * K <= at_floats}


def rt_transpose_a_slab(rt: RuntimeProtocol, M, N, K, trans_b) -> int:
    """k rows per slab of a transpose_a plan in rt's "gemm_aT" (`transpose_a_slab`), 0 when all of
    K fits at once (or not even one slab: then `wgmma_ok` answers False)."""
    slab = transpose_a_slab(M, N, K, trans_b, ws_capacity(rt, "gemm_aT")[1])
    return 0 if slab >= K else slab
