"""The GEMM launchers: validate the views, pick the plan, re-lay an operand out where the plan needs it
(B^T, or the swapped product's A^T) and launch the family's kernel (and the split-K reduction)."""
from __future__ import annotations

import dataclasses
import weakref

from gptcuda.ops.backend import check_matmul, rows
from gptcuda.ops.cuda import cdiv, elementwise, planned
from gptcuda.runtime import Blob, DeviceView, f32, i32, u64
from gptcuda.ops.cuda.gemm.families import (BF16_STORE_BOX, EPI_NONE, MAX_GRID_Z, PRODUCTS, REDUCE_THREADS, SIMT_FILE,
                                            TRANSPOSE_THREADS, TRANSPOSE_TILE, WGMMA_FILE, dual_name, epi_code,
                                            layout_code, reduce_name, transpose_name)
from gptcuda.model.products import Pair, Product
from gptcuda.ops.cuda.gemm.plan import (WGMMA_WORKSPACES, Plan, pair_plan, pair_refusal, pair_unfit, plan_unfit,
                                        split_room)
from gptcuda.ops.cuda.gemm.plan import plan as model_plan     # `matmul(..., plan=)` shadows the name inside matmul
from gptcuda.ops.cuda.gemm.table import APART, tuned_pair, tuned_plan


def _check_dtypes(label, family, out, a, b, bias=None, aux=None):
    """The views' dtypes against the execution plan's base family: bf16 operands for the bf16 family, C
    (and aux) bf16 or fp32; fp32 operands, C and aux for the others and the batched products; the bias fp32."""
    want = "bf16" if family == "bf16" else "f32"
    if a.dtype != want or b.dtype != want:
        raise TypeError(f"{label}: a {a.dtype} and b {b.dtype}, but the {family} products take {want} operands")
    f32_views = {"bias": bias} if want == "bf16" else {"bias": bias, "out": out, "aux": aux}
    for k, v in f32_views.items():
        if v is not None and v.dtype != "f32":
            raise TypeError(f"{label}: {k} must be f32, got {v.dtype}")
    if want == "bf16" and (out.dtype not in ("f32", "bf16") or (aux is not None and aux.dtype != out.dtype)):
        raise TypeError(f"{label}: out {out.dtype}{f' and aux {aux.dtype}' if aux is not None else ''}: bf16 "
                        f"products write f32 or bf16, aux of out's type")


def _grad_out(trans_a, out) -> str:
    """Product.out of a product into view out: "bf16" for a weight gradient (trans_a) into a bf16 C."""
    return "bf16" if trans_a and out.dtype == "bf16" else ""


def _vec_ok(a, b, lda, ldb, sA=0, sB=0):
    """16-byte loads of A and B: aligned bases, row and batch strides (split k_chunks keep the alignment)."""
    per = 16 // a.itemsize
    return a.ptr % 16 == 0 and b.ptr % 16 == 0 and all(int(x) % per == 0 for x in (lda, ldb, sA, sB))


