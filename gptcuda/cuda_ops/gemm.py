"""GEMM launchers: fp32 SIMT (kernels/gemm_simt.cu) and TF32 tensor cores (kernels/gemm_tf32.cu).

    matmul(rt, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None)
        out[M, N] = op(a) @ op(b) (+ bias) (+ epilogue); a is [M, K] or stored [K, M] (trans_a),
        b is [K, N] or stored [N, K] (trans_b). Leading dims of every view flatten into rows.
        "gelu": aux = pre-activation, out = gelu_tanh(aux); "residual": out = aux + ... (aux may be out).
    matmul_batched(rt, out, a, b, trans_a=False, trans_b=False, alpha=1.0)
        out[..., M, N] = alpha * op(a[...]) @ op(b[...]); leading dims flatten into the batch.

rt.precision picks the kernel family: "fp32" -> SIMT, "tf32" -> tensor cores. The block tile
and the split-K factor are chosen per shape from rt.info.sm_count (`plan`). Split-K writes
partials into the workspace "gemm_splitk" [splits, M, N] and a fixed-order reduction applies
the epilogue, so results are deterministic and do not depend on timing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..backend import EPILOGUES, rows
from ..runtime import f32, i32, u64

SIMT_FILE = "gemm_simt.cu"
TF32_FILE = "gemm_tf32.cu"

# Epilogue codes shared with the kernels (GEMM_EPI_* in gemm_simt.cu / gemm_tf32.cu).
EPI_NONE, EPI_BIAS, EPI_GELU, EPI_RESID = 0, 1, 2, 3
# (EPI, HAS_BIAS) pairs a launcher can ask for.
EPI_COMBOS = ((EPI_NONE, False), (EPI_BIAS, True), (EPI_GELU, False), (EPI_GELU, True),
              (EPI_RESID, False), (EPI_RESID, True))

# SIMT block tiles (BM, BN): threads = BM*BN/64; blocks resident per SM (register bound: the
# kernel's __launch_bounds__ asks for 2 / 3 / 6, see GemmSimtMinBlocks in gemm_simt.cu).
SIMT_TILES = ((128, 128), (128, 64), (64, 64))
SIMT_BLOCKS_PER_SM = {256: 2, 128: 3, 64: 6}
SIMT_EFFICIENCY = {(128, 128): 1.0, (128, 64): 0.9, (64, 64): 0.8}

# TF32 block tiles: (BM, BN, BK, warps_m, warps_n, stages); warp tiles 64x64 / 64x32 / 32x32,
# BK = 32 (the shared layouts of gemm_tf32.cu assume it). The unaligned fallback (VEC = false,
# 4-byte cp.async, element guards) is only instantiated for TF32_FALLBACK_TILES.
TF32_TILES = ((256, 128, 32, 4, 2, 3), (128, 128, 32, 2, 2, 3), (128, 64, 32, 2, 2, 4),
              (64, 64, 32, 2, 2, 4))
TF32_FALLBACK_TILES = ((64, 64, 32, 2, 2, 4),)
TF32_EFFICIENCY = {TF32_TILES[0]: 1.0, TF32_TILES[1]: 0.9, TF32_TILES[2]: 0.75, TF32_TILES[3]: 0.6}
SMEM_PER_SM = 228 * 1024       # H100/H200; GemmTf32MinBlocks in gemm_tf32.cu uses the same

# Teaching kernels of gemm_simt.cu, launched only by bench/gemm.py --ladder.
LADDER_NAMES = ("gemm_ladder_naive", "gemm_ladder_coalesced", "gemm_ladder_smem<32>",
                "gemm_ladder_regtile<64,64,8,4,4>")

SPLIT_ALIGN = 32          # k_chunk is a multiple of this (keeps 16-byte alignment and whole BK tiles)
MAX_SPLITS = 32
MAX_GRID_Z = 65535
REDUCE_THREADS = 256


def _b(x: bool) -> str:
    return "true" if x else "false"


def simt_name(bm, bn, ta, tb, epi, has_bias, vec) -> str:
    return f"gemm_simt<{bm},{bn},{_b(ta)},{_b(tb)},{epi},{_b(has_bias)},{_b(vec)}>"


def reduce_name(epi, has_bias) -> str:
    return f"gemm_splitk_reduce<{epi},{_b(has_bias)}>"


def tf32_name(tile, ta, tb, epi, has_bias, vec) -> str:
    bm, bn, bk, wm, wn, st = tile
    return f"gemm_tf32<{bm},{bn},{bk},{wm},{wn},{st},{_b(ta)},{_b(tb)},{epi},{_b(has_bias)},{_b(vec)}>"


def _variants():
    out = []
    for (bm, bn), ta, tb, (epi, hb), vec in itertools.product(
            SIMT_TILES, (False, True), (False, True), EPI_COMBOS, (False, True)):
        out.append((SIMT_FILE, simt_name(bm, bn, ta, tb, epi, hb, vec), {}))
    for tile, ta, tb, (epi, hb), vec in itertools.product(
            TF32_TILES, (False, True), (False, True), EPI_COMBOS, (False, True)):
        if vec or tile in TF32_FALLBACK_TILES:
            out.append((TF32_FILE, tf32_name(tile, ta, tb, epi, hb, vec), {}))
    for epi, hb in EPI_COMBOS:
        out.append((SIMT_FILE, reduce_name(epi, hb), {}))
    for name in LADDER_NAMES:
        out.append((SIMT_FILE, name, {}))
    out.append((TF32_FILE, "mma_probe", {}))
    out.append((TF32_FILE, "tf32_round_probe", {}))
    return out


VARIANTS = _variants()


# ---------------------------------------------------------------------------------------
# planning: block tile and split-K per shape
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    family: str          # "simt" | "tf32"
    tile: tuple          # (BM, BN) for simt, TF32_TILES entry for tf32
    threads: int
    blocks_per_sm: int
    splits: int
    k_chunk: int
    smem: int = 0

    @property
    def bm(self):
        return self.tile[0]

    @property
    def bn(self):
        return self.tile[1]


def _cdiv(a, b):
    return -(-a // b)


# A rough machine model (H200-like), only used to rank candidate plans against each other.
_FLOPS_PER_SM = 128 * 2 * 1.75e9      # fp32 FMA lanes x 2 x clock
_TF32_FLOPS_PER_SM = 1024 * 2 * 1.75e9 / 2
_BYTES_PER_S = 3.5e12
_LAUNCH_S = 3e-6


def _candidates(family, vec=True):
    if family == "tf32" and TF32_TILES:
        tiles = TF32_TILES if vec else TF32_FALLBACK_TILES
        return [(t, t[3] * t[4] * 32, tf32_blocks_per_sm(t), TF32_EFFICIENCY[t], tf32_smem(t))
                for t in tiles]
    return [(t, t[0] * t[1] // 64, SIMT_BLOCKS_PER_SM[t[0] * t[1] // 64], SIMT_EFFICIENCY[t], 0)
            for t in SIMT_TILES]


def tf32_smem(tile) -> int:
    """Dynamic shared memory of a TF32 tile: stages x (BM + BN) x BK floats."""
    bm, bn, bk, _, _, stages = tile
    return stages * (bm + bn) * bk * 4


def tf32_blocks_per_sm(tile) -> int:
    """Mirrors GemmTf32MinBlocks: as many as shared memory allows, 1..3."""
    return max(1, min(3, SMEM_PER_SM // (tf32_smem(tile) + 1024)))


def _util(warps):
    """Fraction of an SM's peak reached with this many resident warps (rough)."""
    return min(1.0, (warps / 16.0) ** 0.5)


