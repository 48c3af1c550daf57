"""The GEMM launchers: validate the views, pick the plan (forced, the measured table, else the cost
model), re-lay an operand out where the plan needs it (B^T, or the swapped product's A^T) and launch
the family's kernel (and the split-K reduction)."""
from __future__ import annotations

from dataclasses import dataclass

from gptcuda.ops.backend import rows
from gptcuda.ops.cuda import cdiv, elementwise
from gptcuda.runtime import DeviceView, f32, i32, u64
from gptcuda.ops.cuda.gemm.families import (AUX_EPILOGUES, EPI_NONE, EPILOGUE_CODES, MAX_GRID_Z, PRODUCTS,
                                            REDUCE_THREADS, SIMT_FILE, TRANSPOSE_THREADS, TRANSPOSE_TILE, layout_code,
                                            reduce_name, transpose_name)
from gptcuda.ops.cuda.gemm.plan import WGMMA_WORKSPACES, Gemm, Plan, plan_unfit, split_room
from gptcuda.ops.cuda.gemm.plan import plan as model_plan     # `matmul(..., plan=)` shadows the name inside matmul
from gptcuda.ops.cuda.gemm.table import tuned_plan


def _check_f32(label, **views):
    for k, v in views.items():
        if v is not None and getattr(v, "dtype", "f32") != "f32":
            raise TypeError(f"{label}: {k} must be f32, got {v.dtype}")


def _check_dtypes(label, family, out, a, b, bias, aux):
    """The views' dtypes against the execution plan's base family: fp32 operands, C and aux for the fp32
    and TF32 families; bf16 operands for the bf16 family, C (and aux) bf16 or fp32; the bias fp32."""
    want = "bf16" if family == "bf16" else "f32"
    if a.dtype != want or b.dtype != want:
        raise TypeError(f"{label}: a {a.dtype} and b {b.dtype}, but the {family} products take {want} operands")
    _check_f32(label, bias=bias)
    if want == "f32":
        _check_f32(label, out=out, aux=aux)
    elif out.dtype not in ("f32", "bf16") or (aux is not None and aux.dtype != out.dtype):
        raise TypeError(f"{label}: out {out.dtype}{f' and aux {aux.dtype}' if aux is not None else ''}: bf16 "
                        f"products write f32 or bf16, aux of out's type")


def _vec_ok(a, b, lda, ldb, sA=0, sB=0):
    """16-byte loads of A and B: aligned bases, row and batch strides multiples of 16 bytes (split
    k_chunk is a multiple of the family's k_align, so split offsets keep the alignment)."""
    per = 16 // a.itemsize
    return a.ptr % 16 == 0 and b.ptr % 16 == 0 and all(int(x) % per == 0 for x in (lda, ldb, sA, sB))


def _workspace(rt, name):
    """(view, floats) of a planned workspace ((None, 0) when the memory plan has none)."""
    try:
        ws = rt.workspace(name)
    except KeyError:
        return None, 0
    return ws, ws.numel


@dataclass(frozen=True)
class GemmCall:
    """One product as a GEMM kernel computes it: out[z] ([M, N], leading dim ldc, batch stride sC) =
    alpha * op(a[z]) @ op(b[z]) (+ bias) (+ the epilogue of code epi with aux), a and b with leading
    dims lda / ldb and batch strides sA / sB, op() transposing where ta / tb; colsum (a family whose
    kernels sum A, epilogue none, batch 1): also colsum[z, m] = the sums of A's rows of split z, as
    stored [K, M] (a weight gradient's bias-gradient partials)."""
    out: DeviceView
    a: DeviceView
    b: DeviceView
    M: int
    N: int
    K: int
    lda: int
    ldb: int
    ldc: int
    ta: bool = False
    tb: bool = False
    epi: int = EPI_NONE
    bias: DeviceView | None = None
    aux: DeviceView | None = None
    alpha: float = 1.0
    batch: int = 1
    sA: int = 0
    sB: int = 0
    sC: int = 0
    colsum: DeviceView | None = None
    label: str = "gemm"


