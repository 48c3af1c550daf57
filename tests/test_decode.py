"""Generation with the KV cache and the device-side draw, on the reference backend (the GPU versions
live in tests/gpu/test_decode_gpu.py and call the helpers here)."""
import numpy as np
import pytest

from gptcuda.model import rng
from gptcuda.config import load_config
from gptcuda.training.engine import Engine
from gptcuda.model.memory import pack_gen_opts, plan_decode, unpack_gen_opts
from gptcuda.model.params import param_table, unflatten
from gptcuda.ops.reference.ops import draw_token
from gptcuda.generate.sampler import Generator, Model, steps_needed
from gptcuda.runtime import bf16

V = 65


def tiny_engine(backend, S=3, T=16, **over):
    cfg = load_config("configs/tiny.yaml", [f"--backend={backend}", f"--batch_size={S}", f"--block_size={T}",
                                            "--max_iters=0"] + [f"--{k}={v}" for k, v in over.items()])
    toks = (np.arange(2000) * 7 % V).astype(np.int32)
    eng = Engine(cfg, toks, toks[:300], V, programs=("forward",))
    r = np.random.default_rng(0)
    p = eng.params()
    eng.set_params({k: v + r.normal(0, 0.3, v.shape) for k, v in p.items()})   # not the symmetric init
    return eng


def model_of(eng) -> Model:
    return Model(eng.cfg, None, eng.params(), V, "test")


def decode_vs_forward(backend, atol, T=16):
    eng = tiny_engine(backend, T=T)
    S, T = eng.cfg.batch_size, eng.cfg.block_size
    r = np.random.default_rng(1)
    x = r.integers(0, V, (S, T)).astype(np.int32)
    eng.set_batch(x, x)
    eng.run("forward")
    full = np.asarray(eng.be.download(eng.bufs.acts["logits"]), np.float64)       # [S,T,V]
    d = eng.be.allocate_arena(plan_decode(eng.cfg, eng.table, V, S))
    eng.be.begin("decode")
    eng.model.record_decode_step(d, V)
    prog = eng.be.end()
    ctx = np.zeros((S, T + 1), np.int32)
    ctx[:, :T] = x
    eng.be.upload(d["ctx"], ctx)
    eng.be.upload(d["fill"], np.full(S, T + 1, np.int32))       # every token known: nothing is drawn
    for name in ("pos", "n_out", "done"):
        eng.be.upload(d[name], np.zeros(d[name].shape, np.int32))
    eng.be.upload(d["opts"], pack_gen_opts(0, 0, 1.0, 1.0, 1, 0))
    for t in range(T):
        eng.be.run(prog)
        step = np.asarray(eng.be.download(d["logits"]), np.float64)
        assert np.max(np.abs(step - full[:, t])) <= atol * np.max(np.abs(full[:, t])), t
        assert (np.asarray(eng.be.download(d["emit"]))[0] == -1).all()
    assert int(np.asarray(eng.be.download(d["pos"]))[0]) == 0          # the window ended: back to 0


def window_logits(eng, windows):
    """The full forward's logits at the last position of each window (one per sequence, <= T tokens)."""
    S, T = eng.cfg.batch_size, eng.cfg.block_size
    x = np.zeros((S, T), np.int32)
    for s, w in enumerate(windows):
        x[s, :len(w)] = w
    eng.set_batch(x, x)
    eng.run("forward")
    full = np.asarray(eng.be.download(eng.bufs.acts["logits"]), np.float64)
    return [full[s, len(w) - 1] for s, w in enumerate(windows)]


