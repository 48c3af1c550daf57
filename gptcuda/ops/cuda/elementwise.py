"""Launchers of kernels/elementwise.cu: GELU, dropout, residual dropout and the bias gradient.

    gelu_fwd(rt, out, x)                        out = gelu_tanh(x)            (tests/tools)
    gelu_bwd(rt, dpre, dout, pre)               dpre = dout * gelu_tanh'(pre) (dpre may be dout)
    dropout_fwd(rt, out, x, p, site)            out = x * keep / (1-p)        (out may be x)
    dropout_bwd(rt, dx, dout, p, site)          dx = dout * keep / (1-p)      (dx may be dout)
    residual_dropout(rt, out, resid, x, p, site) out = resid + x * keep / (1-p) (out may alias)
    bias_grad(rt, db[N], dout[M,N])             db = dout.sum(0), deterministic, two passes
    sum_rows(rt, out[N], partials[c,N])         out = partials.sum(0) in row order (the second pass of
                                                the bias and layernorm weight gradients); while a
                                                backward defers them (defer_sums), held and launched
                                                together, up to SUM_ITEMS a launch, at flush_sums
    accumulate(rt, dst, src, first)             dst = src (first) or dst + src (gradient accumulation)

Element types (the views' dtypes pick the kernel: the *_TYPES tables below; another combination is
a ValueError): fp32, or every tensor bf16; residual_dropout also adds a bf16 branch into an fp32
residual stream; bias_grad sums a bf16 or fp32 dout into db, fp32 or (bf16 gradients) bf16, as sum_rows
writes its outputs from fp32 partials. Values are computed in fp32 and
rounded once where stored in bf16. An output may alias an input of its own element type only.

keep(e) is element e of the flat mask rng.dropout_mask draws from the stream
gc_key(rt.seed, state.step, site): half e & 1 of keep word e >> 1 compared with
threshold = min(floor(p * 2^16), 2^16 - 1) (rng.keep_threshold); p == 0 draws nothing. The bias gradient writes per-chunk column sums into the workspace
"bias_partials" [MAX_CHUNKS, width] and sums them in chunk order.

Deferred sums: a backward's point (a layer) ends with six or more such second passes (its two
layernorms' dw and db, its four biases), each a launch of a few microseconds of latency. Between
defer_sums(rt, True) and defer_sums(rt, False) the producers take their partials from the
workspace "sum_partials" (`partials`: a ring, one region per held sum) and sum_rows holds the
sum; flush_sums launches the held ones in batches of SUM_ITEMS (kernel sum_rows), then reuses the
ring. Each column is summed in the same order either way: the values are the same bit for bit.
"""
from __future__ import annotations

import itertools
import struct

from gptcuda.ops.backend import rows
from gptcuda.runtime import Blob, DeviceView, RuntimeProtocol, i32
from gptcuda.ops.cuda import (aligned4, cdiv, dropout_args, expression, fp32_only, kernel_types, optional_code,
                              planned, type_codes)

FILE = "elementwise.cu"
THREADS = 256             # the elementwise kernels' block (their last template argument)
BG_WARPS = 8              # bias_grad_partial's and sum_rows' warps a block (their WARPS)
MAX_CHUNKS = 256          # row chunks of the bias gradient (rows of the partials workspace)
MIN_CHUNK_ROWS = 32
WORKSPACE = "bias_partials"
SUM_ITEMS = 8             # sums a sum_rows launch takes (its ITEMS: SumBatch's arrays)
# The element types there are kernels for, one a tensor in the kernel's parameter order: fp32, every
# tensor bf16, and residual_dropout's bf16 branch added into an fp32 residual stream
GELU_TYPES = (("f32", "f32"), ("bf16", "bf16"))                              # (out, x)
GELU_BWD_TYPES = (("f32", "f32", "f32"), ("bf16", "bf16", "bf16"))           # (dpre, dout, pre)
DROPOUT_TYPES = (("f32", "f32"), ("bf16", "bf16"))                           # (out, x)
RESIDUAL_TYPES = (("f32", "f32", "f32"), ("bf16", "bf16", "bf16"), ("f32", "f32", "bf16"))  # (out, resid, x)
# (dst, src); the mixed pairs with first = True convert (the attention's fp32 copies of bf16 tensors)
ACCUMULATE_TYPES = (("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16"), ("bf16", "f32"))
BIAS_GRAD_TYPES = (("f32",), ("bf16",))                                      # (dout,); db fp32


def _name(base: str, *args) -> str:
    return expression(base, *args, sep=", ")


