"""GPU tests of kernels/loss.cu: fused softmax cross-entropy and the deterministic mean loss."""
import numpy as np
import pytest

from gptcuda.ops.cuda import loss as L
from gptcuda.ops.reference import ops as ref
from gptcuda.runtime import DeviceView, bf16
from tests.conftest import bf16_err, rel_err, shifted_view

pytestmark = pytest.mark.gpu


def _randn(r, *shape):
    x = r.standard_normal(shape).astype(np.float32)
    x[x == 0] = 0.5
    return x


def _state(rt, step):
    st = np.zeros(16, np.int32)
    st[0] = step
    rt.state = rt.upload(st)


def _read_state(rt):
    s = rt.download(rt.state)
    return s, s.view(np.float32)


# (leading dims, V): warp-per-row kernel up to V = 1024, then crossentropy_rows (V % 4 == 0: 50304) or
# crossentropy_block (1025, 5003)
CASES = [((4, 64), 65), ((37,), 1), ((3, 7), 33), ((9,), 1024), ((5,), 1025), ((3, 2), 5003), ((2,), 50304)]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("lead,V", CASES)
def test_crossentropy(env, lead, V, inplace):
    rt = env
    r = np.random.default_rng(V + len(lead))
    logits_h = _randn(r, *lead, V) * 3.0
    tg_h = r.integers(0, V, size=lead).astype(np.int32)
    N = int(np.prod(lead))
    scale = 1.0 / N
    rl, probs = ref.crossentropy_forward(logits_h, tg_h)
    rd = ref.crossentropy_backward(probs, tg_h, scale).reshape(*lead, V)
    logits, tg = rt.upload(logits_h), rt.upload(tg_h)
    losses = rt.empty(lead)
    dlogits = logits if inplace else rt.empty((*lead, V))
    L.crossentropy(rt, losses, dlogits, logits, tg, scale)
    assert rel_err(rt.download(losses), rl.reshape(lead)) < 1e-5
    assert rel_err(rt.download(dlogits), rd) < 1e-5


# (leading dims, real vocabulary, padded row length): GPT-2's 50257 -> 50304, a char vocabulary padded
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("lead,Vr,V", [((3, 5), 50257, 50304), ((4, 16), 65, 128), ((7,), 1000, 1025)])
def test_crossentropy_padded_vocab(env, lead, Vr, V, inplace):
    """Columns Vr.. are padding: the loss and softmax see only the first Vr, their gradient is 0
    (whatever the padded logits hold, even huge values)."""
    rt = env
    r = np.random.default_rng(Vr)
    logits_h = _randn(r, *lead, V) * 3.0
    logits_h[..., Vr:] = 1e4
    tg_h = r.integers(0, Vr, size=lead).astype(np.int32)
    tg_h.reshape(-1)[0] = Vr - 1
    scale = 0.37
    rl, probs = ref.crossentropy_forward(logits_h[..., :Vr], tg_h)
    rd = np.zeros((*lead, V))
    rd[..., :Vr] = ref.crossentropy_backward(probs, tg_h, scale).reshape(*lead, Vr)
    logits, tg = rt.upload(logits_h), rt.upload(tg_h)
    losses = rt.empty(lead)
    dlogits = logits if inplace else rt.empty((*lead, V))
    L.crossentropy(rt, losses, dlogits, logits, tg, scale, n_vocab=Vr)
    assert rel_err(rt.download(losses), rl.reshape(lead)) < 1e-5
    got = rt.download(dlogits)
    assert rel_err(got, rd) < 1e-5
    assert np.all(got[..., Vr:] == 0)


def test_crossentropy_padded_target_is_nan(env):
    """A target in the padding (>= the real vocabulary) is out of range: NaN loss, no one-hot term."""
    rt = env
    logits = rt.upload(np.ones((2, 8), np.float32))
    tg = rt.upload(np.array([1, 6], np.int32))
    losses = rt.empty((2,))
    L.crossentropy(rt, losses, None, logits, tg, 0.0, n_vocab=6)
    lo = rt.download(losses)
    assert np.isclose(lo[0], np.log(6.0)) and np.isnan(lo[1])


@pytest.mark.parametrize("lead,V", [((4, 64), 65), ((3,), 5003)])
def test_crossentropy_no_grad(env, lead, V):
    rt = env
    r = np.random.default_rng(V)
    logits_h = _randn(r, *lead, V)
    tg_h = r.integers(0, V, size=lead).astype(np.int32)
    rl, _ = ref.crossentropy_forward(logits_h, tg_h)
    logits, tg = rt.upload(logits_h), rt.upload(tg_h)
    losses = rt.empty(lead)
    L.crossentropy(rt, losses, None, logits, tg, 0.0)
    assert rel_err(rt.download(losses), rl.reshape(lead)) < 1e-5
    dl = rt.empty((*lead, V))                            # given but grad_scale 0: untouched
    L.crossentropy(rt, losses, dl, logits, tg, 0.0)
    assert np.all(np.isnan(rt.download(dl)))
    assert np.array_equal(rt.download(logits), logits_h)


