"""Generation with the KV cache equals the full causal forward (reference backend; the GPU
version lives in tests/gpu/test_decode_gpu.py)."""
import numpy as np

from gptcuda.config import load_config
from gptcuda.engine import Engine
from gptcuda.memory import plan_decode
from gptcuda.sampler import sample_logits


def decode_vs_forward(backend, atol):
    cfg = load_config("configs/tiny.yaml", [f"--backend={backend}", "--batch_size=3", "--max_iters=0"])
    toks = (np.arange(2000) * 7 % 65).astype(np.int32)
    eng = Engine(cfg, toks, toks[:300], 65, programs=("forward",))
    rng = np.random.default_rng(0)
    p = eng.params()
    eng.set_params({k: v + rng.normal(0, 0.05, v.shape) for k, v in p.items()})   # not the symmetric init
    S, T = cfg.batch_size, cfg.block_size
    x = rng.integers(0, 65, (S, T)).astype(np.int32)
    eng.set_batch(x, x)
    eng.run("forward")
    full = np.asarray(eng.be.download(eng.bufs.acts["logits"]), np.float64)       # [S,T,V]
    d = eng.be.allocate_arena(plan_decode(eng.cfg, eng.table, 65, S))
    eng.be.begin("decode")
    eng.model.record_decode_step(d)
    prog = eng.be.end()
    eng.be.upload(d["pos"], np.zeros(1, np.int32))
    for t in range(T):
        eng.be.upload(d["tok"], x[:, t])
        eng.be.run(prog)
        step = np.asarray(eng.be.download(d["logits"]), np.float64)
        assert np.max(np.abs(step - full[:, t])) <= atol * np.max(np.abs(full[:, t])), t
    assert int(np.asarray(eng.be.download(d["pos"]))[0]) == T


def test_decode_matches_full_forward_reference():
    decode_vs_forward("reference", 1e-12)


def test_sample_logits():
    rng = np.random.default_rng(0)
    logits = np.array([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    assert sample_logits(logits, 0.0, None, rng).tolist() == [1, 0]
    draws = np.array([sample_logits(logits, 1.0, 1, rng) for _ in range(50)])
    assert np.all(draws == [1, 0])                       # top_k 1 is greedy
    draws = np.array([sample_logits(logits, 100.0, None, rng) for _ in range(300)])
    assert len(set(draws[:, 0].tolist())) == 3           # high temperature spreads