def greedy_vs_forward(backend, rtol, max_new=40, S=3):
    """Greedy generation from prompts of different lengths, past the window's end (T = 16): every
    token is the argmax of the full forward over the window the cache holds (up to a near tie of
    rtol * max|logits| on the GPU, where the two paths round differently). S > 16: the decode
    step's products run on the GEMM and its scratch (ops/cuda/decode.py LINEAR_ROWS)."""
    eng = tiny_engine(backend, S=S)
    S, T = eng.cfg.batch_size, eng.cfg.block_size
    r = np.random.default_rng(2)
    prompts = [r.integers(0, V, (1, 5, T + 4)[s % 3] + s // 3) for s in range(S)]
    gen = Generator(model_of(eng), S, max_new, backend)
    got = gen.generate(prompts, temp=0.0)
    assert [len(g) for g in got] == [max_new] * S
    windows = [list(p[-T:]) for p in prompts]
    for j in range(max_new):
        for s, row in enumerate(window_logits(eng, windows)):
            tok = int(got[s][j])
            assert row.max() - row[tok] <= rtol * np.abs(row).max(), (s, j, tok, int(row.argmax()))
            windows[s].append(tok)
            if len(windows[s]) == T + 1:
                windows[s] = windows[s][-(T // 2):]
    return got


def test_decode_matches_full_forward_reference():
    decode_vs_forward("reference", 1e-12)


def test_greedy_equals_argmax_of_full_forward_reference():
    greedy_vs_forward("reference", 0.0)


def seeded_runs(backend, precision="fp32"):
    """Sampling repeats bit for bit with its seed, changes with it, and stops at the stop sequence."""
    eng = tiny_engine(backend)
    S = eng.cfg.batch_size
    prompts = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6, 7, 8, 9])]
    gen = Generator(model_of(eng), S, 25, backend, precision)
    kw = dict(temp=1.3, top_k=20, top_p=0.9)
    a = gen.generate(prompts, seed=11, **kw)
    b = gen.generate(prompts, seed=11, **kw)
    c = gen.generate(prompts, seed=12, **kw)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    stop = [int(a[0][5]), int(a[0][6])]
    first = next(j for j in range(1, 25) if [int(a[0][j - 1]), int(a[0][j])] == stop)
    steps = list(gen.stream(prompts, seed=11, stop=stop, **kw))
    d = gen.drawn()
    assert np.array_equal(d[0], a[0][:first + 1])                       # ends with the stop sequence
    for s in (1, 2):
        k = next((j for j in range(1, 25) if [int(a[s][j - 1]), int(a[s][j])] == stop), 24)
        assert np.array_equal(d[s], a[s][:k + 1])
    emitted = [[int(e[s]) for e, _ in steps if e[s] >= 0] for s in range(S)]
    assert all(np.array_equal(emitted[s], d[s]) for s in range(S))     # the stream carried every token
    assert steps[-1][1].all()
    return a


def test_seeded_sampling_and_stop_reference():
    seeded_runs("reference")


def test_generator_plans_no_training_state():
    """Generation holds the parameters, the KV cache and its decode buffers: no gradients, Adam
    state, training activations or batch tokens (a GPT-2 124M generator would carry 1.5 GB of
    them), and the parameters it runs on are the model's."""
    eng = tiny_engine("reference", S=2, T=8)
    model = model_of(eng)
    gen = Generator(model, 5, 7, "reference")
    plan = gen.plan
    assert plan.regions == ("params",) and plan.flat_bytes == plan.region_bytes
    assert {e.kind for e in plan.entries} <= {"state", "activation", "workspace"}
    assert not {"res", "ln1", "dres", "dfc", "idx", "targets", "history"} & {e.name for e in plan.entries}
    assert plan["kcache"].shape[1] == 5 and plan["state"].dtype == "i32"
    assert "gradients" not in plan.format() and "adam" not in plan.format()
    assert plan.total_bytes < eng.plan.total_bytes
    got = gen.be.download(gen.d["kcache"])
    assert np.isnan(got).all()                         # poisoned until the first step writes it
    assert gen.bufs.flat_grads is None and gen.bufs.flat_m is None and gen.bufs.flat_v is None
    held = unflatten(param_table(gen.cfg, model.named["wte"].shape[0]), gen.be.download(gen.bufs.flat_params))
    assert set(held) == set(model.named)
    for k, v in model.named.items():                   # the parameters the decode step runs on
        assert np.array_equal(held[k], v), k


def test_steps_needed_matches_stream():
    eng = tiny_engine("reference", S=2, T=8)
    gen = Generator(model_of(eng), 2, 13, "reference")
    prompts = [np.array([1]), np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])]
    steps = list(gen.stream(prompts, temp=0.0))
    assert len(steps) == steps_needed([1, 8], 13, 8)
    assert [len(t) for t in gen.drawn()] == [13, 13]


def test_prompt_checks():
    eng = tiny_engine("reference", S=2)
    gen = Generator(model_of(eng), 2, 3, "reference")
    with pytest.raises(ValueError, match="empty"):
        gen.generate([np.array([1]), np.array([], np.int64)])
    with pytest.raises(ValueError, match="outside"):
        gen.generate([np.array([1]), np.array([V])])
    with pytest.raises(ValueError, match="2 sequences"):
        gen.generate([np.array([1])])


# ---- the draw (reference/ops.py draw_token, mirrored by kernels/decode.cu) ---------------------

def test_draw_greedy_and_degenerate_filters():
    r = np.random.default_rng(3)
    for i in range(20):
        row = r.normal(0, 2, 50).astype(np.float32)
        row[7] = row[31] = row.max() + 1                     # a tie: the lowest index wins
        assert draw_token(row, 50, 0.0, 0, 1.0, 1, i, 0) == 7
        assert draw_token(row, 40, 1.0, 1, 1.0, 1, i, 0) in (7, 31)      # top_k 1 keeps the tie
        assert draw_token(row, 50, 1.0, 0, 1e-6, 1, i, 0) in (7, 31)     # top_p ~0: the most likely
        assert draw_token(row, 20, 1.0, 0, 1.0, 1, i, 0) < 20            # only the real vocabulary