def _launch_gemm(rt, p: Plan, g: Product, out, a, b, bias=None, aux=None, colsum=None, alpha=1.0, ws=None,
                 batched=False):
    """Launch product g as the kernel computes it by plan p (batched: batch strides M K and K N; swapped:
    out^T = B^T A, ldc = M); split-K: partials into ws [splits, M, N], reduced in a fixed order with the
    epilogue. colsum [splits x rows, M]: each split's sums of A's (stored [K, M]) rows, where the kernels sum A."""
    fam, whole, zs = p.fam, p.splits == 1, g.batch * p.splits
    c_dtype = out.dtype if whole else "f32"
    geo = fam.geometry(p.tile, c_dtype)
    lda, ldb, ldc = g.M if g.ta else g.K, g.K if g.tb else g.N, g.M if fam.swaps else g.N
    sA, sB = (g.M * g.K, g.K * g.N) if batched else (0, 0)
    fn = rt.function(fam.file, fam.kernel(p.tile, g.ta, g.tb, epi_code(g) if whole else EPI_NONE, whole and g.bias,
                                          vec=g.vec, out=c_dtype, colsum=colsum is not None))
    # the kernels' parameters: C, aux, A, B, bias, M, N, K, [lda, ldb,] ldc, [sA, sB,] sC, alpha, splits,
    # k_chunk[, zs, colsum][, mapC, mapX, c_tma]: a TMA kernel takes tensor maps of A and B and no A / B strides,
    # a persistent one the z extent of its tiles and the column sums' partials (or null), gemm_wgmma_ws / _pp
    # (geo.c_maps) C's and aux's store maps last
    args = [out if whole else ws, aux if whole else None, *_operands(rt, p, g, a, b, lda, ldb, sA, sB),
            bias if whole else None, i32(g.M), i32(g.N), i32(g.K)]
    args += [i32(ldc)] if geo.tma else [i32(lda), i32(ldb), i32(ldc), u64(sA), u64(sB)]
    args += [u64(g.M * g.N), f32(alpha), i32(p.splits), i32(max(g.K, 1) if whole else p.k_chunk)]
    args += [i32(zs), colsum] if geo.persistent else []
    if geo.c_maps:                    # C's and aux's store maps (a bf16 C: wg_store_tile_tma), or none
        args += _store_maps(rt, g, out, aux, ldc, zs) if c_dtype == "bf16" else [_NO_MAP, _NO_MAP, i32(0)]
    tiles = (cdiv(g.N, p.tile[1]), cdiv(g.M, p.tile[0]), zs)
    if geo.persistent:                # at most blocks_per_sm x SMs blocks, each walking tiles x, x + gridDim.x, ...
        tiles = (max(1, min(tiles[0] * tiles[1] * zs, rt.info.sm_count * geo.blocks_per_sm)), 1, 1)
    rt.launch(fn, tiles, (geo.threads,), args, smem=geo.smem, label=g.label if whole else f"{g.label}:splitk{p.splits}")
    if not whole:
        _reduce(rt, p, g, out, aux, ws, bias, ldc, alpha)


def _reduce(rt, p: Plan, g: Product, out, aux, ws, bias, ldc, alpha=1.0):
    """The split-K partials of product g (plan p) in ws, summed in split order into out with g's epilogue."""
    rM, rN = (g.N, g.M) if p.fam.swaps else (g.M, g.N)
    rt.launch(rt.function(SIMT_FILE, reduce_name(epi_code(g), g.bias, out.dtype)),
              (max(1, min(cdiv(g.M * g.N, REDUCE_THREADS), rt.info.sm_count * 8)),), (REDUCE_THREADS,),
              [out, aux, ws, bias, i32(rM), i32(rN), i32(ldc), i32(p.splits), f32(alpha)],
              label=f"{g.label}:reduce")


_NO_MAP = Blob(bytes(128))


def _store_maps(rt, g: Product, out, aux, ldc, zs) -> list:
    """[C's map, aux's map, c_tma] of a bf16 C: maps {N, M, zs} in boxes of 64 rows x 32 columns, 64-byte
    swizzle, for the epilogue's tensor stores; c_tma 0 (the threads store) where a map cannot describe C or
    aux (16-byte aligned bases, rows and matrices)."""
    views = [out] + ([aux] if aux is not None else [])
    if any(v.ptr % 16 for v in views) or ldc % 8 or (zs > 1 and (g.M * g.N) % 8):
        return [_NO_MAP, _NO_MAP, i32(0)]
    maps = [rt.tensor_map(v, (g.N, g.M, zs), (2 * ldc, 2 * g.M * g.N), BF16_STORE_BOX, swizzle=64) for v in views]
    return [maps[0], maps[-1] if aux is not None else _NO_MAP, i32(1)]


