"""Tests of kernels/encoder.cu against the float64 reference (deterministic backward), on the GPU;
the launchers' path choice and workspace handling also without one (the unmarked tests)."""
from contextlib import contextmanager

import numpy as np
import pytest

from gptcuda.ops.cuda import encoder as enc
from gptcuda.ops.reference import ops as ref
from tests.conftest import FakeGemmRT, bf16_err, fake_view, rel_err, shifted_view
from gptcuda.config import config_of
from gptcuda.runtime import bf16

gpu = pytest.mark.gpu

# (B, T, C, V, Tmax): float4 paths, scalar paths (C % 4 != 0), tails everywhere
SHAPES = [
    (4, 64, 384, 65, 256),
    (3, 17, 37, 11, 20),
    (2, 33, 132, 7, 40),
    (1, 1, 4, 3, 1),
    (5, 50, 1000, 300, 64),
    (16, 256, 384, 65, 256),
]
# GPT-2 scale (the sorted path's reason to be): 2 and 8 sequences of 1024 tokens, and the most
# tokens one sort block takes (E = 32, 16384 < N <= 32768)
GPT2 = [(2, 1024, 768, 50304, 1024), (8, 1024, 768, 50304, 1024), (32, 1024, 768, 50304, 1024)]


def _randn(r, *shape):
    x = r.standard_normal(shape).astype(np.float32)
    x[x == 0] = 0.5
    return x


def _ids(r, B, T, V):
    idx = r.integers(0, V, size=(B, T)).astype(np.int32)
    if V > 2:
        idx[idx == V - 1] = 0        # one vocabulary row never appears: its gradient must stay as it was
    return idx


