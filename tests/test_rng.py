"""The counter-based RNG: pinned values (the CUDA mirror in kernels/common.cuh is checked
against these on the GPU), independence of streams, and dropout/batch statistics."""
import numpy as np

from gptcuda.model import rng


def py_hash32(x):
    """The same mixer in plain Python integers, written independently of the numpy version."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def test_hash_pinned_and_matches_plain_python():
    xs = [0, 1, 2, 12345, 0xFFFFFFFF, 0x9E3779B9]
    assert [int(rng.hash32(x)) for x in xs] == [py_hash32(x) for x in xs]
    assert [int(rng.hash32(x)) for x in (1, 2, 12345, 0xFFFFFFFF)] == [1753845952, 3507691905, 2435775735, 1734902346]


def test_key_and_uniform_pinned():
    k = rng.key(1337, 5, 16)
    assert k == py_hash32(py_hash32(py_hash32(1337) ^ 16) + 5 * 0x9E3779B9)
    assert k == 2422660739
    assert rng.uniform_u32(rng.key(1, 2, 3), [0, 1, 7]).tolist() == [325781674, 1121573400, 1170260028]


def test_batch_offsets_pinned_and_in_range():
    assert rng.batch_offsets(1337, 0, 1, 4, 1003854, 256).tolist() == [14779, 520193, 805717, 930999]
    o = rng.batch_offsets(7, 3, 1, 4096, 300, 16)
    assert o.min() >= 0 and o.max() <= 300 - 16 - 1
    assert len(set(o.tolist())) > 200          # spread over the whole range


def test_dropout_mask_rate_and_streams():
    n, p = 200_000, 0.2
    m = rng.dropout_mask(1, 10, rng.dropout_site(0, 1), n, p)
    assert abs(1 - m.mean() - p) < 0.005
    same = rng.dropout_mask(1, 10, rng.dropout_site(0, 1), n, p)
    assert np.array_equal(m, same)
    for other in (rng.dropout_mask(1, 11, rng.dropout_site(0, 1), n, p),     # next step
                  rng.dropout_mask(1, 10, rng.dropout_site(0, 2), n, p),     # other site
                  rng.dropout_mask(2, 10, rng.dropout_site(0, 1), n, p)):    # other seed
        agree = (m == other).mean()
        assert 0.6 < agree < 0.72            # independent masks agree on p^2 + (1-p)^2 = 0.68


def test_dropout_mask_pairs_pinned_and_matches_plain_python():
    """Columns 2c, 2c + 1 of a row share the word of pair r * ceil(cols / 2) + c: low half even, high odd."""
    seed, step, site, p = 3, 4, rng.dropout_site(1, 0), 0.3
    k = py_hash32(py_hash32(py_hash32(seed) ^ site) + step * 0x9E3779B9)
    thr = int(p * 65536)
    for rows, cols in ((3, 5), (2, 6), (1, 9)):
        want = []
        for r in range(rows):
            for c in range(cols):
                idx = r * ((cols + 1) // 2) + c // 2
                w = py_hash32(idx ^ k)                   # one round: keep_word
                want.append(((w >> 16) if c & 1 else (w & 0xFFFF)) >= thr)
        got = rng.dropout_mask(seed, step, site, rows * cols, p, cols)
        assert got.tolist() == want
    # flat: element e takes half e & 1 of word e >> 1, the same as one row
    assert np.array_equal(rng.dropout_mask(seed, step, site, 9, p), rng.dropout_mask(seed, step, site, 9, p, 9))
    assert rng.dropout_mask(1, 2, 3, 10, 0.5).tolist() == [True, True, False, False, False, False, True, True, False, False]
    assert rng.keep_threshold(0.2) == 13107 and rng.keep_threshold(0.0) == 0 and rng.keep_threshold(1.0) == 0xFFFF


def test_attention_keep_quads_pinned_and_matches_plain_python():
    """Keys 2c, 2c + 1, 2c + 8, 2c + 9 of a 16-key block of row R share the word of quad R * 4 ceil(T / 16)
    + 4 (j // 16) + c, key j its byte 2 ((j >> 3) & 1) + (j & 1), kept when >= floor(256 p)."""
    seed, step, site, p = 3, 4, rng.dropout_site(1, 0), 0.3
    k = py_hash32(py_hash32(py_hash32(seed) ^ site) + step * 0x9E3779B9)
    thr = int(p * 256)
    for B, H, T in ((1, 1, 5), (2, 3, 17), (1, 2, 40)):
        words = 4 * ((T + 15) // 16)
        want = []
        for R in range(B * H * T):
            for j in range(T):
                w = py_hash32((R * words + 4 * (j // 16) + (j % 8) // 2) ^ k)
                want.append(((w >> (8 * (2 * ((j >> 3) & 1) + (j & 1)))) & 0xFF) >= thr)
        got = rng.attention_keep(seed, step, site, (B, H, T, T), p)
        assert got.shape == (B, H, T, T) and got.reshape(-1).tolist() == want
    assert rng.attention_keep(1, 2, 3, (1, 1, 1, 10), 0.5).reshape(-1).tolist() == \
        [True, True, True, False, False, False, False, True, False, True]
    assert rng.attention_threshold(0.2) == 51 and rng.attention_rate(0.2) == 51 / 256
    assert rng.attention_threshold(0.0) == 0 and rng.attention_threshold(1.0) == 255
    big = rng.attention_keep(1, 10, rng.dropout_site(0, 0), (2, 2, 256, 256), 0.2)
    assert abs(1 - big.mean() - rng.attention_rate(0.2)) < 0.005
    other = rng.attention_keep(1, 11, rng.dropout_site(0, 0), (2, 2, 256, 256), 0.2)
    assert 0.6 < (big == other).mean() < 0.72             # the next step's mask is another


def test_dropout_keep_shapes():
    m = rng.dropout_keep(5, 6, 7, (2, 3, 5, 5), 0.4, rows=True)
    assert m.shape == (2, 3, 5, 5)
    assert np.array_equal(m, rng.attention_keep(5, 6, 7, (2, 3, 5, 5), 0.4))
    f = rng.dropout_keep(5, 6, 7, (4, 6), 0.4)
    assert np.array_equal(f.reshape(-1), rng.dropout_mask(5, 6, 7, 24, 0.4))


def test_sites_are_distinct():
    sites = {rng.SITE_BATCH_TRAIN, rng.SITE_BATCH_VAL, rng.SITE_BATCH_EVAL_TRAIN, rng.DROPOUT_EMB}
    sites |= {rng.dropout_site(l, w) for l in range(12) for w in range(3)}
    assert len(sites) == 4 + 36


def test_kernel_dropout_arguments():
    """The launchers' trailing dropout arguments: the residuals' 16-bit threshold with 1 / (1 - p), the
    attention's byte threshold with 1 / (1 - attention_rate(p)) (what the reference scales by); a
    dropout without the StepState is one clear error, also where p rounds to no drop."""
    import types

    import pytest

    from gptcuda.ops.cuda import attention_dropout_args, dropout_args
    rt = types.SimpleNamespace(state=object(), seed=7)
    _, seed, site, thr, scale = (a if i == 0 else a.value for i, a in enumerate(dropout_args(rt, 0.2, 21, "x")))
    assert (seed, site, thr) == (7, 21, 13107) and scale == pytest.approx(1.25, rel=1e-7)
    _, _, _, thr, scale = (a if i == 0 else a.value for i, a in enumerate(attention_dropout_args(rt, 0.2, 16)))
    assert thr == 51 and scale == pytest.approx(256 / 205, rel=1e-7)
    assert [a.value for a in attention_dropout_args(rt, 0.0, 16)[3:]] == [0, 1.0]
    rt.state = None
    for p in (0.2, 0.001):
        with pytest.raises(RuntimeError, match="StepState"):
            attention_dropout_args(rt, p, 16)
