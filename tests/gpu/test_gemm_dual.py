"""gemm_wgmma_dual (gemm.matmul_pair, the op interface's linear_bwd on bf16): a layer's weight gradient
dW = dY^T X (fp32, split-K partials and reduction, the bias gradient's column sums) and input gradient
dX = dY W (bf16, plain or with the GELU's backward) in one launch, the blocks taking tiles from a counter.

Each tile is computed whole by one block with gemm_wgmma_ws's code (ws_produce / ws_consume), so the
outputs must be those of the two products launched apart with the same tile and split count, bit for
bit, whichever block took which tile; against float64 they keep the bf16 family's error model
(test_gemm_bf16.py). The counter resets itself at each launch's last fetch: launches repeated eagerly
and in a replayed graph must give the same bits. CPU tests at the bottom: the plan, the launcher on the
recording runtime, and a model of the counter's protocol.
"""
import heapq

import numpy as np
import pytest

from gptcuda.model.products import Product
from gptcuda.ops.cuda import elementwise, gemm
from gptcuda.ops.cuda.gemm.families import (DUAL_COLSUM_TILES, DUAL_PP_TILES, DUAL_TILES, VARIANTS, dual_name,
                                             dual_serves)
from gptcuda.ops.cuda.gemm.plan import dual_time, make_plan, pair_plan, split_chunk
from gptcuda.ops.reference import ops as ref
from gptcuda.runtime import bf16
from tests.conftest import FakeGemmRT, bf16_err, rel_err
from tests.gpu.test_gemm_bf16 import FP32_TOL, dgelu_abs

gpu = pytest.mark.gpu


@pytest.fixture
def bf16_rt(rt):
    """The session runtime in precision bf16 (grad_pairs on) with split-K and bias-sum workspaces."""
    old_exec, old_ws = rt.exec, dict(rt._workspace)
    rt.exec = rt.exec.with_precision("bf16")
    if not rt.exec.grad_pairs:
        pytest.skip("GPTCUDA_GRAD_PAIRS=0 in this environment")
    rt.set_workspace({**old_ws, "gemm_splitk": rt.empty((8 << 20,), name="gemm_splitk"),
                      elementwise.WORKSPACE: rt.empty((elementwise.MAX_CHUNKS, 4096), name=elementwise.WORKSPACE)})
    yield rt
    rt.exec = old_exec
    rt.set_workspace(old_ws)


def _layer(rt, rng, T, K, N, epilogue):
    """The backward operands of a linear layer y[T, N] = x[T, K] @ w[N, K]^T, bf16 values in float64: dy
    [T, N], x [T, K], w [N, K] (dX = dy @ w reads it as B [N, K] as stored), the dgelu pre-activation [T, K]."""
    r = lambda *s: bf16.round_f32(rng.standard_normal(s)).astype(np.float64)
    dy, x, w = r(T, N), r(T, K), r(N, K)
    pre = r(T, K) if epilogue == "dgelu" else None
    return dy, x, w, pre


def _pair(rt, plan, dy, x, w, pre, colsum, epilogue):
    """matmul_pair into fresh (poisoned) outputs: (dx bf16 [T, K], dw fp32 [N, K], db fp32 [N] or None)."""
    T, N = dy.shape
    K = x.shape[1]
    dx, dw = rt.empty((T, K), "bf16"), rt.empty((N, K))
    db = rt.empty((N,)) if colsum else None
    gemm.matmul_pair(rt, dx, dw, rt.upload(dy, "bf16"), rt.upload(x, "bf16"), rt.upload(w, "bf16"), db=db,
                     epilogue=epilogue, aux=None if pre is None else rt.upload(pre, "bf16"), plan=plan)
    return dx, dw, db


def _bits(rt, v):
    return None if v is None else rt.download(v).view(np.uint16 if v.dtype == "bf16" else np.uint32)


@gpu
@pytest.mark.parametrize("tile,epilogue,colsum", [(t, e, c) for t in DUAL_TILES + DUAL_PP_TILES for e, c in
                                                  (("none", True), ("none", False), ("dgelu", False))
                                                  if dual_serves(t, 4 if e == "dgelu" else 0, c)])
