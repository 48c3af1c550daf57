"""Launchers of kernels/loss.cu: fused softmax cross-entropy and the mean loss.

    crossentropy(rt, losses[N], dlogits[N,V]|None, logits[N,V], targets[N] i32, grad_scale, n_vocab=None)
        over the first n_vocab columns (None: all V; fewer: a padded vocabulary, columns n_vocab.. masked):
        losses = logsumexp(logits[:, :n_vocab]) - logits[target]
        grad_scale != 0: dlogits = (softmax(logits[:, :n_vocab]) - onehot(target)) * grad_scale, 0 in the
        padded columns (dlogits may be logits)
        grad_scale == 0: no gradient is written (dlogits may be None)
        kernel (V the row length): V <= WARP_MAX_V: crossentropy_warp (one warp per row); else bf16
        logits with V % 8 == 0, 2 V <= SMEM_ROW_MAX bytes and views 16-byte aligned: crossentropy_smem (the
        row in shared memory, two rows an SM); else V % 4 == 0, V <= max(ROWS_NV4) * 2048 and logits / dlogits aligned to 4 elements (16 bytes of
        fp32, 8 of bf16): crossentropy_rows<NV4> (one 512-thread block per row held in registers, NV4 the
        smallest of ROWS_NV4 with NV4 * 2048 >= V: one DRAM read of the row); else crossentropy_block
        (one 256-thread block per row)
        logits and dlogits: fp32, or bf16 (a bf16 model's head output; its gradient rounded once, the
        rest computed in fp32), of one type (TYPES); losses fp32
    loss_reduce(rt, losses[N], history[max_steps]|None)
        state.loss = mean(losses) (deterministic, one block); history[state.step] = the same value
        when state.step < len(history)
"""
from __future__ import annotations

from gptcuda.ops.backend import rows
from gptcuda.runtime import RuntimeProtocol, f32, i32
from gptcuda.ops.cuda import DTYPE_CODES, aligned4, cdiv, element_types, expression

FILE = "loss.cu"
WARPS = 8                   # crossentropy_warp's rows a block, crossentropy_block's warps (their WARPS)
THREADS = WARPS * 32
WARP_MAX_V = 1024           # one warp per row up to this vocabulary size, then one block per row
REDUCE_THREADS = 1024       # loss_reduce's block (a power of two: its tree)
ROWS_WARPS = 16             # crossentropy_rows' WARPS: thread t holds float4 vectors j * 512 + t, j < NV4
ROWS_THREADS = ROWS_WARPS * 32
ROWS_NV4 = (8, 16, 25, 28)  # 28: the most without spills at 128 registers (ptxas, sm_90); 25: V = 50304
TYPES = ("f32", "bf16")     # the element types of logits (and dlogits) there are kernels for
SMEM_ROW_MAX = 112 * 1024   # crossentropy_smem's bf16 row: two blocks within an SM's 228 KB (1 KB reserved each)


def ce_name(kind: str, grad: bool, nv4: int = 0, dtype: str = "f32") -> str:
    """crossentropy_warp / crossentropy_block <GRAD, WARPS, TL>, crossentropy_rows <GRAD, NV4, ROWS_WARPS, TL>,
    crossentropy_smem <GRAD, ROWS_WARPS, TL> (TL: the logits' element type's code)."""
    if kind == "rows":
        return expression("crossentropy_rows", grad, nv4, ROWS_WARPS, DTYPE_CODES[dtype], sep=", ")
    if kind == "smem":
        return expression("crossentropy_smem", grad, ROWS_WARPS, DTYPE_CODES[dtype], sep=", ")
    return expression(f"crossentropy_{kind}", grad, WARPS, DTYPE_CODES[dtype], sep=", ")


REDUCE_NAME = expression("loss_reduce", REDUCE_THREADS)
VARIANTS = (
    [(FILE, ce_name(k, g, dtype=t), {}) for t in TYPES for k in ("warp", "block") for g in (True, False)]
    + [(FILE, ce_name("rows", g, n, t), {}) for t in TYPES for n in ROWS_NV4 for g in (True, False)]
    + [(FILE, ce_name("smem", g, dtype="bf16"), {}) for g in (True, False)]
    + [(FILE, REDUCE_NAME, {})]
)


def workspace(cfg, ex=None) -> dict:
    return {}


def rows_nv4(V: int, *views) -> int | None:
    """NV4 of the crossentropy_rows variant for rows of length V over these views (None where the
    row does not fit any, V % 4 != 0, or a view does not start on 4 of its elements)."""
    if V % 4 or not aligned4(*views):
        return None
    return next((n for n in ROWS_NV4 if n * ROWS_THREADS * 4 >= V), None)


def crossentropy(rt: RuntimeProtocol, losses, dlogits, logits, targets, grad_scale, n_vocab=None):
    V = int(logits.shape[-1])
    N = rows(logits.shape)
    Vr = V if n_vocab is None else int(n_vocab)
    if not 0 < Vr <= V:
        raise ValueError(f"crossentropy: n_vocab {Vr} outside 1..{V} (the logits' row length)")
    if targets.dtype != "i32":
        raise TypeError(f"crossentropy: targets must be i32, got {targets.dtype}")
    if targets.numel != N or losses.numel != N:
        raise ValueError(f"crossentropy: logits {logits.shape}, targets {targets.shape}, losses {losses.shape}")
    grad_scale = float(grad_scale)
    grad = grad_scale != 0.0
    if grad and (dlogits is None or dlogits.numel != N * V):
        raise ValueError(f"crossentropy: a gradient needs dlogits of {N}x{V} elements")
    if losses.dtype != "f32":
        raise ValueError(f"crossentropy: losses must be f32, got {losses.dtype}")
    kinds = [(t, t) for t in TYPES] if grad else [(t,) for t in TYPES]
    views = dict(logits=logits, dlogits=dlogits) if grad else dict(logits=logits)
    dtype = logits.dtype
    element_types("crossentropy", kinds, **views)
    args = [losses, dlogits if grad else None, logits, targets, i32(N), i32(V), i32(Vr), f32(grad_scale)]
    nv4 = None if V <= WARP_MAX_V else rows_nv4(V, logits, dlogits if grad else None)
    if V <= WARP_MAX_V:
        rt.launch(rt.function(FILE, ce_name("warp", grad, dtype=dtype)), (cdiv(N, WARPS),), (THREADS,), args,
                  label="crossentropy")
    elif dtype == "bf16" and V % 8 == 0 and 2 * V <= SMEM_ROW_MAX and \
            all(v is None or v.ptr % 16 == 0 for v in (logits, dlogits if grad else None)):
        rt.launch(rt.function(FILE, ce_name("smem", grad, dtype=dtype)), (N,), (ROWS_THREADS,), args, smem=2 * V,
                  label="crossentropy")
    elif nv4 is not None:
        rt.launch(rt.function(FILE, ce_name("rows", grad, nv4, dtype)), (N,), (ROWS_THREADS,), args,
                  label="crossentropy")
    else:
        rt.launch(rt.function(FILE, ce_name("block", grad, dtype=dtype)), (N,), (THREADS,), args,
                  label="crossentropy")


def loss_reduce(rt: RuntimeProtocol, losses, history):
    if rt.state is None:
        raise RuntimeError("loss_reduce: rt.state (the StepState) is not set")
    N = losses.numel
    hist_len = 0 if history is None else history.numel
    rt.launch(rt.function(FILE, REDUCE_NAME), (1,), (REDUCE_THREADS,),
              [rt.state, losses, i32(N), history, i32(hist_len)], label="loss_reduce")
