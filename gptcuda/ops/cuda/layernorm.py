"""Launchers of kernels/layernorm.cu.

    layernorm_fwd(rt, out[N,C], mean[N], rstd[N], x[N,C], w[C], b[C]|None, residual=None)   eps = 1e-5
        residual = (resid[N,C], branch[N,C], p, site): x is first made, x = resid + dropout(branch)
        with dropout p of stream site (residual_dropout's values), in the same pass where it can
    layernorm_bwd(rt, dx[N,C], dw[C], db[C]|None, dout[N,C], x, mean, rstd, w, drop=None, ds=None)
                                                                 dx += ; dw = ; db = ; ds =
        drop = (dropped[N,C], p, site): also dropped = dropout_bwd(dx) with dropout p of stream
        site, in the same pass (the residual gradient's next use: the branch before it)
        ds[C] (with db only): the column sums of that branch gradient as stored (dropped, else dx): the
        bias gradient of the projection whose branch the residual took there

Element types (the views' dtypes pick the kernel: FWD_TYPES, BWD_TYPES; another combination is a
ValueError): fp32 throughout; a bf16 model's, every tensor bf16; or an fp32 residual stream (x, resid,
dx) with bf16 activations and their gradients (out, branch, dout, dropped). w, b, mean, rstd, dw and db
are fp32 always, and so is every sum; a bf16 output is rounded once.

Rows are the flattened leading dimensions. With C % 4 == 0, C <= 1024 and views aligned to 4 of
their elements (16 bytes of fp32, 8 of bf16) a warp holds its row in registers (NV = ceil(C/128)
groups of 4 values per lane); otherwise the loop kernels handle any C. The backward writes per-block
partial sums of dw/db/ds into the workspace "layernorm_partials" [MAX_BLOCKS, 3*C] (or, while a backward
holds its sums, a region of elementwise.py's ring) and elementwise.sum_rows adds them up in block order
(ds's made with db, summed where asked for).
"""
from __future__ import annotations

from gptcuda import faults
from gptcuda.ops.backend import rows
from gptcuda.runtime import DeviceView, RuntimeProtocol, f32, i32, u32
from gptcuda.ops.cuda import (aligned4, cdiv, dropout_args, elementwise, expression, fp32_only, kernel_types,
                              sm_count, type_codes)

FILE = "layernorm.cu"
WARPS = 8                 # every kernel's block (rows a block in the warp-per-row ones): its template argument
THREADS = WARPS * 32
MAX_NV = 8                # register path up to C = 128 * MAX_NV = 1024
MAX_BLOCKS = 512          # backward blocks (rows of the partials workspace)
# The register kernels' backward blocks an SM: the grid is this many times the SMs, each warp walking its rows.
# Two of the bf16 C = 768 kernel fit an SM (127 registers, 76.8 KB), so its grid is one wave (512 blocks were
# two, each block paying its start, its block-wide sums and a partial row again: bench/NOTES.md, "one wave");
# a variant that fits only one an SM (past 128 registers a thread) runs two waves, where it ran up to four.
BWD_BLOCKS_PER_SM = 2
WORKSPACE = "layernorm_partials"
# The element types there are kernels for: (x, branch, out) of the forward, x also the fused residual's
# resid and xw (the residual stream); (dout, x, dx, dropped) of the backward, dx read and accumulated
# into. fp32; all bf16; an fp32 residual stream normalized into bf16, whose bf16 branch (a product's
# output) is added in, and whose gradient dx is accumulated in fp32 from a bf16 dout, the branch's
# gradient (dropped: the next product's operand) bf16.
FWD_TYPES = (("f32", "f32", "f32"), ("bf16", "bf16", "bf16"), ("f32", "bf16", "bf16"))
BWD_TYPES = (("f32", "f32", "f32", "f32"), ("bf16", "bf16", "bf16", "bf16"), ("bf16", "f32", "f32", "bf16"))


def bwd_smem(nv: int, bias: bool) -> int:
    """Dynamic shared memory of layernorm_bwd_reg<nv, bias, ...> (its SMEM): w and each warp's dw (and
    db and ds) sums, nv float4 a lane each (0: the loop kernel takes none)."""
    return ((3 if bias else 1) * WARPS + 1) * nv * 32 * 16