@pytest.mark.parametrize("T,K,N,splits", [(1000, 392, 520, 1), (4000, 768, 520, 3), (2048, 256, 1152, 2)])
def test_dual_is_the_two_products(bf16_rt, tile, epilogue, colsum, T, K, N, splits):
    """The pair's dW, db and dX bit for bit those of matmul with the same tile and split count (gemm_wgmma_ws;
    the ping-pong tiles: gemm_wgmma_pp),
    within the error model of float64, and the same bits when the launch is repeated (the counter at 0
    again). Shapes: T off the 64-row boxes and 128-row tiles, more tiles than SMs (4000 x 768: 32 x 4 of dX
    beside 5 x 4 x 3 of dW at 128 x 192), a wide dW (1152 x 256)."""
    rt, rng = bf16_rt, np.random.default_rng(T + K + N + splits)
    dy, x, w, pre = _layer(rt, rng, T, K, N, epilogue)
    p = make_plan("bf16", tile, splits, T)
    dx, dw, db = _pair(rt, p, dy, x, w, pre, colsum, epilogue)
    # apart, with the same tiles: dX = dY W (W [N, K] is B [K', N'] with K' = N), dW = dY^T X
    dx2, dw2 = rt.empty((T, K), "bf16"), rt.empty((N, K))
    db2 = rt.empty((N,)) if colsum else None
    dyv, xv, wv = rt.upload(dy, "bf16"), rt.upload(x, "bf16"), rt.upload(w, "bf16")
    gemm.matmul(rt, dx2, dyv, wv, False, False, epilogue=epilogue, aux=None if pre is None else rt.upload(pre, "bf16"),
                plan=make_plan("bf16", tile, 1, N))
    gemm.matmul(rt, dw2, dyv, xv, True, False, plan=p, a_colsum=db2)
    for a, b in ((dx, dx2), (dw, dw2), (db, db2)):
        assert a is None or np.array_equal(_bits(rt, a), _bits(rt, b))
    assert rel_err(rt.download(dw), dy.T @ x) <= FP32_TOL
    prod = dy @ w
    if epilogue == "dgelu":
        assert bf16_err(bf16.values(rt.download(dx)), ref.gelu_backward(prod, pre), FP32_TOL, dgelu_abs(pre, prod)) <= 1
    else:
        assert bf16_err(bf16.values(rt.download(dx)), prod, FP32_TOL) <= 1.0
    if colsum:
        assert rel_err(rt.download(db), dy.sum(0)) <= 1e-5
    again = _pair(rt, p, dy, x, w, pre, colsum, epilogue)
    for a, b in zip(again, (dx, dw, db)):
        assert a is None or np.array_equal(_bits(rt, a), _bits(rt, b))


@gpu
def test_dual_replayed_in_a_graph(bf16_rt):
    """Three pairs of other sizes (grids of 132 blocks and fewer) recorded into one program and replayed as a
    graph five times: each replay gives the eager run's bits (each launch leaves the counter at 0)."""
    rt, rng = bf16_rt, np.random.default_rng(5)
    shapes = [(3000, 768, 768, "none"), (200, 128, 256, "none"), (2048, 512, 1536, "dgelu")]
    layers = [_layer(rt, rng, T, K, N, e) for T, K, N, e in shapes]
    ins = [tuple(None if v is None else rt.upload(v, "bf16") for v in lay) for lay in layers]
    outs = [(rt.empty((T, K), "bf16"), rt.empty((N, K))) + ((rt.empty((N,)),) if e == "none" else ())
            for T, K, N, e in shapes]

    def record():
        for (dy, x, w, pre), (dx, dw, *db), (_, _, _, e) in zip(ins, outs, shapes):
            gemm.matmul_pair(rt, dx, dw, dy, x, w, db=db[0] if db else None, epilogue=e, aux=pre)
    record()
    eager = [[_bits(rt, v) for v in o] for o in outs]
    prog = rt.begin("pairs")
    record()
    rt.end()
    g = rt.capture(prog)
    for _ in range(5):
        for o in outs:
            for v in o:
                rt.fill(v, 0x7FC00000 if v.dtype == "f32" else 0x7FC07FC0)
        g.launch()
        assert all(np.array_equal(_bits(rt, v), e) for o, eo in zip(outs, eager) for v, e in zip(o, eo))
    for (dy, x, w, pre), (dx, dw, *db) in zip(layers, outs):
        assert rel_err(rt.download(dw), dy.T @ x) <= FP32_TOL


# ---- CPU ------------------------------------------------------------------------------------------

