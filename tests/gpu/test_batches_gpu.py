"""GPU test of the batch pipeline: the host gathers windows into page-locked buffers and the feeder's
async copies land in idx / targets exactly (gptcuda/data/batches.py, cuda_backend.BatchFeeder)."""
import numpy as np
import pytest

from gptcuda.model import rng
from gptcuda.data.batches import Batches
from gptcuda.ops.cuda_backend import BatchFeeder
from gptcuda.data.text import get_batch
from gptcuda.runtime.driver import call

pytestmark = pytest.mark.gpu

TOKENS = (np.arange(50_021) * 31 % 50257).astype(np.int32)


@pytest.mark.parametrize("accum,world,rank", [(1, 1, 0), (3, 1, 0), (2, 4, 3)])
def test_feeder_copies_each_programs_rows(rt, accum, world, rank):
    B, T = 4, 64
    b = Batches(TOKENS, TOKENS[:5000], B, T, 77, accum=accum, world=world, rank=rank)
    x, y = rt.empty((accum, B, T), "i32"), rt.empty((accum, B, T), "i32")
    f = BatchFeeder(rt, x, y, b.rows("train"), T)
    for step in range(5):                              # more puts than slots: the buffers are reused
        f.put(b.rows("train"), lambda hx, hy: b.fill("train", step, hx, hy))
        gx, gy = rt.download(x).reshape(-1, T), rt.download(y).reshape(-1, T)
        wx, wy = get_batch(TOKENS, 77, step, rng.SITE_BATCH_TRAIN, accum * world * B, T)
        rows = np.concatenate([np.arange((k * world + rank) * B, (k * world + rank + 1) * B) for k in range(accum)])
        assert np.array_equal(gx, wx[rows]) and np.array_equal(gy, wy[rows])
    f.put(B, lambda hx, hy: b.fill("eval_val", 9, hx, hy))    # evaluation: the first B rows of idx / targets
    ex = rt.download(x).reshape(-1, T)[:B]
    wx, _ = get_batch(TOKENS[:5000], 77, 9, rng.SITE_BATCH_VAL, B, T, row_offset=rank * B)
    assert np.array_equal(ex, wx)


def test_feeder_keeps_stream_order(rt):
    """Many puts queued behind slow work: each copy lands after the work before it (a kernel reading
    x in between sees its own batch), and the host never overwrites a buffer still being copied."""
    from gptcuda.ops.cuda import elementwise as ew
    B, T = 2, 4096
    x, y = rt.empty((1, B, T), "i32"), rt.empty((1, B, T), "i32")
    f = BatchFeeder(rt, x, y, B, T)
    big = rt.empty((1 << 24,))
    rt.fill(big, 0)
    snaps = []
    for i in range(6):
        ew.gelu_fwd(rt, big, big)                      # queue some work first
        f.put(B, lambda hx, hy, i=i: (hx.fill(i), hy.fill(-i)))
        snap = rt.empty((B * T,), "i32")
        call(rt.dev.drv.cuMemcpyDtoDAsync, snap.ptr, x.ptr, B * T * 4, rt.stream)
        snaps.append(snap)
    for i, s in enumerate(snaps):
        assert np.all(rt.download(s) == i)
