"""Launchers of kernels/layernorm.cu.

    layernorm_fwd(rt, out[N,C], mean[N], rstd[N], x[N,C], w[C], b[C]|None)      eps = 1e-5
    layernorm_bwd(rt, dx[N,C], dw[C], db[C]|None, dout[N,C], x, mean, rstd, w)  dx += ; dw = ; db =

Rows are the flattened leading dimensions. With C % 4 == 0, C <= 1024 and 16-byte aligned
views a warp holds its row in registers (NV = ceil(C/128) float4 per lane); otherwise the
loop kernels handle any C. The backward writes per-block partial sums of dw/db into the
workspace "layernorm_partials" [MAX_BLOCKS, 2*C] and a second kernel sums them in block order.
"""
from __future__ import annotations

from gptcuda import faults
from gptcuda.ops.backend import rows
from gptcuda.runtime import i32
from gptcuda.ops.cuda import cdiv

FILE = "layernorm.cu"
WARPS = 8
THREADS = WARPS * 32
MAX_NV = 8                # register path up to C = 128 * MAX_NV = 1024
MAX_BLOCKS = 512          # backward blocks (rows of the partials workspace)
WORKSPACE = "layernorm_partials"

VARIANTS = (
    [(FILE, f"layernorm_fwd_reg<{nv}, {b}>", {}) for nv in range(1, MAX_NV + 1) for b in ("true", "false")]
    + [(FILE, f"layernorm_fwd_loop<{b}>", {}) for b in ("true", "false")]
    + [(FILE, f"layernorm_bwd_reg<{nv}, {b}>", {}) for nv in range(1, MAX_NV + 1) for b in ("true", "false")]
    + [(FILE, f"layernorm_bwd_loop<{b}>", {}) for b in ("true", "false")]
    + [(FILE, "layernorm_bwd_reduce", {})]
)
# the deliberately wrong backward of gradcheck.py --break=layernorm (gptcuda/faults.py)
BROKEN = {"GC_BREAK_LAYERNORM": 1}
VARIANTS += [(f, n, BROKEN) for f, n, _ in VARIANTS if n.startswith("layernorm_bwd_") and "reduce" not in n]


def workspace(cfg) -> dict:
    """Partials of the backward: [MAX_BLOCKS, 2*C] floats (C = n_embd)."""
    return {WORKSPACE: ((MAX_BLOCKS, 2 * int(cfg.n_embd)), "f32")}


def _aligned(*views) -> bool:
    return all(v is None or v.ptr % 16 == 0 for v in views)


def _nv(C: int, *views) -> int:
    """Register-path float4 count per lane, or 0 for the loop kernels."""
    if C % 4 == 0 and C <= 128 * MAX_NV and _aligned(*views):
        return cdiv(C, 128)
    return 0


def _bias(b) -> str:
    return "true" if b is not None else "false"


def layernorm_fwd(rt, out, mean, rstd, x, w, b):
    C = int(x.shape[-1])
    N = rows(x.shape)
    if out.numel != N * C or int(w.shape[-1]) != C or (b is not None and int(b.shape[-1]) != C):
        raise ValueError(f"layernorm_fwd: shapes out {out.shape}, x {x.shape}, w {w.shape}")
    nv = _nv(C, out, x, w, b)
    name = f"layernorm_fwd_reg<{nv}, {_bias(b)}>" if nv else f"layernorm_fwd_loop<{_bias(b)}>"
    fn = rt.function(FILE, name)
    rt.launch(fn, (cdiv(N, WARPS),), (THREADS,), [out, mean, rstd, x, w, b, i32(N), i32(C)],
              label="layernorm_fwd")


def layernorm_bwd(rt, dx, dw, db, dout, x, mean, rstd, w):
    C = int(x.shape[-1])
    N = rows(x.shape)
    if dx.numel != N * C or dout.numel != N * C or int(dw.shape[-1]) != C:
        raise ValueError(f"layernorm_bwd: shapes dx {dx.shape}, dout {dout.shape}, x {x.shape}, dw {dw.shape}")
    part = rt.workspace(WORKSPACE)
    nv = _nv(C, dx, dout, x, w, part)
    if nv:
        G = min(cdiv(N, WARPS), MAX_BLOCKS)
        name = f"layernorm_bwd_reg<{nv}, {_bias(db)}>"
    else:
        G = min(N, MAX_BLOCKS)
        name = f"layernorm_bwd_loop<{_bias(db)}>"
    if part.numel < G * 2 * C:
        raise ValueError(f"workspace {WORKSPACE} {part.shape} is too small for {G} blocks x 2*{C}")
    defines = BROKEN if "layernorm" in faults.broken else {}
    rt.launch(rt.function(FILE, name, defines), (G,), (THREADS,),
              [dx, part, dout, x, mean, rstd, w, i32(N), i32(C)], label="layernorm_bwd")
    ncols = 2 * C if db is not None else C
    rt.launch(rt.function(FILE, "layernorm_bwd_reduce"), (cdiv(ncols, 32),), (THREADS,),
              [dw, db, part, i32(G), i32(C)], label="layernorm_bwd_reduce")
