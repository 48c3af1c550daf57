"""Planning a GEMM: its plans (family, tile, split-K, operand re-layout), the cost model that ranks them
(`estimate_s`, `plan`), the candidates bench/tune.py times (`tune_candidates`, `prune_candidates`), why a
plan cannot run a product (`plan_unfit`), and the GEMM workspaces a config plans (`workspace`)."""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from gptcuda.ops.cuda import cdiv
from gptcuda.runtime import execution
from gptcuda.runtime.execution import GEMM_FAMILIES
from gptcuda.model.products import Product
from gptcuda.ops.cuda.gemm.families import (DUAL_EPIS, DUAL_TILES, EPI_IO, FAMILIES, MAX_SPLITS, PRODUCTS,
                                            SPLIT_ALIGN, WGMMA_FILE, dual_serves, epi_code, layout_code)

WGMMA_WORKSPACES = ("gemm_bT", "gemm_aT")   # scratch only the warpgroup-MMA kernels read


def wgmma_layout(mode, g: Product):
    """g's layout code where the warpgroup-MMA families may run it in wgmma_mode `mode`, else False: aligned
    operands; "tf32": NT (batched too), or one product with K % 4 == 0 (a re-laid operand's rows are tensor
    map strides: 16-byte multiples); "3xtf32": one product of PRODUCTS' layouts, K % 4 == 0; None: never."""
    if mode is None or not g.vec:
        return False
    if mode == "tf32" and g.layout == "NT":
        return g.layout
    if g.batch != 1 or g.K % 4 or (mode == "3xtf32" and (g.ta, g.tb) not in PRODUCTS):
        return False
    return g.layout


@dataclass(frozen=True)
class Plan:
    family: str          # a FAMILIES key
    tile: tuple          # one of the family's tiles
    splits: int
    k_chunk: int
    transpose_b: bool = False   # B [K, N] first transposed into the family's scratch as [N, K]

    @property
    def fam(self):
        return FAMILIES[self.family]

    @property
    def geo(self):
        return self.fam.geometry(self.tile)

    def relaid(self, g: Product):
        """(workspace, floats) of B^T [N, K] (transpose_b) or A^T [M, K] (swaps) made before the kernel; None."""
        if self.transpose_b or self.fam.swaps:
            return self.fam.scratch, (g.M if self.fam.swaps else g.N) * g.K
        return None

    def fits(self, g: Product, scratch=None) -> bool:
        """Whether the planned scratch ({workspace: floats}; None: unlimited) holds what it re-lays out."""
        need = self.relaid(g)
        return need is None or scratch is None or 0 < need[1] <= scratch.get(need[0], 0)


# The rest of the rough machine model (H200-like; the peak rates are the families'), only for ranking plans;
# where the numbers come from: bench/NOTES.md, "The GEMM layer: why its tiles, rates and constants".
_BYTES_PER_S = 3.5e12
_L2_BYTES_PER_S = 9e12                # L2 -> SM operand streaming, all SMs together
_LAUNCH_S = 3e-6
_L2_RESIDENT_BYTES = 40e6             # an operand above this is re-read from DRAM (b_reads)
_FILL_S = 1.5e-6                      # a block's pipeline fill: latency of its first operand tiles
_HIDDEN = 0.25                        # share of fill + epilogue not hidden when another block is resident