def _model_time(blocks, work_per_block, threads, bps, eff, rate, sm_count):
    """Time of the busiest SM: it runs ceil(blocks / sm_count) blocks, bps at a time."""
    n = _cdiv(blocks, sm_count)
    warps = threads // 32
    full, last = divmod(n, bps)
    t = full * bps * work_per_block / (rate * eff * _util(bps * warps))
    if last:
        t += last * work_per_block / (rate * eff * _util(last * warps))
    return t


def plan(M, N, K, batch=1, sm_count=132, family="simt", max_ws=0, allow_split=True,
         vec=True, tiles=None, splits=None) -> Plan:
    """The tile and split count with the lowest modelled time. max_ws: floats available for
    split-K partials (0 disables split-K); vec: whether 16-byte loads are possible (TF32 has
    its guarded fallback for fewer tiles); tiles / splits: restrict the candidates to these
    tiles / this split count (benchmarks and sweeps)."""
    use_tf32 = family == "tf32" and bool(TF32_TILES)
    rate = _TF32_FLOPS_PER_SM if use_tf32 else _FLOPS_PER_SM
    best = None
    for tile, threads, bps, eff, smem in _candidates("tf32" if use_tf32 else "simt", vec):
        if tiles is not None and tile not in tiles:
            continue
        bm, bn = tile[0], tile[1]
        blocks = _cdiv(M, bm) * _cdiv(N, bn) * batch
        split_opts = [1]
        if splits is not None:
            split_opts = [splits]
        elif allow_split and batch == 1 and max_ws > 0 and K >= 2 * SPLIT_ALIGN \
                and blocks < sm_count * bps:
            split_opts = range(1, min(MAX_SPLITS, _cdiv(K, SPLIT_ALIGN)) + 1)
        for s in split_opts:
            if s == 1:
                chunk, s_eff = K, 1
            else:
                chunk = _cdiv(_cdiv(K, s), SPLIT_ALIGN) * SPLIT_ALIGN
                s_eff = _cdiv(K, chunk)
                if s_eff != s or s_eff * M * N > max_ws or s_eff > MAX_GRID_Z:
                    continue
            t = _model_time(blocks * s_eff, 2.0 * bm * bn * max(chunk, 1), threads, bps, eff,
                            rate, sm_count)
            if s_eff > 1:
                t += _LAUNCH_S + (2 * s_eff + 1) * M * N * 4 / _BYTES_PER_S
            key = (t, s_eff, -bm * bn)
            if best is None or key < best[0]:
                best = (key, Plan("tf32" if use_tf32 else "simt", tile, threads, bps, s_eff,
                                  chunk if s_eff > 1 else K, smem))
    if best is None:
        raise ValueError(f"no GEMM plan for M={M} N={N} K={K} batch={batch} {family} tiles={tiles} "
                         f"split={allow_split}")
    return best[1]