def fwd_name(nv: int, bias: bool, fused: bool = False, types=FWD_TYPES[0]) -> str:
    """layernorm_fwd_reg<NV, BIAS, RD, WARPS, TX, TB, TO> (nv > 0) or layernorm_fwd_loop<BIAS, WARPS, TX, TO>
    of the forward's element types (a FWD_TYPES entry)."""
    tx, tb, to = type_codes(types)
    return (expression("layernorm_fwd_reg", nv, bias, fused, WARPS, tx, tb, to, sep=", ") if nv
            else expression("layernorm_fwd_loop", bias, WARPS, tx, to, sep=", "))


def bwd_name(nv: int, bias: bool, drop: bool, types=BWD_TYPES[0]) -> str:
    """layernorm_bwd_reg<NV, BIAS, DROP, WARPS, SMEM, TDO, TX, TDX, TDR> (nv > 0) or
    layernorm_bwd_loop<BIAS, DROP, WARPS, TDO, TX, TDX, TDR> of the backward's element types (a BWD_TYPES
    entry)."""
    codes = type_codes(types)
    return (expression("layernorm_bwd_reg", nv, bias, drop, WARPS, bwd_smem(nv, bias), *codes, sep=", ") if nv
            else expression("layernorm_bwd_loop", bias, drop, WARPS, *codes, sep=", "))


_TF = (True, False)
_NVS = range(0, MAX_NV + 1)               # 0: the loop kernels
VARIANTS = (
    [(FILE, fwd_name(nv, b, r, t), {}) for t in FWD_TYPES for nv in _NVS for b in _TF for r in _TF if nv or not r]
    + [(FILE, bwd_name(nv, b, d, t), {}) for t in BWD_TYPES for nv in _NVS for b in _TF for d in _TF]
)
# the deliberately wrong backward of gradcheck.py --break=layernorm (gptcuda/faults.py), in the element
# types of the fp32 / tf32 models and of the bf16 model (all bf16)
BROKEN = {"GC_BREAK_LAYERNORM": 1}
BROKEN_TYPES = BWD_TYPES[:2]
VARIANTS += [(FILE, bwd_name(nv, b, d, t), BROKEN) for t in BROKEN_TYPES for nv in _NVS for b in _TF for d in _TF]


def workspace(cfg, ex=None) -> dict:
    """Partials of the backward: [MAX_BLOCKS, 3*C] floats (C = n_embd); and elementwise's ring of the
    sums a backward holds (elementwise.SUMS): one layer's, its two layernorms' partials ([MAX_BLOCKS, 3C]
    each) and its bias gradients' ([elementwise.MAX_CHUNKS, 4C] at most each, four; a larger one is
    summed at once, from elementwise's "bias_partials")."""
    C = int(cfg.n_embd)
    ring = 2 * MAX_BLOCKS * 3 * C + 4 * elementwise.MAX_CHUNKS * 4 * C + 8 * elementwise.SUMS_ALIGN
    return {WORKSPACE: ((MAX_BLOCKS, 3 * C), "f32"), elementwise.SUMS: ((ring,), "f32")}


def _nv(C: int, *views) -> int:
    """Register-path groups of 4 values per lane, or 0 for the loop kernels."""
    if C % 4 == 0 and C <= 128 * MAX_NV and aligned4(*views):
        return cdiv(C, 128)
    return 0


def _keep_args(rt: RuntimeProtocol, p, site, label):
    """dropout_args of a fused dropout, which needs 0 < p < 1."""
    if not 0.0 < float(p) < 1.0:
        raise ValueError(f"{label}: the fused dropout needs 0 < p < 1, got {p}")
    return dropout_args(rt, p, site, label)


_NO_DROP = [None, u32(0), u32(0), u32(0), f32(1.0)]