GPT2 = {"fc": (3072, 768, "none", True), "qkv": (2304, 768, "none", True), "proj": (768, 768, "none", False),
        "fcproj": (768, 3072, "dgelu", False)}


def _products(T, N, K, epilogue, colsum):
    """(gw, gx) of a layer y = x[T, K] @ w[N, K]^T: dW [N, K] over T, dX [T, K] over N."""
    return Product(N, K, T, True, False, colsum=colsum), Product(T, K, N, False, False, epilogue)


def test_pair_plans_at_gpt2():
    """At 16384 tokens the long weight gradients run unsplit beside their dX (no partials, no reduction);
    the attention projection's (768 x 768: 24-18 tiles of 256 k tiles, longer than the rest together)
    split; a pair the kernel cannot run gets no plan (NT, a bias on dX, unaligned, batched, dgelu_gelu)."""
    plans = {k: pair_plan(*_products(16384, N, K, e, c), 132, 1 << 30) for k, (N, K, e, c) in GPT2.items()}
    assert all(p is not None and p.tile in DUAL_TILES for p in plans.values())
    assert plans["fc"].tile in DUAL_COLSUM_TILES and plans["qkv"].tile in DUAL_COLSUM_TILES
    assert plans["fcproj"].tile == plans["proj"].tile == (256, 128, 4, 0)    # the short dX: four warpgroups
    assert plans["fc"].splits == plans["qkv"].splits == plans["fcproj"].splits == 1
    assert plans["proj"].splits > 1 and plans["proj"].k_chunk % 64 == 0
    assert pair_plan(*_products(16384, 768, 768, "none", False), 132, 0).splits == 1     # no room: unsplit
    gw, gx = _products(1024, 768, 768, "none", False)
    import dataclasses as dc
    for bad in (dc.replace(gx, tb=True), dc.replace(gx, bias=True), dc.replace(gx, vec=False),
                dc.replace(gx, epilogue="dgelu_gelu"), dc.replace(gx, batch=2)):
        assert pair_plan(gw, bad) is None
    assert pair_plan(dc.replace(gw, ta=False), gx) is None
    assert pair_plan(dc.replace(gw, colsum=True), dc.replace(gx, epilogue="dgelu")) is None


def test_dual_time_is_a_list_schedule():
    """dual_time against a direct list schedule of the same tile times: one wave of equal tiles takes one
    tile's time; W's long tiles first, then X's on whichever block frees first."""
    gw, gx = _products(16384, 768, 768, "none", False)
    t = (128, 192, 4, 0)
    k_tile = 0.455e-6 * t[0] * t[1] / (128 * 192)
    w_tiles = [256 * k_tile + 3e-6] * (6 * 4)
    x_tiles = [12 * k_tile + 2e-6] * (128 * 4)
    free = [0.0] * 132
    for d in w_tiles + x_tiles:
        heapq.heappush(free, heapq.heappop(free) + d)
    assert dual_time(gw, gx, t, 1, 16384) == pytest.approx(max(free))
    small_w, small_x = _products(128, 128, 128, "none", False)
    assert dual_time(small_w, small_x, t, 1, 128) == pytest.approx(2 * k_tile + 3e-6)
    assert dual_time(gw, gx, t, 4, split_chunk(16384, 4, 64)) < dual_time(gw, gx, t, 1, 16384)


def test_dual_variants_are_compiled():
    """VARIANTS holds every gemm_wgmma_dual the launcher can ask for: every tile with none and dgelu (the wide
    ping-pong tile: none), the column sums beside none on the tiles of two consumer warpgroups (fcproj's dgelu
    pair has no bias sums in the product), each with an fp32 and a bf16 weight gradient (bf16 gradients), and
    pair_plan never asks for another."""
    names = {n for f, n, _ in VARIANTS if n.startswith("gemm_wgmma_dual")}
    assert names == {dual_name(t, e, c, w) for t in DUAL_TILES + DUAL_PP_TILES for e, c in ((0, False), (0, True),
                                                                                           (4, False))
                     if (not c or t in DUAL_COLSUM_TILES + DUAL_PP_TILES) and
                     (t[:2] != (128, 192) or not t[3] or not e) for w in ("f32", "bf16")}
    assert all(dual_serves(t, e, c) == (dual_name(t, e, c) in names) for t in DUAL_TILES + DUAL_PP_TILES
               for e in (0, 4) for c in (False, True))
    for T in (256, 2048, 16384):
        for N, K, e, c in GPT2.values():
            p = pair_plan(*_products(T, N, K, e, c), 132, 1 << 30)
            assert dual_name(p.tile, 4 if e == "dgelu" else 0, c) in names