def _launched(rt, *args, **kw):
    """Run L.crossentropy; the name and block size of the kernel it launched."""
    seen = []
    launch = rt.launch

    def spy(fn, grid, block, *a, **k):
        seen.append((fn.name, tuple(block)))
        return launch(fn, grid, block, *a, **k)

    rt.launch = spy
    try:
        L.crossentropy(rt, *args, **kw)
    finally:
        del rt.launch
    assert len(seen) == 1, seen
    return seen[0]


def _ce_reference(logits_h, tg_h, Vr, scale):
    """float64 (losses, dlogits) over the first Vr columns; an out-of-range target (outside 0..Vr-1)
    gives a NaN loss and no one-hot term; the padded columns' gradient is 0."""
    V = logits_h.shape[-1]
    lg = logits_h.reshape(-1, V)[:, :Vr].astype(np.float64)
    tg = tg_h.reshape(-1)
    ok = (tg >= 0) & (tg < Vr)
    z = lg - lg.max(axis=1, keepdims=True)
    e = np.exp(z)
    s = e.sum(axis=1, keepdims=True)
    losses = np.full(tg.shape, np.nan)
    rows_ok = np.nonzero(ok)[0]
    losses[rows_ok] = np.log(s[rows_ok, 0]) - z[rows_ok, tg[rows_ok]]
    d = np.zeros((lg.shape[0], V))
    d[:, :Vr] = e / s
    d[rows_ok, tg[rows_ok]] -= 1.0
    return losses.reshape(tg_h.shape), (d * scale).reshape(logits_h.shape)


def _rows_inputs(seed, lead, Vr, V):
    """Random logits (rows shifted by up to +-20) with huge values in the padding, and targets that
    include the first and the last real column."""
    r = np.random.default_rng(seed)
    logits_h = _randn(r, *lead, V) * 3.0 + r.uniform(-20, 20, size=(*lead, 1)).astype(np.float32)
    logits_h[..., Vr:] = 1e4
    tg_h = r.integers(0, Vr, size=lead).astype(np.int32)
    tg_h.reshape(-1)[0] = Vr - 1
    if tg_h.size > 1:
        tg_h.reshape(-1)[1] = 0
    return logits_h, tg_h


# (leading dims, real vocabulary, row length, NV4 of the crossentropy_rows variant picked)
ROWS_CASES = [((4, 2), 50257, 50304, 25),        # GPT-2's padded vocabulary
              ((2,), 51200, 51200, 25),          # exactly 25 * 2048
              ((3,), 2048 * 8 + 4, 2048 * 8 + 4, 16),   # just past an NV4 boundary
              ((2,), 2048 * 8, 2048 * 8, 8),
              ((5,), 1028, 1028, 8),             # the first V past the warp kernel
              ((2, 2), 4093, 4096, 8),           # padded, a real vocabulary not a multiple of 4
              ((3,), 57341, 57344, 28)]          # the largest row held in registers


@pytest.mark.parametrize("mode", ["grad", "inplace", "nograd"])
@pytest.mark.parametrize("lead,Vr,V,nv4", ROWS_CASES)
def test_crossentropy_rows(env, lead, Vr, V, nv4, mode):
    """The row-in-registers kernel: loss and gradient against float64, padding masked (its gradient
    exactly 0), every output element written, the same bits on a second run."""
    rt = env
    logits_h, tg_h = _rows_inputs(Vr + V + len(lead), lead, Vr, V)
    scale = 0.37
    rl, rd = _ce_reference(logits_h, tg_h, Vr, scale)
    logits, tg = rt.upload(logits_h), rt.upload(tg_h)
    losses = rt.empty(lead)                                # NaN-poisoned
    dlogits = {"grad": rt.empty((*lead, V)), "inplace": logits, "nograd": None}[mode]
    name = _launched(rt, losses, dlogits, logits, tg, 0.0 if mode == "nograd" else scale, n_vocab=Vr)
    assert name == (L.ce_name("rows", mode != "nograd", nv4), (L.ROWS_THREADS,))
    got_l = rt.download(losses)
    assert rel_err(got_l, rl) < 1e-5
    if mode == "nograd":
        assert np.array_equal(rt.download(logits), logits_h)
        return
    got = rt.download(dlogits)
    assert rel_err(got, rd) < 1e-5
    assert np.all(got[..., Vr:] == 0)
    if mode == "grad":                                     # deterministic: the same bits again
        losses2, d2 = rt.empty(lead), rt.empty((*lead, V))
        L.crossentropy(rt, losses2, d2, logits, tg, scale, n_vocab=Vr)
        assert np.array_equal(rt.download(losses2), got_l) and np.array_equal(rt.download(d2), got)