def test_draw_distribution():
    """Frequencies over many draws match softmax(logits / temp) restricted by top_k / top_p."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0], np.float32)
    n = 20000

    def freq(inv_temp, top_k, top_p):
        draws = [draw_token(logits, 6, inv_temp, top_k, top_p, 5, i, 0) for i in range(n)]
        return np.bincount(draws, minlength=6) / n

    def expect(inv_temp, keep):
        p = np.exp((logits - logits.max()) * inv_temp) * keep
        return p / p.sum()

    cases = [(1.0, 0, 1.0, np.ones(6)),
             (0.5, 0, 1.0, np.ones(6)),
             (1.0, 3, 1.0, np.array([1, 1, 0, 0, 0, 1])),
             # p = 0.8: token 5 (0.63) alone is short of it, with token 0 (0.23) it is reached
             (1.0, 0, 0.8, np.array([1, 0, 0, 0, 0, 1]))]
    for inv_temp, k, p, keep in cases:
        f, e = freq(inv_temp, k, p), expect(inv_temp, keep)
        assert np.all(np.abs(f - e) <= 4 * np.sqrt(e * (1 - e) / n) + 1e-12), (inv_temp, k, p, f, e)


def test_gen_opts_round_trip():
    w = pack_gen_opts(2 ** 32 - 1, 40, 0.8, 0.95, 500, 3)
    o = unpack_gen_opts(w)
    assert o["seed"] == 2 ** 32 - 1 and o["top_k"] == 40 and o["max_new"] == 500 and o["n_stop"] == 3
    assert o["inv_temp"] == np.float32(1 / 0.8) and o["top_p"] == np.float32(0.95)
    assert unpack_gen_opts(pack_gen_opts(0, 0, 0.0, 1.0, 1, 0))["inv_temp"] == 0.0
    assert rng.SITE_SAMPLE not in (rng.SITE_BATCH_TRAIN, rng.SITE_BATCH_VAL, rng.SITE_BATCH_EVAL_TRAIN)


def test_printer_streams_in_order():
    """sample.py's printer: sample 0 streams as its tokens come, sample 1 follows once 0 is done, and
    nothing is printed twice or lost (char tokenizer: one character a token)."""
    import io
    from gptcuda.generate.sampler import _Printer
    from gptcuda.data.tokenizers import CharTokenizer
    tok = CharTokenizer(list("abcdef"))
    buf = io.StringIO()
    pr = _Printer(tok, ["A:", "B:"], buf)
    steps = [([0, 3], [0, 0]), ([1, -1], [0, 0]), ([-1, 4], [0, 1]), ([2, -1], [1, 1])]
    seen = []
    for emit, done in steps:
        pr.step(emit, done)
        seen.append(buf.getvalue())
    pr.finish()
    assert seen[0] == "A:a" and seen[1] == "A:ab" and seen[2] == "A:ab"
    assert buf.getvalue() == "A:abc\n" + "-" * 40 + "\nB:de\n"


# ---- bf16 generation: its error model (the GPU tests in tests/gpu/test_decode_gpu.py use these) ----------
#
# What a bf16 generation rounds (kernels/decode.cu, memory.plan_decode dtype bf16), each to nearest bf16
# (8 significant bits: |fl(z) - z| <= U |z|, U = 2^-8, conftest.BF16_ROUNDING), and nothing else beyond
# fp32 arithmetic:
#   the weights the products read (the working copy: attn, proj, fc, fcproj, and wte as the head): a
#     fixed change of the model, taken exactly: the reference is the float64 forward on the weights as
#     rounded ("ref_w"; "ref" on the fp32 weights);
#   the activations the products multiply (the layernorm outputs h, the attention output y, the GELU's
#     pre-activation, which the GELU reads as stored, and its output) and the cached keys and values:
#     z -> z (1 + d), |d| <= U, one rounding of each element.
# The logits' error from the activations' roundings is, to first order, sum_i J_i z_i d_i (J_i: the
# logit's derivative by the rounded element i at the reference point, by reverse mode below). The
# standard probabilistic model of rounding errors: the d_i independent, of mean zero, the absolute error
# of each rounding uniform over its half-ulp interval, so that Var(z_i d_i) <= U^2 z_i^2 / 3. The sum of
# these many small independent terms has the standard deviation
#     sigma <= U / sqrt(3) * sqrt(sum_i (J_i z_i)^2),
# and the tolerance is LAMBDA = 6 of them (a normal sum leaves it with probability 2e-9). The fp32
# arithmetic (sums, softmax, layernorm statistics, the residual stream) adds what the fp32 decode's own
# test allows, FP32_SHARE max|logits| (test_decode_matches_full_forward_gpu). A logit's tolerance:
#     |bf16 logit - ref_w| <= LAMBDA sigma + FP32_SHARE max|ref|.
# Terms of second order in U are left out. bf16_error_model gives ref, ref_w and sigma (checked against a
# Monte Carlo of the model: test_bf16_error_model_sigma_matches_sampling);
# test_bf16_error_model_holds_for_an_emulation checks the tolerance against a numpy computation that
# rounds as the model says, and that the same computation with 4 bits less (errors 16x) breaks it.

U_BF16 = 2.0 ** -8
LAMBDA = 6.0
FP32_SHARE = 1e-5


def _forward(P: dict, cfg, tok, at=lambda z: z):
    """The float64 forward over the window tok (positions 0..n-1) on the weights P (the head: P["head"],
    else the embedding wte), keeping what the backward of the last position reads; at(z): what each
    element the bf16 model rounds becomes (a Monte Carlo of the model perturbs them)."""
    from gptcuda.ops.reference.ops import gelu_forward
    C, H, L = cfg.n_embd, cfg.n_head, cfg.n_layer
    n, hs = tok.size, C // H

    def layernorm(x, w, b):
        mu = x.mean(-1, keepdims=True)
        r = 1.0 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        nrm = (x - mu) * r
        return nrm * w + (0.0 if b is None else b), (nrm, r, w)

    lin = lambda a, w, b: a @ w.T + (0.0 if b is None else b)             # noqa: E731
    x = P["wte"][tok] + P["wpe"][:n]
    causal = np.tril(np.ones((n, n), bool))
    keep = []
    for l in range(L):
        p = f"h{l}."
        h1, ln1 = layernorm(x, P[p + "ln1.w"], P.get(p + "ln1.b"))
        h1 = at(h1)
        qkv = lin(h1, P[p + "attn.w"], P.get(p + "attn.b"))
        q, k, v = (qkv[:, i * C:(i + 1) * C].reshape(n, H, hs).transpose(1, 0, 2) for i in range(3))
        k, v = at(k), at(v)
        s = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(hs), -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        y = at((pr @ v).transpose(1, 0, 2).reshape(n, C))
        x = x + lin(y, P[p + "proj.w"], P.get(p + "proj.b"))
        h2, ln2 = layernorm(x, P[p + "ln2.w"], P.get(p + "ln2.b"))
        h2 = at(h2)
        pre = at(lin(h2, P[p + "fc.w"], P.get(p + "fc.b")))
        act = at(gelu_forward(pre))
        x = x + lin(act, P[p + "fcproj.w"], P.get(p + "fcproj.b"))
        keep.append(dict(h1=h1, ln1=ln1, q=q, k=k, v=v, pr=pr, y=y, h2=h2, ln2=ln2, pre=pre, act=act))
    hf, lnf = layernorm(x, P["lnf.w"], P.get("lnf.b"))
    hf = at(hf)
    return hf @ P.get("head", P["wte"]).T, keep, (hf, lnf)


def _ln_back(g, ln):
    """Cotangents of a layernorm's input from its output's (g [B, n, C])."""
    nrm, r, w = ln
    gn = g * w
    return r * (gn - gn.mean(-1, keepdims=True) - nrm * (gn * nrm).mean(-1, keepdims=True))


def bf16_weights(P: dict) -> dict:
    """The float64 weights a bf16 generation's products read: the matrices as the working copy holds
    them, and the head ("head": wte rounded); the embedding reads the fp32 wte, the rest is fp32."""
    from gptcuda.runtime import bf16 as B
    rounded = lambda w: B.round_f32(w).astype(np.float64)                 # noqa: E731
    mats = {k: rounded(v) for k, v in P.items() if k.endswith((".attn.w", ".proj.w", ".fc.w", ".fcproj.w"))}
    return dict(P, head=rounded(P["wte"]), **mats)


def bf16_error_model(named: dict, cfg, tokens):
    """For the last position of the window `tokens` (positions 0..n-1, n <= block_size): (ref [V], ref_w
    [V], sigma [V]) of the error model above, from the weights as a generator uploads them (fp32)."""
    from gptcuda.ops.reference.ops import gelu_backward
    P = {k: np.asarray(v, np.float64) for k, v in named.items()}
    Pw = bf16_weights(P)
    tok = np.asarray(tokens, np.int64)
    ref = _forward(P, cfg, tok)[0][-1]
    logits, keep, (hf, lnf) = _forward(Pw, cfg, tok)
    C, H, L = cfg.n_embd, cfg.n_head, cfg.n_layer
    n, hs, Vp = tok.size, C // H, Pw["head"].shape[0]
    heads = lambda z: z.reshape(Vp, n, H, hs).transpose(0, 2, 1, 3)          # noqa: E731
    mm = lambda g, w: (g.reshape(-1, g.shape[-1]) @ w).reshape(Vp, n, w.shape[-1])   # noqa: E731
    var = np.zeros(Vp)

    def site(g, z):                 # a rounded element's share: (J z)^2, for each of the V logits
        var[:] += ((g * z) ** 2).reshape(Vp, -1).sum(-1)

    g = np.zeros((Vp, n, C))
    g[:, -1] = Pw["head"]           # d logit_v / d hf[n-1] = wte[v] (rounded)
    site(g, hf)
    g = _ln_back(g, lnf)
    for l in reversed(range(L)):
        p, kp = f"h{l}.", keep[l]
        ga = mm(g, Pw[p + "fcproj.w"])
        site(ga, kp["act"])
        gp = ga * gelu_backward(np.ones_like(kp["pre"]), kp["pre"])
        site(gp, kp["pre"])
        gh = mm(gp, Pw[p + "fc.w"])
        site(gh, kp["h2"])
        g = g + _ln_back(gh, kp["ln2"])
        gy = mm(g, Pw[p + "proj.w"])
        site(gy, kp["y"])
        gy, pr, q, k, v = heads(gy), kp["pr"], kp["q"], kp["k"], kp["v"]
        gv = pr.transpose(0, 2, 1) @ gy                                      # sum_i p_ij gy_i
        gpr = gy @ np.ascontiguousarray(v.transpose(0, 2, 1))                # gy_i . v_j
        gs = pr * (gpr - (gpr * pr).sum(-1, keepdims=True)) / np.sqrt(hs)
        gq, gk = gs @ k, gs.transpose(0, 1, 3, 2) @ q
        site(gk, k)                 # the cached keys and values (q is not rounded)
        site(gv, v)
        gqkv = np.concatenate([z.transpose(0, 2, 1, 3).reshape(Vp, n, C) for z in (gq, gk, gv)], -1)
        gh = mm(gqkv, Pw[p + "attn.w"])
        site(gh, kp["h1"])
        g = g + _ln_back(gh, kp["ln1"])
    return ref, logits[-1], U_BF16 / np.sqrt(3.0) * np.sqrt(var)


def bf16_tolerance(ref, sigma):
    """The error model's tolerance of each logit about ref_w (above)."""
    return LAMBDA * sigma + FP32_SHARE * np.max(np.abs(ref))