def _weight_grad_shapes(cfg):
    C = cfg.n_embd
    V = cfg.vocab_size
    shapes = [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]
    if V:
        shapes.append((V, C))
    return shapes


def workspace(cfg) -> dict:
    """Split-K partials for the weight-gradient GEMMs (K = batch_size * block_size tokens),
    sized for both orientations (dW and dW^T) and both kernel families at 132 SMs."""
    K = cfg.batch_size * cfg.block_size
    need = 0
    for (m, n) in _weight_grad_shapes(cfg):
        for (M, N) in ((m, n), (n, m)):
            for fam in ("simt", "tf32"):
                p = plan(M, N, K, 1, 132, fam, max_ws=MAX_SPLITS * M * N)
                if p.splits > 1:
                    need = max(need, p.splits * M * N)
    if need == 0:
        return {}
    return {"gemm_splitk": ((need,), "f32")}


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------
def _check_f32(label, **views):
    for k, v in views.items():
        if v is not None and getattr(v, "dtype", "f32") != "f32":
            raise TypeError(f"{label}: {k} must be f32, got {v.dtype}")


def _aligned(*xs):
    return all(int(x) % 4 == 0 for x in xs)


def _ws_capacity(rt):
    try:
        ws = rt.workspace("gemm_splitk")
    except KeyError:
        return None, 0
    return ws, ws.numel


def _vec_ok(a, b, lda, ldb, sA, sB):
    """16-byte loads of A and B: aligned bases, row and batch strides multiples of 4 floats
    (split k_chunk is a multiple of SPLIT_ALIGN, so split offsets keep the alignment)."""
    return a.ptr % 16 == 0 and b.ptr % 16 == 0 and _aligned(lda, ldb, sA, sB)


def _launch_gemm(rt, p: Plan, out, aux, a, b, bias, M, N, K, lda, ldb, ldc, sA, sB, sC,
                 alpha, ta, tb, epi, has_bias, batch, ws=None, label="gemm"):
    vec = _vec_ok(a, b, lda, ldb, sA, sB) and (p.splits == 1 or p.k_chunk % 4 == 0)
    if p.family == "tf32" and not vec and p.tile not in TF32_FALLBACK_TILES:
        raise AssertionError(f"{label}: TF32 tile {p.tile} has no unaligned variant")
    if p.splits > 1:
        # partials: plain store into ws [splits, M, N], then the fixed-order reduction + epilogue
        name = _kernel_name(p, ta, tb, EPI_NONE, False, vec)
        fn = rt.function(_file(p), name)
        grid = (_cdiv(N, p.bn), _cdiv(M, p.bm), p.splits)
        rt.launch(fn, grid, (p.threads,), [ws, None, a, b, None, i32(M), i32(N), i32(K),
                                           i32(lda), i32(ldb), i32(N), u64(0), u64(0), u64(M * N),
                                           f32(1.0), i32(p.splits), i32(p.k_chunk)],
                  smem=p.smem, label=f"{label}:splitk{p.splits}")
        rfn = rt.function(SIMT_FILE, reduce_name(epi, has_bias))
        total = M * N
        blocks = max(1, min(_cdiv(total, REDUCE_THREADS), rt.info.sm_count * 8))
        rt.launch(rfn, (blocks,), (REDUCE_THREADS,), [out, aux, ws, bias, i32(M), i32(N), i32(ldc),
                                                      i32(p.splits), f32(alpha)],
                  label=f"{label}:reduce")
        return
    name = _kernel_name(p, ta, tb, epi, has_bias, vec)
    fn = rt.function(_file(p), name)
    grid = (_cdiv(N, p.bn), _cdiv(M, p.bm), batch)
    rt.launch(fn, grid, (p.threads,), [out, aux, a, b, bias, i32(M), i32(N), i32(K),
                                       i32(lda), i32(ldb), i32(ldc), u64(sA), u64(sB), u64(sC),
                                       f32(alpha), i32(1), i32(max(K, 1))],
              smem=p.smem, label=label)


