"""Planning a GEMM: the block tile, the split-K factor and the operand re-layout of a shape, from a
cost model (`plan`, `estimate_s`), the candidates bench/tune.py times (`tune_candidates`), the
workspaces a config plans (`workspace`), and whether a plan can run a launch (`plan_unfit`).
Which layouts the warpgroup-MMA families can run, and with which scratch, is layout.py's."""
from __future__ import annotations

from dataclasses import dataclass

from gptcuda.runtime import execution
from gptcuda.runtime.execution import GEMM_FAMILIES
from gptcuda.ops.cuda.gemm.families import (EPI_BIAS, EPI_IO, EPI_NONE, EPI_RESID, FAMILIES, MAX_GRID_Z,
                                            MAX_SPLITS, SPLIT_ALIGN, cdiv)
from gptcuda.ops.cuda.gemm.layout import mode_flags


@dataclass(frozen=True)
class Plan:
    family: str          # "simt" | "tf32" | "wgmma" | "wgmma3_ra" | "wgmma_ra" | ...: a FAMILIES key
    tile: tuple          # an entry of the family's tiles
    threads: int
    blocks_per_sm: int
    splits: int
    k_chunk: int
    smem: int = 0
    transpose_b: bool = False   # wgmma on B [K, N]: B is first transposed into "gemm_bT" [N, K]
                                # (transpose_a: into "gemm_aT" after A^T, as [N, k slab])
    transpose_a: bool = False   # wgmma on A stored [K, M] (trans_a, the weight gradients): A is first
                                # transposed into "gemm_aT" [M, k slab] (TF32 only)
    k_slab: int = 0             # transpose_a: k rows per slab (a multiple of SPLIT_ALIGN, splits == 1);
                                # 0: the whole K at once

    @property
    def fam(self):
        return FAMILIES[self.family]

    @property
    def bm(self):
        return self.tile[0]

    @property
    def bn(self):
        return self.tile[1]


# The rest of the rough machine model (H200-like; the peak rates are the families'), only used to
# rank candidate plans against each other.
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
    """(tile, threads, blocks/SM, efficiency, smem) of the family's tiles that run operands of this
    alignment (`tiles`: restrict to these; default: the cost model's own set)."""
    fam = FAMILIES[family]
    pool = fam.tiles if vec else fam.unaligned_tiles
    return [(t, fam.threads(t), fam.blocks_per_sm(t), fam.efficiency[t], fam.smem(t))
            for t in pool if (t in fam.plan_tiles if tiles is None else t in tiles)]


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


def split_chunk(K, splits):
    """k_chunk of a split count (a multiple of SPLIT_ALIGN), or None when `splits` chunks of that
    size would leave one empty."""
    if splits == 1:
        return K
    chunk = cdiv(cdiv(K, splits), SPLIT_ALIGN) * SPLIT_ALIGN
    return chunk if cdiv(K, chunk) == splits else None


