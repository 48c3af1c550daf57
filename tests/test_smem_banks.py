"""tools/smem_banks.py: the TF32 GEMM's shared-memory layouts are bijective, conflict-free
and feed every mma fragment register the right element (CPU only)."""
import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "smem_banks.py"


@pytest.fixture
def sb():
    spec = importlib.util.spec_from_file_location("smem_banks_under_test", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_layouts_pass(sb, capsys):
    assert sb.main([]) == 0
    assert "all shared-memory layout checks passed" in capsys.readouterr().out


def test_every_tile_and_case_is_checked(sb):
    rep = sb.Report()
    for tile in sb.TF32_TILES:
        for ta in (False, True):
            for tb in (False, True):
                for vec in ((True, False) if tile in sb.TF32_FALLBACK_TILES else (True,)):
                    staging, frag = sb.check_tile(rep, tile, ta, tb, vec)
                    assert staging <= 2 and frag == 1, (tile, ta, tb, vec, staging, frag)
    assert not rep.fail, rep.fail[:3]


def test_ways_counts_conflicts(sb):
    # 32 lanes, one word each, all on bank 0 at distinct words -> 32-way
    assert sb.ways([[32 * i] for i in range(32)], 1) == 32
    # broadcast of one word is free
    assert sb.ways([[5]] * 32, 1) == 1
    # 128-bit: a quarter warp covering 128 contiguous bytes is conflict-free
    assert sb.ways([[4 * i + e for e in range(4)] for i in range(32)], 4) == 1
    # 128-bit with a 256-byte stride: pairs of lanes in a quarter warp collide
    assert sb.ways([[8 * i + e for e in range(4)] for i in range(32)], 4) == 2


def test_detects_a_broken_swizzle(sb, monkeypatch):
    monkeypatch.setattr(sb, "off_mnmajor", lambda R, k, c: k * R + c)     # no swizzle
    rep = sb.Report()
    tile = sb.TF32_TILES[0]
    sb.check_tile(rep, tile, True, False, True)
    assert rep.fail                       # fragment loads conflict / read the wrong element


def test_detects_a_wrong_fragment_base(sb, monkeypatch):
    orig = sb.frag_bases

    def bad(kmajor, R, w0, g, t):
        if kmajor:
            return orig(kmajor, R, w0, g, t)
        b = 4 * t * R + w0 + 4 * (g ^ t)
        return b, b

    monkeypatch.setattr(sb, "frag_bases", bad)
    rep = sb.Report()
    sb.check_tile(rep, sb.TF32_TILES[-1], False, False, True)
    assert any("reads" in m for m in rep.fail)


def test_block_emulation_matches_numpy(sb):
    tile = min(sb.TF32_TILES, key=lambda t: t[0] * t[1])
    got, want = sb.emulate_block(tile, True, True, tile[0] + 3, tile[1] + 1, 37, False,
                                 m0=tile[0], n0=0, seed=3)
    assert got.shape == want.shape and abs(got - want).max() < 1e-9


def test_partial_last_pass_192_threads(sb):
    # 192 threads stage a 128-row operand in 5 1/3 passes: the last pass has inactive lanes,
    # every element is still written once, and one block computes the right product
    tile = next(t for t in sb.TF32_TILES if t[3] * t[4] == 6)
    insts = sb.staging_instructions(True, 128, 192, True)
    assert len(insts) == 6 * 6 - 4 and min(len(i) for _, i in insts) == 32   # 2 of 6 warps in the last pass
    rep = sb.Report()
    staging, frag = sb.check_tile(rep, tile, False, False, True)
    assert not rep.fail and staging <= 2 and frag == 1
    got, want = sb.emulate_block(tile, True, False, tile[0] + 7, tile[1] - 9, 40, True, m0=tile[0], n0=0, seed=5)
    assert abs(got - want).max() < 1e-9
