"""Planning a GEMM: the block tile, the split-K factor and the operand re-layout of a shape, from a
cost model (`plan`, `estimate_s`), the candidates bench/tune.py times (`tune_candidates`), the
workspaces a config plans (`workspace`), and whether a plan can run a launch (`plan_unfit`).
Which layouts the warpgroup-MMA families may run on a runtime is layout.py's."""
from __future__ import annotations

from dataclasses import dataclass

from gptcuda.runtime import execution
from gptcuda.runtime.execution import GEMM_FAMILIES
from gptcuda.ops.cuda.gemm.families import (EPI_IO, EPI_NONE, FAMILIES, MAX_GRID_Z, MAX_SPLITS, SPLIT_ALIGN,
                                            WGMMA_FILE, cdiv, layout_code)


@dataclass(frozen=True)
class Plan:
    family: str          # "simt" | "tf32" | "wgmma" | "wgmma_ra" | ... | "wgmma3_ra": a FAMILIES key
    tile: tuple          # an entry of the family's tiles
    splits: int
    k_chunk: int
    transpose_b: bool = False   # B [K, N] first transposed into the family's scratch as [N, K]

    @property
    def fam(self):
        return FAMILIES[self.family]

    @property
    def bm(self):
        return self.tile[0]

    @property
    def bn(self):
        return self.tile[1]

    @property
    def threads(self):
        return self.fam.threads(self.tile)

    @property
    def blocks_per_sm(self):
        return self.fam.blocks_per_sm(self.tile)

    @property
    def smem(self):
        return self.fam.smem(self.tile)

    def relaid(self, M, N, K):
        """(workspace, floats) of the operand this plan re-lays out before its kernel: B^T [N, K]
        (transpose_b), A^T [M, K] (the swapped product); None."""
        if self.transpose_b or self.fam.swaps:
            return self.fam.scratch, (M if self.fam.swaps else N) * K
        return None

    def fits(self, M, N, K, scratch=None) -> bool:
        """Whether the planned scratch ({workspace: floats}; None: unlimited) holds what it re-lays out."""
        need = self.relaid(M, N, K)
        return need is None or scratch is None or 0 < need[1] <= scratch.get(need[0], 0)


# The rest of the rough machine model (H200-like; the peak rates are the families'), only used to
# rank candidate plans against each other.
_BYTES_PER_S = 3.5e12
_L2_BYTES_PER_S = 9e12                # L2 -> SM operand streaming, all SMs together: the wgmma TMA kernel
                                      # streamed 3.2 GB of operand panels in 0.365 ms at 4096^3 (8.8 TB/s)
_LAUNCH_S = 3e-6
_L2_RESIDENT_BYTES = 40e6             # an operand above this (H200: 50 MB of L2) is re-read from DRAM
                                      # by every row of output tiles that sweeps it (see estimate_s)
_FILL_S = 1.5e-6                      # a block's pipeline fill: latency of its first operand tiles
_HIDDEN = 0.25                        # share of fill + epilogue not hidden when another block is resident


def _util(warps):
    """Fraction of an SM's peak reached with this many resident warps (rough)."""
    return min(1.0, (warps / 16.0) ** 0.5)


def _model_time(blocks, work_per_block, threads, bps, eff, rate, sm_count):
    """Time of the busiest SM: it runs ceil(blocks / sm_count) blocks, bps at a time."""
    n = cdiv(blocks, sm_count)
    warps = threads // 32
    full, last = divmod(n, bps)
    t = full * bps * work_per_block / (rate * eff * _util(bps * warps))
    if last:
        t += last * work_per_block / (rate * eff * _util(last * warps))
    return t


def split_chunk(K, splits, align=SPLIT_ALIGN):
    """k_chunk of a split count (a multiple of `align`: the family's k_align), or None when `splits`
    chunks of that size would leave one empty."""
    if splits == 1:
        return K
    chunk = cdiv(cdiv(K, splits), align) * align
    return chunk if cdiv(K, chunk) == splits else None


def make_plan(family, tile, splits, K, transpose_b=False) -> Plan | None:
    """The Plan of a family / tile / split count for reduction length K (None: no such plan);
    transpose_b: a family that transposes B first (its `transposes_b` layout)."""
    fam = FAMILIES.get(family)
    if fam is None or tile not in fam.tiles + fam.unaligned_tiles or not 1 <= splits <= MAX_SPLITS or K < 1:
        return None
    if transpose_b and not fam.transposes_b:
        return None
    chunk = split_chunk(K, splits, fam.k_align)
    return None if chunk is None else Plan(family, tile, splits, chunk, transpose_b)


