"""The GEMM kernel families: one table (FAMILIES) of what the planner and the launchers need to
know about each (kernel file, tiles, block size, shared memory, resident blocks, kernel name,
argument layout, modelled rate), the epilogue codes, and the catalogue of compiled variants
(VARIANTS).

    simt    fp32 on the CUDA cores (kernels/gemm_simt.cu), every layout, aligned or not
    tf32    TF32 mma.sync (kernels/gemm_tf32.cu), every layout; unaligned operands on a few tiles
    wgmma   TF32 warpgroup MMA (kernels/gemm_wgmma.cu, sm_90a): K-major A and B only
    wgmma3_ra  fp32 as three TF32 warpgroup-MMA products (3xTF32) over A and B as stored: A split into
               hi and lo halves in the consumers' registers, B split (and turned K-major) in shared memory
    wgmma_ra  TF32 A^T B with A [K, M] as stored read through registers, B K-major (or B^T first)
    wgmma_ra_mn  the same with B [K, N] as stored, turned K-major by the producers
    wgmma_ra_t  TF32 A^T B as (B^T A)^T: B [K, N] through registers, A^T first, out stored transposed
    bf16    BF16 warpgroup MMA (gemm_wgmma_ws with DT 1): every layout as stored, C bf16 or fp32

The execution plan picks a base family (ExecutionPlan.gemm_family); on sm_90 its warpgroup-MMA
families compete with it (`Family.partners`) for the layouts each runs (`Family.layouts`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from gptcuda.runtime.execution import WGMMA_ARCHS  # noqa: F401 (gemm/__init__ re-exports it)
from gptcuda.ops.cuda import DTYPE_CODES, cdiv, expression  # noqa: F401 (plan.py, launch.py and gemm/__init__ import cdiv from here)

SIMT_FILE = "gemm_simt.cu"
TF32_FILE = "gemm_tf32.cu"
WGMMA_FILE = "gemm_wgmma.cu"

# Epilogue codes shared with the kernels (GEMM_EPI_* in kernels/gemm_epilogue.cuh).
EPI_NONE, EPI_BIAS, EPI_GELU, EPI_RESID, EPI_DGELU = 0, 1, 2, 3, 4
# The op interface's epilogue names (backend.EPILOGUES plus "dgelu") -> kernel code without bias.
EPILOGUE_CODES = {"none": EPI_NONE, "gelu": EPI_GELU, "residual": EPI_RESID, "dgelu": EPI_DGELU}
AUX_EPILOGUES = ("gelu", "residual", "dgelu")
# (EPI, HAS_BIAS) pairs a launcher can ask for (dgelu never takes a bias).
EPI_COMBOS = ((EPI_NONE, False), (EPI_BIAS, True), (EPI_GELU, False), (EPI_GELU, True),
              (EPI_RESID, False), (EPI_RESID, True), (EPI_DGELU, False))
# The products the op interface asks for, by (trans_a, trans_b): x @ W^T with any epilogue and bias, dY @ W
# plain or with the GELU backward folded in, the weight gradients dY^T @ X plain (batched: these three
# layouts, plain). Every family's kernels are compiled for these alone, in the layout each kernel reads
# (after B^T first: A @ B as x @ W^T, A^T B as A^T (B^T)^T; Family.combos).
PRODUCTS = {(False, True): tuple(e for e in EPI_COMBOS if e[0] != EPI_DGELU),
            (False, False): ((EPI_NONE, False), (EPI_DGELU, False)),
            (True, False): ((EPI_NONE, False),)}
# [M, N] arrays an epilogue moves through DRAM: the output, plus aux written (GELU) or read.
EPI_IO = {EPI_NONE: 1, EPI_BIAS: 1, EPI_GELU: 2, EPI_RESID: 2, EPI_DGELU: 2}

# SIMT block tiles (BM, BN): threads = BM*BN/64 (an 8x8 tile a thread); blocks resident per SM by threads
# (register bound: 128x128 <= 128 registers; the smaller tiles stage two float4 per operand and get up
# to 168), passed to gemm_simt's __launch_bounds__ as template arguments (simt_name).
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
SMEM_PER_SM = 228 * 1024       # H100/H200

# Warpgroup-MMA tiles (kernels/gemm_wgmma.cu; sm_90a; A [M, K] and B [N, K] both K-major):
# (BM, BN, STAGES, LOADER), BM / 64 warpgroups of 128 threads, each computing 64 x BN; LOADER 0:
# every thread stages with cp.async (gemm_wgmma), 1: the bulk tensor copy engine (gemm_wgmma_tma).
#   128x128 s3: 97 KB, 2 blocks/SM: one block's epilogue overlaps the other's main loop (short K).
#   128x192 s4: N = 384 / 1152 / 1536 are 2 / 6 / 8 column tiles; 161 KB, 1 block/SM.
#   128x256 s4, 256x128 s4: the large tiles (193 KB), fewest operand bytes per flop.
#   128x64 s4: narrow outputs (the head's N = 65), 2 blocks/SM.
# LOADER 2 (gemm_wgmma_ws): TMA with a producer warpgroup of its own, persistent (one block per SM
# walks the output tiles), so the next tile's loads overlap this one's epilogue.
WGMMA_LOADERS = ("cp.async", "tma", "tma ws")
WGMMA_TILES = ((128, 128, 3, 0), (128, 192, 4, 0), (128, 256, 4, 0), (256, 128, 4, 0), (128, 64, 4, 0),
               (128, 128, 3, 1), (128, 192, 4, 1), (128, 256, 4, 1), (256, 128, 4, 1),
               (128, 128, 4, 2), (128, 192, 4, 2), (128, 256, 4, 2), (256, 128, 4, 2))
# rate relative to the mma.sync 256x128 tile (wgmma's dense TF32 peak is ~1.6x mma.sync's); set from
# bench/gemm.py --sweep on the H200: TMA beats cp.async by 5-20% at 192- and 256-wide tiles
WGMMA_EFFICIENCY = dict(zip(WGMMA_TILES, (1.35, 1.5, 1.5, 1.5, 1.1, 1.4, 1.65, 1.75, 1.7,
                                          1.6, 1.75, 1.8, 1.75)))
# The weight gradients' products A^T B with A [K, M] as stored read through registers (family
# "wgmma_ra", kernels/gemm_wgmma.cu gemm_wgmma_ra, MN_B false): (BM, BN, STAGES), the warp-specialized
# persistent kernel of gemm_wgmma_ws whose consumers load A's fragments from its MN-major swizzled
# k tiles (register-A wgmma), so A needs no transposing pass; B K-major ([N, K] as stored, or a
# B [K, N] transposed first into "gemm_aT"). "wgmma_ra_mn" (MN_B true): B [K, N] as stored, turned
# K-major by the producer warpgroup, through its registers (no pass at all). BM 128: a consumer
# thread holds 96 accumulators and two k tiles' fragments (32) at BN 192.
WGMMA_RA_TILES = ((128, 128, 4), (128, 192, 4))
WGMMA_RA_MN_TILES = ((128, 128, 7), (128, 192, 5))
# "wgmma_ra_t": out = A^T B (A [K, M], B [K, N] as stored) run as out^T = B^T A with B through
# registers and A transposed first (into "gemm_aT", with its column sums), out^T stored transposed
# (gemm_wgmma_ra's TC): for the weight gradient whose B is the larger operand (dW fcproj = dY^T act).
WGMMA_RA_T_TILES = WGMMA_RA_TILES
# Their rates, set so that the cost model picks what the H200's measured table picks for the shipped
# configs' weight gradients (bench/plan_check.py; bench/NOTES.md 2026-12-02).
WGMMA_RA_EFFICIENCY = dict(zip(WGMMA_RA_TILES, (1.7, 1.9)))      # (wgmma_ra_t: the same kernel)
WGMMA_RA_MN_EFFICIENCY = dict(zip(WGMMA_RA_MN_TILES, (0.8, 1.0)))
# fp32 through three TF32 products (3xTF32; family "wgmma3_ra", kernels/gemm_wgmma.cu gemm_wgmma3_ra):
# (BM, BN, STAGES), the warp-specialized persistent kernel whose consumers load A's fragments as
# stored (K-major, or MN-major in gemm_wgmma_ra's boxes) and split them into hi and lo halves
# themselves, and whose producers split (and turn) B. A slot holds A once and B's two halves, (BM + 2 BN)
# x 128 bytes: 4 stages at 128 x 128. Two consumer warpgroups (BM 128) of sum + partial accumulators
# (BN / 2 each). (It replaced gemm_wgmma3_ws, which split both operands in shared memory and no measured
# table picked, and the TMA kernel over halves a pass wrote first, which the H200's table picked for one
# shape of the shipped configs: bench/NOTES.md 2026-12-02.)
WGMMA3_RA_TILES = ((128, 128, 4), (128, 64, 4))
WGMMA3_RA_EFFICIENCY = dict(zip(WGMMA3_RA_TILES, (2.0, 1.5)))

# BF16 (family "bf16", precision bf16's base family; gemm_wgmma_ws with DT = 1): the persistent TMA tiles
# (BM, BN, STAGES) of the TF32 kernel, a k tile 64 bf16 (128 bytes a row, as TF32's 32); every layout
# read as stored: an operand stored [K, rows] is MN-major in shared memory and read through the
# instruction's transpose bits, so nothing is re-laid out and no scratch is planned. C (and aux) are
# bf16 where a product makes activations (NT, NN) and fp32 for the weight gradients (TN; their split-K
# partials too); x @ W^T (NT) also into fp32, for a bf16 generation's products whose outputs stay fp32
# (qkv, the residual stream, the logits: gptcuda/ops/cuda/decode.py). Rates relative to TF32_FLOPS_PER_SM (BF16's dense peak is twice TF32's) from
# bench/bf16_gemm.py on the H200: 445-782 TFLOP/s at GPT-2's large products (bench/NOTES.md 2026-12-02).
BF16_TILES = ((128, 256, 4), (256, 128, 4), (128, 192, 4), (128, 128, 4))
BF16_EFFICIENCY = dict(zip(BF16_TILES, (3.3, 3.2, 3.2, 2.9)))
BF16_OUTS = {"NT": ("bf16", "f32"), "NN": ("bf16",), "TN": ("f32",)}   # layout -> C's dtypes
BF16_K_TILE = 64

# A rough machine model (H200-like) of the peak rates, only used to rank candidate plans.
FFMA_FLOPS_PER_SM = 128 * 2 * 1.75e9       # fp32 FMA lanes x 2 x clock
TF32_FLOPS_PER_SM = 1024 * 2 * 1.75e9 / 2


def _simt_threads(t):             # an 8x8 tile a thread
    return t[0] * t[1] // 64


def _tf32_threads(t):             # a warp a warp tile
    return t[3] * t[4] * 32


# gemm_simt.cu's transpose [K, N] -> [N, K] of transpose_b plans: TRANSPOSE_THREADS threads a TRANSPOSE_TILE
# square (asserted)
TRANSPOSE_TILE, TRANSPOSE_THREADS = 64, 256


def transpose_name(vec, colsum=False) -> str:
    """gemm_transpose's name expression: vec, float4 accesses; colsum, the A^T of a weight gradient that
    also writes its bias gradient's partial column sums."""
    return expression("gemm_transpose", vec, colsum, TRANSPOSE_TILE, TRANSPOSE_THREADS, sep=", ")