def _file(p: Plan):
    return TF32_FILE if p.family == "tf32" else SIMT_FILE


def _kernel_name(p: Plan, ta, tb, epi, has_bias, vec):
    if p.family == "tf32":
        return tf32_name(p.tile, ta, tb, epi, has_bias, vec)
    return simt_name(p.bm, p.bn, ta, tb, epi, has_bias, vec)


def _family(rt):
    prec = getattr(rt, "precision", "fp32")
    if prec == "tf32":
        return "tf32" if TF32_TILES else "simt"
    if prec == "fp32":
        return "simt"
    raise ValueError(f"matmul: unknown precision {prec!r} (fp32 | tf32)")


def matmul_plan(rt, p: Plan, out, a, b, trans_a=False, trans_b=False):
    """out = op(a) @ op(b) with a given plan (benchmarks and tile sweeps; no epilogue).
    Split-K plans read rt.workspace("gemm_splitk")."""
    M, N = rows(out.shape), int(out.shape[-1])
    K = rows(a.shape) if trans_a else int(a.shape[-1])
    lda = M if trans_a else K
    ldb = N if not trans_b else K
    ws = rt.workspace("gemm_splitk") if p.splits > 1 else None
    if ws is not None and ws.numel < p.splits * M * N:
        raise ValueError(f"matmul_plan: workspace {ws.numel} < {p.splits} x {M} x {N}")
    _launch_gemm(rt, p, out, None, a, b, None, M, N, K, lda, ldb, N, 0, 0, M * N, 1.0,
                 trans_a, trans_b, EPI_NONE, False, 1, ws=ws, label=f"matmul[{M}x{N}x{K}]")


def kernel_label(p: Plan, trans_a, trans_b, vec=True) -> str:
    """Short description of a plan: family, tile, split."""
    tile = "x".join(str(x) for x in p.tile[:2])
    if p.family == "tf32":
        tile += f"x{p.tile[2]} w{p.tile[3]}x{p.tile[4]} s{p.tile[5]}"
    t = ("T" if trans_a else "N") + ("T" if trans_b else "N")
    return f"{p.family} {tile} {t}{'' if vec else ' unaligned'}" + (f" splitK={p.splits}" if p.splits > 1 else "")


def matmul(rt, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None):
    """out[M, N] = op(a) @ op(b) (+ bias), then the epilogue (see module docstring)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"matmul: epilogue {epilogue!r} is not one of {EPILOGUES}")
    _check_f32("matmul", out=out, a=a, b=b, bias=bias, aux=aux)
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
    if epilogue in ("gelu", "residual"):
        if aux is None:
            raise ValueError(f"matmul: epilogue {epilogue!r} needs aux")
        if aux.numel != M * N or int(aux.shape[-1]) != N:
            raise ValueError(f"matmul: aux {aux.shape} must hold [M={M}, N={N}] like out {out.shape}")
    elif aux is not None:
        raise ValueError("matmul: aux is only used by the 'gelu' and 'residual' epilogues")
    has_bias = bias is not None
    epi = {"none": EPI_BIAS if has_bias else EPI_NONE, "gelu": EPI_GELU, "residual": EPI_RESID}[epilogue]

    family = _family(rt)
    ws, cap = _ws_capacity(rt)
    lda = M if trans_a else K
    ldb = N if not trans_b else K
    p = plan(M, N, K, 1, rt.info.sm_count, family, max_ws=cap,
             vec=_vec_ok(a, b, lda, ldb, 0, 0))
    _launch_gemm(rt, p, out, aux, a, b, bias, M, N, K, lda, ldb, N, 0, 0, M * N, 1.0,
                 trans_a, trans_b, epi, has_bias, 1, ws=ws, label=f"matmul[{M}x{N}x{K}]")


def matmul_batched(rt, out, a, b, trans_a=False, trans_b=False, alpha=1.0):
    """out[..., M, N] = alpha * op(a[...]) @ op(b[...]); leading dims flatten into the batch."""
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
    family = _family(rt)
    lda = M if trans_a else K
    ldb = N if not trans_b else K
    p = plan(M, N, K, batch, rt.info.sm_count, family, max_ws=0, allow_split=False,
             vec=_vec_ok(a, b, lda, ldb, M * K, K * N))
    _launch_gemm(rt, p, out, None, a, b, None, M, N, K, lda, ldb, N, M * K, K * N, M * N,
                 float(alpha), trans_a, trans_b, EPI_NONE, False, batch,
                 label=f"matmul_batched[{batch}x{M}x{N}x{K}]")


__all__ = ["matmul", "matmul_batched", "matmul_plan", "workspace", "plan", "kernel_label",
           "VARIANTS", "Plan"]
