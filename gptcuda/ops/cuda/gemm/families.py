"""The GEMM kernel families (FAMILIES: file, tiles and modelled rates, where each runs, per tile the launch
geometry and kernel name), the epilogue codes, the products the kernels are compiled for (PRODUCTS) and
the compiled variants (VARIANTS).

    simt    fp32 on the CUDA cores (kernels/gemm_simt.cu), every layout, aligned or not
    tf32    TF32 mma.sync (kernels/gemm_tf32.cu), every layout; unaligned operands on one tile
    wgmma   TF32 warpgroup MMA (kernels/gemm_wgmma.cu, sm_90a): K-major A and B only
    wgmma_ra  TF32 A^T B with A [K, M] as stored read through registers, B K-major (or B^T first)
    wgmma_ra_mn  the same with B [K, N] as stored, turned K-major by the producers
    wgmma_ra_t  TF32 A^T B as (B^T A)^T: B [K, N] through registers, A^T first, out stored transposed
    wgmma3_ra  fp32 as three TF32 warpgroup-MMA products (3xTF32) over A and B as stored, split in the kernel
    bf16    BF16 warpgroup MMA (gemm_wgmma_ws with DT 1): every layout as stored, C bf16 or fp32
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

from gptcuda.model.products import layout_code
from gptcuda.ops.cuda import DTYPE_CODES, cdiv, expression, optional_code

SIMT_FILE, TF32_FILE, WGMMA_FILE = "gemm_simt.cu", "gemm_tf32.cu", "gemm_wgmma.cu"

# Epilogue codes shared with the kernels (GEMM_EPI_* in kernels/gemm_epilogue.cuh).
EPI_NONE, EPI_BIAS, EPI_GELU, EPI_RESID, EPI_DGELU, EPI_DGELU_GELU = 0, 1, 2, 3, 4, 5
# The op interface's epilogue names (backend.EPILOGUES) -> kernel code without bias.
EPILOGUE_CODES = {"none": EPI_NONE, "gelu": EPI_GELU, "residual": EPI_RESID, "dgelu": EPI_DGELU,
                  "dgelu_gelu": EPI_DGELU_GELU}
# (EPI, HAS_BIAS) pairs a launcher can ask for (dgelu never takes a bias).
EPI_COMBOS = ((EPI_NONE, False), (EPI_BIAS, True), (EPI_GELU, False), (EPI_GELU, True),
              (EPI_RESID, False), (EPI_RESID, True), (EPI_DGELU, False))
# The products the op interface asks for, by (trans_a, trans_b): x @ W^T with any epilogue and bias, dY @ W
# plain or with the GELU backward folded in (and, families with `rebuilds_gelu`, the GELU output rebuilt
# over the pre-activation: recompute), the weight gradients dY^T @ X plain (batched: these three layouts,
# plain). Every family's kernels are compiled for these alone, in the layout each kernel reads.
PRODUCTS = {(False, True): tuple(e for e in EPI_COMBOS if e[0] != EPI_DGELU),
            (False, False): ((EPI_NONE, False), (EPI_DGELU, False), (EPI_DGELU_GELU, False)),
            (True, False): ((EPI_NONE, False),)}
# [M, N] arrays an epilogue moves through DRAM: the output, plus aux written (GELU) or read (and rewritten).
EPI_IO = {EPI_NONE: 1, EPI_BIAS: 1, EPI_GELU: 2, EPI_RESID: 2, EPI_DGELU: 2, EPI_DGELU_GELU: 3}

# Each family's tiles -> rate relative to its peak (the cost model's only); why these tiles and rates: bench/NOTES.md,
# "The GEMM layer: why its tiles, rates and constants".
# SIMT (BM, BN): an 8x8 tile a thread; resident blocks per SM by threads (gemm_simt's MIN_BLOCKS).
SIMT_TILES = {(128, 128): 1.0, (128, 64): 0.9, (64, 64): 0.8}
SIMT_BLOCKS_PER_SM = {256: 2, 128: 3, 64: 6}
# TF32 (BM, BN, BK, warps_m, warps_n, stages), BK = 32 (gemm_tf32.cu's shared layouts assume it): the cost model
# plans the first four; the unaligned variant (VEC = false) exists for TF32_FALLBACK_TILES alone.
TF32_TILES = {(256, 128, 32, 4, 2, 3): 1.0, (128, 128, 32, 2, 2, 3): 0.9, (128, 64, 32, 2, 2, 4): 0.75,
              (64, 64, 32, 2, 2, 4): 0.6, (256, 128, 32, 4, 2, 4): 1.0, (192, 128, 32, 3, 2, 3): 0.95}
TF32_PLAN_TILES = tuple(TF32_TILES)[:4]
TF32_FALLBACK_TILES = ((64, 64, 32, 2, 2, 4),)
SMEM_PER_SM = 228 * 1024       # H100/H200
SMEM_PER_BLOCK = 227 * 1024    # a block's shared memory at most (dynamic and static)
# Warpgroup MMA (BM, BN, STAGES, LOADER), A [M, K] and B [N, K] K-major, BM / 64 warpgroups computing; LOADER
# 0: cp.async (gemm_wgmma), 1: TMA (gemm_wgmma_tma), 2: TMA by a producer warpgroup, persistent (gemm_wgmma_ws).
WGMMA_TILES = {(128, 128, 3, 0): 1.35, (128, 192, 4, 0): 1.5, (128, 256, 4, 0): 1.5, (256, 128, 4, 0): 1.5,
               (128, 64, 4, 0): 1.1, (128, 128, 3, 1): 1.4, (128, 192, 4, 1): 1.65, (128, 256, 4, 1): 1.75,
               (256, 128, 4, 1): 1.7, (128, 128, 4, 2): 1.6, (128, 192, 4, 2): 1.75, (128, 256, 4, 2): 1.8,
               (256, 128, 4, 2): 1.75}
# The other warpgroup-MMA families (BM, BN, STAGES): persistent, BM / 64 consumer warpgroups and a producer's.
WGMMA_RA_TILES = {(128, 128, 4): 1.7, (128, 192, 4): 1.9}           # wgmma_ra, wgmma_ra_t (gemm_wgmma_ra)
WGMMA_RA_MN_TILES = {(128, 128, 7): 0.8, (128, 192, 5): 1.0}
WGMMA3_RA_TILES = {(128, 128, 4): 2.0, (128, 64, 4): 1.5}          # a slot: A once and B's hi and lo halves
# BF16 (BM, BN, STAGES, PP): a k tile is 64 bf16; operands as stored. PP 0: gemm_wgmma_ws; PP 1: gemm_wgmma_pp,
# two consumer warpgroups each on its own tile.
BF16_TILES = {(128, 256, 4, 0): 3.3, (256, 128, 4, 0): 3.2, (128, 192, 4, 0): 3.2, (128, 128, 6, 1): 3.0,
              (128, 192, 5, 1): 3.2}
# The 128 x 192 ping-pong tile holds 192 accumulators a thread (240 registers). Its dgelu kernels are not built
# (Family.serves): ptxas reports 224-308 bytes of spills for them, almost all in the threads' fallback stores
# (a C the tensor maps cannot describe), but even so the tile ran them slower than 256 x 128 on the H200
# (16384 tokens: dgelu 0.1705 against 0.1552 ms, dgelu_gelu 0.1955 against 0.1756; bench/NOTES.md). Its
# column sums take 4 columns a thread (Bf16ColSum's W), which fits.
BF16_PP_WIDE = (128, 192, 5, 1)
BF16_OUTS = {"NT": ("bf16", "f32"), "NN": ("bf16",), "TN": ("f32", "bf16")}   # layout -> C's dtypes (TN bf16:
# the weight gradients of a model that keeps its gradients in bf16, grad_dtype bf16)
# A bf16 C is stored through shared memory by the copy engine: two boxes of 64 x 32 bf16 a consumer warpgroup
# (gemm_wgmma.cu wg_store_tile_tma, ws_stage_bytes), after the ring
BF16_STAGE_BYTES = 2 * 64 * 32 * 2
BF16_STORE_BOX = (32, 64, 1)
# gemm_wgmma_dual (a layer's weight gradient dY^T X, fp32 C, and its input gradient dY W, bf16 C, none or dgelu,
# in one launch: plan.py pair_plan, launch.py matmul_pair): the tiles, gemm_wgmma_ws's with a bf16 C, those
# with the weight gradient's column sums (their reduction buffer, 1 KB a consumer warpgroup, does not fit
# beside 256 x 128's ring and four staging boxes), and the input gradient's epilogue codes
DUAL_TILES = ((128, 192, 4, 0), (128, 256, 4, 0), (256, 128, 4, 0))
DUAL_COLSUM_TILES = DUAL_TILES[:2]
DUAL_EPIS = (0, 4)      # EPI_NONE, EPI_DGELU
# ... and its ping-pong form's (gemm_wgmma_pp's consumers: PP 1), which the measured table alone picks (the
# schedule model has no term for an epilogue under the other warpgroup's k loop); 128 x 192 without dgelu
# (BF16_PP_WIDE's rule), both with the column sums
DUAL_PP_TILES = ((128, 128, 6, 1), (128, 192, 5, 1))
# A bf16 TN kernel's column sums (the bias gradient) are spread over up to this many column tiles of a row of
# tiles, each summing every G-th k tile into a row of its own (the kernels' COLSUM; they are shared-memory bound)
BF16_COLSUM_GROUPS = 8

# A rough machine model (H200-like) of the peak rates, only used to rank candidate plans.
FFMA_FLOPS_PER_SM = 128 * 2 * 1.75e9       # fp32 FMA lanes x 2 x clock
TF32_FLOPS_PER_SM = 1024 * 2 * 1.75e9 / 2

SPLIT_ALIGN = 32          # a k_chunk's multiple (16-byte alignment, whole BK tiles); Family.k_align: bf16's is 64
MAX_SPLITS = 32
MAX_GRID_Z = 65535
REDUCE_THREADS = 256       # gemm_splitk_reduce's block (grid-stride)
TRANSPOSE_TILE, TRANSPOSE_THREADS = 64, 256     # gemm_transpose [K, N] -> [N, K]: a square tile a block


def dual_name(t, epi_x, colsum, w_out="f32") -> str:
    """gemm_wgmma_dual's name expression: tile t (DUAL_TILES, DUAL_PP_TILES: PP 1), the input gradient's
    epilogue code, colsum (the weight gradient's column sums: their groups, BF16_COLSUM_GROUPS, or 0), w_out the
    weight gradient's C (fp32, the partials of a split one too; bf16: an unsplit one, bf16 gradients)."""
    geo = FAMILIES["bf16"].geometry(t, "bf16")
    tail = (t[3], DTYPE_CODES[w_out]) if w_out != "f32" else (1,) if t[3] else ()
    return expression("gemm_wgmma_dual", *t[:3], epi_x, geo.threads, geo.smem, BF16_COLSUM_GROUPS if colsum else 0,
                      *tail)


def dual_serves(t, epi_x, colsum) -> bool:
    """Whether gemm_wgmma_dual has tile t for the input gradient's epilogue code and the column sums (the
    dgelu pair, fcproj's, sums no bias; 256 x 128 has no room for the sums, the wide ping-pong tile no dgelu)."""
    return (t in DUAL_TILES + DUAL_PP_TILES and epi_x in DUAL_EPIS and not (colsum and epi_x) and
            (not colsum or t in DUAL_COLSUM_TILES + DUAL_PP_TILES) and (t != BF16_PP_WIDE or not epi_x))


def reduce_name(epi, has_bias, out="f32") -> str:
    """gemm_splitk_reduce <EPI, HAS_BIAS, THREADS[, OUT]>: OUT, C's element type (bf16: the weight gradients a
    model keeps in bf16, epilogue none; fp32's is the default)."""
    return expression("gemm_splitk_reduce", epi, has_bias, REDUCE_THREADS, *optional_code(out))


def transpose_name(vec, colsum=False) -> str:
    """gemm_transpose's name expression: vec, float4 accesses; colsum, also writes A's partial column sums."""
    return expression("gemm_transpose", vec, colsum, TRANSPOSE_TILE, TRANSPOSE_THREADS, sep=", ")


def ring_smem(stages, rows) -> int:
    """Bytes of `stages` slots of `rows` 128-byte rows, + 1 KB the kernel may skip to align them to 1024 bytes."""
    return stages * rows * 128 + 1024


def epi_code(g) -> int:
    """The kernels' epilogue code of a product (model/products.py Product): EPI_BIAS for none with a bias."""
    return EPI_BIAS if g.epilogue == "none" and g.bias else EPILOGUE_CODES[g.epilogue]


class Geometry(NamedTuple):
    """How a tile's kernel is launched."""
    threads: int                  # a block's
    blocks_per_sm: int            # resident on one SM
    smem: int                     # a block's dynamic shared memory (bytes)
    tma: bool = True              # it takes TMA tensor maps of A and B (and no A / B strides)
    persistent: bool = True       # <= blocks_per_sm x SMs blocks walk the tiles; takes their z extent, colsum
    c_maps: bool = False          # then C's and aux's store maps and c_tma (gemm_wgmma_ws, gemm_wgmma_pp)


@dataclass(frozen=True)
class Family:
    """One kernel family. The methods (per tile the launch geometry, label and kernel name) are those of the
    warp-specialized persistent kernels; the other kinds of kernel override them."""
    name: str
    rates: dict                   # tile -> rate relative to `rate` (the cost model's); its keys: every tile
    base: str                     # the base family whose precision it serves (a base family: its own name)
    file: str = WGMMA_FILE
    rate: float = TF32_FLOPS_PER_SM   # modelled peak flop/s of one SM
    plan_tiles: tuple = ()        # the cost model's candidates among the tiles (empty: all)
    unaligned_tiles: tuple = ()   # tiles with an unaligned variant (VEC = false)
    layouts: tuple = ("NT", "NN", "TN")   # layout_codes of the products it runs (as stored, or re-laid out below)
    transposes_b: str = ""        # the layout whose B [K, N] it transposes first into `scratch` (transpose_b plans)
    swaps: bool = False           # runs A^T B as (B^T A)^T: A^T first into `scratch`, B through registers
    scratch: str = ""             # the workspace of its re-laid operand
    a_regs: bool = False          # A read through registers, an MN-major A [K, M] from swizzled boxes {32, 32}
    colsum: bool = False          # a kernel of it also sums A as stored [K, M] (matmul's a_colsum; trans_a)
    colsum_groups: int = 1        # ... into this many rows a split at most (colsum_rows)
    split_waves: int = 1          # the cost model tries split-K below this many waves of blocks
    partners: tuple = ()          # a base family's warpgroup-MMA families, competing with it on sm_90
    needs: str = ""               # what a warpgroup-MMA plan needs (the reason a plan is refused)
    dtype: str = "f32"            # its operands' element type (view dtype)
    outs: dict = None             # a bf16 family: layout code -> the dtypes of C its kernels write (fp32 only: None)
    k_align: int = SPLIT_ALIGN    # a split-K chunk is a multiple of this (its k tile)
    rebuilds_gelu: bool = False   # its kernels have the dgelu_gelu epilogue (bf16 C)
    suffix: str = ""              # after the tile in plan labels

    @property
    def tiles(self) -> tuple:
        return tuple(self.rates)

    def geometry(self, t, out="f32") -> Geometry:   # (BM, BN, STAGES): BM / 64 consumer warpgroups, a producer's
        return Geometry((t[0] // 64 + 1) * 128, 1, ring_smem(t[2], t[0] + t[1]))      # a slot: A and B; out: C's dtype

    def short(self, t) -> str:
        return f"{t[0]}x{t[1]}s{t[2]}{self.suffix}"

    def kernel(self, t, ta, tb, epi, hb, vec=True, out="f32", colsum=False) -> str:
        """The name expression for tile t, the layout (ta, tb) the kernel reads, epilogue code epi (hb: with
        a bias), aligned operands (vec), C's dtype (out), the variant that also sums A (colsum)."""
        raise NotImplementedError

    def serves(self, t, epi, colsum=False, out="f32") -> bool:
        """Whether tile t has kernels for epilogue code epi (colsum: the variant that also sums A) into a C of
        dtype out."""
        return True

    def colsum_rows(self, t, N) -> int:
        """Rows of column-sum partials a split of a product N wide writes on tile t."""
        return min(cdiv(N, t[1]), self.colsum_groups)

    def out_dtypes(self, ta, tb) -> tuple:
        """The dtypes of C its kernels write for the layout its kernel reads as (ta, tb)."""
        return ("f32",) if self.outs is None else self.outs.get(layout_code(ta, tb), ())

    def kernel_layout(self, code) -> tuple:
        """(trans_a, trans_b) its kernel reads for a product of layout `code` (B^T first, swapped: K-major)."""
        ta, tb = code[0] == "T", code[1] == "T"
        return (True, True) if self.swaps else (ta, True) if code == self.transposes_b else (ta, tb)

    def combos(self) -> list:
        """(trans_a, trans_b, EPI, HAS_BIAS) its kernels are compiled for: PRODUCTS' epilogues of each layout
        it runs (TT: none), in the layout its kernel reads."""
        return list(dict.fromkeys((*self.kernel_layout(code), epi, hb) for code in self.layouts
                                  for epi, hb in PRODUCTS.get((code[0] == "T", code[1] == "T"), ((EPI_NONE, False),))
                                  if epi != EPI_DGELU_GELU or self.rebuilds_gelu))


class Simt(Family):               # (BM, BN): an 8x8 tile a thread, operands by pointer
    def geometry(self, t, out="f32"):
        threads = t[0] * t[1] // 64
        return Geometry(threads, SIMT_BLOCKS_PER_SM[threads], 0, False, False)

    def short(self, t):
        return f"{t[0]}x{t[1]}"

    def kernel(self, t, ta, tb, epi, hb, vec=True, out="f32", colsum=False):
        geo = self.geometry(t)
        return expression("gemm_simt", *t, ta, tb, epi, hb, vec, geo.threads, geo.blocks_per_sm)


class MmaSync(Family):            # (BM, BN, BK, warps_m, warps_n, stages): a warp a warp tile, A and B by pointer
    def geometry(self, t, out="f32"):        # stages x (BM + BN) x BK floats; blocks: as many as fit (1 KB reserved each),
        smem = t[5] * (t[0] + t[1]) * t[2] * 4          # 1..3 (gemm_tf32's MIN_BLOCKS)
        return Geometry(t[3] * t[4] * 32, max(1, min(3, SMEM_PER_SM // (smem + 1024))), smem, False, False)

    def short(self, t):
        return f"{t[0]}x{t[1]}s{t[5]}"

    def kernel(self, t, ta, tb, epi, hb, vec=True, out="f32", colsum=False):
        geo = self.geometry(t)
        return expression("gemm_tf32", *t, ta, tb, epi, hb, vec, geo.threads, geo.smem, geo.blocks_per_sm)


class Wgmma(Family):              # (BM, BN, STAGES, LOADER): BM / 64 warpgroups computing, + LOADER 2's producer
    def geometry(self, t, out="f32"):
        smem = ring_smem(t[2], t[0] + t[1])
        blocks = 1 if t[3] == 2 else max(1, min(2, SMEM_PER_SM // (smem + 1024)))
        return Geometry((t[0] // 64 + (t[3] == 2)) * 128, blocks, smem, t[3] >= 1, t[3] == 2, t[3] == 2)

    def short(self, t):
        return f"{t[0]}x{t[1]}s{t[2]}" + ("", "tma", "ws")[t[3]]

    def kernel(self, t, ta, tb, epi, hb, vec=True, out="f32", colsum=False):
        geo = self.geometry(t)
        name = ("gemm_wgmma", "gemm_wgmma_tma", "gemm_wgmma_ws")[t[3]]
        return expression(name, *t[:3], epi, hb, geo.threads, geo.smem)


class RegisterA(Family):          # gemm_wgmma_ra<..., MN_B (B turned by its producers), COLSUM, TC (C transposed)>
    def kernel(self, t, ta, tb, epi, hb, vec=True, out="f32", colsum=False):
        geo = self.geometry(t)
        return expression("gemm_wgmma_ra", *t, epi, hb, not self.transposes_b and not self.swaps, colsum, self.swaps,
                          geo.threads, geo.smem)


class Split3(Family):             # gemm_wgmma3_ra<..., MN_A = trans_a, MN_B = not trans_b, COLSUM (MN_A only)>
    def geometry(self, t, out="f32"):        # a slot: A once (split in the consumers' registers), B's halves
        return Geometry((t[0] // 64 + 1) * 128, 1, ring_smem(t[2], t[0] + 2 * t[1]))

    def kernel(self, t, ta, tb, epi, hb, vec=True, out="f32", colsum=False):
        geo = self.geometry(t)
        return expression("gemm_wgmma3_ra", *t, epi, hb, ta, not tb, colsum, geo.threads, geo.smem)


class Bf16(Family):               # (BM, BN, STAGES, PP): gemm_wgmma_ws<..., DT 1, MN_A, MN_B, OUT[, COLSUM]> or _pp
    def geometry(self, t, out="f32"):   # PP: two consumer warpgroups whatever BM; a bf16 C: their staging boxes
        wgs = 2 if t[3] else t[0] // 64
        return Geometry((wgs + 1) * 128, 1, ring_smem(t[2], t[0] + t[1]) + (BF16_STAGE_BYTES * wgs if out == "bf16" else 0),
                        c_maps=True)

    def short(self, t):
        return f"{t[0]}x{t[1]}s{t[2]}" + ("pp" if t[3] else "")

    def serves(self, t, epi, colsum=False, out="f32"):
        # a bf16 C's staging boxes and the column sums' buffer (1 KB a consumer warpgroup, static) beside the
        # ring: 256 x 128's do not fit a block's shared memory
        sums = 1024 * (2 if t[3] else t[0] // 64) if colsum else 0
        return ((t != BF16_PP_WIDE or epi not in (EPI_DGELU, EPI_DGELU_GELU))
                and self.geometry(t, out).smem + sums <= SMEM_PER_BLOCK)

    def kernel(self, t, ta, tb, epi, hb, vec=True, out="f32", colsum=False):
        geo = self.geometry(t, out)
        return expression("gemm_wgmma_pp" if t[3] else "gemm_wgmma_ws", *t[:3], epi, hb, geo.threads, geo.smem,
                          DTYPE_CODES["bf16"], ta, not tb, DTYPE_CODES[out], *((self.colsum_groups,) if colsum else ()))


_ALIGNED = "16-byte aligned"
FAMILIES = {f.name: f for f in (
    Simt("simt", SIMT_TILES, "simt", SIMT_FILE, FFMA_FLOPS_PER_SM, unaligned_tiles=tuple(SIMT_TILES),
         partners=("wgmma3_ra",)),
    MmaSync("tf32", TF32_TILES, "tf32", TF32_FILE, plan_tiles=TF32_PLAN_TILES, unaligned_tiles=TF32_FALLBACK_TILES,
            partners=("wgmma", "wgmma_ra", "wgmma_ra_mn", "wgmma_ra_t")),
    Wgmma("wgmma", WGMMA_TILES, "tf32", layouts=("NT", "NN"), transposes_b="NN", scratch="gemm_bT", split_waves=4,
          needs="sm_90 with K-major, aligned A and B, or B's transpose in the gemm_bT workspace"),
    RegisterA("wgmma_ra", WGMMA_RA_TILES, "tf32", layouts=("TT", "TN"), transposes_b="TN", scratch="gemm_aT",
              a_regs=True, colsum=True, suffix="ra",
              needs=f"sm_90, A^T B with A [K, M] as stored and B [N, K] (or [K, N] transposed first into the "
                    f"gemm_aT workspace), {_ALIGNED}, one product"),
    RegisterA("wgmma_ra_mn", WGMMA_RA_MN_TILES, "tf32", layouts=("TN",), a_regs=True, colsum=True, suffix="ramn",
              needs=f"sm_90, A^T B with A [K, M] and B [K, N] as stored, {_ALIGNED}, one product"),
    RegisterA("wgmma_ra_t", WGMMA_RA_TILES, "tf32", layouts=("TN",), swaps=True, scratch="gemm_aT", a_regs=True,
              suffix="rat", needs=f"sm_90, A^T B with A [K, M] and B [K, N] as stored, {_ALIGNED}, one product, "
                                  f"no epilogue, A^T [M, K] room in the gemm_aT workspace"),
    Bf16("bf16", BF16_TILES, "bf16", layouts=tuple(BF16_OUTS), split_waves=4, dtype="bf16", outs=BF16_OUTS,
         k_align=64, needs="sm_90, bf16 A and B with 16-byte aligned rows (multiples of 8 elements)",
         rebuilds_gelu=True, colsum=True, colsum_groups=BF16_COLSUM_GROUPS),
    Split3("wgmma3_ra", WGMMA3_RA_TILES, "simt", rate=TF32_FLOPS_PER_SM / 3, a_regs=True, colsum=True, suffix="ra3",
           needs=f"sm_90, {_ALIGNED} A and B (rows and batches: multiples of 4 floats), one product"),
)}


def _variants():
    out = []
    for fam in FAMILIES.values():
        for tile, (ta, tb, epi, hb), vec in itertools.product(fam.tiles, fam.combos(), (False, True)):
            if (vec or tile in fam.unaligned_tiles) and fam.serves(tile, epi):
                out += [(fam.file, fam.kernel(tile, ta, tb, epi, hb, vec, o), {}) for o in fam.out_dtypes(ta, tb)]
        if fam.colsum:            # the plain product that also sums A, in each layout its kernel reads A [K, M]
            layouts = dict.fromkeys(fam.kernel_layout(code) for code in fam.layouts)
            out += [(fam.file, fam.kernel(tile, ta, tb, EPI_NONE, False, out=o, colsum=True), {})
                    for tile, (ta, tb) in itertools.product(fam.tiles, layouts)
                    for o in fam.out_dtypes(ta, tb) if ta and fam.serves(tile, EPI_NONE, True, o)]
    out += [(WGMMA_FILE, dual_name(t, epi, colsum, w), {}) for t in DUAL_TILES + DUAL_PP_TILES for epi in DUAL_EPIS
            for colsum in (False, True) if dual_serves(t, epi, colsum) for w in ("f32", "bf16")]
    out += [(SIMT_FILE, reduce_name(epi, hb), {}) for epi, hb in EPI_COMBOS]
    out += [(SIMT_FILE, reduce_name(EPI_NONE, False, "bf16"), {})]     # (bf16 weight gradients)
    out += [(SIMT_FILE, transpose_name(vec, colsum), {}) for colsum in (False, True) for vec in (False, True)]
    return out + [(TF32_FILE, "mma_probe", {}), (TF32_FILE, "tf32_round_probe", {})]


VARIANTS = _variants()