def ew_name(base: str, vec: int, *flags, types=None) -> str:
    """gelu_fwd <VEC, THREADS, TO, TX>, gelu_bwd <VEC, THREADS, TDP, TDO, TP>, accumulate <VEC, FIRST,
    THREADS, TD, TS>, dropout_apply <VEC, RESID, DROP, THREADS, TO, TR, TX> of the tensors' element types
    (dtypes in that order; fp32 unless given; dropout_apply without RESID: TR is TO's)."""
    n = {"gelu_fwd": 2, "gelu_bwd": 3, "accumulate": 2, "dropout_apply": 3}[base]
    return _name(base, vec, *flags, THREADS, *type_codes(types or ("f32",) * n))


def bias_grad_name(vec: int, dtype: str = "f32") -> str:
    """bias_grad_partial <VEC, WARPS, TD> of dout's element type."""
    return _name("bias_grad_partial", vec, BG_WARPS, *type_codes((dtype,)))


SUM_TYPES = ("f32", "bf16")     # sum_rows' outputs (the partials are fp32): fp32 or bf16 gradients


def sum_outputs(label: str, **views):
    """A ValueError of one line where a view given (None: none) is not a dtype sum_rows writes (SUM_TYPES):
    the parameters' gradients that come from row sums, fp32 or bf16."""
    for k, v in views.items():
        if v is not None and v.dtype not in SUM_TYPES:
            raise ValueError(f"{label}: {k} must be {' or '.join(SUM_TYPES)} (a gradient), got {v.dtype}")


def sum_rows_name(out: str = "f32") -> str:
    """sum_rows <WARPS, ITEMS[, TO]>: TO, the outputs' element type (fp32's is the default)."""
    return _name("sum_rows", BG_WARPS, SUM_ITEMS, *optional_code(out))


SUM_ROWS = sum_rows_name()

_TF = (True, False)
_VEC = (4, 1)
VARIANTS = (
    [(FILE, ew_name("gelu_fwd", v, types=t), {}) for t in GELU_TYPES for v in _VEC]
    + [(FILE, ew_name("gelu_bwd", v, types=t), {}) for t in GELU_BWD_TYPES for v in _VEC]
    + [(FILE, ew_name("dropout_apply", v, False, d, types=(t[0], t[0], t[1])), {})
       for t in DROPOUT_TYPES for v in _VEC for d in _TF]
    + [(FILE, ew_name("dropout_apply", v, True, d, types=t), {}) for t in RESIDUAL_TYPES for v in _VEC for d in _TF]
    + [(FILE, bias_grad_name(v, *t), {}) for t in BIAS_GRAD_TYPES for v in _VEC]
    + [(FILE, ew_name("accumulate", v, f, types=t), {}) for t in ACCUMULATE_TYPES for v in _VEC for f in _TF]
    + [(FILE, sum_rows_name(t), {}) for t in SUM_TYPES]
)
SUMS = "sum_partials"     # the deferred sums' partials: a ring of one backward point's (layernorm.workspace)
SUMS_ALIGN = 64           # floats: every region starts 256-byte aligned


def workspace(cfg, ex=None) -> dict:
    """Bias-gradient partials: [MAX_CHUNKS, 4C] floats, the widest bias (fc's; the head has none). (The
    deferred sums' ring SUMS is planned by layernorm.workspace, which knows both of its users' sizes.)"""
    return {WORKSPACE: ((MAX_CHUNKS, 4 * int(cfg.n_embd)), "f32")}


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


def gelu_fwd(rt: RuntimeProtocol, out, x):
    n = _check_same("gelu_fwd", out, x)
    types = kernel_types("gelu_fwd", GELU_TYPES, out=out, x=x)
    vec = 4 if aligned4(out, x) else 1
    grid, block = _ew_geometry(n, vec)
    rt.launch(rt.function(FILE, ew_name("gelu_fwd", vec, types=types)), grid, block, [out, x, i32(n)],
              label="gelu_fwd")


def gelu_bwd(rt: RuntimeProtocol, dpre, dout, pre):
    n = _check_same("gelu_bwd", dpre, dout, pre)
    types = kernel_types("gelu_bwd", GELU_BWD_TYPES, dpre=dpre, dout=dout, pre=pre)
    vec = 4 if aligned4(dpre, dout, pre) else 1
    grid, block = _ew_geometry(n, vec)
    rt.launch(rt.function(FILE, ew_name("gelu_bwd", vec, types=types)), grid, block, [dpre, dout, pre, i32(n)],
              label="gelu_bwd")