def b_reads(p: Plan, M, N, k_chunk, sm_count=132) -> int:
    """How often B comes from DRAM: the grid's x (N tiles) runs fastest, so a wave of sm_count x
    blocks_per_sm blocks covers a few rows of output tiles (or part of one), each sweeping all of
    B's panels; when B's part of one split, N x k_chunk floats, is more than the L2 keeps, every
    later wave re-reads it: min(row tiles, waves) reads (the head's logits = lnf @ wte^T, wte 154 MB:
    64 reads of wte with 128-row tiles, 32 with 256-row tiles), else one."""
    if 4.0 * N * max(k_chunk, 1) <= _L2_RESIDENT_BYTES:
        return 1
    rows_, tiles = cdiv(M, p.bm), cdiv(M, p.bm) * cdiv(N, p.bn)
    return max(1, min(rows_, cdiv(tiles, sm_count * p.blocks_per_sm)))


def _gemm_estimate(p: Plan, M, N, K, k_chunk, batch, epi, sm_count) -> float:
    """estimate_s of the GEMM kernel (and split-K reduction) alone, reduction length K."""
    fam = p.fam
    blocks = cdiv(M, p.bm) * cdiv(N, p.bn) * batch * p.splits
    t = _model_time(blocks, 2.0 * p.bm * p.bn * max(k_chunk, 1), p.threads, p.blocks_per_sm,
                    fam.efficiency[p.tile], fam.rate, sm_count)
    io = 1 if p.splits > 1 else EPI_IO[epi]
    per_block = _FILL_S + p.bm * p.bn * 4 * io / (_BYTES_PER_S / sm_count)
    per_sm = cdiv(blocks, sm_count)
    t += per_sm * per_block * (_HIDDEN if p.blocks_per_sm >= 2 else 1.0)
    t = max(t, 4.0 * batch * (M * K + b_reads(p, M, N, k_chunk, sm_count) * K * N + M * N * io) / _BYTES_PER_S,
            4.0 * blocks * (p.bm + p.bn) * max(k_chunk, 1) / _L2_BYTES_PER_S)
    if p.splits > 1:
        t += _LAUNCH_S + (2 * p.splits + EPI_IO[epi]) * M * N * 4 / _BYTES_PER_S
    return t


def has_colsum_kernel(p: Plan, ta, tb) -> bool:
    """Whether plan p's family has a kernel that sums A as stored while it reads it, for this layout."""
    return p.fam.colsum_kernel is not None and p.fam.colsum_kernel(p.tile, ta, tb) is not None


def estimate_s(p: Plan, M, N, K, batch=1, epi=EPI_NONE, sm_count=132, colsum=False) -> float:
    """Modelled seconds of one launch (split-K: both kernels): the busiest SM's main loops, plus
    per-block pipeline fill and epilogue stores (mostly hidden behind another resident block's
    main loop when blocks_per_sm >= 2), at least the DRAM traffic (B re-read where it outgrows
    the L2: `b_reads`) and the operand panels every block streams from L2; split-K adds its
    partials and the reduction; the re-layout passes (transposes) their bytes. colsum (matmul's
    a_colsum, A stored [K, M]): the A^T transpose of a swapped product and the consumers of
    gemm_wgmma_ra / gemm_wgmma3_ra give it nearly free, other plans read A once more."""
    extra = 0.0
    if colsum:
        fused = p.fam.swaps or has_colsum_kernel(p, True, False)
        extra = _LAUNCH_S / 3 + (0.0 if fused else _LAUNCH_S / 3 + 4.0 * K * M / _BYTES_PER_S)
    t = _gemm_estimate(p, *((N, M) if p.fam.swaps else (M, N)), K, p.k_chunk, batch, epi, sm_count)
    if (relaid := p.relaid(M, N, K)) is not None:     # (swaps: out^T = B^T A after A^T [M, K])
        t += _LAUNCH_S / 3 + 8.0 * batch * relaid[1] / _BYTES_PER_S
    return extra + t


def competing(family, wgmma=False, epi=None) -> list:
    """The families that compete for a product: the base family of `family` and, where `wgmma_ok`
    answered layout `wgmma`, its warpgroup-MMA partners that run that layout, compiled for epilogue
    code epi (None: any)."""
    base = FAMILIES[_base_family(family)]
    return [base.name] + [name for name in base.partners if wgmma in FAMILIES[name].layouts and
                          (epi is None or FAMILIES[name].runs_epi(epi))]


def _base_family(family):
    """The base family a `family` argument names: "tf32" or "bf16", else "simt"."""
    return family if family in ("tf32", "bf16") else "simt"