def layernorm_fwd(rt: RuntimeProtocol, out, mean, rstd, x, w, b, residual=None):
    C = int(x.shape[-1])
    N = rows(x.shape)
    if out.numel != N * C or int(w.shape[-1]) != C or (b is not None and int(b.shape[-1]) != C):
        raise ValueError(f"layernorm_fwd: shapes out {out.shape}, x {x.shape}, w {w.shape}")
    fp32_only("layernorm_fwd", mean=mean, rstd=rstd, w=w, b=b)
    fused = residual is not None
    resid, branch, p, site = residual if fused else (None, None, 0.0, 0)
    t = kernel_types("layernorm_fwd", [(tx, tx, tb, to) for tx, tb, to in FWD_TYPES],
                     x=x, resid=resid, branch=branch, out=out)
    types = (t[0], t[2], t[3])
    nv = _nv(C, out, x, w, b, resid, branch)
    if fused:
        if resid.numel != N * C or branch.numel != N * C:
            raise ValueError(f"layernorm_fwd: resid {resid.shape} / branch {branch.shape} are not [{N}, {C}]")
        if not nv:                       # the loop kernels take x as it is: make it first
            elementwise.residual_dropout(rt, x, resid, branch, p, site)
    if nv:
        tail = ([x, resid, branch] + _keep_args(rt, p, site, "layernorm_fwd") if fused
                else [None, None, None] + _NO_DROP)
        rt.launch(rt.function(FILE, fwd_name(nv, b is not None, fused, types)), (cdiv(N, WARPS),), (THREADS,),
                  [out, mean, rstd, None if fused else x, w, b, i32(N), i32(C)] + tail, label="layernorm_fwd")
    else:
        rt.launch(rt.function(FILE, fwd_name(0, b is not None, types=types)), (cdiv(N, WARPS),), (THREADS,),
                  [out, mean, rstd, x, w, b, i32(N), i32(C)], label="layernorm_fwd")


def _drop_args(rt: RuntimeProtocol, drop, N, C):
    """(DROP, trailing arguments) of the backward's dropout output `drop` (None or
    (dropped, p, site) with 0 < p < 1)."""
    if drop is None:
        return False, [None] + _NO_DROP
    out, p, site = drop
    if out.numel != N * C:
        raise ValueError(f"layernorm_bwd: dropped {out.shape} is not [{N}, {C}]")
    return True, [out] + _keep_args(rt, p, site, "layernorm_bwd")


def layernorm_bwd(rt: RuntimeProtocol, dx, dw, db, dout, x, mean, rstd, w, drop=None, ds=None):
    C = int(x.shape[-1])
    N = rows(x.shape)
    if dx.numel != N * C or dout.numel != N * C or int(dw.shape[-1]) != C:
        raise ValueError(f"layernorm_bwd: shapes dx {dx.shape}, dout {dout.shape}, x {x.shape}, dw {dw.shape}")
    if ds is not None and (db is None or ds.numel != C):
        raise ValueError(f"layernorm_bwd: ds {ds.shape} needs db and {C} elements")
    fp32_only("layernorm_bwd", mean=mean, rstd=rstd, w=w)
    elementwise.sum_outputs("layernorm_bwd", dw=dw, db=db, ds=ds)      # (sum_rows' outputs: fp32 or bf16 gradients)
    types = kernel_types("layernorm_bwd", BWD_TYPES, dout=dout, x=x, dx=dx,
                         dropped=drop[0] if drop is not None else None)
    if "layernorm" in faults.broken and types not in BROKEN_TYPES:
        raise ValueError("layernorm_bwd: the deliberately wrong backward (gradcheck --break=layernorm) is fp32 or "
                         "all bf16 only")
    dflag, dargs = _drop_args(rt, drop, N, C)
    nv = _nv(C, dx, dout, x, w, drop[0] if drop is not None else None)
    G = min(cdiv(N, WARPS), BWD_BLOCKS_PER_SM * sm_count(rt), MAX_BLOCKS) if nv else min(N, MAX_BLOCKS)
    part = elementwise.partials(rt, G, 3 * C, WORKSPACE)     # the held sums' ring or the workspace
    if part is None:
        raise ValueError(f"workspace {WORKSPACE} is too small for {G} blocks x 3*{C}")
    if nv and not aligned4(part):
        raise ValueError(f"layernorm_bwd: partials at {part.ptr:#x} are not 16-byte aligned")
    name = bwd_name(nv, db is not None, dflag, types)
    defines = BROKEN if "layernorm" in faults.broken else {}
    rt.launch(rt.function(FILE, name, defines), (G,), (THREADS,),
              [dx, part, dout, x, mean, rstd, w, i32(N), i32(C)] + dargs, smem=bwd_smem(nv, db is not None),
              label="layernorm_bwd")
    sums = [(dw, part, C, 3 * C)]
    if db is not None:
        sums.append((db, DeviceView(part.ptr + 4 * C, (G, C), "f32", part.name), C, 3 * C))
    if ds is not None:
        sums.append((ds, DeviceView(part.ptr + 8 * C, (G, C), "f32", part.name), C, 3 * C))
    elementwise.sum_rows(rt, *sums, label="layernorm_bwd_reduce")
