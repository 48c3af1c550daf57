"""Generation on the GPU: the KV-cache step against the full forward, greedy against argmax, seeded
sampling, and the draw kernel against reference/ops.py draw_token; bf16 generation against float64 by its
error model (tests/test_decode.py), and against fp32 where the logits' margins decide."""
import numpy as np
import pytest

from gptcuda.generate.sampler import Generator
from gptcuda.ops.cuda import decode as D
from gptcuda.model.memory import STOP_MAX, pack_gen_opts
from gptcuda.ops.reference.ops import draw_token
from gptcuda.runtime import bf16
from test_decode import (FP32_SHARE, V, bf16_error_model, bf16_tolerance, decode_vs_forward, greedy_vs_forward,
                         seeded_runs, tiny_model)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T", [16, 150])          # 150: three chunks of keys, the last one partial
def test_decode_matches_full_forward_gpu(T):
    decode_vs_forward("cuda", 1e-5, T)


def test_greedy_equals_argmax_of_full_forward_gpu():
    greedy_vs_forward("cuda", 1e-4)


def test_greedy_through_the_gemm_gpu():
    """20 sequences: more rows than decode_linear takes, so the products run on the GEMM, in the
    scratch the generator plans for itself."""
    greedy_vs_forward("cuda", 1e-4, max_new=24, S=20)


def test_seeded_sampling_and_stop_gpu():
    seeded_runs("cuda")


# (padded row, real vocabulary): GPT-2's, a char model's, one below the block's thread count
@pytest.mark.parametrize("Vp,n_vocab", [(50304, 50257), (128, 65), (1000, 997)])
@pytest.mark.parametrize("temp,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 40, 1.0), (1.0, 0, 0.9),
                                              (0.7, 50, 0.95), (1.0, 1, 1.0), (2.0, 0, 0.5)])
def test_draw_kernel_matches_reference(env, Vp, n_vocab, temp, top_k, top_p):
    """The kernel's draws equal draw_token's: the same rule and random words; the integer weights
    come from expf here and exp there, so at most one draw of the 64 may land across a boundary."""
    rt = env
    S, T, N, seed = 64, 8, 4, 123
    r = np.random.default_rng(Vp + top_k)
    logits = (r.standard_normal((S, Vp)) * 3).astype(np.float32)
    logits[:, n_vocab:] = 1e4                               # padding: never drawn, never the max
    logits[0, 5] = logits[0, 9] = logits[0, :n_vocab].max() + 1   # a tie
    pos = rt.upload(np.array([2], np.int32))
    fill = np.full(S, 3, np.int32)
    g = {"ctx": rt.upload(np.zeros((S, T + 1), np.int32)), "fill": rt.upload(fill),
         "out": rt.upload(np.zeros((S, N), np.int32)), "n_out": rt.upload(np.arange(S, dtype=np.int32) % N),
         "done": rt.upload(np.zeros(S, np.int32)), "emit": rt.empty((2, S), "i32"),
         "opts": rt.upload(pack_gen_opts(seed, top_k, temp, top_p, N, 0)),
         "stop": rt.upload(np.zeros(STOP_MAX, np.int32))}
    D.decode_sample(rt, g, rt.upload(logits), pos, n_vocab)
    emit = rt.download(g["emit"])
    inv_temp = float(np.float32(1 / temp)) if temp else 0.0
    want = [draw_token(logits[s], n_vocab, inv_temp, top_k, np.float32(top_p), seed, s % N, s) for s in range(S)]
    got = emit[0].tolist()
    assert all(0 <= t < n_vocab for t in got)
    miss = sum(a != b for a, b in zip(got, want))
    assert miss <= (0 if temp == 0 or top_k == 1 else 1), (got, want)
    if temp == 0:
        assert got[0] == 5
    assert (emit[1] == ((np.arange(S) % N) + 1 >= N)).all()            # done once N tokens are drawn
    assert (rt.download(g["ctx"])[:, 3] == emit[0]).all()
    assert (rt.download(g["fill"]) == 4).all()


@pytest.mark.parametrize("M", [1, 3, 4, 5, 16, 17])
@pytest.mark.parametrize("N,K", [(768, 768), (65, 64), (257, 67)])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "residual"])
def test_decode_linear(env, M, N, K, epilogue):
    """out = a @ w^T + bias with the epilogue, against float64 (17 rows: the GEMM takes over)."""
    from gptcuda.ops.reference import ops as ref
    from tests.conftest import rel_err
    rt = env
    r = np.random.default_rng(M * N + K)
    a, w = r.standard_normal((M, K)).astype(np.float32), r.standard_normal((N, K)).astype(np.float32)
    bias, res = r.standard_normal(N).astype(np.float32), r.standard_normal((M, N)).astype(np.float32)
    pre = a.astype(np.float64) @ w.T.astype(np.float64) + bias
    want = {"none": pre, "gelu": ref.gelu_forward(pre), "residual": res + pre}[epilogue]
    out = rt.empty((M, N))
    aux = {"none": None, "gelu": rt.empty((M, N)), "residual": out}[epilogue]
    if epilogue == "residual":
        rt.write(out, res)
    D.decode_linear(rt, out, rt.upload(a), rt.upload(w), rt.upload(bias), epilogue, aux)
    assert rel_err(rt.download(out), want) < 1e-5
    if epilogue == "gelu":
        assert rel_err(rt.download(aux), pre) < 1e-5