def _skewed_ids(r, B, T, V):
    """Like text: a few ids hundreds of times (EOT, " the", ...), a long tail of rare ones, most of
    V absent, 0 and V - 1 present (V = 50304: ids of all four 4-bit radix digits)."""
    N = B * T
    hot = np.array([0, 11, 13, 198, 262, V - 1, 50256 % V], dtype=np.int64)
    x = np.empty(N, dtype=np.int64)
    kind = r.random(N)
    x[:] = r.integers(0, V, size=N)                               # uniform tail
    zipf = np.minimum(r.zipf(1.3, size=N) - 1, 3000)              # frequent small ids
    x[kind < 0.5] = zipf[kind < 0.5]
    x[kind < 0.15] = hot[r.integers(0, len(hot), size=N)][kind < 0.15]
    x[N // 2:N // 2 + 300] = 262                                  # a run of one id
    return x.astype(np.int32).reshape(B, T)


@contextmanager
def _workspace(rt, N, C):
    """The sorted path's planned workspace for N tokens (poisoned), the previous set restored."""
    old = dict(rt._workspace)
    ws = rt.empty((enc.workspace_ints(N, C),), "i32")
    rt.set_workspace({**old, enc.WORKSPACE: ws})
    try:
        yield ws
    finally:
        rt.set_workspace(old)


def _sequential_dwte(dwte0, dout, idx, V):
    """float32 dwte0[v] + the sum of the tokens of id v in the sorted path's exact order: ((0 + dout[n0]) +
    dout[n1]) + ... over its tokens n0 < n1 < ... where there are at most 32 (ENC_LONG); a longer run, the
    entries s0 .. s1 - 1 of the valid tokens sorted by id (n increasing within an id), in pieces cut at
    the multiples of 32 of that order, each summed so from 0, then 0 + piece_0 + piece_1 + .... Rows of
    absent ids are dwte0's, bitwise."""
    C = dout.shape[-1]
    d = dout.reshape(-1, C)
    ids = idx.reshape(-1).astype(np.int64)
    keep = (ids >= 0) & (ids < V)
    n = np.nonzero(keep)[0]
    order = n[np.argsort(ids[n], kind="stable")]                 # by id, n increasing within an id
    sid = ids[order]
    starts = np.r_[0, np.nonzero(np.diff(sid))[0] + 1]
    counts = np.diff(np.r_[starts, len(order)])
    acc = np.zeros((len(starts), C), dtype=np.float32)
    short = counts <= 32
    for k in range(int(counts[short].max()) if short.any() else 0):
        live = short & (counts > k)
        acc[live] = acc[live] + d[order[starts[live] + k]]        # float32 adds, one token a round
    for r in np.nonzero(~short)[0]:
        s0, s1 = int(starts[r]), int(starts[r] + counts[r])
        cuts = [s0] + list(range((s0 // 32 + 1) * 32, s1, 32)) + [s1]
        for a, b in zip(cuts[:-1], cuts[1:]):
            piece = np.zeros(C, dtype=np.float32)
            for i in range(a, b):
                piece = piece + d[order[i]]
            acc[r] = acc[r] + piece
    out = dwte0.copy()
    out[sid[starts]] = dwte0[sid[starts]] + acc
    return out


def _run_bwd(rt, dwte0, dout, idx, Tmax, method):
    dwte = rt.upload(dwte0)
    dwpe = rt.empty((Tmax, dout.shape[-1]))       # overwritten entirely (rows >= T zeroed)
    enc.encoder_bwd(rt, dwte, dwpe, dout, idx, method=method)
    return rt.download(dwte), rt.download(dwpe)


@gpu
@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_encoder_fwd(rt, B, T, C, V, Tmax):
    r = np.random.default_rng(B * 1000 + C)
    idx_h = _ids(r, B, T, V)
    wte_h, wpe_h = _randn(r, V, C), _randn(r, Tmax, C)
    idx, wte, wpe = rt.upload(idx_h), rt.upload(wte_h), rt.upload(wpe_h)
    out = rt.empty((B, T, C))
    enc.encoder_fwd(rt, out, idx, wte, wpe)
    got = rt.download(out)
    assert rel_err(got, ref.encoder_forward(idx_h, wte_h, wpe_h)) < 1e-6


@gpu
@pytest.mark.parametrize("method", ["scan", "sort"])
@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_encoder_bwd(rt, B, T, C, V, Tmax, method):
    r = np.random.default_rng(B * 7 + C)
    idx_h = _ids(r, B, T, V)
    dout_h = _randn(r, B, T, C)
    dwte0 = _randn(r, V, C)                      # dwte accumulates
    idx, dout = rt.upload(idx_h), rt.upload(dout_h)
    ref_dwte, ref_dwpe = ref.encoder_backward(dout_h, idx_h, V, Tmax)
    with _workspace(rt, B * T, C):
        (g_wte, g_wpe), (g_wte2, g_wpe2) = [_run_bwd(rt, dwte0, dout, idx, Tmax, method) for _ in range(2)]
    assert rel_err(g_wte, dwte0.astype(np.float64) + ref_dwte) < 1e-5
    assert rel_err(g_wpe, ref_dwpe) < 1e-5
    assert np.all(g_wpe[T:] == 0)
    if V > 2:
        assert np.array_equal(g_wte[V - 1], dwte0[V - 1])
    # bitwise reproducible
    assert np.array_equal(g_wte.view(np.uint32), g_wte2.view(np.uint32))
    assert np.array_equal(g_wpe.view(np.uint32), g_wpe2.view(np.uint32))
    if method == "sort":                         # tokens summed one by one in increasing n
        assert np.array_equal(g_wte.view(np.uint32), _sequential_dwte(dwte0, dout_h, idx_h, V).view(np.uint32))


@gpu
@pytest.mark.parametrize("lengths", [(4000,), (33, 32, 64, 65, 31, 97), (1, 40, 2, 3000, 7, 33), (16384,)])
@pytest.mark.parametrize("C", [768, 132])
def test_encoder_bwd_long_runs(rt, lengths, C):
    """Runs of more than 32 rows (ENC_LONG) summed in pieces of the sorted order's 32-entry chunks: a run
    starting on a chunk's first entry or inside it, ending on a chunk's last entry or inside it, two long
    runs meeting in one chunk, one id for every token; C = 132: VEC 1 (33 columns a lane's share of a tile
    ragged). The exact order of _sequential_dwte, bit for bit, each run's rows and only those."""
    V, T = 50304, 1024
    r = np.random.default_rng(sum(lengths) + C)
    N = -(-max(sum(lengths), 2 * T) // T) * T
    hot = r.choice(V - 1, size=len(lengths), replace=False)
    ids = np.concatenate([np.full(n, v) for n, v in zip(lengths, hot)] +
                         [r.integers(0, V, size=N - sum(lengths))])[r.permutation(N)]
    idx_h = ids.astype(np.int32).reshape(N // T, T)
    dout_h = _randn(r, N // T, T, C)
    dwte0 = _randn(r, V, C)
    idx, dout = rt.upload(idx_h), rt.upload(dout_h)
    with _workspace(rt, N, C):
        g_wte, _ = _run_bwd(rt, dwte0, dout, idx, T, "sort")
    assert np.array_equal(g_wte.view(np.uint32), _sequential_dwte(dwte0, dout_h, idx_h, V).view(np.uint32))
    ref_dwte, _ = ref.encoder_backward(dout_h, idx_h, V, T)
    assert rel_err(g_wte, dwte0.astype(np.float64) + ref_dwte) < 1e-5


@gpu
@pytest.mark.parametrize("B,T,C,V,Tmax", GPT2)
def test_encoder_bwd_gpt2_scale(rt, B, T, C, V, Tmax):
    N = B * T
    assert enc.bwd_wte_method(N, C, V) == "sort"
    r = np.random.default_rng(N)
    idx_h = _skewed_ids(r, B, T, V)
    present = np.unique(idx_h)
    counts = np.bincount(idx_h.reshape(-1), minlength=V)
    assert counts.max() >= 300 and counts[V - 1] > 0 and len(present) < V // 2    # skewed, mostly absent
    dout_h = _randn(r, B, T, C)
    dwte0 = _randn(r, V, C)
    dwte0[V - 2] = -0.0                          # untouched rows keep even a negative zero
    assert counts[V - 2] == 0
    idx, dout = rt.upload(idx_h), rt.upload(dout_h)
    ref_dwte, ref_dwpe = ref.encoder_backward(dout_h, idx_h, V, Tmax)
    with _workspace(rt, N, C):
        (g_wte, g_wpe), (g_wte2, g_wpe2) = [_run_bwd(rt, dwte0, dout, idx, Tmax, None) for _ in range(2)]
    assert rel_err(g_wte, dwte0.astype(np.float64) + ref_dwte) < 1e-5
    assert rel_err(g_wpe, ref_dwpe) < 1e-5
    absent = counts == 0
    assert np.array_equal(g_wte[absent].view(np.uint32), dwte0[absent].view(np.uint32))
    assert np.array_equal(g_wte.view(np.uint32), g_wte2.view(np.uint32))
    assert np.array_equal(g_wpe.view(np.uint32), g_wpe2.view(np.uint32))
    assert np.array_equal(g_wte.view(np.uint32), _sequential_dwte(dwte0, dout_h, idx_h, V).view(np.uint32))


@gpu
@pytest.mark.parametrize("method", ["scan", "sort"])
def test_encoder_bwd_drops_out_of_range_ids(rt, method):
    B, T, C, V, Tmax = 3, 100, 132, 1000, 128
    r = np.random.default_rng(5)
    idx_h = _ids(r, B, T, V)
    idx_h[0, :7] = [-1, V, V + 5, 2 ** 31 - 1, -(2 ** 31), 3, 3]     # the first five: no row
    dout_h = _randn(r, B, T, C)
    dwte0 = _randn(r, V, C)
    idx, dout = rt.upload(idx_h), rt.upload(dout_h)
    ok = idx_h.copy()
    ok[0, :5] = V - 1                            # stand-ins on a row of its own, then forgotten
    ref_dwte, _ = ref.encoder_backward(dout_h * (ok != V - 1)[..., None], ok, V, Tmax)
    with _workspace(rt, B * T, C):
        g_wte, _ = _run_bwd(rt, dwte0, dout, idx, Tmax, method)
    assert rel_err(g_wte, dwte0.astype(np.float64) + ref_dwte) < 1e-5
    if method == "sort":
        assert np.array_equal(g_wte.view(np.uint32), _sequential_dwte(dwte0, dout_h, idx_h, V).view(np.uint32))
        assert np.array_equal(g_wte[V - 1].view(np.uint32), dwte0[V - 1].view(np.uint32))


@gpu
def test_encoder_bwd_sorted_graph_equals_eager(rt):
    """The sorted path captured in a CUDA graph (no host sync, nothing allocated) equals eager runs,
    replay after replay (dwte reset between: it accumulates)."""
    B, T, C, V, Tmax = 2, 1024, 768, 50304, 1024
    r = np.random.default_rng(11)
    idx_h = _skewed_ids(r, B, T, V)
    dout_h = _randn(r, B, T, C)
    dwte0 = _randn(r, V, C)
    idx, dout = rt.upload(idx_h), rt.upload(dout_h)
    with _workspace(rt, B * T, C):
        eager, _ = _run_bwd(rt, dwte0, dout, idx, Tmax, None)
        dwte, dwpe = rt.upload(dwte0), rt.empty((Tmax, C))
        prog = rt.begin("encoder_bwd")
        enc.encoder_bwd(rt, dwte, dwpe, dout, idx)
        rt.end()
        g = rt.capture(prog)
        for _ in range(2):
            rt.write(dwte, dwte0)
            g.launch()
            assert np.array_equal(rt.download(dwte).view(np.uint32), eager.view(np.uint32))


# ---- bf16 -----------------------------------------------------------------------------------
# The inputs are bf16 (exact in fp32 and float64): references are float64 of the same values. Error
# model: the forward adds two values in fp32 (exact here but for an exponent gap > 16: <= 2^-24 of the
# sum) and rounds a bf16 out once (bf16_err: 2^-8 |ref| plus the fp32 error); the backward sums
# bf16 dout in fp32 as it sums fp32 dout (the fp32 tests' 1e-5), and its orders are the fp32 kernels'.

@gpu
@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("shift", [0, 4])
@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_encoder_fwd_bf16(rt, B, T, C, V, Tmax, shift, out_dtype):
    """wte, wpe bf16 (a working copy; shift 4: misaligned for 4-value loads) into out bf16 or fp32:
    against float64 within the model, and bitwise the fp32 sum of the two values, rounded once to bf16."""
    r = np.random.default_rng(B * 1000 + C + shift)
    idx_h = _ids(r, B, T, V)
    wte_v, wpe_v = bf16.round_f32(_randn(r, V, C)), bf16.round_f32(_randn(r, Tmax, C))
    idx = rt.upload(idx_h)
    wte, wpe = (shifted_view(rt, w.shape, "bf16", shift, w) for w in (wte_v, wpe_v))
    out = rt.empty((B, T, C), out_dtype)                          # NaN-poisoned
    enc.encoder_fwd(rt, out, idx, wte, wpe)
    want = ref.encoder_forward(idx_h, wte_v, wpe_v)
    sum32 = wte_v[idx_h] + wpe_v[:T]                             # float32 adds, as the kernel
    got = rt.download(out)
    if out_dtype == "bf16":
        assert bf16_err(bf16.values(got), want, 2.0 ** -22) <= 1
        assert np.array_equal(got, bf16.bits(sum32))
    else:
        assert rel_err(got, want) < 1e-6
        assert np.array_equal(got.view(np.uint32), sum32.view(np.uint32))


def _sequential_dwpe(dout, Tmax):
    """float32 ((0 + dout[0, t]) + dout[1, t]) + ... for t < T, 0 after: encoder_bwd_wpe's order."""
    B, T, C = dout.shape
    acc = np.zeros((Tmax, C), np.float32)
    for b in range(B):
        acc[:T] = acc[:T] + dout[b]
    return acc


@gpu
@pytest.mark.parametrize("method", ["scan", "sort"])
@pytest.mark.parametrize("shift", [0, 4])
@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_encoder_bwd_bf16(rt, B, T, C, V, Tmax, method, shift):
    """dout bf16 into fp32 dwte (+=) and dwpe (=): against float64 (the fp32 sums' error), bitwise the
    sorted path's and the dwpe kernel's summation orders, reproducible; absent ids' rows untouched."""
    r = np.random.default_rng(B * 7 + C + shift)
    idx_h = _ids(r, B, T, V)
    dout_v = bf16.round_f32(_randn(r, B, T, C))
    dwte0 = _randn(r, V, C)
    idx, dout = rt.upload(idx_h), shifted_view(rt, dout_v.shape, "bf16", shift, dout_v)
    ref_dwte, ref_dwpe = ref.encoder_backward(dout_v, idx_h, V, Tmax)
    with _workspace(rt, B * T, C):
        (g_wte, g_wpe), (g_wte2, g_wpe2) = [_run_bwd(rt, dwte0, dout, idx, Tmax, method) for _ in range(2)]
    assert rel_err(g_wte, dwte0.astype(np.float64) + ref_dwte) < 1e-5
    assert rel_err(g_wpe, ref_dwpe) < 1e-5
    assert np.array_equal(g_wpe.view(np.uint32), _sequential_dwpe(dout_v, Tmax).view(np.uint32))
    if V > 2:
        assert np.array_equal(g_wte[V - 1].view(np.uint32), dwte0[V - 1].view(np.uint32))
    assert np.array_equal(g_wte.view(np.uint32), g_wte2.view(np.uint32))
    assert np.array_equal(g_wpe.view(np.uint32), g_wpe2.view(np.uint32))
    if method == "sort":
        assert np.array_equal(g_wte.view(np.uint32), _sequential_dwte(dwte0, dout_v, idx_h, V).view(np.uint32))


@gpu
def test_encoder_bwd_bf16_gpt2_scale(rt):
    """GPT-2's shape (the sorted path) with bf16 dout: the fp32 sums of the same values, bitwise."""
    B, T, C, V, Tmax = 8, 1024, 768, 50304, 1024
    r = np.random.default_rng(8 * 1024 + 1)
    idx_h = _skewed_ids(r, B, T, V)
    dout_v = bf16.round_f32(_randn(r, B, T, C))
    dwte0 = _randn(r, V, C)
    idx, dout = rt.upload(idx_h), rt.upload(dout_v, "bf16")
    ref_dwte, ref_dwpe = ref.encoder_backward(dout_v, idx_h, V, Tmax)
    with _workspace(rt, B * T, C):
        g_wte, g_wpe = _run_bwd(rt, dwte0, dout, idx, Tmax, None)
    assert rel_err(g_wte, dwte0.astype(np.float64) + ref_dwte) < 1e-5
    assert rel_err(g_wpe, ref_dwpe) < 1e-5
    assert np.array_equal(g_wte.view(np.uint32), _sequential_dwte(dwte0, dout_v, idx_h, V).view(np.uint32))
    assert np.array_equal(g_wpe.view(np.uint32), _sequential_dwpe(dout_v, Tmax).view(np.uint32))


# ---- no GPU needed: the launchers' choices -------------------------------------------------

def test_method_choice():
    assert enc.bwd_wte_method(64 * 256, 384, 65) == "scan"             # the char model keeps the scan
    assert enc.bwd_wte_method(8192, 768, 50304) == "sort"
    assert enc.bwd_wte_method(32768, 768, 50304) == "sort"
    assert enc.bwd_wte_method(32769, 768, 50304) == "scan"             # more than one sort block takes
    assert enc.bwd_wte_method(32768, 768, 1 << 17) == "scan"           # (V+1) << 15 > 2^32
    cfg = config_of(batch_size=8, block_size=1024, n_embd=768, vocab_size=0)
    assert enc.workspace(cfg) == {enc.WORKSPACE: ((25092 + 2 * 256 * 768,), "i32")}   # 3N + 2 + 2K to 4 words
    assert enc.workspace(config_of(batch_size=64, block_size=1024, n_embd=768, vocab_size=50304)) == {}
    for N, e in ((1, 1), (1024, 1), (1025, 2), (8192, 8), (16385, 32), (32768, 32)):
        name, smem, nbits, passes = enc.sort_plan(N, 50304)
        assert name.startswith(f"encoder_bwd_sort<{e},") and smem <= 227 * 1024 and passes == 4
        assert (N - 1) < 2 ** nbits and (enc.FILE, name, {}) in enc.VARIANTS


def test_sorted_path_launches_and_needs_its_workspace():
    from gptcuda.runtime import DeviceView
    B, T, C, V = 8, 1024, 768, 50304
    args = (fake_view((V, C)), fake_view((T, C), 1 << 34), fake_view((B, T, C), 1 << 35),
            DeviceView(1 << 36, (B, T), "i32", "idx"))
    rt = FakeGemmRT()
    with pytest.raises(KeyError, match=enc.WORKSPACE):
        enc.encoder_bwd(rt, *args)
    need = enc.workspace_ints(B * T, C)
    rt._ws[enc.WORKSPACE] = DeviceView(1 << 37, (need - 1,), "i32", "ws")
    with pytest.raises(ValueError, match="must hold"):
        enc.encoder_bwd(rt, *args)
    rt._ws[enc.WORKSPACE] = DeviceView(1 << 37, (need,), "i32", "ws")
    enc.encoder_bwd(rt, *args)
    assert [x[0] for x in rt.launches] == [enc.sort_plan(B * T, V)[0], enc.enc_name("encoder_bwd_wte_long", 4),
                                           enc.enc_name("encoder_bwd_wte_seg", 4), enc.enc_name("encoder_bwd_wpe", 4)]
    assert enc.sort_plan(B * T, V)[0].startswith("encoder_bwd_sort<8,")
    assert rt.launches[0][1:3] == ((1,), (enc.SORT_THREADS,)) and rt.launches[0][3] > 48 * 1024
    rt.launches.clear()
    enc.encoder_bwd(rt, *args, method="scan")
    assert rt.launches[0][:2] == (enc.enc_name("encoder_bwd_wte", 4), (V, 6))
