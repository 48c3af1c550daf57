"""Causal self-attention launchers: unfused (kernels/attention.cu + batched gemms) and fused
(flash attention: kernels/flash_*.cu, one file an implementation; flash_common.cuh says what they share).

    attention_fwd(rt, y[B,T,C], qkv[B,T,3C], saved, n_head, p, site, ex)
    attention_bwd(rt, dqkv[B,T,3C], dy[B,T,C], qkv, y, saved, n_head, p, site, ex)

ex is the execution plan (gptcuda/runtime/execution.py; the backend passes its own, default rt's): its
`attention` path and, for the unfused path's batched products, its GEMM choices. The fused paths:
flash (fp32 in FFMA: flash_fwd, flash_bwd_dq, flash_bwd_dkv), flash_3x (fp32 as 3xTF32 on the tensor
cores, sm_90 with fp32_gemm 3xtf32: flash_fwd_x3, flash_bwd_dq_x3, flash_bwd_dkv_x3) and flash_tc
(tf32: flash_fwd_tc, flash_bwd_dq_tc, and flash_bwd_dkv_wg on warpgroup MMA for head sizes up to 64
where the plan has it, else flash_bwd_dkv_tc). `saved` is the per-layer dict planned from `saved_shapes(cfg)`: {"probs": [B,H,T,T]} the
unfused path (the probabilities before dropout are kept for the backward), {"lse": [B,H,T]}
the fused one (the per-row log-sum-exp of the scaled scores). Scratch shared by all layers
comes from `workspace(cfg)`, names prefixed "attention_" (not "attn_": the memory plan names the
per-layer saved tensors "attn_<name>" and model.saved() collects every "attn_*" entry).

Dropout on the attention probabilities uses the stream (rt.seed, state.step, site); the keep
bit of element (b, h, i, j) is that of rng.attention_keep over [B,H,T,T] (keys 2c, 2c + 1, 2c + 8,
2c + 9 of a 16-key block of a row share one keep word, a byte each), scaled by 1 / (1 -
rng.attention_rate(p)), in both paths.
"""
from __future__ import annotations

import math

from gptcuda.runtime import execution
from gptcuda.ops.cuda import attention_dropout_args, cdiv, elementwise, flash, sm_count
from gptcuda.ops.cuda.flash import (FLASH_HEAD_SIZES, FLASH_PATHS, FLASH_THREADS, FLASH_WG_HEAD_SIZES, ROWSUM_FILE,  # noqa: F401
                                    ROWSUM_THREADS, expression)
from gptcuda.runtime import DeviceView, f32, i32

FILE = "attention.cu"
ROWS_PER_BLOCK = 8            # the row kernels' rows a block (one warp a row): their template argument
ROW_THREADS = 32 * ROWS_PER_BLOCK
PERMUTE_THREADS = 256         # the permutes' block: their template argument
MAX_GRID = 132 * 32           # grid-stride kernels: enough blocks to fill 132 SMs many times


def _permute_name(to_heads: bool, vec: int) -> str:
    return expression("attn_permute_in" if to_heads else "attn_permute_out", vec, PERMUTE_THREADS)


def _row_name(kernel: str, drop: bool | None) -> str:
    """attn_softmax_fwd / attn_softmax_bwd <drop, ROWS_PER_BLOCK>, attn_dropout_probs <ROWS_PER_BLOCK> (drop None)."""
    return expression(kernel, *(() if drop is None else (drop,)), ROWS_PER_BLOCK)


VARIANTS = (
    [(FILE, _permute_name(t, v), {}) for t in (True, False) for v in (1, 4)]
    + [(FILE, _row_name(k, d), {}) for k in ("attn_softmax_fwd", "attn_softmax_bwd") for d in (False, True)]
    + [(FILE, _row_name("attn_dropout_probs", None), {})]
    + flash.variants()
)


# ---------------------------------------------------------------------------- planning

def _dims(cfg):
    B, T, C, H = int(cfg.batch_size), int(cfg.block_size), int(cfg.n_embd), int(cfg.n_head)
    return B, T, C, H, C // H


