"""GEMM launchers: fp32 SIMT (kernels/gemm_simt.cu) and TF32 tensor cores (kernels/gemm_tf32.cu,
mma.sync; kernels/gemm_wgmma.cu, Hopper's warpgroup MMA for the x @ W^T case, also fp32 as 3xTF32).

    matmul(rt, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None)
        out[M, N] = op(a) @ op(b) (+ bias) (+ epilogue); a is [M, K] or stored [K, M] (trans_a),
        b is [K, N] or stored [N, K] (trans_b). Leading dims of every view flatten into rows.
        "gelu": aux = pre-activation, out = gelu_tanh(aux); "residual": out = aux + ... (aux may be out);
        "dgelu": out = (op(a) @ op(b)) * gelu_tanh'(aux), aux = the saved pre-activation (read only,
        out must not alias it; no bias).
    matmul_batched(rt, out, a, b, trans_a=False, trans_b=False, alpha=1.0)
        out[..., M, N] = alpha * op(a[...]) @ op(b[...]); leading dims flatten into the batch.

rt.precision picks the kernel family: "fp32" -> SIMT, "tf32" -> tensor cores (the "wgmma" family
joins the candidates when the device is sm_90 and both operands are K-major: trans_a = False,
trans_b = True, 16-byte aligned; or, for trans_b = False, after B is transposed into the
workspace "gemm_bT" (one small launch: the backward's dX = dY @ W with W a weight; `wgmma_ok`;
GPTCUDA_WGMMA=0 leaves it out); for trans_a = True (the weight gradient dW = dY^T @ X, K = tokens)
after A [K, M] (and B [K, N]) are transposed into the workspace "gemm_aT" as [M, k] (and [N, k]):
when the scratch cannot hold the whole of them the product runs as k slabs in a fixed order,
the first writing out and the others adding to it (the residual epilogue with aux = out; linear
epilogues only). For "fp32" these layouts, and trans_a = True (the weight gradient
dY^T @ X), may run as 3xTF32 (family "wgmma3") when the config planned the split scratch
"gemm_split_a" / "gemm_split_b" (fp32_gemm: 3xtf32): A and B are split into TF32 hi and lo halves
by a pre-pass (transposing a [K, rows] operand on the way), then three products. The block tile
and the split-K factor of a shape come from the measured table of bench/tune.py when it has
an entry for (precision, transposes, epilogue, M, N, K, batch) on this GPU and these kernel
sources (`tuned_plan`), else from a cost model (`plan`) fed with rt.info.sm_count. Split-K
writes partials into the workspace "gemm_splitk" [splits, M, N] and a fixed-order reduction
applies the epilogue, so results are deterministic and do not depend on timing at run time
(which plan a shape gets is fixed once the table is written; GPTCUDA_GEMM_TUNE=0 ignores it).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..backend import rows
from ..runtime import DeviceView, f32, i32, u64

SIMT_FILE = "gemm_simt.cu"
TF32_FILE = "gemm_tf32.cu"

# Epilogue codes shared with the kernels (GEMM_EPI_* in gemm_simt.cu / gemm_tf32.cu).
EPI_NONE, EPI_BIAS, EPI_GELU, EPI_RESID, EPI_DGELU = 0, 1, 2, 3, 4
# The op interface's epilogue names (backend.EPILOGUES plus "dgelu") -> kernel code without bias.
EPILOGUE_CODES = {"none": EPI_NONE, "gelu": EPI_GELU, "residual": EPI_RESID, "dgelu": EPI_DGELU}
AUX_EPILOGUES = ("gelu", "residual", "dgelu")
# (EPI, HAS_BIAS) pairs a launcher can ask for (dgelu never takes a bias).
EPI_COMBOS = ((EPI_NONE, False), (EPI_BIAS, True), (EPI_GELU, False), (EPI_GELU, True),
              (EPI_RESID, False), (EPI_RESID, True), (EPI_DGELU, False))
# [M, N] arrays an epilogue moves through DRAM: the output, plus aux written (GELU) or read.
EPI_IO = {EPI_NONE: 1, EPI_BIAS: 1, EPI_GELU: 2, EPI_RESID: 2, EPI_DGELU: 2}

# SIMT block tiles (BM, BN): threads = BM*BN/64; blocks resident per SM (register bound: the
# kernel's __launch_bounds__ asks for 2 / 3 / 6, see GemmSimtMinBlocks in gemm_simt.cu).
SIMT_TILES = ((128, 128), (128, 64), (64, 64))
SIMT_BLOCKS_PER_SM = {256: 2, 128: 3, 64: 6}
SIMT_EFFICIENCY = {(128, 128): 1.0, (128, 64): 0.9, (64, 64): 0.8}

# TF32 block tiles: (BM, BN, BK, warps_m, warps_n, stages); warp tiles 64x64 / 64x32 / 32x32,
# BK = 32 (the shared layouts of gemm_tf32.cu assume it). The unaligned fallback (VEC = false,
# 4-byte cp.async, element guards) is only instantiated for TF32_FALLBACK_TILES.
#   256x128 s3: 1 block/SM (147 KB), 8 warps of 64x64: the fewest operand bytes per flop.
#   128x128 s3: 2 blocks/SM (96 KB each): one block's epilogue and pipeline fill overlap the
#               other's main loop (GELU / residual / dgelu epilogues, short K).
#   256x128 s4: a 4-deep cp.async ring (193 KB, 1 block/SM).
#   192x128 s3: 6 warps of 64x64, 1 block/SM: M = 16384 rows make 86 row tiles, so N = 384
#               (3 column tiles) is 258 blocks = 1.95 waves of 132 SMs instead of 1.45 (73%).
TF32_TILES = ((256, 128, 32, 4, 2, 3), (128, 128, 32, 2, 2, 3), (128, 64, 32, 2, 2, 4),
              (64, 64, 32, 2, 2, 4), (256, 128, 32, 4, 2, 4), (192, 128, 32, 3, 2, 3))
TF32_FALLBACK_TILES = ((64, 64, 32, 2, 2, 4),)
# The cost model (`plan`, used without a measured table) only picks among these; the others are
# candidates for bench/tune.py, whose measurements decide.
TF32_PLAN_TILES = TF32_TILES[:4]
TF32_EFFICIENCY = {TF32_TILES[0]: 1.0, TF32_TILES[1]: 0.9, TF32_TILES[2]: 0.75, TF32_TILES[3]: 0.6,
                   TF32_TILES[4]: 1.0, TF32_TILES[5]: 0.95}
SMEM_PER_SM = 228 * 1024       # H100/H200; GemmTf32MinBlocks in gemm_tf32.cu uses the same

# Warpgroup-MMA tiles (kernels/gemm_wgmma.cu; sm_90a; A [M, K] and B [N, K] both K-major):
# (BM, BN, STAGES, LOADER), BM / 64 warpgroups of 128 threads, each computing 64 x BN; LOADER 0:
# every thread stages with cp.async (gemm_wgmma), 1: the bulk tensor copy engine (gemm_wgmma_tma).
#   128x128 s3: 97 KB, 2 blocks/SM: one block's epilogue overlaps the other's main loop (short K).
#   128x192 s4: N = 384 / 1152 / 1536 are 2 / 6 / 8 column tiles; 161 KB, 1 block/SM.
#   128x256 s4, 256x128 s4: the large tiles (193 KB), fewest operand bytes per flop.
#   128x64 s4: narrow outputs (the head's N = 65), 2 blocks/SM.
WGMMA_FILE = "gemm_wgmma.cu"
WGMMA_LOADERS = ("cp.async", "tma")
WGMMA_TILES = ((128, 128, 3, 0), (128, 192, 4, 0), (128, 256, 4, 0), (256, 128, 4, 0), (128, 64, 4, 0),
               (128, 128, 3, 1), (128, 192, 4, 1), (128, 256, 4, 1), (256, 128, 4, 1))
# rate relative to the mma.sync 256x128 tile (wgmma's dense TF32 peak is ~1.6x mma.sync's); set from
# bench/gemm.py --sweep on the H200: TMA beats cp.async by 5-20% at 192- and 256-wide tiles
WGMMA_EFFICIENCY = dict(zip(WGMMA_TILES, (1.35, 1.5, 1.5, 1.5, 1.1, 1.4, 1.65, 1.75, 1.7)))
WGMMA_ARCHS = ("sm_90",)       # compiled for sm_90a (compiler.ARCH_SPECIFIC)
# fp32 through three TF32 products (family "wgmma3", the TMA kernel with PRODUCTS = 3): each slot
# holds hi and lo tiles of both operands, twice a TF32 slot, so fewer stages fit: (BM, BN, STAGES, 1).
# A thread keeps two sets of BN / 2 accumulators (the sum and the k tile's partial), so only two
# warpgroups (BM 128, up to 255 registers a thread) fit without spilling.
WGMMA3_TILES = ((128, 128, 3, 1), (128, 192, 2, 1), (128, 64, 4, 1))
WGMMA3_EFFICIENCY = dict(zip(WGMMA3_TILES, (2.0, 2.1, 1.5)))

# gemm_simt.cu's transpose [K, N] -> [N, K] of transpose_b plans (split: the hi and lo halves of a
# wgmma3 operand), by (split, vec: float4 accesses)
TRANSPOSE_NAMES = {(split, vec): f"gemm_transpose<{str(split).lower()}, {str(vec).lower()}>"
                   for split in (False, True) for vec in (False, True)}
SPLIT_NAMES = {False: "tf32_split<false>", True: "tf32_split<true>"}   # gemm_simt.cu: the halves of an operand

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


def wgmma_name(tile, epi, has_bias, products=1) -> str:
    bm, bn, st, loader = tile
    if loader:
        return f"gemm_wgmma_tma<{bm},{bn},{st},{epi},{_b(has_bias)},{products}>"
    assert products == 1, "3xTF32 runs on the TMA kernel only"
    return f"gemm_wgmma<{bm},{bn},{st},{epi},{_b(has_bias)}>"


def _variants():
    out = []
    for (bm, bn), ta, tb, (epi, hb), vec in itertools.product(
            SIMT_TILES, (False, True), (False, True), EPI_COMBOS, (False, True)):
        out.append((SIMT_FILE, simt_name(bm, bn, ta, tb, epi, hb, vec), {}))
    for tile, ta, tb, (epi, hb), vec in itertools.product(
            TF32_TILES, (False, True), (False, True), EPI_COMBOS, (False, True)):
        if vec or tile in TF32_FALLBACK_TILES:
            out.append((TF32_FILE, tf32_name(tile, ta, tb, epi, hb, vec), {}))
    for tile, (epi, hb) in itertools.product(WGMMA_TILES, EPI_COMBOS):
        out.append((WGMMA_FILE, wgmma_name(tile, epi, hb), {}))
    for tile, (epi, hb) in itertools.product(WGMMA3_TILES, EPI_COMBOS):
        out.append((WGMMA_FILE, wgmma_name(tile, epi, hb, 3), {}))
    for epi, hb in EPI_COMBOS:
        out.append((SIMT_FILE, reduce_name(epi, hb), {}))
    for name in LADDER_NAMES:
        out.append((SIMT_FILE, name, {}))
    out += [(SIMT_FILE, n, {}) for n in (*TRANSPOSE_NAMES.values(), *SPLIT_NAMES.values())]
    out.append((TF32_FILE, "mma_probe", {}))
    out.append((TF32_FILE, "tf32_round_probe", {}))
    return out


VARIANTS = _variants()


# ---------------------------------------------------------------------------------------
# planning: block tile and split-K per shape
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    family: str          # "simt" | "tf32" | "wgmma" | "wgmma3" (fp32 as 3xTF32)
    tile: tuple          # (BM, BN) for simt, a TF32_TILES / WGMMA_TILES / WGMMA3_TILES entry
    threads: int
    blocks_per_sm: int
    splits: int
    k_chunk: int
    smem: int = 0
    transpose_b: bool = False   # wgmma on B [K, N]: B is first transposed into "gemm_bT" [N, K]
                                # (wgmma3: into "gemm_split_b" [2, N, K]; transpose_a: into
                                # "gemm_aT" after A^T, as [N, k slab])
    transpose_a: bool = False   # wgmma on A stored [K, M] (trans_a, the weight gradients): A is first
                                # transposed into "gemm_aT" [M, k slab] (TF32 only; wgmma3 splits it)
    k_slab: int = 0             # transpose_a: k rows per slab (a multiple of SPLIT_ALIGN, splits == 1);
                                # 0: the whole K at once

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
_L2_BYTES_PER_S = 9e12                # L2 -> SM operand streaming, all SMs together: the wgmma TMA kernel
                                      # streamed 3.2 GB of operand panels in 0.365 ms at 4096^3 (8.8 TB/s)
_LAUNCH_S = 3e-6
_TRANSPOSE_BYTES_PER_S = 3e12         # gemm_transpose<false> measured ~3.2 TB/s (bench/NOTES.md)
_L2_RESIDENT_BYTES = 40e6             # an operand above this (H200: 50 MB of L2) is re-read from DRAM
                                      # by every row of output tiles that sweeps it (see estimate_s)
_FILL_S = 1.5e-6                      # a block's pipeline fill: latency of its first operand tiles
_HIDDEN = 0.25                        # share of fill + epilogue not hidden when another block is resident


def _candidates(family, vec=True, tiles=None):
    """(tile, threads, blocks/SM, efficiency, smem) of the family's tiles (`tiles`: restrict to
    these; default: the cost model's own set)."""
    if family in ("wgmma", "wgmma3"):
        pool, eff, prod = ((WGMMA_TILES, WGMMA_EFFICIENCY, 1) if family == "wgmma" else
                           (WGMMA3_TILES, WGMMA3_EFFICIENCY, 3))
        return [(t, t[0] // 64 * 128, wgmma_blocks_per_sm(t, prod), eff[t], wgmma_smem(t, prod))
                for t in pool if vec and (tiles is None or t in tiles)]
    if family == "tf32" and TF32_TILES:
        pool = TF32_TILES if vec else TF32_FALLBACK_TILES
        if tiles is None:
            pool = [t for t in pool if t in TF32_PLAN_TILES]
        return [(t, t[3] * t[4] * 32, tf32_blocks_per_sm(t), TF32_EFFICIENCY[t], tf32_smem(t))
                for t in pool if tiles is None or t in tiles]
    return [(t, t[0] * t[1] // 64, SIMT_BLOCKS_PER_SM[t[0] * t[1] // 64], SIMT_EFFICIENCY[t], 0)
            for t in SIMT_TILES if tiles is None or t in tiles]


def tf32_smem(tile) -> int:
    """Dynamic shared memory of a TF32 tile: stages x (BM + BN) x BK floats."""
    bm, bn, bk, _, _, stages = tile
    return stages * (bm + bn) * bk * 4


def tf32_blocks_per_sm(tile) -> int:
    """Mirrors GemmTf32MinBlocks: as many as shared memory allows, 1..3."""
    return max(1, min(3, SMEM_PER_SM // (tf32_smem(tile) + 1024)))


def wgmma_smem(tile, products=1) -> int:
    """Dynamic shared memory of a wgmma tile: stages x (BM + BN) rows of 128 bytes (3xTF32: twice,
    hi and lo), plus 1 KB the kernel may skip to align its tiles to 1024 bytes (the swizzle's period)."""
    bm, bn, stages, _ = tile
    return stages * (bm + bn) * 128 * (2 if products == 3 else 1) + 1024


def wgmma_blocks_per_sm(tile, products=1) -> int:
    return max(1, min(2, SMEM_PER_SM // (wgmma_smem(tile, products) + 1024)))


def transpose_a_slab(M, N, K, trans_b, floats) -> int:
    """k rows per slab of a transpose_a plan whose scratch "gemm_aT" holds `floats`: K when A^T
    [M, K] (and B^T [N, K] after it, unless trans_b) fit, else the most whole 32-wide k tiles
    that do (0: not even one)."""
    per_k = M + (0 if trans_b else N)
    if per_k <= 0 or K <= 0:
        return 0
    if per_k * K <= floats:
        return K
    return min(K, floats // per_k // SPLIT_ALIGN * SPLIT_ALIGN)


def wgmma_mode(trans_a, trans_b, vec, K, N, batch, bt_floats, M=0, at_floats=0):
    """How the warpgroup-MMA kernel can run a product of this layout: "direct" (A and B K-major:
    trans_a = False, trans_b = True, 16-byte aligned operands), "transpose" (trans_b = False, one
    product, K % 4 == 0 and a B^T scratch of bt_floats holds [N, K]); trans_a (A stored [K, M]):
    one product, K % 4 == 0 (the slabs' rows are the tensor maps' 16-byte strides) and at least one
    32-wide k slab of A^T [M, k] (+ B^T [N, k]) fits the scratch "gemm_aT" of at_floats
    (`transpose_a_slab`): "transpose_ab" (trans_b = False: both operands transposed, at any
    alignment) or "transpose_a" (trans_b = True: B read in place, 16-byte aligned); else False."""
    if trans_a:
        if batch != 1 or K % 4 or (trans_b and not vec) or not transpose_a_slab(M, N, K, trans_b, at_floats):
            return False
        return "transpose_a" if trans_b else "transpose_ab"
    if not vec:
        return False
    if trans_b:
        return "direct"
    return "transpose" if batch == 1 and K % 4 == 0 and 0 < K * N <= bt_floats else False


def wgmma3_mode(trans_a, trans_b, vec, M, N, K, batch, a_floats, b_floats):
    """`wgmma_mode` for the 3xTF32 kernel: one product (batch 1: the tensor maps' third dim is hi /
    lo), K % 4 == 0 (the split rows are the tensor maps' 16-byte strides), whose split operands fit
    the workspaces: A's halves [2, M, K] in a_floats, B's [2, N, K] in b_floats. Both operands are
    split in either layout: A stored [K, M] (trans_a) is transposed by its split, B stored [K, N]
    by its split for "transpose"."""
    if batch != 1 or K % 4 or not 0 < 2 * M * K <= a_floats or not 0 < 2 * N * K <= b_floats:
        return False
    # the split passes read both operands at any alignment and write them densely, so a forced plan
    # runs on unaligned operands too (the cost model and bench/tune.py offer 3xTF32 for aligned ones)
    return wgmma_mode(False, trans_b, True, K, N, batch, b_floats)


def wgmma_device(rt) -> bool:
    """Whether rt's device runs the warpgroup-MMA kernels (sm_90; GPTCUDA_WGMMA=0: never)."""
    return getattr(rt, "arch", None) in WGMMA_ARCHS and os.environ.get("GPTCUDA_WGMMA", "1") != "0"


WGMMA_WORKSPACES = ("gemm_bT", "gemm_aT", "gemm_split_a", "gemm_split_b")   # scratch only the wgmma kernels read


def device_workspaces(ws: dict, rt) -> dict:
    """`workspace(cfg)`'s entries that rt's device uses: without the wgmma kernels (not sm_90, or
    GPTCUDA_WGMMA=0) the transposed-B / -A and 3xTF32 scratch would never be read."""
    if wgmma_device(rt):
        return dict(ws)
    return {k: v for k, v in ws.items() if k not in WGMMA_WORKSPACES}


def wgmma_layout_mode(precision, trans_a, trans_b, vec, M, N, K, batch, scratch: dict):
    """How a device that runs the warpgroup-MMA kernels can run this product: TF32 `wgmma_mode` with
    "gemm_bT" as the B^T scratch and "gemm_aT" as the A^T (+ B^T) slabs of trans_a products (the
    slab size: `transpose_a_slab`), fp32 as 3xTF32 (`wgmma3_mode`) with the split scratch
    "gemm_split_a" / "gemm_split_b" (fp32_gemm: 3xtf32); scratch: {name: floats} of the planned
    WGMMA_WORKSPACES (a missing one: none). False: not at all."""
    if precision == "tf32":
        return wgmma_mode(trans_a, trans_b, vec, K, N, batch, scratch.get("gemm_bT", 0), M,
                          scratch.get("gemm_aT", 0))
    if precision == "fp32":
        return wgmma3_mode(trans_a, trans_b, vec, M, N, K, batch, scratch.get("gemm_split_a", 0),
                           scratch.get("gemm_split_b", 0))
    return False


def wgmma_ok(rt, trans_a, trans_b, vec, K=0, N=0, batch=1, M=0):
    """`wgmma_layout_mode` of this launch with rt's planned workspaces where the kernels exist (an
    sm_90 device; GPTCUDA_WGMMA=0: never), else False."""
    if not wgmma_device(rt):
        return False
    return wgmma_layout_mode(getattr(rt, "precision", "fp32"), trans_a, trans_b, vec, M, N, K, batch,
                             {name: _ws_capacity(rt, name)[1] for name in WGMMA_WORKSPACES})


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


def split_chunk(K, splits):
    """k_chunk of a split count (a multiple of SPLIT_ALIGN), or None when `splits` chunks of that
    size would leave one empty."""
    if splits == 1:
        return K
    chunk = _cdiv(_cdiv(K, splits), SPLIT_ALIGN) * SPLIT_ALIGN
    return chunk if _cdiv(K, chunk) == splits else None


def make_plan(family, tile, splits, K, transpose_b=False, transpose_a=False, k_slab=0) -> Plan | None:
    """The Plan of a family / tile / split count for reduction length K (None: no such plan);
    transpose_b: a wgmma plan that first transposes B; transpose_a: a TF32 wgmma plan that first
    transposes A (stored [K, M]; with transpose_b B too) into "gemm_aT", in slabs of k_slab k rows
    (0 or >= K: all of K at once; else a multiple of SPLIT_ALIGN, and no split-K)."""
    if family not in ("simt", "tf32", "wgmma", "wgmma3") or not 1 <= splits <= MAX_SPLITS or K < 1:
        return None
    if transpose_b and family not in ("wgmma", "wgmma3"):
        return None
    k_slab = 0 if not transpose_a or k_slab >= K else int(k_slab)
    if transpose_a and (family != "wgmma" or k_slab < 0 or k_slab % SPLIT_ALIGN or (k_slab and splits > 1)):
        return None
    chunk = split_chunk(K, splits)
    if chunk is None:
        return None
    for t, threads, bps, _eff, smem in _candidates(family, True, tiles=[tile]) or \
            _candidates(family, False, tiles=[tile]):
        return Plan(family, t, threads, bps, splits, chunk, smem, transpose_b, transpose_a, k_slab)
    return None


def _efficiency(p: Plan) -> float:
    return {"tf32": TF32_EFFICIENCY, "wgmma": WGMMA_EFFICIENCY,
            "wgmma3": WGMMA3_EFFICIENCY}.get(p.family, SIMT_EFFICIENCY)[p.tile]


def b_reads(p: Plan, M, N, k_chunk, sm_count=132) -> int:
    """How often B comes from DRAM: the grid's x (N tiles) runs fastest, so a wave of sm_count x
    blocks_per_sm blocks covers a few rows of output tiles (or part of one), each sweeping all of
    B's panels; when B's part of one split, N x k_chunk floats (x2: 3xTF32 halves), is more than the
    L2 keeps, every later wave re-reads it: min(row tiles, waves) reads (the head's logits = lnf @
    wte^T, wte 154 MB: 64 reads of wte with 128-row tiles, 32 with 256-row tiles), else one."""
    halves = 2 if p.family == "wgmma3" else 1
    if 4.0 * halves * N * max(k_chunk, 1) <= _L2_RESIDENT_BYTES:
        return 1
    rows_, tiles = _cdiv(M, p.bm), _cdiv(M, p.bm) * _cdiv(N, p.bn)
    return max(1, min(rows_, _cdiv(tiles, sm_count * p.blocks_per_sm)))


def _gemm_estimate(p: Plan, M, N, K, k_chunk, batch, epi, sm_count) -> float:
    """estimate_s of the GEMM kernel (and split-K reduction) alone, reduction length K."""
    rate = {"simt": _FLOPS_PER_SM, "wgmma3": _TF32_FLOPS_PER_SM / 3}.get(p.family, _TF32_FLOPS_PER_SM)
    blocks = _cdiv(M, p.bm) * _cdiv(N, p.bn) * batch * p.splits
    t = _model_time(blocks, 2.0 * p.bm * p.bn * max(k_chunk, 1), p.threads, p.blocks_per_sm,
                    _efficiency(p), rate, sm_count)
    io = 1 if p.splits > 1 else EPI_IO[epi]
    per_block = _FILL_S + p.bm * p.bn * 4 * io / (_BYTES_PER_S / sm_count)
    per_sm = _cdiv(blocks, sm_count)
    t += per_sm * per_block * (_HIDDEN if p.blocks_per_sm >= 2 else 1.0)
    halves = 2 if p.family == "wgmma3" else 1
    t = max(t, 4.0 * batch * (halves * (M * K + b_reads(p, M, N, k_chunk, sm_count) * K * N) + M * N * io)
            / _BYTES_PER_S,
            4.0 * halves * blocks * (p.bm + p.bn) * max(k_chunk, 1) / _L2_BYTES_PER_S)
    if p.splits > 1:
        t += _LAUNCH_S + (2 * p.splits + EPI_IO[epi]) * M * N * 4 / _BYTES_PER_S
    return t


def estimate_s(p: Plan, M, N, K, batch=1, epi=EPI_NONE, sm_count=132) -> float:
    """Modelled seconds of one launch (split-K: both kernels): the busiest SM's main loops, plus
    per-block pipeline fill and epilogue stores (mostly hidden behind another resident block's
    main loop when blocks_per_sm >= 2), at least the DRAM traffic (B re-read where it outgrows
    the L2: `b_reads`) and the operand panels every block streams from L2; split-K adds its
    partials and the reduction; the re-layout passes (transposes, 3xTF32 splits) their bytes.
    transpose_a plans: the transposes of A (and B) at ~3 TB/s, then one GEMM per k slab, every
    slab after the first reading out back (the residual epilogue)."""
    if p.transpose_a:
        kc = p.k_slab or K
        n, last = _cdiv(K, kc), K - (_cdiv(K, kc) - 1) * kc
        t = _gemm_estimate(p, M, N, kc if n > 1 else K, kc if n > 1 else p.k_chunk, batch, epi, sm_count)
        if n > 1:
            t += (n - 2) * _gemm_estimate(p, M, N, kc, kc, batch, EPI_RESID, sm_count)
            t += _gemm_estimate(p, M, N, last, last, batch, EPI_RESID, sm_count)
        ops = 2 if p.transpose_b else 1
        return t + n * ops * _LAUNCH_S / 3 + \
            8.0 * batch * K * (M + (N if p.transpose_b else 0)) / _TRANSPOSE_BYTES_PER_S
    t = _gemm_estimate(p, M, N, K, p.k_chunk, batch, epi, sm_count)
    if p.family == "wgmma3":           # the split passes: read 4 bytes, write 8, per element of A and B
        t += 2 * _LAUNCH_S / 3 + 12.0 * (M * K + K * N) / _BYTES_PER_S
    elif p.transpose_b:
        t += _LAUNCH_S / 3 + 8.0 * batch * K * N / _BYTES_PER_S
    return t


# wgmma modes (`wgmma_mode`) -> (transpose_b, transpose_a) of the family's plans
_MODE_FLAGS = {"direct": (False, False), "transpose": (True, False), "transpose_ab": (True, True),
               "transpose_a": (False, True)}


def mode_flags(family, wgmma):
    """(transpose_b, transpose_a) of a `family` plan for a launch whose `wgmma_ok` answer is wgmma
    (the 3xTF32 family re-lays A [K, M] out in its split pass: no transpose_a)."""
    if family not in ("wgmma", "wgmma3") or not wgmma:
        return False, False
    tb, ta = _MODE_FLAGS.get(wgmma, (False, False))
    return (tb, ta) if family == "wgmma" else (wgmma == "transpose", False)


def _slab_epi_ok(epi) -> bool:
    """Whether a product in k slabs can apply this epilogue (linear ones: bias and residual on the
    first slab, the later ones add to out)."""
    return epi in (EPI_NONE, EPI_BIAS, EPI_RESID)


def plan(M, N, K, batch=1, sm_count=132, family="simt", max_ws=0, allow_split=True,
         vec=True, tiles=None, splits=None, epi=EPI_NONE, wgmma=False, k_slab=0) -> Plan:
    """The tile and split count with the lowest modelled time (`estimate_s`). max_ws: floats
    available for split-K partials (0 disables split-K); vec: whether 16-byte loads are possible
    (TF32 has its guarded fallback for fewer tiles); tiles / splits: restrict the candidates to
    these tiles / this split count (benchmarks, sweeps, tuning); epi: the epilogue code (its
    [M, N] traffic weighs on the choice); wgmma: `wgmma_ok`'s answer, the warpgroup-MMA tiles
    compete too ("transpose": their plans transpose B first; "transpose_ab" / "transpose_a": A
    (and B) first, in slabs of k_slab k rows (`transpose_a_slab`; 0: all of K), no split-K when
    that is less than K; for the simt family: the 3xTF32 tiles). A wgmma tile's tie with its TMA
    twin goes to the TMA loader (5-20% faster where measured)."""
    use_tf32 = family == "tf32" and bool(TF32_TILES)
    fams = ["tf32" if use_tf32 else "simt"]
    if wgmma:
        fams.append("wgmma" if use_tf32 else "wgmma3")
    best = None
    for fam in fams:
        tb, ta = mode_flags(fam, wgmma)
        slab = k_slab if ta and 0 < k_slab < K else 0
        if slab and (not _slab_epi_ok(epi) or slab % SPLIT_ALIGN):
            continue
        # transpose_ab re-lays both operands out densely: the tiles' 16-byte loads read the scratch
        for tile, threads, bps, _eff, smem in _candidates(fam, vec or (ta and tb), tiles):
            blocks = _cdiv(M, tile[0]) * _cdiv(N, tile[1]) * batch
            split_opts = [1]
            if splits is not None:
                split_opts = [splits]
            elif allow_split and batch == 1 and max_ws > 0 and K >= 2 * SPLIT_ALIGN and not slab \
                    and blocks < (4 if fam == "wgmma" else 1) * sm_count * bps:
                # wgmma: also past one wave (a long K over few output tiles, the head's dlnf =
                # dlogits @ wte: 192 256x128 tiles, 1.45 waves; split 2: 2.9)
                split_opts = range(1, min(MAX_SPLITS, _cdiv(K, SPLIT_ALIGN)) + 1)
            for s in split_opts:
                chunk = split_chunk(K, s)
                if chunk is None or (s > 1 and (s * M * N > max_ws or s > MAX_GRID_Z or slab)):
                    continue
                p = Plan(fam, tile, threads, bps, s, chunk, smem, tb, ta, slab)
                cp_async = fam == "wgmma" and tile[3] == 0      # a tie with its TMA twin: TMA
                key = (estimate_s(p, M, N, K, batch, epi, sm_count), s, -tile[0] * tile[1], cp_async)
                if best is None or key < best[0]:
                    best = (key, p)
    if best is None:
        raise ValueError(f"no GEMM plan for M={M} N={N} K={K} batch={batch} {family} tiles={tiles} "
                         f"split={allow_split}")
    return best[1]


# Split counts the tuner tries (besides the cost model's own choice).
TUNE_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def tune_candidates(M, N, K, batch=1, family="simt", vec=True, max_ws=0, wgmma=False, epi=EPI_NONE,
                    k_slab=0) -> list:
    """Every plan bench/tune.py may time for a shape: each tile of the family that can run it
    (unaligned operands: the fallback tiles only; wgmma: the warpgroup-MMA tiles too, transpose_a
    ones in slabs of k_slab (0: all of K; no split-K and only linear epilogues `epi` when less)) x
    each split count that fits the workspace."""
    fam = "tf32" if family == "tf32" and TF32_TILES else "simt"
    tiles = (TF32_TILES if vec else TF32_FALLBACK_TILES) if fam == "tf32" else SIMT_TILES
    pool = [(fam, t) for t in tiles]
    if wgmma and (vec or wgmma == "transpose_ab" and fam == "tf32"):
        pool += [("wgmma", t) for t in WGMMA_TILES] if fam == "tf32" else [("wgmma3", t) for t in WGMMA3_TILES]
    out = []
    for fam, tile in pool:
        tb, ta = mode_flags(fam, wgmma)
        slab = k_slab if ta and 0 < k_slab < K else 0
        if slab and not _slab_epi_ok(epi):
            continue
        for s in TUNE_SPLITS:
            if s > 1 and (batch != 1 or s * M * N > max_ws or K < 2 * SPLIT_ALIGN or slab):
                continue
            p = make_plan(fam, tile, s, K, tb, ta, slab)
            if p is not None and p not in out:
                out.append(p)
    return out


def prune_candidates(cands, M, N, K, batch=1, epi=EPI_NONE, sm_count=132, keep=1.6, max_n=6,
                     always=()):
    """The candidates worth timing: modelled time (`estimate_s`) within `keep` x the best, at most
    max_n of them, fastest first; plans in `always` (the cost model's choice) are kept."""
    scored = sorted(((estimate_s(p, M, N, K, batch, epi, sm_count), i, p) for i, p in enumerate(cands)),
                    key=lambda x: (x[0], x[1]))
    if not scored:
        return []
    best = scored[0][0]
    out = [p for t, _, p in scored if t <= keep * best][:max_n]
    for p in always:
        if p not in out:
            out.append(p)
    return out


def _weight_grad_shapes(cfg):
    C = cfg.n_embd
    V = cfg.vocab_size
    shapes = [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]
    if V:
        shapes.append((V, C))
    return shapes


HEAD_SLABS = 4


def workspace(cfg) -> dict:
    """Split-K partials for the weight-gradient GEMMs (K = batch_size * block_size tokens),
    sized for both orientations (dW and dW^T) and both kernel families at 132 SMs; the wgmma
    kernels' re-laid operands (WGMMA_WORKSPACES: TF32 "gemm_bT" and "gemm_aT", fp32 with
    fp32_gemm 3xtf32 "gemm_split_a" / "gemm_split_b"). bench/tune.py only times splits that fit
    this size."""
    K = cfg.batch_size * cfg.block_size
    need = 0
    for (m, n) in _weight_grad_shapes(cfg):
        for (M, N) in ((m, n), (n, m)):
            for fam in ("simt", "tf32"):
                p = plan(M, N, K, 1, 132, fam, max_ws=MAX_SPLITS * M * N)
                if p.splits > 1:
                    need = max(need, p.splits * M * N)
    out = {"gemm_splitk": ((need,), "f32")} if need else {}
    w_max = max(m * n for m, n in _weight_grad_shapes(cfg))
    if getattr(cfg, "precision", "fp32") == "tf32":
        # B^T of the backward's dX = dY @ W (W [out, in]: [C, 4C] the largest), for the wgmma kernel
        out["gemm_bT"] = ((w_max,), "f32")
        # A^T and B^T of a weight gradient dW = dY^T @ X (trans_a) for the wgmma kernel, [out + in,
        # tokens] of the per-layer weights (the MLP's 4C + C the largest: 126 MB at C 768 and 8192
        # tokens); the tied head's dwte (V + C rows) runs in k slabs of it, at most HEAD_SLABS
        # (every slab after the first reads and writes dwte [V, C] once more: 0.3 GB at GPT-2's V)
        layer_shapes = _weight_grad_shapes(cfg)[:4]
        V = int(getattr(cfg, "vocab_size", 0) or 0)
        head = (V + cfg.n_embd) * _cdiv(K, HEAD_SLABS) if V else 0
        out["gemm_aT"] = ((max(max((m + n) * K for m, n in layer_shapes), head),), "f32")
    elif getattr(cfg, "fp32_gemm", "ffma") == "3xtf32":
        # the hi and lo halves of the 3xTF32 operands, up to [tokens, 4C] each: A the MLP's second
        # product's input, the backward's dY of the first or, transposed, a weight gradient's dY;
        # B a weight (or its transpose) or, transposed, a weight gradient's input activation
        out["gemm_split_a"] = ((2 * K * 4 * cfg.n_embd,), "f32")
        out["gemm_split_b"] = ((2 * max(w_max, K * 4 * cfg.n_embd),), "f32")
    return out


# ---------------------------------------------------------------------------------------
# the measured table (written by bench/tune.py)
# ---------------------------------------------------------------------------------------
TUNE_FORMAT = 1
_tables: dict = {}           # path -> {key: Plan}
_source_hash = None


def source_hash() -> str:
    """sha256 of the GEMM kernel sources with their includes expanded: a table measured on other
    sources is not used."""
    global _source_hash
    if _source_hash is None:
        from .. import compiler
        h = hashlib.sha256()
        for f in (SIMT_FILE, TF32_FILE, WGMMA_FILE):
            h.update(f.encode() + b"\0" + compiler.expand_source(f).encode() + b"\0")
        _source_hash = h.hexdigest()
    return _source_hash


def tune_key(precision, trans_a, trans_b, epilogue, has_bias, M, N, K, batch=1) -> str:
    """Table key: precision, transposes, the op's epilogue (+bias), the shape and the batch."""
    return (f"{precision}:{'T' if trans_a else 'N'}{'T' if trans_b else 'N'}:"
            f"{epilogue}{'+bias' if has_bias else ''}:{int(M)}x{int(N)}x{int(K)}:b{int(batch)}")


def table_path(gpu_name: str, src_hash: str | None = None) -> Path:
    """<compile cache>/tune/<gpu>-<first 16 hex of the source hash>.json"""
    from .. import compiler
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-") or "gpu"
    return compiler.cache_dir() / "tune" / f"{slug}-{(src_hash or source_hash())[:16]}.json"


def plan_to_json(p: Plan) -> dict:
    d = {"family": p.family, "tile": list(p.tile), "splits": p.splits, "k_chunk": p.k_chunk}
    if p.transpose_b:
        d["transpose_b"] = True
    if p.transpose_a:
        d["transpose_a"] = True
        if p.k_slab:
            d["k_slab"] = p.k_slab
    return d


def plan_from_json(d: dict, K: int) -> Plan | None:
    """The Plan an entry names, rebuilt for reduction length K (None if it is not a valid plan)."""
    try:
        tile = tuple(int(x) for x in d["tile"])
        p = make_plan(str(d["family"]), tile, int(d["splits"]), int(K), bool(d.get("transpose_b", False)),
                      bool(d.get("transpose_a", False)), int(d.get("k_slab", 0)))
    except (KeyError, TypeError, ValueError):
        return None
    if p is None or p.k_chunk != int(d.get("k_chunk", p.k_chunk)):
        return None
    return p


def _key_K(key: str) -> int:
    return int(key.split(":")[3].split("x")[2])


def load_table(gpu_name: str, src_hash: str | None = None, refresh: bool = False) -> dict:
    """{key: Plan} of the table for this GPU and these kernel sources ({} when there is none, or
    it is unreadable, or was written for another GPU / other sources). Read once per process."""
    path = table_path(gpu_name, src_hash)
    cached = _tables.get(str(path))
    if cached is not None and not refresh:
        return cached
    table = {}
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") == TUNE_FORMAT and doc.get("gpu") == gpu_name and \
                doc.get("source_hash") == (src_hash or source_hash()):
            for key, entry in doc.get("entries", {}).items():
                p = plan_from_json(entry, _key_K(key))
                if p is not None:
                    table[key] = p
    except (OSError, ValueError, AttributeError, IndexError):
        table = {}
    _tables[str(path)] = table
    return table


def save_table(gpu_name: str, entries: dict, src_hash: str | None = None, meta: dict | None = None,
               merge: bool = True) -> Path:
    """Write {key: entry dict (plan_to_json + anything else)} atomically, merged over the entries
    already there; the process's cached copy is refreshed."""
    src_hash = src_hash or source_hash()
    path = table_path(gpu_name, src_hash)
    doc = {"format": TUNE_FORMAT, "gpu": gpu_name, "source_hash": src_hash, "entries": {}}
    if merge:
        try:
            old = json.loads(path.read_text())
            if old.get("format") == TUNE_FORMAT and old.get("source_hash") == src_hash:
                doc["entries"].update(old.get("entries", {}))
        except (OSError, ValueError, AttributeError):
            pass
    doc["entries"].update(entries)
    if meta:
        doc["meta"] = meta
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _tables.pop(str(path), None)
    load_table(gpu_name, src_hash)
    return path


def tuned_plan(rt, key: str, vec: bool, ws_floats: int, M: int, N: int, wgmma=False) -> Plan | None:
    """The table's plan for `key` if there is one this launch can use (its alignment allows the
    tile, the workspace holds its split, wgmma: `wgmma_ok` for this launch; transpose_a: rt's
    "gemm_aT" holds its k slab, and its epilogue is linear where it runs in slabs), else None."""
    if os.environ.get("GPTCUDA_GEMM_TUNE", "1") == "0":
        return None
    name = getattr(getattr(rt, "info", None), "name", None)
    if not isinstance(name, str):
        return None
    p = load_table(name).get(key)
    if p is None:
        return None
    slab = 0
    if p.transpose_a:            # the key names the layout, K and the epilogue
        _, trans, epilogue, _, _ = key.split(":")
        K = _key_K(key)
        slab = rt_transpose_a_slab(rt, M, N, K, trans[1] == "T")
        if p.k_slab and not _slab_epi_ok(EPILOGUE_CODES.get(epilogue.split("+")[0], -1)):
            return None
    if _plan_unfit(p, _family(rt), vec, wgmma, slab):
        return None
    if p.splits > 1 and p.splits * M * N > ws_floats:
        return None
    return p


# ---------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------
def _check_f32(label, **views):
    for k, v in views.items():
        if v is not None and getattr(v, "dtype", "f32") != "f32":
            raise TypeError(f"{label}: {k} must be f32, got {v.dtype}")


def _aligned(*xs):
    return all(int(x) % 4 == 0 for x in xs)


def _ws_capacity(rt, name="gemm_splitk"):
    """(view, floats) of a planned GEMM workspace: split-K partials or the wgmma kernels' scratch
    (WGMMA_WORKSPACES) ((None, 0) when the plan has none)."""
    try:
        ws = rt.workspace(name)
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
    if p.family in ("wgmma", "wgmma3") and (ta or not tb or not vec):
        raise AssertionError(f"{label}: the wgmma kernel needs K-major, 16-byte aligned A and B")
    operands = [a, b]
    if p.family == "wgmma3":     # TMA over the split halves: {K, rows, 2 (hi, lo)}, dense
        operands = [rt.tensor_map(x, (K, rows, 2), (4 * K, 4 * rows * K), (32, box, 1))
                    for x, rows, box in ((a, M, p.bm), (b, N, p.bn))]
    elif p.family == "wgmma" and p.tile[3]:       # TMA: tensor maps {K, rows, batch} in place of pointers
        operands = [rt.tensor_map(x, (K, rows, batch), (4 * ld, 4 * max(stride, rows * ld)), (32, box, 1))
                    for x, rows, ld, stride, box in ((a, M, lda, sA, p.bm), (b, N, ldb, sB, p.bn))]
    if p.splits > 1:
        # partials: plain store into ws [splits, M, N], then the fixed-order reduction + epilogue
        name = _kernel_name(p, ta, tb, EPI_NONE, False, vec)
        fn = rt.function(_file(p), name)
        grid = (_cdiv(N, p.bn), _cdiv(M, p.bm), p.splits)
        rt.launch(fn, grid, (p.threads,), _gemm_args(p, ws, None, operands, None, M, N, K, lda, ldb, N,
                                                      0, 0, M * N, 1.0, p.splits, p.k_chunk),
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
    rt.launch(fn, grid, (p.threads,), _gemm_args(p, out, aux, operands, bias, M, N, K, lda, ldb, ldc,
                                                  sA, sB, sC, alpha, 1, max(K, 1)),
              smem=p.smem, label=label)


def _gemm_args(p: Plan, C, aux, operands, bias, M, N, K, lda, ldb, ldc, sA, sB, sC, alpha, splits, k_chunk):
    """The argument block of a GEMM kernel (the TMA kernel takes tensor maps and no A/B strides)."""
    if p.family == "wgmma3" or (p.family == "wgmma" and p.tile[3]):
        return [C, aux, *operands, bias, i32(M), i32(N), i32(K), i32(ldc), u64(sC), f32(alpha),
                i32(splits), i32(k_chunk)]
    return [C, aux, *operands, bias, i32(M), i32(N), i32(K), i32(lda), i32(ldb), i32(ldc),
            u64(sA), u64(sB), u64(sC), f32(alpha), i32(splits), i32(k_chunk)]


def _file(p: Plan):
    return {"tf32": TF32_FILE, "wgmma": WGMMA_FILE, "wgmma3": WGMMA_FILE}.get(p.family, SIMT_FILE)


def _kernel_name(p: Plan, ta, tb, epi, has_bias, vec):
    if p.family in ("wgmma", "wgmma3"):
        return wgmma_name(p.tile, epi, has_bias, 3 if p.family == "wgmma3" else 1)
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


def _plan_unfit(p: Plan, family, vec, wgmma, slab=0) -> str | None:
    """Why plan p cannot run a launch of kernel family `family` (rt.precision's), alignment `vec`
    and `wgmma_ok` answer `wgmma` (slab: the k rows per slab rt's "gemm_aT" holds for it, 0: all
    of K, `rt_transpose_a_slab`); None when it can. (A table entry that does not fit is skipped; a
    plan the caller forces is refused with this reason.)"""
    if p.family in ("wgmma", "wgmma3"):
        base = "tf32" if p.family == "wgmma" else "simt"
        if family != base:
            return f"plan family {p.family} but rt.precision wants {family}"
        if not wgmma:
            return ("a wgmma plan needs sm_90 with K-major, aligned A and B, or their transposes in the "
                    "gemm_bT / gemm_aT workspaces" if p.family == "wgmma" else
                    "a wgmma3 plan needs sm_90, K % 4 == 0, one product and the gemm_split_a/_b workspaces")
        want_tb, want_ta = mode_flags(p.family, wgmma)
        if p.transpose_a != want_ta:
            return (f"a wgmma plan {'with' if p.transpose_a else 'without'} transpose_a does not fit "
                    f"trans_a here")
        if p.transpose_b != want_tb:
            return f"a wgmma plan {'with' if p.transpose_b else 'without'} transpose_b does not fit trans_b here"
        if p.transpose_a and slab and (p.k_slab == 0 or p.k_slab > slab):
            return (f"the gemm_aT workspace holds k slabs of {slab or 'all'} rows here, the plan needs "
                    f"{p.k_slab or 'all of K'}")
    elif p.family != family:
        return f"plan family {p.family} but rt.precision wants {family}"
    if p.family == "tf32" and not vec and p.tile not in TF32_FALLBACK_TILES:
        return f"TF32 tile {p.tile} needs 16-byte aligned operands"
    return None


def _check_plan(label, p: Plan, family, vec, batch, cap, M, N, K, wgmma=False, slab=0, epi=EPI_NONE):
    """A plan given by the caller must be runnable here (wgmma: `wgmma_ok` for this launch;
    transpose_a: slab as in `_plan_unfit`, a linear epilogue when it runs in k slabs)."""
    why = _plan_unfit(p, family, vec, wgmma, slab)
    if why:
        raise ValueError(f"{label}: {why}")
    if p.k_slab and not _slab_epi_ok(epi):
        raise ValueError(f"{label}: a plan in k slabs adds them through the residual epilogue: "
                         f"epilogue {epi} cannot run in slabs")
    if p.splits > 1:
        if batch != 1:
            raise ValueError(f"{label}: split-K is not available for batched GEMMs")
        if cap < p.splits * M * N:
            raise ValueError(f"{label}: workspace gemm_splitk holds {cap} floats < {p.splits} x {M} x {N}")
        if split_chunk(K, p.splits) != p.k_chunk:
            raise ValueError(f"{label}: k_chunk {p.k_chunk} does not split K={K} into {p.splits}")


def matmul_plan(rt, p: Plan, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none",
                aux=None):
    """matmul with a given plan (benchmarks, tile sweeps, bench/tune.py). Split-K plans read
    rt.workspace("gemm_splitk")."""
    matmul(rt, out, a, b, trans_a, trans_b, bias=bias, epilogue=epilogue, aux=aux, plan=p)


def kernel_label(p: Plan, trans_a, trans_b, vec=True) -> str:
    """Short description of a plan: family, tile, split."""
    tile = "x".join(str(x) for x in p.tile[:2])
    if p.family == "tf32":
        tile += f"x{p.tile[2]} w{p.tile[3]}x{p.tile[4]} s{p.tile[5]}"
    elif p.family in ("wgmma", "wgmma3"):
        tile += f"x32 s{p.tile[2]} {WGMMA_LOADERS[p.tile[3]]}"
        if p.transpose_a:
            tile += (" A^T, B^T first" if p.transpose_b else " A^T first") + \
                (f" in k slabs of {p.k_slab}" if p.k_slab else "")
        elif p.transpose_b:
            tile += " B^T first"
    t = ("T" if trans_a else "N") + ("T" if trans_b else "N")
    return f"{p.family} {tile} {t}{'' if vec else ' unaligned'}" + (f" splitK={p.splits}" if p.splits > 1 else "")


def plan_label(p: Plan) -> str:
    """Compact plan name for tables: tf32 256x128s3, simt 128x128, + /splitK."""
    tile = f"{p.tile[0]}x{p.tile[1]}"
    if p.family == "tf32":
        tile += f"s{p.tile[5]}"
    elif p.family in ("wgmma", "wgmma3"):
        tile += f"s{p.tile[2]}" + ("tma" if p.tile[3] else "")
    if p.transpose_a:
        tile += (" +aT" if p.transpose_b else " +aT,b") + (f" slab{p.k_slab}" if p.k_slab else "")
    elif p.transpose_b:
        tile += " +bT"
    return f"{p.family} {tile}" + (f" split{p.splits}" if p.splits > 1 else "")


def matmul_dims(out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None):
    """Validate a matmul's views; returns (M, N, K, lda, ldb, epi code, has_bias)."""
    if epilogue not in EPILOGUE_CODES:
        raise ValueError(f"matmul: epilogue {epilogue!r} is not one of {tuple(EPILOGUE_CODES)}")
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


def matmul(rt, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None, plan=None):
    """out[M, N] = op(a) @ op(b) (+ bias), then the epilogue (see module docstring). `plan`
    forces a plan (benchmarks, bench/tune.py); otherwise the measured table, else the cost model."""
    M, N, K, lda, ldb, epi, has_bias = matmul_dims(out, a, b, trans_a, trans_b, bias, epilogue, aux)
    family = _family(rt)
    ws, cap = _ws_capacity(rt)
    vec = _vec_ok(a, b, lda, ldb, 0, 0)
    wg = wgmma_ok(rt, trans_a, trans_b, vec, K, N, 1, M)
    slab = rt_transpose_a_slab(rt, M, N, K, trans_b) if wg in ("transpose_ab", "transpose_a") else 0
    label = f"matmul[{M}x{N}x{K}]"
    p = plan
    if p is not None:
        _check_plan(label, p, family, vec, 1, cap, M, N, K, wg, slab, epi)
    else:
        key = tune_key(rt.precision, trans_a, trans_b, epilogue, has_bias, M, N, K, 1)
        p = tuned_plan(rt, key, vec, cap, M, N, wg)
    if p is None:
        p = _plan_fn(M, N, K, 1, rt.info.sm_count, family, max_ws=cap, vec=vec, epi=epi, wgmma=wg, k_slab=slab)
    if p.transpose_a:
        _matmul_transposed_a(rt, p, out, aux, a, b, bias, M, N, K, trans_b, epi, has_bias, ws, label)
        return
    if p.family == "wgmma3":
        a, b = _split_operands(rt, a, b, trans_a, trans_b, M, N, K, lda, ldb, label)
        trans_a, trans_b, lda, ldb = False, True, K, K
    elif p.transpose_b:
        b, trans_b, ldb = _transpose_b(rt, b, K, N, label), True, K
    _launch_gemm(rt, p, out, aux, a, b, bias, M, N, K, lda, ldb, N, 0, 0, M * N, 1.0,
                 trans_a, trans_b, epi, has_bias, 1, ws=ws, label=label)


_plan_fn = plan      # `matmul(..., plan=)` shadows the function's name inside matmul


def _scratch(rt, name, shape, label):
    ws, cap = _ws_capacity(rt, name)
    shape = (shape,) if isinstance(shape, int) else shape
    n = math.prod(shape)
    if ws is None or cap < n:
        raise ValueError(f"{label}: this plan needs the workspace {name} of {n} floats")
    return DeviceView(ws.ptr, tuple(shape), "f32", name)


TRANSPOSE_TILE = 64     # gemm_transpose's square tile


def _transpose_into(rt, out, x, K, N, split, label, what="B^T"):
    """x [K, N] (dense) -> out [N, K], or its hi and lo halves [2, N, K] when split."""
    vec = K % 4 == 0 and N % 4 == 0 and x.ptr % 16 == 0 and out.ptr % 16 == 0
    rt.launch(rt.function(SIMT_FILE, TRANSPOSE_NAMES[split, vec]),
              (_cdiv(N, TRANSPOSE_TILE), _cdiv(K, TRANSPOSE_TILE)), (256,),
              [out, x, i32(K), i32(N)], label=f"{label}:{what}")


def rt_transpose_a_slab(rt, M, N, K, trans_b) -> int:
    """k rows per slab of a transpose_a plan in rt's "gemm_aT" (`transpose_a_slab`), 0 when all of
    K fits at once (or not even one slab: then `wgmma_ok` answers False)."""
    slab = transpose_a_slab(M, N, K, trans_b, _ws_capacity(rt, "gemm_aT")[1])
    return 0 if slab >= K else slab


def _matmul_transposed_a(rt, p: Plan, out, aux, a, b, bias, M, N, K, trans_b, epi, has_bias, ws, label):
    """A transpose_a plan: per k slab [k0, k0 + kc) (all of K when p.k_slab is 0), A's rows k0 ..
    of [K, M] (a contiguous sub-view) -> "gemm_aT" as [M, kc], B's rows of [K, N] -> after it as
    [N, kc] (trans_b: B [N, K] is read in place, columns k0 ..), then the K-major wgmma product;
    the first slab applies the epilogue, the later ones add to out (residual with aux = out), in
    slab order: deterministic."""
    kc = p.k_slab or K
    at = _scratch(rt, "gemm_aT", (M + (0 if trans_b else N)) * min(kc, K), label)
    for k0 in range(0, K, kc):
        kl = min(kc, K - k0)
        a_t = DeviceView(at.ptr, (M, kl), "f32", "gemm_aT")
        _transpose_into(rt, a_t, DeviceView(a.ptr + 4 * k0 * M, (kl, M), "f32", "A slab"), kl, M, False,
                        label, "A^T")
        if trans_b:
            b_op, ldb = DeviceView(b.ptr + 4 * k0, (N, kl), "f32", "B slab"), K
        else:
            b_op, ldb = DeviceView(at.ptr + 4 * M * kl, (N, kl), "f32", "gemm_aT"), kl
            _transpose_into(rt, b_op, DeviceView(b.ptr + 4 * k0 * N, (kl, N), "f32", "B slab"), kl, N, False,
                            label, "B^T")
        first = k0 == 0
        _launch_gemm(rt, p, out, aux if first else out, a_t, b_op, bias if first else None, M, N, kl, kl, ldb,
                     N, 0, 0, M * N, 1.0, False, True, epi if first else EPI_RESID, has_bias and first, 1,
                     ws=ws, label=label if K == kl else f"{label}:k{k0}")


def _transpose_b(rt, b, K, N, label):
    """B [K, N] -> the workspace "gemm_bT" as [N, K] (the operand of a transpose_b plan)."""
    bt = _scratch(rt, "gemm_bT", (N, K), label)
    _transpose_into(rt, bt, b, K, N, False, label)
    return bt


def _split_into(rt, out, x, rows_, cols, ld, label, what):
    vec = x.ptr % 16 == 0 and cols % 4 == 0 and ld % 4 == 0
    groups = rows_ * _cdiv(cols, 4)
    blocks = max(1, min(_cdiv(groups, 256), rt.info.sm_count * 8))
    rt.launch(rt.function(SIMT_FILE, SPLIT_NAMES[vec]), (blocks,), (256,),
              [out, x, i32(rows_), i32(cols), i32(ld)], label=f"{label}:split {what}")


def _split_operands(rt, a, b, trans_a, trans_b, M, N, K, lda, ldb, label):
    """The operands of a 3xTF32 plan: A, [M, K] or [K, M] (trans_a: transposed on the way), ->
    "gemm_split_a" [2, M, K] (hi, lo); B, [N, K] (trans_b) or [K, N] (transposed on the way), ->
    "gemm_split_b" [2, N, K]."""
    sa = _scratch(rt, "gemm_split_a", (2, M, K), label)
    sb = _scratch(rt, "gemm_split_b", (2, N, K), label)
    if trans_a:
        _transpose_into(rt, sa, a, K, M, True, label, "split A^T")
    else:
        _split_into(rt, sa, a, M, K, lda, label, "A")
    if trans_b:
        _split_into(rt, sb, b, N, K, ldb, label, "B")
    else:
        _transpose_into(rt, sb, b, K, N, True, label, "split B^T")
    return sa, sb


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
    lda = M if trans_a else K
    ldb = N if not trans_b else K
    return batch, M, N, K, lda, ldb


def matmul_batched(rt, out, a, b, trans_a=False, trans_b=False, alpha=1.0, plan=None):
    """out[..., M, N] = alpha * op(a[...]) @ op(b[...]); leading dims flatten into the batch."""
    batch, M, N, K, lda, ldb = matmul_batched_dims(out, a, b, trans_a, trans_b)
    family = _family(rt)
    vec = _vec_ok(a, b, lda, ldb, M * K, K * N)
    # the batched launch re-lays nothing out: K-major operands only
    wg = wgmma_ok(rt, trans_a, trans_b, vec, K, N, batch) == "direct" and "direct"
    label = f"matmul_batched[{batch}x{M}x{N}x{K}]"
    p = plan
    if p is not None:
        _check_plan(label, p, family, vec, batch, 0, M, N, K, wg)
    else:
        p = tuned_plan(rt, tune_key(rt.precision, trans_a, trans_b, "none", False, M, N, K, batch), vec, 0, M, N, wg)
    if p is None:
        p = _plan_fn(M, N, K, batch, rt.info.sm_count, family, max_ws=0, allow_split=False, vec=vec, wgmma=wg)
    _launch_gemm(rt, p, out, None, a, b, None, M, N, K, lda, ldb, N, M * K, K * N, M * N,
                 float(alpha), trans_a, trans_b, EPI_NONE, False, batch, label=label)


__all__ = ["matmul", "matmul_batched", "matmul_plan", "workspace", "plan", "kernel_label",
           "VARIANTS", "Plan", "tune_key", "tuned_plan", "load_table", "save_table", "table_path",
           "source_hash", "tune_candidates", "prune_candidates", "estimate_s", "make_plan", "wgmma_ok",
           "wgmma_mode", "wgmma3_mode", "wgmma_layout_mode", "wgmma_device", "transpose_a_slab",
           "mode_flags"]