@pytest.mark.parametrize("inplace", [False, True])
def test_crossentropy_rows_out_of_range_target(env, inplace):
    """Targets outside 0..Vr-1 (negative, in the padding, past the row): NaN loss, no one-hot term,
    no read outside the row; the other rows are unaffected."""
    rt = env
    lead, Vr, V = (6,), 50257, 50304
    logits_h, tg_h = _rows_inputs(7, lead, Vr, V)
    tg_h[:4] = [-1, Vr, V - 1, 1 << 30]
    scale = 0.5
    rl, rd = _ce_reference(logits_h, tg_h, Vr, scale)
    logits, tg = rt.upload(logits_h), rt.upload(tg_h)
    losses = rt.empty(lead)
    dlogits = logits if inplace else rt.empty((*lead, V))
    name = _launched(rt, losses, dlogits, logits, tg, scale, n_vocab=Vr)
    assert name == (L.ce_name("rows", True, 25), (L.ROWS_THREADS,))
    lo = rt.download(losses)
    assert np.all(np.isnan(lo[:4])) and rel_err(lo[4:], rl[4:]) < 1e-5
    got = rt.download(dlogits)
    assert rel_err(got, rd) < 1e-5
    assert np.all(got[..., Vr:] == 0)


def _offset(rt, arr_or_shape):
    """A view 4 bytes into its allocation (not 16-byte aligned): uploaded from an array, or NaN-poisoned."""
    if isinstance(arr_or_shape, tuple):
        shape = arr_or_shape
        base = rt.empty((int(np.prod(shape)) + 1,))
    else:
        shape = arr_or_shape.shape
        base = rt.upload(np.concatenate([np.full(1, 9.0, np.float32), arr_or_shape.reshape(-1)]))
    return DeviceView(base.ptr + 4, tuple(shape), "f32", "offset")


# rows the register kernel must not take: crossentropy_block instead
@pytest.mark.parametrize("case", ["logits_misaligned", "dlogits_misaligned", "inplace_misaligned",
                                  "nograd_misaligned", "v_not_multiple_of_4", "too_long"])
def test_crossentropy_block_fallback(env, case):
    rt = env
    lead, Vr, V = (3,), 50257, 50304
    if case == "v_not_multiple_of_4":
        Vr = V = 50257
    elif case == "too_long":
        Vr, V = 57345, 2048 * max(L.ROWS_NV4) + 4
    logits_h, tg_h = _rows_inputs(V + 3, lead, Vr, V)
    grad = case != "nograd_misaligned"
    scale = 0.37 if grad else 0.0
    rl, rd = _ce_reference(logits_h, tg_h, Vr, scale)
    misaligned = case.endswith("misaligned") and case != "dlogits_misaligned"
    logits = _offset(rt, logits_h) if misaligned else rt.upload(logits_h)
    if not grad:
        dlogits = None
    elif case.startswith("inplace"):
        dlogits = logits
    else:
        dlogits = _offset(rt, (*lead, V)) if case == "dlogits_misaligned" else rt.empty((*lead, V))
    losses = rt.empty(lead)
    name = _launched(rt, losses, dlogits, logits, rt.upload(tg_h), scale, n_vocab=Vr)
    assert name == (L.ce_name("block", grad), (L.THREADS,))
    assert rel_err(rt.download(losses), rl) < 1e-5
    if grad:
        got = rt.download(dlogits)
        assert rel_err(got, rd) < 1e-5
        assert np.all(got[..., Vr:] == 0)


# ---- bf16 logits (a bf16 model's head output) and their gradient in bf16 ------------------------
# Error model: the logits are bf16, exact in fp32 and float64 (the reference: float64 of the same
# values); the kernels compute in fp32 as for fp32 logits, so the fp32 losses keep the fp32 tests' bound
# (1e-5 of max|ref|), and a bf16 gradient adds one rounding (bf16_err: 2^-8 |ref| an element plus the
# fp32 error, 1e-5 of max|ref|). Padding columns: exactly 0.

# (leading dims, real vocabulary, row length, kernel): each kernel, padded and not
BF16_CASES = [((4, 64), 65, 65, "warp"), ((37,), 1, 1, "warp"), ((9,), 1024, 1024, "warp"),
              ((4, 16), 65, 128, "warp"),
              ((5,), 1025, 1025, "block"), ((3, 2), 5003, 5003, "block"), ((7,), 1000, 1025, "block"),
              ((5,), 1028, 1028, "rows"), ((3,), 2048 * 8 + 4, 2048 * 8 + 4, "rows"),
              ((4, 2), 50257, 50304, "smem"), ((2, 2), 4093, 4096, "smem"), ((5,), 1032, 1032, "smem"),
              ((3,), 57341, 57344, "smem")]       # V % 8 == 0 up to SMEM_ROW_MAX: the row in shared memory