# Teaching kernels of gemm_simt.cu, launched only by bench/gemm.py --ladder.
LADDER_NAMES = ("gemm_ladder_naive", "gemm_ladder_coalesced", "gemm_ladder_smem<32>",
                "gemm_ladder_regtile<64,64,8,4,4>")

SPLIT_ALIGN = 32          # k_chunk is a multiple of this (keeps 16-byte alignment and whole BK tiles;
                          # Family.k_align: the bf16 family's k tile, 64)
MAX_SPLITS = 32
MAX_GRID_Z = 65535
REDUCE_THREADS = 256       # gemm_splitk_reduce's block (grid-stride)


def simt_name(bm, bn, ta, tb, epi, has_bias, vec) -> str:
    """gemm_simt's name expression: the tile, layout and epilogue, then THREADS and MIN_BLOCKS."""
    threads = _simt_threads((bm, bn))
    return expression("gemm_simt", bm, bn, ta, tb, epi, has_bias, vec, threads, SIMT_BLOCKS_PER_SM[threads])


def reduce_name(epi, has_bias) -> str:
    return expression("gemm_splitk_reduce", epi, has_bias, REDUCE_THREADS)


def tf32_name(tile, ta, tb, epi, has_bias, vec) -> str:
    """gemm_tf32's name expression: the tile, layout and epilogue, then THREADS, SMEM and MIN_BLOCKS."""
    return expression("gemm_tf32", *tile, ta, tb, epi, has_bias, vec, _tf32_threads(tile), tf32_smem(tile),
                      tf32_blocks_per_sm(tile))