def _round_bits(z, bits: int):
    """z rounded to nearest (ties to even) with `bits` significant bits (8: bf16's, without its range)."""
    m, e = np.frexp(np.asarray(z, np.float64))
    return np.ldexp(np.round(m * 2.0 ** bits) / 2.0 ** bits, e).astype(np.float32)


def bf16_emulated_forward(named: dict, cfg, tokens, bits: int = 8) -> np.ndarray:
    """The logits [n, V] of a computation that rounds as the bf16 error model says (to nearest bf16, or to
    `bits` significant bits), everything else in float32 (numpy's, its sums in other orders than the
    kernels'): what the model must hold for."""
    from gptcuda.runtime import bf16 as B
    f = np.float32
    P = {k: np.asarray(v, f) for k, v in named.items()}
    r16 = (lambda z: B.round_f32(z)) if bits == 8 else (lambda z: _round_bits(z, bits))    # noqa: E731
    C, H, L = cfg.n_embd, cfg.n_head, cfg.n_layer
    hs = C // H
    tok = np.asarray(tokens, np.int64)
    n = tok.size

    def layernorm(x, w, b):
        mu = x.mean(-1, keepdims=True, dtype=f)
        d = x - mu
        r = f(1) / np.sqrt((d * d).mean(-1, keepdims=True, dtype=f) + f(1e-5))
        return r16(d * r * w + (f(0) if b is None else b))

    def product(a, w, b):
        out = a @ r16(w).T
        return out if b is None else out + b

    def gelu(z):                    # gemm_gelu's form (exp -> inf: 0, as expf)
        with np.errstate(over="ignore"):
            return z / (f(1) + np.exp(f(-2) * (f(0.7978845608028654) * (z + f(0.044715) * z * z * z))))

    x = P["wte"][tok] + P["wpe"][:n]
    causal = np.tril(np.ones((n, n), bool))
    for l in range(L):
        p = f"h{l}."
        h = layernorm(x, P[p + "ln1.w"], P.get(p + "ln1.b"))
        qkv = product(h, P[p + "attn.w"], P.get(p + "attn.b"))
        q, k, v = (qkv[:, i * C:(i + 1) * C].reshape(n, H, hs).transpose(1, 0, 2) for i in range(3))
        k, v = r16(k), r16(v)
        s = np.where(causal, (q * f(1 / np.sqrt(hs))) @ k.transpose(0, 2, 1), f(-np.inf))
        e = np.exp(s - s.max(-1, keepdims=True))
        y = r16((e @ v) / e.sum(-1, keepdims=True)).transpose(1, 0, 2).reshape(n, C)
        x = x + product(y, P[p + "proj.w"], P.get(p + "proj.b"))
        h = layernorm(x, P[p + "ln2.w"], P.get(p + "ln2.b"))
        act = r16(gelu(r16(product(h, P[p + "fc.w"], P.get(p + "fc.b")))))
        x = x + product(act, P[p + "fcproj.w"], P.get(p + "fcproj.b"))
    return product(layernorm(x, P["lnf.w"], P.get("lnf.b")), P["wte"], None).astype(np.float64)