def _dropout(rt: RuntimeProtocol, out, resid, x, p, site, label):
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{label}: dropout probability must be in [0, 1), got {p}")
    views = (out, x) if resid is None else (out, resid, x)
    n = _check_same(label, *views)
    if resid is None:
        to, tx = kernel_types(label, DROPOUT_TYPES, out=out, x=x)
        types = (to, to, tx)
    else:
        types = kernel_types(label, RESIDUAL_TYPES, out=out, resid=resid, x=x)
    for name, v in (("resid", resid), ("x", x)):
        if v is not None and v.dtype != out.dtype and _overlap(out, v):
            raise ValueError(f"{label}: out ({out.dtype}) overlaps {name} ({v.dtype}): an output may alias an "
                             "input of its own element type only")
    if p == 0.0 and resid is None and out.ptr == x.ptr:
        return None                      # identity in place: nothing to do
    drop = p > 0.0
    vec = 4 if aligned4(*views) else 1
    name = ew_name("dropout_apply", vec, resid is not None, drop, types=types)
    grid, block = _ew_geometry(n, vec)
    return rt.launch(rt.function(FILE, name), grid, block,
                     [out, resid, x, i32(n)] + dropout_args(rt, p, site, label), label=label)


def dropout_fwd(rt: RuntimeProtocol, out, x, p, site):
    return _dropout(rt, out, None, x, p, site, "dropout_fwd")


def dropout_bwd(rt: RuntimeProtocol, dx, dout, p, site):
    return _dropout(rt, dx, None, dout, p, site, "dropout_bwd")


def residual_dropout(rt: RuntimeProtocol, out, resid, x, p, site):
    return _dropout(rt, out, resid, x, p, site, "residual_dropout")


def bias_grad(rt: RuntimeProtocol, db, dout):
    N = int(dout.shape[-1])
    M = rows(dout.shape)
    if db.numel != N:
        raise ValueError(f"bias_grad: db {db.shape} does not match dout {dout.shape}")
    sum_outputs("bias_grad", db=db)
    (dtype,) = kernel_types("bias_grad", BIAS_GRAD_TYPES, dout=dout)
    rpc = max(MIN_CHUNK_ROWS, cdiv(M, MAX_CHUNKS))
    chunks = cdiv(M, rpc)
    part = partials(rt, chunks, N, WORKSPACE)
    if part is None:
        raise ValueError(f"workspace {WORKSPACE} is too small for {chunks} chunks x {N} columns")
    vec = 4 if N % 4 == 0 and aligned4(dout) else 1
    rt.launch(rt.function(FILE, bias_grad_name(vec, dtype)), (cdiv(N, 32 * vec), chunks), (BG_WARPS * 32,),
              [part, dout, i32(M), i32(N), i32(rpc)], label="bias_grad_partial")
    sum_rows(rt, (db, part), label="bias_grad_reduce")


# ---- the second pass of the row sums, deferred while a backward asks for it ------------------------
class _Held:
    """The sums a backward holds: the ring (workspace SUMS), its next free float, and the
    (out, partials, rows, cols, ld) of each held sum."""

    def __init__(self, ring):
        self.ring, self.used, self.items = ring, 0, []


def defer_sums(rt: RuntimeProtocol, on: bool):
    """on: from here sum_rows holds the sums whose partials came from `partials` (the ring of the
    workspace SUMS; none planned: nothing is held); off: flush_sums, then sum at once again."""
    if not on:
        flush_sums(rt)
        rt.held_sums = None
        return
    ring = planned(rt, SUMS)
    rt.held_sums = _Held(ring) if ring is not None else None


def flush_sums(rt: RuntimeProtocol):
    """Launch the held sums (SUM_ITEMS a launch, in the order they were held) and free the ring."""
    held = getattr(rt, "held_sums", None)
    if held is None:
        return
    for i in range(0, len(held.items), SUM_ITEMS):
        _sum_launch(rt, held.items[i:i + SUM_ITEMS])
    held.items, held.used = [], 0