def ws_threads(tile) -> int:
    """A warp-specialized kernel's block: BM / 64 consumer warpgroups and the producer's."""
    return (tile[0] // 64 + 1) * 128


def ring_smem(stages, rows) -> int:
    """Bytes of `stages` slots of `rows` 128-byte rows, + 1 KB the kernel may skip to align them to 1024 bytes."""
    return stages * rows * 128 + 1024


def persistent_smem(tile) -> int:          # a slot: A and B
    return ring_smem(tile[2], tile[0] + tile[1])


def wgmma3_ra_smem(tile) -> int:           # a slot: A once (split in the consumers' registers), B's halves
    return ring_smem(tile[2], tile[0] + 2 * tile[1])


def _ws(kernel, tile, smem, *args) -> str:
    """A warp-specialized kernel's name expression: <BM, BN, STAGES, args..., THREADS, SMEM>."""
    return expression(kernel, *tile[:3], *args, ws_threads(tile), smem)


def wgmma_name(tile, epi, has_bias) -> str:
    kernel = ("gemm_wgmma", "gemm_wgmma_tma", "gemm_wgmma_ws")[tile[3]]
    return expression(kernel, *tile[:3], epi, has_bias, wgmma_threads(tile), wgmma_smem(tile))


def bf16_name(tile, ta, tb, epi, has_bias, out) -> str:
    """gemm_wgmma_ws's BF16 name expression: DT 1, A MN-major where stored [K, M] (ta), B where stored
    [K, N] (not tb), C's type code (`out`: "bf16" or "f32")."""
    return expression("gemm_wgmma_ws", *tile, epi, has_bias, ws_threads(tile), persistent_smem(tile), DTYPE_CODES["bf16"],
                      ta, not tb, DTYPE_CODES[out])


def ra_name(tile, mn_b, epi, has_bias, colsum=False, tc=False) -> str:
    """gemm_wgmma_ra's name expression (MN_B: B stored [K, N], turned by the producers); colsum: the
    variant whose consumers also sum A's fragments (matmul's a_colsum); tc: C stored transposed."""
    return _ws("gemm_wgmma_ra", tile, persistent_smem(tile), epi, has_bias, mn_b, colsum, tc)


def wgmma3_ra_name(tile, ta, tb, epi, has_bias, colsum=False) -> str:
    """gemm_wgmma3_ra's name expression (MN_A = trans_a, MN_B = not trans_b; colsum: MN_A only)."""
    return _ws("gemm_wgmma3_ra", tile, wgmma3_ra_smem(tile), epi, has_bias, ta, not tb, colsum)


def tf32_smem(tile) -> int:
    """Dynamic shared memory of a TF32 tile: stages x (BM + BN) x BK floats."""
    bm, bn, bk, _, _, stages = tile
    return stages * (bm + bn) * bk * 4


def tf32_blocks_per_sm(tile) -> int:
    """As many as shared memory allows (1 KB reserved a block), 1..3: gemm_tf32's MIN_BLOCKS."""
    return max(1, min(3, SMEM_PER_SM // (tf32_smem(tile) + 1024)))


def wgmma_smem(tile) -> int:
    """Dynamic shared memory of a wgmma tile: stages x (BM + BN) rows of 128 bytes, plus the 1 KB of
    ring_smem."""
    bm, bn, stages, _ = tile
    return ring_smem(stages, bm + bn)


def wgmma_blocks_per_sm(tile) -> int:
    if tile[3] == 2:              # persistent: one block per SM at most (ws_grid)
        return 1
    return max(1, min(2, SMEM_PER_SM // (wgmma_smem(tile) + 1024)))


def wgmma_threads(tile) -> int:
    """BM / 64 warpgroups computing, plus the loading warpgroup of the warp-specialized kernel."""
    return ws_threads(tile) if tile[3] == 2 else tile[0] // 64 * 128


def layout_code(trans_a, trans_b) -> str:
    """"NT", "NN", "TN" or "TT": T where the operand is stored transposed (A [K, M], B [N, K])."""
    return ("T" if trans_a else "N") + ("T" if trans_b else "N")


@dataclass(frozen=True)
class Family:
    """One kernel family: its file and tiles, and per tile the launch geometry, the kernel's name
    expression and the cost model's rate; for a warpgroup-MMA family, the layouts it runs and how."""
    name: str
    file: str
    tiles: tuple                  # every tile its kernels are compiled for (aligned operands)
    plan_tiles: tuple             # the cost model's own candidates among them (bench/tune.py times all)
    unaligned_tiles: tuple        # tiles with an unaligned variant (VEC = false)
    efficiency: dict              # tile -> rate relative to the family's peak (model only)
    rate: float                   # modelled peak flop/s of one SM
    threads: Callable             # tile -> threads of a block
    blocks_per_sm: Callable       # tile -> blocks resident on one SM
    smem: Callable                # tile -> dynamic shared memory of a block (bytes)
    kernel: Callable              # (tile, trans_a, trans_b, epi, has_bias, vec) -> name expression (a bf16
                                  # family: (tile, trans_a, trans_b, epi, has_bias, out dtype); `variant`)
    label: Callable               # tile -> its description in kernel_label
    short: Callable               # tile -> its compact name in plan_label
    base: str                     # the base family whose precision it serves (a base family: its own name)
    tma: Callable = lambda tile: False   # the kernel takes TMA tensor maps of A and B (and no A/B strides)
    persistent: Callable = lambda tile: False   # a grid of at most blocks_per_sm x SMs blocks walks the
                                                # tiles; the kernel takes their z extent last (ws_grid)
    colsum_kernel: Callable | None = None       # (tile, trans_a, trans_b) -> the kernel (epilogue none, one
                                                # product) that also writes A's column sums as stored
                                                # (matmul's a_colsum), or None for that layout
    layouts: tuple = tuple(layout_code(*lay) for lay in PRODUCTS)   # the layouts (layout_code) of the
                                  # products it runs: as stored, or after the re-layout below
    transposes_b: str = ""        # the layout whose B [K, N] it transposes first into `scratch` (transpose_b plans)
    swaps: bool = False           # runs A^T B as (B^T A)^T: A^T first into `scratch`, B through registers
    scratch: str = ""             # the workspace of its re-laid operand
    a_regs: bool = False          # A read through registers, an MN-major A [K, M] from swizzled boxes {32, 32}
    split_waves: int = 1          # the cost model tries split-K below this many waves of blocks
    partners: tuple = ()          # a base family's warpgroup-MMA families, competing with it on sm_90
    needs: str = ""               # what a warpgroup-MMA plan needs (the reason a plan is refused)
    dtype: str = "f32"            # its operands' element type (view dtype)
    outs: dict = None             # a bf16 family: layout code -> the dtypes of C its kernels write (fp32 only: None)
    k_align: int = SPLIT_ALIGN    # a split-K chunk is a multiple of this (its k tile)

    def variant(self, tile, ta, tb, epi, hb, vec=True, out="f32") -> str:
        """The kernel's name expression for this tile, layout (as its kernel reads it), epilogue and C dtype."""
        if self.outs is None:
            return self.kernel(tile, ta, tb, epi, hb, vec)
        return self.kernel(tile, ta, tb, epi, hb, out)

    def out_dtypes(self, ta, tb) -> tuple:
        """The dtypes of C its kernels write for the layout its kernel reads as (ta, tb)."""
        return ("f32",) if self.outs is None else self.outs.get(layout_code(ta, tb), ())

    def kernel_layout(self, code) -> tuple:
        """(trans_a, trans_b) its kernel reads for a product of layout `code`: B^T first reads B [N, K],
        the swapped product B^T A reads both K-major ((True, True) in its kernel's terms)."""
        ta, tb = code[0] == "T", code[1] == "T"
        return (True, True) if self.swaps else (ta, True) if code == self.transposes_b else (ta, tb)

    def combos(self) -> list:
        """(trans_a, trans_b, EPI, HAS_BIAS) its kernels are compiled for: per layout it runs, the
        epilogues the op interface asks of it (gemm.PRODUCTS; TT, no product of the interface: none),
        in the layout its kernel reads."""
        out = []
        for code in self.layouts:
            ta, tb = code[0] == "T", code[1] == "T"
            for epi, hb in PRODUCTS.get((ta, tb), ((EPI_NONE, False),)):
                if (combo := (*self.kernel_layout(code), epi, hb)) not in out:
                    out.append(combo)
        return out

    def runs_epi(self, epi) -> bool:
        """Whether its kernels are compiled for epilogue code epi (EPI_BIAS: with a bias) in some layout."""
        return any(e == epi for _, _, e, _ in self.combos())


def _wgmma_label(t):
    return f"{t[0]}x{t[1]}x32 s{t[2]} {WGMMA_LOADERS[t[3]]}"


def _wgmma_short(t):
    return f"{t[0]}x{t[1]}s{t[2]}" + ("", "tma", "ws")[t[3]]


def _persistent(name, tiles, efficiency, rate, smem, base, **kw) -> Family:
    """A warp-specialized persistent family of gemm_wgmma.cu reading A as stored through registers
    (wgmma_ra*, wgmma3_ra): BM / 64 consumer warpgroups and a producer's, one block per SM, TMA."""
    return Family(name, WGMMA_FILE, tiles, tiles, (), efficiency, rate, threads=ws_threads,
                  blocks_per_sm=lambda t: 1, smem=smem, base=base, tma=lambda t: True, persistent=lambda t: True,
                  a_regs=True, **kw)


FAMILIES = {f.name: f for f in (
    Family("simt", SIMT_FILE, SIMT_TILES, SIMT_TILES, SIMT_TILES, SIMT_EFFICIENCY, FFMA_FLOPS_PER_SM,
           threads=_simt_threads,
           blocks_per_sm=lambda t: SIMT_BLOCKS_PER_SM[_simt_threads(t)],
           smem=lambda t: 0,
           kernel=lambda t, ta, tb, epi, hb, vec: simt_name(t[0], t[1], ta, tb, epi, hb, vec),
           label=lambda t: f"{t[0]}x{t[1]}",
           short=lambda t: f"{t[0]}x{t[1]}", base="simt",
           partners=("wgmma3_ra",)),
    Family("tf32", TF32_FILE, TF32_TILES, TF32_PLAN_TILES, TF32_FALLBACK_TILES, TF32_EFFICIENCY,
           TF32_FLOPS_PER_SM,
           threads=_tf32_threads,
           blocks_per_sm=tf32_blocks_per_sm,
           smem=tf32_smem,
           kernel=tf32_name,
           label=lambda t: f"{t[0]}x{t[1]}x{t[2]} w{t[3]}x{t[4]} s{t[5]}",
           short=lambda t: f"{t[0]}x{t[1]}s{t[5]}", base="tf32",
           partners=("wgmma", "wgmma_ra", "wgmma_ra_mn", "wgmma_ra_t")),
    Family("wgmma", WGMMA_FILE, WGMMA_TILES, WGMMA_TILES, (), WGMMA_EFFICIENCY, TF32_FLOPS_PER_SM,
           threads=wgmma_threads,
           blocks_per_sm=wgmma_blocks_per_sm,
           smem=wgmma_smem,
           kernel=lambda t, ta, tb, epi, hb, vec: wgmma_name(t, epi, hb),
           label=_wgmma_label, short=_wgmma_short, base="tf32",
           tma=lambda t: bool(t[3]), persistent=lambda t: t[3] == 2, layouts=("NT", "NN"), transposes_b="NN",
           scratch="gemm_bT", split_waves=4,
           needs="sm_90 with K-major, aligned A and B, or B's transpose in the gemm_bT workspace"),
    _persistent("wgmma_ra", WGMMA_RA_TILES, WGMMA_RA_EFFICIENCY, TF32_FLOPS_PER_SM, persistent_smem, "tf32",
                kernel=lambda t, ta, tb, epi, hb, vec: ra_name(t, False, epi, hb),
                colsum_kernel=lambda t, ta, tb: ra_name(t, False, EPI_NONE, False, colsum=True),
                label=lambda t: f"{t[0]}x{t[1]}x32 s{t[2]} tma ws A in registers",
                short=lambda t: f"{t[0]}x{t[1]}s{t[2]}ra", layouts=("TT", "TN"), transposes_b="TN",
                scratch="gemm_aT",
                needs="sm_90, A^T B with A [K, M] as stored and B [N, K] (or [K, N] transposed first into "
                      "the gemm_aT workspace), 16-byte aligned, one product"),
    _persistent("wgmma_ra_mn", WGMMA_RA_MN_TILES, WGMMA_RA_MN_EFFICIENCY, TF32_FLOPS_PER_SM, persistent_smem,
                "tf32",
                kernel=lambda t, ta, tb, epi, hb, vec: ra_name(t, True, epi, hb),
                colsum_kernel=lambda t, ta, tb: ra_name(t, True, EPI_NONE, False, colsum=True),
                label=lambda t: f"{t[0]}x{t[1]}x32 s{t[2]} tma ws A in registers, B turned",
                short=lambda t: f"{t[0]}x{t[1]}s{t[2]}ramn", layouts=("TN",),
                needs="sm_90, A^T B with A [K, M] and B [K, N] as stored, 16-byte aligned, one product"),
    _persistent("wgmma_ra_t", WGMMA_RA_T_TILES, WGMMA_RA_EFFICIENCY, TF32_FLOPS_PER_SM, persistent_smem, "tf32",
                kernel=lambda t, ta, tb, epi, hb, vec: ra_name(t, False, epi, hb, tc=True),
                label=lambda t: f"{t[0]}x{t[1]}x32 s{t[2]} tma ws B in registers, A^T first, out^T",
                short=lambda t: f"{t[0]}x{t[1]}s{t[2]}rat", layouts=("TN",), swaps=True, scratch="gemm_aT",
                needs="sm_90, A^T B with A [K, M] and B [K, N] as stored, 16-byte aligned, one product, no "
                      "epilogue, A^T [M, K] room in the gemm_aT workspace"),
    Family("bf16", WGMMA_FILE, BF16_TILES, BF16_TILES, (), BF16_EFFICIENCY, TF32_FLOPS_PER_SM,
           threads=ws_threads, blocks_per_sm=lambda t: 1, smem=persistent_smem,
           kernel=lambda t, ta, tb, epi, hb, out: bf16_name(t, ta, tb, epi, hb, out),
           label=lambda t: f"{t[0]}x{t[1]}x64 s{t[2]} tma ws bf16", short=lambda t: f"{t[0]}x{t[1]}s{t[2]}",
           base="bf16", tma=lambda t: True, persistent=lambda t: True, layouts=tuple(BF16_OUTS), dtype="bf16",
           outs=BF16_OUTS, k_align=BF16_K_TILE, split_waves=4,
           needs="sm_90, bf16 A and B with 16-byte aligned rows (multiples of 8 elements)"),
    _persistent("wgmma3_ra", WGMMA3_RA_TILES, WGMMA3_RA_EFFICIENCY, TF32_FLOPS_PER_SM / 3, wgmma3_ra_smem, "simt",
                kernel=lambda t, ta, tb, epi, hb, vec: wgmma3_ra_name(t, ta, tb, epi, hb),
                colsum_kernel=lambda t, ta, tb: wgmma3_ra_name(t, ta, tb, EPI_NONE, False, colsum=True) if ta else None,
                label=lambda t: f"{t[0]}x{t[1]}x32 s{t[2]} tma ws split, A in registers",
                short=lambda t: f"{t[0]}x{t[1]}s{t[2]}ra3",
                needs="sm_90, 16-byte aligned A and B (rows and batches: multiples of 4 floats), one product"),
)}


def _variants():
    out = []
    for fam in FAMILIES.values():
        for tile, (ta, tb, epi, hb), vec in itertools.product(fam.tiles, fam.combos(), (False, True)):
            if vec or tile in fam.unaligned_tiles:
                out += [(fam.file, fam.variant(tile, ta, tb, epi, hb, vec, o), {}) for o in fam.out_dtypes(ta, tb)]
        if fam.colsum_kernel is not None:
            layouts = dict.fromkeys(fam.kernel_layout(code) for code in fam.layouts)
            out += [(fam.file, k, {}) for tile, (ta, tb) in itertools.product(fam.tiles, layouts)
                    if (k := fam.colsum_kernel(tile, ta, tb)) is not None]
    for epi, hb in EPI_COMBOS:
        out.append((SIMT_FILE, reduce_name(epi, hb), {}))
    for name in LADDER_NAMES:
        out.append((SIMT_FILE, name, {}))
    out += [(SIMT_FILE, transpose_name(vec, colsum), {}) for colsum in (False, True) for vec in (False, True)]
    out.append((TF32_FILE, "mma_probe", {}))
    out.append((TF32_FILE, "tf32_round_probe", {}))
    return out


VARIANTS = _variants()
