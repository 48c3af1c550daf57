"""Generation on the GPU: the KV-cache step against the full forward, greedy against argmax, seeded
sampling, and the draw kernel against reference/ops.py draw_token."""
import numpy as np
import pytest

from gptcuda.ops.cuda import decode as D
from gptcuda.model.memory import STOP_MAX, pack_gen_opts
from gptcuda.ops.reference.ops import draw_token
from test_decode import decode_vs_forward, greedy_vs_forward, seeded_runs

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