def _operands(rt, p: Plan, g: Product, a, b, lda, ldb, sA, sB) -> tuple:
    """A and B as the kernel takes them: pointers, or TMA tensor maps. A K-major operand (A [M, K], B
    [N, K]) {K, rows, batch} with boxes {a k tile (128 bytes: 32 fp32, 64 bf16), BM or BN} in the 128-byte
    swizzle; an MN-major one (A [K, M]: ta, B [K, N]: not tb, read as stored) {rows, K, batch}, boxes
    {BM or BN, 32}, unswizzled, except A read through registers (a_regs): boxes {32, 32}, and a bf16
    operand's: boxes {64, 64}, in the 128-byte swizzle."""
    if not p.geo.tma:
        return a, b
    out = []
    for x, rows_, ld, stride, box, mn in ((a, g.M, lda, sA, p.tile[0], g.ta), (b, g.N, ldb, sB, p.tile[1], not g.tb)):
        e = x.itemsize
        inner, outer = (rows_, g.K) if mn else (g.K, rows_)
        regs = mn and p.fam.a_regs and x is a
        out.append(rt.tensor_map(x, (inner, outer, g.batch), (e * ld, e * max(stride, outer * ld)),
                                 (32, 32, 1) if regs else (64, 64, 1) if mn and e == 2 else (box, 32, 1) if mn
                                 else (128 // e, box, 1), swizzle=regs or not mn or e == 2))
    return tuple(out)


def _plan(rt, g: Product, forced, ex, out_dtype) -> tuple:
    """(plan, split-K workspace view) of product g under execution plan ex: `forced`, else the measured
    table's, else the cost model's; refused with `plan_unfit`'s reason where it cannot run."""
    ws = planned(rt, "gemm_splitk")
    cap = split_room(out_dtype, ws.numel, g) if ws is not None and g.batch == 1 else 0
    scratch = {name: v.numel for name in WGMMA_WORKSPACES if (v := planned(rt, name)) is not None}   # absent: 0
    p = forced or tuned_plan(rt, g, ex, cap, scratch, out_dtype) or \
        model_plan(g, ex.gemm_family, ex.wgmma_mode, rt.info.sm_count, cap, scratch)
    why = plan_unfit(p, g, ex.gemm_family, ex.wgmma_mode, cap, scratch, out_dtype)
    if why:
        raise ValueError(f"{g.label}: {why}")
    return p, ws


def _dims(label, out, a, b, ta, tb, batched=False) -> tuple:
    """(M, N, K, lda, ldb) of out = op(a) @ op(b), leading dims flattening into rows (batched: the batch)."""
    lead = 3 if batched else 2
    for name, v in (("out", out), ("a", a), ("b", b)):
        if len(v.shape) < lead:
            raise ValueError(f"{label}: {name} {v.shape} must have >= {lead} dims")
    (M, N), (am, K), (bk, bn) = ((int(v.shape[-2]) if batched else rows(v.shape), int(v.shape[-1]))[::-1 if t else 1]
                                 for v, t in ((out, False), (a, ta), (b, tb)))
    if am != M or bk != K or bn != N:
        raise ValueError(f"{label}: op(a) of a {a.shape} (trans_a={ta}) is [{am} rows, K={K}], op(b) of b {b.shape} "
                         f"(trans_b={tb}) [K={bk}, N={bn}], out {out.shape} [{M} rows, N={N}]")
    return M, N, K, M if ta else K, K if tb else N


def matmul(rt, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None, plan=None, ex=None,
           a_colsum=None):
    """The op interface's matmul (gptcuda/ops/backend.py). ex: the execution plan (default rt's); `plan`
    forces a plan (benchmarks, bench/tune.py). a_colsum: partial sums from a swapped product's A^T
    transpose or from kernels that sum A as they read it (Family.colsum), else bias_grad reads a again."""
    M, N, K, lda, ldb = _dims("matmul", out, a, b, trans_a, trans_b)
    check_matmul(out, trans_a, bias, epilogue, aux, a_colsum)
    if epilogue in ("dgelu", "dgelu_gelu") and out.ptr < aux.ptr + aux.nbytes and aux.ptr < out.ptr + out.nbytes:
        raise ValueError(f"matmul: {epilogue!r} reads aux while writing out: they must not overlap")
    ex = rt.exec if ex is None else ex
    _check_dtypes("matmul", ex.gemm_family, out, a, b, bias, aux)
    g = Product(M, N, K, trans_a, trans_b, epilogue, bias is not None, colsum=a_colsum is not None,
                vec=_vec_ok(a, b, lda, ldb), label=f"matmul[{M}x{N}x{K}]", out=_grad_out(trans_a, out))
    p, ws = _plan(rt, g, plan, ex, out.dtype)
    if p.fam.swaps:           # out^T = b^T a: a^T first into the family's scratch (with a's column sums)
        part = None if a_colsum is None else _partials(rt, cdiv(K, TRANSPOSE_TILE), M)
        at = _transposed(rt, p.fam.scratch, a, K, M, g.label, "A^T", colsum=part)
        _launch_gemm(rt, p, Product(N, M, K, True, True, vec=g.vec, label=g.label), out, b, at, ws=ws)
    else:
        if p.transpose_b:
            b, g = _transposed(rt, p.fam.scratch, b, K, N, g.label, "B^T"), dataclasses.replace(g, tb=True)
        # a kernel that sums A as it reads it gives the bias gradient's partials, colsum_rows a split
        part = (_partials(rt, p.splits * p.fam.colsum_rows(p.tile, N), M)
                if a_colsum is not None and p.fam.colsum and epi_code(g) == EPI_NONE else None)
        _launch_gemm(rt, p, g, out, a, b, bias, aux, colsum=part, ws=ws)
    if part is not None:
        elementwise.sum_rows(rt, (a_colsum, part), label="bias_grad_reduce")
    elif a_colsum is not None:
        elementwise.bias_grad(rt, a_colsum, a)


def matmul_pair(rt, dx, dw, dy, x, w, db=None, epilogue="none", aux=None, ex=None, plan=None):
    """The two gradients of a linear layer out = x @ w^T from dy, independent of each other: dw = dy^T @ x
    (db: dy's column sums, the bias gradient) and dx = dy @ w (epilogue none, or dgelu over aux: the GELU
    before the layer). bf16 products with ex.grad_pairs that the kernel can pair: the measured table's entry
    (table.py tuned_pair: a plan, or APART: the two products were faster) else the model's plan (plan.py
    pair_plan); `plan` forces one (tests, benchmarks). A plan: one launch of gemm_wgmma_dual (dw's split-K
    reduction and db's sums after it); else matmul twice."""
    ex = rt.exec if ex is None else ex
    Mw, Nw, Kw, ldaw, ldbw = _dims("matmul_pair dw", dw, dy, x, True, False)
    Mx, Nx, Kx, ldax, ldbx = _dims("matmul_pair dx", dx, dy, w, False, False)
    check_matmul(dw, True, None, "none", None, db)
    check_matmul(dx, False, None, epilogue, aux, None)
    p = None
    if ex.grad_pairs and dx.dtype == "bf16" and dw.dtype in ("f32", "bf16"):       # (grad_pairs: the bf16 family)
        _check_dtypes("matmul_pair", "bf16", dw, dy, x)
        _check_dtypes("matmul_pair", "bf16", dx, dy, w, aux=aux)
        label = f"matmul_pair[dW {Mw}x{Nw}x{Kw} + dX {Mx}x{Nx}x{Kx}]"
        gw = Product(Mw, Nw, Kw, True, False, colsum=db is not None, vec=_vec_ok(dy, x, ldaw, ldbw), label=label,
                     out=_grad_out(True, dw))
        gx = Product(Mx, Nx, Kx, False, False, epilogue, vec=_vec_ok(dy, w, ldax, ldbx), label=label)
        ws = planned(rt, "gemm_splitk")
        room = ws.numel if ws is not None else 0
        if plan is not None:
            why = pair_unfit(plan, gw, gx, room)
            if why:
                raise ValueError(f"matmul_pair: {plan}: {why}")
            p = plan
        elif pair_refusal(gw, gx) is None:      # the measured table's entry (a plan, or apart), else the model's
            tuned = tuned_pair(rt, Pair(gw, gx), ex, room)
            p = None if tuned == APART else tuned or pair_plan(gw, gx, rt.info.sm_count, room)
        if epilogue == "dgelu" and p is not None and dx.ptr < aux.ptr + aux.nbytes and aux.ptr < dx.ptr + dx.nbytes:
            raise ValueError("matmul_pair: 'dgelu' reads aux while writing dx: they must not overlap")
    if p is None:
        if plan is not None:
            raise ValueError("matmul_pair: a forced plan needs the bf16 family with grad_pairs, bf16 dx, fp32 or bf16 "
                             "dw")
        matmul(rt, dx, dy, w, False, False, epilogue=epilogue, aux=aux, ex=ex)
        matmul(rt, dw, dy, x, True, False, ex=ex, a_colsum=db)
        return
    _launch_dual(rt, p, gw, gx, dx, dw, dy, x, w, db, aux, ws)


def _launch_dual(rt, p: Plan, gw: Product, gx: Product, dx, dw, dy, x, w, db, aux, ws):
    """gemm_wgmma_dual by pair plan p (gw split p.splits ways into ws, then reduced), then db's sums."""
    whole = p.splits == 1
    part = _partials(rt, p.splits * p.fam.colsum_rows(p.tile, gw.N), gw.M) if db is not None else None
    geo = p.fam.geometry(p.tile, "bf16")
    fn = rt.function(WGMMA_FILE, dual_name(p.tile, epi_code(gx), part is not None, dw.dtype if whole else "f32"))
    px = Plan(p.family, p.tile, 1, max(gx.K, 1))
    args = [dw if whole else ws, *_operands(rt, p, gw, dy, x, gw.M, gw.N, 0, 0), i32(gw.M), i32(gw.N), i32(gw.K),
            i32(p.splits), i32(p.k_chunk), part,        # (TN: A [K, M], B [K, N] as stored; NN: A [M, K], B [K, N])
            dx, aux, *_operands(rt, px, gx, dy, w, gx.K, gx.N, 0, 0), i32(gx.M), i32(gx.N), i32(gx.K),
            *_store_maps(rt, gx, dx, aux, gx.N, 1), _tile_counter(rt)]
    total = cdiv(gw.M, p.tile[0]) * cdiv(gw.N, p.tile[1]) * p.splits + cdiv(gx.M, p.tile[0]) * cdiv(gx.N, p.tile[1])
    rt.launch(fn, (max(1, min(total, rt.info.sm_count)),), (geo.threads,), args, smem=geo.smem,
              label=gw.label + ("" if whole else f":splitk{p.splits}"))
    if not whole:
        _reduce(rt, p, gw, dw, None, ws, None, gw.N)
    if part is not None:
        elementwise.sum_rows(rt, (db, part), label="bias_grad_reduce")
    elif db is not None:
        elementwise.bias_grad(rt, db, dy)


_COUNTERS = weakref.WeakKeyDictionary()       # runtime -> its gemm_wgmma_dual tile counter


def _tile_counter(rt) -> DeviceView:
    """gemm_wgmma_dual's tile counter on this runtime: one int, zeroed once here; each launch leaves it at 0
    (the kernel's last fetch resets it), so one counter serves every launch of the runtime's stream."""
    v = _COUNTERS.get(rt)
    if v is None:
        v = _COUNTERS[rt] = rt.empty((1,), "i32", poison=False, name="gemm_dual_tiles")
        rt.fill(v, 0)
    return v


def _transposed(rt, name, x, K, N, label, what, colsum=None):
    """x [K, N] (dense) transposed into the workspace `name` as [N, K] (room: plan_unfit); colsum[i, :]:
    the column sums of x's rows 64 i .. 64 i + 63."""
    out = DeviceView(rt.workspace(name).ptr, (N, K), "f32", name)
    vec = K % 4 == 0 and N % 4 == 0 and x.ptr % 16 == 0 and out.ptr % 16 == 0
    rt.launch(rt.function(SIMT_FILE, transpose_name(vec, colsum is not None)),
              (cdiv(N, TRANSPOSE_TILE), cdiv(K, TRANSPOSE_TILE)), (TRANSPOSE_THREADS,),
              [out, x, i32(K), i32(N), colsum, i32(0)], label=f"{label}:{what}")
    return out


def _partials(rt, chunks, M):
    """A [chunks, M] view for the bias gradient's partials (elementwise.partials), None where they do not fit."""
    return None if chunks > elementwise.MAX_CHUNKS else elementwise.partials(rt, chunks, M, elementwise.WORKSPACE)


def matmul_batched(rt, out, a, b, trans_a=False, trans_b=False, alpha=1.0, plan=None, ex=None):
    """out[..., M, N] = alpha * op(a[...]) @ op(b[...]), leading dims the batch (ex, plan: as in matmul)."""
    _check_dtypes("matmul_batched", "batched", out, a, b)
    M, N, K, lda, ldb = _dims("matmul_batched", out, a, b, trans_a, trans_b, batched=True)
    batch = rows(out.shape[:-1])
    if rows(a.shape[:-1]) != batch or rows(b.shape[:-1]) != batch:
        raise ValueError(f"matmul_batched: batch sizes differ: out {out.shape[:-2]}, a {a.shape[:-2]}, "
                         f"b {b.shape[:-2]}")
    if batch > MAX_GRID_Z:
        raise ValueError(f"matmul_batched: batch {batch} exceeds {MAX_GRID_Z}")
    if (trans_a, trans_b) not in PRODUCTS:
        raise ValueError(f"matmul_batched: {layout_code(trans_a, trans_b)} is not a layout the kernels are built for "
                         f"(NT, NN, TN)")
    g = Product(M, N, K, trans_a, trans_b, batch=batch, vec=_vec_ok(a, b, lda, ldb, M * K, K * N),
             label=f"matmul_batched[{batch}x{M}x{N}x{K}]")
    p, _ = _plan(rt, g, plan, rt.exec if ex is None else ex, "f32")
    _launch_gemm(rt, p, g, out, a, b, alpha=float(alpha), batched=True)
