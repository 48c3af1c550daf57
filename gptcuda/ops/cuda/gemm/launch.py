"""The GEMM launchers: validate the views, pick the plan (forced, the measured table, else the
cost model), re-lay an operand out where the plan needs it (B^T, or the swapped product's A^T) and
launch the family's kernel (and the split-K reduction)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from gptcuda.ops.backend import rows
from gptcuda.ops.cuda import elementwise
from gptcuda.runtime import DeviceView, f32, i32, u64
from gptcuda.ops.cuda.gemm.families import (AUX_EPILOGUES, EPI_BIAS, EPI_NONE, EPILOGUE_CODES, FAMILIES, MAX_GRID_Z,
                                            PRODUCTS, REDUCE_THREADS, SIMT_FILE, TRANSPOSE_THREADS, TRANSPOSE_TILE,
                                            cdiv, layout_code, reduce_name, transpose_name)
from gptcuda.ops.cuda.gemm.layout import rt_scratch, wgmma_ok, ws_capacity
from gptcuda.ops.cuda.gemm.plan import Plan, check_plan, has_colsum_kernel, split_room
from gptcuda.ops.cuda.gemm.plan import plan as model_plan     # `matmul(..., plan=)` shadows the name inside matmul
from gptcuda.ops.cuda.gemm.table import tune_key, tuned_plan


# (trans_a, trans_b, EPI, HAS_BIAS) each family's kernels are compiled for (Family.combos)
COMBOS = {name: frozenset(fam.combos()) for name, fam in FAMILIES.items()}


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


def _vec_ok(a, b, lda, ldb, sA, sB):
    """16-byte loads of A and B: aligned bases, row and batch strides multiples of 16 bytes (split
    k_chunk is a multiple of the family's k_align, so split offsets keep the alignment)."""
    per = 16 // a.itemsize
    return a.ptr % 16 == 0 and b.ptr % 16 == 0 and all(int(x) % per == 0 for x in (lda, ldb, sA, sB))



@dataclass(frozen=True)
class GemmCall:
    """One product as a GEMM kernel computes it: out[z] ([M, N], leading dim ldc, batch stride sC) =
    alpha * op(a[z]) @ op(b[z]) (+ bias) (+ the epilogue of code epi with aux), a and b with leading
    dims lda / ldb and batch strides sA / sB, op() transposing where ta / tb; colsum (a family with a
    colsum_kernel, epilogue none, batch 1): also colsum[z, m] = the sums of A's rows of split z, as
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

    @property
    def has_bias(self) -> bool:
        return self.bias is not None


def _launch_gemm(rt, p: Plan, c: GemmCall, ws=None):
    """Launch one product by plan p: the family's kernel, and for split-K its partials into ws [splits,
    M, N] then the fixed-order reduction that applies the epilogue (a swaps kernel stores them
    transposed, [splits, N, M]: out's layout). rt: the device's SM count and its tensor maps."""
    fam = p.fam
    if c.colsum is not None and (not has_colsum_kernel(p, c.ta, c.tb) or c.epi != EPI_NONE or c.batch != 1):
        raise AssertionError(f"{c.label}: column sums need the {p.family} colsum kernel, no epilogue, batch 1")
    vec = _vec_ok(c.a, c.b, c.lda, c.ldb, c.sA, c.sB) and (p.splits == 1 or p.k_chunk % (16 // c.a.itemsize) == 0)
    if fam.name != fam.base:     # a warpgroup-MMA kernel: the layouts it reads, aligned
        if (c.ta, c.tb) not in {fam.kernel_layout(code) for code in fam.layouts} or not vec:
            raise AssertionError(f"{c.label}: the {p.family} kernel needs {fam.needs}")
    elif not vec and p.tile not in fam.unaligned_tiles:
        raise AssertionError(f"{c.label}: {p.family.upper()} tile {p.tile} has no unaligned variant")

    def launch(file, kernel, grid, threads, args, smem=0, label=""):    # args: ((name, value), ...) in order
        rt.launch(rt.function(file, kernel), grid, (threads,), [v for _, v in args], smem=smem, label=label)

    kernel = fam.colsum_kernel(p.tile, c.ta, c.tb) if c.colsum is not None else \
        fam.variant(p.tile, c.ta, c.tb, EPI_NONE if p.splits > 1 else c.epi, p.splits == 1 and c.has_bias, vec,
                    "f32" if p.splits > 1 else c.out.dtype)
    operands = _operands(rt, p, c)
    if p.splits == 1:
        launch(fam.file, kernel, _grid(rt, p, c.M, c.N, c.batch), p.threads,
               _gemm_args(p, c, operands, 1, max(c.K, 1)), p.smem, c.label)
        return
    rM, rN = (c.N, c.M) if fam.swaps else (c.M, c.N)
    part = GemmCall(ws, c.a, c.b, c.M, c.N, c.K, c.lda, c.ldb, rN, c.ta, c.tb, sC=c.M * c.N, batch=p.splits,
                    colsum=c.colsum, label=c.label)
    launch(fam.file, kernel, _grid(rt, p, c.M, c.N, p.splits), p.threads,
           _gemm_args(p, part, operands, p.splits, p.k_chunk), p.smem, f"{c.label}:splitk{p.splits}")
    blocks = max(1, min(cdiv(c.M * c.N, REDUCE_THREADS), rt.info.sm_count * 8))
    launch(SIMT_FILE, reduce_name(c.epi, c.has_bias), (blocks,), REDUCE_THREADS,
           (("out", c.out), ("aux", c.aux), ("partials", ws), ("bias", c.bias), ("M", i32(rM)), ("N", i32(rN)),
            ("ldc", i32(c.ldc)), ("splits", i32(p.splits)), ("alpha", f32(c.alpha))), label=f"{c.label}:reduce")


def _operands(rt, p: Plan, c: GemmCall) -> tuple:
    """A and B as the kernel takes them: pointers, or TMA tensor maps. A K-major operand (A [M, K], B
    [N, K]) {K, rows, batch} with boxes {a k tile (128 bytes: 32 fp32, 64 bf16), BM or BN} in the 128-byte
    swizzle; an MN-major one (A [K, M]: ta, B [K, N]: not tb, read as stored) {rows, K, batch}, boxes
    {BM or BN, 32}, unswizzled, except A read through registers (a_regs): boxes {32, 32}, and a bf16
    operand's: boxes {64, 64}, in the 128-byte swizzle."""
    fam = p.fam
    if not fam.tma(p.tile):
        return c.a, c.b
    out = []
    for x, rows_, ld, stride, box, mn in ((c.a, c.M, c.lda, c.sA, p.bm, c.ta), (c.b, c.N, c.ldb, c.sB, p.bn, not c.tb)):
        e = x.itemsize
        kt = 128 // e
        inner, outer = (rows_, c.K) if mn else (c.K, rows_)
        regs = mn and fam.a_regs and x is c.a
        swizzled = regs or not mn or e == 2
        out.append(rt.tensor_map(x, (inner, outer, c.batch), (e * ld, e * max(stride, outer * ld)),
                                 (32, 32, 1) if regs else (64, 64, 1) if mn and e == 2 else (box, 32, 1) if mn
                                 else (kt, box, 1), swizzle=swizzled))
    return tuple(out)


def _grid(rt, p: Plan, M, N, zs):
    """Output tiles (n, m, z = batch * splits); a persistent kernel gets at most blocks_per_sm x SMs
    blocks, each walking tiles blockIdx.x, + gridDim.x, ... (kernels/gemm_wgmma.cu gemm_wgmma_ws)."""
    if p.fam.persistent(p.tile):
        return (max(1, min(cdiv(N, p.bn) * cdiv(M, p.bm) * zs, rt.info.sm_count * p.blocks_per_sm)), 1, 1)
    return (cdiv(N, p.bn), cdiv(M, p.bm), zs)


def _gemm_args(p: Plan, c: GemmCall, operands, splits, k_chunk) -> tuple:
    """The argument block of a GEMM kernel (a TMA kernel takes tensor maps and no A/B strides; a
    persistent one the z extent of its tiles and the column sums' partials, or null, last)."""
    a, b = operands
    head = (("C", c.out), ("aux", c.aux), ("A", a), ("B", b), ("bias", c.bias), ("M", i32(c.M)), ("N", i32(c.N)),
            ("K", i32(c.K)))
    tail = (("alpha", f32(c.alpha)), ("splits", i32(splits)), ("k_chunk", i32(k_chunk)))
    if p.fam.tma(p.tile):
        zs = (("zs", i32(c.batch)), ("colsum", c.colsum)) if p.fam.persistent(p.tile) else ()
        return head + (("ldc", i32(c.ldc)), ("sC", u64(c.sC))) + tail + zs
    return head + (("lda", i32(c.lda)), ("ldb", i32(c.ldb)), ("ldc", i32(c.ldc)), ("sA", u64(c.sA)),
                   ("sB", u64(c.sB)), ("sC", u64(c.sC))) + tail


def matmul_dims(out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None):
    """Validate a matmul's views; returns (M, N, K, lda, ldb, epi code, has_bias)."""
    if epilogue not in EPILOGUE_CODES:
        raise ValueError(f"matmul: epilogue {epilogue!r} is not one of {tuple(EPILOGUE_CODES)}")
    if len(out.shape) < 2 or len(a.shape) < 2 or len(b.shape) < 2:
        raise ValueError(f"matmul: out {out.shape}, a {a.shape}, b {b.shape} must have >= 2 dims")
    M, N = rows(out.shape), int(out.shape[-1])
    if trans_a:
        K, am = rows(a.shape), int(a.shape[-1])
        if am != M:
            raise ValueError(f"matmul: a is stored [K, M] (trans_a) with shape {a.shape}, "
                             f"its last dim must be M={M} (rows of out {out.shape})")
    else:
        am, K = rows(a.shape), int(a.shape[-1])
        if am != M:
            raise ValueError(f"matmul: a {a.shape} has {am} rows, out {out.shape} has {M}")
    if trans_b:
        bn, bk = rows(b.shape), int(b.shape[-1])
    else:
        bk, bn = rows(b.shape), int(b.shape[-1])
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
        if _overlap(out, aux):
            raise ValueError("matmul: 'dgelu' reads aux while writing out: they must not overlap")
    has_bias = bias is not None
    epi = EPI_BIAS if (epilogue == "none" and has_bias) else EPILOGUE_CODES[epilogue]
    lda = M if trans_a else K
    ldb = N if not trans_b else K
    return M, N, K, lda, ldb, epi, has_bias


def _overlap(x, y):
    ptr_x, ptr_y = int(getattr(x, "ptr", 0)), int(getattr(y, "ptr", 0))
    return ptr_x < ptr_y + y.nbytes and ptr_y < ptr_x + x.nbytes


def matmul(rt, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None, plan=None, ex=None,
           a_colsum=None):
    """out[M, N] = op(a) @ op(b) (+ bias), then the epilogue (see the package docstring). ex: the
    execution plan whose choices apply (the backend passes its own; default rt's). `plan` forces a
    plan (benchmarks, bench/tune.py); otherwise the measured table, else the cost model.
    a_colsum [M] (trans_a only): also a_colsum = a.sum(0) of a as stored [K, M], the bias gradient of
    a weight gradient; a swapped product (wgmma_ra_t) takes the partial sums from its A^T transpose, a
    plan whose kernel reads A as stored (wgmma_ra, wgmma_ra_mn, wgmma3_ra: has_colsum_kernel) from
    that kernel's consumers, else elementwise.bias_grad reads a once more."""
    M, N, K, lda, ldb, epi, has_bias = matmul_dims(out, a, b, trans_a, trans_b, bias, epilogue, aux)
    if a_colsum is not None and (not trans_a or a_colsum.numel != M):
        raise ValueError(f"matmul: a_colsum needs trans_a and {M} elements, got {a_colsum.shape} (trans_a {trans_a})")
    ex = rt.exec if ex is None else ex
    family = ex.gemm_family
    _check_dtypes("matmul", family, out, a, b, bias, aux)
    ws, cap = ws_capacity(rt)
    cap = split_room(out.dtype, cap)
    vec = _vec_ok(a, b, lda, ldb, 0, 0)
    wg = wgmma_ok(rt, trans_a, trans_b, vec, K, 1, ex=ex)
    label = f"matmul[{M}x{N}x{K}]"
    p = plan
    if p is not None:
        check_plan(label, p, family, vec, 1, cap, M, N, K, wg, epi)
    else:
        key = tune_key(ex.table_tag, trans_a, trans_b, epilogue, has_bias, M, N, K, 1, a_colsum is not None)
        p = tuned_plan(rt, key, vec, cap, M, N, wg, ex=ex)
    if p is None:
        p = model_plan(M, N, K, 1, rt.info.sm_count, family, max_ws=cap, vec=vec, epi=epi, wgmma=wg,
                       colsum=a_colsum is not None, scratch=rt_scratch(rt))
    if p.fam.swaps:
        part = _matmul_swapped(rt, p, out, a, b, M, N, K, a_colsum, ws, label)
    else:
        if p.transpose_b:
            b, trans_b, ldb = _transpose_b(rt, b, K, N, label, p.fam.scratch), True, K
        if (trans_a, trans_b, epi, has_bias) not in COMBOS[p.family] or \
                out.dtype not in p.fam.out_dtypes(trans_a, trans_b):
            raise ValueError(f"{label}: the {p.family} kernels are not compiled for {layout_code(trans_a, trans_b)} "
                             f"with epilogue code {epi}{' and a bias' if has_bias else ''} into {out.dtype} (the op "
                             f"interface's products: gemm.PRODUCTS; bf16: gemm.BF16_OUTS)")
        # a kernel that sums A as it reads it (gemm_wgmma_ra, gemm_wgmma3_ra) gives the bias gradient's
        # partials, one row per split; elsewhere bias_grad reads A once more
        part = None
        if a_colsum is not None and has_colsum_kernel(p, trans_a, trans_b) and epi == EPI_NONE:
            part = _partials(rt, p.splits, M)
        _launch_gemm(rt, p, GemmCall(out, a, b, M, N, K, lda, ldb, N, trans_a, trans_b, epi, bias, aux, sC=M * N,
                                     colsum=part, label=label), ws)
    if part is not None:
        elementwise.sum_rows(rt, (a_colsum, part), label="bias_grad_reduce")
    elif a_colsum is not None:
        elementwise.bias_grad(rt, a_colsum, a)


def _scratch(rt, name, shape, label):
    ws, cap = ws_capacity(rt, name)
    if ws is None or cap < math.prod(shape):
        raise ValueError(f"{label}: this plan needs the workspace {name} of {math.prod(shape)} floats")
    return DeviceView(ws.ptr, tuple(shape), "f32", name)


def _transpose_into(rt, out, x, K, N, label, what="B^T", colsum=None, chunk0=0):
    """x [K, N] (dense) -> out [N, K]. colsum: also colsum[chunk0 + i, :] = the column sums of x's rows
    64 i .. 64 i + 63."""
    vec = K % 4 == 0 and N % 4 == 0 and x.ptr % 16 == 0 and out.ptr % 16 == 0
    rt.launch(rt.function(SIMT_FILE, transpose_name(vec, colsum is not None)),
              (cdiv(N, TRANSPOSE_TILE), cdiv(K, TRANSPOSE_TILE)), (TRANSPOSE_THREADS,),
              [out, x, i32(K), i32(N), colsum, i32(chunk0)], label=f"{label}:{what}")


def _partials(rt, chunks, M):
    """A [chunks, M] view for the bias gradient's partials (elementwise.partials: a region of the held
    sums' ring, or the workspace "bias_partials"), or None where they do not fit."""
    if chunks > elementwise.MAX_CHUNKS:
        return None
    return elementwise.partials(rt, chunks, M, elementwise.WORKSPACE)


def _matmul_swapped(rt, p: Plan, out, a, b, M, N, K, a_colsum, ws, label):
    """A swaps plan (wgmma_ra_t) of out [M, N] = a^T b, a [K, M] and b [K, N] as stored, run as the
    product P = out^T = b^T a: a transposed into its scratch as [M, K], b read as stored through
    registers, P stored transposed into out (split-K: its partials in out's layout, the usual
    reduction). The weight gradient whose input b is the larger operand (dW fcproj = dY^T act)
    transposes dY instead of act. a_colsum: the transpose writes a's column sums, a row per 64-row
    tile of a, into the partials it returns (None where they do not fit: bias_grad then)."""
    part = None if a_colsum is None else _partials(rt, cdiv(K, TRANSPOSE_TILE), M)
    at = _scratch(rt, p.fam.scratch, (M, K), label)
    _transpose_into(rt, at, a, K, M, label, "A^T", colsum=part)
    _launch_gemm(rt, p, GemmCall(out, b, at, N, M, K, N, K, N, True, True, sC=M * N, label=label), ws)
    return part


def _transpose_b(rt, b, K, N, label, scratch):
    """B [K, N] -> the workspace `scratch` as [N, K] (the operand of a transpose_b plan)."""
    bt = _scratch(rt, scratch, (N, K), label)
    _transpose_into(rt, bt, b, K, N, label)
    return bt


def matmul_batched_dims(out, a, b, trans_a=False, trans_b=False):
    """Validate a batched matmul's views; returns (batch, M, N, K, lda, ldb)."""
    _check_f32("matmul_batched", out=out, a=a, b=b)
    for nm, v in (("out", out), ("a", a), ("b", b)):
        if len(v.shape) < 3:
            raise ValueError(f"matmul_batched: {nm} {v.shape} must have >= 3 dims")
    M, N = int(out.shape[-2]), int(out.shape[-1])
    batch = rows(out.shape[:-1])
    if trans_a:
        K, am = int(a.shape[-2]), int(a.shape[-1])
    else:
        am, K = int(a.shape[-2]), int(a.shape[-1])
    if trans_b:
        bn, bk = int(b.shape[-2]), int(b.shape[-1])
    else:
        bk, bn = int(b.shape[-2]), int(b.shape[-1])
    if am != M or bk != K or bn != N:
        raise ValueError(f"matmul_batched: out {out.shape}, a {a.shape} (trans_a={trans_a}), "
                         f"b {b.shape} (trans_b={trans_b}) do not make [M, K] @ [K, N]")
    ba, bb = rows(a.shape[:-1]), rows(b.shape[:-1])
    if ba != batch or bb != batch:
        raise ValueError(f"matmul_batched: batch sizes differ: out {out.shape[:-2]}, "
                         f"a {a.shape[:-2]}, b {b.shape[:-2]}")
    if batch > MAX_GRID_Z:
        raise ValueError(f"matmul_batched: batch {batch} exceeds {MAX_GRID_Z}")
    if (trans_a, trans_b) not in PRODUCTS:
        raise ValueError(f"matmul_batched: {layout_code(trans_a, trans_b)} is not a layout the kernels are built for "
                         f"(NT, NN, TN)")
    lda = M if trans_a else K
    ldb = N if not trans_b else K
    return batch, M, N, K, lda, ldb


def matmul_batched(rt, out, a, b, trans_a=False, trans_b=False, alpha=1.0, plan=None, ex=None):
    """out[..., M, N] = alpha * op(a[...]) @ op(b[...]); leading dims flatten into the batch (ex: as
    in matmul)."""
    batch, M, N, K, lda, ldb = matmul_batched_dims(out, a, b, trans_a, trans_b)
    ex = rt.exec if ex is None else ex
    family = ex.gemm_family
    vec = _vec_ok(a, b, lda, ldb, M * K, K * N)
    wg = wgmma_ok(rt, trans_a, trans_b, vec, K, batch, ex=ex)        # (batched: x @ W^T only)
    label = f"matmul_batched[{batch}x{M}x{N}x{K}]"
    p = plan
    if p is not None:
        check_plan(label, p, family, vec, batch, 0, M, N, K, wg)
    else:
        p = tuned_plan(rt, tune_key(ex.table_tag, trans_a, trans_b, "none", False, M, N, K, batch), vec, 0, M, N, wg,
                       ex=ex)
    if p is None:
        p = model_plan(M, N, K, batch, rt.info.sm_count, family, max_ws=0, allow_split=False, vec=vec, wgmma=wg)
    _launch_gemm(rt, p, GemmCall(out, a, b, M, N, K, lda, ldb, N, trans_a, trans_b, alpha=float(alpha), batch=batch,
                                 sA=M * K, sB=K * N, sC=M * N, label=label))
