"""The host half of the batch pipeline (gptcuda/data/batches.py): which windows each program reads."""
import numpy as np
import pytest

from gptcuda.model import rng
from gptcuda.data.batches import ArrayStream, Batches
from gptcuda.data.text import get_batch

TOKENS = (np.arange(7000) * 13 % 101).astype(np.int32)


def _fill(b, program, counter):
    rows = b.rows(program)
    x, y = np.full((rows, b.T), -1, np.int32), np.full((rows, b.T), -1, np.int32)
    b.fill(program, counter, x, y)
    return x, y


def test_one_micro_batch_is_get_batch():
    """Without accumulation or ranks a step reads what get_batch (and the old device sampler) drew."""
    b = Batches(TOKENS, TOKENS[:900], 4, 16, 1337)
    for program, site, toks in (("train", rng.SITE_BATCH_TRAIN, TOKENS), ("eval_train", rng.SITE_BATCH_EVAL_TRAIN, TOKENS),
                                ("eval_val", rng.SITE_BATCH_VAL, TOKENS[:900])):
        x, y = _fill(b, program, 7)
        wx, wy = get_batch(toks, 1337, 7, site, 4, 16)
        assert np.array_equal(x, wx) and np.array_equal(y, wy)


@pytest.mark.parametrize("accum,world", [(3, 1), (1, 4), (2, 3)])
def test_micro_batches_and_ranks_read_the_rows_of_one_big_batch(accum, world):
    """Micro-batch k of rank r is rows (k*W + r)*B.. of the batch one GPU would read with A*W*B rows."""
    B, T = 2, 16
    big = Batches(TOKENS, TOKENS, accum * world * B, T, 99)
    bx, by = _fill(big, "train", 5)
    seen = []
    for r in range(world):
        b = Batches(TOKENS, TOKENS, B, T, 99, accum=accum, world=world, rank=r)
        x, y = _fill(b, "train", 5)
        assert x.shape == (accum * B, T)
        for k in range(accum):
            rows = slice((k * world + r) * B, (k * world + r + 1) * B)
            assert np.array_equal(x[k * B:(k + 1) * B], bx[rows]) and np.array_equal(y[k * B:(k + 1) * B], by[rows])
            seen.append(rows.start)
        ex, _ = _fill(b, "eval_val", 3)                     # evaluation: rows r*B.. of W*B, no micro-batches
        gx, _ = get_batch(TOKENS, 99, 3, rng.SITE_BATCH_VAL, B, T, row_offset=r * B)
        assert np.array_equal(ex, gx)
    assert sorted(seen) == list(range(0, accum * world * B, B))


def test_y_is_x_shifted_and_counters_differ():
    b = Batches(TOKENS, TOKENS, 3, 32, 1)
    x, y = _fill(b, "train", 0)
    assert np.array_equal(x[:, 1:], y[:, :-1])
    x2, _ = _fill(b, "train", 1)
    assert not np.array_equal(x, x2)


def test_split_too_short():
    with pytest.raises(ValueError, match="val split has 10 tokens"):
        Batches(TOKENS, TOKENS[:10], 2, 16, 0)


def test_offsets_past_four_billion_tokens():
    """A split of more than 2**32 tokens draws starts over all of it (two 32-bit words)."""
    n = 3 * 2**32
    offs = rng.batch_offsets(5, 1, rng.SITE_BATCH_TRAIN, 4096, n, 1024)
    assert offs.min() >= 0 and offs.max() < n - 1024 and offs.max() > 2**33
    small = rng.batch_offsets(5, 1, rng.SITE_BATCH_TRAIN, 64, 10**6, 1024)       # unchanged below 2**32
    w = rng.uniform_u32(rng.key(5, 1, rng.SITE_BATCH_TRAIN), np.arange(64, dtype=np.uint64))
    assert np.array_equal(small, (w % np.uint64(10**6 - 1024)).astype(np.int64))


def test_array_stream_gather():
    s = ArrayStream(np.arange(100, dtype=np.int32))
    out = np.zeros((2, 5), np.int32)
    s.gather(np.array([3, 90]), 5, out)
    assert out.tolist() == [[3, 4, 5, 6, 7], [90, 91, 92, 93, 94]]
