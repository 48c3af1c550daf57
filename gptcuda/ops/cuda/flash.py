"""The fused attention kernels' geometry (kernels/flash_*.cu), chosen here and nowhere else.

    flash_kernel(kind, path, hs, drop, wg=False) -> FlashKernel(file, name, rows, smem)

kind: fwd | dq | dkv; path: the fused path (flash: FFMA, flash_tc: TF32, flash_3x: 3xTF32, flash_bf16:
bf16 on warpgroup MMA and TMA, head sizes FLASH_BF16_HEAD_SIZES); wg: dK/dV on warpgroup MMA (flash_tc,
head sizes FLASH_WG_HEAD_SIZES). A plan's choices (rows a block, the other
side's tile, ring stages, which operands stay in registers) and its shared memory in bytes go to the
kernel as template arguments after <HS, DROP>; each kernel static_asserts that the threads are its
block's and that the bytes are what its layout of those tiles takes, so a plan the kernel cannot run
fails to compile (the CPU suite compiles every VARIANTS entry). Launches and VARIANTS both name their
kernels through flash_kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

from gptcuda.ops.cuda import expression  # noqa: F401 (attention.py names its kernels through it)
from gptcuda.runtime.execution import FLASH_BF16_HEAD_SIZES, FLASH_WG_HEAD_SIZES  # noqa: F401 (the plan decides)

FLASH_FILES = {"flash": "flash_simt.cu", "flash_tc": "flash_tc.cu", "flash_3x": "flash_x3.cu",   # a path's kernels
               "flash_bf16": "flash_bf16.cu"}
FLASH_WG_FILE = "flash_wg.cu"          # flash_bwd_dkv_wg: flash_tc's dK/dV on warpgroup MMA
ROWSUM_FILE = "flash_rowsum.cu"        # flash_rowsum_do: D of every fused path's backward
FLASH_PATHS = tuple(FLASH_FILES)       # the fused paths of execution.ATTENTION_PATHS
FLASH_HEAD_SIZES = (32, 64, 128)
FLASH_THREADS = 128                    # every flash kernel's block: 4 warps (FA_THREADS, asserted)
FLASH_BQ = 64                          # FFMA kernels: query rows a block of fwd and dq
FLASH_BK = 64                          # FFMA kernels: key rows a block of dkv
ROWSUM_THREADS = 256

_SUFFIX = {"flash": "", "flash_tc": "_tc", "flash_3x": "_x3", "flash_bf16": "_bf16"}
_KIND = {"fwd": "fwd", "dq": "bwd_dq", "dkv": "bwd_dkv"}


@dataclass(frozen=True)
class FlashKernel:
    """A flash kernel as launched: its file, name expression, rows of a block (queries in fwd / dq,
    keys in dkv: the grid's second dimension covers T with them) and dynamic shared memory (bytes)."""
    file: str
    name: str
    rows: int
    smem: int
    threads: int = FLASH_THREADS
    stream_rows: int = 0          # flash_bf16: rows of its streamed tiles (the TMA boxes of the other side)
    walk: bool = False            # flash_bf16 (ns 3): a block walks work items (launch at most one block an SM)


def flash_tc_plan(kind: str, hs: int, x3: bool = False) -> dict:
    """Tile plan of a tensor-core flash kernel, tf32 (the _tc kernels) or 3xTF32 (x3: the _x3 kernels):
    rows a block, dynamic shared memory (bytes) and `args`, the template arguments after <HS, DROP>
    (threads, mt, bc, ns, areg[, vreg], smem; flash_tc.cuh FaFwdTc / FaDqTc / FaDkvTc). 4 warps of mt
    m16 row tiles each; a ring of ns cp.async stages of streamed tiles of bc rows; the resident
    operands either staged through ring stages 1.. into registers (areg) or kept in their own buffer
    (dkv: V's fragments in registers where vreg). 3xTF32 holds hi and lo fragments: 16 rows a warp
    from head size 64, shorter key tiles in fwd, the resident operands of dq and dkv (and fwd's Q at
    head size 128) left in shared memory."""
    ld = hs + 4
    mt = 2 if hs <= (32 if x3 else 64) else 1
    extra = ()
    if kind == "fwd":                      # ring: K, V tiles of bc keys; Q staged -> registers (or resident)
        bc = (32 if hs <= 64 else 16) if x3 else (64 if hs <= 64 else 32)
        ns, stage, resident, areg = 3, 2 * bc * ld, 64 * mt * ld, not x3 or hs <= 64
    elif kind == "dq":                     # ring: K, V tiles of bc keys; resident Q, dO
        bc = 32 if hs <= 64 else 16
        areg = not x3 and hs * mt <= 64
        ns = (3 if hs <= 64 else 2) if x3 else (3 if areg else 2)
        stage, resident = 2 * bc * ld, 2 * 64 * mt * ld
    elif kind == "dkv":                    # ring: Q, dO tiles of bc = 16 queries + lse, D; resident K, V
        bc = 16
        areg = not x3 and hs * mt <= 64
        extra = (not x3 and hs <= 64,)     # vreg
        ns, stage, resident = (3 if hs <= 64 else 2), 2 * bc * ld + 2 * bc, 2 * 64 * mt * ld
    else:
        raise ValueError(kind)
    smem = 4 * (max(ns * stage, stage + resident) if areg else ns * stage + resident)
    return {"rows": 64 * mt, "smem": smem, "args": (FLASH_THREADS, mt, bc, ns, areg, *extra, smem)}


def flash_simt_plan(kind: str, hs: int) -> dict:
    """Tile plan of an FFMA flash kernel (flash_simt.cu): br = 64 rows of the block's side, bc of the
    other (keys in fwd / dq: 32 at head size 128, else 64; queries in dkv: 32), row stride hs + 4, and a
    br x (bc + 4) buffer that stages P; args: threads, br, bc, smem (bytes)."""
    ld = hs + 4
    if kind == "fwd":
        br, bc = FLASH_BQ, 32 if hs >= 128 else 64
        n = (br + 2 * bc) * ld + br * (bc + 4)
    elif kind == "dq":
        br, bc = FLASH_BQ, 32 if hs >= 128 else 64
        n = (2 * br + 2 * bc) * ld + br * (bc + 4)
    elif kind == "dkv":
        br, bc = FLASH_BK, 32
        n = (2 * br + 2 * bc) * ld + 2 * bc + br * (bc + 4)
    else:
        raise ValueError(kind)
    return {"rows": br, "smem": 4 * n, "args": (FLASH_THREADS, br, bc, 4 * n)}


def flash_dkv_wg_plan(hs: int) -> dict:
    """Tile plan of flash_bwd_dkv_wg (dK/dV on warpgroup MMA, sm_90a, head sizes up to 64): one
    warpgroup of bk = 64 keys (one m64 tile); K and V resident (64 x hs each), a ring of ns = 2 stages
    of bq = 32 queries (Q, dO, then lse and D in 1 KB; Q^T and dO^T are written over Q and dO), every
    tile 1024-byte aligned, plus 1 KB to align the base: three blocks an SM. args: threads, bk, bq, ns,
    smem (bytes)."""
    if hs not in FLASH_WG_HEAD_SIZES:
        raise ValueError(f"flash_bwd_dkv_wg takes head sizes {FLASH_WG_HEAD_SIZES}, not {hs}")
    bk, bq, ns = 64, 32, 2
    smem = 2 * bk * hs * 4 + ns * (2 * bq * hs * 4 + 1024) + 1024
    return {"rows": bk, "smem": smem, "args": (FLASH_THREADS, bk, bq, ns, smem)}


# (kind, head size) -> (bm, bn, ns) of the bf16 flash kernels (bench/attention.py --bf16-tiles times others).
# ns 3: the kernel's pipelined loop (a tile's first products issued before the last tile's second ones); on
# the H200 it pays for dK/dV, and for the forward and dQ only with 192 rows at T >= 1024 (three consumer
# warpgroups a block: FLASH_BF16_TILES_LONG), not at T256
FLASH_BF16_TILES = {("fwd", 64): (128, 128, 2), ("dq", 64): (128, 64, 2), ("dkv", 64): (128, 64, 3),
                    ("fwd", 128): (128, 64, 2), ("dq", 128): (128, 64, 2), ("dkv", 128): (128, 64, 2)}
FLASH_BF16_LONG_T = 1024
FLASH_BF16_TILES_LONG = {("fwd", 64): (192, 128, 3), ("dq", 64): (192, 64, 3)}
FLASH_BF16_SMEM_MAX = 227 * 1024 - 1024    # sm_90's opt-in limit a block, less the static part (barrier words)


def flash_bf16_tile(kind: str, hs: int, T: int = 0) -> tuple:
    """(bm, bn, ns) of the bf16 `kind` kernel at head size hs for sequences of T rows."""
    if T >= FLASH_BF16_LONG_T and (kind, hs) in FLASH_BF16_TILES_LONG:
        return FLASH_BF16_TILES_LONG[(kind, hs)]
    return FLASH_BF16_TILES[(kind, hs)]


def fb_xslot(bn: int) -> int:
    """Bytes of one of pipelined dK/dV's lse / D slots (kernels/flash_bf16.cu fb_xslot, whose static_assert on
    the block's shared memory holds this to it): bn + 4 fp32 values (the copy engine's box starts at the
    16-byte boundary at or before the tile's first value), 128-byte aligned."""
    return -(-(bn + 4) * 4 // 128) * 128


def flash_bf16_plan(kind: str, hs: int, T: int = 0) -> dict:
    """Tile plan of a bf16 flash kernel (flash_bf16.cu, sm_90a) for sequences of T rows (flash_bf16_tile):
    bm rows of the block's side (bm / 64 consumer warpgroups and the producer's: 128 (bm / 64 + 1)
    threads), streamed tiles of bn rows of the other side in a ring of ns stages (ns 3: the kernel runs a
    tile's second products beside the next tile's first, two stages in use and a third loading; dK/dV's
    default at head size 64; at 128 its registers for both would serialize its wgmma); the resident tiles
    (fwd: Q; dq: Q, dO; dkv: K, V; in two buffers where the block walks), the ring (dkv with ns 3: then each
    stage's queries' lse and D, fp32), 1 KB to align the base.
    walk (ns 3, FaBf16::WALK): a block walks work items, the grid at most one block an SM; otherwise a block
    an item. args: threads, bm, bn, ns, smem (bytes)."""
    if hs not in FLASH_BF16_HEAD_SIZES:
        raise ValueError(f"the bf16 flash kernels take head sizes {FLASH_BF16_HEAD_SIZES}, not {hs}")
    if kind not in _KIND:
        raise ValueError(kind)
    bm, bn, ns = flash_bf16_tile(kind, hs, T)
    if bm not in (128, 192, 256) or bn not in (64, 128) or ns not in (2, 3):
        raise ValueError(f"bf16 flash tiles: bm 128 | 192 | 256, bn 64 | 128, ns 2 | 3, not {(bm, bn, ns)}")
    walk = ns >= 3                              # FaBf16::WALK: the block walks work items, its resident tiles twice
    resident = {"fwd": 1, "dq": 2, "dkv": 2}[kind] * (2 if walk else 1)
    # a stage's queries' lse and D (fp32), pipelined dK/dV's: two slots of fb_xslot(bn) bytes
    extra = 2 * fb_xslot(bn) if kind == "dkv" and walk else 0
    smem = resident * bm * hs * 2 + ns * (2 * bn * hs * 2 + extra) + 1024
    if smem > FLASH_BF16_SMEM_MAX:
        raise ValueError(f"bf16 flash {kind} tiles {(bm, bn, ns)} at head size {hs}: {smem} bytes of shared memory, "
                         f"more than the {FLASH_BF16_SMEM_MAX} a block may have beside its barriers")
    threads = 128 * (bm // 64 + 1)
    return {"rows": bm, "smem": smem, "threads": threads, "stream_rows": bn, "walk": walk,
            "args": (threads, bm, bn, ns, smem)}


def _x3(path: str) -> bool:
    if path not in FLASH_PATHS:
        raise ValueError(f"unknown fused attention path {path!r} (one of {FLASH_PATHS})")
    return path == "flash_3x"


def flash_plan(kind: str, hs: int, path: str, T: int = 0) -> dict:
    """The plan of the `kind` kernel of the fused `path` (flash | flash_tc | flash_3x | flash_bf16; T, the
    sequences' rows, picks flash_bf16's tile)."""
    x3 = _x3(path)
    if path == "flash_bf16":
        return flash_bf16_plan(kind, hs, T)
    return flash_simt_plan(kind, hs) if path == "flash" else flash_tc_plan(kind, hs, x3)


def flash_kernel(kind: str, path: str, hs: int, drop: bool, wg: bool = False, T: int = 0) -> FlashKernel:
    """The `kind` kernel (fwd | dq | dkv) of the fused `path` at head size hs, with dropout or not, for
    sequences of T rows; wg: flash_tc's dK/dV on warpgroup MMA."""
    if wg:
        if path != "flash_tc" or kind != "dkv":
            raise ValueError(f"flash_bwd_dkv_wg is flash_tc's dkv kernel, not {path}'s {kind}")
        plan, file, base = flash_dkv_wg_plan(hs), FLASH_WG_FILE, "flash_bwd_dkv_wg"
    else:
        plan, file, base = flash_plan(kind, hs, path, T), FLASH_FILES[path], f"flash_{_KIND[kind]}{_SUFFIX[path]}"
    return FlashKernel(file, expression(base, hs, bool(drop), *plan["args"]), plan["rows"], plan["smem"],
                       plan.get("threads", FLASH_THREADS), plan.get("stream_rows", 0), plan.get("walk", False))


def rowsum_name(hs: int) -> str:
    """flash_rowsum_do <HS, THREADS> (fp32 dy and y; the bf16 path's D is made by flash_bwd_dq_bf16)."""
    return expression("flash_rowsum_do", hs, ROWSUM_THREADS)


def variants() -> list:
    """(file, name, defines) of every flash kernel a launch can name."""
    out = []
    for hs in FLASH_HEAD_SIZES:
        for drop in (False, True):
            out += [(k.file, k.name, {}) for path in FLASH_PATHS for kind in _KIND
                    if path != "flash_bf16" or hs in FLASH_BF16_HEAD_SIZES
                    for T in ((0, FLASH_BF16_LONG_T) if path == "flash_bf16" else (0,))
                    for k in [flash_kernel(kind, path, hs, drop, T=T)]]
            if hs in FLASH_WG_HEAD_SIZES:
                k = flash_kernel("dkv", "flash_tc", hs, drop, wg=True)
                out.append((k.file, k.name, {}))
    out = [v for i, v in enumerate(out) if v not in out[:i]]          # a tile the two T classes share
    return out + [(ROWSUM_FILE, rowsum_name(hs), {}) for hs in FLASH_HEAD_SIZES]
