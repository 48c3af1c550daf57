#!/usr/bin/env python3
"""Shared-memory layouts of the TF32 GEMM (kernels/gemm_tf32.cu): derived, proven, simulated.

For every TF32 block tile (gptcuda/ops/cuda/gemm/families.py TF32_TILES) and every transpose case this
tool replays, thread by thread, what the kernel does with shared memory:

  1. the layout of each operand tile is a bijection of (row, k) onto the stage's floats;
  2. staging (Tf32Stager's 16-byte cp.async, partial last passes of 192-thread tiles included,
     and the 4-byte unaligned fallback) writes every element of the tile exactly once, at the
     offset the kernel computes (its strength-reduced forms included);
  3. every fragment load (LDS.128) reads the element the mma.sync.m16n8k8 fragment ownership
     of the PTX ISA asks for, under the kernel's m / n / k index permutations, and the
     epilogue writes each accumulator register to the matching (row, column);
  4. an end-to-end emulation of one block (staging with tail guards, fragment loads, mma
     semantics, epilogue) reproduces op(A) @ op(B);
  5. bank conflicts: every quarter-warp phase of a 128-bit access, every 32-lane phase of a
     4-byte access: staging must be <= 2-way, fragment loads 1-way (conflict-free).

Exits non-zero when any check fails. The layout formulas are mirrored from gemm_tf32.cu
(tf32_off_kmajor, tf32_off_mnmajor, Tf32Stager, tf32_stage_scalar, the a_frag / b_frag bases):
keep them in sync.

    python tools/smem_banks.py [-v]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gptcuda.ops.cuda.gemm.families import FAMILIES  # noqa: E402

TF32_TILES, TF32_FALLBACK_TILES = FAMILIES["tf32"].tiles, FAMILIES["tf32"].unaligned_tiles

BK = 32                    # GEMM_TF32_BK
BANKS = 32
MAX_STAGING_WAYS = 2
MAX_FRAGMENT_WAYS = 1


# --------------------------------------------------------------------------------------
# layouts (mirror of gemm_tf32.cu)
# --------------------------------------------------------------------------------------
def off_kmajor(r, k):
    """tf32_off_kmajor: tile [R][32], 16-byte chunks XOR-swizzled by bit 2 of r."""
    return r * 32 + (((k >> 2) ^ (((r >> 2) & 1) << 2)) << 2) + (k & 3)


def off_mnmajor(R, k, c):
    """tf32_off_mnmajor<R>: tile [32][R], chunks XOR-swizzled by 2 * ((k / 4) % 4)."""
    return k * R + (((c >> 2) ^ (((k >> 2) & 3) << 1)) << 2) + (c & 3)


def layout(kmajor, R):
    """offset[rc, k] for the operand tile of R rows (m or n) and BK k."""
    rc, k = np.meshgrid(np.arange(R), np.arange(BK), indexing="ij")
    return off_kmajor(rc, k) if kmajor else off_mnmajor(R, k, rc)


# --------------------------------------------------------------------------------------
# bank conflicts
# --------------------------------------------------------------------------------------
def ways(word_addrs, width):
    """Conflict degree of one warp-wide shared access. word_addrs[lane] = the 4-byte words the
    lane touches (width of them, consecutive). 128-bit accesses are served per quarter warp,
    64-bit per half warp, 32-bit per warp; inside a phase, distinct words on one bank serialise."""
    phase = {1: 32, 2: 16, 4: 8}[width]
    worst = 0
    for p0 in range(0, 32, phase):
        banks = {}
        for lane in range(p0, min(p0 + phase, len(word_addrs))):
            for w in word_addrs[lane]:
                banks.setdefault(w % BANKS, set()).add(w)
        if banks:
            worst = max(worst, max(len(s) for s in banks.values()))
    return worst


# --------------------------------------------------------------------------------------
# staging (mirror of tf32_stage): list of warp instructions, each [(lane, rc, k, offset)]
# --------------------------------------------------------------------------------------
def staging_instructions(kmajor, R, threads, vec):
    """Tf32Stager (vec) / tf32_stage_scalar: per warp instruction, (width, [(lane, rc, k, offset)]);
    lanes whose chunk does not exist (a partial last pass) are inactive."""
    insts = []
    if vec:
        chunks = R * 8
        ch = -(-chunks // threads)
        cpr = 8 if kmajor else R // 4
        step = threads // cpr
        assert threads % cpr == 0 and (not kmajor or step % 8 == 0) and R % 32 == 0
        for i in range(ch):
            for w in range(threads // 32):
                inst = []
                for lane in range(32):
                    tid = 32 * w + lane
                    if i == ch - 1 and tid + i * threads >= chunks:          # last_ok
                        continue
                    if kmajor:
                        r_t, c_t = tid >> 3, (tid & 7) << 2
                        soff = off_kmajor(r_t, c_t) + i * step * 32          # chunk_off, the kernel's form
                        inst.append((lane, r_t + i * step, c_t, soff))
                    else:
                        r_t, c_t = tid // cpr, (tid % cpr) << 2
                        if step % 16 == 0:
                            soff = off_mnmajor(R, r_t, c_t) + i * step * R
                        else:
                            k = r_t + i * step
                            soff = k * R + (((c_t >> 2) ^ (((k >> 2) & 3) << 1)) << 2)
                        inst.append((lane, c_t, r_t + i * step, soff))
                if inst:
                    insts.append((4, inst))
    else:
        el = R * 32 // threads
        for i in range(el):
            for w in range(threads // 32):
                inst = []
                for lane in range(32):
                    idx = 32 * w + lane + i * threads
                    if kmajor:
                        rc, k = idx >> 5, idx & 31
                        inst.append((lane, rc, k, off_kmajor(rc, k)))
                    else:
                        k, c = idx // R, idx % R
                        inst.append((lane, c, k, off_mnmajor(R, k, c)))
                insts.append((1, inst))
    return insts


# --------------------------------------------------------------------------------------
# fragment loads (mirror of the kernel's inner loop): per warp, per kb, LDS.128 instructions
# each lane gets 4 words; returns [(offsets[32], targets[32][4])] where a target names the
# fragment register: ("a", mi, j, i) or ("b", ni, j, i).
# --------------------------------------------------------------------------------------
def frag_bases(kmajor, R, w0, g, t):
    if kmajor:
        return ((w0 + 4 * g) * 32 + 16 * (0 ^ (g & 1)) + 4 * t,
                (w0 + 4 * g) * 32 + 16 * (1 ^ (g & 1)) + 4 * t)
    b = 4 * t * R + w0 + 4 * (g ^ (2 * t))
    return b, b


def fragment_instructions(tile, ta, tb, warp):
    bm, bn, bk, wm, wn, stages = tile
    wtm, wtn = bm // wm, bn // wn
    mt, nt = wtm // 16, wtn // 8
    wm0, wn0 = (warp // wn) * wtm, (warp % wn) * wtn
    insts = []   # (operand, kb, offsets[32], targets[32] as list of 4 register keys)
    for kb in range(bk // 16):
        # A
        if not ta:
            for mi in range(mt):
                for h in range(2):
                    offs, tg = [], []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        base = frag_bases(True, bm, wm0, g, t)[kb]
                        offs.append(base + (32 * (mi >> 1) + 2 * (mi & 1) + h) * 32)
                        tg.append([("a", mi, 0, h), ("a", mi, 0, h + 2), ("a", mi, 1, h), ("a", mi, 1, h + 2)])
                    insts.append(("a", kb, offs, tg))
        else:
            for p in range(mt // 2):
                for j in range(2):
                    for hi in range(2):
                        offs, tg = [], []
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            base = frag_bases(False, bm, wm0, g, t)[0]
                            offs.append(base + (16 * kb + 2 * j + hi) * bm + 32 * p)
                            tg.append([("a", 2 * p, j, 2 * hi), ("a", 2 * p, j, 1 + 2 * hi),
                                       ("a", 2 * p + 1, j, 2 * hi), ("a", 2 * p + 1, j, 1 + 2 * hi)])
                        insts.append(("a", kb, offs, tg))
        # B
        if tb:
            for ni in range(nt):
                offs, tg = [], []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    base = frag_bases(True, bn, wn0, g, t)[kb]
                    offs.append(base + (32 * (ni >> 2) + (ni & 3)) * 32)
                    tg.append([("b", ni, 0, 0), ("b", ni, 0, 1), ("b", ni, 1, 0), ("b", ni, 1, 1)])
                insts.append(("b", kb, offs, tg))
        else:
            for q in range(nt // 4):
                for j in range(2):
                    for hi in range(2):
                        offs, tg = [], []
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            base = frag_bases(False, bn, wn0, g, t)[0]
                            offs.append(base + (16 * kb + 2 * j + hi) * bn + 32 * q)
                            tg.append([("b", 4 * q + x, j, hi) for x in range(4)])
                        insts.append(("b", kb, offs, tg))
    return insts, (wm0, wn0, mt, nt)


# ISA fragment ownership of mma.m16n8k8 (.tf32): lane = 4 g + t
def isa_a(i, g, t):      # (row, col) of register a_i
    return [(g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)][i]


def isa_b(i, g, t):      # (k, n) of register b_i
    return [(t, g), (t + 4, g)][i]


def isa_c(i, g, t):      # (row, col) of register c_i
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)][i]


# the kernel's index permutations
def phys_m(wm0, mi, row):        # fragment row (0..15) of m16 tile mi -> row of the block tile
    g, h = row % 8, row // 8
    return wm0 + 32 * (mi >> 1) + 4 * g + 2 * (mi & 1) + h


def phys_n(wn0, ni, col):        # fragment column (0..7) of n8 tile ni -> column of the block tile
    return wn0 + 32 * (ni >> 2) + 4 * col + (ni & 3)


def phys_k(kb, j, kl):           # logical k (0..7) of mma step j in k block kb -> k of the tile
    return 16 * kb + 4 * (kl % 4) + 2 * j + kl // 4


# --------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------
class Report:
    def __init__(self, verbose=False):
        self.fail = []
        self.verbose = verbose

    def check(self, ok, msg):
        if not ok:
            self.fail.append(msg)
        return ok

    def info(self, msg):
        if self.verbose:
            print(msg)


def check_tile(rep: Report, tile, ta, tb, vec):
    bm, bn, bk, wm, wn, stages = tile
    assert bk == BK
    threads = wm * wn * 32
    name = f"tile {bm}x{bn}x{bk} warps {wm}x{wn} {'T' if ta else 'N'}{'T' if tb else 'N'} vec={vec}"
    ops = {"a": (not ta, bm), "b": (tb, bn)}
    inverse = {}
    worst_stage, worst_frag = 0, 0
    for op, (kmajor, R) in ops.items():
        lay = layout(kmajor, R)
        flat = np.sort(lay.ravel())
        rep.check(np.array_equal(flat, np.arange(R * BK)), f"{name}: {op} layout is not a bijection")
        inv = np.empty((R * BK, 2), np.int64)
        rc, k = np.meshgrid(np.arange(R), np.arange(BK), indexing="ij")
        inv[lay.ravel()] = np.stack([rc.ravel(), k.ravel()], 1)
        inverse[op] = inv
        # staging: each element once, at the layout offset; conflicts
        seen = np.zeros((R, BK), np.int64)
        for width, inst in staging_instructions(kmajor, R, threads, vec):
            words = [[] for _ in range(32)]       # per lane (inactive lanes touch nothing)
            for lane, r_, k_, off in inst:
                span = range(width)
                for e in span:
                    ok = off + e == (off_kmajor(r_, k_ + e) if kmajor else off_mnmajor(R, k_, r_ + e))
                    rep.check(ok, f"{name}: {op} staging offset of ({r_}, {k_}+{e})")
                    if kmajor:
                        seen[r_, k_ + e] += 1
                    else:
                        seen[r_ + e, k_] += 1
                words[lane] = [off + e for e in span]
            worst_stage = max(worst_stage, ways(words, width))
        rep.check(np.all(seen == 1), f"{name}: {op} staging does not write every element once")
    rep.check(worst_stage <= MAX_STAGING_WAYS, f"{name}: staging {worst_stage}-way > {MAX_STAGING_WAYS}")

    # fragments: right element in every register, conflict-free
    for warp in range(wm * wn):
        insts, (wm0, wn0, mt, nt) = fragment_instructions(tile, ta, tb, warp)
        for op, kb, offs, tg in insts:
            words = [[o + e for e in range(4)] for o in offs]
            rep.check(all(o % 4 == 0 for o in offs), f"{name}: unaligned 128-bit fragment load")
            worst_frag = max(worst_frag, ways(words, 4))
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for e in range(4):
                    rc, k = inverse[op][offs[lane] + e]
                    _, tile_i, j, reg = tg[lane][e]
                    if op == "a":
                        row, kl = isa_a(reg, g, t)
                        want = (phys_m(wm0, tile_i, row), phys_k(kb, j, kl))
                    else:
                        kl, col = isa_b(reg, g, t)
                        want = (phys_n(wn0, tile_i, col), phys_k(kb, j, kl))
                    rep.check((rc, k) == want, f"{name}: warp {warp} lane {lane} {op}{tile_i}[{j}][{reg}] "
                                               f"reads ({rc}, {k}), wants {want}")
        # epilogue: acc[mi][4q+x][2h+e] -> row wm0 + 32(mi/2) + 4g + 2(mi%2) + h, col wn0 + 32q + 8t + 4e + x
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for mi in range(mt):
                for ni in range(nt):
                    for reg in range(4):
                        row, col = isa_c(reg, g, t)
                        h, e = reg // 2, reg % 2
                        q, x = ni // 4, ni % 4
                        kr = wm0 + 32 * (mi >> 1) + 4 * g + 2 * (mi & 1) + h
                        kc = wn0 + 32 * q + 8 * t + 4 * e + x
                        rep.check((kr, kc) == (phys_m(wm0, mi, row), phys_n(wn0, ni, col)),
                                  f"{name}: epilogue of c{reg} tile ({mi}, {ni}) lane {lane}")
    rep.check(worst_frag <= MAX_FRAGMENT_WAYS, f"{name}: fragment loads {worst_frag}-way > {MAX_FRAGMENT_WAYS}")
    rep.info(f"{name}: staging {worst_stage}-way, fragment loads {worst_frag}-way")
    return worst_stage, worst_frag


def emulate_block(tile, ta, tb, M, N, K, vec, m0=0, n0=0, seed=0):
    """One thread block of gemm_tf32 in numpy (exact arithmetic on float64): staging with the
    kernel's guards, the fragment loads, mma semantics, the epilogue. Returns (got, want) for
    the block's output window."""
    bm, bn, bk, wm, wn, stages = tile
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((K, M) if ta else (M, K))
    b = rng.standard_normal((N, K) if tb else (K, N))
    opa = a.T if ta else a
    opb = b.T if tb else b
    acc = {}
    nk = -(-K // BK)
    for kt in range(nk):
        k0 = kt * BK
        smem = {}
        for op, kmajor, R, X, rc0, rcmax in (("a", not ta, bm, a, m0, M), ("b", tb, bn, b, n0, N)):
            s = np.full(R * BK, np.nan)
            for width, inst in staging_instructions(kmajor, R, wm * wn * 32, vec):
                for lane, r_, k_, off in inst:
                    for e in range(width):
                        rr, kk = (r_, k_ + e) if kmajor else (r_ + e, k_)
                        grc, gk = rc0 + rr, k0 + kk
                        valid = grc < rcmax and gk < K
                        # the guards of tf32_stage (zero fill)
                        val = 0.0
                        if valid:
                            val = X[grc, gk] if kmajor else X[gk, grc]
                        s[off + e] = val
            assert not np.isnan(s).any()
            smem[op] = s
        for warp in range(wm * wn):
            insts, (wm0, wn0, mt, nt) = fragment_instructions(tile, ta, tb, warp)
            regs = {}
            for op, kb, offs, tg in insts:
                for lane in range(32):
                    for e in range(4):
                        key = tg[lane][e]
                        regs[(kb,) + key + (lane,)] = smem[op][offs[lane] + e]
            for kb in range(bk // 16):
                for j in range(2):
                    for mi in range(mt):
                        for ni in range(nt):
                            # D = A (16x8) B (8x8) from the lanes' registers, ISA ownership
                            A = np.zeros((16, 8))
                            B = np.zeros((8, 8))
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                for i in range(4):
                                    r, c = isa_a(i, g, t)
                                    A[r, c] = regs[(kb, "a", mi, j, i, lane)]
                                for i in range(2):
                                    k_, n_ = isa_b(i, g, t)
                                    B[k_, n_] = regs[(kb, "b", ni, j, i, lane)]
                            D = A @ B
                            for lane in range(32):
                                g, t = lane >> 2, lane & 3
                                for i in range(4):
                                    r, c = isa_c(i, g, t)
                                    key = (warp, mi, ni, i, lane)
                                    acc[key] = acc.get(key, 0.0) + D[r, c]
    got = np.full((bm, bn), np.nan)
    for warp in range(wm * wn):
        _, (wm0, wn0, mt, nt) = fragment_instructions(tile, ta, tb, warp)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for mi in range(mt):
                for h in range(2):
                    r = wm0 + 32 * (mi >> 1) + 4 * g + 2 * (mi & 1) + h
                    for q in range(nt // 4):
                        for e in range(2):
                            c = wn0 + 32 * q + 8 * t + 4 * e
                            for x in range(4):
                                got[r, c + x] = acc.get((warp, mi, 4 * q + x, 2 * h + e, lane), 0.0)
    want = np.zeros((bm, bn))
    mm, nn = min(bm, M - m0), min(bn, N - n0)
    want[:mm, :nn] = opa[m0:m0 + mm] @ opb[:, n0:n0 + nn]
    return got[:mm, :nn], want[:mm, :nn]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    rep = Report(verbose="-v" in argv)
    quick = "--quick" in argv
    rows = []
    for tile in TF32_TILES:
        for ta in (False, True):
            for tb in (False, True):
                for vec in ((True, False) if tile in TF32_FALLBACK_TILES else (True,)):
                    s, f = check_tile(rep, tile, ta, tb, vec)
                    rows.append((tile, ta, tb, vec, s, f))
    # end-to-end emulation of one block per transpose case on the smallest tile, with tails, and
    # on tiles whose staging ends in a partial pass (192 threads: 1024 chunks are 5 1/3 passes)
    small = min(TF32_TILES, key=lambda t: t[0] * t[1])
    shapes = [(small, small[0], small[1], 2 * BK, True, 0, 0),
              (small, small[0] + 5, small[1] + 3, 45, False, small[0], small[1])]
    for tile in TF32_TILES:
        threads = tile[3] * tile[4] * 32
        if (tile[0] * 8) % threads or (tile[1] * 8) % threads:
            shapes.append((tile, tile[0] + 100, tile[1] + 5, 45, True, tile[0], 0))
    if quick:
        shapes = shapes[:1]
    for ta in (False, True):
        for tb in (False, True):
            for (small, M, N, K, vec, m0, n0) in shapes:
                got, want = emulate_block(small, ta, tb, M, N, K, vec, m0, n0, seed=M + N + K)
                err = np.max(np.abs(got - want)) if got.size else 0.0
                rep.check(err < 1e-9, f"emulated block {small} ta={ta} tb={tb} M={M} N={N} K={K} "
                                      f"m0={m0} n0={n0}: max err {err:.3g}")
                rep.info(f"emulated block {small[:2]} {'T' if ta else 'N'}{'T' if tb else 'N'} "
                         f"M={M} N={N} K={K} at ({m0}, {n0}): max err {err:.2g}")
    print(f"{'tile':>24} {'case':>4} {'vec':>5} {'staging':>8} {'fragment':>8}")
    for tile, ta, tb, vec, s, f in rows:
        print(f"{str(tile[:2]) + ' w' + str(tile[3:5]) + ' s' + str(tile[5]):>24} {('T' if ta else 'N') + ('T' if tb else 'N'):>4} "
              f"{str(vec):>5} {s:>7}-way {f:>7}-way")
    if rep.fail:
        print(f"FAILED: {len(rep.fail)} check(s)", file=sys.stderr)
        for m in rep.fail[:20]:
            print("  " + m, file=sys.stderr)
        return 1
    print("all shared-memory layout checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