def tiny_model(T=16, seed=0, **over) -> Model:
    """configs/tiny.yaml at block_size T (V = 65): nanoGPT's initialisation plus N(0, 0.3) on every
    parameter (as tiny_engine), as the fp32 values a generator uploads; no engine, no device."""
    from gptcuda.model.params import init_params
    cfg = load_config("configs/tiny.yaml", [f"--block_size={T}", "--max_iters=0"]
                      + [f"--{k}={v}" for k, v in over.items()])
    table = param_table(cfg, V)
    r = np.random.default_rng(seed)
    named = {k: (v + r.normal(0, 0.3, v.shape)).astype(np.float32)
             for k, v in unflatten(table, init_params(table, cfg, cfg.seed)).items()}
    return Model(cfg, None, named, V, "test")


def test_bf16_error_model_reference_is_the_forward():
    """ref, the error model's reference, is the reference backend's full forward on the same weights, at
    every position; ref_w differs from it by the weights' rounding alone (exactly 0 without it)."""
    eng = tiny_engine("reference", S=2)
    named = {k: v.astype(np.float32) for k, v in eng.params().items()}
    eng.set_params(named)
    r = np.random.default_rng(4)
    x = r.integers(0, V, (2, 16)).astype(np.int32)
    eng.set_batch(x, x)
    eng.run("forward")
    full = np.asarray(eng.be.download(eng.bufs.acts["logits"]), np.float64)
    for s in range(2):
        for t in (0, 7, 15):
            ref, ref_w, sigma = bf16_error_model(named, eng.cfg, x[s, :t + 1])
            assert np.max(np.abs(ref - full[s, t])) <= 1e-10 * np.max(np.abs(full[s, t]))
            assert 0 < np.max(np.abs(ref_w - ref)) < 0.05 * np.max(np.abs(ref))
            assert (sigma > 0).all() and np.max(sigma) < 0.02 * np.max(np.abs(ref))
    ident = {k: np.asarray(bf16.round_f32(v), np.float32) for k, v in named.items()}
    ref, ref_w, _ = bf16_error_model(ident, eng.cfg, x[0])
    assert np.array_equal(ref, ref_w)                   # weights exact in bf16: nothing to round