def test_matmul_pair_launch_on_the_recording_runtime():
    """The launcher: one gemm_wgmma_dual of min(tiles, SMs) blocks, then dW's reduction where it is split,
    then the column sums' reduction; GPTCUDA_GRAD_PAIRS=0 or fp32: matmul twice, dX first."""
    from gptcuda.runtime import execution
    rt = FakeGemmRT("bf16", ws=1 << 24, arch="sm_90")
    rt.set_workspace({**rt._ws, elementwise.WORKSPACE: rt.empty((elementwise.MAX_CHUNKS, 4096),
                                                                  name=elementwise.WORKSPACE)})
    T, N, K = 16384, 768, 768
    dy, x, w = rt.empty((T, N), "bf16"), rt.empty((T, K), "bf16"), rt.empty((N, K), "bf16")
    dx, dw, db = rt.empty((T, K), "bf16"), rt.empty((N, K)), rt.empty((N,))
    gemm.matmul_pair(rt, dx, dw, dy, x, w, db=db)
    p = pair_plan(*_products(T, N, K, "none", True), 132, 1 << 24)
    names = [n for n, *_ in rt.launches]
    assert names[0] == dual_name(p.tile, 0, True) and rt.launches[0][1] == (132,)
    assert names[1].startswith("gemm_splitk_reduce") and names[2].startswith("sum_rows") and len(names) == 3
    rt.launches.clear()
    small = rt.empty((200, K), "bf16"), rt.empty((200, N), "bf16"), rt.empty((200, K), "bf16")
    gemm.matmul_pair(rt, small[0], dw, small[1], small[2], w)
    grid = rt.launches[0][1][0]
    assert [n for n, *_ in rt.launches] == [dual_name(pair_plan(*_products(200, N, K, "none", False), 132,
                                                                1 << 24).tile, 0, False)]
    assert grid <= 132
    rt.launches.clear()
    rt.exec = execution.resolve(arch="sm_90", precision="bf16", env={"GPTCUDA_GRAD_PAIRS": "0"})
    gemm.matmul_pair(rt, dx, dw, dy, x, w, db=db)
    names = [n for n, *_ in rt.launches]
    assert not any(n.startswith("gemm_wgmma_dual") for n in names)
    assert ",false,true,1" in names[0] and ",true,true,0" in [n for n in names if n.startswith("gemm_wgmma")][1]
    with pytest.raises(ValueError, match="forced plan"):
        gemm.matmul_pair(rt, dx, dw, dy, x, w, plan=make_plan("bf16", DUAL_TILES[0], 1, T))


def _counter_model(total, grid, rng):
    """The kernel's protocol (WsDynWalk) played with the blocks' fetches interleaved at random: a block's
    first tile is its index, each next one grid + the counter's old value (atomicAdd), the fetch that
    returns total - 1 resets the counter; a block stops at its first id >= total. -> (the tiles each
    block took, the counter after, how many resets)."""
    ctr, resets = [0], 0
    took = {b: [b] if b < total else [] for b in range(grid)}
    live = [b for b in range(grid) if b < total]
    while live:
        b = live[rng.integers(len(live))]
        c = ctr[0]
        ctr[0] += 1
        if c == total - 1:
            ctr[0], resets = 0, resets + 1
        if grid + c >= total:
            live.remove(b)
        else:
            took[b].append(grid + c)
    return took, ctr[0], resets


@pytest.mark.parametrize("total,grid", [(600, 132), (132, 132), (133, 132), (7, 7), (1, 1), (1000, 3)])
def test_tile_counter_protocol(total, grid):
    """Every tile taken exactly once, each block's tiles rising (W's before X's), the counter back at 0
    after one reset, whatever the interleaving; launches one after another start from 0 each time."""
    rng = np.random.default_rng(total * grid)
    for _ in range(20):
        took, ctr, resets = _counter_model(total, grid, rng)
        assert sorted(t for ts in took.values() for t in ts) == list(range(total))
        assert all(ts == sorted(ts) for ts in took.values())
        assert ctr == 0 and resets == 1
