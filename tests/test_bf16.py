"""gptcuda/runtime/bf16.py: bf16 bit patterns on the host, rounded as the kernels' cvt.rn (kernels/bf16.cuh)."""
import numpy as np

from gptcuda.runtime import bf16


def test_round_to_nearest_even():
    one = 0x3F80                                   # 1.0; its bf16 ulp is 2^-7
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, 1 + 2 ** -9], np.float32)
    # ties go to the even pattern (1.0 and 1 + 2^-6), anything past half an ulp up, below it down
    assert list(bf16.bits(x)) == [one, one, one + 2, one + 1, one]
    assert list(bf16.bits(-x)) == [p | 0x8000 for p in bf16.bits(x)]


def test_widening_is_exact_and_round_trips():
    rng = np.random.default_rng(0)
    b = rng.integers(0, 1 << 16, 10000).astype(np.uint16)
    b = b[(b & 0x7F80) != 0x7F80]                  # finite patterns
    assert np.array_equal(bf16.bits(bf16.values(b)), b)
    x = rng.standard_normal(1000).astype(np.float32)
    r = bf16.round_f32(x)
    assert np.all(np.abs(r - x) <= np.abs(x) * 2.0 ** -8)


def test_specials():
    x = np.array([np.inf, -np.inf, np.nan, 3.4e38, np.float32(3.3895e38), 0.0, -0.0, 1e-40], np.float32)
    v = bf16.values(bf16.bits(x))
    assert v[0] == np.inf and v[1] == -np.inf and np.isnan(v[2])
    assert v[3] == np.inf                          # past the largest bf16 by more than half an ulp
    assert np.isfinite(v[4]) and v[4] > 3.3e38
    assert v[5] == 0 and np.signbit(v[6]) and 0 < v[7] < 1e-39   # subnormals are kept