def test_bf16_error_model_sigma_matches_sampling():
    """sigma, from the reverse-mode derivatives, is the standard deviation of the logits when every element
    the model rounds is multiplied by 1 + d, d uniform in [-U, U] (a Monte Carlo of the model in float64):
    within the sampling error of 300 draws (about 4% of sigma a logit; the median of the 65 logits' ratios
    within 5%, each within 3.5 of those 4%). A site left out of the derivatives, or sigma off by sqrt(3),
    would move the median by far more."""
    m = tiny_model()
    tok = np.random.default_rng(1).integers(0, V, 12)
    _, ref_w, sigma = bf16_error_model(m.named, m.cfg, tok)
    P = bf16_weights({k: np.asarray(v, np.float64) for k, v in m.named.items()})
    r = np.random.default_rng(5)
    draws = np.array([_forward(P, m.cfg, tok, lambda z: z * (1 + r.uniform(-U_BF16, U_BF16, z.shape)))[0][-1]
                      for _ in range(300)])
    ratio = np.sqrt(np.mean((draws - ref_w) ** 2, axis=0)) / sigma
    assert 0.95 < np.median(ratio) < 1.05 and 0.86 < ratio.min() and ratio.max() < 1.14, \
        (np.median(ratio), ratio.min(), ratio.max())