def _check_ce_bf16(rt, lead, Vr, V, kind, mode, shift=0):
    """crossentropy on bf16 logits `shift` bytes into their allocation (dlogits: as far into theirs, or
    the logits, or none): the kernel `kind` launched, losses and gradient against float64 within the
    model, padding exactly 0, the logits untouched without a gradient. Returns (losses, dlogits bits)."""
    logits_h, tg_h = _rows_inputs(Vr + V + len(lead) + shift, lead, Vr, V)
    logits_v = bf16.round_f32(logits_h)
    scale = 0.0 if mode == "nograd" else 0.37
    rl, rd = _ce_reference(logits_v, tg_h, Vr, scale)
    logits = shifted_view(rt, (*lead, V), "bf16", shift, logits_v)
    dlogits = {"grad": lambda: shifted_view(rt, (*lead, V), "bf16", shift), "inplace": lambda: logits,
               "nograd": lambda: None}[mode]()
    losses = rt.empty(lead)                                # NaN-poisoned, as dlogits
    name = _launched(rt, losses, dlogits, logits, rt.upload(tg_h), scale, n_vocab=Vr)
    rows = kind == "rows"
    assert name == (L.ce_name(kind, mode != "nograd", L.rows_nv4(V) if rows else 0, "bf16"),
                    (L.ROWS_THREADS if kind in ("rows", "smem") else L.THREADS,))
    got_l = rt.download(losses)
    assert rel_err(got_l, rl) < 1e-5
    if mode == "nograd":
        assert np.array_equal(rt.download(logits), bf16.bits(logits_v))
        return got_l, None
    got_d = rt.download(dlogits)
    got = bf16.values(got_d)
    assert bf16_err(got, rd, 1e-5) <= 1
    assert np.all(got[..., Vr:] == 0)
    return got_l, got_d


@pytest.mark.parametrize("mode", ["grad", "inplace", "nograd"])
@pytest.mark.parametrize("lead,Vr,V,kind", BF16_CASES)
def test_crossentropy_bf16(env, lead, Vr, V, kind, mode):
    """bf16 logits (and dlogits, in place or not) through each kernel, within the model; the same bits
    on a second run."""
    got_l, got_d = _check_ce_bf16(env, lead, Vr, V, kind, mode)
    if mode == "grad":
        got_l2, got_d2 = _check_ce_bf16(env, lead, Vr, V, kind, mode)
        assert np.array_equal(got_l2.view(np.uint32), got_l.view(np.uint32)) and np.array_equal(got_d2, got_d)


# bf16 rows 16-byte aligned: the shared-memory kernel; 8 bytes off: the register kernel (16 for fp32); 2 or 4
# bytes off: the block kernel
@pytest.mark.parametrize("mode", ["grad", "inplace", "nograd"])
@pytest.mark.parametrize("shift,kind", [(16, "smem"), (8, "rows"), (4, "block"), (2, "block")])
def test_crossentropy_bf16_alignment(env, shift, kind, mode):
    _check_ce_bf16(env, (3,), 50257, 50304, kind, mode, shift)


@pytest.mark.parametrize("N", [16384, 1, 1023, 1025, 3000])
def test_loss_reduce(env, N):
    rt = env
    r = np.random.default_rng(N)
    losses_h = (np.abs(r.standard_normal(N)) + 0.1).astype(np.float32)
    losses = rt.upload(losses_h)
    want = losses_h.astype(np.float64).mean()
    _state(rt, 3)
    hist = rt.empty((10,))
    L.loss_reduce(rt, losses, hist)
    s, f = _read_state(rt)
    assert abs(f[2] - want) <= 1e-6 * want
    h = rt.download(hist)
    assert h[3] == f[2]
    assert np.all(np.isnan(np.delete(h, 3)))
    assert s[0] == 3                                      # step untouched
    # bitwise reproducible
    L.loss_reduce(rt, losses, hist)
    assert _read_state(rt)[1][2] == f[2]
    # step beyond the history, and no history
    _state(rt, 10)
    hist = rt.empty((10,))
    L.loss_reduce(rt, losses, hist)
    assert np.all(np.isnan(rt.download(hist)))
    assert _read_state(rt)[1][2] == f[2]
    _state(rt, 0)
    L.loss_reduce(rt, losses, None)
    assert _read_state(rt)[1][2] == f[2]
