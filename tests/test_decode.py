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


def seeded_runs(backend):
    """Sampling repeats bit for bit with its seed, changes with it, and stops at the stop sequence."""
    eng = tiny_engine(backend)
    S = eng.cfg.batch_size
    prompts = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6, 7, 8, 9])]
    gen = Generator(model_of(eng), S, 25, backend)
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