def _fused(cfg, ex) -> bool:
    """The plan's attention is a flash path (ex: the execution plan; default the config's)."""
    return (ex or execution.resolve(cfg)).attention not in ("unfused", None)     # (None: the reference's plan)


def saved_shapes(cfg, ex=None) -> dict:
    """Per-layer tensors the forward keeps for the backward."""
    B, T, C, H, hs = _dims(cfg)
    if _fused(cfg, ex):
        return {"lse": ((B, H, T), "f32")}
    return {"probs": ((B, H, T, T), "f32")}


def workspace(cfg, ex=None) -> dict:
    """Scratch shared by all layers (name -> (shape, dtype)); bf16 activations at a head size without
    bf16 flash kernels: the fp32 copies the tf32 flash kernels run on, qkv | y | dy | dqkv (`_on_fp32`)."""
    B, T, C, H, hs = _dims(cfg)
    ex = ex or execution.resolve(cfg)
    if _fused(cfg, ex):
        out = {"attention_d": ((B, H, T), "f32")}            # D = rowsum(dO * O) of the backward
        if ex.act_dtype == "bf16" and ex.attention != "flash_bf16":
            out[F32_COPIES] = ((B * T * 8 * C,), "f32")
        return out
    heads = ((B, H, T, hs), "f32")
    return {
        "attention_q": heads, "attention_k": heads, "attention_v": heads,
        "attention_yh": heads,                                # yh in the forward, dyh in the backward
        "attention_att": ((B, H, T, T), "f32"),               # dropped probs (fwd, p > 0); pd, then dpd -> dS (bwd)
        "attention_dq": heads, "attention_dk": heads, "attention_dv": heads,
    }


# ---------------------------------------------------------------------------- helpers

def _split(qkv: DeviceView, n_head: int):
    B, T, C3 = (int(s) for s in qkv.shape)
    if C3 % 3:
        raise ValueError(f"attention: qkv width {C3} is not 3*C")
    C = C3 // 3
    if C % n_head:
        raise ValueError(f"attention: C={C} does not split into {n_head} heads")
    return B, T, C, int(n_head), C // n_head


def _view(ws: DeviceView, shape) -> DeviceView:
    """The leading part of a workspace, viewed with `shape` (workspaces are sized for the config)."""
    v = DeviceView(ws.ptr, tuple(int(s) for s in shape), ws.dtype, ws.name)
    if v.numel > ws.numel:
        raise ValueError(f"workspace {ws.name}{ws.shape} is smaller than {v.shape}")
    return v


def _workspaces(rt, shape, *names) -> list:
    """The workspaces attention_<name>, each viewed with `shape`."""
    return [_view(rt.workspace("attention_" + n), shape) for n in names]


def _aligned(*views) -> bool:
    return all(v is None or v.ptr % 16 == 0 for v in views)


def _grid_1d(n: int, threads: int) -> int:
    return max(1, min(cdiv(n, threads), MAX_GRID))




def _permute(rt, to_heads: bool, wide: DeviceView, heads, B, T, H, hs):
    """Copy wide [B,T,nmat*C] into nmat heads [B,H,T,hs] (to_heads), or the heads back into wide."""
    kernel = "attn_permute_in" if to_heads else "attn_permute_out"     # the launch's label
    nmat = len(heads)
    h = list(heads) + [None] * (3 - nmat)
    vec = 4 if hs % 4 == 0 and _aligned(wide, *h) else 1
    fn = rt.function(FILE, _permute_name(to_heads, vec))
    n = B * T * nmat * H * hs // vec
    views = h + [wide] if to_heads else [wide] + h   # both kernels take the destination first
    rt.launch(fn, (_grid_1d(n, PERMUTE_THREADS),), (PERMUTE_THREADS,),
              views + [i32(B), i32(T), i32(H), i32(hs), i32(nmat)], label=kernel)