def test_bf16_error_model_holds_for_an_emulation():
    """A float32 computation that rounds as the model says (to nearest bf16 at each of its places) stays
    within the tolerance at every logit of every position; the same computation rounding to 6 significant
    bits (errors 4x) does not: the tolerance is no looser than the model makes it."""
    m = tiny_model()
    r = np.random.default_rng(6)
    worst, coarse = 0.0, 0
    for _ in range(2):
        x = r.integers(0, V, 16)
        em8, em6 = bf16_emulated_forward(m.named, m.cfg, x), bf16_emulated_forward(m.named, m.cfg, x, bits=6)
        for t in range(16):
            ref, ref_w, sigma = bf16_error_model(m.named, m.cfg, x[:t + 1])
            tol = bf16_tolerance(ref, sigma)
            worst = max(worst, float(np.max(np.abs(em8[t] - ref_w) / tol)))
            coarse += int(np.sum(np.abs(em6[t] - ref_w) > tol))
    assert worst < 1.0, worst                   # (0.38 when written)
    assert coarse > 100, coarse                 # of 2080 logits (about 300 when written)


def _record_gen(monkeypatch, S, precision="bf16", arch="sm_90", model=None, max_new=5):
    """A Generator on the fake device (tests/fakes.py): its launches recorded, none run."""
    from gptcuda.generate import sampler
    from gptcuda.ops.cuda_backend import CudaBackend
    from tests.fakes import RecordingRuntime
    made = []

    def backend_class(cfg):
        def make(c):
            be = CudaBackend(c, rt=RecordingRuntime(c, arch=arch))
            made.append(be)
            return be
        return make
    monkeypatch.setattr(sampler, "backend_class", backend_class)
    model = model or tiny_model(16, backend="cuda")
    return Generator(model, S, max_new, "cuda", precision)


@pytest.mark.parametrize("S", [3, 20])
def test_record_bf16_decode_step(monkeypatch, S):
    """precision bf16: the working copy made once from the loaded weights (one to_bf16, before the step and
    not in it), the step's products reading it with bf16 operands (decode_linear DT 1 up to 16 rows, the bf16
    GEMM beyond), into fp32 qkv, residual stream and logits and a bf16 GELU output; the attention over a
    bf16 cache into a bf16 y; the embedding, layernorm parameters and biases fp32."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from gptcuda.runtime import Launch
    gen = _record_gen(monkeypatch, S)
    d, rt, table = gen.d, gen.be.rt, param_table(gen.cfg, V)
    assert {n: d[n].dtype for n in ("h", "y", "fc_pre", "fc_act", "kcache", "vcache", "params_bf16")} == \
        dict.fromkeys(("h", "y", "fc_pre", "fc_act", "kcache", "vcache", "params_bf16"), "bf16")
    assert {d[n].dtype for n in ("x", "qkv", "logits", "attn_part", "h_mean")} == {"f32"}
    assert d["params_bf16"].numel == table.total
    copies = [r for r in rt.launched if isinstance(r, Launch)]
    assert [r.fn.name.split("<")[0] for r in copies] == ["to_bf16"]
    assert copies[0].slots[0] == d["params_bf16"].ptr and copies[0].slots[1] == gen.bufs.flat_params.ptr
    items = [r for r in gen.program.items if isinstance(r, Launch)]
    names = [r.fn.name for r in items]
    assert not any(n.startswith("to_bf16") for n in names)
    work = (d["params_bf16"].ptr, d["params_bf16"].ptr + d["params_bf16"].nbytes)
    flat = (gen.bufs.flat_params.ptr, gen.bufs.flat_params.ptr + gen.bufs.flat_params.nbytes)
    inside = lambda p, r: r[0] <= int(p) < r[1]                              # noqa: E731
    L = gen.cfg.n_layer
    if S <= 16:
        lin = [r for r in items if r.fn.name.startswith("decode_linear")]
        assert len(lin) == 4 * L + 1
        outs = [r.fn.name.rsplit(",", 2)[1:] for r in lin]                    # DT, OUT
        assert outs == ([[" 1", " 0>"], [" 1", " 0>"], [" 1", " 1>"], [" 1", " 0>"]] * L + [[" 1", " 0>"]])
        assert all(inside(r.slots[3], work) for r in lin)                    # w: the working copy
        assert all(r.slots[4] == 0 or inside(r.slots[4], flat) for r in lin)   # the bias: fp32
    else:
        gemms = [n for n in names if n.startswith("gemm")]
        assert len(gemms) == 4 * L + 1 and all(n.startswith(("gemm_wgmma_ws<", "gemm_wgmma_pp<")) for n in gemms)
        assert [n.rsplit(",", 4)[1:] for n in gemms[:4]] == [["1", "false", "false", "0>"]] * 2 + \
            [["1", "false", "false", "1>"], ["1", "false", "false", "0>"]]
    att = [n for n in names if n.startswith("decode_attention")]
    assert len(att) == 2 * L and all(n.endswith(",1>") for n in att)
    emb = next(r for r in items if r.fn.name.startswith("decode_embed"))
    assert inside(emb.slots[2], flat) and inside(emb.slots[3], flat)        # wte, wpe: fp32
    ln = [r for r in items if r.fn.name.startswith("layernorm_fwd")]
    assert len(ln) == 2 * L + 1 and all(r.slots[0] == d["h"].ptr for r in ln)


def test_record_fp32_decode_step_reads_the_parameters(monkeypatch):
    """fp32 (and tf32): no working copy, no to_bf16, the products read the fp32 parameters, every decode
    kernel its fp32 variant (type codes 0)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from gptcuda.runtime import Launch
    for precision in ("fp32", "tf32"):
        gen = _record_gen(monkeypatch, 3, precision)
        assert "params_bf16" not in gen.d and not gen.be.rt.launched
        assert {e.dtype for e in gen.plan.entries} <= {"f32", "i32"}
        items = [r for r in gen.program.items if isinstance(r, Launch)]
        flat = (gen.bufs.flat_params.ptr, gen.bufs.flat_params.ptr + gen.bufs.flat_params.nbytes)
        lin = [r for r in items if r.fn.name.startswith("decode_linear")]
        assert lin and all(r.fn.name.endswith(", 0, 0>") and flat[0] <= int(r.slots[3]) < flat[1] for r in lin)
        assert all(n.endswith(",0>") for n in (r.fn.name for r in items) if n.startswith("decode_attention"))