def split_room(out_dtype: str, floats: int) -> int:
    """The workspace floats split-K partials may use for a C of out_dtype: the split-K reduction
    writes fp32, so a bf16 C is one product (0)."""
    return floats if out_dtype == "f32" else 0


def plan(M, N, K, batch=1, sm_count=132, family="simt", max_ws=0, allow_split=True,
         vec=True, tiles=None, splits=None, epi=EPI_NONE, wgmma=False, colsum=False, scratch=None) -> Plan:
    """The tile and split count with the lowest modelled time (`estimate_s`). max_ws: floats
    available for split-K partials (0 disables split-K); vec: whether 16-byte loads are possible
    (TF32 has its guarded fallback for fewer tiles); tiles / splits: restrict the candidates to
    these tiles / this split count (benchmarks, sweeps, tuning); epi: the epilogue code (its
    [M, N] traffic weighs on the choice); wgmma: `wgmma_ok`'s answer, the layout whose
    warpgroup-MMA families compete too (`competing`; aligned operands only), those that re-lay an
    operand out where the planned scratch ({workspace: floats}, None: any) holds it. A wgmma tile's
    tie with its TMA twin goes to the TMA loader (5-20% faster where measured). colsum: the product
    also gives A's column sums (estimate_s)."""
    best = None
    for name in competing(family, wgmma if vec else False, epi):
        fam = FAMILIES[name]
        pool = fam.tiles if vec else fam.unaligned_tiles
        for tile in (t for t in pool if t in (fam.plan_tiles if tiles is None else tiles)):
            blocks = cdiv(M, tile[0]) * cdiv(N, tile[1]) * batch
            split_opts = [1]
            if splits is not None:
                split_opts = [splits]
            elif allow_split and batch == 1 and max_ws > 0 and K >= 2 * fam.k_align \
                    and blocks < fam.split_waves * sm_count * fam.blocks_per_sm(tile):
                # wgmma: also past one wave (a long K over few output tiles, the head's dlnf =
                # dlogits @ wte: 192 256x128 tiles, 1.45 waves; split 2: 2.9)
                split_opts = range(1, min(MAX_SPLITS, cdiv(K, fam.k_align)) + 1)
            for s in split_opts:
                chunk = split_chunk(K, s, fam.k_align)
                if chunk is None or (s > 1 and (s * M * N > max_ws or s > MAX_GRID_Z)):
                    continue
                p = Plan(name, tile, s, chunk, wgmma == fam.transposes_b)
                if not p.fits(M, N, K, scratch):
                    continue
                cp_async = fam.file == WGMMA_FILE and not fam.tma(tile)    # a tie with its TMA twin: TMA
                key = (estimate_s(p, M, N, K, batch, epi, sm_count, colsum), s, -tile[0] * tile[1], cp_async)
                if best is None or key < best[0]:
                    best = (key, p)
    if best is None:
        raise ValueError(f"no GEMM plan for M={M} N={N} K={K} batch={batch} {family} tiles={tiles} "
                         f"split={allow_split}")
    return best[1]


# Split counts the tuner tries (besides the cost model's own choice).
TUNE_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def tune_candidates(M, N, K, batch=1, family="simt", vec=True, max_ws=0, wgmma=False, epi=EPI_NONE,
                    scratch=None) -> list:
    """Every plan bench/tune.py may time for a shape: each tile of the families that can run it
    (unaligned operands: the base family's fallback tiles only; wgmma: the warpgroup-MMA families of
    that layout, as in `plan`) x each split count that fits the workspace."""
    out = []
    for name in competing(family, wgmma if vec else False, epi):
        fam = FAMILIES[name]
        for tile in fam.tiles if vec else fam.unaligned_tiles:
            for s in TUNE_SPLITS:
                if s > 1 and (batch != 1 or s * M * N > max_ws or K < 2 * fam.k_align):
                    continue
                p = make_plan(name, tile, s, K, wgmma == fam.transposes_b)
                if p is not None and p not in out and p.fits(M, N, K, scratch):
                    out.append(p)
    return out