def permute_in(rt, outs, x: DeviceView, B, T, H, hs):
    """x [B,T,nmat*C] -> nmat views [B,H,T,hs] (nmat = len(outs))."""
    _permute(rt, True, x, outs, B, T, H, hs)


def permute_out(rt, out: DeviceView, ins, B, T, H, hs):
    """nmat views [B,H,T,hs] -> out [B,T,nmat*C]."""
    _permute(rt, False, out, ins, B, T, H, hs)


# ---------------------------------------------------------------------------- ops


def _path(saved, op, ex):
    """The saved tensor the execution plan's attention path (unfused | flash | flash_tc | flash_3x)
    reads, checked against what the memory plan saved; a runtime without a config's plan: as `saved`
    says, the fused kernels as the plan's rule picks them (ExecutionPlan.fused_path). Returns (saved name,
    the fused path)."""
    path = ex.attention
    want = "probs" if path == "unfused" else "lse" if path is not None else ("probs" if "probs" in saved else "lse")
    if want not in saved:
        raise KeyError(f"{op}: the plan's attention {path or 'path'} needs the saved {want!r}, the memory plan "
                       f"saved {sorted(saved)}")
    fused = ex.fused_path()
    if want == "lse" and fused not in FLASH_PATHS:
        raise ValueError(f"{op}: unknown fused attention path {fused!r} (one of {FLASH_PATHS})")
    return want, fused


F32_COPIES = "attention_f32"


def _on_fp32(rt, label, *views):
    """fp32 views of the F32_COPIES workspace in the shapes of `views` (bf16 tensors of the attention:
    qkv, y, dy, dqkv, in that order), laid one after the other."""
    ws = rt.workspace(F32_COPIES)
    out, off = [], 0
    for v in views:
        if off + v.numel > ws.numel:
            raise ValueError(f"{label}: the workspace {F32_COPIES} holds {ws.numel} floats, not {off + v.numel}")
        out.append(DeviceView(ws.ptr + 4 * off, v.shape, "f32", f"{F32_COPIES}:{v.name}"))
        off += v.numel
    return out


def attention_fwd(rt, y, qkv, saved, n_head, p, site, ex=None):
    """y = attention(qkv) (saving what the backward needs). bf16 qkv and y: the bf16 flash kernels
    (flash_bf16), or at other head sizes the tf32 ones on fp32 copies (qkv widened exactly, y rounded
    once)."""
    ex = rt.exec if ex is None else ex      # the execution plan (the backend passes its own)
    if _path(saved, "attention_fwd", ex)[1] == "flash_bf16":      # (bf16 tensors only: _bf16_check)
        return _bf16_fwd(rt, y, qkv, saved["lse"], n_head, p, site)
    if qkv.dtype == "bf16":
        q32, y32 = _on_fp32(rt, "attention_fwd", qkv, y)
        elementwise.accumulate(rt, q32, qkv, first=True)
        attention_fwd(rt, y32, q32, saved, n_head, p, site, ex)
        elementwise.accumulate(rt, y, y32, first=True)
        return None
    want, path = _path(saved, "attention_fwd", ex)
    if want == "probs":
        return _unfused_fwd(rt, y, qkv, saved["probs"], n_head, p, site, ex)
    return _fused_fwd(rt, y, qkv, saved["lse"], n_head, p, site, path)


