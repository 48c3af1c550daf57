"""Launchers of kernels/elementwise.cu: GELU, dropout, residual dropout and the bias gradient.

    gelu_fwd(rt, out, x)                        out = gelu_tanh(x)            (tests/tools)
    gelu_bwd(rt, dpre, dout, pre)               dpre = dout * gelu_tanh'(pre) (dpre may be dout)
    dropout_fwd(rt, out, x, p, site)            out = x * keep / (1-p)        (out may be x)
    dropout_bwd(rt, dx, dout, p, site)          dx = dout * keep / (1-p)      (dx may be dout)
    residual_dropout(rt, out, resid, x, p, site) out = resid + x * keep / (1-p) (out may alias)
    bias_grad(rt, db[N], dout[M,N])             db = dout.sum(0), deterministic, two passes
    bias_grad_reduce(rt, db[N], partials[c,N])  db = partials.sum(0) in chunk order (the second pass)
    accumulate(rt, dst, src, first)             dst = src (first) or dst + src (gradient accumulation)

keep(e) is element e of the flat mask rng.dropout_mask draws from the stream
gc_key(rt.seed, state.step, site): half e & 1 of keep word e >> 1 compared with
threshold = min(floor(p * 2^16), 2^16 - 1) (rng.keep_threshold); p == 0 draws nothing. The bias gradient writes per-chunk column sums into the workspace
"bias_partials" [MAX_CHUNKS, width] and sums them in chunk order.
"""
from __future__ import annotations

from gptcuda.ops.backend import rows
from gptcuda.runtime import DeviceView, i32
from gptcuda.ops.cuda import cdiv, dropout_args

FILE = "elementwise.cu"
THREADS = 256
BG_WARPS = 8
MAX_CHUNKS = 256          # row chunks of the bias gradient (rows of the partials workspace)
MIN_CHUNK_ROWS = 32
WORKSPACE = "bias_partials"

_B = ("true", "false")
VARIANTS = (
    [(FILE, f"gelu_fwd<{v}>", {}) for v in (4, 1)]
    + [(FILE, f"gelu_bwd<{v}>", {}) for v in (4, 1)]
    + [(FILE, f"dropout_apply<{v}, {r}, {d}>", {}) for v in (4, 1) for r in _B for d in _B]
    + [(FILE, f"bias_grad_partial<{v}>", {}) for v in (4, 1)]
    + [(FILE, f"accumulate<{v}, {f}>", {}) for v in (4, 1) for f in _B]
    + [(FILE, "bias_grad_reduce", {})]
)


def workspace(cfg) -> dict:
    """Bias-gradient partials: [MAX_CHUNKS, max(4C, 3C, V)] floats."""
    C = int(cfg.n_embd)
    width = max(4 * C, 3 * C, C, int(getattr(cfg, "vocab_size", 0) or 0))
    return {WORKSPACE: ((MAX_CHUNKS, width), "f32")}


def _aligned(*views) -> bool:
    return all(v is None or v.ptr % 16 == 0 for v in views)


def _ew_geometry(n: int, vec: int):
    threads = n // 4 + n % 4 if vec == 4 else n
    return (cdiv(threads, THREADS),), (THREADS,)


def _check_same(label, *views):
    n = views[0].numel
    for v in views[1:]:
        if v.numel != n:
            raise ValueError(f"{label}: sizes differ: {[tuple(u.shape) for u in views]}")
    if n >= 2 ** 31:
        raise ValueError(f"{label}: {n} elements exceed the int32 element index")
    return n


def gelu_fwd(rt, out, x):
    n = _check_same("gelu_fwd", out, x)
    vec = 4 if _aligned(out, x) else 1
    grid, block = _ew_geometry(n, vec)
    rt.launch(rt.function(FILE, f"gelu_fwd<{vec}>"), grid, block, [out, x, i32(n)], label="gelu_fwd")


def gelu_bwd(rt, dpre, dout, pre):
    n = _check_same("gelu_bwd", dpre, dout, pre)
    vec = 4 if _aligned(dpre, dout, pre) else 1
    grid, block = _ew_geometry(n, vec)
    rt.launch(rt.function(FILE, f"gelu_bwd<{vec}>"), grid, block, [dpre, dout, pre, i32(n)], label="gelu_bwd")


def _dropout(rt, out, resid, x, p, site, label):
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{label}: dropout probability must be in [0, 1), got {p}")
    views = (out, x) if resid is None else (out, resid, x)
    n = _check_same(label, *views)
    if p == 0.0 and resid is None and out.ptr == x.ptr:
        return None                      # identity in place: nothing to do
    drop = p > 0.0
    vec = 4 if _aligned(*views) else 1
    name = f"dropout_apply<{vec}, {'true' if resid is not None else 'false'}, {'true' if drop else 'false'}>"
    grid, block = _ew_geometry(n, vec)
    return rt.launch(rt.function(FILE, name), grid, block,
                     [out, resid, x, i32(n)] + dropout_args(rt, p, site, label), label=label)


def dropout_fwd(rt, out, x, p, site):
    return _dropout(rt, out, None, x, p, site, "dropout_fwd")


def dropout_bwd(rt, dx, dout, p, site):
    return _dropout(rt, dx, None, dout, p, site, "dropout_bwd")


def residual_dropout(rt, out, resid, x, p, site):
    return _dropout(rt, out, resid, x, p, site, "residual_dropout")


def bias_grad(rt, db, dout):
    N = int(dout.shape[-1])
    M = rows(dout.shape)
    if db.numel != N:
        raise ValueError(f"bias_grad: db {db.shape} does not match dout {dout.shape}")
    part = rt.workspace(WORKSPACE)
    rpc = max(MIN_CHUNK_ROWS, cdiv(M, MAX_CHUNKS))
    chunks = cdiv(M, rpc)
    if part.numel < chunks * N:
        raise ValueError(f"workspace {WORKSPACE} {part.shape} is too small for {chunks} chunks x {N} columns")
    vec = 4 if N % 4 == 0 and _aligned(dout) else 1
    rt.launch(rt.function(FILE, f"bias_grad_partial<{vec}>"), (cdiv(N, 32 * vec), chunks), (BG_WARPS * 32,),
              [part, dout, i32(M), i32(N), i32(rpc)], label="bias_grad_partial")
    bias_grad_reduce(rt, db, DeviceView(part.ptr, (chunks, N), "f32", WORKSPACE))


def bias_grad_reduce(rt, db, partials):
    """db [N] = partials [chunks, N] summed over the chunks in order (the bias gradient's second pass;
    the GEMM launcher's A^T transposes write such partials too)."""
    chunks, N = (int(d) for d in partials.shape)
    if db.numel != N:
        raise ValueError(f"bias_grad_reduce: db {db.shape} does not match partials {partials.shape}")
    rt.launch(rt.function(FILE, "bias_grad_reduce"), (cdiv(N, 32),), (BG_WARPS * 32,),
              [db, partials, i32(chunks), i32(N)], label="bias_grad_reduce")


def accumulate(rt, dst, src, first):
    n = _check_same("accumulate", dst, src)
    if _overlap(dst, src):
        raise ValueError("accumulate: dst and src overlap")
    vec = 4 if _aligned(dst, src) else 1
    grid, block = _ew_geometry(n, vec)
    rt.launch(rt.function(FILE, f"accumulate<{vec}, {'true' if first else 'false'}>"), grid, block,
              [dst, src, i32(n)], label="accumulate")


def _overlap(x, y) -> bool:
    return x.ptr < y.ptr + y.nbytes and y.ptr < x.ptr + x.nbytes