# ---- bf16 generation (the error model: tests/test_decode.py, above bf16_error_model) ---------------------

@pytest.fixture
def bf16_rt(rt):
    """The session runtime in precision bf16 (decode_linear's rows beyond LINEAR_ROWS go to the bf16 GEMM)
    with a split-K workspace (restored after)."""
    old_exec, old_ws = rt.exec, dict(rt._workspace)
    rt.exec = rt.exec.with_precision("bf16")
    rt.set_workspace({**old_ws, "gemm_splitk": rt.empty((4 << 20,), name="gemm_splitk")})
    yield rt
    rt.exec = old_exec
    rt.set_workspace(old_ws)


LINEAR_BF16_CASES = [(M, N, K) for M in (1, 3, 4, 5, 16, 17) for N, K in ((768, 768), (65, 64), (257, 72), (130, 36))
                     if M <= 16 or K % 8 == 0]          # (the bf16 GEMM reads rows of 16 bytes)


@pytest.mark.parametrize("out_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "residual"])
@pytest.mark.parametrize("M,N,K", LINEAR_BF16_CASES)
def test_decode_linear_bf16(bf16_rt, M, N, K, epilogue, out_dtype):
    """bf16 a and w (exact in bf16, so the float64 product of the same values is the reference) into fp32
    or bf16, against float64: fp32 out within the fp32 sum's error (1e-5 of max|ref| as the fp32 test; the
    GEMM's 4e-5 beyond 16 rows, test_gemm_bf16's), bf16 out one rounding more (conftest.bf16_err), the
    GELU's output from its pre-activation as stored. K 36: the one-value loop (rows not of 16 bytes); 17
    rows: the bf16 GEMM, x @ W^T into fp32 or bf16."""
    from gptcuda.ops.reference import ops as ref
    from tests.conftest import bf16_err, rel_err
    rt = bf16_rt
    tol = 1e-5 if M <= D.LINEAR_ROWS[-1] else 4e-5
    r = np.random.default_rng(M * N + K)
    a = bf16.round_f32(r.standard_normal((M, K))).astype(np.float64)
    w = bf16.round_f32(r.standard_normal((N, K))).astype(np.float64)
    bias = r.standard_normal(N).astype(np.float32)
    res = r.standard_normal((M, N)).astype(np.float32)
    if out_dtype == "bf16":
        res = bf16.round_f32(res)
    pre = a @ w.T + bias
    out = rt.empty((M, N), out_dtype)
    aux = {"none": None, "gelu": rt.empty((M, N), out_dtype), "residual": out}[epilogue]
    if epilogue == "residual":
        rt.write(out, bf16.bits(res) if out_dtype == "bf16" else res)
        pre = pre + res
    D.decode_linear(rt, out, rt.upload(a, "bf16"), rt.upload(w, "bf16"), rt.upload(bias), epilogue, aux)
    got = rt.download(out)
    if out_dtype == "f32":
        assert rel_err(got, ref.gelu_forward(pre) if epilogue == "gelu" else pre) < tol
        if epilogue == "gelu":
            assert rel_err(rt.download(aux), pre) < tol
        return
    got = bf16.values(got).astype(np.float64)
    if epilogue == "gelu":
        stored = bf16.values(rt.download(aux)).astype(np.float64)
        assert bf16_err(stored, pre, tol) <= 1.0
        assert bf16_err(got, ref.gelu_forward(stored), 1e-6) <= 1.0
    else:
        assert bf16_err(got, pre, tol) <= 1.0


def test_bf16_working_copy_is_the_loaded_weights_gpu():
    """The generator's parameters are the model's fp32 weights, and its working copy those rounded to
    nearest even, bit for bit (made once, before the first step)."""
    from gptcuda.model.params import flatten, param_table
    m = tiny_model(16)
    gen = Generator(m, 3, 4, "cuda", "bf16")
    flat = flatten(param_table(gen.cfg, V), m.named)
    assert np.array_equal(gen.be.download(gen.bufs.flat_params), flat.astype(np.float32))
    assert np.array_equal(gen.be.download(gen.d["params_bf16"]), bf16.bits(flat))


@pytest.mark.parametrize("T,S", [(16, 3), (16, 20), (150, 3)])    # 20 rows: the bf16 GEMM; 150: three key chunks
def test_bf16_decode_logits_within_the_error_model_gpu(T, S):
    """Every step's logits of a bf16 generation reading S windows of T tokens, against the float64 reference
    on the weights as the working copy holds them (ref_w), within the error model's tolerance at every
    logit (6 standard deviations of the activations' roundings, plus the fp32 share); and farther from
    the float64 reference on the fp32 weights than an fp32 decode may be (the bf16 path in effect). The
    step's buffers are poisoned before each step (an unwritten output shows as NaN)."""
    from gptcuda.runtime import POISON_WORDS
    m = tiny_model(T)
    gen = Generator(m, S, 1, "cuda", "bf16")
    rt, d = gen.be.rt, gen.d
    x = np.random.default_rng(T + S).integers(0, V, (S, T))
    gen.reset(list(x), temp=0.0, top_k=None, top_p=1.0, seed=0)
    checked = range(T) if T <= 16 else (0, 1, 63, 64, 65, 127, 128, T - 1)       # chunk edges
    worst = far = 0.0
    for t in range(T):
        for name in ("x", "h", "h_mean", "h_rstd", "qkv", "y", "attn_part", "fc_pre", "fc_act", "logits"):
            rt.fill(d[name], POISON_WORDS[d[name].dtype])
        gen.be.run(gen.program)
        got = rt.download(d["logits"]).astype(np.float64)
        assert np.isfinite(got).all(), t
        if t not in checked:
            continue
        for s in range(S):
            ref, ref_w, sigma = bf16_error_model(m.named, m.cfg, x[s, :t + 1])
            worst = max(worst, float(np.max(np.abs(got[s] - ref_w) / bf16_tolerance(ref, sigma))))
            far = max(far, float(np.max(np.abs(got[s] - ref)) / np.max(np.abs(ref))))
    assert worst <= 1.0, worst
    assert far > 100 * FP32_SHARE, far


@pytest.mark.parametrize("S,max_new", [(3, 40), (20, 12)])
def test_bf16_greedy_matches_fp32_where_the_margin_decides_gpu(S, max_new):
    """Greedy bf16 generation past the window's end: each token it draws is the argmax of the float64
    reference over the window the cache holds (ref_w) within the error model (a logit above it by more
    than both tolerances could not be passed over). At every window of its path where the margin decides
    both ways (ref_w's top logit above every other by more than their bf16 tolerances, ref's by more than
    twice the fp32 decode's 1e-4 of max|ref|, the same token), an fp32 generator reading that window as its
    prompt draws the same token; and the two generations agree on every token before the first window
    where it does not decide. At least half the windows decide (about 3/4 when written)."""
    m = tiny_model(16)
    T = m.cfg.block_size
    r = np.random.default_rng(2)
    prompts = [r.integers(0, V, (1, 5, T + 4)[s % 3] + s // 3) for s in range(S)]
    got = Generator(m, S, max_new, "cuda", "bf16").generate(prompts, temp=0.0)
    want = Generator(m, S, max_new, "cuda", "fp32").generate(prompts, temp=0.0)
    assert [len(g) for g in got] == [len(g) for g in want] == [max_new] * S
    windows, decided, first = [], [], []
    for s in range(S):
        w, f = list(prompts[s][-T:]), None
        for j in range(max_new):
            ref, ref_w, sigma = bf16_error_model(m.named, m.cfg, w)
            tol = bf16_tolerance(ref, sigma)
            tok, top, top32 = int(got[s][j]), int(ref_w.argmax()), int(ref.argmax())
            assert ref_w[top] - ref_w[tok] <= tol[top] + tol[tok], (s, j, tok, top)
            others = np.arange(V) != top
            ok = top == top32 and bool(np.all(ref_w[top] - ref_w[others] > tol[top] + tol[others])) and \
                bool(np.all(ref[top] - ref[others] > 2e-4 * np.max(np.abs(ref))))
            windows.append(list(w))
            decided.append((ok, top))
            if not ok and f is None:
                f = j
            w.append(tok)
            if len(w) == T + 1:
                w = w[-(T // 2):]
        first.append(max_new if f is None else f)
    fp32 = Generator(m, len(windows), 1, "cuda", "fp32").generate(windows, temp=0.0)
    compared = [(int(fp32[i][0]), top) for i, (ok, top) in enumerate(decided) if ok]
    assert all(a == b for a, b in compared), compared
    assert len(compared) >= len(windows) // 2, (len(compared), len(windows))
    for s in range(S):
        assert np.array_equal(got[s][:first[s]], want[s][:first[s]]), (s, first[s])


def test_bf16_seeded_sampling_and_stop_gpu():
    seeded_runs("cuda", "bf16")