def attention_bwd(rt, dqkv, dy, qkv, y, saved, n_head, p, site, ex=None):
    """dqkv from dy (bf16: flash_bf16, or on fp32 copies of qkv, y and dy, dqkv rounded once, as
    attention_fwd)."""
    ex = rt.exec if ex is None else ex
    if _path(saved, "attention_bwd", ex)[1] == "flash_bf16":
        return _bf16_bwd(rt, dqkv, dy, qkv, y, saved["lse"], n_head, p, site)
    if qkv.dtype == "bf16":
        q32, y32, dy32, dq32 = _on_fp32(rt, "attention_bwd", qkv, y, dy, dqkv)
        for dst, src in ((q32, qkv), (y32, y), (dy32, dy)):
            elementwise.accumulate(rt, dst, src, first=True)
        attention_bwd(rt, dq32, dy32, q32, y32, saved, n_head, p, site, ex)
        elementwise.accumulate(rt, dqkv, dq32, first=True)
        return None
    want, path = _path(saved, "attention_bwd", ex)
    if want == "probs":
        return _unfused_bwd(rt, dqkv, dy, qkv, saved["probs"], n_head, p, site, ex)
    wg = ex.dkv_on_wgmma(int(qkv.shape[-1]) // (3 * int(n_head)))
    return _fused_bwd(rt, dqkv, dy, qkv, y, saved["lse"], n_head, p, site, path, wg)


# ---- unfused

def _unfused_fwd(rt, y, qkv, probs, n_head, p, site, ex):
    from gptcuda.ops.cuda.gemm import matmul_batched

    B, T, C, H, hs = _split(qkv, n_head)
    heads = (B, H, T, hs)
    q, k, v, yh = _workspaces(rt, heads, "q", "k", "v", "yh")
    probs = _view(probs, (B, H, T, T))
    permute_in(rt, (q, k, v), qkv, B, T, H, hs)
    matmul_batched(rt, probs, q, k, trans_a=False, trans_b=True, alpha=1.0 / math.sqrt(hs), ex=ex)
    rows = B * H * T
    grid = (cdiv(rows, ROWS_PER_BLOCK),)
    drop = float(p) > 0
    pd = _view(rt.workspace("attention_att"), (B, H, T, T)) if drop else None
    fn = rt.function(FILE, _row_name("attn_softmax_fwd", drop))
    rt.launch(fn, grid, (ROW_THREADS,),
              [probs, pd] + attention_dropout_args(rt, p, site) + [i32(rows), i32(T)],
              label="attn_softmax_fwd")
    matmul_batched(rt, yh, pd if drop else probs, v, ex=ex)
    permute_out(rt, y, (yh,), B, T, H, hs)


def _unfused_bwd(rt, dqkv, dy, qkv, probs, n_head, p, site, ex):
    from gptcuda.ops.cuda.gemm import matmul_batched

    B, T, C, H, hs = _split(qkv, n_head)
    heads = (B, H, T, hs)
    q, k, v, dyh, dq, dk, dv = _workspaces(rt, heads, "q", "k", "v", "yh", "dq", "dk", "dv")
    att = _view(rt.workspace("attention_att"), (B, H, T, T))
    probs = _view(probs, (B, H, T, T))
    rows = B * H * T
    grid = (cdiv(rows, ROWS_PER_BLOCK),)
    drop = float(p) > 0
    dargs = attention_dropout_args(rt, p, site)

    permute_in(rt, (q, k, v), qkv, B, T, H, hs)      # later layers' forwards overwrote q, k, v
    permute_in(rt, (dyh,), dy, B, T, H, hs)
    if drop:                                         # att = pd, used for dv, then reused for dpd
        rt.launch(rt.function(FILE, _row_name("attn_dropout_probs", None)), grid, (ROW_THREADS,),
                  [att, probs] + dargs + [i32(rows), i32(T)], label="attn_dropout_probs")
    matmul_batched(rt, dv, att if drop else probs, dyh, trans_a=True, ex=ex)      # dv = pd^T dyh
    matmul_batched(rt, att, dyh, v, trans_b=True, ex=ex)                          # dpd = dyh v^T
    fn = rt.function(FILE, _row_name("attn_softmax_bwd", drop))
    rt.launch(fn, grid, (ROW_THREADS,),
              [att, probs] + dargs + [f32(1.0 / math.sqrt(hs)), i32(rows), i32(T)],
              label="attn_softmax_bwd")
    matmul_batched(rt, dq, att, k, ex=ex)                                         # dq = dS k
    matmul_batched(rt, dk, att, q, trans_a=True, ex=ex)                           # dk = dS^T q
    permute_out(rt, dqkv, (dq, dk, dv), B, T, H, hs)


# ---- fused (the kernels and their geometry: flash.py)

def _fused_check(hs, *views):
    if hs not in FLASH_HEAD_SIZES:
        raise ValueError(f"fused attention supports head sizes {FLASH_HEAD_SIZES}, got {hs}; "
                         "use attention: unfused")
    if not _aligned(*views):
        raise ValueError("fused attention needs 16-byte aligned qkv / y / dy / dqkv")


def _fused_fwd(rt, y, qkv, lse, n_head, p, site, path):
    B, T, C, H, hs = _split(qkv, n_head)
    _fused_check(hs, qkv, y)
    lse = _view(lse, (B, H, T))
    k = flash.flash_kernel("fwd", path, hs, float(p) > 0)
    rt.launch(rt.function(k.file, k.name), (B * H, cdiv(T, k.rows)), (FLASH_THREADS,),
              [y, lse, qkv] + attention_dropout_args(rt, p, site) + [f32(1.0 / math.sqrt(hs)), i32(T), i32(H)],
              smem=k.smem, label="flash_fwd")


def rowsum_do(rt, D, dy, y, B, T, H, hs):
    """D [B, H, T] = the row sums of dy * y per head (dy, y [B, T, H * hs], fp32, 16-byte aligned): the fp32
    paths' D = rowsum(dO * O) = rowsum(P * dP), also with dropout (bf16: flash_bwd_dq_bf16 makes it)."""
    rows = B * T * H
    rt.launch(rt.function(ROWSUM_FILE, flash.rowsum_name(hs)), (cdiv(rows * (hs // 4), ROWSUM_THREADS),),
              (ROWSUM_THREADS,), [D, dy, y, i32(rows), i32(T), i32(H)], label="flash_rowsum_do")


def _fused_bwd(rt, dqkv, dy, qkv, y, lse, n_head, p, site, path, wg=False):
    """path: the fused path's kernels (flash | flash_tc | flash_3x); wg: dK / dV on warpgroup MMA
    (flash_bwd_dkv_wg: sm_90a, flash_tc only, head sizes FLASH_WG_HEAD_SIZES)."""
    if wg and path != "flash_tc":
        raise ValueError(f"flash_bwd_dkv_wg is a flash_tc kernel, not one of {path}")
    B, T, C, H, hs = _split(qkv, n_head)
    _fused_check(hs, qkv, y, dy, dqkv)
    lse = _view(lse, (B, H, T))
    D = _view(rt.workspace("attention_d"), (B, H, T))
    rowsum_do(rt, D, dy, y, B, T, H, hs)
    args = [dqkv, qkv, dy, lse, D] + attention_dropout_args(rt, p, site) + [f32(1.0 / math.sqrt(hs)), i32(T), i32(H)]
    for kind, k in (("dq", flash.flash_kernel("dq", path, hs, float(p) > 0)),
                    ("dkv", flash.flash_kernel("dkv", path, hs, float(p) > 0, wg))):
        rt.launch(rt.function(k.file, k.name), (B * H, cdiv(T, k.rows)), (FLASH_THREADS,), args,
                  smem=k.smem, label=f"flash_bwd_{kind}")


# ---- bf16 (flash_bf16.cu: qkv and dy read through TMA tensor maps)

def _bf16_map(rt, x, rows):
    """The tensor map of bf16 x [B, T, width] as [B][T][width] (a box never leaves its sequence: rows past
    T read as zeros), boxes of 64 columns (128 bytes, the 128-byte swizzle) by `rows`."""
    B, T, width = (int(s) for s in x.shape)
    return rt.tensor_map(x, (width, T, B), (2 * width, 2 * width * T), (64, rows, 1))


def _flat_map(rt, x, box):
    """The tensor map of fp32 x (lse, D [B, H, T]) as one flat dimension from the 16-byte boundary at or
    before x (the copy engine's alignment: a layer's [B, H, T] need not start on one), boxes of `box`
    values, no swizzle, and x's first element's place in it: [map, i32]. The copy engine faults on a box
    whose first value is not on a 16-byte boundary (a head's lse at an odd T), so the kernel starts each
    box at the boundary at or before the values it wants and `box` is 4 more than it wants. A box past a
    head's T reads the next head's values, past the end zeros: the kernel masks them. The unused
    dimensions' strides are 16-byte multiples, as the copy engine wants."""
    shift = x.ptr % 16 // 4
    n = x.numel + shift
    pitch = -(-4 * n // 16) * 16
    base = DeviceView(x.ptr - 4 * shift, (n,), x.dtype, x.name)
    return [rt.tensor_map(base, (n, 1, 1), (pitch, pitch), (box, 1, 1), swizzle=False), i32(shift)]


def _bf16_check(*views):
    """bf16, 16-byte aligned views (a head size without bf16 kernels: flash_bf16_plan refuses it)."""
    if any(v.dtype != "bf16" for v in views):
        raise TypeError(f"the bf16 flash kernels take bf16 qkv / y / dy / dqkv, got {[v.dtype for v in views]}")
    if not _aligned(*views):
        raise ValueError("fused attention needs 16-byte aligned qkv / y / dy / dqkv")


def _bf16_items(rt, k, BH, T):
    """A bf16 flash kernel's grid and its last two arguments (B * H and the work items): the items (b*H + h,
    tile of k.rows rows) a block each, or walked by at most one block an SM (k.walk)."""
    items = BH * cdiv(T, k.rows)
    return (min(items, sm_count(rt)) if k.walk else items,), [i32(BH), i32(items)]


def _bf16_fwd(rt, y, qkv, lse, n_head, p, site):
    B, T, C, H, hs = _split(qkv, n_head)
    _bf16_check(qkv, y)
    lse = _view(lse, (B, H, T))
    k = flash.flash_kernel("fwd", "flash_bf16", hs, float(p) > 0, T=T)
    maps = [_bf16_map(rt, qkv, k.rows), _bf16_map(rt, qkv, k.stream_rows)]
    grid, items = _bf16_items(rt, k, B * H, T)
    rt.launch(rt.function(k.file, k.name), grid, (k.threads,),
              [y, lse] + maps + attention_dropout_args(rt, p, site) + [f32(1.0 / math.sqrt(hs)), i32(T), i32(H)]
              + items, smem=k.smem, label="flash_fwd")


def _bf16_bwd(rt, dqkv, dy, qkv, y, lse, n_head, p, site):
    B, T, C, H, hs = _split(qkv, n_head)
    _bf16_check(qkv, y, dy, dqkv)
    lse = _view(lse, (B, H, T))
    D = _view(rt.workspace("attention_d"), (B, H, T))      # written by dQ's kernel (its rows'), read by dK / dV's
    tail = [lse, D] + attention_dropout_args(rt, p, site) + [f32(1.0 / math.sqrt(hs)), i32(T), i32(H)]
    kq = flash.flash_kernel("dq", "flash_bf16", hs, float(p) > 0, T=T)
    maps = [_bf16_map(rt, qkv, kq.rows), _bf16_map(rt, dy, kq.rows), _bf16_map(rt, qkv, kq.stream_rows)]
    grid, items = _bf16_items(rt, kq, B * H, T)
    rt.launch(rt.function(kq.file, kq.name), grid, (kq.threads,), [dqkv] + maps + [dy, y] + tail + items,
              smem=kq.smem, label="flash_bwd_dq")
    kk = flash.flash_kernel("dkv", "flash_bf16", hs, float(p) > 0, T=T)
    maps = [_bf16_map(rt, qkv, kk.rows), _bf16_map(rt, qkv, kk.stream_rows), _bf16_map(rt, dy, kk.stream_rows)]
    maps += _flat_map(rt, lse, kk.stream_rows + 4) + _flat_map(rt, D, kk.stream_rows + 4)
    grid, items = _bf16_items(rt, kk, B * H, T)
    rt.launch(rt.function(kk.file, kk.name), grid, (kk.threads,), [dqkv] + maps + tail + items, smem=kk.smem,
              label="flash_bwd_dkv")