def make_plan(family, tile, splits, K, transpose_b=False, transpose_a=False, k_slab=0) -> Plan | None:
    """The Plan of a family / tile / split count for reduction length K (None: no such plan);
    transpose_b: a wgmma plan that first transposes B; transpose_a: a TF32 wgmma plan that first
    transposes A (stored [K, M]; with transpose_b B too) into "gemm_aT", in slabs of k_slab k rows
    (0 or >= K: all of K at once; else a multiple of SPLIT_ALIGN, and no split-K)."""
    fam = FAMILIES.get(family)
    if fam is None or not 1 <= splits <= MAX_SPLITS or K < 1:
        return None
    if transpose_b and not (fam.k_major or fam.b_first):
        return None
    k_slab = 0 if not transpose_a or k_slab >= K else int(k_slab)
    if transpose_a and (not fam.transposes_a or k_slab < 0 or k_slab % SPLIT_ALIGN or (k_slab and splits > 1)):
        return None
    chunk = split_chunk(K, splits)
    if chunk is None:
        return None
    for t, threads, bps, _eff, smem in _candidates(family, True, tiles=[tile]) or \
            _candidates(family, False, tiles=[tile]):
        return Plan(family, t, threads, bps, splits, chunk, smem, transpose_b, transpose_a, k_slab)
    return None


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
    partials and the reduction; the re-layout passes (transposes) their bytes.
    transpose_a plans: the transposes of A (and B) at ~3 TB/s, then one GEMM per k slab, every
    slab after the first reading out back (the residual epilogue). colsum (matmul's a_colsum, A
    stored [K, M]): the A^T transposes and the consumers of gemm_wgmma_ra / gemm_wgmma3_ra give it
    nearly free, other plans read A once more."""
    extra = 0.0
    if colsum:
        fused = p.transpose_a or p.fam.swaps or has_colsum_kernel(p, True, False)
        extra = _LAUNCH_S / 3 + (0.0 if fused else _LAUNCH_S / 3 + 4.0 * K * M / _BYTES_PER_S)
    return extra + _estimate_s(p, M, N, K, batch, epi, sm_count)


def _estimate_s(p: Plan, M, N, K, batch, epi, sm_count) -> float:
    if p.transpose_a:
        kc = p.k_slab or K
        n, last = cdiv(K, kc), K - (cdiv(K, kc) - 1) * kc
        t = _gemm_estimate(p, M, N, kc if n > 1 else K, kc if n > 1 else p.k_chunk, batch, epi, sm_count)
        if n > 1:
            t += (n - 2) * _gemm_estimate(p, M, N, kc, kc, batch, EPI_RESID, sm_count)
            t += _gemm_estimate(p, M, N, last, last, batch, EPI_RESID, sm_count)
        ops = 2 if p.transpose_b else 1
        return t + n * ops * _LAUNCH_S / 3 + \
            8.0 * batch * K * (M + (N if p.transpose_b else 0)) / _TRANSPOSE_BYTES_PER_S
    if p.fam.swaps:                    # out^T = B^T A after A^T [M, K]
        return _gemm_estimate(p, N, M, K, p.k_chunk, batch, epi, sm_count) + _LAUNCH_S / 3 + \
            8.0 * batch * K * M / _BYTES_PER_S
    t = _gemm_estimate(p, M, N, K, p.k_chunk, batch, epi, sm_count)
    if p.transpose_b:
        t += _LAUNCH_S / 3 + 8.0 * batch * K * N / _BYTES_PER_S
    return t


def slab_epi_ok(epi) -> bool:
    """Whether a product in k slabs can apply this epilogue (linear ones: bias and residual on the
    first slab, the later ones add to out)."""
    return epi in (EPI_NONE, EPI_BIAS, EPI_RESID)


def competing(family, wgmma, vec=True, epi=None, ra_bt=True, ra_at=True) -> list:
    """The families that compete for a product: the base family of `family`, and where `wgmma_ok`
    answered `wgmma` its warpgroup-MMA partner, plus, with 16-byte aligned operands, the partner
    that read any layout as stored (`stored_partners`), and for A [K, M] ("transpose_a" /
    "transpose_ab") the register-A ones (`ra_partners`: the first with B [N, K], or with B [K, N]
    transposed into "gemm_aT" where that holds it (ra_bt), the second with B [K, N] as stored, the
    third (swaps) with A^T [M, K] in "gemm_aT" where that holds it (ra_at)) whose kernels exist for
    epilogue code epi (None: any)."""
    base = FAMILIES[_base_family(family)]
    out = [base.name] + ([base.partner] if wgmma and base.partner else [])
    if wgmma and vec:
        out += list(base.stored_partners)
    if wgmma in ("transpose_a", "transpose_ab") and vec:
        for name in base.ra_partners:
            fam = FAMILIES[name]
            if epi is not None and not fam.runs_epi(epi):
                continue
            b_stored = wgmma == "transpose_ab"           # B [K, N]
            if fam.swaps:
                ok = b_stored and ra_at
            else:
                ok = (fam.mn_major and b_stored) or (not fam.mn_major and (ra_bt or not b_stored))
            if ok:
                out.append(name)
    return out


def _base_family(family):
    """The base family a `family` argument names: "tf32", else "simt"."""
    return "tf32" if family == "tf32" else "simt"


def plan(M, N, K, batch=1, sm_count=132, family="simt", max_ws=0, allow_split=True,
         vec=True, tiles=None, splits=None, epi=EPI_NONE, wgmma=False, k_slab=0, colsum=False,
         ra_bt=True, ra_at=True) -> Plan:
    """The tile and split count with the lowest modelled time (`estimate_s`). max_ws: floats
    available for split-K partials (0 disables split-K); vec: whether 16-byte loads are possible
    (TF32 has its guarded fallback for fewer tiles); tiles / splits: restrict the candidates to
    these tiles / this split count (benchmarks, sweeps, tuning); epi: the epilogue code (its
    [M, N] traffic weighs on the choice); wgmma: `wgmma_ok`'s answer, the warpgroup-MMA tiles
    compete too ("transpose": their plans transpose B first; "transpose_ab" / "transpose_a": A
    (and B) first, in slabs of k_slab k rows (`transpose_a_slab`; 0: all of K), no split-K when
    that is less than K; for the simt family: the 3xTF32 tiles). A wgmma tile's tie with its TMA
    twin goes to the TMA loader (5-20% faster where measured). colsum: the product also gives A's
    column sums (estimate_s); ra_bt / ra_at: "gemm_aT" holds B^T [N, K] / A^T [M, K] for a register-A
    plan (`competing`)."""
    best = None
    for name in competing(family, wgmma, vec, epi, ra_bt, ra_at):
        fam = FAMILIES[name]
        tb, ta = mode_flags(name, wgmma)
        slab = k_slab if ta and 0 < k_slab < K else 0
        if slab and (not slab_epi_ok(epi) or slab % SPLIT_ALIGN):
            continue
        # transpose_ab re-lays both operands out densely: the tiles' 16-byte loads read the scratch
        for tile, threads, bps, _eff, smem in _candidates(name, vec or (ta and tb), tiles):
            blocks = cdiv(M, tile[0]) * cdiv(N, tile[1]) * batch
            split_opts = [1]
            if splits is not None:
                split_opts = [splits]
            elif allow_split and batch == 1 and max_ws > 0 and K >= 2 * SPLIT_ALIGN and not slab \
                    and blocks < fam.split_waves * sm_count * bps:
                # wgmma: also past one wave (a long K over few output tiles, the head's dlnf =
                # dlogits @ wte: 192 256x128 tiles, 1.45 waves; split 2: 2.9)
                split_opts = range(1, min(MAX_SPLITS, cdiv(K, SPLIT_ALIGN)) + 1)
            for s in split_opts:
                chunk = split_chunk(K, s)
                if chunk is None or (s > 1 and (s * M * N > max_ws or s > MAX_GRID_Z or slab)):
                    continue
                p = Plan(name, tile, threads, bps, s, chunk, smem, tb, ta, slab)
                cp_async = fam.k_major and not fam.tma(tile)      # a tie with its TMA twin: TMA
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
                    k_slab=0, ra_bt=True, ra_at=True) -> list:
    """Every plan bench/tune.py may time for a shape: each tile of the family that can run it
    (unaligned operands: the fallback tiles only; wgmma: the warpgroup-MMA tiles too, transpose_a
    ones in slabs of k_slab (0: all of K; no split-K and only linear epilogues `epi` when less)) x
    each split count that fits the workspace."""
    base = FAMILIES[_base_family(family)]
    pool = [(base.name, t) for t in (base.tiles if vec else base.unaligned_tiles)]
    for name in competing(family, wgmma, vec, epi, ra_bt, ra_at)[1:]:
        fam = FAMILIES[name]
        if vec or wgmma == "transpose_ab" and fam.transposes_a:
            pool += [(name, t) for t in fam.tiles]
    out = []
    for fam, tile in pool:
        tb, ta = mode_flags(fam, wgmma)
        slab = k_slab if ta and 0 < k_slab < K else 0
        if slab and not slab_epi_ok(epi):
            continue
        for s in TUNE_SPLITS:
            if s > 1 and (batch != 1 or s * M * N > max_ws or K < 2 * SPLIT_ALIGN or slab):
                continue
            p = make_plan(fam, tile, s, K, tb, ta, slab)
            if p is not None and p not in out:
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


HEAD_SLABS = 2


def workspace(cfg, ex=None) -> dict:
    """Split-K partials for the weight-gradient GEMMs (K = batch_size * block_size tokens),
    sized for both orientations (dW and dW^T) and both base families at 132 SMs; the wgmma
    kernels' re-laid operands where the plan holds them (`wgmma_scratch`, default the config's plan on
    sm_90: TF32's "gemm_bT" and "gemm_aT"). bench/tune.py only times splits that fit this size."""
    relayout = (ex or execution.resolve(cfg)).wgmma_scratch
    K = cfg.batch_size * cfg.block_size
    need = 0
    for (m, n) in _weight_grad_shapes(cfg):
        for (M, N) in ((m, n), (n, m)):
            for fam in GEMM_FAMILIES.values():
                p = plan(M, N, K, 1, 132, fam, max_ws=MAX_SPLITS * M * N)
                if p.splits > 1:
                    need = max(need, p.splits * M * N)
    out = {"gemm_splitk": ((need,), "f32")} if need else {}
    w_max = max(m * n for m, n in _weight_grad_shapes(cfg))
    if relayout:
        # B^T of the backward's dX = dY @ W (W [out, in]: [C, 4C] the largest), for the wgmma kernel
        out["gemm_bT"] = ((w_max,), "f32")
        # A^T and B^T of a weight gradient dW = dY^T @ X (trans_a) for the wgmma kernel, [out + in,
        # tokens] of the per-layer weights (the MLP's 4C + C the largest: 126 MB at C 768 and 8192
        # tokens); the tied head's dwte (V + C rows) runs in k slabs of it, at most HEAD_SLABS
        # (every slab after the first reads and writes dwte [V, C] once more: 0.3 GB at GPT-2's V)
        layer_shapes = _weight_grad_shapes(cfg)[:4]
        V = int(cfg.vocab_size or 0)
        head = (V + cfg.n_embd) * cdiv(K, HEAD_SLABS) if V else 0
        out["gemm_aT"] = ((max(max((m + n) * K for m, n in layer_shapes), head),), "f32")
    return out