def prune_candidates(cands, M, N, K, batch=1, epi=EPI_NONE, sm_count=132, keep=1.6, max_n=6,
                     always=(), colsum=False):
    """The candidates worth timing: modelled time (`estimate_s`) within `keep` x the best, at most
    max_n of them, fastest first; plans in `always` (the cost model's choice) are kept."""
    scored = sorted(((estimate_s(p, M, N, K, batch, epi, sm_count, colsum), i, p) for i, p in enumerate(cands)),
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


def workspace(cfg, ex=None) -> dict:
    """Split-K partials for the weight-gradient GEMMs (K = batch_size * block_size tokens),
    sized for both orientations (dW and dW^T) and the fp32 and tf32 base families at 132 SMs (and
    the plan's own, bf16); the wgmma
    kernels' re-laid operands where the plan holds them (`wgmma_scratch`, default the config's plan on
    sm_90: TF32's "gemm_bT" and "gemm_aT"). bench/tune.py only times splits that fit this size."""
    ex = ex or execution.resolve(cfg)
    K = cfg.batch_size * cfg.block_size
    need = 0
    for (m, n) in _weight_grad_shapes(cfg):
        for (M, N) in ((m, n), (n, m)):
            for fam in dict.fromkeys((GEMM_FAMILIES["fp32"], GEMM_FAMILIES["tf32"], ex.gemm_family)):
                p = plan(M, N, K, 1, 132, fam, max_ws=MAX_SPLITS * M * N)
                if p.splits > 1:
                    need = max(need, p.splits * M * N)
    out = {"gemm_splitk": ((need,), "f32")} if need else {}
    if ex.wgmma_scratch:
        shapes = _weight_grad_shapes(cfg)
        # B^T of the backward's dX = dY @ W (W [out, in]: [C, 4C] the largest), for the wgmma kernel
        out["gemm_bT"] = ((max(m * n for m, n in shapes),), "f32")
        # a weight gradient dW [M, N] = dY^T @ X's re-laid operand, for the register-A kernels: X^T
        # [N, tokens] (wgmma_ra) or dY^T [M, tokens] (wgmma_ra_t) of the per-layer weights (4C rows the
        # most: 101 MB at C 768 and 8192 tokens); of the tied head's dwte, lnf^T [C, tokens] only
        # (dlogits^T [V, tokens] would be 1.65 GB at GPT-2's V)
        rows = [max(m, n) for m, n in shapes[:4]] + [n for _, n in shapes[4:]]
        out["gemm_aT"] = ((max(rows) * K,), "f32")
    return out


def kernel_label(p: Plan, trans_a, trans_b, vec=True) -> str:
    """Short description of a plan: family, tile, split."""
    tile = p.fam.label(p.tile) + (" B^T first" if p.transpose_b else "")
    return f"{p.family} {tile} {layout_code(trans_a, trans_b)}{'' if vec else ' unaligned'}" + \
        (f" splitK={p.splits}" if p.splits > 1 else "")


def plan_label(p: Plan) -> str:
    """Compact plan name for tables: tf32 256x128s3, simt 128x128, + /splitK."""
    return f"{p.family} {p.fam.short(p.tile)}{' +bT' if p.transpose_b else ''}" + \
        (f" split{p.splits}" if p.splits > 1 else "")


def plan_unfit(p: Plan, family, vec, wgmma) -> str | None:
    """Why plan p cannot run a launch of base family `family` (rt.precision's), alignment `vec`
    and `wgmma_ok` answer `wgmma`; None when it can. (A table entry that does not fit is skipped; a
    plan the caller forces is refused with this reason.)"""
    fam = p.fam
    if fam.base != family:
        return f"plan family {p.family} but rt.precision wants {family}"
    if fam.name == fam.base:            # a base family: every layout, unaligned operands on some tiles
        return None if vec or p.tile in fam.unaligned_tiles else \
            f"{p.family.upper()} tile {p.tile} needs 16-byte aligned operands"
    if not vec or wgmma not in fam.layouts:
        return f"a {p.family} plan needs {fam.needs}"
    if p.transpose_b != (wgmma == fam.transposes_b):
        return f"a {p.family} plan {'with' if p.transpose_b else 'without'} transpose_b does not fit trans_b here"
    return None


def check_plan(label, p: Plan, family, vec, batch, cap, M, N, K, wgmma=False, epi=EPI_NONE):
    """A plan given by the caller must be runnable here (wgmma: `wgmma_ok` for this launch)."""
    why = plan_unfit(p, family, vec, wgmma)
    if why:
        raise ValueError(f"{label}: {why}")
    if not p.fam.runs_epi(epi):
        raise ValueError(f"{label}: the {p.family} kernels are not compiled for epilogue {epi}")
    if p.splits > 1:
        if batch != 1:
            raise ValueError(f"{label}: split-K is not available for batched GEMMs")
        if cap < p.splits * M * N:
            raise ValueError(f"{label}: workspace gemm_splitk holds {cap} floats < {p.splits} x {M} x {N}")
        if split_chunk(K, p.splits, p.fam.k_align) != p.k_chunk:
            raise ValueError(f"{label}: k_chunk {p.k_chunk} does not split K={K} into {p.splits}")