def _launch_gemm(rt, p: Plan, c: GemmCall, ws=None):
    """Launch one product by plan p: the family's kernel, and for split-K its partials into ws [splits,
    M, N] then the fixed-order reduction that applies the epilogue (a swaps kernel stores them
    transposed, [splits, N, M]: out's layout). rt: the device's SM count and its tensor maps."""
    fam, whole = p.fam, p.splits == 1
    has_bias = c.bias is not None
    fn = rt.function(fam.file, fam.kernel(p.tile, c.ta, c.tb, c.epi if whole else EPI_NONE, whole and has_bias,
                                          vec=_vec_ok(c.a, c.b, c.lda, c.ldb, c.sA, c.sB),
                                          out=c.out.dtype if whole else "f32", colsum=c.colsum is not None))
    operands = _operands(rt, p, c)
    if whole:
        rt.launch(fn, _grid(rt, p, c.M, c.N, c.batch), (p.threads,), _gemm_args(p, c, operands, 1, max(c.K, 1)),
                  smem=p.smem, label=c.label)
        return
    rM, rN = (c.N, c.M) if fam.swaps else (c.M, c.N)
    part = GemmCall(ws, c.a, c.b, c.M, c.N, c.K, c.lda, c.ldb, rN, c.ta, c.tb, sC=c.M * c.N, batch=p.splits,
                    colsum=c.colsum, label=c.label)
    rt.launch(fn, _grid(rt, p, c.M, c.N, p.splits), (p.threads,), _gemm_args(p, part, operands, p.splits, p.k_chunk),
              smem=p.smem, label=f"{c.label}:splitk{p.splits}")
    blocks = max(1, min(cdiv(c.M * c.N, REDUCE_THREADS), rt.info.sm_count * 8))
    args = (("out", c.out), ("aux", c.aux), ("partials", ws), ("bias", c.bias), ("M", i32(rM)), ("N", i32(rN)),
            ("ldc", i32(c.ldc)), ("splits", i32(p.splits)), ("alpha", f32(c.alpha)))
    rt.launch(rt.function(SIMT_FILE, reduce_name(c.epi, has_bias)), (blocks,), (REDUCE_THREADS,),
              [v for _, v in args], label=f"{c.label}:reduce")