def partials(rt: RuntimeProtocol, rows_: int, cols: int, name: str):
    """A [rows_, cols] view for partial sums that sum_rows will add up: a region of the ring while
    sums are held (flushing the held ones first when the ring is full), else (or when it could
    never fit) the start of the workspace `name`; None where that is too small."""
    held, n = getattr(rt, "held_sums", None), rows_ * cols
    if held is not None and n <= held.ring.numel:
        if held.used + n > held.ring.numel:
            flush_sums(rt)
        v = DeviceView(held.ring.ptr + 4 * held.used, (rows_, cols), "f32", SUMS)
        held.used += cdiv(n, SUMS_ALIGN) * SUMS_ALIGN
        return v
    ws = rt.workspace(name)                     # KeyError: the runtime plans no such workspace
    return DeviceView(ws.ptr, (rows_, cols), "f32", name) if ws.numel >= n else None


def sum_rows(rt: RuntimeProtocol, *sums, label="sum_rows"):
    """Each sum (out, parts) or (out, parts, cols, ld): out [cols] = parts [rows, ld][:, :cols] summed
    over the rows in order (cols and ld default to parts' width). Held where parts lie in the ring
    of held sums; the others are launched now, together."""
    now = []
    held = getattr(rt, "held_sums", None)
    for s in sums:
        out, parts = s[0], s[1]
        nrows, width = (int(d) for d in parts.shape)
        cols = int(s[2]) if len(s) > 2 else width
        ld = int(s[3]) if len(s) > 3 else width
        fp32_only(label, partials=parts)
        sum_outputs(label, out=out)
        if out.numel != cols or cols > ld:
            raise ValueError(f"{label}: out {out.shape} does not match {cols} columns of partials {parts.shape}")
        item = (out, parts, nrows, cols, ld)
        if held is not None and held.ring.ptr <= parts.ptr < held.ring.ptr + held.ring.nbytes:
            held.items.append(item)
        else:
            now.append(item)
    for i in range(0, len(now), SUM_ITEMS):
        _sum_launch(rt, now[i:i + SUM_ITEMS], label)


def _sum_launch(rt: RuntimeProtocol, items, label="sum_rows"):
    """sum_rows launches over up to SUM_ITEMS (out, parts, rows, cols, ld): one, or one a run of items whose
    outputs share an element type."""
    for dtype, run in itertools.groupby(items, key=lambda it: it[0].dtype):
        data, grid = sum_batch(list(run))
        rt.launch(rt.function(FILE, sum_rows_name(dtype)), (grid,), (BG_WARPS * 32,), [Blob(data)], label=label)


def sum_batch(items) -> tuple:
    """(the SumBatch argument of sum_rows, the grid) for up to SUM_ITEMS (out, parts, rows, cols, ld):
    SUM_ITEMS each of out pointers, parts pointers, rows, cols and ld, then SUM_ITEMS + 1 first
    blocks (past the last item: the grid), all 64-bit."""
    n = len(items)
    if not 0 < n <= SUM_ITEMS:
        raise ValueError(f"sum_rows: {n} sums in one launch (1 .. {SUM_ITEMS})")
    first = [0]
    for it in items:
        first.append(first[-1] + cdiv(it[3], 32))
    grid = first[-1]
    pad = [0] * (SUM_ITEMS - n)
    cols = [[o.ptr for o, *_ in items], [p.ptr for _, p, *_ in items]] + [[it[k] for it in items] for k in (2, 3, 4)]
    words = [w for col in cols for w in col + pad] + first + [grid] * (SUM_ITEMS - n)
    return struct.pack(f"<{len(words)}q", *words), grid


def unpack_sum_batch(data: bytes) -> list:
    """The (out ptr, parts ptr, rows, cols, ld) of each sum in a SumBatch argument (sum_batch's inverse;
    for stand-ins of the runtime)."""
    w = struct.unpack(f"<{5 * SUM_ITEMS + SUM_ITEMS + 1}q", data)
    first = w[5 * SUM_ITEMS:]
    n = sum(1 for i in range(SUM_ITEMS) if first[i] < first[SUM_ITEMS])     # every sum has a block
    return [tuple(w[k * SUM_ITEMS + i] for k in range(5)) for i in range(n)]


def accumulate(rt: RuntimeProtocol, dst, src, first):
    n = _check_same("accumulate", dst, src)
    if _overlap(dst, src):
        raise ValueError("accumulate: dst and src overlap")
    types = kernel_types("accumulate", ACCUMULATE_TYPES, dst=dst, src=src)
    vec = 4 if aligned4(dst, src) else 1
    grid, block = _ew_geometry(n, vec)
    rt.launch(rt.function(FILE, ew_name("accumulate", vec, first, types=types)), grid, block,
              [dst, src, i32(n)], label="accumulate")


def _overlap(x, y) -> bool:
    return x.ptr < y.ptr + y.nbytes and y.ptr < x.ptr + x.nbytes