def test_bf16_generation_refusals(monkeypatch):
    """One clear error, before any device memory, for what the bf16 kernels cannot take: a width that is
    not a multiple of 8, a device without the sm_90 kernels; an unknown precision."""
    from gptcuda.errors import UsageError
    odd = tiny_model(16, n_embd=36, n_head=3)
    with pytest.raises(UsageError, match="n_embd a multiple of 8.*36"):
        Generator(odd, 2, 3, "cuda", "bf16")
    with pytest.raises(UsageError, match="precision bf16: .*sm_90"):
        _record_gen(monkeypatch, 2, "bf16", arch="sm_80")
    with pytest.raises(UsageError, match="precision must be"):
        Generator(tiny_model(16), 2, 3, "reference", "fp16")


def test_bf16_generation_on_the_reference_backend():
    """--backend reference runs every precision in float64: bf16 plans no bf16 buffer and draws what fp32
    draws."""
    m = tiny_model(16)
    prompts = [np.array([1, 2, 3]), np.array([4])]
    a = Generator(m, 2, 6, "reference", "bf16")
    assert "params_bf16" not in a.d and {e.dtype for e in a.plan.entries} <= {"f32", "i32"}
    got = a.generate(prompts, temp=0.0)
    want = Generator(m, 2, 6, "reference", "fp32").generate(prompts, temp=0.0)
    assert all(np.array_equal(x, y) for x, y in zip(got, want))


def test_bf16_decode_plan():
    """plan_decode dtype bf16: the products' operands (h, y, the GELU's pre-activation and output), the KV
    cache and the working copy in bf16 at half the bytes; the rest as in fp32."""
    m = tiny_model(16)
    table = param_table(m.cfg, V)
    f32, b16 = plan_decode(m.cfg, table, V, 3, 10), plan_decode(m.cfg, table, V, 3, 10, dtype="bf16")
    for e in f32.entries:
        got = b16[e.name]
        if e.name in ("h", "y", "fc_pre", "fc_act", "kcache", "vcache"):
            assert got.dtype == "bf16" and 2 * got.nbytes == e.nbytes
        else:
            assert (got.dtype, got.shape) == (e.dtype, e.shape)
    assert b16["params_bf16"].dtype == "bf16" and b16["params_bf16"].numel == table.total
    assert b16.flat_bytes == f32.flat_bytes
    with pytest.raises(ValueError, match="dtype"):
        plan_decode(m.cfg, table, V, 3, 10, dtype="f16")


def test_sample_options_take_bf16():
    from gptcuda.errors import UsageError
    from gptcuda.generate.sampler import parse_options
    assert parse_options({"precision": "bf16"})["precision"] == "bf16"
    with pytest.raises(UsageError, match="--precision must be fp32, tf32 or bf16, got 'fp16'"):
        parse_options({"precision": "fp16"})