def _operands(rt, p: Plan, c: GemmCall) -> tuple:
    """A and B as the kernel takes them: pointers, or TMA tensor maps. A K-major operand (A [M, K], B
    [N, K]) {K, rows, batch} with boxes {a k tile (128 bytes: 32 fp32, 64 bf16), BM or BN} in the 128-byte
    swizzle; an MN-major one (A [K, M]: ta, B [K, N]: not tb, read as stored) {rows, K, batch}, boxes
    {BM or BN, 32}, unswizzled, except A read through registers (a_regs): boxes {32, 32}, and a bf16
    operand's: boxes {64, 64}, in the 128-byte swizzle."""
    if not p.fam.tma(p.tile):
        return c.a, c.b
    out = []
    for x, rows_, ld, stride, box, mn in ((c.a, c.M, c.lda, c.sA, p.tile[0], c.ta),
                                          (c.b, c.N, c.ldb, c.sB, p.tile[1], not c.tb)):
        e = x.itemsize
        inner, outer = (rows_, c.K) if mn else (c.K, rows_)
        regs = mn and p.fam.a_regs and x is c.a
        out.append(rt.tensor_map(x, (inner, outer, c.batch), (e * ld, e * max(stride, outer * ld)),
                                 (32, 32, 1) if regs else (64, 64, 1) if mn and e == 2 else (box, 32, 1) if mn
                                 else (128 // e, box, 1), swizzle=regs or not mn or e == 2))
    return tuple(out)


def _grid(rt, p: Plan, M, N, zs):
    """Output tiles (n, m, z = batch * splits); a persistent kernel gets at most blocks_per_sm x SMs
    blocks, each walking tiles blockIdx.x, + gridDim.x, ... (kernels/gemm_wgmma.cu gemm_wgmma_ws)."""
    tiles = (cdiv(N, p.tile[1]), cdiv(M, p.tile[0]), zs)
    if p.fam.persistent(p.tile):
        return (max(1, min(tiles[0] * tiles[1] * zs, rt.info.sm_count * p.blocks_per_sm)), 1, 1)
    return tiles


def _gemm_args(p: Plan, c: GemmCall, operands, splits, k_chunk) -> list:
    """The argument block of a GEMM kernel (a TMA kernel takes tensor maps and no A/B strides; a
    persistent one the z extent of its tiles and the column sums' partials, or null, last)."""
    a, b = operands
    head = (("C", c.out), ("aux", c.aux), ("A", a), ("B", b), ("bias", c.bias), ("M", i32(c.M)), ("N", i32(c.N)),
            ("K", i32(c.K)))
    tail = (("alpha", f32(c.alpha)), ("splits", i32(splits)), ("k_chunk", i32(k_chunk)))
    if p.fam.tma(p.tile):
        zs = (("zs", i32(c.batch)), ("colsum", c.colsum)) if p.fam.persistent(p.tile) else ()
        args = head + (("ldc", i32(c.ldc)), ("sC", u64(c.sC))) + tail + zs
    else:
        args = head + (("lda", i32(c.lda)), ("ldb", i32(c.ldb)), ("ldc", i32(c.ldc)), ("sA", u64(c.sA)),
                       ("sB", u64(c.sB)), ("sC", u64(c.sC))) + tail
    return [v for _, v in args]


def _plan(rt, g: Gemm, forced, ex, out_dtype) -> tuple:
    """(plan, split-K workspace view) of product g under execution plan ex: `forced` (benchmarks,
    bench/tune.py), else the measured table's, else the cost model's; refused with its reason where it
    cannot run (`plan_unfit`)."""
    ws, cap = _workspace(rt, "gemm_splitk")
    cap = split_room(out_dtype, cap) if g.batch == 1 else 0
    scratch = {name: _workspace(rt, name)[1] for name in WGMMA_WORKSPACES}
    p = forced or tuned_plan(rt, g, ex, cap, scratch, out_dtype) or \
        model_plan(g, ex.gemm_family, ex.wgmma_mode, rt.info.sm_count, cap, scratch)
    why = plan_unfit(p, g, ex.gemm_family, ex.wgmma_mode, cap, scratch, out_dtype)
    if why:
        raise ValueError(f"{g.label}: {why}")
    return p, ws


def matmul_dims(out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None):
    """Validate a matmul's views; returns (M, N, K, lda, ldb)."""
    if epilogue not in EPILOGUE_CODES:
        raise ValueError(f"matmul: epilogue {epilogue!r} is not one of {tuple(EPILOGUE_CODES)}")
    if len(out.shape) < 2 or len(a.shape) < 2 or len(b.shape) < 2:
        raise ValueError(f"matmul: out {out.shape}, a {a.shape}, b {b.shape} must have >= 2 dims")
    M, N = rows(out.shape), int(out.shape[-1])
    am, K = (int(a.shape[-1]), rows(a.shape)) if trans_a else (rows(a.shape), int(a.shape[-1]))
    if am != M:
        raise ValueError(f"matmul: a is stored [K, M] (trans_a) with shape {a.shape}, its last dim must be M={M} "
                         f"(rows of out {out.shape})" if trans_a else
                         f"matmul: a {a.shape} has {am} rows, out {out.shape} has {M}")
    bn, bk = (rows(b.shape), int(b.shape[-1])) if trans_b else (int(b.shape[-1]), rows(b.shape))
    if bk != K or bn != N:
        raise ValueError(f"matmul: b {b.shape} (trans_b={trans_b}) is [K={bk}, N={bn}] but "
                         f"op(a) has K={K} and out has N={N}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"matmul: bias {bias.shape} must be ({N},)")
    if epilogue in AUX_EPILOGUES:
        if aux is None:
            raise ValueError(f"matmul: epilogue {epilogue!r} needs aux")
        if aux.numel != M * N or int(aux.shape[-1]) != N:
            raise ValueError(f"matmul: aux {aux.shape} must hold [M={M}, N={N}] like out {out.shape}")
    elif aux is not None:
        raise ValueError(f"matmul: aux is only used by the {AUX_EPILOGUES} epilogues")
    if epilogue == "dgelu":
        if bias is not None:
            raise ValueError("matmul: the 'dgelu' epilogue takes no bias")
        if out.ptr < aux.ptr + aux.nbytes and aux.ptr < out.ptr + out.nbytes:
            raise ValueError("matmul: 'dgelu' reads aux while writing out: they must not overlap")
    return M, N, K, M if trans_a else K, K if trans_b else N


def matmul(rt, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None, plan=None, ex=None,
           a_colsum=None):
    """out[M, N] = op(a) @ op(b) (+ bias), then the epilogue (see the package docstring). ex: the
    execution plan whose choices apply (the backend passes its own; default rt's). `plan` forces a
    plan (benchmarks, bench/tune.py); otherwise the measured table, else the cost model.
    a_colsum [M] (trans_a only): also a_colsum = a.sum(0) of a as stored [K, M], the bias gradient of
    a weight gradient; a swapped product (wgmma_ra_t) takes the partial sums from its A^T transpose, a
    plan whose kernels read A as stored and sum it (Family.colsum: wgmma_ra, wgmma_ra_mn, wgmma3_ra)
    from their consumers, else elementwise.bias_grad reads a once more."""
    M, N, K, lda, ldb = matmul_dims(out, a, b, trans_a, trans_b, bias, epilogue, aux)
    if a_colsum is not None and (not trans_a or a_colsum.numel != M):
        raise ValueError(f"matmul: a_colsum needs trans_a and {M} elements, got {a_colsum.shape} (trans_a {trans_a})")
    ex = rt.exec if ex is None else ex
    _check_dtypes("matmul", ex.gemm_family, out, a, b, bias, aux)
    g = Gemm(M, N, K, trans_a, trans_b, epilogue, bias is not None, colsum=a_colsum is not None,
             vec=_vec_ok(a, b, lda, ldb), label=f"matmul[{M}x{N}x{K}]")
    p, ws = _plan(rt, g, plan, ex, out.dtype)
    if p.fam.swaps:
        part = _matmul_swapped(rt, p, out, a, b, g, a_colsum, ws)
    else:
        if p.transpose_b:
            b, trans_b, ldb = _transposed(rt, p.fam.scratch, b, K, N, g.label, "B^T"), True, K
        # a kernel that sums A as it reads it gives the bias gradient's partials, one row per split
        part = _partials(rt, p.splits, M) if a_colsum is not None and p.fam.colsum and g.epi == EPI_NONE else None
        _launch_gemm(rt, p, GemmCall(out, a, b, M, N, K, lda, ldb, N, trans_a, trans_b, g.epi, bias, aux, sC=M * N,
                                     colsum=part, label=g.label), ws)
    if part is not None:
        elementwise.sum_rows(rt, (a_colsum, part), label="bias_grad_reduce")
    elif a_colsum is not None:
        elementwise.bias_grad(rt, a_colsum, a)


def _transposed(rt, name, x, K, N, label, what, colsum=None):
    """x [K, N] (dense) transposed into the workspace `name` as [N, K] (its room checked by plan_unfit);
    colsum: also colsum[i, :] = the column sums of x's rows 64 i .. 64 i + 63."""
    out = DeviceView(rt.workspace(name).ptr, (N, K), "f32", name)
    vec = K % 4 == 0 and N % 4 == 0 and x.ptr % 16 == 0 and out.ptr % 16 == 0
    rt.launch(rt.function(SIMT_FILE, transpose_name(vec, colsum is not None)),
              (cdiv(N, TRANSPOSE_TILE), cdiv(K, TRANSPOSE_TILE)), (TRANSPOSE_THREADS,),
              [out, x, i32(K), i32(N), colsum, i32(0)], label=f"{label}:{what}")
    return out


def _partials(rt, chunks, M):
    """A [chunks, M] view for the bias gradient's partials (elementwise.partials: a region of the held
    sums' ring, or the workspace "bias_partials"), or None where they do not fit."""
    if chunks > elementwise.MAX_CHUNKS:
        return None
    return elementwise.partials(rt, chunks, M, elementwise.WORKSPACE)


def _matmul_swapped(rt, p: Plan, out, a, b, g: Gemm, a_colsum, ws):
    """A swaps plan (wgmma_ra_t) of out [M, N] = a^T b, a [K, M] and b [K, N] as stored, run as the
    product P = out^T = b^T a: a transposed into its scratch as [M, K], b read as stored through
    registers, P stored transposed into out (split-K: its partials in out's layout, the usual
    reduction). The weight gradient whose input b is the larger operand (dW fcproj = dY^T act)
    transposes dY instead of act. a_colsum: the transpose writes a's column sums, a row per 64-row
    tile of a, into the partials it returns (None where they do not fit: bias_grad then)."""
    M, N, K = g.M, g.N, g.K
    part = None if a_colsum is None else _partials(rt, cdiv(K, TRANSPOSE_TILE), M)
    at = _transposed(rt, p.fam.scratch, a, K, M, g.label, "A^T", colsum=part)
    _launch_gemm(rt, p, GemmCall(out, b, at, N, M, K, N, K, N, True, True, sC=M * N, label=g.label), ws)
    return part


def matmul_batched_dims(out, a, b, trans_a=False, trans_b=False):
    """Validate a batched matmul's views; returns (batch, M, N, K, lda, ldb)."""
    _check_f32("matmul_batched", out=out, a=a, b=b)
    for nm, v in (("out", out), ("a", a), ("b", b)):
        if len(v.shape) < 3:
            raise ValueError(f"matmul_batched: {nm} {v.shape} must have >= 3 dims")
    M, N = int(out.shape[-2]), int(out.shape[-1])
    batch = rows(out.shape[:-1])
    am, K = (int(a.shape[-1]), int(a.shape[-2])) if trans_a else (int(a.shape[-2]), int(a.shape[-1]))
    bn, bk = (int(b.shape[-2]), int(b.shape[-1])) if trans_b else (int(b.shape[-1]), int(b.shape[-2]))
    if am != M or bk != K or bn != N:
        raise ValueError(f"matmul_batched: out {out.shape}, a {a.shape} (trans_a={trans_a}), "
                         f"b {b.shape} (trans_b={trans_b}) do not make [M, K] @ [K, N]")
    if rows(a.shape[:-1]) != batch or rows(b.shape[:-1]) != batch:
        raise ValueError(f"matmul_batched: batch sizes differ: out {out.shape[:-2]}, "
                         f"a {a.shape[:-2]}, b {b.shape[:-2]}")
    if batch > MAX_GRID_Z:
        raise ValueError(f"matmul_batched: batch {batch} exceeds {MAX_GRID_Z}")
    if (trans_a, trans_b) not in PRODUCTS:
        raise ValueError(f"matmul_batched: {layout_code(trans_a, trans_b)} is not a layout the kernels are built for "
                         f"(NT, NN, TN)")
    return batch, M, N, K, M if trans_a else K, K if trans_b else N


def matmul_batched(rt, out, a, b, trans_a=False, trans_b=False, alpha=1.0, plan=None, ex=None):
    """out[..., M, N] = alpha * op(a[...]) @ op(b[...]); leading dims flatten into the batch (ex: as
    in matmul)."""
    batch, M, N, K, lda, ldb = matmul_batched_dims(out, a, b, trans_a, trans_b)
    g = Gemm(M, N, K, trans_a, trans_b, batch=batch, vec=_vec_ok(a, b, lda, ldb, M * K, K * N),
             label=f"matmul_batched[{batch}x{M}x{N}x{K}]")
    p, _ = _plan(rt, g, plan, rt.exec if ex is None else ex, "f32")
    _launch_gemm(rt, p, GemmCall(out, a, b, M, N, K, lda, ldb, N, trans_a, trans_b, alpha=float(alpha), batch=batch,
                                 sA=M * K, sB=K * N, sC=M * N, label=g.label))