def kernel_label(p: Plan, trans_a, trans_b, vec=True) -> str:
    """Short description of a plan: family, tile, split."""
    tile = p.fam.label(p.tile)
    if p.transpose_a:
        tile += (" A^T, B^T first" if p.transpose_b else " A^T first") + \
            (f" in k slabs of {p.k_slab}" if p.k_slab else "")
    elif p.transpose_b:
        tile += " B^T first"
    t = ("T" if trans_a else "N") + ("T" if trans_b else "N")
    return f"{p.family} {tile} {t}{'' if vec else ' unaligned'}" + (f" splitK={p.splits}" if p.splits > 1 else "")


def plan_label(p: Plan) -> str:
    """Compact plan name for tables: tf32 256x128s3, simt 128x128, + /splitK."""
    tile = p.fam.short(p.tile)
    if p.transpose_a:
        tile += (" +aT" if p.transpose_b else " +aT,b") + (f" slab{p.k_slab}" if p.k_slab else "")
    elif p.transpose_b:
        tile += " +bT"
    return f"{p.family} {tile}" + (f" split{p.splits}" if p.splits > 1 else "")


def plan_unfit(p: Plan, family, vec, wgmma, slab=0) -> str | None:
    """Why plan p cannot run a launch of base family `family` (rt.precision's), alignment `vec`
    and `wgmma_ok` answer `wgmma` (slab: the k rows per slab rt's "gemm_aT" holds for it, 0: all
    of K, `rt_transpose_a_slab`); None when it can. (A table entry that does not fit is skipped; a
    plan the caller forces is refused with this reason.)"""
    fam = p.fam
    if fam.a_regs and fam.products == 1:    # TF32 weight gradients: A [K, M] through registers; B [N, K],
                                            # [K, N] transposed first, or as stored
        if family != fam.base:
            return f"plan family {p.family} but rt.precision wants {family}"
        if wgmma not in ("transpose_a", "transpose_ab") or not vec or (fam.mn_major and wgmma != "transpose_ab"):
            return f"a {p.family} plan needs {fam.needs}"
        if fam.b_first and p.transpose_b != (wgmma == "transpose_ab"):
            return f"a {p.family} plan {'with' if p.transpose_b else 'without'} transpose_b does not fit trans_b here"
    elif fam.layouts:            # reads its layouts as stored (wgmma3_ra)
        if family != fam.base:
            return f"plan family {p.family} but rt.precision wants {family}"
        if not wgmma or not vec or (fam.mn_major and wgmma != "transpose_ab"):
            return f"a {p.family} plan needs {fam.needs}"
    elif fam.k_major:
        if family != fam.base:
            return f"plan family {p.family} but rt.precision wants {family}"
        if not wgmma:
            return f"a {p.family} plan needs {fam.needs}"
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
    elif not vec and p.tile not in fam.unaligned_tiles:
        return f"{p.family.upper()} tile {p.tile} needs 16-byte aligned operands"
    return None


def check_plan(label, p: Plan, family, vec, batch, cap, M, N, K, wgmma=False, slab=0, epi=EPI_NONE):
    """A plan given by the caller must be runnable here (wgmma: `wgmma_ok` for this launch;
    transpose_a: slab as in `plan_unfit`, a linear epilogue when it runs in k slabs)."""
    why = plan_unfit(p, family, vec, wgmma, slab)
    if why:
        raise ValueError(f"{label}: {why}")
    if not p.fam.runs_epi(epi):
        raise ValueError(f"{label}: the {p.family} kernels are not compiled for epilogue {epi}")
    if p.k_slab and not slab_epi_ok(epi):
        raise ValueError(f"{label}: a plan in k slabs adds them through the residual epilogue: "
                         f"epilogue {epi} cannot run in slabs")
    if p.splits > 1:
        if batch != 1:
            raise ValueError(f"{label}: split-K is not available for batched GEMMs")
        if cap < p.splits * M * N:
            raise ValueError(f"{label}: workspace gemm_splitk holds {cap} floats < {p.splits} x {M} x {N}")
        if split_chunk(K, p.splits) != p.k_chunk:
            raise ValueError(f"{label}: k_chunk {p.k_chunk} does not split K={K} into {p.splits}")
