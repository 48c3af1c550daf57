"""A model of gemm_wgmma_dual's protocol (kernels/gemm_wgmma.cu WsDynWalk with ws_produce / ws_consume's ring):
blocks whose producer takes tile ids from one counter (a block's first tile its index, each next gridDim.x +
the counter's old value; the fetch returning total - 1 resets it) and hands each to its consumer warpgroups
through a ring of D ids (full: the producer's arrival after its store; empty: every consumer's arrival after
its load), loading each tile's k tiles into a ring of S slots (a slot refilled once every consumer released
it); the consumers take the ids in order, consume the tile's k tiles and release each slot. W's tiles come
first in the list, X's after; a block walks W's, then X's. Run over random shapes and interleavings of all
blocks' producers and consumers: every tile computed once, by the block that loaded it, each block's tiles
rising and in the order its producer loaded them, no deadlock, no arrival on a full slot, the counter at 0.
A ring of ids with the empty wait left out loses ids, and the model finds it."""
import random

import pytest


def run(n_w, n_x, k_w, k_x, grid, S, D, wgs, seed, skip_empty_wait=False, budget=2_000_000) -> dict:
    """-> {"computed": [(tile, block)], "order": {block: [tiles]}, "loaded": {block: [tiles]}, "ctr": int,
    "resets": int} or raises AssertionError / RuntimeError("deadlock")."""
    rnd = random.Random(seed)
    total = n_w + n_x
    grid = min(grid, total)
    nk = lambda t: k_w if t < n_w else k_x
    state = {"ctr": 0, "resets": 0}
    computed, order, loaded = [], {b: [] for b in range(grid)}, {b: [] for b in range(grid)}

    class Block:
        def __init__(self, b):
            self.b = b
            self.full = set()                  # operand ring uses (it) loaded
            self.released = {}                 # it -> the consumers that released it
            self.slots = [None] * D            # the id ring: (j, id) last stored in each slot
            self.taken = {}                    # j -> the consumers that took id j

    def producer(blk):
        it = j = 0
        t = blk.b

        def hand_over(nid):                    # WsDynWalk::next's store into slot j % D, then full
            nonlocal j
            while j >= D and not skip_empty_wait and len(blk.taken.get(j - D, ())) < wgs:
                yield
            old = blk.slots[j % D]
            if old is not None and len(blk.taken.get(old[0], ())) < wgs:
                raise AssertionError("an id overwritten before taken")
            blk.slots[j % D] = (j, nid)
            j += 1

        for lo, hi in ((0, n_w), (n_w, total)):
            while lo <= t < hi:
                loaded[blk.b].append(t)
                for _ in range(nk(t)):
                    while it >= S and len(blk.released.get(it - S, ())) < wgs:
                        yield
                    assert it not in blk.full
                    blk.full.add(it)
                    it += 1
                    yield
                c = state["ctr"]                     # the fetch: one atomic, then the handover
                state["ctr"] += 1
                if c == total - 1:
                    state["ctr"], state["resets"] = 0, state["resets"] + 1
                t = grid + c
                yield from hand_over(t)
            yield

    def consumer(blk, w):
        it = j = 0
        t = blk.b
        for lo, hi in ((0, n_w), (n_w, total)):
            while lo <= t < hi:
                for _ in range(nk(t)):
                    while it not in blk.full:
                        yield
                    yield
                    blk.released.setdefault(it, set()).add(w)
                    it += 1
                if w == 0:
                    computed.append((t, blk.b))
                    order[blk.b].append(t)
                while blk.slots[j % D] is None or blk.slots[j % D][0] < j:   # wait full[j % D]
                    yield
                assert blk.slots[j % D][0] == j, "an id overwritten before taken"
                t = blk.slots[j % D][1]
                blk.taken.setdefault(j, set()).add(w)
                j += 1
                yield

    blocks = [Block(b) for b in range(grid)]
    procs = [producer(b) for b in blocks] + [consumer(b, w) for b in blocks for w in range(wgs)]
    live = list(procs)
    steps = 0
    while live:
        p = rnd.choice(live)
        try:
            next(p)
        except StopIteration:
            live.remove(p)
        steps += 1
        if steps > budget:
            raise RuntimeError("deadlock")
    return {"computed": computed, "order": order, "loaded": loaded, "ctr": state["ctr"], "resets": state["resets"]}


CASES = [(96, 512, 8, 3, 132, 4, 4, 2), (24, 512, 16, 2, 132, 4, 4, 4), (3, 5, 6, 1, 8, 2, 4, 2), (0, 40, 1, 1, 7, 4, 4, 2),
         (40, 0, 2, 1, 7, 3, 2, 2), (5, 2, 1, 9, 7, 4, 1, 2), (1, 1, 1, 1, 132, 4, 4, 2)]


@pytest.mark.parametrize("n_w,n_x,k_w,k_x,grid,S,D,wgs", CASES)
def test_every_tile_once_in_each_blocks_order(n_w, n_x, k_w, k_x, grid, S, D, wgs):
    for seed in range(6):
        r = run(n_w, n_x, k_w, k_x, grid, S, D, wgs, seed)
        assert sorted(t for t, _ in r["computed"]) == list(range(n_w + n_x))
        for b, ts in r["order"].items():
            assert ts == sorted(ts) == r["loaded"][b]               # rising: W's before X's, as loaded
        assert r["ctr"] == 0 and r["resets"] == 1


def test_the_empty_wait_is_needed():
    """Without the producer's wait for the consumers to have taken an id D uses back, a fast producer
    overwrites ids the consumers have not read."""
    with pytest.raises(AssertionError, match="overwritten"):
        for seed in range(50):
            run(0, 60, 1, 1, 2, 8, 2, 2, seed, skip_empty_wait=True)