def _model_time(blocks, work_per_block, threads, bps, eff, rate, sm_count):
    """Time of the busiest SM: it runs ceil(blocks / sm_count) blocks, bps at a time, at the share of its
    peak that its resident warps reach (rough: sqrt(warps / 16), at most 1)."""
    def run(n, resident):             # n blocks, `resident` at a time
        return n * work_per_block / (rate * eff * min(1.0, (resident * (threads // 32) / 16.0) ** 0.5))
    full, last = divmod(cdiv(blocks, sm_count), bps)
    t = run(full * bps, bps)
    return t + run(last, last) if last else t


def split_chunk(K, splits, align=SPLIT_ALIGN):
    """k_chunk of a split count (a multiple of the family's k_align), None where a chunk would be empty."""
    if splits == 1:
        return K
    chunk = cdiv(cdiv(K, splits), align) * align
    return chunk if cdiv(K, chunk) == splits else None


def make_plan(family, tile, splits, K, transpose_b=False) -> Plan | None:
    """The Plan of a family / tile / split count for reduction length K; None: no such plan."""
    fam = FAMILIES.get(family)
    if fam is None or tile not in fam.tiles + fam.unaligned_tiles or not 1 <= splits <= MAX_SPLITS or K < 1 or \
            transpose_b and not fam.transposes_b:
        return None
    chunk = split_chunk(K, splits, fam.k_align)
    return None if chunk is None else Plan(family, tile, splits, chunk, transpose_b)


def b_reads(p: Plan, M, N, k_chunk, sm_count=132) -> int:
    """How often B comes from DRAM: once, or where B's part of a split (N x k_chunk floats) outgrows the L2,
    once a wave of blocks where N tiles run fastest (the grid's x; a persistent kernel's walk unless C is
    wider than tall, where it walks m fastest and reads B once: gemm_wgmma.cu WsTile): min(row tiles, waves)."""
    rows_, cols = cdiv(M, p.tile[0]), cdiv(N, p.tile[1])
    if 4.0 * N * max(k_chunk, 1) <= _L2_RESIDENT_BYTES or p.geo.persistent and cols * p.tile[1] > rows_ * p.tile[0]:
        return 1
    tiles = rows_ * cols
    return max(1, min(rows_, cdiv(tiles, sm_count * p.geo.blocks_per_sm)))


def estimate_s(p: Plan, g: Product, sm_count=132) -> float:
    """Modelled seconds of product g by plan p: the busiest SM's main loops plus per-block fill and epilogue
    (mostly hidden where another block is resident), at least the DRAM traffic and the L2 operand streaming;
    plus split-K's partials and reduction, a re-laid operand's pass and, for g.colsum, the column sums."""
    M, N = (g.N, g.M) if p.fam.swaps else (g.M, g.N)       # (swaps: out^T = B^T A after A^T [M, K])
    K, k, epi, (bm, bn), geo = g.K, max(p.k_chunk, 1), epi_code(g), p.tile[:2], p.geo
    blocks = cdiv(M, bm) * cdiv(N, bn) * g.batch * p.splits
    t = _model_time(blocks, 2.0 * bm * bn * k, geo.threads, geo.blocks_per_sm, p.fam.rates[p.tile], p.fam.rate,
                    sm_count)
    io = 1 if p.splits > 1 else EPI_IO[epi]
    per_block = _FILL_S + bm * bn * 4 * io / (_BYTES_PER_S / sm_count)
    t += cdiv(blocks, sm_count) * per_block * (_HIDDEN if geo.blocks_per_sm >= 2 else 1.0)
    t = max(t, 4.0 * g.batch * (M * K + b_reads(p, M, N, k, sm_count) * K * N + M * N * io) / _BYTES_PER_S,
            4.0 * blocks * (bm + bn) * k / _L2_BYTES_PER_S)
    if p.splits > 1:
        t += _LAUNCH_S + (2 * p.splits + EPI_IO[epi]) * M * N * 4 / _BYTES_PER_S
    if (relaid := p.relaid(g)) is not None:
        t += _LAUNCH_S / 3 + 8.0 * g.batch * relaid[1] / _BYTES_PER_S
    if g.colsum:        # nearly free from a swapped product's A^T or a kernel that sums A; else A read once more
        t += _LAUNCH_S / 3 + (0.0 if p.fam.swaps or p.fam.colsum else _LAUNCH_S / 3 + 4.0 * g.K * g.M / _BYTES_PER_S)
    return t


# gemm_wgmma_dual's tile times, for pair_plan's schedule only: a 128 x 192 k tile of 64 in ~0.455 us (a weight
# gradient's long tile on the H200, bench/NOTES.md), other tiles in proportion to their area; a tile's
# epilogue and fill with two consumer warpgroups, ~2 us (bf16 C) or ~3 us (fp32 C, twice the bytes), half
# that with four (each stores a quarter of the tile)
_DUAL_K_TILE_S = 0.455e-6 / (128 * 192)
_DUAL_EPI_S = {"bf16": 2e-6, "f32": 3e-6}
PAIR_MAX_SPLITS = 8


def dual_time(gw: Product, gx: Product, tile, splits, k_chunk, sm_count=132) -> float:
    """Modelled seconds of gemm_wgmma_dual over weight gradient gw (split `splits` ways, k_chunk a split)
    and input gradient gx on `tile`: the list (gw's tiles, then gx's) taken in order by min(tiles,
    sm_count) blocks, each taking the next tile when it is free (the kernel's counter), the last to finish;
    plus split-K's partials and reduction."""
    bm, bn = tile[:2]
    k_tile, wgs = _DUAL_K_TILE_S * bm * bn, bm // 64

    def tiles(g, n_splits, chunk, out):
        n = cdiv(g.M, bm) * cdiv(g.N, bn)
        return [(cdiv(min(g.K, chunk * (z + 1)) - chunk * z, 64)) * k_tile + _DUAL_EPI_S[out] * 2 / wgs
                for z in range(n_splits) for _ in range(n)]
    work = tiles(gw, splits, k_chunk, "f32") + tiles(gx, 1, gx.K, "bf16")
    free = [0.0] * min(len(work), sm_count)
    heapq.heapify(free)
    for w in work:
        heapq.heappush(free, heapq.heappop(free) + w)
    t = max(free)
    if splits > 1:
        t += _LAUNCH_S + (2 * splits + 1) * gw.M * gw.N * 4 / _BYTES_PER_S
    return t


def pair_refusal(gw: Product, gx: Product) -> str | None:
    """Why weight gradient gw and input gradient gx cannot run as one gemm_wgmma_dual whatever the plan (gw: TN,
    fp32 or bf16 C, plain, colsum beside a plain gx; gx: NN, bf16 C, none or dgelu; one product each, aligned),
    or None."""
    if (gw.layout, gx.layout) != ("TN", "NN") or gw.epilogue != "none" or gw.bias or gx.bias or gx.colsum or \
            epi_code(gx) not in DUAL_EPIS or gw.batch != 1 or gx.batch != 1 or not (gw.vec and gx.vec) or \
            gw.colsum and epi_code(gx) != DUAL_EPIS[0]:      # (no variant: the dgelu pair, fcproj's, sums no bias)
        return "the pair cannot run as one launch (layouts, epilogues, alignment)"
    return None


def pair_plan(gw: Product, gx: Product, sm_count=132, max_ws=0) -> Plan | None:
    """The plan of gemm_wgmma_dual for weight gradient gw and input gradient gx over the same dY: the tile (of
    DUAL_TILES that dual_serves; the ping-pong ones only the measured table picks) and gw's split count (up to
    PAIR_MAX_SPLITS, partials within max_ws floats) of the least dual_time; None where pair_refusal says no."""
    if pair_refusal(gw, gx):
        return None
    best = None
    for tile in (t for t in DUAL_TILES if dual_serves(t, epi_code(gx), gw.colsum)):
        for s in range(1, PAIR_MAX_SPLITS + 1):
            chunk = split_chunk(gw.K, s, 64)
            if chunk is None or s > 1 and s * gw.M * gw.N > max_ws:
                continue
            t = dual_time(gw, gx, tile, s, chunk, sm_count)
            if best is None or t < best[0]:
                best = (t, Plan("bf16", tile, s, chunk))
    return None if best is None else best[1]


def pair_unfit(p: Plan, gw: Product, gx: Product, max_ws=0) -> str | None:
    """Why plan p cannot run the pair (gw, gx) as one gemm_wgmma_dual (the pair itself: pair_refusal; a tile
    the kernel lacks; a split count that K or max_ws floats of partials do not allow), or None."""
    why = pair_refusal(gw, gx)
    if why:
        return why
    if p.family != "bf16" or not dual_serves(p.tile, epi_code(gx), gw.colsum):
        return (f"gemm_wgmma_dual has no tile {p.tile} for {gx.epilogue}{' with the column sums' if gw.colsum else ''}"
                f" (bf16)")
    if make_plan("bf16", p.tile, p.splits, gw.K) != p or p.splits > PAIR_MAX_SPLITS:
        return f"split {p.splits} (k_chunk {p.k_chunk}) is not a split of K = {gw.K} within {PAIR_MAX_SPLITS}"
    if p.splits > 1 and p.splits * gw.M * gw.N > max_ws:
        return f"{p.splits} x {gw.M} x {gw.N} partials outgrow the split-K workspace ({max_ws} floats)"
    return None


def competing(family, wgmma=False, epi=None) -> list:
    """The base `family` and its partners that run layout `wgmma` (`wgmma_layout`'s), built for epi (None: any)."""
    return [family] + [name for name in FAMILIES[family].partners if wgmma in FAMILIES[name].layouts and
                       (epi is None or any(c[2] == epi for c in FAMILIES[name].combos()))]


def split_room(out_dtype: str, floats: int, g: Product | None = None) -> int:
    """Workspace floats for split-K partials into a C of out_dtype: the reduction writes fp32, and a bf16 C of a
    plain weight gradient (g: trans_a, no epilogue or bias: bf16 gradients); other bf16 Cs split none (0)."""
    plain_dw = g is not None and g.ta and g.epilogue == "none" and not g.bias and g.batch == 1
    return floats if out_dtype == "f32" or plain_dw else 0


def _plans(g: Product, family, mode, max_ws, scratch, tiles_of, splits_of):
    """Product g's plans by the `competing` families, tiles_of(fam) x splits_of(fam, tile), whose split-K
    fits (one product, partials within max_ws floats) and whose re-laid operand the scratch holds."""
    wg = wgmma_layout(mode, g)
    for name in competing(family, wg, epi_code(g)):
        fam = FAMILIES[name]
        for tile in tiles_of(fam):
            if not fam.serves(tile, epi_code(g), g.colsum, g.out or "f32"):
                continue
            for s in splits_of(fam, tile):
                chunk = split_chunk(g.K, s, fam.k_align)
                if chunk is None or s > 1 and (g.batch != 1 or s > MAX_SPLITS or s * g.M * g.N > max_ws):
                    continue
                p = Plan(name, tile, s, chunk, wg == fam.transposes_b)
                if p.fits(g, scratch):
                    yield p


def plan(g: Product, family, mode=None, sm_count=132, max_ws=0, scratch=None, tiles=None, splits=None) -> Plan:
    """Product g's plan of the lowest modelled time (`estimate_s`) among the base `family`'s and, in wgmma_mode
    `mode`, its warpgroup-MMA partners' where the scratch ({workspace: floats}; None: any) holds what they
    re-lay out. max_ws: floats for split-K partials (0: none); tiles / splits: only these (benchmarks,
    tests; else plan_tiles, and split-K below split_waves waves of blocks). Ties go to fewer splits, the
    larger tile, then a wgmma tile's TMA twin."""
    def tiles_of(fam):
        pool = fam.tiles if g.vec else fam.unaligned_tiles
        return [t for t in pool if t in (tiles if tiles is not None else fam.plan_tiles or fam.tiles)]

    def splits_of(fam, tile):
        if splits is not None:
            return [splits]
        if g.batch == 1 and max_ws > 0 and g.K >= 2 * fam.k_align and \
                cdiv(g.M, tile[0]) * cdiv(g.N, tile[1]) < fam.split_waves * sm_count * fam.geometry(tile).blocks_per_sm:
            return range(1, min(MAX_SPLITS, cdiv(g.K, fam.k_align)) + 1)
        return [1]

    best = min(_plans(g, family, mode, max_ws, scratch, tiles_of, splits_of), default=None, key=lambda p: (
        estimate_s(p, g, sm_count), p.splits, -p.tile[0] * p.tile[1], p.fam.file == WGMMA_FILE and not p.geo.tma))
    if best is None:
        raise ValueError(f"no GEMM plan for {g} {family} tiles={tiles}")
    return best


# Split counts the tuner tries (besides the cost model's own choice).
TUNE_SPLITS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)


def tune_candidates(g: Product, family, mode=None, max_ws=0, scratch=None) -> list:
    """Every plan bench/tune.py may time for product g: as `plan`'s, every tile x TUNE_SPLITS."""
    return list(_plans(g, family, mode, max_ws, scratch, lambda fam: fam.tiles if g.vec else fam.unaligned_tiles,
                       lambda fam, tile: [s for s in TUNE_SPLITS if s == 1 or g.K >= 2 * fam.k_align]))


def prune_candidates(cands, g: Product, sm_count=132, keep=1.6, max_n=6) -> list:
    """The candidates worth timing, fastest first: within `keep` x the best's modelled time, at most max_n."""
    scored = sorted((estimate_s(p, g, sm_count), i, p) for i, p in enumerate(cands))
    return [p for t, _, p in scored if t <= keep * scored[0][0]][:max_n]


def wave_candidates(cands, g: Product, kept, sm_count=132, max_splits=8, fill=0.9, tol=0.02) -> list:
    """For each (family, tile) of the kept candidates whose unsplit blocks fill less than `fill` of their
    waves: the plan of cands with the split count (at most max_splits) whose k loops fill the waves best
    (waves / splits, the fewest splits within tol of the least), where that is not 1. The cost model
    charges split-K's partials more than the H200 takes for them, so its ranking prunes these: dW fc's 96
    tiles of 128 x 192 on 132 SMs split 4 (2.9 waves of a quarter of the k loop) ranks 13th of its 20
    plans at B8 (bench/NOTES.md, a sixth session)."""
    tiles_kept = {(p.family, p.tile, p.transpose_b) for p in kept}
    groups = {}
    for p in cands:
        if (p.family, p.tile, p.transpose_b) in tiles_kept and p.splits <= max_splits:
            groups.setdefault((p.family, p.tile, p.transpose_b), []).append(p)
    out = []
    for plans in groups.values():
        M, N = (g.N, g.M) if plans[0].fam.swaps else (g.M, g.N)
        tiles = cdiv(M, plans[0].tile[0]) * cdiv(N, plans[0].tile[1]) * g.batch
        slots = sm_count * plans[0].geo.blocks_per_sm
        if tiles >= fill * cdiv(tiles, slots) * slots:
            continue
        ranked = sorted((cdiv(tiles * p.splits, slots) / p.splits, p.splits, i) for i, p in enumerate(plans))
        best = min(ranked, key=lambda r: (r[0] > (1 + tol) * ranked[0][0], r[1]))
        if best[1] > 1:
            out.append(plans[best[2]])
    return out


def plan_unfit(p: Plan, g: Product, family, mode=None, ws_floats=None, scratch=None, out="f32") -> str | None:
    """Why plan p cannot run product g under base family `family` and wgmma_mode `mode` into a C of dtype
    out, with ws_floats of split-K workspace and the scratch {workspace: floats} (None: not checked); None
    when it can. A table entry that does not fit is skipped; a forced plan is refused with the reason."""
    fam, wg = p.fam, wgmma_layout(mode, g)
    if fam.base != family:
        return f"plan family {p.family} but rt.precision wants {family}"
    if fam.name == fam.base:            # a base family: every layout, unaligned operands on some tiles
        if not g.vec and p.tile not in fam.unaligned_tiles:
            return f"{p.family.upper()} tile {p.tile} needs 16-byte aligned operands"
    elif wg not in fam.layouts:
        return f"a {p.family} plan needs {fam.needs}"
    elif p.transpose_b != (wg == fam.transposes_b):
        return f"a {p.family} plan {'with' if p.transpose_b else 'without'} transpose_b does not fit trans_b here"
    ta, tb = fam.kernel_layout(g.layout)
    if (ta, tb, epi_code(g), g.bias) not in fam.combos() or out not in fam.out_dtypes(ta, tb):
        return (f"the {p.family} kernels are not compiled for {layout_code(ta, tb)} with epilogue code {epi_code(g)}"
                f"{' and a bias' if g.bias else ''} into {out} (the op interface's products: gemm.PRODUCTS; bf16: "
                f"gemm.BF16_OUTS)")
    if not fam.serves(p.tile, epi_code(g), g.colsum, out if p.splits == 1 else "f32"):
        return (f"the {p.family} tile {fam.short(p.tile)} has no kernel for epilogue code {epi_code(g)}"
                f"{' with the column sums' if g.colsum else ''}")
    if p.splits > 1 and g.batch != 1:
        return "split-K is not available for batched GEMMs"
    if p.splits > 1 and ws_floats is not None and ws_floats < p.splits * g.M * g.N:
        return f"workspace gemm_splitk holds {ws_floats} floats < {p.splits} x {g.M} x {g.N}"
    if split_chunk(g.K, p.splits, fam.k_align) != p.k_chunk:
        return f"k_chunk {p.k_chunk} does not split K={g.K} into {p.splits}"
    if not p.fits(g, scratch):
        return "this plan needs the workspace {} of {} floats".format(*p.relaid(g))
    return None


def plan_label(p: Plan) -> str:
    """Compact plan name for tables: family, tile (+bT: B^T first), split."""
    return f"{p.family} {p.fam.short(p.tile)}{' +bT' if p.transpose_b else ''}" + \
        (f" split{p.splits}" if p.splits > 1 else "")


def workspace(cfg, ex=None) -> dict:
    """The GEMM workspaces of a config's memory plan {name: (shape, dtype)}: split-K partials of the weight
    gradients (K: batch_size * block_size tokens; dW and dW^T) as the fp32, tf32 and ex's base families plan
    them at 132 SMs; where ex holds them (`wgmma_scratch`), the warpgroup-MMA kernels' re-laid operands."""
    ex = ex or execution.resolve(cfg)
    K, C, V = cfg.batch_size * cfg.block_size, cfg.n_embd, cfg.vocab_size
    layers = [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]
    shapes = layers + ([(V, C)] if V else [])
    fams = dict.fromkeys((GEMM_FAMILIES["fp32"], GEMM_FAMILIES["tf32"], ex.gemm_family))
    need = max([p.splits * M * N for m, n in shapes for M, N in ((m, n), (n, m)) for fam in fams
                if (p := plan(Product(M, N, K), fam, max_ws=MAX_SPLITS * M * N)).splits > 1], default=0)
    out = {"gemm_splitk": ((need,), "f32")} if need else {}
    if ex.wgmma_scratch:
        out["gemm_bT"] = ((max(m * n for m, n in shapes),), "f32")           # W^T of dX = dY @ W (wgmma)
        # X^T [N, tokens] or dY^T [M, tokens] of a per-layer weight gradient (register-A; not the head's)
        out["gemm_aT"] = ((max(max(m, n) for m, n in layers) * K,), "f32")
    return out


def device_workspaces(ws: dict, rt) -> dict:
    """`workspace(cfg)`'s entries that rt's device reads: without the warpgroup-MMA kernels, no scratch."""
    return dict(ws) if rt.exec.wgmma else {k: v for k, v in ws.items() if k not in WGMMA_WORKSPACES}
